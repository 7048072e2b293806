"""Recurrent-state (Mamba) groups (spec/groups.py ``state_faults``, spec/kv_memory.py
``plan_state_write``): a state block holds the state after exactly the tokens up to where it
was written, a cached state block the state after exactly its key's chain, and a request holds
at most ``GroupSpec.state_blocks`` real blocks.  Hand-built worlds each rule flags, and one it
accepts."""

from __future__ import annotations

import pytest
from kvspec.spec.config import Config
from kvspec.spec.groups import GroupSpec, Shape, state_faults
from kvspec.spec.kv_memory import CACHED_WRITE, SHARED_WRITE, STATE_SLOT, UNMAPPED, plan_state_write, state_of
from kvspec.spec.prefix_hash import PrefixKey
from kvspec.spec.state import Device, KVState, PoolView, SeqModel, Status, TableView, World

B = 4
TOKENS = (1, 2, 3, 0, 1, 2, 3, 0, 2, 2)
MAMBA = GroupSpec("mamba", B, state_blocks=2)


def _world(
    slots: tuple[int | None, ...],
    num_computed: int,
    memory: dict,
    cached: tuple[tuple[PrefixKey, int], ...] = (),
    refcounts: dict[int, int] | None = None,
) -> World:
    held = [b for b in slots if b is not None]
    ids = tuple(range(8))
    rc = refcounts or {b: int(b in held) for b in ids}
    pool = PoolView(
        ids=ids,
        refcounts=rc,
        free=tuple(b for b in ids if rc[b] == 0),
        cached=cached,
        computed=frozenset(b for _, b in cached),
    )
    state = KVState(gpu=pool, tables={0: TableView(0, Device.GPU, slots)})
    seq = SeqModel(0, TOKENS, num_computed=num_computed, status=Status.RUNNING, prompt_len=8)
    return World(Config(block_size=B, num_blocks=8, prefix_caching=True), state, {0: seq}, memory)


def _cell(block: int) -> tuple[Device, int, int]:
    return (Device.GPU, block, STATE_SLOT)


def test_a_running_state_in_its_block_and_a_cached_boundary_state_hold():
    key = PrefixKey(TOKENS[:8])
    memory = {_cell(3): state_of(TOKENS[:8]), _cell(5): state_of(TOKENS[:9])}
    world = _world((None, 3, 5), 9, memory, cached=((key, 3),))
    assert list(state_faults(world, MAMBA)) == []


def test_a_state_block_holding_another_count_is_a_readback_fault():
    memory = {_cell(5): state_of(TOKENS[:8])}  # the worker left the state after 8, not 9
    found = list(state_faults(_world((None, None, 5), 9, memory), MAMBA))
    assert [v.invariant for v in found] == ["kv-readback"], found


def test_a_state_the_group_dropped_is_a_readback_fault():
    found = list(state_faults(_world((None, 3, None), 9, {_cell(3): state_of(TOKENS[:8])}), MAMBA))
    assert [v.invariant for v in found] == ["kv-readback"], found


def test_a_cached_state_block_must_hold_its_keys_state():
    key = PrefixKey(TOKENS[:8])
    memory = {_cell(3): state_of(TOKENS[:7]), _cell(5): state_of(TOKENS[:9])}
    found = list(state_faults(_world((None, 3, 5), 9, memory, cached=((key, 3),)), MAMBA))
    assert [v.invariant for v in found] == ["prefix-cache-consistency"], found


def test_a_cached_state_block_with_nothing_written_cannot_be_handed_out():
    key = PrefixKey(TOKENS[:4])
    world = _world((None, None, 5), 9, {_cell(5): state_of(TOKENS[:9])}, cached=((key, 2),))
    assert [v.invariant for v in state_faults(world, MAMBA)] == ["prefix-cache-consistency"]


def test_more_real_blocks_than_the_state_group_holds_is_a_bound_fault():
    memory = {_cell(5): state_of(TOKENS[:9])}
    found = list(state_faults(_world((1, 3, 5), 9, memory), MAMBA))
    assert [v.invariant for v in found] == ["window-bound"], found


def test_state_writes_go_to_the_block_of_the_last_token():
    world = _world((None, 3, 5), 9, {_cell(5): state_of(TOKENS[:9])})
    seq = world.seqs[0]
    # In place: the running state advances in its uncached, unshared block.
    writes, faults = plan_state_write(world.state, seq, 10, B, world.memory)
    assert faults == [] and [(w.cell, w.kv) for w in writes] == [(_cell(5), state_of(TOKENS))]
    # A slot the group nulled has no block to hold the state.
    _, faults = plan_state_write(_world((None, 3, None), 9, {}).state, seq, 10, B, {})
    assert [f.kind for f in faults] == [UNMAPPED]


def test_a_state_write_into_a_cached_or_shared_block_is_a_fault():
    key = PrefixKey(TOKENS[:8])
    world = _world((None, 3), 8, {_cell(3): state_of(TOKENS[:8])}, cached=((key, 3),))
    seq = world.seqs[0]
    _, faults = plan_state_write(world.state, seq, 7, B, world.memory)
    assert [f.kind for f in faults] == [CACHED_WRITE]
    _, faults = plan_state_write(world.state, seq, 8, B, world.memory)
    assert faults == []  # the very state the key claims
    shared = _world((None, 3), 8, {_cell(3): state_of(TOKENS[:8])}, refcounts={b: 0 for b in range(8)} | {3: 2})
    _, faults = plan_state_write(shared.state, seq, 7, B, shared.memory)
    assert [f.kind for f in faults] == [SHARED_WRITE]


def test_mamba_shapes():
    common = dict(
        block_size=4, swa_block_size=4, sliding_window=None, extra_blocks=0, num_spec_tokens=0,
        max_num_batched_tokens=32, max_model_len=32, full_sequence_must_fit=False, mamba=True,
    )
    align = Shape(prefix_caching=True, async_scheduling=True, **common)
    none = Shape(prefix_caching=False, async_scheduling=False, **common)
    assert align.mamba_cache_mode == "align" and none.mamba_cache_mode == "none"
    assert "hybrid-mamba" in align.tags() and "hybrid-block-sizes" not in align.tags()
    assert align.groups()[1] == GroupSpec("mamba", 4, state_blocks=3)
    assert none.groups()[1] == GroupSpec("mamba", 32, state_blocks=1)
    assert (align.scheduler_block_size, none.scheduler_block_size) == (4, 32)
    with pytest.raises(ValueError):
        Shape(prefix_caching=False, async_scheduling=False, **{**common, "sliding_window": 4})
