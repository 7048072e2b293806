"""The counterexample picture: the SVG timeline and report.html, read back in a real browser.

The browser tests need Debian's Chromium and the playwright Python package (driven at that
executable; nothing is downloaded; the ``browser`` and ``shown_report`` fixtures in
conftest.py).  ``.ci/run`` installs both; elsewhere they skip, naming ``apt-get install
chromium`` and ``pip install -e '.[browser]'``.  Each page is read back against its report on
reference broken variants: every operation of the trace, a row for every sequence the violation
names, and the facts behind the verdict (for an admission: the pool, the need, what the
allocation took).
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from kvspec.reference.broken import BROKEN
from kvspec.spec.config import Config
from kvspec.spec.violation import PoolFacts, Violation
from kvspec.testing.artifacts.report import build_report
from kvspec.testing.artifacts.timeline import (
    FREE_ALL,
    film,
    offending_cells,
    report_html,
    rows_of,
    timeline_svg,
    verdict_facts,
)
from kvspec.testing.blockmanager.driver import TraceStep, replay

CONFIG = Config(block_size=4, num_blocks=8)
TRACE = [
    TraceStep("admit", {"seq": 0, "tokens": [1, 2, 3, 4, 5], "num_new_tokens": 5, "next_token": 6}),
    TraceStep("fork", {"parent": 0, "child": 1}),
]
# The seed bug's shape on its broken variant: the check counts the window, admission takes the
# whole prompt, so seq 1 is answered OK and its allocation fails; it never gets a table.
ADMISSION_CONFIG = Config(block_size=2, num_blocks=5, sliding_window=4)
ADMISSION_TRACE = [
    TraceStep("admit", {"seq": 0, "tokens": [1, 2, 3], "num_new_tokens": 3, "next_token": 4}),
    TraceStep("step", {"seq": 0, "num_new_tokens": 1, "next_token": 5}),
    TraceStep("admit", {"seq": 1, "tokens": list(range(10, 19)), "num_new_tokens": 2, "next_token": 0}),
]
# A window one block too generous: window-bound breaks on every decode step past the window.
WINDOW_CONFIG = Config(block_size=2, num_blocks=8, sliding_window=2)
WINDOW_TRACE = [
    TraceStep("admit", {"seq": 0, "tokens": [1, 2, 3, 4, 5], "num_new_tokens": 5, "next_token": 6}),
    *(TraceStep("step", {"seq": 0, "num_new_tokens": 1, "next_token": 7 + i}) for i in range(4)),
]
CASES = {
    "fork-without-incref": (CONFIG, TRACE),
    "window-capped-admission": (ADMISSION_CONFIG, ADMISSION_TRACE),
}


def _film(variant: str = "fork-without-incref", violations=()):
    config, trace = CASES[variant]
    return film(BROKEN[variant].cls(config), trace, violations=violations)


def _report(variant: str, trace, violations) -> dict:
    config = CASES[variant][0]
    return build_report(
        outcome="violated", impl=f"broken:{variant}", implementation_name=variant, target={}, config=config,
        run={}, trace=trace, violations=violations, reproducer={"path": None, "reason": "not a vLLM target"},
        command=["kvspec", "check", "--impl", f"broken:{variant}"],
    )


def test_the_film_stops_at_the_violation_and_names_its_cells():
    f = _film()
    assert [v.invariant for v in f.violations] == ["refcount-exact", "refcount-exact"]
    assert len(f.frames) == 1 + len(TRACE)
    column, cells = offending_cells(f)
    assert column == 2
    assert cells == {("", 0, 0), ("", 0, 1), ("", 1, 0), ("", 1, 1)}  # blocks 0 and 1, held by both sequences


def test_the_svg_has_one_cell_per_row_and_operation():
    svg = timeline_svg(_film(), CONFIG.describe())
    assert svg.count('class="cell') == 2 * 2 * len(TRACE)  # 2 sequences x 2 slots x 2 operations
    assert svg.count('class="cell offending"') == 4
    assert svg.count('class="pool"') == len(TRACE)


def test_the_film_draws_every_operation_past_other_violations():
    """The replay goes on past a violation it meets before the reported one (a run that
    stepped past a known finding, or watched other invariants), marking it in its column."""
    trace, config = WINDOW_TRACE, WINDOW_CONFIG
    found, driver = replay(BROKEN["off-by-one-window"].cls(config), trace[:3])
    assert [v.invariant for v in found] == ["window-bound"] and len(driver.trace) == 3  # met at op 3
    reported = Violation("kv-readback", "shown at the last operation", kind="no-slot", seqs=(0,), positions=(5,))
    f = film(BROKEN["off-by-one-window"].cls(config), trace, violations=[reported])
    assert [fr.index for fr in f.frames] == list(range(len(trace) + 2))  # start, every op, free all
    assert "window-bound" in f.frames[3].found
    assert f.failing == len(trace) + 1 and f.violations == (reported,)


def test_a_named_sequence_without_a_table_gets_a_row_and_the_admission_its_facts():
    f = _film("window-capped-admission")
    (v,) = f.violations
    assert (v.invariant, v.kind, v.seqs) == ("admission-soundness", "ok-then-failed", (1,))
    assert v.pool == PoolFacts(free=3, evictable=0, num_blocks=5) and v.need == 1
    assert all(("", 1) not in fr.tables for fr in f.frames)  # seq 1 never holds a table
    assert ("", 1, 0) in rows_of(f) and offending_cells(f) == (3, {("", 1, 0)})
    assert verdict_facts(f) == {"pool": v.pool, "need": 1}
    svg = timeline_svg(f, ADMISSION_CONFIG.describe())
    assert 'class="verdict"' in svg and 'data-need="1"' in svg and 'data-kind="missing"' in svg


def test_a_group_the_violation_names_labels_its_rows():
    f = _film()
    grouped = tuple(Violation(v.invariant, v.message, kind=v.kind, seqs=(0, 1), group="swa") for v in f.violations)
    svg = timeline_svg(film(BROKEN["fork-without-incref"].cls(CONFIG), TRACE, violations=grouped), CONFIG.describe())
    assert svg.count('class="row" data-seq') == 4 and svg.count('data-group="swa"') == 4 + 4 * len(TRACE)
    assert "swa s1[1]" in svg


@pytest.mark.parametrize("variant", sorted(CASES))
def test_the_browser_shows_every_operation_row_and_fact(variant, shown_report, tmp_path):
    f = _film(variant)
    config, trace = CASES[variant]
    report = _report(variant, trace, f.violations)
    page = tmp_path / "report.html"
    page.write_text(report_html(report, timeline_svg(f, config.describe())))
    shown = shown_report(page, report)
    for c in shown["cells"]:
        _, slots = f.frames[c["op"]].tables.get(("", c["seq"]), ("", ()))
        want = slots[c["slot"]] if c["slot"] < len(slots) else None
        assert c["block"] == ("" if want is None else str(want)), c
        if want is not None:
            assert c["text"].startswith(str(want)), c
    _, named = offending_cells(f)
    assert {("", c["seq"], c["slot"]) for c in shown["cells"] if c["offending"]} == named
    assert [p["free"] for p in shown["pool"]] == [fr.free for fr in f.frames[1:]]


def test_the_page_lists_the_violation_and_the_trace(shown_report, tmp_path):
    f = _film()
    report = _report("fork-without-incref", TRACE, f.violations)
    page = tmp_path / "report.html"
    page.write_text(report_html(report, timeline_svg(f, CONFIG.describe())))
    shown = shown_report(page, report)
    assert [x["invariant"] for x in shown["found"]] == ["refcount-exact", "refcount-exact"]
    assert {x["kind"] for x in shown["found"]} == {"wrong-refcount"}
    assert len(shown["trace"]) == len(TRACE) and shown["trace"][1].startswith("fork(")
    blocks = {f["value"][0] for f in shown["facts"] if f["fact"] == "blocks"}
    assert blocks == {0, 1}


def test_a_page_read_back_against_a_wrong_report_fails(shown_report, tmp_path):
    """The reader is shown able to fail: a page that leaves out a named sequence's row and an
    operation's column does not pass for the report."""
    f = _film("window-capped-admission")
    config, trace = CASES["window-capped-admission"]
    report = _report("window-capped-admission", trace, f.violations)
    short = film(BROKEN["window-capped-admission"].cls(config), trace[:2])  # as a film that stopped early
    page = tmp_path / "report.html"
    page.write_text(report_html(report, timeline_svg(short, config.describe())))
    with pytest.raises(AssertionError):
        shown_report(page, report)


