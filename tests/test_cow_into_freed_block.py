"""A copy-on-write copy into a block the same operation leaves free starts no life there.

Legacy BlockSpaceManagerV2 with prefix caching: a forked sequence's append copies its shared
partial block into a fresh one (0.6.3 vllm/core/block/naive_block.py:381-383 ->
prefix_caching_block.py:464-487 ``cow_block_if_not_appendable``, which records the copy), the block fills,
and ``promote_to_immutable_block`` finds its content already cached: the sequence takes the
cached block and the fresh one is freed in the same call (:453-460).  The copy is still handed
to the worker (block_manager_v2.py:245 ``clear_copy_on_writes``).  Nothing reads that free block; the next
allocation that hands it out starts a new life.  ``kvspec check --vllm 0.6.3.post1 --seed 1
--time-budget 780`` raised immutability there (B=3 N=6, 8 operations) because the driver kept
the copied cells of the free block alive.  The stand-in below is the reference manager with
that deduplication and no allocation epochs (legacy V2 reports none, so the driver infers
lifetimes from the free list and the cache map)."""

from __future__ import annotations

import attrs
from kvspec.reference.manager import ReferenceManager
from kvspec.spec.config import Config
from kvspec.spec.interface import BlockCopy
from kvspec.spec.prefix_hash import key_of
from kvspec.spec.state import KVState
from kvspec.testing.blockmanager.driver import Driver

# Four blocks, so the admission after the copies is handed the block the promotion freed (vLLM's
# run had six; its allocator hands a freed hashless block out again first).
CONFIG = Config(block_size=3, num_blocks=4, prefix_caching=True)


class DedupAfterCopy(ReferenceManager):
    """Copy-on-write, then V2's promotion: a copy target that fills with content the cache
    already holds is replaced by the cached block and freed, the copy still reported."""

    name = "test-dedup-after-copy"

    def reserve(self, seq_id: int, num_new_tokens: int, lookahead: int = 0) -> list[BlockCopy]:
        copies = super().reserve(seq_id, num_new_tokens, lookahead)
        seq = self.seqs[seq_id]
        B = self.config.block_size
        filled = seq.num_computed + num_new_tokens
        for _, new in copies:
            i = seq.table.slots.index(new)
            cached = self.gpu.lookup(key_of(seq.tokens, (i + 1) * B, seq.extra)) if (i + 1) * B <= filled else None
            if cached is not None and cached != new:
                self.gpu.incref(cached)
                seq.table.slots[i] = cached
                self.gpu.decref(new)
        return copies

    def observe(self) -> KVState:
        state = super().observe()
        return attrs.evolve(state, gpu=attrs.evolve(state.gpu, epochs=None))


def _run(impl: ReferenceManager) -> Driver:
    """The 0.6.3.post1 trace: two forks of a 5-token sequence each append position 5."""
    d = Driver(impl)
    d.admit(0, [0, 0, 0], 3)
    d.step(0, 1)
    d.step(0, 1)
    d.fork(0, 1)
    d.fork(0, 2)
    d.step(1, 1)
    d.step(2, 1)
    d.admit(3, [0], 1)
    return d


def test_the_copy_into_the_block_promotion_frees_is_reported():
    d = _run(DedupAfterCopy(CONFIG))
    assert [s.outcome for s in d.trace][5:7] == ["ok, copies=[(1, 2)]", "ok, copies=[(1, 3)]"]
    assert d.state.tables[2].slots == d.state.tables[1].slots  # seq 2 took seq 1's cached block


def test_a_copy_into_a_block_the_operation_leaves_free_starts_no_life():
    d = _run(DedupAfterCopy(CONFIG))
    assert d.state.tables[3].slots == (3,)  # seq 3 was handed the freed copy target
    assert d.check() == []
    assert d.pending == []


def test_a_copy_into_a_block_a_table_holds_still_starts_a_life():
    """Without the deduplication the copy target is seq 2's block: its copied slots are live,
    so the copy is recorded (and a later overwrite of them would be a fault)."""
    d = Driver(ReferenceManager(CONFIG))
    d.admit(0, [0, 0, 0], 3)
    d.step(0, 1)
    d.step(0, 1)
    d.fork(0, 1)
    d.step(1, 1)
    (target,) = {d.state.tables[1].slots[1]}
    assert {d.memory.get((d.state.tables[1].device, target, off)) for off in range(3)} == {(3, 0), (4, 0), (5, 0)}
