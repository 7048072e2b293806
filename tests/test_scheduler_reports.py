"""The scheduler machine's search in ``kvspec check`` (cli/shapes.py): rounds that step past
what earlier rounds found and the known findings of the scheduler target, every distinct
verdict shrunk on its own, a report folder per verdict that ``kvspec replay``'s loop
(testing/artifacts/rerun.py with testing/scheduler/replay.py's session) re-runs.  On a deliberately
broken reference scheduler (reference/broken_scheduler.py), no vLLM needed."""

from __future__ import annotations

import json
import re

import attrs
from kvspec.cli.common import EXIT_FOUND, EXIT_OK
from kvspec.cli.failures import replay_verdict
from kvspec.cli.shapes import (
    SCHEDULER_IMPL,
    run_scheduler_search,
    scheduler_json,
    shapes_exit,
    verdict_kind,
    write_scheduler_reports,
)
from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS, DIFFERENTIAL_ONLY
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.groups import Shape
from kvspec.testing.artifacts.report import trace_from_json
from kvspec.testing.artifacts.rerun import rerun
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.guard import Guard, Limits
from kvspec.testing.known import KnownFinding
from kvspec.testing.scheduler.replay import in_context, scheduler_session

BROKEN = BROKEN_SCHEDULERS["no-draft-rollback"].cls  # kv-readback in spec-decode shapes
EXAMPLES = 150
ROLLBACK = KnownFinding(
    id="ROLLBACK", title="drafts not rolled back", invariant=("kv-readback",), operation=("step",),
    impl=(SCHEDULER_IMPL,),
)


def search(**kw):
    return run_scheduler_search(BROKEN, profile="ci", examples=EXAMPLES, steps=None, seed=3, focus=None, **kw)


def test_every_distinct_verdict_is_reported_each_shrunk_on_its_own():
    run = search()
    found = run.search.found
    assert found, run.summary
    fingerprints = [f.fingerprint for f in found]
    assert len(set(fingerprints)) == len(fingerprints)  # distinct
    assert any(f.invariant == "kv-readback" for f in fingerprints)
    assert len(run.search.rounds) == len(found) + 1  # the last round found nothing new
    assert run.search.rounds[-1].status == "holds"
    for f in found:
        assert f.outcome.trace and f.outcome.shape is not None
        if f.outcome.status == "differs":  # a policy difference: no invariant violated
            assert not f.outcome.violations and f.outcome.difference is not None
            assert f.fingerprint.exception == f.outcome.difference.comparison.value
        else:
            # Every violated invariant of an operation is judged on its own (cli/search.py
            # ``Sieve``): the verdict is one of the operation's violations, not always the first.
            assert f.fingerprint.invariant in {v.invariant for v in f.outcome.violations}
    assert run.summary.status == "violated"


def test_a_known_finding_is_stepped_past_then_reported_by_its_id():
    run = search(known=[ROLLBACK])
    assert run.search.fired["ROLLBACK"] > 0
    labelled = [f for f in run.search.found if f.known is not None]
    assert [f.known.id for f in labelled] == ["ROLLBACK"]
    assert "kv-readback" in {v.invariant for v in labelled[0].outcome.violations}
    assert scheduler_json(run)["known_findings"]["ROLLBACK"]["fired"] > 0


def test_each_verdict_gets_a_report_that_replays(tmp_path, capsys):
    run = search()
    shared = {"target": {"kind": "none"}, "command": ["kvspec", "check"], "limits": {}}
    entries = write_scheduler_reports(run, tmp_path, 3, lambda: dict(shared), "")
    out = capsys.readouterr().out
    assert len(entries) == len(run.search.found)
    first = json.loads((tmp_path / f"03-{run.search.found[0].fingerprint.slug()}" / "report.json").read_text())
    assert first["machine"] == "scheduler" and first["verdict"]["kind"] == verdict_kind(run.search.found[0].outcome)
    assert "no timeline picture" not in out and out.count("picture: ") == len(entries)
    for entry in entries:
        report = json.loads(open(entry["report"]).read())
        assert entry["machine"] == "scheduler"
        shape, trace = Shape(**report["shape"]), trace_from_json(report["trace"])
        session = scheduler_session(shape, Mode(report["differential_mode"]))
        again = in_context(lambda: rerun(BROKEN, shape, trace, session=session))  # noqa: B023
        recorded = {v["invariant"] for v in report["violations"]}
        assert recorded <= {v.invariant for v in again.violations}, (report["violations"], again)
        # The reference scheduler runs the same operations clean (or answers them differently).
        fixed = in_context(lambda: rerun(ReferenceScheduler, shape, trace, session=session))  # noqa: B023
        assert not recorded & {v.invariant for v in fixed.violations} or fixed.unapplied is not None


