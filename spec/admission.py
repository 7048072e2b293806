"""Admission arithmetic: exactly how many blocks admitting a sequence's first step takes.

Admission must be sound (``admission-soundness``): answering OK promises that the
allocation that follows fits.  The exact need of a first step over positions
``hit .. hit + k - 1`` (``hit`` leading tokens already in the prefix cache, whole blocks) is
the slots of the needed range (see ``window.needed_blocks``) that no hit covers.  Hit blocks
that sit unreferenced in the evictable set are taken out of it, so they count against the
same capacity.  vLLM's legacy BlockSpaceManagerV2 instead caps the need of a whole prompt at
``max_block_sliding_window`` while ``allocate`` takes every prompt block: the seed bug.

Policy freedoms (not pinned by the spec): a watermark of blocks kept back (legacy
``watermark_blocks``) may make an implementation answer LATER where the exact need fits; which
free block is picked; eviction order among unreferenced cached blocks.
"""

from __future__ import annotations

from .window import first_needed_block


def new_blocks_for_step(hit_tokens: int, end: int, window: int | None, block_size: int) -> int:
    """Blocks a first step over positions ``hit_tokens .. end-1`` must newly allocate.

    Slots ``first_needed_block(hit_tokens) .. (end-1)//B`` are needed; the ones below
    ``hit_tokens // B`` are prefix-cache hits and are reused, not allocated.
    """
    assert block_size >= 1 and end > hit_tokens >= 0
    first = first_needed_block(hit_tokens, window, block_size)
    last = (end - 1) // block_size
    return last - max(first, hit_tokens // block_size) + 1


def hit_blocks_held(hit_tokens: int, window: int | None, block_size: int) -> int:
    """Hit blocks the sequence keeps (a sliding window drops hits that fall outside it)."""
    assert block_size >= 1 and hit_tokens >= 0
    first = first_needed_block(hit_tokens, window, block_size)
    return max(0, hit_tokens // block_size - first)


def fits(new_blocks: int, evictable_hits: int, free: int, evictable: int) -> bool:
    """Whether a first step fits: new blocks, plus hits revived from the evictable set, must not
    exceed the blocks that are free or evictable.
    """
    return new_blocks + evictable_hits <= free + evictable