def test_report_html_is_written_beside_report_json_by_check(tmp_path, shown_report):
    """``kvspec check`` on a broken variant writes report.html that passes the read-back."""
    from kvspec.cli.main import main
    from kvspec.testing.artifacts.report import load_report

    code = main(["check", "--impl", "broken:window-capped-admission", "--profile", "ci", "--examples", "60",
                 "--invariant", "admission-soundness", "--out", str(tmp_path), "--no-verify"])
    assert code == 1
    pages = sorted(tmp_path.rglob("report.html"))
    assert pages
    for page in pages:
        report = load_report(Path(page).with_name("report.json"))
        shown = shown_report(page, report)
        if any(v.get("kind") == "ok-then-failed" for v in report["violations"]):
            assert shown["verdict"] is not None


REPORTS = os.environ.get("KVSPEC_REPORT_DIR")


@pytest.mark.skipif(
    not REPORTS,
    reason="reads back the pages of a real run: KVSPEC_REPORT_DIR=DIR after "
    "`kvspec check --vllm 0.6.3.post1 --seed 1 --examples 50 --out DIR` makes it run",
)
def test_every_page_of_a_real_run_reads_back(shown_report):
    from kvspec.testing.artifacts.report import load_report

    pages = sorted(Path(str(REPORTS)).rglob("report.html"))
    assert pages, f"no report.html under {REPORTS}"
    for page in pages:
        shown_report(page, load_report(page.with_name("report.json")))


