"""Deliberately broken variants of the reference: each breaks one invariant on purpose.

They exist so that the suite can show every check can fail -- a check that cannot fail is a
defect.  ``BROKEN`` maps a variant's name to its class and the invariant IDs the machines
must report for it.
"""

from __future__ import annotations

import attrs
from kvspec.spec.admission import AdmissionPolicy
from kvspec.spec.config import Config
from kvspec.spec.errors import NotAdmitted
from kvspec.spec.interface import Admission, BlockCopy
from kvspec.spec.prefix_hash import ExtraKeys, PrefixKey
from kvspec.spec.window import blocks_for_tokens, window_cover

from .block_table import BlockTable
from .manager import PartialTailReference, ReferenceManager, _Seq
from .pool import BlockPool


class LeakOnFree(ReferenceManager):
    """Forgets to release a sequence's last block when it is freed."""

    name = "leak-on-free"

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        held = seq.table.held()
        for block in reversed(held[:-1]):
            self._pool(seq.device).decref(block)


class SkipCopyOnWrite(ReferenceManager):
    """Writes into a block shared after a fork instead of copying it first."""

    name = "skip-copy-on-write"

    def _shared_in(self, table: BlockTable, start: int, stop: int) -> list[int]:
        return []


class OffByOneWindow(ReferenceManager):
    """Drops out-of-window blocks one block late, so it holds one block too many."""

    name = "off-by-one-window"

    def _first_needed(self, start: int) -> int:
        return max(0, super()._first_needed(start) - 1)


class EagerWindow(ReferenceManager):
    """Drops one block too early: the window's first block is gone while still attended."""

    name = "eager-window"

    def _first_needed(self, start: int) -> int:
        if self.config.sliding_window is None:
            return 0
        return start // self.config.block_size


class _StalePool(BlockPool):
    def allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self.key_of.pop(block)  # the cache map keeps pointing at the reused block
        self.refcount[block] = 1
        self.epoch[block] += 1
        return block


class StaleCacheEntry(ReferenceManager):
    """Evicts a cached block for reuse but leaves its prefix-cache entry behind."""

    name = "stale-cache-entry"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _StalePool(config.num_blocks, config.prefix_caching)


class _NullKeyedPool(BlockPool):
    def _evict(self, block: int) -> None:
        # The key is parked on an id outside the pool instead of being removed.
        self.cache[self.key_of.pop(block)] = self.num_blocks

    def lookup(self, key: PrefixKey) -> int | None:
        block = super().lookup(key)
        return None if block == self.num_blocks else block


class CachesTheNullBlock(ReferenceManager):
    """Evicting a cached block leaves its key mapped to the null block (an id outside the
    pool) rather than removing it; such entries never hit here.  vLLM 0.10.1.1-0.12.0 cache
    the null block itself under a chunked-local group with async scheduling (FINDINGS V1-S2b)."""

    name = "caches-the-null-block"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _NullKeyedPool(config.num_blocks, config.prefix_caching)


class _FreeCachedPool(BlockPool):
    def decref(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)  # the cache entry stays: its block is up for grabs


class ReleaseCachedAsFree(ReferenceManager):
    """Releases an unreferenced cached block to the free list but keeps its cache entry (a
    0.33.0 mutant of BlockPool did this: hash set, block_hash cleared)."""

    name = "release-cached-as-free"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _FreeCachedPool(config.num_blocks, config.prefix_caching)


class _CachedCountsAsUsedPool(BlockPool):
    def usage(self) -> float:
        if not self.num_blocks:
            return 0.0
        return 1.0 - len(self.free) / self.num_blocks


class UsageCountsCached(ReferenceManager):
    """Reports unreferenced cached blocks as in use: the exported KV-cache usage stays high
    while the pool could reclaim them."""

    name = "usage-counts-cached"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _CachedCountsAsUsedPool(config.num_blocks, config.prefix_caching)


