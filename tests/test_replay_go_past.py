"""``kvspec replay`` and the straight-line reproducers go on past a target's ``go_on`` known
findings (testing/known.py ``GoPast``), as ``kvspec check`` and ``kvspec fuzz`` went past them
while searching: V1-e (BlockPool.get_usage counts the null block) shows at every state of vLLM
0.9.1 and 0.10.1.1, so a re-run that stopped at the first violation stopped there, before the
step the report is about.  On kvspec's reference manager and scheduler with a usage figure that
is wrong at every state (a stand-in for V1-e) and a second bug behind it; no vLLM needed."""

from __future__ import annotations

import json

import attrs
from kvspec.cli.failures import replay_verdict
from kvspec.cli.shapes import SCHEDULER_IMPL, run_scheduler_search
from kvspec.reference.broken import LeakOnFree
from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS
from kvspec.reference.manager import ReferenceManager
from kvspec.reference.pool import BlockPool
from kvspec.spec.config import Config
from kvspec.spec.invariants import Violation
from kvspec.testing import Driver
from kvspec.testing.artifacts.reproducer import Reproducer, generate
from kvspec.testing.artifacts.rerun import rerun
from kvspec.testing.blockmanager.driver import OPS, SpecViolation
from kvspec.testing.known import Fingerprint, KnownFinding, go_past_known, own_findings
from kvspec.testing.scheduler.replay import OPS as SCHEDULER_OPS
from kvspec.testing.scheduler.replay import in_context, scheduler_session


def _wrong(usage: float) -> float:
    return usage + 0.25 if usage < 0.5 else usage - 0.25


class _NullCountedPool(BlockPool):
    def usage(self) -> float:
        return _wrong(super().usage())


class UsageOffAndCrashOnFork(ReferenceManager):
    """A usage figure wrong at every state (as V1-e's), and a crash on every fork."""

    name = "usage-off-and-crash-on-fork"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _NullCountedPool(config.num_blocks, config.prefix_caching)

    def fork(self, parent_id: int, child_id: int) -> None:
        raise KeyError(f"no such sequence {parent_id}")


class UsageOffAndLeak(LeakOnFree):
    """A usage figure wrong at every state, and a leak on free (``no-leak`` at the end)."""

    name = "usage-off-and-leak"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _NullCountedPool(config.num_blocks, config.prefix_caching)


CONFIG = Config(block_size=2, num_blocks=8)
E = KnownFinding("E", "usage counts the null block", ("conservation",), (*OPS, "teardown"),
                 kind=("wrong-usage",), go_on=True)
E_SCHEDULER = attrs.evolve(E, id="E/scheduler", operation=(*SCHEDULER_OPS, "teardown"), impl=(SCHEDULER_IMPL,))


def _trace(impl_cls, *ops):
    """The trace a driver records for ``ops`` (name, args) on the implementation."""
    driver = Driver(impl_cls(CONFIG))
    for op, *args in ops:
        try:
            getattr(driver, op)(*args)
        except KeyError:
            break
    return list(driver.trace)


def test_replay_goes_past_a_go_on_finding_to_the_recorded_crash_and_counts_it():
    trace = _trace(UsageOffAndCrashOnFork, ("admit", 0, [1, 2, 3], 3), ("admit", 1, [4], 1), ("fork", 0, 2))
    assert [s.op for s in trace] == ["admit", "admit", "fork"] and trace[-1].crash is not None
    # Stopping at the first violation stops at step 1, on the usage figure.
    stopped = rerun(UsageOffAndCrashOnFork, CONFIG, trace)
    assert stopped.crash is None and len(stopped.trace) == 1
    assert {v.kind for v in stopped.violations} == {"wrong-usage"}
    go_past = go_past_known([E], "reference", None)
    assert go_past is not None
    again = rerun(UsageOffAndCrashOnFork, CONFIG, trace, go_past=go_past)
    assert again.crash is not None and again.crash_step == 3 and again.crash.type == "KeyError"
    assert again.gone_past == {"E": 2} and not again.violations


