"""The scheduler machine (testing/scheduler/machine.py) on the reference scheduler: it holds
every invariant per KV-cache group and over the shared pool in every production shape, and
each shape's deliberately broken variant (reference/broken_scheduler.py) is caught there and
only there."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.groups import KV_CONNECTORS, SHAPE_TAGS
from kvspec.testing import SpecViolation
from kvspec.testing.scheduler.driver import ShapeCounts
from kvspec.testing.scheduler.machine import SchedulerMachine, shapes

EXAMPLES = 150


def _shapes_for(tag: str):
    """The shapes a variant of ``tag`` is run in: the KV connector's draw one (the reference
    models it), the others draw as they always did."""
    return shapes(connectors=KV_CONNECTORS) if tag == "kv-connector" else shapes()


def _settings(n: int = EXAMPLES):
    return settings(settings(), max_examples=n, report_multiple_bugs=False, deadline=None)


def test_reference_scheduler_holds_in_every_shape():
    counts = ShapeCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(ReferenceScheduler, counts=counts), settings=_settings(2 * EXAMPLES)
    )
    for tag in SHAPE_TAGS:
        assert counts.operations[tag] >= 100, (tag, counts)


@pytest.mark.parametrize("name", sorted(BROKEN_SCHEDULERS))
def test_broken_scheduler_is_caught_in_its_shape(name):
    variant = BROKEN_SCHEDULERS[name]
    within = _shapes_for(variant.shape).filter(lambda s: variant.shape in s.tags())
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
    outside = _shapes_for(variant.shape).filter(lambda s: variant.shape not in s.tags())
    run_state_machine_as_test(
        lambda: SchedulerMachine(variant.cls, outside), settings=_settings(EXAMPLES // 2)
    )


def test_scheduler_implementations_are_in_the_one_table():
    """The scheduler-driven implementations (they take a Shape) are listed with the others in
    testing/implementations.py: vLLM's scheduler adapter, the reference, every broken variant."""
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter
    from kvspec.testing.implementations import (
        BROKEN_SCHEDULER_PREFIX,
        SCHEDULERS,
        UnknownImplementation,
        lookup_scheduler,
    )

    assert lookup_scheduler("v1-scheduler").factory is VLLMV1SchedulerAdapter
    assert lookup_scheduler("reference-scheduler").factory is ReferenceScheduler
    broken = {n[len(BROKEN_SCHEDULER_PREFIX) :] for n in SCHEDULERS if n.startswith(BROKEN_SCHEDULER_PREFIX)}
    assert broken == set(BROKEN_SCHEDULERS)
    for name in broken:
        impl = lookup_scheduler(BROKEN_SCHEDULER_PREFIX + name)
        assert impl.factory is BROKEN_SCHEDULERS[name].cls and impl.shape in SHAPE_TAGS
    with pytest.raises(UnknownImplementation):
        lookup_scheduler("no-such-scheduler")


def test_only_progress_sees_a_scheduler_that_waits_forever():
    """``waits-for-a-full-batch`` reaches only sound states: with ``progress`` left out of the
    watched invariants (the drain is not run) its shape passes."""
    from kvspec.spec.invariants import INVARIANTS

    variant = BROKEN_SCHEDULERS["waits-for-a-full-batch"]
    within = shapes().filter(lambda s: variant.shape in s.tags())
    others = frozenset(INVARIANTS) - {"progress"}
    run_state_machine_as_test(
        lambda: SchedulerMachine(variant.cls, within, focus=others), settings=_settings(EXAMPLES // 2)
    )


def test_a_stalled_request_of_0_33_is_labelled_c3():
    """``kvspec check`` labels a scheduler verdict by the shipped known findings of the
    scheduler target (the search's fingerprint and match, cli/search.py ``Sieve``): a lone
    request preempted at the startup minimum on 0.33.0 is C3."""
    from kvspec.cli.shapes import SCHEDULER_IMPL
    from kvspec.spec.invariants import Violation
    from kvspec.testing.blockmanager.driver import TraceStep
    from kvspec.testing.known import SHIPPED, evidence_of, fingerprint, load_known, which_known

    trace = [TraceStep("arrive", {"seq": 0}), TraceStep("step", {})]
    stalled = Violation("progress", "seq 0 was preempted while ...", kind="preempted-alone", seqs=(0,))
    error = SpecViolation([stalled], trace)
    known = load_known([SHIPPED])

    def label(version: str):
        concern = [k for k in known if k.concerns(SCHEDULER_IMPL, version)]
        return which_known(concern, fingerprint(error), evidence_of(error), None, {s.op for s in trace})

    assert label("0.33.0") is not None and label("0.33.0").id == "C3"
    assert label("0.12.0") is None


def test_a_finding_the_step_past_policy_goes_on_past_does_not_end_the_example():
    """``CONTINUE`` (a known finding that leaves the state usable, e.g. a wrong usage figure from
    the first operation on) lets the example go on, as the block-manager machine does; without
    it a release whose every example shows such a finding would run nothing."""
    from kvspec.testing.blockmanager.machine import CONTINUE

    variant = BROKEN_SCHEDULERS["chunk-as-sliding-window"]
    within = shapes().filter(lambda s: variant.shape in s.tags())
    seen: dict[int, tuple[object, list[int]]] = {}  # the driver kept: its id is not reused

    def go_on(error, driver):
        if not isinstance(error, SpecViolation):
            return True
        seen.setdefault(id(driver), (driver, []))[1].append(len(driver.trace))
        return CONTINUE

    run_state_machine_as_test(lambda: SchedulerMachine(variant.cls, within, step_past=go_on),
                              settings=_settings(EXAMPLES // 2))
    assert seen, "the broken scheduler showed no violation to go on past"
    assert any(max(lengths) > min(lengths) for _, lengths in seen.values()), seen
