"""Building and reading vLLM's legacy (V0) block managers, release by release.

Every constructor call is resolved into ``(callable, keyword arguments)`` by a ``*_call``
function, so that an adapter can make the call and a recorder can write it down with the
arguments the release accepts.  Releases are told apart by ``inspect.signature`` and import
availability, never by version numbers.  Imports only vLLM and the standard library.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

# BlockSpaceManager.get_block_space_manager_class names (vllm/core/interfaces.py).
VERSION_STRINGS = {"v1": "v1", "v2": "v2", "self_attn": "selfattn"}

Call = tuple[Callable[..., Any], dict[str, Any]]


def params(fn: Callable[..., Any]) -> frozenset[str]:
    """The parameter names of ``fn`` (bound methods through their function)."""
    return _function_params(getattr(fn, "__func__", fn))


@functools.cache
def _function_params(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def accepted(fn: Callable[..., Any], **candidates: Any) -> dict[str, Any]:
    """The subset of ``candidates`` that ``fn`` accepts by name."""
    names = params(fn)
    return {k: v for k, v in candidates.items() if k in names}


def manager_class(manager: str) -> type:
    """The block-manager class the release's scheduler builds for ``manager``
    (scheduler.py ``BlockSpaceManager.get_block_space_manager_class``)."""
    from vllm.core.interfaces import BlockSpaceManager

    return BlockSpaceManager.get_block_space_manager_class(VERSION_STRINGS[manager])


def manager_call(
    manager: str,
    *,
    block_size: int,
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    sliding_window: int | None,
    enable_caching: bool,
    watermark: float | None = None,
) -> Call:
    cls = manager_class(manager)
    kwargs = accepted(
        cls.__init__,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        sliding_window=sliding_window,
        enable_caching=enable_caching,
    )
    if watermark is not None:
        kwargs["watermark"] = watermark
    return cls, kwargs


def sequence_call(seq_id: int, tokens: Sequence[int], block_size: int) -> Call:
    """``Sequence(...)`` as the release's input processing builds a prompt-only sequence."""
    from vllm.sequence import Sequence as VllmSequence

    names = params(VllmSequence.__init__)
    kwargs: dict[str, Any] = {"seq_id": seq_id}
    if "inputs" in names:
        try:
            from vllm.inputs import token_inputs
        except ImportError:  # LLMInputs (0.5 - 0.6.3) is a TypedDict: a plain dict at runtime
            kwargs["inputs"] = {
                "prompt_token_ids": list(tokens),
                "prompt": None,
                "multi_modal_data": None,
            }
        else:
            kwargs["inputs"] = token_inputs(prompt_token_ids=list(tokens))
    else:  # 0.4.x: Sequence(seq_id, prompt, prompt_token_ids, block_size, ...)
        kwargs["prompt"] = None
        kwargs["prompt_token_ids"] = list(tokens)
    kwargs["block_size"] = block_size
    if "eos_token_id" in names:
        kwargs["eos_token_id"] = None
    return VllmSequence, kwargs


def group_call(request_id: str, seqs: list, arrival: float) -> Call:
    from vllm.sequence import SequenceGroup

    names = params(SequenceGroup.__init__)
    kwargs: dict[str, Any] = {"request_id": request_id, "seqs": seqs}
    if "arrival_time" in names:
        kwargs["arrival_time"] = arrival
    if "sampling_params" in names:
        try:
            from vllm import SamplingParams
        except ImportError:
            pass
        else:
            kwargs["sampling_params"] = SamplingParams()
    return SequenceGroup, kwargs


def token_logprobs(token: int) -> dict[int, Any]:
    """The logprobs argument of ``Sequence.append_token_id`` (a float in very old releases)."""
    from vllm import sequence as vseq

    logprob = getattr(vseq, "Logprob", None)
    return {token: logprob(0.0) if logprob is not None else 0.0}


def out_of_blocks_error() -> type[BaseException] | None:
    try:
        from vllm.core.block.interfaces import BlockAllocator
    except ImportError:  # releases without the V2 block allocator
        return None
    return BlockAllocator.NoFreeBlocksError


def is_out_of_blocks(err: BaseException) -> bool:
    """vLLM's out-of-blocks failure: V2 ``NoFreeBlocksError``; BlockSpaceManagerV1's
    ``UncachedBlockAllocator.allocate`` / ``LRUEvictor.evict`` ValueErrors."""
    error = out_of_blocks_error()
    if error is not None and isinstance(err, error):
        return True
    return isinstance(err, ValueError) and (
        "No free blocks are available" in str(err) or "No usable cache memory left" in str(err)
    )


