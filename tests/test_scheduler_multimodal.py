"""The multimodal shape (``Shape.mm_item_tokens``) on the reference scheduler: requests carry
images, encoded against the encoder budget and the encoder cache (reference/encoder_cache.py).
The reference agrees with itself there in the strictest mode, every example compared to its end
with encoder inputs scheduled; the broken encoder scheduler (reference/broken_scheduler.py
``MULTIMODAL_ONLY``) holds every invariant, is the reference in every other shape, and the
differential in a multimodal shape reports it as a policy difference in the encoder inputs."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.broken_scheduler import MULTIMODAL_ONLY
from kvspec.reference.encoder_cache import EncoderCache
from kvspec.reference.policies import REFERENCE_OWN
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.groups import Shape
from kvspec.spec.invariants import INVARIANTS
from kvspec.spec.prefix_hash import ExtraKeys, MMFeature
from kvspec.testing import SpecViolation
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.scheduler.machine import DiffCounts, PolicyDifference, SchedulerMachine, shapes

EXAMPLES = 100
MULTIMODAL = shapes(multimodal=True).filter(lambda s: s.multimodal)
TEXT_ONLY = shapes(multimodal=True).filter(lambda s: not s.multimodal)


def _settings(n: int = EXAMPLES):
    return settings(settings(), max_examples=n, report_multiple_bugs=False, deadline=None)


def test_reference_agrees_with_itself_in_the_multimodal_shape():
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(ReferenceScheduler, MULTIMODAL, differential=Mode.RENAMING, diff_counts=counts),
        settings=_settings(),
    )
    assert counts.mm_examples == counts.examples >= EXAMPLES, counts
    assert counts.mm_examples_to_end == counts.mm_examples and not counts.ended, counts
    assert counts.encoder_inputs >= EXAMPLES // 2, counts


def test_a_multimodal_shape_is_synchronous_without_drafts():
    plain = Shape(
        block_size=4,
        swa_block_size=4,
        sliding_window=None,
        extra_blocks=0,
        prefix_caching=False,
        num_spec_tokens=0,
        async_scheduling=False,
        max_num_batched_tokens=8,
        max_model_len=32,
        full_sequence_must_fit=False,
        mm_item_tokens=4,
    )
    assert plain.multimodal and "multimodal" in plain.tags() and plain.encoder_budget == 8
    assert attrs.evolve(plain, mm_item_tokens=12).encoder_budget == 12
    for bad in ({"async_scheduling": True}, {"num_spec_tokens": 2}, {"pipeline_parallel": 2}):
        with pytest.raises(ValueError, match="multimodal"):
            attrs.evolve(plain, **bad)


def _image_shape(**kw) -> Shape:
    return Shape(
        block_size=4,
        swa_block_size=4,
        sliding_window=None,
        extra_blocks=4,
        prefix_caching=False,
        num_spec_tokens=0,
        async_scheduling=False,
        max_num_batched_tokens=8,
        max_model_len=32,
        full_sequence_must_fit=False,
        max_tokens=2,
        mm_item_tokens=4,
        **kw,
    )


def test_an_image_the_budget_cannot_take_stops_the_step_before_it():
    """Two images of 4 in one prompt, an encoder budget of 4: the step stops before the second
    (the budget left is 0), which the next step encodes; the first step computes the tokens
    before the second image only (vLLM's ``_try_schedule_encoder_inputs``)."""
    shape = _image_shape()
    ref = ReferenceScheduler(shape, encoder_budget=4, encoder_cache_size=8)
    images = (MMFeature("x", 0, 4), MMFeature("y", 5, 4))
    ref.add(0, list(range(12)), 2, ExtraKeys(None, None, images))
    first = ref.schedule()
    assert [(s.seq_id, s.start, s.num_tokens) for s in first.scheduled] == [(0, 0, 5)]
    assert first.encoder_inputs == ((0, 0),) and ref.encoder_stops["budget"] == 1
    ref.update(first, {0: []})
    second = ref.schedule()
    assert [(s.seq_id, s.start, s.num_tokens) for s in second.scheduled] == [(0, 5, 7)]
    assert second.encoder_inputs == ((0, 1),)


def test_a_cached_image_is_read_not_encoded():
    """A second request carrying the first's image while its output is cached reads it: only
    the first request's step encodes it.  The broken cache keyed by request encodes it again."""
    shape = _image_shape()
    image = (MMFeature("x", 0, 4),)
    plans = {}
    for cls in (ReferenceScheduler, MULTIMODAL_ONLY["encodes-shared-images-again"][0]):
        ref = cls(shape, encoder_budget=8, encoder_cache_size=8)
        ref.add(0, [3, 3, 3, 3, 1], 2, ExtraKeys(None, None, image))
        ref.add(1, [3, 3, 3, 3, 2], 2, ExtraKeys(None, None, image))
        plans[cls] = ref.schedule().encoder_inputs
    assert plans[ReferenceScheduler] == ((0, 0),)
    assert plans[MULTIMODAL_ONLY["encodes-shared-images-again"][0]] == ((0, 0), (1, 0))


def test_an_unread_output_is_evicted_oldest_first():
    cache = EncoderCache(8)
    cache.allocate(0, 0, "x", 4)
    cache.allocate(1, 0, "y", 4)
    cache.release(0, 0, "x")
    cache.release(1, 0, "y")
    assert cache.freeable_slots == 8 and cache.free_slots == 0
    assert cache.fits(4, 8, 0) and cache.evicted == 1
    assert not cache.touch(2, 0, "x") and cache.touch(2, 0, "y")


@pytest.mark.parametrize("name", sorted(MULTIMODAL_ONLY))
def test_only_the_multimodal_differential_catches_a_broken_encoder_scheduler(name):
    variant, comparison = MULTIMODAL_ONLY[name]
    # Every invariant holds, in the multimodal shape too; without images the differential
    # finds no difference from the reference.
    run_state_machine_as_test(lambda: SchedulerMachine(variant, MULTIMODAL), settings=_settings(EXAMPLES // 2))
    run_state_machine_as_test(
        lambda: SchedulerMachine(variant, TEXT_ONLY, differential=Mode.RENAMING), settings=_settings(EXAMPLES // 2)
    )
    with pytest.raises(PolicyDifference) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(variant, MULTIMODAL, differential=Mode.RENAMING), settings=_settings()
        )
    found = caught.value
    assert not isinstance(found, SpecViolation | AssertionError), found
    assert found.comparison == comparison and found.policy == REFERENCE_OWN.id, found
    assert found.release == variant.name, found
    # Two requests with one image at least, and the step that encodes it again, after a few idle
    # steps the shrinker may leave in front (their number moves with the shape draws).
    busy = [t for t in found.trace if not (t.op == "step" and t.outcome.startswith("scheduled {}, preempted []"))]
    assert sum(t.op == "arrive" for t in found.trace) >= 2 and len(busy) <= 8, found
    text = str(found)
    assert "violat" not in text.lower() and not any(i in text for i in INVARIANTS), text
