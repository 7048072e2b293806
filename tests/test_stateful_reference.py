"""The reference satisfies the spec: the machine runs every operation on it across
configurations and finds nothing."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference import ReferenceManager
from kvspec.testing import KVCacheMachine, RunStats
from kvspec.testing.blockmanager.strategies import configs


def _run(strategy, **kw) -> RunStats:
    stats = RunStats()
    run_state_machine_as_test(
        lambda: KVCacheMachine(ReferenceManager, strategy, stats=stats, **kw), settings=settings()
    )
    return stats


def _assert_meaningful(stats: RunStats, *ops: str) -> None:
    # A run that executed nothing must not pass: every named operation really ran.
    assert stats.examples >= settings().max_examples // 2, stats
    for op in ops:
        assert stats.by_op.get(op, 0) >= 10, f"{op} barely ran: {stats}"


def test_stateful_reference_all_configurations():
    stats = _run(configs())
    _assert_meaningful(stats, "admit", "step", "fork", "free", "preempt", "swap_out", "swap_in")
    print(f"reference, all configurations: {stats}")


def test_stateful_reference_sliding_window_with_prefix_caching():
    strategy = configs(prefix_caching=st.just(True)).filter(lambda c: c.sliding_window is not None)
    stats = _run(strategy)
    _assert_meaningful(stats, "admit", "step", "reset_prefix_cache")


def test_stateful_reference_realistic_sizes():
    # Pools of hundreds of blocks and prompts of a few hundred tokens, fewer examples.
    strategy = configs(block_sizes=st.sampled_from([16]), max_blocks=512)
    stats = RunStats()
    run_state_machine_as_test(
        lambda: KVCacheMachine(ReferenceManager, strategy, stats=stats, max_prompt_blocks=24),
        settings=settings(settings(), max_examples=max(10, settings().max_examples // 5)),
    )
    assert stats.by_op.get("step", 0) >= 10, stats