# ---------------------------------------------------------------- scheduler verdicts

SVG = "{http://www.w3.org/2000/svg}"


def read_page(page: Path) -> dict:
    """What a report.html draws, read from its markup (no browser): the operations' columns,
    the rows' (group, seq), the cells, the listed facts and the policy difference's."""
    text = page.read_text()
    start, end = text.index("<svg"), text.index("</svg>") + len("</svg>")
    svg = ET.fromstring(text[start:end])
    groups = list(svg.iter(f"{SVG}g"))
    html_part = text[:start] + text[end:]
    return {
        "ops": [int(g.get("data-op")) for g in groups if g.get("class", "").split()[:1] == ["op"]],
        "labels": [g.get("data-label") for g in groups if g.get("class", "").split()[:1] == ["op"]],
        "offending_ops": [int(g.get("data-op")) for g in groups if g.get("class") == "op offending"],
        "rows": {(t.get("data-group"), int(t.get("data-seq"))) for t in svg.iter(f"{SVG}text") if t.get("data-seq")},
        "cells": [g.attrib for g in groups if g.get("class", "").startswith("cell")],
        "facts": re.findall(r"data-violation='(\d+)' data-fact='(\w+)'", html_part),
        "difference": re.findall(r"data-difference='(\w+)'", html_part),
    }