def test_a_policy_difference_is_a_verdict_of_its_own_that_replays(tmp_path, capsys):
    """A scheduler only the differential catches (every invariant holding): the search reports
    the difference as its own verdict (kind ``differential``, fingerprint: what it compared,
    the operation, the policy), shrunk, with a folder whose report carries the difference and
    replays to the same difference; the reference scheduler replays it with none."""
    variant, comparison = DIFFERENTIAL_ONLY["serial-admission"]
    run = run_scheduler_search(variant, profile="ci", examples=EXAMPLES, steps=None, seed=3, focus=None)
    differs = [f for f in run.search.found if f.outcome.status == "differs"]
    assert differs, run.summary
    f = differs[0]
    assert f.fingerprint.invariant == "differs" and f.fingerprint.exception == comparison.value
    assert f.fingerprint.location == f.outcome.difference.policy  # the declared policy's ID
    assert f.fingerprint.operation == f.outcome.trace[-1].op
    assert re.fullmatch(r"[a-z0-9.-]+", f.fingerprint.slug()), f.fingerprint.slug()
    # Stepped past once found: the next round finds something else or nothing.
    assert len(run.search.rounds) == len(run.search.found) + 1
    assert len({x.fingerprint for x in run.search.found}) == len(run.search.found)
    assert not f.outcome.violations and f.outcome.difference is not None
    assert verdict_kind(f.outcome) == "differential"
    assert shapes_exit(0, run) == EXIT_FOUND
    assert run.summary.status == "differs" and scheduler_json(run)["policy_difference"]["compared"] == comparison.value
    shared = {"target": {"kind": "none"}, "command": ["kvspec", "check"], "limits": {}}
    entries = write_scheduler_reports(run, tmp_path, 1, lambda: dict(shared), "")
    out = capsys.readouterr().out
    assert "differs from" in out and "declared policy" in out
    assert "VIOLATED" not in out and "violation of" not in out
    entry = next(e for e in entries if e["kind"] == "differential")
    folder = tmp_path / f"{run.search.found.index(f) + 1:02d}-{f.fingerprint.slug()}"
    assert entry["report"] == str(folder / "report.json") and (folder / "trace.txt").exists()
    report = json.loads((folder / "report.json").read_text())
    assert report["outcome"] == "differs" and report["violations"] == []
    pd = report["policy_difference"]
    assert pd["compared"] == comparison.value and pd["message"] == str(f.outcome.difference)
    assert {"release", "policy", "mode", "seq", "group", "target", "reference"} <= set(pd)
    shape, trace = Shape(**report["shape"]), trace_from_json(report["trace"])
    session = scheduler_session(shape, Mode(report["differential_mode"]))
    again = in_context(lambda: rerun(variant, shape, trace, session=session))
    assert again.difference is not None and str(again.difference) == pd["message"], again
    assert replay_verdict(report, trace, again, True) == EXIT_FOUND
    assert "the recorded difference reproduces" in capsys.readouterr().out
    clean = in_context(lambda: rerun(ReferenceScheduler, shape, trace, session=session))
    if clean.unapplied is None:
        assert clean.difference is None and not clean.violations, clean
        assert replay_verdict(report, trace, clean, False) == EXIT_OK


class _HangsInSchedule(ReferenceScheduler):
    """A scheduler that never returns from its second ``schedule`` (what broken code does)."""

    calls = 0

    def schedule(self):
        type(self).calls += 1
        if type(self).calls >= 2:
            while True:
                pass
        return super().schedule()


