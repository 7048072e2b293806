"""The KV-cache usage vLLM V1 reports (``KVCacheManager.usage``; the scheduler's
``get_kv_cache_usage``) is observed and checked by ``conservation``: the share of the pool held
by requests, with unreferenced cached blocks counted reclaimable."""

from __future__ import annotations

import logging

import attrs
import pytest
from kvspec.spec.config import Config
from kvspec.spec.groups import Shape, pool_state
from kvspec.spec.invariants import conservation
from kvspec.spec.state import World

from .conftest import requires_vllm

PROMPT = tuple(range(1, 9))  # two full blocks of 4


@pytest.fixture(scope="module", autouse=True)
def quiet():
    logging.getLogger("vllm").setLevel(logging.ERROR)


def _faults(state) -> list[str]:
    return [str(v) for v in conservation(World(Config(block_size=4, num_blocks=len(state.gpu.ids)), state, {}, {}))]


@requires_vllm("0.9.0", pin="0.33.0")
def test_block_manager_usage_is_observed_and_checked():
    from kvspec.adapters.v1 import make_v1

    target = make_v1(Config(block_size=4, num_blocks=6, prefix_caching=True))
    target.admit(0, PROMPT, len(PROMPT))
    held = target.observe()
    assert held.gpu.usage == pytest.approx(2 / 6) and _faults(held) == []
    target.free(0)
    cached = target.observe()  # both blocks unreferenced and cached: reclaimable, not used
    assert len(cached.gpu.evictable) == 2 and cached.gpu.usage == 0.0 and _faults(cached) == []
    wrong = attrs.evolve(cached, gpu=attrs.evolve(cached.gpu, usage=2 / 6))
    assert any("reports usage" in f for f in _faults(wrong))


@requires_vllm("0.10.1", pin="0.33.0")
def test_scheduler_usage_is_observed():
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter
    from kvspec.testing.scheduler.driver import SchedulerDriver

    shape = Shape(
        block_size=4, swa_block_size=4, sliding_window=None, extra_blocks=2, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=32, max_model_len=32,
        full_sequence_must_fit=False, max_tokens=4,
    )
    driver = SchedulerDriver(VLLMV1SchedulerAdapter(shape))
    driver.arrive(0, PROMPT, 4)
    driver.step(bytes([0, 1, 2, 3]), bytes([1, 2, 3, 0]))
    assert driver.check() == []
    pool = driver.state.pool
    assert pool.usage is not None and pool.usage > 0
    assert pool.usage == pytest.approx(len(pool.in_use()) / len(pool.ids))
    assert _faults(pool_state(driver.state)) == []
