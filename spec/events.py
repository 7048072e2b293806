"""KV-cache events: the stream that tells KV-aware routers and offload tiers what a server's
prefix cache holds.

vLLM V1 queues an event whenever its cache map changes (vllm/v1/core/block_pool.py of 0.33.0):
``BlockStored`` when blocks are published under their hashes (``cache_full_blocks``
230-356, and ``cache_partial_block`` 486-603 for a partial tail), ``BlockRemoved`` for every
(hash, block) entry dropped (``_emit_block_removed_events`` 651-664: eviction through
``_maybe_evict_cached_block``, and a partial entry superseded when its block is promoted to a
full one, 288-297), ``AllBlocksCleared`` on ``reset_prefix_cache`` (871-910).  The engine
drains the queue with ``take_events`` (934-945) after every scheduler step and publishes it
(vllm/distributed/kv_events.py).  A consumer (llm-d, Dynamo, LMCache) rebuilds the server's
cache map by replaying the stream from empty.

What the events carry: ``BlockStored.block_hashes`` and ``BlockRemoved.block_hashes`` -- the
hashes, not block ids; the hash is the ``ExternalBlockHash`` form, raw bytes or their low 64
bits as an int (``maybe_convert_block_hash``, kv_cache_utils.py:82-85, chosen by
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).  V1 keeps duplicate blocks under one hash (NOTE #1
in block_pool.py): each duplicate is stored and removed by its own event, so a consumer
counts.  The spec's event therefore carries keys (``PrefixKey``, the collision-free hash), and
replaying a stream gives a multiset: how many blocks each key is cached in.

Out of the spec: ``emit_cached_block_events`` (block_pool.py:405-484) re-announces reused
blocks only when a request asks for ``kv_cache_report_mode == "full"``, a report of reuse rather
than of storage; the machines run the default incremental mode.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from enum import StrEnum

import attrs

from .prefix_hash import PrefixKey


class EventKind(StrEnum):
    STORED = "stored"  # BlockStored: each key now names one more cached block
    REMOVED = "removed"  # BlockRemoved: each key names one cached block fewer
    CLEARED = "cleared"  # AllBlocksCleared: the cache map is empty


@attrs.frozen
class CacheEvent:
    kind: EventKind
    keys: tuple[PrefixKey, ...] = ()

    def describe(self) -> str:
        if self.kind is EventKind.CLEARED:
            return "AllBlocksCleared"
        shown = ", ".join(f"{len(k.chain)} tokens" for k in self.keys)
        return f"{'BlockStored' if self.kind is EventKind.STORED else 'BlockRemoved'}({shown})"


def replay(events: Iterable[CacheEvent]) -> tuple[Counter[PrefixKey], list[str]]:
    """Replay an event stream from an empty cache: the multiset of cached keys it describes,
    and the events that contradict the stream before them (a removal of a key not stored)."""
    stream = EventReplay()
    faults = stream.feed(events)
    return +stream.live, faults


@attrs.define
class EventReplay:
    """An event stream replayed so far: ``feed`` takes the events that follow, so a stream
    that only grows is replayed once in all (``replay`` is one ``feed`` of every event)."""

    live: Counter[PrefixKey] = attrs.Factory(Counter)
    seen: int = 0  # events fed so far; faults number events from 1

    def feed(self, events: Iterable[CacheEvent]) -> list[str]:
        """Apply the next events; the faults among them (a removal of a key not stored)."""
        live = self.live
        faults: list[str] = []
        for event in events:
            self.seen += 1
            if event.kind is EventKind.CLEARED:
                live.clear()
            elif event.kind is EventKind.STORED:
                live.update(event.keys)
            else:
                for key in event.keys:
                    if live[key] <= 0:
                        faults.append(
                            f"event {self.seen} ({event.describe()}) removes a key no earlier event stored "
                            f"(chain of {len(key.chain)} tokens)"
                        )
                    else:
                        live[key] -= 1
        return faults