def test_a_scheduler_hang_is_a_verdict_with_its_report(tmp_path):
    guard = Guard(Limits(op_timeout=0.3, memory_cap_gib=None))
    _HangsInSchedule.calls = 0
    with guard.armed():
        run = run_scheduler_search(
            guard.wrap(_HangsInSchedule), profile="ci", examples=20, steps=None, seed=3, focus=None
        )
    [found] = run.search.found
    assert found.outcome.status == "hung" and found.fingerprint.invariant == "hung"
    assert found.outcome.shape is not None and found.outcome.trace[-1].op == found.fingerprint.operation
    assert run.summary.status == "hung" and shapes_exit(EXIT_OK, run) == EXIT_FOUND
    shared = {"target": {"kind": "none"}, "command": ["kvspec", "check"], "limits": {}}
    [_entry] = write_scheduler_reports(run, tmp_path, 1, lambda: dict(shared), "")
    report = json.loads((tmp_path / f"01-{found.fingerprint.slug()}" / "report.json").read_text())
    assert report["outcome"] == "hung" and report["shape"] is not None and report["trace"]


class _PreemptsTheLoneRequestOnce(ReferenceScheduler):
    """Preempts the sole running request once, the first time it has computed something: a
    request preempted while nothing else holds a block (``progress``, as FINDINGS C3), met only
    when the example's end (its drain) is where it first runs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.preempted_once = False

    def schedule(self):
        if not self.preempted_once and len(self.running) == 1 and self.reqs[self.running[0]].computed:
            self.preempted_once = True
            victim = self.running[0]
            self._preempt(victim)
            plan = super().schedule()
            return attrs.evolve(plan, preempted=(victim, *plan.preempted))
        return super().schedule()


def test_a_verdict_met_in_the_examples_end_replays_from_where_the_end_began(capsys):
    """``progress`` is judged in the machine's drain at the end of an example; the drain's steps
    are in the trace, marked as the end's, and a replay stops applying the recorded steps where
    the end began and runs the end itself (else the preemption it records happens before the
    replay's own drain, which then meets none: "did not recur").  One request in a fixed shape,
    then the example's end."""
    from kvspec.spec.prefix_hash import NO_EXTRA
    from kvspec.testing.blockmanager.driver import END, SpecViolation
    from kvspec.testing.scheduler.machine import SchedulerMachine

    shape = Shape(
        block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=4, prefix_caching=False,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=16, max_model_len=16,
        full_sequence_must_fit=True, max_tokens=4,
    )

    def example() -> SpecViolation:
        machine = SchedulerMachine(_PreemptsTheLoneRequestOnce)
        machine.start(shape)
        machine.d.arrive(0, [0, 0, 0], 4, NO_EXTRA)
        machine.invariants_hold()
        try:
            machine.teardown()
        except SpecViolation as found:
            return found
        raise AssertionError("the lone request's preemption was not judged")

    found = in_context(example)
    assert [v.invariant for v in found.violations] == ["progress"]
    ends = [bool(s.args.get(END)) for s in found.trace]
    assert ends[0] is False and any(ends) and ends == sorted(ends), found.trace  # the end's, last
    report = {"violations": [v.to_json() for v in found.violations], "trace": [s.to_json() for s in found.trace]}
    recorded = trace_from_json(report["trace"])
    session = scheduler_session(shape, None)
    again = in_context(lambda: rerun(_PreemptsTheLoneRequestOnce, shape, recorded, session=session))
    assert "progress" in {v.invariant for v in again.violations}, again
    assert [s.op for s in again.trace] == [s.op for s in recorded]  # the same end, run again
    assert replay_verdict(report, recorded, again, True) == EXIT_FOUND
    assert "the recorded violation reproduces" in capsys.readouterr().out
    # The reference scheduler runs the same request to its end.
    clean = in_context(lambda: rerun(ReferenceScheduler, shape, recorded, session=session))
    assert not clean.violations and clean.unapplied is None, clean
