"""The V1 engine's KVCacheManager against the spec (vllm/v1/core), full attention and
sliding window, prefix caching on and off."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.testing import KVCacheMachine, RunStats
from kvspec.testing.blockmanager.strategies import configs
from kvspec.testing.implementations import factory

from .conftest import requires_vllm

pytestmark = requires_vllm("0.11.0", pin="0.33.0")


_factory = factory("v1")


WINDOWS = {
    "full-attention": lambda c: c.sliding_window is None,
    "sliding-window": lambda c: c.sliding_window is not None,
}


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("attention", sorted(WINDOWS))
def test_stateful_v1_kv_cache_manager_holds_every_invariant(attention, caching):
    strategy = configs(swap=False, max_blocks=16, prefix_caching=st.just(caching)).filter(
        WINDOWS[attention]
    )
    stats = RunStats()
    run_state_machine_as_test(
        lambda: KVCacheMachine(_factory, strategy, stats=stats),
        settings=settings(settings(), report_multiple_bugs=False),
    )
    assert stats.by_op.get("step", 0) >= 20 and stats.by_op.get("admit", 0) >= 20, stats
    if caching:
        assert stats.by_op.get("preempt", 0) >= 5, stats


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_stateful_v1_differential_against_the_reference(caching):
    """Lockstep with the reference, comparing outcomes (counts and renaming differ on
    policy here: V1 reserves lookahead at admission and keeps out-of-window hit blocks for
    the admission step)."""
    from kvspec.testing.blockmanager.differential import DifferentialMachine, Mode

    strategy = configs(swap=False, max_blocks=16, prefix_caching=st.just(caching))
    stats = RunStats()
    run_state_machine_as_test(
        lambda: DifferentialMachine(_factory, strategy, stats=stats, mode=Mode.OUTCOMES),
        settings=settings(settings(), report_multiple_bugs=False),
    )
    assert stats.by_op.get("step", 0) >= 20, stats
