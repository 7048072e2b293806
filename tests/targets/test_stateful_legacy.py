"""vLLM 0.6.3's legacy block managers against the spec.  The findings (FINDINGS.md) are
pinned: the machine must find each one from scratch within its example budget, so a change
that blinds the oracle fails here."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.spec.config import Config
from kvspec.spec.invariants import INVARIANTS
from kvspec.testing import KVCacheMachine, RunStats, SpecViolation
from kvspec.testing.blockmanager.driver import replay
from kvspec.testing.blockmanager.strategies import configs
from kvspec.testing.implementations import by_manager

from .conftest import requires_vllm

pytestmark = requires_vllm("0.6.3", "0.6.3", pin="0.6.3")


def _factory(manager):
    return by_manager(manager).factory


def _windowed(caching=False):
    # No swap: F11 (BlockSpaceManagerV1 "Double free!" on a windowed swap-out) is a crash that
    # would pre-empt the pinned window findings on some search paths.
    return configs(max_blocks=16, prefix_caching=st.just(caching), swap=False).filter(
        lambda c: c.sliding_window is not None
    )


def _full(caching, max_lookahead=3):
    return configs(
        max_blocks=16, prefix_caching=st.just(caching), max_lookahead=max_lookahead
    ).filter(lambda c: c.sliding_window is None)


def _find(manager, strategy, invariant, machine=None, **budget) -> SpecViolation:
    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(
            lambda: KVCacheMachine(
                _factory(manager), strategy, focus={invariant}, **(machine or {})
            ),
            settings=settings(settings(), report_multiple_bugs=False, **budget),
        )
    assert {v.invariant for v in caught.value.violations} == {invariant}
    return caught.value


def test_stateful_v2_seed_bug_found_from_scratch():
    """F1: can_allocate caps the sliding-window need, allocate takes every prompt block."""
    found = _find("v2", _windowed(), "admission-soundness")
    assert "answered OK, then the allocation failed" in str(found)
    # A handful of operations: where the shrinker stops depends on the first failing example
    # (at the ci budget: admits filling the pool, then the prompt that overflows it, 10 steps).
    assert len(found.trace) <= 12, found


def test_stateful_v2_prefill_exceeds_the_window():
    """F2: allocate holds every prompt block of a sliding-window sequence."""
    found = _find("v2", _windowed(), "window-bound")
    # A handful of operations: where the shrinker stops depends on the first failing example
    # (at the ci budget: admits filling the pool, then the prompt that overflows it, 10 steps).
    assert len(found.trace) <= 12, found


def test_stateful_v1_overwrites_full_blocks_in_place():
    """F3: BlockSpaceManagerV1's cyclic sliding-window reuse breaks block immutability."""
    found = _find("v1", _windowed(), "immutability")
    assert "overwrites position" in str(found)
    # A handful of operations: where the shrinker stops depends on the first failing example
    # (at the ci budget: admits filling the pool, then the prompt that overflows it, 10 steps).
    assert len(found.trace) <= 12, found


def test_stateful_v2_chunked_prefill_hits_uncomputed_blocks():
    """F4: with prefix caching, blocks a chunked prefill has not computed yet are marked
    computed at scheduling and can be handed out as hits."""
    found = _find("v2", _full(True), "prefix-cache-consistency")
    assert "only allocated, not written" in str(found)


def test_stateful_v2_full_attention_without_caching_holds():
    stats = RunStats()
    run_state_machine_as_test(
        # F12 (lookahead slots + swap), F13 (freeing a swapped-out sequence) and F14 (the
        # progress livelock of a pool-filling chunked prompt) are pinned separately; this run
        # has no lookahead, frees only running or waiting sequences and watches the rest.
        lambda: KVCacheMachine(
            _factory("v2"),
            _full(False, max_lookahead=0),
            stats=stats,
            free_swapped=False,
            focus=set(INVARIANTS) - {"progress"},
        ),
        settings=settings(settings(), report_multiple_bugs=False),
    )
    for op in ("admit", "step", "fork", "swap_out", "preempt"):
        assert stats.by_op.get(op, 0) >= 5, stats


def test_stateful_v2_swap_out_ignores_lookahead_blocks():
    """F12: can_swap_out counts the full blocks and the blocks the unseen tokens touch, not
    the empty blocks a lookahead reservation (multi-step, speculative decoding) holds; then
    swap_out runs the CPU pool dry."""
    with_lookahead_and_swap = _full(False).filter(
        lambda c: c.max_lookahead > 0 and c.num_cpu_blocks > 0
    )
    found = _find(
        "v2",
        with_lookahead_and_swap,
        "admission-soundness",
        machine={"free_swapped": False},  # F13, a crash, is pinned below
        max_examples=400,
    )
    assert "swap_out after can_swap_out said yes" in str(found), found
    assert len(found.trace) <= 12, found  # a handful (the minimum is 3: admit, step, swap_out)


def test_stateful_v1_recompute_of_a_forked_group_miscounts_refs():
    """F9: BlockSpaceManagerV1.allocate sets every block's ref_count to the group's
    num_seqs(), which still counts finished siblings."""
    # Five operations in a precise order (fork after prefill, free the child, preempt, re-admit):
    # more examples than the profile's, so that the pin does not hang on one search path.
    found = _find("v1", _full(False), "refcount-exact", max_examples=600)
    assert any(s.op == "fork" for s in found.trace), found


def test_v2_freeing_a_swapped_out_sequence_corrupts_the_cpu_block_pool():
    """F13: swap-out keeps the GPU allocator's Block objects on the CPU side
    (NaiveBlockAllocator.swap_in reuses them), so freeing a swapped-out sequence returns a GPU
    BlockPool id into the CPU BlockPool; the next CPU allocation indexes past that pool."""
    admit = [{"op": "admit", "args": {"seq": i, "tokens": [0], "num_new_tokens": 1}} for i in range(5)]
    trace = [
        *admit,
        *({"op": "free", "args": {"seq": i}} for i in range(4)),
        {"op": "swap_out", "args": {"seq": 4}},
        {"op": "free", "args": {"seq": 4}},  # the request is aborted while swapped out
        {"op": "admit", "args": {"seq": 5, "tokens": [0], "num_new_tokens": 1}},
        {"op": "swap_out", "args": {"seq": 5}},
    ]
    config = Config(block_size=8, num_blocks=5, num_cpu_blocks=1, max_lookahead=0)
    with pytest.raises(IndexError):
        replay(_factory("v2")(config), trace)