class PublishBeforeCompute(ReferenceManager):
    """Publishes a prompt's full blocks at admission, before their KV is written."""

    name = "publish-before-compute"

    def admit(self, seq_id, tokens, num_new_tokens, extra=()):
        hit = super().admit(seq_id, tokens, num_new_tokens, extra)
        seq = self.seqs[seq_id]
        computed = seq.num_computed
        # Pretend every allocated slot is computed already.
        seq.num_computed = min(len(seq.tokens), len(seq.table.slots) * self.config.block_size)
        self._publish(seq)
        seq.num_computed = computed
        return hit


class SaltBlindKey(ReferenceManager):
    """Keys its prefix cache without the cache salt: tenants with the same prompt share KV
    (the isolation the salt exists for, vLLM 0.33.0 kv_cache_utils.py:659-662)."""

    name = "salt-blind-key"

    def _keyed(self, extra: ExtraKeys) -> ExtraKeys:
        return attrs.evolve(extra, cache_salt=None)


class _SilentEvictionPool(BlockPool):
    def _evict(self, block: int) -> None:
        del self.cache[self.key_of.pop(block)]  # no BlockRemoved: routers keep the stale key


class SilentEviction(ReferenceManager):
    """Evicts a cached block without emitting its removal event."""

    name = "silent-eviction"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _SilentEvictionPool(config.num_blocks, config.prefix_caching)


class _SilentPromotionPool(BlockPool):
    def _supersede(self, block: int) -> None:
        del self.cache[self.key_of.pop(block)]  # the partial key goes without its BlockRemoved


class SilentPromotion(PartialTailReference):
    """Retires a promoted block's partial key without emitting its removal event."""

    name = "silent-promotion"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _SilentPromotionPool(config.num_blocks, config.prefix_caching)


class _UnretiredPartialPool(BlockPool):
    def _supersede(self, block: int) -> None:
        self.key_of.pop(block)  # the superseded partial key stays in the map, unowned


class UnretiredPartial(PartialTailReference):
    """Promotes a partial tail to its full key but leaves the superseded partial key live: once
    the block is evicted and reused, the stale partial key names someone else's tokens."""

    name = "unretired-partial"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _UnretiredPartialPool(config.num_blocks, config.prefix_caching)


class WindowCappedAdmission(ReferenceManager):
    """The seed bug (legacy BlockSpaceManagerV2): admission caps a sliding-window prompt's
    need at the window while allocation takes a block for every prompt block.
    """

    name = "window-capped-admission"

    def can_admit(self, seq_id, tokens, num_new_tokens, extra=()):
        need = blocks_for_tokens(len(tokens), self.config.block_size)
        if self.config.sliding_window is not None:
            need = min(need, window_cover(self.config.sliding_window, self.config.block_size))
        if need > self.config.num_blocks:
            return Admission.NEVER
        return Admission.OK if need <= self.gpu.available() else Admission.LATER

    def admit(self, seq_id, tokens, num_new_tokens, extra=()):
        # Allocates the whole prompt, whatever the first step computes and the window keeps.
        return super().admit(seq_id, tokens, len(tokens), extra)


class DirtyRefusal(ReferenceManager):
    """Allocates a step's blocks one by one and, when the pool runs dry, refuses without
    giving back the blocks it already took."""

    name = "dirty-refusal"

    def reserve(self, seq_id: int, num_new_tokens: int, lookahead: int = 0) -> list[BlockCopy]:
        seq = self._running(seq_id)
        end = seq.num_computed + num_new_tokens + lookahead
        while len(seq.table.slots) < (end - 1) // self.config.block_size + 1:
            if not self.gpu.available():
                raise NotAdmitted("pool ran dry halfway through the step")
            seq.table.slots.append(self.gpu.allocate())
        return super().reserve(seq_id, num_new_tokens, lookahead)


class ForkWithoutIncref(ReferenceManager):
    """Forks a sequence by copying its table without taking a reference on the blocks."""

    name = "fork-without-incref"

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._running(parent_id)
        table = BlockTable(list(parent.table.slots))
        table.first_live = parent.table.first_live
        self.seqs[child_id] = _Seq(
            list(parent.tokens),
            parent.extra,
            table,
            parent.num_computed,
            published=parent.published,
        )


