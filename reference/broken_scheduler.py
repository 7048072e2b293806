"""Deliberately broken variants of the reference scheduler, one per production shape.

Each breaks one thing that only shows in its shape (the scheduler machine's shapes,
spec/groups.py ``SHAPE_TAGS``), so that the suite shows the per-group and scheduler-driven
checks can fail there.  They take a ``Shape`` rather than a ``Config``, which is why they are
not in ``reference/broken.py``'s ``BROKEN`` (whose variants the block-manager machine builds
from configurations).
"""

from __future__ import annotations

from typing import Any

import attrs
from kvspec.spec.groups import GroupSpec, Scheduled, Shape
from kvspec.spec.window import first_needed_position

from .encoder_cache import EncoderCache
from .policies import Comparison
from .prefix_cache import full_hit
from .scheduler import ReferenceScheduler, _Req


class AliasedGroupTables(ReferenceScheduler):
    """Hybrid: the sliding-window group's table points at the full-attention group's blocks
    (slot for slot) instead of blocks of its own -- two groups, one block, one refcount."""

    name = "aliased-group-tables"

    def _grow(self, req: _Req, end: int) -> None:
        super()._grow(req, end)
        if len(req.tables) < 2:
            return
        full, other = req.tables[0], req.tables[1]
        for i, block in enumerate(other):
            if block is not None and i < len(full) and full[i] is not None and block != full[i]:
                self._decref(block)
                other[i] = full[i]


class UnreservedPlaceholders(ReferenceScheduler):
    """Async: reserves a step's slots as if the outputs in flight (placeholders) were not
    there, so the worker's positions past them have no slot."""

    name = "unreserved-placeholders"

    def _grow(self, req: _Req, end: int) -> None:
        super()._grow(req, end - req.placeholders)


class NoDraftRollback(ReferenceScheduler):
    """Speculative decoding: rejected drafts are not rolled back; the computed count keeps
    positions whose KV the worker discarded."""

    name = "no-draft-rollback"

    def _roll_back(self, req: _Req, rejected: int) -> None:
        return


class ShortBudgetChunk(ReferenceScheduler):
    """Token budget: a prefill chunk that ``max_num_batched_tokens`` cuts short (a prompt
    longer than the whole budget) gets slots for one token fewer than it computes."""

    name = "short-budget-chunk"

    def _schedule_one(self, req: _Req, budget: int, *planned: Any, **decision: Any):
        remaining = req.known() - req.computed
        whole = budget == self.shape.max_num_batched_tokens  # the step's budget, not a remnant
        if whole and 1 < budget < remaining and req.outputs == 0:
            self._grow(req, req.computed + budget - 1)
            start, req.computed = req.computed, req.computed + budget
            req.in_flight += budget
            return Scheduled(req.seq_id, start, budget, 0, ())
        return super()._schedule_one(req, budget, *planned, **decision)


class ExactFitReuse(ReferenceScheduler):
    """Startup sizing: in a pool of exactly the startup minimum, the allocation that would
    take the last free block hands out one already in use (an off-by-one at the edge that
    only a pool sized at the minimum reaches)."""

    name = "exact-fit-reuse"

    def _allocate(self) -> int:
        at_edge = self.num_blocks == self.minimum_blocks and len(self.free) == 1
        if at_edge and self._last is not None and self.refcounts[self._last] > 0:
            return self._last  # the last free block stays free; an in-use one goes out again
        block = super()._allocate()
        self._last = block
        return block

    def __init__(self, shape: Shape) -> None:
        self._last: int | None = None
        super().__init__(shape)


class ChunkAsSlidingWindow(ReferenceScheduler):
    """Chunked-local attention: keeps the last C positions (a sliding window of the chunk's
    size) instead of only the current chunk, so blocks before the chunk stay held after the
    chunk boundary.  Safe but wasteful: only the chunk's bound (``window-bound``) sees it."""

    name = "chunk-as-sliding-window"

    def _first_needed(self, req: _Req, group: GroupSpec) -> int:
        if group.attention_chunk_size is None:
            return super()._first_needed(req, group)
        return first_needed_position(req.computed - req.in_flight, group.attention_chunk_size)


