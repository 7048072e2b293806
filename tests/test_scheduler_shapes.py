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


def test_a_stalled_request_of_0_33_is_labelled_by_its_shape():
    """``kvspec check`` labels a scheduler verdict by the shipped known findings of the
    scheduler target (the search's fingerprint and match, cli/search.py ``Sieve``, which passes
    the example's shape): a lone request stalled at the startup minimum on 0.33.0 is C3 with
    EAGLE and a window group, C5 with a Mamba group, C6 with ngram drafts and a budget below
    the padded decode -- and none of them in a shape none of them needs."""
    import attrs
    from kvspec.cli.shapes import SCHEDULER_IMPL
    from kvspec.spec.config import Config
    from kvspec.spec.groups import Shape
    from kvspec.spec.invariants import Violation
    from kvspec.testing.blockmanager.driver import TraceStep
    from kvspec.testing.known import SHIPPED, label_failures, load_known

    trace = [TraceStep("arrive", {"seq": 0}), TraceStep("step", {})]
    plain = Shape(
        block_size=2, swa_block_size=1, sliding_window=None, extra_blocks=0, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=4, max_model_len=16,
        full_sequence_must_fit=False,
    )
    c3 = attrs.evolve(plain, sliding_window=1, num_spec_tokens=2, eagle=True)
    c5 = attrs.evolve(plain, mamba=True, async_scheduling=True)
    c6 = attrs.evolve(plain, num_spec_tokens=4)
    known = load_known([SHIPPED])

    def label(version: str, shape: Shape, kind: str = "livelock"):
        stalled = Violation("progress", "seq 0 was never scheduled ...", kind=kind, seqs=(0,))
        concern = [k for k in known if k.concerns(SCHEDULER_IMPL, version)]
        config = Config(block_size=2, num_blocks=8, prefix_caching=True, max_lookahead=shape.num_spec_tokens)
        ((_, found),) = label_failures(concern, SpecViolation([stalled], trace), config, trace, shape)
        return found.id if found is not None else None

    assert label("0.33.0", c3, "preempted-alone") == "C3"
    assert label("0.33.0", c5, "preempted-alone") == "C5"
    assert label("0.33.0", c6) == "C6" and label("0.30.0", c6) == "C6"
    # ngram drafts the budget holds padded, or no prefix cache: none of them.
    assert label("0.33.0", attrs.evolve(c6, max_num_batched_tokens=5)) is None
    assert label("0.33.0", attrs.evolve(c6, num_spec_tokens=0)) is None
    assert label("0.33.0", plain) is None
    assert label("0.12.0", c3) is None


def _padded_admission(policy) -> tuple[ReferenceScheduler, list]:
    """FINDINGS C6's trace on the reference scheduler: 2 ngram drafts, budget 2, a request
    admitted at a two-token prefix hit with one token left."""
    from kvspec.spec.groups import Shape
    from kvspec.testing.scheduler.driver import SchedulerDriver
    from kvspec.testing.scheduler.progress import drain

    shape = Shape(
        block_size=2, swa_block_size=1, sliding_window=None, extra_blocks=0, prefix_caching=True,
        num_spec_tokens=2, async_scheduling=False, max_num_batched_tokens=2, max_model_len=16,
        full_sequence_must_fit=False, max_tokens=2,
    )
    reference = ReferenceScheduler(shape, policy=policy)
    driver = SchedulerDriver.for_shape(reference, shape)
    driver.arrive(0, [0, 0], 1)
    driver.step(bytes(4), bytes(4))
    driver.arrive(1, [0, 0, 0], 1)
    return reference, drain(driver, driver.check)


def test_the_reference_schedules_a_padded_admission_the_budget_cannot_hold_unpadded():
    """The reference's own policy does not wait for a budget that never holds the padded decode
    (``padding_waits_for_budget``): the request runs to its end.  Under vLLM 0.33.0's declared
    policy the same trace livelocks, as vLLM does (FINDINGS C6), and ``progress`` says so."""
    from kvspec.reference.policies import REFERENCE_OWN, declared_for

    reference, found = _padded_admission(REFERENCE_OWN)
    assert found == [] and not reference.live(1)
    reference, found = _padded_admission(declared_for("0.33.0"))
    assert [(v.invariant, v.kind) for v in found] == [("progress", "livelock")], found


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


def test_the_multimodal_line_says_when_no_example_ran_beside_the_reference(capsys):
    """Where the differential did not run (no policy declared for the release), the multimodal
    line must not read as a comparison of zero examples."""
    from kvspec.cli.shapes import ShapesOutcome, print_multimodal
    from kvspec.testing.scheduler.machine import DiffCounts

    counts = ShapeCounts()
    counts.add(["multimodal"], 5)
    print_multimodal(ShapesOutcome("holds", counts, examples=1, differential=DiffCounts(undeclared="0.9.1")))
    said = " ".join(capsys.readouterr().out.split())
    assert "none run beside the reference scheduler" in said and "0 of 0" not in said
    ran = DiffCounts(mm_examples=2, mm_examples_to_end=1, encoder_inputs=3)
    print_multimodal(ShapesOutcome("holds", counts, examples=1, differential=ran))
    said = " ".join(capsys.readouterr().out.split())
    assert "3 compared with the reference in 1 of 2 examples compared to the end" in said