def test_replay_never_goes_past_the_reports_own_finding_nor_another_kind_of_its_invariant():
    trace = _trace(UsageOffAndCrashOnFork, ("admit", 0, [1, 2, 3], 3), ("fork", 0, 2))
    assert go_past_known([E], "reference", None, own={"E"}) is None  # the report is about E itself
    assert go_past_known([attrs.evolve(E, go_on=False)], "reference", None) is None
    assert go_past_known([attrs.evolve(E, impl=("v1",))], "reference", None) is None  # not this target
    policy = go_past_known([E], "reference", None)
    assert policy is not None
    driver = Driver(UsageOffAndCrashOnFork(CONFIG))
    wrong = Violation("conservation", "usage off", kind="wrong-usage")
    double = Violation("conservation", "block 1 freed twice", kind="double-free")
    leak = Violation("no-leak", "blocks [0] still in use")
    assert policy(SpecViolation([wrong], trace[:1]), driver) == "continue"
    # A conservation violation of another kind beside E's is not E: the re-run stops there.
    assert policy(SpecViolation([wrong, double], trace[:1]), driver) is False
    assert policy(SpecViolation([wrong, leak], trace[:1]), driver) is False
    assert policy(ValueError("a crash is never gone past"), driver) is False
    assert policy.gone == {"E": 1}
    # A report's own finding: what its run labelled it, or what its own violations match now.
    fp = Fingerprint("conservation", "teardown")
    assert own_findings([E], fp, [wrong], CONFIG, trace) == {"E"}
    assert own_findings([E], fp, [double], CONFIG, trace) == frozenset()
    assert own_findings([E], Fingerprint("no-leak", "teardown"), [wrong, leak], CONFIG, trace) == frozenset()
    assert own_findings([E], Fingerprint("crash", "fork", "KeyError"), [], CONFIG, trace, recorded=["F"]) == {"F"}


def test_the_end_of_a_replay_goes_past_it_too_and_the_verdict_names_what_it_went_past(capsys):
    """The leak shows at the end (after freeing every sequence), beside the usage figure: the
    recorded no-leak reproduces, and the output says E was gone past and how often."""
    trace = _trace(UsageOffAndLeak, ("admit", 0, [1, 2, 3], 3), ("admit", 1, [4], 1))
    report = {"violations": [{"invariant": "conservation", "kind": "wrong-usage", "message": "m"},
                             {"invariant": "no-leak", "message": "m"}],
              "trace": [s.to_json() for s in trace], "config": attrs.asdict(CONFIG)}
    go_past = go_past_known([E], "reference", None)
    again = rerun(UsageOffAndLeak, CONFIG, trace, go_past=go_past)
    assert len(again.trace) > len(trace)  # reached the end: the frees of every sequence
    assert {"conservation", "no-leak"} <= {v.invariant for v in again.violations}
    # Gone past after each of the two operations, and once in the end's progress drain (whose
    # first check meets it) before every sequence is freed, as the machine's end does.
    assert again.gone_past == {"E": 3}
    assert replay_verdict(report, trace, again, same=True) == 1
    out = capsys.readouterr().out
    assert "went past known finding(s) E (3 checks)" in out
    assert "the recorded violation reproduces" in out
    # With nothing but E at the end, the replay claims no violation, never E for another.
    clean = rerun(UsageOffAndCrashOnFork, CONFIG, trace, go_past=go_past_known([E], "reference", None))
    # (after each operation, in the drain, and after freeing every sequence)
    assert not clean.violations and clean.gone_past == {"E": 4}


def test_a_reproducer_goes_past_the_go_on_finding_and_checks_only_its_own_failure(monkeypatch):
    """A straight-line file re-runs the trace on vLLM's adapter: recorded here on the reference
    (as the adapter), the re-run reaches the fork instead of stopping at step 1 on the usage."""
    from kvspec.testing.artifacts import straight_line

    recorded: dict = {}

    def record(build, config, trace, focus=None, engine="legacy", **kw):
        recorded.update(kw)
        return rerun(UsageOffAndCrashOnFork, config, trace, focus=focus, go_past=kw.get("go_past"))

    monkeypatch.setattr(straight_line, "record", record)
    monkeypatch.setattr(straight_line, "write", lambda recording, *a, **kw: ("text", ("crash",)))
    trace = _trace(UsageOffAndCrashOnFork, ("admit", 0, [1, 2, 3], 3), ("fork", 0, 2))
    wrong = Violation("conservation", "usage off", kind="wrong-usage")
    go_past = go_past_known([E], "reference", None)
    made = generate("v1", CONFIG, trace, [wrong], {"focus": None}, go_past)
    assert isinstance(made, Reproducer) and recorded["go_past"] is go_past
    assert go_past.gone == {"E": 1}  # the fork's crash was reached past step 1's usage figure
    assert go_past.others([wrong], CONFIG, trace) == []  # the file does not check E's fact


