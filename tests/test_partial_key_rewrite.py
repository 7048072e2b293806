"""Immutability's room for legacy BlockSpaceManagerV1's partial-key sharing (spec/kv_memory.py
``_sole_rewrite_past_key``): a block shared by its 1-token partial key, whose slot 1 already
holds the first holder's position 1, is left to the second holder when the first copies it on
write and is freed; the second then writes its own position 1 there.  Found by the default
``--impl legacy-v1`` search on vLLM 0.6.3 (B=3 N=2, prefix caching: ``admit(0,[0])``,
``step 0``, ``admit(1,[0])``, ``step 0`` with a copy, ``free 0``, ``step 1``)."""

from __future__ import annotations

import pytest
from kvspec.spec.kv_memory import OVERWRITE, plan_step_writes
from kvspec.spec.prefix_hash import NO_EXTRA, key_of
from kvspec.spec.state import Device, KVState, PoolView, SeqModel, TableView

GPU = Device.GPU
MEMORY = {(GPU, 0, 0): (0, 0), (GPU, 0, 1): (1, 0)}  # seq 0 wrote positions 0 and 1 (token 0)


def _state(tables: dict[int, tuple[int, ...]], refcount: int) -> KVState:
    pool = PoolView(ids=(0, 1), refcounts={0: refcount, 1: 0}, free=(1,),
                    cached=((key_of((0,), 1, NO_EXTRA), 0),), computed=frozenset({0}))
    return KVState(gpu=pool, tables={s: TableView(s, GPU, slots) for s, slots in tables.items()})


def _overwrites(state: KVState, start: int, tokens: tuple[int, ...]) -> list[str]:
    seq = SeqModel(seq_id=1, tokens=tokens)
    _, faults = plan_step_writes(state, seq, start, start + 1, 3, MEMORY)
    return [f.message for f in faults if f.kind == OVERWRITE]


def test_the_sole_holder_rewrites_a_position_past_the_partial_key():
    assert _overwrites(_state({1: (0,)}, 1), 1, (0, 5)) == []


@pytest.mark.parametrize(
    ("tables", "refcount", "start", "tokens"),
    [
        ({1: (0,), 0: (0,)}, 1, 1, (0, 5)),  # another table still maps the block (a fork without incref)
        ({1: (0,)}, 2, 1, (0, 5)),  # the block is still shared
        ({1: (0,)}, 1, 0, (7, 5)),  # a position the partial key covers
    ],
    ids=["other-table", "shared", "inside-the-key"],
)
def test_other_rewrites_are_still_faults(tables, refcount, start, tokens):
    assert _overwrites(_state(tables, refcount), start, tokens)


def test_a_write_at_another_position_is_still_an_overwrite():
    """F3's cyclic reuse: position 4 into the slot holding position 1 (ring of one 3-slot block)."""
    seq = SeqModel(seq_id=1, tokens=(0, 5, 5, 5, 5))
    _, faults = plan_step_writes(_state({1: (0, 0)}, 1), seq, 4, 5, 3, MEMORY)
    assert [f.kind for f in faults] == [OVERWRITE]
