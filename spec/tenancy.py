"""The prefix cache as tenants and routers see it: isolation between domains, and the event
stream that describes the cache map.  Registered with the other invariants
(``spec.invariants.INVARIANTS``); the statement is each function's docstring.

Prefix-cache reset and retention (what the spec allows and forbids):

* ``reset_prefix_cache`` may refuse, and V1 refuses whenever any block is in use
  (block_pool.py:871-884 of 0.33.0: ``num_used_blocks != 1`` -> False; legacy
  ``PrefixCachingBlockAllocator.reset_prefix_cache`` likewise while blocks are referenced).
  A refused reset changes nothing.  A reset that succeeds empties the cache map, so no later
  lookup hits content cached before it, moves every evictable block to the free list, and
  leaves live sequences' tables and refcounts alone (``conservation``,
  ``prefix-cache-consistency``).  It emits ``AllBlocksCleared`` (block_pool.py:907-908), after
  which the event stream replays to the empty map (``event-consistency``).
* Retention: an unreferenced cached block may be kept (evictable) or evicted at any time
  eviction needs a block; the spec fixes no eviction order (LRU in vLLM's
  ``FreeKVCacheBlockQueue``, a policy).  The retention interval
  (``KVCacheConfig.prefix_cache_retention_interval``, ``Shape.retention_interval``; 0, sparse,
  is the engine's default from 0.30.0) only thins which full blocks of a sliding-window or
  Mamba group get published (``SingleTypeKVCacheManager.cache_blocks`` passing
  ``reachable_block_mask`` to ``cache_full_blocks``, 0.33.0 single_type_kv_cache_manager.py:
  477-543, :1067-1140, :1549-1610; 0.30.0 :470, :1065, :1566; full-attention and chunked-local
  groups publish every full block, kv_cache_coordinator.py:40-55), a freedom of *which* blocks
  are cached and so of how long a later hit is: the scheduler differential, whose reference
  publishes densely, does not compare such shapes (testing/scheduler/machine.py
  ``SchedulerMachine.start``), and no invariant asks such a group for a block it did not
  publish.  It never allows a key to name other content (``prefix-cache-consistency``), a hit
  across domains (``prefix-cache-isolation``) or an unannounced change of the map
  (``event-consistency``).
  Retention is no freedom to serve a reset's or an eviction's stale entries.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator

from .events import replay
from .prefix_hash import PrefixKey, confused_domains
from .registry import invariant, live_tables, needs_prefix_caching, pools
from .state import Device, PoolView, World
from .violation import Violation, fact


def _extra_text(extra: tuple[object, ...]) -> str:
    return ",".join("=".join(map(str, part)) for part in extra) or "plain"


@invariant(
    "prefix-cache-isolation",
    "Prefix hits stay inside their domain",
    "generate_block_hash_extra_keys / hash_block_tokens / get_request_block_hasher "
    "(vllm/v1/core/kv_cache_utils.py: cache_salt, LoRA, multimodal features), "
    "Request.cache_salt/lora_request/mm_features (vllm/v1/request.py)",
    applies=needs_prefix_caching,
)
def prefix_cache_isolation(world: World) -> Iterator[Violation]:
    """No prefix-cache hit crosses a cache-salt, LoRA-adapter or multimodal-content domain: a
    block a live sequence holds is cached, if at all, under a key of that sequence's own domain
    (``ExtraKeys.for_chain``), and two live sequences share a block only when their domains
    agree up to that block's end -- identical prompts in different domains never share a block.

    A salt or an adapter separates every block of a request; a multimodal feature separates the
    blocks from the one it starts in (a feature placed after a block leaves that block
    shareable).  Checked on the blocks sequences hold, which is where crossed KV is read.
    """
    for device, pool in pools(world.state):
        keys_of: dict[int, list[PrefixKey]] = defaultdict(list)
        for key, block in pool.cached:
            keys_of[block].append(key)
        held_by: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for table in live_tables(world, device):
            for i, block in enumerate(table.slots):
                if block is not None:
                    held_by[block].append((table.seq_id, i))
        for block in sorted(held_by):
            yield from block_isolation(world, device, block, held_by[block], keys_of.get(block, ()))


def block_isolation(
    world: World, device: Device, block: int, holders: Iterable[tuple[int, int]], keys: Iterable[PrefixKey]
) -> Iterator[Violation]:
    """``prefix-cache-isolation`` on one block: ``holders`` are the (live sequence, slot) pairs
    that hold it, ``keys`` the keys the cache map names it under."""
    B = world.config.block_size
    keys = tuple(keys)
    domains: dict[tuple[object, ...], list[int]] = {}
    for seq_id, i in sorted(holders):
        seq = world.seqs[seq_id]
        domains.setdefault(seq.extra.for_chain((i + 1) * B), []).append(seq_id)
        for key in keys:
            n = len(key.chain)
            if key.block_index(B) != i or key.chain != tuple(seq.tokens[:n]):
                continue  # another chain: prefix-cache-consistency's business
            own = seq.extra.for_chain(n)
            if key.extra != own:
                yield fact(
                    "cross-domain-key",
                    f"seq {seq.seq_id} ({seq.extra.describe()}) holds {device.value} "
                    f"block {block} at slot {i}, cached under the same tokens in another "
                    f"domain ({_extra_text(key.extra)}; its own: {_extra_text(own)})",
                    seqs=(seq.seq_id,),
                    device=device.value,
                    blocks=(block,),
                    expected=_extra_text(own),
                    observed=_extra_text(key.extra),
                    domains=confused_domains(own, key.extra),
                )
    if len(domains) > 1:
        shown = "; ".join(f"seqs {sids} in {_extra_text(d)}" for d, sids in sorted(domains.items(), key=str))
        yield fact(
            "cross-domain-share",
            f"{device.value} block {block} is shared across domains: {shown}",
            seqs=sorted({s for sids in domains.values() for s in sids}),
            device=device.value,
            blocks=(block,),
            expected=1,
            observed=len(domains),
        )


@invariant(
    "event-consistency",
    "KV-cache events describe the cache map",
    "BlockPool.kv_event_queue / take_events, BlockStored/BlockRemoved/AllBlocksCleared "
    "(vllm/v1/core/block_pool.py, vllm/distributed/kv_events.py)",
    applies=needs_prefix_caching,
)
def event_consistency(world: World) -> Iterator[Violation]:
    """Replaying the pool's KV-cache event stream from empty yields exactly its prefix-cache map
    after every operation: each key as many times as blocks are cached under it; no event
    removes a key that is not stored, and none announces a key the map does not hold.

    Events carry hashes, not block ids (``spec.events``), so the map is compared as a multiset
    of keys.  Under a hybrid scheduler each KV-cache group is checked on its own stream against
    its own map (``GroupState.events``; 0.33.0 events name their group, ``group_idx``), partial
    tail entries included.  An implementation that emits no events (``PoolView.events`` None)
    says nothing.
    """
    for device, pool in pools(world.state):
        if pool.events is None:
            continue
        live, faults = replay(pool.events)
        for fault in faults:
            yield fact("bad-event", f"{device.value}: {fault}", device=device.value)
        cached = Counter(key for key, _ in pool.cached)
        for key in sorted(set(live) | set(cached), key=key_order):
            fault = event_key_fault(device, pool, key, live[key], cached[key])
            if fault is not None:
                yield fault


def key_order(key: PrefixKey) -> tuple:
    """The order ``event-consistency`` reports keys in."""
    return (len(key.chain), key.chain, str(key.extra))


def event_key_fault(device: Device, pool: PoolView, key: PrefixKey, said: int, held: int) -> Violation | None:
    """``event-consistency`` on one key: the stream says ``said`` blocks are cached under it,
    the map holds ``held``."""
    if said == held:
        return None
    blocks = sorted(b for k, b in pool.cached if k == key)
    return fact(
        "stream-differs",
        f"{device.value}: the event stream says {said} block(s) cached under the "
        f"{len(key.chain)}-token chain {_short(key.chain)} ({_extra_text(key.extra)}), "
        f"the cache map holds {held} {blocks} ({len(pool.events or ())} events so far)",
        device=device.value,
        blocks=blocks,
        expected=held,
        observed=said,
    )


def _short(chain: tuple[int, ...]) -> str:
    return str(list(chain)) if len(chain) <= 12 else f"[... {list(chain[-4:])}]"


__all__ = ["event_consistency", "prefix_cache_isolation"]
