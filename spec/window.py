"""Window semantics and block arithmetic.

Window semantics (the spec's, and vLLM's): with sliding window W, the token at position p
attends the W positions ``max(0, p - W + 1) .. p``, itself included.  This is what vLLM's
attention backends implement with ``window_size = (W - 1, 0)`` (legacy and V1 FlashAttention
backends) and what V1's ``SlidingWindowManager`` relies on when it frees every block before
``num_computed_tokens - W + 1`` (vllm/v1/core/single_type_kv_cache_manager.py).

Sections in the consensus-specs order: predicates, then arithmetic.  Everything is a pure
function of named quantities; every division has a positive divisor.
"""

from __future__ import annotations

# ---------------------------------------------------------------- predicates


def attends(query_pos: int, key_pos: int, window: int | None) -> bool:
    """Whether the token at ``query_pos`` attends the key at ``key_pos`` (causal, windowed)."""
    if key_pos > query_pos or key_pos < 0:
        return False
    return window is None or query_pos - key_pos < window


# ---------------------------------------------------------------- arithmetic


def ceil_div(a: int, b: int) -> int:
    """Ceiling of a / b for b >= 1 (a may be negative)."""
    assert b >= 1
    return -((-a) // b)


def block_of(position: int, block_size: int) -> int:
    """Index, in a block table, of the block holding token position ``position``."""
    assert block_size >= 1 and position >= 0
    return position // block_size


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that positions 0 .. num_tokens-1 occupy."""
    return ceil_div(num_tokens, block_size)


def blocks_touched(lo: int, hi: int, block_size: int) -> int:
    """Number of blocks that the positions lo .. hi (inclusive) fall in; 0 when empty."""
    assert block_size >= 1
    if hi < lo:
        return 0
    return hi // block_size - lo // block_size + 1


def window_cover(window: int, block_size: int) -> int:
    """The most blocks that any ``window`` consecutive positions can touch.

    ``ceil((W - 1) / B) + 1``: W positions starting at the last slot of a block spill
    over ``W - 1`` further positions.  The tempting ``ceil(W / B)`` is one short whenever
    ``W mod B != 1`` (and B > 1); proofs/ has both the proof and the witness.
    """
    assert window >= 1 and block_size >= 1
    return ceil_div(window - 1, block_size) + 1


def first_needed_position(start: int, window: int | None) -> int:
    """First position still attended when computing the token at ``start`` onwards."""
    if window is None:
        return 0
    return max(0, start - window + 1)


def needed_blocks(start: int, end: int, window: int | None, block_size: int) -> int:
    """Blocks that must be held while computing positions ``start .. end-1``.

    The step writes the KV of every scheduled position and reads the window of each:
    positions ``first_needed_position(start) .. end - 1``.  With full attention that is
    every block up to ``end``.
    """
    if end <= start:
        end = start + 1
    return blocks_touched(first_needed_position(start, window), end - 1, block_size)


def first_needed_block(start: int, window: int | None, block_size: int) -> int:
    """Index of the first block-table slot a step starting at ``start`` still needs."""
    return first_needed_position(start, window) // block_size
