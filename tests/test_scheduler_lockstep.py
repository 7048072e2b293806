"""The scheduler lockstep (testing/scheduler/lockstep.py) on kvspec's own schedulers: two child
processes of this interpreter, the reference scheduler as BASE; as HEAD the reference (nothing
differs), a scheduler that breaks no invariant but batches nothing (``serial-admission``: a
behaviour change), and one that breaks an invariant (a regression; the reverse a fix).

The verdicts on a real vLLM (a planted scheduler change in a copy of 0.33.0) are
tests/targets/test_scheduler_lockstep_pr.py.
"""

from __future__ import annotations

import sys

from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS, SerialAdmission
from kvspec.testing.implementations import BROKEN_SCHEDULER_PREFIX
from kvspec.testing.lockstep import Kind, Mode, Side, differing, run_lockstep
from kvspec.testing.scheduler.lockstep import SchedulerLockstepMachine, SchedulerObservation
from kvspec.testing.scheduler.machine import shapes

# No golden files: they replay on vLLM's scheduler (tests/targets/test_scheduler_lockstep_pr.py).
BUDGET = dict(profile="ci", examples=12, max_verdicts=1, machine=SchedulerLockstepMachine, golden=False)
REFERENCE = "reference-scheduler"
# Reserves no block for an async step's output placeholders: admission-soundness breaks.
BROKEN = BROKEN_SCHEDULER_PREFIX + "unreserved-placeholders"


def _side(label: str, impl: str) -> Side:
    return Side(label, impl, sys.executable, impl)


def _async():
    return shapes().filter(lambda s: s.async_scheduling and s.extra_blocks > 0)


def test_the_same_scheduler_on_both_sides_differs_nowhere_and_counts_what_it_compared():
    run = run_lockstep(_side("HEAD", REFERENCE), _side("BASE", REFERENCE), shapes(), **BUDGET)
    assert run.status == "compared" and run.verdicts == [], [v.describe() for v in run.verdicts]
    assert run.stats.examples >= 10 and run.stats.by_op.get("step", 0) > run.stats.examples


def test_a_scheduler_that_breaks_no_invariant_but_batches_nothing_is_a_behaviour_change():
    run = run_lockstep(_side("HEAD", SerialAdmission.name), _side("BASE", REFERENCE), shapes(), **BUDGET)
    (verdict,) = run.verdicts
    assert verdict.kind is Kind.CHANGE, verdict.describe()
    assert verdict.op == "step" and verdict.field in ("hits", "scheduled"), verdict.describe()
    assert not verdict.head_violations and not verdict.base_violations
    head, base = verdict.values()
    assert head != base
    assert len(verdict.trace) <= 6, verdict.describe()  # shrunk: two arrivals and a step or so


def test_an_invariant_broken_on_head_is_a_regression_and_on_base_a_fix():
    assert BROKEN.removeprefix(BROKEN_SCHEDULER_PREFIX) in BROKEN_SCHEDULERS
    run = run_lockstep(_side("HEAD", BROKEN), _side("BASE", REFERENCE), _async(), **BUDGET)
    (verdict,) = run.verdicts
    assert verdict.kind is Kind.REGRESSION, verdict.describe()
    assert verdict.head_violations and not verdict.base_violations
    run = run_lockstep(_side("HEAD", REFERENCE), _side("BASE", BROKEN), _async(), **BUDGET)
    (verdict,) = run.verdicts
    assert verdict.kind is Kind.FIX and verdict.base_violations and not verdict.head_violations


def test_each_mode_compares_its_fields_and_those_of_the_modes_below():
    base = SchedulerObservation(outcome="step", scheduled=((0, 0, 8, 0),), free=3, tables=(("full", 0, (0,)),))
    tables = attrs_evolve(base, tables=(("full", 0, (1,)), ("full", 1, (1,))))
    counts = attrs_evolve(base, free=2)
    scheduled = attrs_evolve(base, scheduled=((0, 0, 4, 0),))
    assert differing(tables, base, Mode.RENAMING) == ["tables"]
    assert differing(tables, base, Mode.COUNTS) == []
    assert differing(counts, base, Mode.COUNTS) == ["free"]
    assert differing(counts, base, Mode.OUTCOMES) == []
    assert differing(scheduled, base, Mode.OUTCOMES) == ["scheduled"]


def attrs_evolve(o: SchedulerObservation, **changes) -> SchedulerObservation:
    import attrs

    return attrs.evolve(o, **changes)