class ChunkDropsItsStart(ReferenceScheduler):
    """Chunked-local attention: frees the first block of the current chunk as well, which the
    rest of the chunk still attends."""

    name = "chunk-drops-its-start"

    def _first_needed(self, req: _Req, group: GroupSpec) -> int:
        first = super()._first_needed(req, group)
        if group.attention_chunk_size is None:
            return first
        return min(first + group.block_size, req.computed - req.in_flight)


class WaitsForAFullBatch(ReferenceScheduler):
    """Token budget: with nothing running, admits waiting requests only once their prompts
    fill the step's budget (a batch-forming delay).  Every state it reaches is sound; but with
    no new arrivals the last requests never fill it, and wait forever: only ``progress`` sees
    it."""

    name = "waits-for-a-full-batch"

    def _full(self) -> bool:
        waiting = sum(len(self.reqs[s].tokens) for s in self.waiting)
        forming = not self.running and waiting < self.shape.max_num_batched_tokens
        return super()._full() or (self.shape.budget_bound and forming)


class StatePerPosition(ReferenceScheduler):
    """Mamba: the state group takes a block for every block of positions a step computes, as
    an attention group does, rather than only the block its state ends in.  Without prefix
    caching safe but wasteful: only the state group's bound (``window-bound``) sees it.  With
    it (the reference caching Mamba states, ``mamba_state_cache``) the blocks inside a chunk
    are cached too, under keys whose states they never held: ``prefix-cache-consistency``."""

    name = "state-per-position"

    def _grow(self, req: _Req, end: int) -> None:
        state = [g for g in self.group_specs if g.state]
        if state:
            self.group_specs = tuple(attrs.evolve(g, state_blocks=None) for g in self.group_specs)
        try:
            super()._grow(req, end)
        finally:
            if state:
                self.group_specs = self.shape.groups()


class StateFreedBeforeRead(ReferenceScheduler):
    """Mamba: frees the block holding the processed state once the processed count reaches
    its block's end, before the next step has read the state from it."""

    name = "state-freed-before-read"

    def _first_needed(self, req: _Req, group: GroupSpec) -> int:
        first = super()._first_needed(req, group)
        return first + 1 if group.state else first


class MambaBlockAsHashBlock(ReferenceScheduler):
    """Mamba with hashes finer than its blocks: lays the state group's table out in blocks of
    the prefix match unit (the hash block) instead of the Mamba block, so the state a step
    leaves sits in another slot than the one its next step reads.  The two sizes are one in
    every other Mamba shape, so only hashes finer than the block (``mamba-partial-hits``) show
    it."""

    name = "mamba-block-as-hash-block"

    def _grow(self, req: _Req, end: int) -> None:
        unit = self.shape.prefix_match_unit
        if unit is not None:
            self.group_specs = tuple(attrs.evolve(g, block_size=unit) if g.state else g for g in self.group_specs)
        try:
            super()._grow(req, end)
        finally:
            self.group_specs = self.shape.groups()


class EagleDropAdds(ReferenceScheduler):
    """EAGLE with prefix caching: adds the block the EAGLE head should drop from a prefix hit
    instead of taking it off, so the request starts past the blocks it was handed.  Only a
    prefix hit under a block-dropping EAGLE head (``spec-decode-eagle``, rule
    ``eagle-prefix-hits``) runs it."""

    name = "eagle-drop-adds"

    def _after_eagle_drop(self, length: int, full: GroupSpec) -> int:
        return length + min(self.alignment, full.block_size)


class FreesBeforeTheSend(ReferenceScheduler):
    """KV connector: frees a finished request's blocks when it finishes, while the worker is
    still sending its KV (the deferred free forgotten).  The pool stays consistent; the send
    reads blocks the pool may hand out again: ``kv-readback``'s freed-while-sending."""

    name = "frees-before-the-send"

    def _finish(self, seq_id: int, send: bool = False) -> None:
        super()._finish(seq_id)


