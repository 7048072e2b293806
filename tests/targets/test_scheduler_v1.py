"""vLLM's own V1 scheduler (Scheduler / AsyncScheduler) in production shapes: hybrid
KV-cache groups, async scheduling, speculative decoding, token-budget chunking,
``full_sequence_must_fit`` on and off, pools at vLLM's startup minimum.  Every invariant per
group and over the shared pool (spec/groups.py), checked by the scheduler machine."""

from __future__ import annotations

import logging

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.spec.groups import SHAPE_TAGS, Shape
from kvspec.testing.scheduler_driver import SchedulerDriver, ShapeCounts
from kvspec.testing.scheduler_machine import SchedulerMachine, shapes

from .conftest import requires_vllm

pytestmark = requires_vllm("0.33.0", pin="0.33.0")


@pytest.fixture(scope="module")
def adapter():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    return VLLMV1SchedulerAdapter


def test_hybrid_scheduler_is_built_as_production_builds_it(adapter):
    shape = Shape(
        block_size=4, swa_block_size=2, sliding_window=5, extra_blocks=0, prefix_caching=True,
        num_spec_tokens=2, async_scheduling=False, max_num_batched_tokens=8, max_model_len=32,
        full_sequence_must_fit=True, max_tokens=6,
    )
    target = adapter(shape)
    assert type(target.manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert target.num_blocks == target.minimum_blocks  # vLLM's startup minimum
    driver = SchedulerDriver(target)
    driver.arrive(0, [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3], 6)
    for i in range(6):
        driver.step(bytes([i, 1, 2, 3]), bytes([1, 2, 3, 0]))
        assert driver.check() == []
    assert driver.counts["chunks"] >= 1 and driver.counts["draft_steps"] >= 1, driver.counts
    assert driver.finish() == []


@pytest.mark.parametrize("tag", SHAPE_TAGS)
def test_scheduler_holds_every_invariant_in_shape(adapter, tag):
    counts = ShapeCounts()
    within = shapes().filter(lambda s: tag in s.tags())
    run_state_machine_as_test(
        lambda: SchedulerMachine(adapter, within, counts=counts),
        settings=settings(settings(), max_examples=40, report_multiple_bugs=False, deadline=None),
    )
    assert counts.operations[tag] >= 200, counts
