"""A sequence whose KV a connector is sending (``Status.SENDING``): it finished, yet its GPU
blocks are legitimately held until the worker reports the send (vLLM's deferred free).

``refcount-exact`` counts its table as live, ``no-leak`` accepts its blocks, ``kv-readback``
reads its KV back (a send reads it) and flags its table gone before the send ends
(freed-while-sending); once the driver forgets it (the send reported), ``no-leak`` requires
the blocks freed.  The incremental checker agrees with the whole-world definition on each.
"""

from __future__ import annotations

import pytest
from kvspec.spec.config import Config
from kvspec.spec.groups import KV_CONNECTORS, SHAPE_TAGS, Shape
from kvspec.spec.invariants import check_world
from kvspec.spec.state import Device, KVState, PoolView, SeqModel, Status, TableView, World
from kvspec.testing.blockmanager.incremental import Judges

MEMORY = {(Device.GPU, 0, 0): (0, 5), (Device.GPU, 0, 1): (1, 6), (Device.GPU, 1, 0): (2, 7)}


def _world(status: Status | None, held: bool = True, refcounts=(1, 1, 0), memory=MEMORY) -> World:
    pool = PoolView((0, 1, 2), dict(enumerate(refcounts)), (2,) if held else (0, 1, 2), (), (), frozenset())
    tables = {0: TableView(0, Device.GPU, (0, 1))} if held else {}
    seqs = {} if status is None else {0: SeqModel(0, (5, 6, 7), status=status, num_computed=3, step=(2, 3))}
    return World(Config(block_size=2, num_blocks=3), KVState(gpu=pool, tables=tables), seqs, dict(memory))


def _both(*worlds: World) -> list:
    """Every invariant on each world in turn, judged incrementally (one checker following the
    changes) and by the whole-world definition, which must agree; the last world's violations."""
    judges = Judges("both")
    found: list = []
    for world in worlds:
        found = judges.judge({(Device.GPU, b) for b in range(3)})("pool", world, None)
    return found


def test_a_sending_sequence_holds_its_blocks_legitimately():
    world = _world(Status.SENDING)
    assert check_world(world) == []
    assert _both(world) == []


def test_a_sending_sequence_whose_blocks_were_freed_is_flagged():
    world = _world(Status.SENDING, held=False, refcounts=(0, 0, 0))
    found = check_world(world)
    assert [(v.invariant, v.kind) for v in found] == [("kv-readback", "freed-while-sending")]
    after_held = _both(_world(Status.SENDING), world)
    assert [(v.invariant, v.kind) for v in after_held] == [("kv-readback", "freed-while-sending")]


def test_a_sending_sequence_reads_its_kv_back():
    """A block held for a send must keep its KV: overwritten, the send reads the wrong KV."""
    world = _world(Status.SENDING, memory={**MEMORY, (Device.GPU, 1, 0): (2, 4)})
    assert {v.invariant for v in check_world(world)} == {"kv-readback"}


@pytest.mark.parametrize("status", [None, Status.WAITING])
def test_blocks_kept_after_the_send_was_reported_leak(status):
    """The driver forgets a request once its send is reported: a table left is a leak."""
    world = _world(status)
    found = {v.invariant for v in check_world(world)}
    assert "no-leak" in found and "refcount-exact" in found
    assert "no-leak" in {v.invariant for v in _both(_world(Status.SENDING), world)}


def test_the_connector_shape_is_tagged_and_checked():
    kwargs = dict(
        block_size=4, swa_block_size=4, sliding_window=None, extra_blocks=1, prefix_caching=False,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=8, max_model_len=16,
        full_sequence_must_fit=False,
    )
    shape = Shape(**kwargs, kv_connector=KV_CONNECTORS[0])
    assert "kv-connector" in shape.tags() and "kv-connector" in SHAPE_TAGS
    assert f"connector={KV_CONNECTORS[0]}" in shape.describe()
    assert "kv-connector" not in Shape(**kwargs).tags()
    with pytest.raises(ValueError, match="unknown KV connector"):
        Shape(**kwargs, kv_connector="NoSuchConnector")


def test_the_shapes_draw_a_connector_only_where_one_is_offered():
    """A release offering no connector never draws one; one that offers draws it, never beside a
    Mamba group (the worker plays no boundary-state offloads)."""
    from hypothesis import find, given, settings
    from kvspec.testing.scheduler.machine import shapes

    assert find(shapes(connectors=KV_CONNECTORS), lambda s: s.kv_connector is not None).kv_connector in KV_CONNECTORS

    @settings(max_examples=200, deadline=None, database=None)
    @given(offered=shapes(connectors=KV_CONNECTORS), plain=shapes())
    def check(offered, plain):
        assert plain.kv_connector is None
        assert not (offered.mamba and offered.kv_connector is not None)

    check()


def test_sends_reported_in_one_output_are_iterated_in_the_order_reported():
    """vLLM frees the blocks of ``finished_sending`` in its iteration order; a plain set of
    strings iterates in the process's hash order, so the adapter hands vLLM one that iterates
    as the reference scheduler frees (adapters/v1_scheduler.py ``SentInOrder``)."""
    from kvspec.adapters.v1_scheduler import SentInOrder

    ids = [f"req-{n}" for n in (7, 2, 11, 0, 5)]
    sent = SentInOrder(ids)
    assert list(sent) == ids and set(sent) == set(ids) and isinstance(sent, set)
    assert list(SentInOrder(ids + ids[:2])) == ids  # a request reported twice is one send
    assert not SentInOrder()  # nothing sent: vLLM is handed None
