"""The scheduler differential (testing/scheduler_machine.py ``SchedulerLockstep``): the
reference scheduler agrees with itself in the strictest mode in every production shape, and
a broken scheduler that every invariant accepts (reference/broken_scheduler.py
``DIFFERENTIAL_ONLY``) passes the invariants and fails the differential with a shrunk trace."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.broken_scheduler import DIFFERENTIAL_ONLY
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.testing import SpecViolation
from kvspec.testing.differential import Mode
from kvspec.testing.scheduler_machine import DiffCounts, SchedulerMachine

EXAMPLES = 100


def _settings(n: int = EXAMPLES):
    return settings(settings(), max_examples=n, report_multiple_bugs=False, deadline=None)


def test_reference_scheduler_agrees_with_itself_in_renaming_mode():
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(ReferenceScheduler, differential=Mode.RENAMING, diff_counts=counts),
        settings=_settings(),
    )
    assert counts.examples >= EXAMPLES and counts.steps >= 10 * EXAMPLES, counts
    assert not counts.allowed and not counts.ended, counts


@pytest.mark.parametrize("name", sorted(DIFFERENTIAL_ONLY))
def test_invariants_accept_what_the_differential_rejects(name):
    variant, caught_as = DIFFERENTIAL_ONLY[name]
    run_state_machine_as_test(lambda: SchedulerMachine(variant), settings=_settings())
    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(variant, differential=Mode.RENAMING), settings=_settings()
        )
    assert {v.invariant for v in caught.value.violations} == {caught_as}, caught.value
    assert len(caught.value.trace) <= 6, caught.value


def test_check_summary_counts_comparisons_and_reports_the_differential():
    """``kvspec check``'s shapes run compares every example with the reference scheduler and
    says how much it compared; a scheduler only the differential catches fails it."""
    from kvspec.cli.shapes import differential_line, run_shapes

    held = run_shapes(ReferenceScheduler, profile="ci", examples=20, steps=None, seed=None, focus=None)
    assert held.status == "holds", held
    d = held.differential
    assert d.examples >= 20 and d.steps > 0 and d.states > 0, d
    assert f"{d.steps} steps and {d.states} states compared" in differential_line(d)
    assert "divergences allowed: none" in differential_line(d)

    variant, caught_as = DIFFERENTIAL_ONLY["serial-admission"]
    found = run_shapes(variant, profile="ci", examples=EXAMPLES, steps=None, seed=None, focus=None)
    assert found.status == "violated", found
    assert {v.invariant for v in found.violations} == {caught_as}, found.violations

