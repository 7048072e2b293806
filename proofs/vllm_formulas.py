"""vLLM's block arithmetic, restated as one-line formulas with where each was read.

Nothing here is vLLM's code: each function restates one formula (with vLLM's ``cdiv(a, b)``
= ceil(a / b)) next to its z3 encoding, and both are registered for the conformance tests.
tests/test_proofs_vllm_formulas.py checks the restatements against the installed release.
Paths are relative to the release's site-packages.

0.6.3 legacy BlockSpaceManagerV2 (vllm/core/block_manager_v2.py):
  :79,84  ``max_block_sliding_window = W // B + 1 + 1``
  :91     ``watermark_blocks = int(watermark * num_gpu_blocks)``, watermark 0.01 by default (:65)
  :117-143 ``can_allocate``: need = cdiv(prompt_len + lookahead, B) (block/block_table.py:79),
          capped at max_block_sliding_window; NEVER if total - need < watermark_blocks, OK if
          free - need >= watermark_blocks, else LATER
  :159 ``allocate`` -> BlockTable.allocate (block/block_table.py:81-100): one block per
          prompt chunk of B tokens, cdiv(prompt_len, B) blocks, no window applied
  block/block_table.py:138-146 (append_token_ids): frees slots idx < computed // B -
          max_block_sliding_window
0.6.3 legacy BlockSpaceManagerV1 (vllm/core/block_manager_v1.py):
  :253 ``block_sliding_window = ceil(W / B)``; :326-329 logical block i >= that reuses
          physical block ``table[i % block_sliding_window]`` (a ring)
  :284-316 ``can_allocate``: need = seq.n_blocks = cdiv(prompt_len, B) (vllm/sequence.py:451),
          capped at block_sliding_window, same watermark rule as V2
0.33.0 V1 engine (vllm/v1/kv_cache_interface.py):
  :918-944 ``SlidingWindowSpec.max_admission_blocks_per_request`` =
          cdiv(min(W - 1 + extra_retained_tokens + max_in_flight_tokens, max_model_len), B) + 1
          (also the pool sizer, ``max_memory_usage_bytes`` :946-955; the admission cap in
          v1/core/single_type_kv_cache_manager.py:215-227)
"""

from __future__ import annotations

import z3

from .encode import Encoding, ceil_div, register, zmin

OK, LATER, NEVER = 0, 1, 2  # AllocStatus, as numbers so one encoding can return it

V063_V2 = "vllm 0.6.3 vllm/core/block_manager_v2.py"
V063_V1 = "vllm 0.6.3 vllm/core/block_manager_v1.py"
V0330_V1 = "vllm 0.33.0 vllm/v1/kv_cache_interface.py"


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


# ---------------------------------------------------------------- 0.6.3 BlockSpaceManagerV2


def v2_max_block_sliding_window(w: int, b: int) -> int:
    """block_manager_v2.py:79,84."""
    return w // b + 2


def z_v2_max_block_sliding_window(w, b):
    return w / b + 2


def v2_watermark_blocks(num_blocks: int) -> int:
    """block_manager_v2.py:91 with the default watermark 0.01 (:65)."""
    return int(0.01 * num_blocks)


def z_v2_watermark_blocks(num_blocks):
    return num_blocks / 100


def v2_can_allocate(
    prompt_len: int, lookahead: int, b: int, w: int | None, num_blocks: int, free: int
) -> int:
    """block_manager_v2.py:117-145 for a decoder-only group: OK / LATER / NEVER."""
    need = _cdiv(prompt_len + lookahead, b)
    need = need if w is None else min(need, v2_max_block_sliding_window(w, b))
    wm = v2_watermark_blocks(num_blocks)
    return NEVER if num_blocks - need < wm else OK if free - need >= wm else LATER


def z_v2_can_allocate(prompt_len, lookahead, b, win, num_blocks, free):
    need = ceil_div(prompt_len + lookahead, b)
    need = z3.If(win.on, zmin(need, z_v2_max_block_sliding_window(win.size, b)), need)
    wm = z_v2_watermark_blocks(num_blocks)
    return z3.If(num_blocks - need < wm, NEVER, z3.If(free - need >= wm, OK, LATER))


def v2_allocate_blocks(prompt_len: int, b: int) -> int:
    """Blocks ``allocate`` takes without prefix caching: block_table.py:81-100, 262-292."""
    return _cdiv(prompt_len, b)


def z_v2_allocate_blocks(prompt_len, b):
    return ceil_div(prompt_len, b)


