"""The counterexample picture: the SVG timeline and report.html, read back in a real browser.

The browser test needs Debian's Chromium and the playwright Python package (driven at that
executable; nothing is downloaded).  ``.ci/run`` installs both; elsewhere it skips, naming
``apt-get install chromium`` and ``pip install -e '.[browser]'``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from kvspec.reference.broken import BROKEN
from kvspec.spec.config import Config
from kvspec.testing.driver import TraceStep
from kvspec.testing.timeline import film, offending_cells, report_html, timeline_svg

CONFIG = Config(block_size=4, num_blocks=8)
TRACE = [
    TraceStep("admit", {"seq": 0, "tokens": [1, 2, 3, 4, 5], "num_new_tokens": 5, "next_token": 6}),
    TraceStep("fork", {"parent": 0, "child": 1}),
]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _film():
    return film(BROKEN["fork-without-incref"].cls(CONFIG), TRACE)


def _report(f) -> dict:
    return {
        "impl": "broken:fork-without-incref",
        "outcome": "violated",
        "config": {"block_size": 4, "num_blocks": 8},
        "violations": [{"invariant": v.invariant, "message": v.message} for v in f.violations],
        "trace_text": [f"{i}. {s.describe()}" for i, s in enumerate(TRACE, 1)],
        "reproducer": {"path": None, "reason": "not a vLLM target"},
        "command": ["kvspec", "check", "--impl", "broken:fork-without-incref"],
    }


def test_the_film_stops_at_the_violation_and_names_its_cells():
    f = _film()
    assert [v.invariant for v in f.violations] == ["refcount-exact", "refcount-exact"]
    assert len(f.frames) == 1 + len(TRACE)
    column, cells = offending_cells(f)
    assert column == 2
    assert cells == {(0, 0), (0, 1), (1, 0), (1, 1)}  # blocks 0 and 1, held by both sequences


def test_the_svg_has_one_cell_per_row_and_operation():
    svg = timeline_svg(_film(), CONFIG)
    assert svg.count('class="cell') == 2 * 2 * len(TRACE)  # 2 sequences x 2 slots x 2 operations
    assert svg.count('class="cell offending"') == 4


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no Chromium: `apt-get install chromium` (Debian) makes this browser test run")
    playwright = pytest.importorskip(
        "playwright.sync_api", reason="no playwright: `pip install -e '.[browser]'` makes this browser test run"
    )
    f = _film()
    path = Path(tmp_path_factory.mktemp("report")) / "report.html"
    path.write_text(report_html(_report(f), timeline_svg(f, CONFIG)))
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            tab = browser.new_page()
            tab.goto(path.as_uri())
            yield tab, f
        finally:
            browser.close()


def test_the_browser_shows_the_state_after_every_operation(page):
    tab, f = page
    cells = tab.eval_on_selector_all(
        "#timeline g.cell",
        """els => els.map(g => {
            const r = g.getBoundingClientRect();
            return {op: +g.dataset.op, seq: +g.dataset.seq, slot: +g.dataset.slot,
                    block: g.dataset.block, text: g.textContent.trim(), visible: r.width > 0 && r.height > 0,
                    offending: g.classList.contains('offending')};
        })""",
    )
    assert cells and all(c["visible"] for c in cells)
    for c in cells:
        _, slots = f.frames[c["op"]].tables.get(c["seq"], ("", ()))
        want = slots[c["slot"]] if c["slot"] < len(slots) else None
        assert c["block"] == ("" if want is None else str(want)), c
        if want is not None:
            assert c["text"].startswith(str(want)), c
    _, named = offending_cells(f)
    shown = {(c["seq"], c["slot"]) for c in cells if c["offending"]}
    assert shown == named


def test_the_page_lists_the_violation_and_the_trace(page):
    tab, _ = page
    found = tab.inner_text("#found")
    assert "[refcount-exact]" in found and "block 0" in found
    trace = tab.eval_on_selector_all("#trace li", "els => els.map(e => e.textContent)")
    assert len(trace) == len(TRACE) and trace[1].startswith("fork(")