class KeepsBlocksAfterTheSend(ReferenceScheduler):
    """KV connector: ignores the worker's report that a finished request's KV was sent, so its
    blocks stay held for good: ``no-leak`` (and ``refcount-exact``: no live table holds them)."""

    name = "keeps-blocks-after-the-send"

    def _sent(self, seq_id: int) -> None:
        pass


class HoldsTheWholeTableForTheSend(ReferenceScheduler):
    """KV connector: holds every block of a finished request for the send, those its windows
    (or attention chunks) no longer read included.  Nothing is unsafe, the pool just keeps
    blocks nobody reads until the send is reported; vLLM frees them first
    (``_connector_finished``), so only the differential sees it."""

    name = "holds-the-whole-table-for-the-send"

    def _hold_for_send(self, req) -> None:
        self.held[req.seq_id] = req


class RecomputesInFlight(ReferenceScheduler):
    """Pipeline parallel: takes a batch in flight for lost, planning a request's next step from
    the positions whose output came back, so the synchronous scheduler hands the worker
    positions it is still computing (a prefill chunk's successor starts over the chunk in
    flight).  Async scheduling plans past the step in flight with placeholders and a
    synchronous scheduler without a pipeline has no batch in flight when it plans, so only a
    pipeline reaches it: ``kv-readback``'s step-start."""

    name = "recomputes-in-flight"

    def _tokens_for(self, req: _Req, budget: int) -> tuple[int, tuple[int, ...]]:
        if not self.shape.async_scheduling and req.in_flight:
            req.computed -= req.in_flight
            req.in_flight = 0
        return super()._tokens_for(req, budget)


class PerRequestEncoderCache(EncoderCache):
    """An encoder cache keyed by request and image: a request finds only the outputs it encoded
    itself, never another request's output of the same image."""

    def touch(self, seq: int, index: int, identifier: str) -> bool:
        return super().touch(seq, index, f"{seq}/{identifier}")

    def allocate(self, seq: int, index: int, identifier: str, embeds: int) -> None:
        super().allocate(seq, index, f"{seq}/{identifier}", embeds)

    def release(self, seq: int, index: int, identifier: str) -> None:
        super().release(seq, index, f"{seq}/{identifier}")


class EncodesSharedImagesAgain(ReferenceScheduler):
    """Multimodal: the encoder cache is not shared between requests (keyed by request and image,
    not by the image's identifier), so a request carrying an image another request's encoder
    output already holds encodes it again.  Every KV block is where it should be, so every
    invariant holds; the step schedules an encoder input vLLM's shared cache does not (0.33.0
    encoder_cache_manager.py ``check_and_update_cache``, :112-140) and spends budget and cache
    room on it.  Only the differential in a multimodal shape (``encoder inputs``) sees it."""

    name = "encodes-shared-images-again"

    def __init__(self, shape: Shape, **kwargs: Any) -> None:
        super().__init__(shape, **kwargs)
        if self.encoder is not None:
            self.encoder = PerRequestEncoderCache(self.encoder.capacity)


@attrs.frozen
class BrokenScheduler:
    cls: type[ReferenceScheduler]
    shape: str  # the SHAPE_TAGS entry whose examples reach the bug
    catches: frozenset[str]  # invariant IDs that report it