def v2_first_kept_slot(computed: int, b: int, w: int) -> int:
    """block_table.py:141-146: slots below this index are freed (null block) on append."""
    return max(0, computed // b - v2_max_block_sliding_window(w, b))


def z_v2_first_kept_slot(computed, b, w):
    kept = computed / b - z_v2_max_block_sliding_window(w, b)
    return z3.If(kept > 0, kept, 0)


# ---------------------------------------------------------------- 0.6.3 BlockSpaceManagerV1


def v1_block_sliding_window(w: int, b: int) -> int:
    """block_manager_v1.py:253."""
    return _cdiv(w, b)


def z_v1_block_sliding_window(w, b):
    return ceil_div(w, b)


def v1_can_allocate(prompt_len: int, b: int, w: int | None, num_blocks: int, free: int) -> int:
    """block_manager_v1.py:284-316 for a decoder-only group (no lookahead in V1)."""
    need = _cdiv(prompt_len, b)
    need = need if w is None else min(need, v1_block_sliding_window(w, b))
    wm = v2_watermark_blocks(num_blocks)  # same int(0.01 * num_gpu_blocks), :260
    return NEVER if num_blocks - need < wm else OK if free - need >= wm else LATER


def z_v1_can_allocate(prompt_len, b, win, num_blocks, free):
    need = ceil_div(prompt_len, b)
    need = z3.If(win.on, zmin(need, z_v1_block_sliding_window(win.size, b)), need)
    wm = z_v2_watermark_blocks(num_blocks)
    return z3.If(num_blocks - need < wm, NEVER, z3.If(free - need >= wm, OK, LATER))


def v1_allocate_blocks(prompt_len: int, b: int, w: int | None) -> int:
    """Physical blocks ``_allocate_sequence`` takes (:321-335): the ring stops at ceil(W/B)."""
    n = _cdiv(prompt_len, b)
    return n if w is None else min(n, v1_block_sliding_window(w, b))


def z_v1_allocate_blocks(prompt_len, b, win):
    n = ceil_div(prompt_len, b)
    return z3.If(win.on, zmin(n, z_v1_block_sliding_window(win.size, b)), n)


def v1_ring_block(logical: int, w: int, b: int) -> int:
    """block_manager_v1.py:326-329: the table entry logical block ``logical`` shares."""
    r = v1_block_sliding_window(w, b)
    return logical if logical < r else logical % r


def z_v1_ring_block(logical, w, b):
    r = z_v1_block_sliding_window(w, b)
    return z3.If(logical < r, logical, logical % r)


# ---------------------------------------------------------------- 0.33.0 V1 engine


def v1engine_max_admission_blocks(w: int, extra: int, in_flight: int, max_len: int, b: int) -> int:
    """kv_cache_interface.py:937-944."""
    return _cdiv(min(w - 1 + extra + in_flight, max_len), b) + 1


def z_v1engine_max_admission_blocks(w, extra, in_flight, max_len, b):
    return ceil_div(zmin(w - 1 + extra + in_flight, max_len), b) + 1


for _enc in (
    Encoding(
        "vllm-0.6.3.v2.max_block_sliding_window",
        v2_max_block_sliding_window,
        z_v2_max_block_sliding_window,
        ("pos", "pos"),
        source=f"{V063_V2}:79,84",
    ),
    Encoding(
        "vllm-0.6.3.v2.watermark_blocks",
        v2_watermark_blocks,
        z_v2_watermark_blocks,
        ("nat",),
        source=f"{V063_V2}:91",
    ),
    Encoding(
        "vllm-0.6.3.v2.can_allocate",
        v2_can_allocate,
        z_v2_can_allocate,
        ("pos", "nat", "pos", "window", "pos", "nat"),
        requires=lambda L, la, b, w, n, f: f <= n,
        source=f"{V063_V2}:117-145",
    ),
    Encoding(
        "vllm-0.6.3.v2.allocate_blocks",
        v2_allocate_blocks,
        z_v2_allocate_blocks,
        ("pos", "pos"),
        source="vllm 0.6.3 vllm/core/block/block_table.py:81-100",
    ),
    Encoding(
        "vllm-0.6.3.v2.first_kept_slot",
        v2_first_kept_slot,
        z_v2_first_kept_slot,
        ("nat", "pos", "pos"),
        source="vllm 0.6.3 vllm/core/block/block_table.py:141-146",
    ),
    Encoding(
        "vllm-0.6.3.v1.block_sliding_window",
        v1_block_sliding_window,
        z_v1_block_sliding_window,
        ("pos", "pos"),
        source=f"{V063_V1}:253",
    ),
    Encoding(
        "vllm-0.6.3.v1.can_allocate",
        v1_can_allocate,
        z_v1_can_allocate,
        ("pos", "pos", "window", "pos", "nat"),
        requires=lambda L, b, w, n, f: f <= n,
        source=f"{V063_V1}:284-316",
    ),
    Encoding(
        "vllm-0.6.3.v1.allocate_blocks",
        v1_allocate_blocks,
        z_v1_allocate_blocks,
        ("pos", "pos", "window"),
        source=f"{V063_V1}:321-335",
    ),
    Encoding(
        "vllm-0.6.3.v1.ring_block",
        v1_ring_block,
        z_v1_ring_block,
        ("nat", "pos", "pos"),
        source=f"{V063_V1}:326-329",
    ),
    Encoding(
        "vllm-0.33.0.v1.max_admission_blocks_per_request",
        v1engine_max_admission_blocks,
        z_v1engine_max_admission_blocks,
        ("pos", "nat", "pos", "pos", "pos"),
        source=f"{V0330_V1}:937-944",
    ),
):
    register(_enc)
