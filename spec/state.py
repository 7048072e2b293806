"""The abstract state: what every implementation's state maps to, and what the scheduler knows.

An implementation (the reference, or an adapter around vLLM) reports a ``KVState``: its
pools (refcounts, free list, prefix-cache map) and every live sequence's block table.  The
scheduler side -- which tokens each sequence holds and how many are computed -- is the
``SeqModel``, kept by the driver, not by the implementation under test.  Shadow KV memory
(what the worker wrote into each slot) lives in ``kv_memory``.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

import attrs

from .config import Config
from .events import CacheEvent
from .prefix_hash import NO_EXTRA, ExtraKeys, PrefixKey


class Device(StrEnum):
    GPU = "gpu"
    CPU = "cpu"


class Status(StrEnum):
    RUNNING = "running"  # blocks on the GPU pool, may be stepped
    SWAPPED = "swapped"  # blocks on the CPU pool
    WAITING = "waiting"  # preempted by recompute: holds nothing, re-admitted later
    # Finished, its GPU blocks held while a KV connector sends its KV (vLLM's deferred free:
    # ``request_finished`` answered delay_free_blocks, 0.33.0 sched/scheduler.py:3040-3060);
    # the blocks are freed once the worker reports the send finished (:3579-3582).
    SENDING = "sending"


DROPPED = None
"""Marker for a block-table slot a sliding window has dropped (vLLM's null block)."""

Slot = int | None


@attrs.frozen
class TableView:
    """One sequence's block table: slot i holds token positions i*B .. i*B+B-1."""

    seq_id: int
    device: Device
    slots: tuple[Slot, ...]

    def held(self) -> tuple[int, ...]:
        return tuple(b for b in self.slots if b is not DROPPED)


def table_view(previous: Mapping[int, TableView], seq_id: int, device: Device, slots: tuple[Slot, ...]) -> TableView:
    """A sequence's block table, as the object ``previous`` (the last observation's tables) holds
    when nothing in it changed: consecutive observations then share what an operation did not
    touch, and comparing them is an identity test for those tables."""
    old = previous.get(seq_id)
    if old is not None and old.device is device and old.slots == slots:
        return old
    return TableView(seq_id, device, slots)


# A reported prefix-cache hit rate is compared to this many decimal places.  Legacy vLLM keeps
# it as a running float average over blocks of lookups (0.6.3 block/common.py:313-316) and
# divides the unfinished block's hits (:330-335): two managers that count the same hits and
# lookups may round the same rate differently by the order of their float operations, while
# a miscount of one lookup or hit among fewer than ten thousand moves the rate by more than
# 1e-8.
HIT_RATE_DIGITS = 9


@attrs.frozen
class PoolView:
    """One block pool as the implementation holds it.

    ids          every block id of the pool (a null block, if any, is not in the pool).
    refcounts    block id -> refcount for every id in ``ids``.
    free         the free list as held; a duplicate entry is a double free.
    evictable    unreferenced blocks kept for their cached content (reclaimable).
    cached       prefix-cache map entries (key, block id); the map a lookup consults.
    epochs       block id -> how many times the allocator has handed the block out, when the
                 implementation can tell (a block's content lives for one epoch); None
                 makes the driver infer lifetimes from the free list and the cache map.
    events       every KV-cache event the pool emitted since it was built, in emission
                 order (``kvspec.spec.events``); None when the implementation emits none.
    computed     cached blocks a lookup may hand out as hits (their KV is written); legacy
                 vLLM registers a full block's hash before computing it and tracks
                 computed-ness separately, V1 hands out every cached block.
    usage        the share of the pool the implementation reports in use (V1's
                 ``KVCacheManager.usage``, which the engine exports as ``kv_cache_usage``,
                 0.33.0 sched/scheduler.py:3294); None when it reports none.
    hit_rate     the prefix-cache hit rate the implementation reports for the pool (legacy
                 ``get_prefix_cache_hit_rate(device)``, 0.6.3 block_manager_v2.py:450-451,
                 which the engine exports as ``gpu_prefix_cache_hit_rate``, llm_engine.py:
                 1594-1598); None when it reports none.  No invariant bounds it: a difference
                 between two releases (to ``HIT_RATE_DIGITS`` places) is a behaviour change.
    """

    ids: tuple[int, ...]
    refcounts: Mapping[int, int]
    free: tuple[int, ...]
    evictable: tuple[int, ...] = ()
    cached: tuple[tuple[PrefixKey, int], ...] = ()
    computed: frozenset[int] = frozenset()
    epochs: Mapping[int, int] | None = None
    events: tuple[CacheEvent, ...] | None = None
    usage: float | None = None
    hit_rate: float | None = None

    def cached_key_of(self) -> dict[int, PrefixKey]:
        return {block: key for key, block in self.cached}

    def in_use(self) -> frozenset[int]:
        return frozenset(b for b, rc in self.refcounts.items() if rc > 0)


@attrs.frozen
class KVState:
    """An implementation's whole observable state."""

    gpu: PoolView
    tables: Mapping[int, TableView]
    cpu: PoolView | None = None

    def pool(self, device: Device) -> PoolView | None:
        return self.gpu if device is Device.GPU else self.cpu


@attrs.frozen
class SeqModel:
    """What the scheduler knows of one sequence.

    tokens        prompt and generated tokens so far.
    num_computed  positions whose KV the worker has written (or a prefix-cache hit supplied).
    step          the positions [start, end) of the step the implementation last reserved
                  slots for (prefill chunk, or decode token plus lookahead).
    prompt_len    tokens at the latest (re)admission; a preempted sequence recomputes all of
                  them as prefill before it samples again.
    """

    seq_id: int
    tokens: tuple[int, ...]
    num_computed: int = 0
    status: Status = Status.RUNNING
    step: tuple[int, int] = (0, 0)
    extra: ExtraKeys = NO_EXTRA  # cache salt, LoRA adapter, multimodal features
    prompt_len: int = 0  # tokens at its latest (re)admission: all of them are prefill

    def decoding(self) -> bool:
        """A token has been sampled and everything before it is computed."""
        return len(self.tokens) > self.prompt_len and self.num_computed == len(self.tokens) - 1


@attrs.frozen
class World:
    """Everything the state invariants look at, after one operation."""

    config: Config
    state: KVState
    seqs: Mapping[int, SeqModel]
    memory: Mapping[tuple[Device, int, int], tuple[int, int]]  # cell -> (position, token)
