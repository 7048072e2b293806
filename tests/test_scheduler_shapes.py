"""The scheduler machine (testing/scheduler_machine.py) on the reference scheduler: it holds
every invariant per KV-cache group and over the shared pool in every production shape, and
each shape's deliberately broken variant (reference/broken_scheduler.py) is caught there and
only there."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.groups import SHAPE_TAGS
from kvspec.testing import SpecViolation
from kvspec.testing.scheduler_driver import ShapeCounts
from kvspec.testing.scheduler_machine import SchedulerMachine, shapes

EXAMPLES = 150


def _settings(n: int = EXAMPLES):
    return settings(settings(), max_examples=n, report_multiple_bugs=False, deadline=None)


def test_reference_scheduler_holds_in_every_shape():
    counts = ShapeCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(ReferenceScheduler, counts=counts), settings=_settings()
    )
    for tag in SHAPE_TAGS:
        assert counts.operations[tag] >= 100, (tag, counts)


@pytest.mark.parametrize("name", sorted(BROKEN_SCHEDULERS))
def test_broken_scheduler_is_caught_in_its_shape(name):
    variant = BROKEN_SCHEDULERS[name]
    within = shapes().filter(lambda s: variant.shape in s.tags())
    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(variant.cls, within), settings=_settings(EXAMPLES * 2)
        )
    found = {v.invariant for v in caught.value.violations}
    assert found & variant.catches, (name, sorted(found), caught.value)
    assert len(caught.value.trace) <= 25, caught.value


@pytest.mark.parametrize("name", sorted(BROKEN_SCHEDULERS))
def test_broken_scheduler_passes_outside_its_shape(name):
    """Only its shape reaches the bug: the shape is what the run must generate."""
    variant = BROKEN_SCHEDULERS[name]
    outside = shapes().filter(lambda s: variant.shape not in s.tags())
    run_state_machine_as_test(
        lambda: SchedulerMachine(variant.cls, outside), settings=_settings(EXAMPLES // 2)
    )
