"""Reading vLLM's V1 ``Scheduler`` (vllm/v1/core/sched), for the scheduler machine's
straight-line reproducers (testing/scheduler/reproducer.py).

Each function is copied into a reproducer with ``inspect.getsource``: it imports nothing and
reads only the scheduler's own objects, as ``adapters/v1_scheduler.py`` observes them.
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
