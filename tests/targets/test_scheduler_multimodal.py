"""vLLM's own scheduler in the multimodal shape (``Shape.mm_item_tokens``): the model is a tiny
BLIP-2 kvspec writes (adapters/v1_scheduler_mm.py, nothing downloaded), so the scheduler builds
an encoder compute budget and an encoder cache and schedules each request's images
(``_try_schedule_encoder_inputs``, 0.33.0 sched/scheduler.py:2018-2215).

On scripted traces vLLM plans what the reference scheduler does (reference/encoder_cache.py):
an image the budget cannot take stops the step just before it; an image another request's
output already holds is read from the cache, not encoded again -- which the broken reference
keyed by request (``encodes-shared-images-again``) does not, and the differential sees.  A short
search of the multimodal shape compares every example to its end."""

from __future__ import annotations

import logging

import attrs
import pytest
from kvspec.reference.broken_scheduler import MULTIMODAL_ONLY
from kvspec.reference.policies import declared_for
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.groups import Shape
from kvspec.spec.prefix_hash import ExtraKeys, MMFeature
from kvspec.testing.scheduler.driver import SchedulerDriver
from kvspec.testing.scheduler.machine import reference_beside, retention_offer_of, shapes

from .conftest import VLLM, requires_vllm

on_v1 = requires_vllm("0.12.0", pin="0.33.0")
SHAPE = Shape(
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
)
ACCEPT, TOKENS = bytes(4), bytes([1, 2, 3, 0])


@pytest.fixture(scope="module")
def adapter():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    return VLLMV1SchedulerAdapter


def _beside(adapter, reference_cls=ReferenceScheduler, shape: Shape = SHAPE):
    """vLLM's scheduler and the reference (``reference_cls``) on its encoder budget and cache."""
    target = adapter(shape)
    reference = reference_beside(target, shape, declared_for(VLLM))
    if reference_cls is not ReferenceScheduler:
        reference = reference_cls(
            shape,
            num_blocks=target.num_blocks,
            policy=declared_for(VLLM),
            encoder_budget=target.encoder_budget,
            encoder_cache_size=target.encoder_cache_size,
        )
    return SchedulerDriver(target), SchedulerDriver(reference)


def _plans(drivers, arrivals, steps: int):
    """Each step's (scheduled (seq, start, tokens), encoder inputs) on both sides."""
    for driver in drivers:
        for seq, tokens, images in arrivals:
            driver.arrive(seq, tokens, 2, ExtraKeys(None, None, images))
    out = []
    for _ in range(steps):
        plans = [d.step(ACCEPT, TOKENS) for d in drivers]
        for d in drivers:
            assert d.check() == [], d.trace
        out.append([([(s.seq_id, s.start, s.num_tokens) for s in p.scheduled], p.encoder_inputs) for p in plans])
    return out


@on_v1
def test_the_release_builds_the_multimodal_shape(adapter):
    assert adapter.multimodal_refusal() is None
    target = adapter(SHAPE)
    # compute_mm_encoder_budget: max(token budget, the largest image), both the compute
    # budget and the cache size.
    assert target.encoder_budget == target.encoder_cache_size == SHAPE.encoder_budget == 8


@on_v1
def test_an_image_the_budget_cannot_take_stops_the_step_before_it(adapter):
    """Three images of 3, 9 embeddings past the 8-embedding budget, in a prompt the token
    budget would take 8 of: the first step encodes two and stops its tokens before the third,
    which the next step encodes."""
    shape = attrs.evolve(SHAPE, mm_item_tokens=3)
    images = (MMFeature("x", 0, 3), MMFeature("y", 3, 3), MMFeature("z", 6, 3))
    steps = _plans(_beside(adapter, shape=shape), [(0, [3] * 9 + [1], images)], 2)
    for vllm, ref in steps:
        assert vllm == ref, steps
    assert [vllm for vllm, _ in steps] == [([(0, 0, 6)], ((0, 0), (0, 1))), ([(0, 6, 4)], ((0, 2),))], steps


@on_v1
def test_a_shared_image_is_encoded_once(adapter):
    """Two requests carrying one image: vLLM and the reference encode it for the first only;
    the broken reference whose cache is keyed by request encodes it for both."""
    image = (MMFeature("x", 0, 4),)
    arrivals = [(0, [3, 3, 3, 3, 1], image), (1, [3, 3, 3, 3, 2], image)]
    (first,) = _plans(_beside(adapter), arrivals, 1)
    assert first[0] == first[1] == ([(0, 0, 5), (1, 0, 3)], ((0, 0),)), first
    broken = MULTIMODAL_ONLY["encodes-shared-images-again"][0]
    (first,) = _plans(_beside(adapter, broken), arrivals, 1)
    assert first[0][1] == ((0, 0),) and first[1][1] == ((0, 0), (1, 0)), first


@on_v1
def test_the_differential_holds_in_the_multimodal_shape(adapter):
    """``kvspec check``'s scheduler search narrowed to the multimodal shape: every verdict is a
    known finding of the release (F-KV9/scheduler before 0.31.0: a LoRA name and an equal salt
    keyed alike, which the shape's salts and adapters reach; F-KV10/scheduler on 0.12.0: an
    image named like either), and where a policy is declared
    every example is compared to its end with encoder inputs among what is compared."""
    from kvspec.cli.shapes import SCHEDULER_IMPL, run_scheduler_search
    from kvspec.testing.known import SHIPPED, load_known

    known = [k for k in load_known([SHIPPED]) if k.concerns(SCHEDULER_IMPL, VLLM)]
    within = shapes(retention_offer_of(adapter), (), True).filter(lambda s: s.multimodal)
    run = run_scheduler_search(
        adapter, known=known, shape_strategy=within, profile="ci", examples=25, steps=None, seed=1, focus=None
    )
    unknown = [
        (f.fingerprint, [str(v) for v in f.outcome.violations], f.outcome.trace)
        for f in run.search.found
        if f.known is None
    ]
    assert unknown == [], unknown
    assert run.summary.counts.examples["multimodal"] == run.summary.examples > 0, run.summary
    d = run.summary.differential
    if declared_for(VLLM) is not None:
        assert d.mm_examples_to_end == d.mm_examples > 0 and not d.ended and d.encoder_inputs > 0, d