BROKEN_SCHEDULERS: dict[str, BrokenScheduler] = {
    AliasedGroupTables.name: BrokenScheduler(
        AliasedGroupTables, "hybrid", frozenset({"refcount-exact"})
    ),
    UnreservedPlaceholders.name: BrokenScheduler(
        UnreservedPlaceholders, "async", frozenset({"admission-soundness"})
    ),
    NoDraftRollback.name: BrokenScheduler(NoDraftRollback, "spec-decode", frozenset({"kv-readback"})),
    ShortBudgetChunk.name: BrokenScheduler(
        ShortBudgetChunk, "budget-chunked", frozenset({"admission-soundness"})
    ),
    ExactFitReuse.name: BrokenScheduler(ExactFitReuse, "startup-min", frozenset({"refcount-exact"})),
    ChunkAsSlidingWindow.name: BrokenScheduler(
        ChunkAsSlidingWindow, "hybrid-chunked-local", frozenset({"window-bound"})
    ),
    ChunkDropsItsStart.name: BrokenScheduler(
        ChunkDropsItsStart, "hybrid-chunked-local", frozenset({"kv-readback"})
    ),
    WaitsForAFullBatch.name: BrokenScheduler(
        WaitsForAFullBatch, "budget-chunked", frozenset({"progress"})
    ),
    StatePerPosition.name: BrokenScheduler(
        StatePerPosition, "hybrid-mamba", frozenset({"window-bound", "prefix-cache-consistency"})
    ),
    StateFreedBeforeRead.name: BrokenScheduler(
        StateFreedBeforeRead, "hybrid-mamba", frozenset({"kv-readback"})
    ),
    MambaBlockAsHashBlock.name: BrokenScheduler(
        MambaBlockAsHashBlock, "mamba-partial-hits", frozenset({"kv-readback", "admission-soundness", "window-bound"})
    ),
    # A hit the addition carries past the prompt's end leaves the request nothing to compute:
    # it holds its place in ``running`` and never finishes, which ``progress`` reports.
    EagleDropAdds.name: BrokenScheduler(
        EagleDropAdds, "spec-decode-eagle", frozenset({"kv-readback", "admission-soundness", "progress"})
    ),
    FreesBeforeTheSend.name: BrokenScheduler(FreesBeforeTheSend, "kv-connector", frozenset({"kv-readback"})),
    KeepsBlocksAfterTheSend.name: BrokenScheduler(
        KeepsBlocksAfterTheSend, "kv-connector", frozenset({"no-leak", "refcount-exact"})
    ),
    RecomputesInFlight.name: BrokenScheduler(RecomputesInFlight, "pipeline-parallel", frozenset({"kv-readback"})),
}


class SerialAdmission(ReferenceScheduler):
    """Admits a waiting request only when nothing runs: safe (every invariant holds, every
    request finishes) and useless (no batching).  Only the differential sees it: the reference
    schedules the waiting request beside the running one."""

    name = "serial-admission"

    def _full(self) -> bool:
        return bool(self.running) or super()._full()


class OverReserve(ReferenceScheduler):
    """Reserves a block more than a step needs in the full-attention group (a local group's
    excess ``window-bound`` reports): the pool stays consistent (the block is held and
    counted), so every invariant holds; the differential in ``counts`` mode sees the block."""

    name = "over-reserve"

    def _slots_for(self, req: _Req, end: int, group) -> int:
        return super()._slots_for(req, end, group) + (group == self.group_specs[0])


class EvictsNewestFirst(ReferenceScheduler):
    """Prefix caching: every freed block goes to the head of the free queue, so the allocator
    evicts the most recently freed cached content first instead of the least recently used.
    A legitimate cache -- every hit it finds is real, every state sound -- that keeps other
    blocks cached than the reference (and vLLM) do, and so misses hits they find, or finds hits
    they miss.  Only the differential past a prefix hit sees it."""

    name = "evicts-newest-first"

    def _free(self, blocks) -> None:
        queued = set(self.free)
        super()._free(blocks)
        freed = [b for b in self.free if b not in queued]
        self.free = freed + [b for b in self.free if b in queued]


class UnalignedMambaSplit(ReferenceScheduler):
    """Mamba with prefix caching ("align" mode): cuts prefill chunks by the budget alone, not at
    Mamba block ends.  Every state it leaves is still read back by the step after (the block
    layout follows the chunk), so every invariant holds; only the differential, beside a
    scheduler that aligns (the reference, vLLM 0.33.0), sees the chunk that runs on."""

    name = "unaligned-mamba-split"

    def _aligned(self, req: _Req, n: int) -> int:
        return n


