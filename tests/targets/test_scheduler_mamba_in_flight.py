"""FINDINGS C5 on vLLM 0.33.0's own Scheduler: in Mamba "align" mode (prefix caching) vLLM's
startup minimum counts two state blocks per request (``MambaSpec.max_memory_usage_bytes``,
kv_cache_interface.py:1135-1141: the block the next step reads and the block it writes), while
with more than one batch in flight (async scheduling, a pipeline) each batch in flight holds the
block its chunk writes until its output is processed (``remove_skipped_blocks`` frees by the
processed count, single_type_kv_cache_manager.py:1629-1657; kv_cache_manager.py:561-568).  A
sole request whose prompt fills the full-attention share of a pool at that minimum is then
preempted and recomputed, with nobody beside it; the sliding-window groups got the same
in-flight term in their sizing (``max_in_flight_tokens``, config/vllm.py:601-609).  Without a
batch in flight the same request runs straight through.  With hits inside a Mamba block
(``prefix_match_unit``) the preempted request never comes back: its resumption at its own
partial hit asks a copy-on-write block more (single_type_kv_cache_manager.py:1497-1518), and
the engine idles with it waiting."""

from __future__ import annotations

import logging

import attrs
import pytest
from kvspec.spec.groups import Shape
from kvspec.testing.scheduler.driver import SchedulerDriver
from kvspec.testing.scheduler.progress import drain

from .conftest import requires_vllm

pytestmark = requires_vllm("0.33.0", "0.33.0", pin="0.33.0")

# B=4 full attention + a Mamba "align" group, budget 4 of max_model_len 32, async scheduling,
# the pool at the startup minimum (8 + 2 blocks).
C5 = Shape(
    block_size=4, swa_block_size=4, sliding_window=None, extra_blocks=0, prefix_caching=True,
    num_spec_tokens=0, async_scheduling=True, max_num_batched_tokens=4, max_model_len=32,
    full_sequence_must_fit=False, max_tokens=2, mamba=True,
)
PROMPT = [0] * 29


def _drain(shape: Shape) -> tuple[object, list]:
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    target = VLLMV1SchedulerAdapter(shape)
    driver = SchedulerDriver.for_shape(target, shape)
    driver.arrive(0, PROMPT, shape.max_tokens)
    return target, drain(driver, driver.check)


@pytest.mark.parametrize(
    "shape", [C5, attrs.evolve(C5, async_scheduling=False, pipeline_parallel=2)], ids=["async", "pipeline"]
)
def test_c5_a_sole_mamba_request_is_preempted_at_the_startup_minimum(shape):
    target, found = _drain(shape)
    assert target.num_blocks == target.minimum_blocks
    assert [(v.invariant, v.kind) for v in found] == [("progress", "preempted-alone")], found


def test_c5_with_hits_inside_a_block_the_sole_request_never_resumes():
    """B=8, hashes at every token, budget = max_model_len = 64, async: the 61-token prompt runs
    0+56, 56+4 (to its last hash boundary), is preempted, and no later step schedules it."""
    shape = attrs.evolve(
        C5, block_size=8, swa_block_size=8, max_num_batched_tokens=64, max_model_len=64, max_tokens=1,
        prefix_match_unit=1,
    )
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    target = VLLMV1SchedulerAdapter(shape)
    driver = SchedulerDriver.for_shape(target, shape)
    driver.arrive(0, [0] * 61, 1)
    plans = [driver.step(bytes(4), bytes(4)) for _ in range(8)]
    assert [tuple(p.preempted) for p in plans[:3]] == [(), (), (0,)]
    assert target.live(0) and not any(p.scheduled for p in plans[3:]), plans
    assert driver.check() == []


def test_c5_control_one_batch_in_flight_runs_straight_through():
    target, found = _drain(attrs.evolve(C5, async_scheduling=False))
    assert found == [] and not target.live(0)