def test_a_scheduler_replay_goes_past_a_go_on_finding_to_the_recorded_verdict(capsys):
    """The scheduler machine's own end (drain, aborts) goes past it as well."""
    broken = BROKEN_SCHEDULERS["no-draft-rollback"].cls  # kv-readback in spec-decode shapes

    class UsageOff(broken):  # type: ignore[misc, valid-type]
        name = "usage-off"

        def observe(self):
            state = super().observe()
            pool = state.pool
            in_use = len(pool.ids) - len(pool.free) - len(pool.evictable)
            return attrs.evolve(state, pool=attrs.evolve(pool, usage=_wrong(in_use / len(pool.ids))))

    run = run_scheduler_search(broken, profile="ci", examples=60, steps=None, seed=3, focus=None)
    found = next(f for f in run.search.found if f.fingerprint.invariant == "kv-readback")
    shape, trace = found.outcome.shape, found.outcome.trace
    assert len(trace) > 1
    session = scheduler_session(shape, None)
    stopped = in_context(lambda: rerun(UsageOff, shape, trace, session=session))
    assert {v.kind for v in stopped.violations} == {"wrong-usage"} and len(stopped.trace) == 1
    go_past = go_past_known([E_SCHEDULER], SCHEDULER_IMPL, None)
    assert go_past is not None
    session = scheduler_session(shape, None, go_past)
    again = in_context(lambda: rerun(UsageOff, shape, trace, session=session, go_past=go_past))
    assert "kv-readback" in {v.invariant for v in again.violations}
    assert len(again.trace) == len(trace) and again.gone_past == {"E/scheduler": len(trace) - 1}
    report = {"violations": [v.to_json() for v in found.outcome.violations], "machine": "scheduler"}
    assert replay_verdict(json.loads(json.dumps(report)), trace, again, same=True) == 1
    out = capsys.readouterr().out
    assert f"went past known finding(s) E/scheduler ({len(trace) - 1} checks)" in out
    assert "the recorded violation reproduces" in out


def test_a_rounds_sieve_names_what_a_re_run_of_its_traces_goes_past():
    """Naming a nondeterministic target's step (``kvspec check``, cli/failures.py) re-runs the
    trace: it goes past what the round went past on (a go_on finding it steps past), nothing else."""
    from kvspec.cli.search import Sieve

    other = KnownFinding("O", "o", ("no-leak",), ("free",), go_on=True)
    go_past = Sieve(frozenset(), [E, other], frozenset({"E"})).go_past()
    assert go_past.own == {"O"}  # not stepped past by this round: never gone past
    driver = Driver(UsageOffAndCrashOnFork(CONFIG))
    wrong = Violation("conservation", "usage off", kind="wrong-usage")
    assert go_past(SpecViolation([wrong], []), driver) == "continue"


def test_a_replay_on_a_release_without_the_go_on_finding_reproduces_the_reports_own_violation(capsys):
    """A report recorded where V1-e shows (its violations hold V1-e's usage figure beside the
    report's own no-leak) replayed where V1-e is fixed: the report's own violation reproduces,
    and the missing usage figure is named, not taken for a different outcome.  A replay that
    meets another failure and not the report's own claims nothing: ``kvspec bisect`` reads it as
    diverged, never as the report's finding reproducing."""
    from kvspec.cli.pr import DIVERGED
    from kvspec.testing.artifacts.rerun import Rerun

    trace = _trace(UsageOffAndLeak, ("admit", 0, [1, 2, 3], 3))
    report = {"violations": [{"invariant": "conservation", "kind": "wrong-usage", "message": "m"},
                             {"invariant": "no-leak", "message": "m"}],
              "fingerprint": {"invariant": "no-leak", "operation": "teardown", "exception": "", "location": ""}}
    fixed = Rerun(list(trace), [Violation("no-leak", "blocks [0] still in use")])
    assert replay_verdict(report, trace, fixed, same=False) == 1
    out = capsys.readouterr().out
    assert "the recorded violation reproduces; the report also recorded conservation, not shown here" in out
    other = Rerun(list(trace), [Violation("refcount-exact", "block 1 has refcount 2 with 1 holder(s)")])
    assert replay_verdict(report, trace, other, same=False) == 1
    out = capsys.readouterr().out
    assert "violations differ from the report's (no-leak)" in out and "reproduces" not in out
    assert any(d in out for d in DIVERGED)
