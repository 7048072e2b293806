"""The prefix-cache retention the engine runs by default (``CacheConfig``'s
``prefix_cache_retention_interval`` 0, vLLM 0.33.0 config/cache.py:275) reaches vLLM's sparse
code through the scheduler adapter: on the same trace a sliding-window group and a Mamba group
cache fewer blocks than under dense retention (``reachable_block_mask``,
single_type_kv_cache_manager.py:545-605 and :1556-1610), so ``Shape.retention_interval`` keeps
mattering.  A periodic interval off the scheduler's block size, or beside no such group, is a
refused shape (kv_cache_coordinator.py:33-62)."""

from __future__ import annotations

import logging

import attrs
import pytest
from kvspec.spec.errors import ConfigError
from kvspec.spec.groups import Shape
from kvspec.testing.scheduler.driver import SchedulerDriver

from .conftest import requires_vllm

on_030 = requires_vllm("0.30.0", pin="0.33.0")
on_033 = requires_vllm("0.33.0", pin="0.33.0")
before_030 = requires_vllm("0.10.1.1", "0.25.1", pin="0.25.1")
B = 4
PROMPT = [1, 2, 3, 0] * 8  # eight full blocks


@pytest.fixture(scope="module")
def adapter():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    return VLLMV1SchedulerAdapter


SWA = Shape(
    block_size=B, swa_block_size=B, sliding_window=B, extra_blocks=4, prefix_caching=True,
    num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=64, max_model_len=64,
    full_sequence_must_fit=False, max_tokens=2,
)
# A Mamba group publishes a state only where a step ends: a block per step.
MAMBA = attrs.evolve(SWA, sliding_window=None, mamba=True, max_num_batched_tokens=B)


def _cached_after_prompt(adapter, shape: Shape) -> list[int]:
    """Cache entries per group once the prompt is computed (in steps of the token budget)."""
    driver = SchedulerDriver(adapter(shape))
    driver.arrive(0, PROMPT, shape.max_tokens)
    for _ in range(-(-len(PROMPT) // shape.max_num_batched_tokens)):
        driver.step(bytes([0, 1, 2, 3]), bytes([1, 2, 3, 0]))
        assert driver.check() == [], driver.trace
    return [len(g.cached) for g in driver.state.groups]


@on_030
def test_the_engine_default_is_sparse(adapter):
    assert adapter.retention_offer().configurable and adapter.retention_offer().engine_default == 0


@pytest.mark.parametrize(
    "shape",
    [pytest.param(SWA, marks=on_030, id="sliding-window"), pytest.param(MAMBA, marks=on_033, id="mamba")],
)
def test_sparse_retention_caches_fewer_local_blocks(adapter, shape):
    """Eight full blocks: dense retention caches all eight in either group, the engine's
    default only the replay boundary's (one), an interval of four blocks one per interval and
    the boundary's (three); the full-attention group caches every block whatever the retention."""
    dense = _cached_after_prompt(adapter, attrs.evolve(shape, retention_interval=None))
    sparse = _cached_after_prompt(adapter, attrs.evolve(shape, retention_interval=0))
    periodic = _cached_after_prompt(adapter, attrs.evolve(shape, retention_interval=4 * B))
    assert dense[0] == sparse[0] == periodic[0] == len(PROMPT) // B, (dense, sparse, periodic)  # full attention
    assert sparse[1] < periodic[1] < dense[1], (dense, sparse, periodic)


@on_030
@pytest.mark.parametrize(
    "shape",
    [
        attrs.evolve(SWA, retention_interval=B + 1),  # not a multiple of the scheduler's block size
        attrs.evolve(SWA, sliding_window=None, retention_interval=B),  # no sliding-window or Mamba group
    ],
    ids=["off-block", "full-attention-only"],
)
def test_a_retention_vllm_refuses_is_a_refused_shape(adapter, shape):
    with pytest.raises(ConfigError, match="refuses the retention"):
        adapter(shape)


@before_030
def test_a_release_without_the_field_runs_dense_only(adapter):
    assert not adapter.retention_offer().configurable and adapter.retention_offer().engine_default is None
    with pytest.raises(ConfigError, match="dense retention only"):
        adapter(attrs.evolve(SWA, retention_interval=0))