class DoubleFree(ReferenceManager):
    """Puts every released block on the free list, even one another sequence still holds."""

    name = "double-free"

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        pool = self._pool(seq.device)
        for block in reversed(seq.table.held()):
            pool.decref(block)
            if pool.refcount[block] > 0:
                pool.free.append(block)


class CyclicWindow(ReferenceManager):
    """BlockSpaceManagerV1-style: a sliding-window sequence reuses its own blocks in a ring,
    overwriting full blocks in place instead of recycling them through the pool.
    """

    name = "cyclic-window"

    def reserve(self, seq_id: int, num_new_tokens: int, lookahead: int = 0) -> list[BlockCopy]:
        W, B = self.config.sliding_window, self.config.block_size
        seq = self._running(seq_id)
        ring = len(seq.table.held())
        if W is None or ring < window_cover(W, B):
            return super().reserve(seq_id, num_new_tokens, lookahead)
        start = seq.num_computed
        last = (start + num_new_tokens + lookahead - 1) // B
        while len(seq.table.slots) <= last:
            i = len(seq.table.slots)
            reused = seq.table.slots[i - ring]
            seq.table.slots[i - ring] = None
            seq.table.slots.append(reused)
        return []


class RefuseAll(ReferenceManager):
    """Does nothing, safely: answers LATER to every admission and refuses every allocation."""

    name = "refuse-all"

    def can_admit(self, seq_id, tokens, num_new_tokens, extra=()):
        return Admission.LATER

    def admit(self, seq_id, tokens, num_new_tokens, extra=()):
        raise NotAdmitted(f"seq {seq_id}: this manager admits nothing")


class _NeverHitPool(BlockPool):
    def lookup(self, key):
        return None  # the cache map fills, but no lookup ever finds anything


class NeverHit(ReferenceManager):
    """Publishes computed blocks to its prefix cache, but every lookup comes back empty."""

    name = "never-hit"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _NeverHitPool(config.num_blocks, config.prefix_caching)


class _NeverCachesPool(BlockPool):
    def register(self, key, block) -> None:
        return  # prefix caching is on, yet nothing is ever published


class NeverCaches(ReferenceManager):
    """Prefix caching on, nothing ever published: every lookup misses, safely."""

    name = "never-caches"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _NeverCachesPool(config.num_blocks, config.prefix_caching)


class _HoardPool(BlockPool):
    def available(self) -> int:
        return len(self.free)  # cached blocks are kept, never evicted to make room


class Hoard(ReferenceManager):
    """Never evicts an unreferenced cached block to make room: counts only the free list,
    and refuses what would need an eviction."""

    name = "hoard"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.gpu = _HoardPool(config.num_blocks, config.prefix_caching)

    def _hoarded(self, tokens, num_new_tokens, extra) -> bool:
        plan = self._plan(tokens, num_new_tokens, extra)
        return plan.new_blocks + plan.evictable_hits > len(self.gpu.free)

    def can_admit(self, seq_id, tokens, num_new_tokens, extra=()):
        answer = super().can_admit(seq_id, tokens, num_new_tokens, extra)
        if answer is Admission.OK and self._hoarded(tokens, num_new_tokens, extra):
            return Admission.LATER
        return answer

    def admit(self, seq_id, tokens, num_new_tokens, extra=()):
        if self._hoarded(tokens, num_new_tokens, extra):
            raise NotAdmitted(f"seq {seq_id}: would have to evict a cached block")
        return super().admit(seq_id, tokens, num_new_tokens, extra)


class WindowHitHoard(Hoard):
    """Hoards like ``hoard`` while declaring the ``window_hits_from_the_end`` freedom of vLLM's
    V1 sliding-window lookup: that freedom explains a refusal only when the window hit's own
    revived blocks do not fit, so this target is still caught."""

    name = "window-hit-hoard"
    admission_policy = AdmissionPolicy(
        window_hits_from_the_end=True,
        sources=(("window_hits_from_the_end", "claimed by a broken variant"),),
    )


