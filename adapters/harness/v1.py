"""Reading vLLM's V1-engine ``KVCacheManager`` (vllm/v1/core), for straight-line reproducers.

The names match ``harness.legacy`` so that a reproducer's checks read the same on either
engine.  Imports nothing at module level (each function is copied into a reproducer with
``inspect.getsource``): the manager's own objects carry everything.
"""

from __future__ import annotations

from typing import Any


def accepted(cls: Any, **candidates: Any) -> dict[str, Any]:
    """The keyword arguments of ``candidates`` that this release's ``cls`` takes: constructors'
    parameters come and go between releases (``KVCacheManager``: ``hash_block_size`` from 0.20,
    ``scheduler_block_size`` from 0.31), so a file written on one release builds on another."""
    import inspect

    params = inspect.signature(cls).parameters
    return {k: v for k, v in candidates.items() if k in params}


def gpu_refcounts(mgr: Any) -> dict[int, int]:
    """``ref_cnt`` of every block of the pool (vLLM's null block left out)."""
    pool = mgr.block_pool
    return {b.block_id: b.ref_cnt for b in pool.blocks if b is not pool.null_block}


def gpu_block_ids(mgr: Any, seq_id: int) -> list[int]:
    """The blocks the request kvspec named ``seq<seq_id>-...`` holds (null blocks left out)."""
    coordinator = mgr.coordinator
    prefix = f"seq{seq_id}-"
    for manager in coordinator.single_type_managers:
        for request_id, blocks in manager.req_to_blocks.items():
            if request_id.startswith(prefix):
                return [b.block_id for b in blocks if not b.is_null]
    return []


def free_queue_ids(mgr: Any) -> list[int]:
    """The block ids on the pool's free queue, in queue order (a block freed twice is on it twice)."""
    queue = mgr.block_pool.free_block_queue
    if hasattr(queue, "get_all_free_blocks"):
        return [b.block_id for b in queue.get_all_free_blocks()]
    ids, block = [], queue.free_list_head  # 0.8.x: a plain linked list, no sentinels
    while block is not None:
        ids.append(block.block_id)
        block = block.next_free_block
    return ids


def cached_block_count(mgr: Any) -> int:
    """Blocks of the pool that carry a prefix-cache hash (held or evictable)."""
    pool = mgr.block_pool
    return sum(1 for b in pool.blocks if b is not pool.null_block and b.block_hash is not None)


def renamed(tables: dict[int, list[int]]) -> dict[int, list[int]]:
    """Block tables with every block id replaced by the order of its first appearance (by
    sequence, then slot): equal for two managers that differ only in which ids they hand out."""
    names: dict[int, int] = {}
    return {s: [names.setdefault(b, len(names)) for b in tables[s]] for s in sorted(tables)}


def eviction_order(mgr: Any, requests: dict[str, Any]) -> list[str]:
    """The free queue's cached blocks in the order they would be evicted, each named by the
    first request (of ``requests``, by name) and block index whose hash it carries: equal for
    two managers that evict alike, whatever ids they use and however hashes are seeded."""
    from vllm.v1.core import kv_cache_utils

    names: dict[Any, str] = {}
    for label, request in requests.items():
        for i, h in enumerate(getattr(request, "block_hashes", ())):
            names.setdefault(h, f"{label}[{i}]")
    order = []
    for block in mgr.block_pool.free_block_queue.get_all_free_blocks():
        key = block.block_hash
        if key is None:
            continue
        if hasattr(kv_cache_utils, "get_block_hash") and isinstance(key, bytes | bytearray):
            key = kv_cache_utils.get_block_hash(key)  # 0.11+: hash bytes + group id
        order.append(names.get(getattr(key, "block_hash", key), "?"))
    return order