def check_scheduler_page(page: Path, report: dict) -> dict:
    """A scheduler report's page draws every operation of its trace (and the teardown when the
    violation showed there), a row for every request that arrived, a row in the named group
    (every group when none is named) for every request a violation names, every violation's
    facts, and a policy difference's."""
    shown = read_page(page)
    trace, found = report["trace"], report["violations"]
    assert shown["ops"][: len(trace)] == list(range(1, len(trace) + 1)), shown["ops"]
    assert len(shown["ops"]) in (len(trace), len(trace) + 1)
    # Each column is its operation's, and a last one past the trace is the end of the run.
    assert [label.split()[0] for label in shown["labels"][: len(trace)]] == [s["op"] for s in trace]
    assert shown["labels"][len(trace) :] in ([], [FREE_ALL])
    assert shown["offending_ops"] == shown["ops"][-1:]
    groups = {g for g, _ in shown["rows"]}
    arrived = {s["args"]["seq"] for s in trace if s["op"] == "arrive"}
    assert arrived <= {seq for _, seq in shown["rows"]}, (arrived, shown["rows"])  # every request
    for v in found:
        for seq in v.get("seqs", []):
            for group in [v["group"]] if v.get("group") else groups:
                assert (group, seq) in shown["rows"], (v, shown["rows"])
    want = {(str(i), k) for i, v in enumerate(found) for k in v if k not in ("invariant", "message")}
    assert set(shown["facts"]) == want
    # What a violation names and the last column draws is marked there; a block no table holds
    # any more (a refcount left on a freed block) has no cell, only its facts.
    seqs = {s for v in found for s in v.get("seqs", [])}
    blocks = {str(b) for v in found for b in v.get("blocks", [])}
    last = [c for c in shown["cells"] if int(c["data-op"]) == shown["ops"][-1]]
    named = [c for c in last if int(c["data-seq"]) in seqs or c["data-block"] in blocks]
    if named:
        assert any("offending" in c["class"] for c in named), named
    if report.get("policy_difference"):
        assert "compared" in shown["difference"] and "target" in shown["difference"]
    return shown


@pytest.fixture(scope="module")
def scheduler_reports(tmp_path_factory):
    """The report folders of two scheduler searches on broken schedulers (reference/
    broken_scheduler.py): ``no-draft-rollback`` over every shape (an invariant verdict and a
    policy difference), and ``aliased-group-tables`` held to the hybrid shapes, so a verdict
    in a shape of several KV-cache groups is there whatever the first search meets first."""
    import contextlib
    import io

    from kvspec.cli.shapes import run_scheduler_search, write_scheduler_reports
    from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS
    from kvspec.testing.scheduler.machine import shapes

    base = tmp_path_factory.mktemp("scheduler")
    shared = {"target": {"kind": "none"}, "command": ["kvspec", "check"], "limits": {}}
    entries: list[dict] = []
    for name, within in (("no-draft-rollback", None), ("aliased-group-tables", "hybrid")):
        narrowed = {} if within is None else {"shape_strategy": shapes().filter(lambda s, t=within: t in s.tags())}
        run = run_scheduler_search(
            BROKEN_SCHEDULERS[name].cls, profile="ci", examples=150, steps=None, seed=3, focus=None, **narrowed
        )
        with contextlib.redirect_stdout(io.StringIO()):
            written = write_scheduler_reports(run, base, len(entries) + 1, lambda: dict(shared), "")
        assert written, name
        entries += written
    return [Path(e["report"]) for e in entries]


def test_every_scheduler_verdict_gets_a_page_that_draws_it(scheduler_reports):
    from kvspec.testing.artifacts.report import load_report

    reports = scheduler_reports
    kinds = {load_report(r)["verdict"]["kind"] for r in reports}
    assert {"invariant", "differential"} <= kinds, kinds
    hybrid = 0
    for path in reports:
        report = load_report(path)
        shown = check_scheduler_page(path.with_name("report.html"), report)
        hybrid += len({g for g, _ in shown["rows"]}) > 1
    assert hybrid, "no verdict in a shape of several KV-cache groups"