def block_copies(result: Any) -> list[tuple[int, int]]:
    """A block-copy result as (src, dst) pairs (a list of pairs, or the older dict src -> [dst])."""
    if not result:
        return []
    if isinstance(result, dict):
        out: list[tuple[int, int]] = []
        for src, dsts in result.items():
            if isinstance(dsts, int):
                out.append((int(src), int(dsts)))
            else:
                out.extend((int(src), int(d)) for d in dsts)
        return out
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], int):
        return [(int(result[0]), int(result[1]))]
    return [(int(a), int(b)) for a, b in result]


# ---------------------------------------------------------------- reading a manager


def is_v1_manager(mgr: Any) -> bool:
    """BlockSpaceManagerV1 (PhysicalTokenBlock tables) rather than V2/SelfAttn (BlockTable)."""
    return hasattr(mgr, "gpu_allocator")


def gpu_refcounts(mgr: Any) -> dict[int, int]:
    """Refcount of every GPU block the manager's allocator has (V2's null block excluded)."""
    if is_v1_manager(mgr):
        allocator = mgr.gpu_allocator
        if hasattr(allocator, "free_blocks"):  # UncachedBlockAllocator: scan the tables too
            blocks = {b.block_number: b for b in allocator.free_blocks}
            for table in mgr.block_tables.values():
                blocks.update((b.block_number, b) for b in table if b.device == allocator.device)
            return {n: b.ref_count for n, b in sorted(blocks.items())}
        blocks = [*allocator.cached_blocks.values(), *allocator.evictor.free_table.values()]
        counts = {n: 0 for n in range(allocator.num_blocks)}
        counts.update((b.block_number, b.ref_count) for b in blocks)
        return counts
    from vllm.utils import Device

    gpu = mgr.block_allocator._allocators[Device.GPU]
    naive = getattr(gpu, "_hashless_allocator", gpu)
    null = getattr(mgr.block_allocator, "_null_block", None)
    null_id = null.block_id if null is not None else None
    counts = naive.refcounter._refcounts
    return {b: counts[b] for b in sorted(gpu.all_block_ids) if b != null_id}


def gpu_block_ids(mgr: Any, seq_id: int) -> list[int]:
    """The GPU block ids in ``seq_id``'s block table (dropped window slots left out)."""
    table = mgr.block_tables.get(seq_id)
    if table is None:
        return []
    if is_v1_manager(mgr):
        return [b.block_number for b in table]
    null = getattr(mgr.block_allocator, "_null_block", None)
    null_id = null.block_id if null is not None else None
    return [b for b in table.physical_block_ids if b is not None and b != null_id]


def prefix_cache_hit_rate(mgr: Any, device: str = "GPU") -> float | None:
    """The prefix-cache hit rate the manager reports for ``device`` (``"GPU"`` or ``"CPU"``),
    the figure the engine exports in its stats every step (0.6.3 llm_engine.py:1594-1598,
    through ``Scheduler.get_prefix_cache_hit_rate``; -1 from an allocator without prefix
    caching); None from a manager that reports none (0.5.x has no such method)."""
    report = getattr(mgr, "get_prefix_cache_hit_rate", None)
    if report is None:
        return None
    from vllm.utils import Device

    return float(report(Device[device]))


def slot_of(mgr: Any, seq_id: int, position: int, block_size: int) -> tuple[int | None, int]:
    """The (block, offset) the worker writes ``position`` of ``seq_id`` into, through the
    block table the manager hands the worker (BlockSpaceManagerV1's sliding-window tables
    repeat blocks: entry i is physical block ``i % block_sliding_window``)."""
    table = mgr.block_tables[seq_id]
    index, offset = divmod(position, block_size)
    if is_v1_manager(mgr):
        return table[index].block_number, offset
    return table.physical_block_ids[index], offset


def marked_computed(mgr: Any, block: int) -> bool:
    """Whether the prefix cache may hand ``block`` out as a hit: the allocator counts its KV
    as computed (V2 ``block_is_computed``, BlockSpaceManagerV1 ``PhysicalTokenBlock.computed``)."""
    if is_v1_manager(mgr):
        allocator = mgr.gpu_allocator
        blocks = [*allocator.cached_blocks.values(), *allocator.evictor.free_table.values()]
        return any(b.block_number == block and b.computed for b in blocks)
    from vllm.utils import Device

    return bool(mgr.block_allocator._allocators[Device.GPU].block_is_computed(block))
