from kvspec.testing import profiles

PROFILE = profiles.load()


def pytest_report_header(config):
    return f"kvspec hypothesis profile: {PROFILE} (CI set -> 'ci'; else KVSPEC_PROFILE or 'dev')"


# ------------------------------------------------------------------ report.html in a browser
# Debian's Chromium driven by the playwright Python package at that executable (nothing is
# downloaded).  ``.ci/run`` installs both; elsewhere the browser tests skip, naming the command.

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

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

READ_PAGE = """() => {
    const all = (sel, f) => Array.from(document.querySelectorAll(sel)).map(f);
    const seen = g => { const r = g.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
    const verdict = document.querySelector('#timeline g.verdict');
    return {
        ops: all('#timeline g.op', g => ({op: +g.dataset.op, found: g.dataset.found, label: g.dataset.label,
                                          offending: g.classList.contains('offending'), visible: seen(g)})),
        cells: all('#timeline g.cell', g => ({op: +g.dataset.op, seq: +g.dataset.seq, slot: +g.dataset.slot,
                                              group: g.dataset.group,
                                              block: g.dataset.block, kind: g.dataset.kind,
                                              text: g.textContent.trim(), visible: seen(g),
                                              offending: g.classList.contains('offending')})),
        rows: all('#timeline text.row[data-seq]', t => ({seq: +t.dataset.seq, slot: +t.dataset.slot,
                                                          group: t.dataset.group, text: t.textContent})),
        pool: all('#timeline g.pool', g => ({op: +g.dataset.op, free: +g.dataset.free,
                                              evictable: +g.dataset.evictable, visible: seen(g)})),
        verdict: verdict && {op: +verdict.dataset.op, need: verdict.dataset.need, taken: verdict.dataset.taken,
                             pool_free: verdict.dataset.poolFree, visible: seen(verdict)},
        facts: all('#facts tr[data-fact]', r => ({violation: +r.dataset.violation, fact: r.dataset.fact,
                                                  value: r.dataset.value, visible: seen(r)})),
        found: all('#found li[data-invariant]', li => ({invariant: li.dataset.invariant, kind: li.dataset.kind})),
        trace: all('#trace li', li => li.textContent),
    };
}"""


@pytest.fixture(scope="session")
def browser():
    if CHROMIUM is None:
        pytest.skip("no Chromium: `apt-get install chromium` (Debian) makes this browser test run")
    playwright = pytest.importorskip(
        "playwright.sync_api", reason="no playwright: `pip install -e '.[browser]'` makes this browser test run"
    )
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def shown_report(browser):
    """Open a report.html in the browser and read back what it shows, checked against its
    report (the dict of report.json): every operation of the trace has a column, every
    sequence a violation names has a row (in the group it names), every fact of every violation is listed with its
    value, and an admission's pool, need and taken are drawn in the failing column."""

    def read(page: Path, report: dict) -> dict:
        tab = browser.new_page()
        try:
            tab.goto(Path(page).as_uri())
            shown = tab.evaluate(READ_PAGE)
        finally:
            tab.close()
        for f in shown["facts"]:  # parsed here, not by JavaScript: a block hash is wider than a double
            f["value"] = json.loads(f["value"])
        trace, found = report["trace"], report.get("violations") or []
        ops = [o["op"] for o in shown["ops"]]
        assert all(o["visible"] for o in shown["ops"]) and all(c["visible"] for c in shown["cells"])
        assert ops[: len(trace)] == list(range(1, len(trace) + 1)), ops  # every operation drawn
        assert len(ops) in (len(trace), len(trace) + 1), ops  # and "free all" when it showed there
        labels = [o["label"] for o in shown["ops"]]
        assert [x.split()[0] for x in labels[: len(trace)]] == [s["op"] for s in trace], labels
        assert labels[len(trace) :] in ([], ["free all"]), labels
        assert len(shown["trace"]) == len(trace)
        failing = ops[-1]
        assert [o["op"] for o in shown["ops"] if o["offending"]] == [failing]
        rows = {r["seq"] for r in shown["rows"]}
        named = {s for v in found for s in v.get("seqs", [])}
        assert named <= rows, (named, rows)
        lanes = {(r["group"], r["seq"]) for r in shown["rows"]}
        for v in found:
            if v.get("group"):
                assert {(v["group"], s) for s in v["seqs"]} <= lanes, (v, lanes)
                if report.get("machine") != "scheduler":  # one group: every row is the named one's
                    assert {r["group"] for r in shown["rows"] if r["seq"] in v["seqs"]} == {v["group"]}
        listed = {(f["violation"], f["fact"]): f["value"] for f in shown["facts"]}
        want = {(i, k): json.loads(json.dumps(val)) for i, v in enumerate(found) for k, val in v.items()
                if k not in ("invariant", "message")}
        assert listed == want
        assert [(f["invariant"], f["kind"]) for f in shown["found"]] == [
            (v["invariant"], v.get("kind", "")) for v in found
        ]
        assert [p["op"] for p in shown["pool"]] == ops and all(p["visible"] for p in shown["pool"])
        with_need = [v for v in found if "need" in v or "pool" in v or "taken" in v]
        if with_need:
            v = with_need[0]
            verdict = shown["verdict"]
            assert verdict is not None and verdict["visible"] and verdict["op"] == failing
            assert verdict["need"] == str(v.get("need", ""))
            assert verdict["taken"] == ",".join(map(str, v.get("taken", [])))
            if "pool" in v:
                assert verdict["pool_free"] == str(v["pool"]["free"])
                # The pool the failing operation met is the one the column before it shows.
                before = [p for p in shown["pool"] if p["op"] == failing - 1]
                assert not before or before[0]["free"] == v["pool"]["free"], (before, v["pool"])
        else:
            assert shown["verdict"] is None
        # What a violation names and the failing column draws is marked there.  A violation
        # naming no sequence or block drawn there (a hash collision seen as a request arrives,
        # a refcount left on a block no table holds any more) marks its column only.
        seqs = {s for v in found for s in v.get("seqs", [])}
        blocks = {str(b) for v in found for b in v.get("blocks", [])}
        drawn = [c for c in shown["cells"] if c["op"] == failing and (c["seq"] in seqs or c["block"] in blocks)]
        if drawn:
            assert any(c["offending"] for c in drawn), drawn
        return shown

    return read


def pytest_collection_modifyitems(config, items):
    """The real-target tests first (each runs a release's target suite in a subprocess, minutes
    long): started first, ``pytest -n 2 --dist worksteal`` spreads the rest around them instead
    of leaving one worker on a long test at the end."""
    items.sort(key=lambda item: item.get_closest_marker("target") is None)