def test_the_offline_reader_fails_a_page_that_leaves_out_an_operation(scheduler_reports, tmp_path):
    """The markup reader is shown able to fail: a page drawn from the trace cut short of its
    last operation does not pass for the report."""
    from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS
    from kvspec.spec.groups import Shape
    from kvspec.testing.artifacts.report import load_report, trace_from_json
    from kvspec.testing.artifacts.timeline import scheduler_film

    reports = scheduler_reports
    report = next(load_report(r) for r in reports if load_report(r)["violations"])
    shape, trace = Shape(**report["shape"]), trace_from_json(report["trace"])
    short = scheduler_film(BROKEN_SCHEDULERS["no-draft-rollback"].cls(shape), shape, trace[:-1])
    page = tmp_path / "report.html"
    page.write_text(report_html(report, timeline_svg(short, shape.describe())))
    with pytest.raises(AssertionError):
        check_scheduler_page(page, report)


def test_the_browser_reads_back_every_scheduler_page(scheduler_reports, shown_report):
    from kvspec.testing.artifacts.report import load_report

    reports = scheduler_reports
    for path in reports:
        report = load_report(path)
        shown = shown_report(path.with_name("report.html"), report)
        for v in report["violations"]:
            if v.get("group"):
                assert {(v["group"], s) for s in v["seqs"]} <= {(r["group"], r["seq"]) for r in shown["rows"]}


def _collision_of_two_domains(seqs: bool = True):
    """The scheduler driver's verdict when one block hash stands for the same tokens under a
    LoRA name "x" (seq 0) and a cache salt "x" (seq 1), on the reference scheduler: the hashes
    are learned as an adapter learns a release's (``learn_hash_keys``), from a hash that drops
    each extra key's kind (F-KV9's releases).  ``seqs``: name the sequences that carried them."""
    from kvspec.adapters.v1 import learn_hash_keys
    from kvspec.reference.scheduler import ReferenceScheduler
    from kvspec.spec.groups import Shape
    from kvspec.spec.prefix_hash import ExtraKeys
    from kvspec.testing.scheduler.driver import SchedulerDriver

    shape = Shape(
        block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=4, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=16, max_model_len=16,
        full_sequence_must_fit=False, max_tokens=2,
    )
    target = ReferenceScheduler(shape)
    driver = SchedulerDriver(target)
    keys: dict = {}
    collisions: list = []
    owners: dict = {}
    for seq, extra in ((0, ExtraKeys(lora="x")), (1, ExtraKeys("x"))):
        driver.arrive(seq, (0, 0), 2, extra)
        untagged = [("x", (0, 0))]  # the block's hash: its tokens and the extra key's value alone
        learn_hash_keys(untagged, (0, 0), extra, 2, keys, {}, collisions, seq if seqs else None, owners)
    target.hash_collisions = collisions
    found = [v for v in driver.check() if v.invariant == "prefix-cache-consistency"]
    return shape, driver.trace, found


def test_a_domain_collision_names_both_requests_and_the_page_marks_them(tmp_path):
    """A scheduler's domain collision carries the requests whose blocks the hash stood for and
    the domains it confused (facts), so the picture marks those requests' cells; without the
    requests it has no red cell."""
    from kvspec.reference.scheduler import ReferenceScheduler
    from kvspec.testing.artifacts.timeline import scheduler_film

    shape, trace, (v,) = _collision_of_two_domains()
    assert (v.kind, v.seqs, v.domains) == ("domain-collision", (0, 1), ("cache_salt", "lora"))
    f = scheduler_film(ReferenceScheduler(shape), shape, trace, violations=[v])
    _, cells = offending_cells(f)  # the reference shows no collision: the film runs to its end
    assert {seq for _, seq, _ in cells} == {0, 1}
    assert 'class="cell offending"' in timeline_svg(f, shape.describe())
    _, _, (anonymous,) = _collision_of_two_domains(seqs=False)
    assert anonymous.seqs == ()
    unnamed = scheduler_film(ReferenceScheduler(shape), shape, trace, violations=[anonymous])
    assert offending_cells(unnamed)[1] == set()
