"""Reading vLLM's V1 ``Scheduler`` (vllm/v1/core/sched), for the scheduler machine's
straight-line reproducers (testing/scheduler/reproducer.py).

Each function is copied into a reproducer with ``inspect.getsource``: it imports nothing but
vLLM's own modules and reads only the scheduler's own objects, as ``adapters/v1_scheduler.py``
observes them.
"""

from __future__ import annotations

from typing import Any


def block_table(scheduler: Any, group: int, request_id: str) -> list[int | None]:
    """The block ids a request holds in one KV-cache group, in table order; None for vLLM's
    null block (a slot a sliding window dropped).  Empty when the request holds none there."""
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[group]
    null = scheduler.kv_cache_manager.block_pool.null_block
    held = manager.req_to_blocks.get(request_id, [])
    return [None if (b is null or getattr(b, "is_null", False)) else b.block_id for b in held]


def refcounts(scheduler: Any) -> dict[int, int]:
    """``ref_cnt`` of every block of the shared pool (vLLM's null block left out)."""
    pool = scheduler.kv_cache_manager.block_pool
    return {b.block_id: b.ref_cnt for b in pool.blocks if b is not pool.null_block}


def cached_entries(scheduler: Any, groups: int) -> list[int]:
    """Prefix-cache entries per KV-cache group: the scheduler differential's ``cached`` counts (a
    block registered under several keys counts once per key)."""
    from vllm.v1.core import kv_cache_utils

    raw = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    raw = getattr(raw, "_cache", raw)
    counts = [0] * groups
    for key, entry in raw.items():
        if hasattr(kv_cache_utils, "get_group_id"):  # 0.11+: the hash's bytes carry the group
            group = kv_cache_utils.get_group_id(key)
        else:  # 0.9-0.10: BlockHashWithGroupId
            group = key.group_id
        counts[group] += len(entry) if isinstance(entry, dict) else 1
    return counts