class DenseUnderSparseRetention(ReferenceScheduler):
    """Prefix caching with a sliding-window group under a sparse retention
    (``Shape.retention_interval`` 0 or positive): caches the window's blocks before every
    aligned boundary, as dense retention does, instead of only before the retention's
    multiples and the reachable boundaries.  Every block it caches holds what its key says, so
    every hit is sound and every invariant holds; it finds hits the sparse cache (vLLM 0.30.0+,
    the reference) does not keep, or keeps blocks they let go.  Only the differential in a
    sparse shape sees it."""

    name = "dense-under-sparse-retention"

    def _retention(self, req: _Req, group: GroupSpec) -> tuple[int | None, tuple[int, ...]]:
        return None, ()


class MambaHitAsARun(ReferenceScheduler):
    """Mamba "align" prefix caching: the Mamba group's hit is the longest run of cached states
    from block 0, as a full-attention hit is, ending at the run's last state, instead of the last
    cached state at or below the full-attention hit.  Every state it hits is cached and holds
    the whole prefix before it, so every hit is sound and every invariant holds; but a prefill
    chunk spanning several blocks leaves no states at the block ends inside it, so its runs stop
    short of hits the reference (and vLLM 0.33.0) take.  Only the differential past a Mamba
    hit sees it."""

    name = "mamba-hit-as-a-run"

    def _state_hit(self, lookup, max_blocks: int, group: GroupSpec) -> list[int | None]:
        run = full_hit(lookup, max_blocks)
        return [None] * (len(run) - 1) + run[-1:]


PREFIX_CACHE_ONLY: dict[str, type[ReferenceScheduler]] = {EvictsNewestFirst.name: EvictsNewestFirst}
"""Broken prefix caches no invariant catches and the differential does, once it compares past
prefix hits: what differs first (a hit's start, the requests a step fits, the blocks held) is
the first step their caches part on."""

DIFFERENTIAL_ONLY: dict[str, tuple[type[ReferenceScheduler], Comparison]] = {
    SerialAdmission.name: (SerialAdmission, Comparison.SCHEDULED),
    OverReserve.name: (OverReserve, Comparison.HELD_BLOCKS),
    UnalignedMambaSplit.name: (UnalignedMambaSplit, Comparison.STEP_COUNTS),
    HoldsTheWholeTableForTheSend.name: (HoldsTheWholeTableForTheSend, Comparison.HELD_BLOCKS),
}
"""Broken schedulers no invariant catches and the differential does (as a difference from the
reference's own policy), with what it compares when it finds them."""

MAMBA_CACHE_ONLY: dict[str, type[ReferenceScheduler]] = {MambaHitAsARun.name: MambaHitAsARun}
"""Broken Mamba prefix caches only the differential past a Mamba hit catches, in the Mamba
"align" shapes whose hits end at block ends (the reference's ``mamba_state_cache``)."""

MULTIMODAL_ONLY: dict[str, tuple[type[ReferenceScheduler], Comparison]] = {
    EncodesSharedImagesAgain.name: (EncodesSharedImagesAgain, Comparison.ENCODER_INPUTS),
}
"""Broken encoder schedulers only the differential in a multimodal shape catches
(tests/test_scheduler_multimodal.py), with what it compares when it finds them: without images
they are the reference."""

SPARSE_RETENTION_ONLY: dict[str, type[ReferenceScheduler]] = {DenseUnderSparseRetention.name: DenseUnderSparseRetention}
"""Broken sliding-window prefix caches only the differential in a sparse-retention shape
catches (tests/test_scheduler_retention.py): in a dense shape they are the reference."""

__all__ = [
    "BROKEN_SCHEDULERS",
    "DIFFERENTIAL_ONLY",
    "MAMBA_CACHE_ONLY",
    "MULTIMODAL_ONLY",
    "PREFIX_CACHE_ONLY",
    "SPARSE_RETENTION_ONLY",
    "BrokenScheduler",
]