class Livelock(ReferenceManager):
    """Charges a re-admitted sequence for the blocks it held before its preemption, so none of
    its steps ever fits: the scheduler preempts it and re-admits it forever."""

    name = "livelock"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.preempted: set[int] = set()

    def free(self, seq_id: int) -> None:
        self.preempted.add(seq_id)
        super().free(seq_id)

    def reserve(self, seq_id: int, num_new_tokens: int, lookahead: int = 0) -> list[BlockCopy]:
        if seq_id in self.preempted:
            raise NotAdmitted(f"seq {seq_id} still owes the blocks it held before its preemption")
        return super().reserve(seq_id, num_new_tokens, lookahead)


@attrs.frozen
class BrokenVariant:
    cls: type[ReferenceManager]
    catches: frozenset[str]  # each of these, watched alone, must catch it
    needs: dict = attrs.Factory(dict)  # config constraints that make the bug reachable


BROKEN: dict[str, BrokenVariant] = {
    LeakOnFree.name: BrokenVariant(LeakOnFree, frozenset({"no-leak", "refcount-exact"})),
    SkipCopyOnWrite.name: BrokenVariant(SkipCopyOnWrite, frozenset({"immutability"})),
    OffByOneWindow.name: BrokenVariant(
        OffByOneWindow, frozenset({"window-bound"}), {"window": True}
    ),
    EagerWindow.name: BrokenVariant(EagerWindow, frozenset({"kv-readback"}), {"window": True}),
    StaleCacheEntry.name: BrokenVariant(
        StaleCacheEntry, frozenset({"prefix-cache-consistency"}), {"prefix_caching": True}
    ),
    CachesTheNullBlock.name: BrokenVariant(
        CachesTheNullBlock, frozenset({"prefix-cache-consistency"}), {"prefix_caching": True}
    ),
    ReleaseCachedAsFree.name: BrokenVariant(
        ReleaseCachedAsFree, frozenset({"conservation"}), {"prefix_caching": True}
    ),
    UsageCountsCached.name: BrokenVariant(
        UsageCountsCached, frozenset({"conservation"}), {"prefix_caching": True}
    ),
    PublishBeforeCompute.name: BrokenVariant(
        PublishBeforeCompute,
        frozenset({"prefix-cache-consistency", "kv-readback"}),
        {"prefix_caching": True},
    ),
    WindowCappedAdmission.name: BrokenVariant(
        WindowCappedAdmission, frozenset({"admission-soundness", "window-bound"}), {"window": True}
    ),
    DirtyRefusal.name: BrokenVariant(DirtyRefusal, frozenset({"admission-soundness"})),
    ForkWithoutIncref.name: BrokenVariant(ForkWithoutIncref, frozenset({"refcount-exact"})),
    DoubleFree.name: BrokenVariant(DoubleFree, frozenset({"conservation"})),
    CyclicWindow.name: BrokenVariant(CyclicWindow, frozenset({"immutability"}), {"window": True}),
    SaltBlindKey.name: BrokenVariant(
        SaltBlindKey, frozenset({"prefix-cache-isolation"}), {"prefix_caching": True}
    ),
    SilentEviction.name: BrokenVariant(
        SilentEviction, frozenset({"event-consistency"}), {"prefix_caching": True}
    ),
    SilentPromotion.name: BrokenVariant(
        SilentPromotion, frozenset({"event-consistency"}), {"prefix_caching": True}
    ),
    UnretiredPartial.name: BrokenVariant(
        UnretiredPartial, frozenset({"prefix-cache-consistency"}), {"prefix_caching": True}
    ),
    RefuseAll.name: BrokenVariant(RefuseAll, frozenset({"admission-completeness"})),
    NeverHit.name: BrokenVariant(NeverHit, frozenset({"hit-completeness"}), {"prefix_caching": True}),
    NeverCaches.name: BrokenVariant(
        NeverCaches, frozenset({"hit-completeness"}), {"prefix_caching": True}
    ),
    Hoard.name: BrokenVariant(Hoard, frozenset({"admission-completeness"}), {"prefix_caching": True}),
    WindowHitHoard.name: BrokenVariant(
        WindowHitHoard, frozenset({"admission-completeness"}), {"prefix_caching": True, "window": True}
    ),
    Livelock.name: BrokenVariant(Livelock, frozenset({"progress", "reserve-completeness"})),
}
