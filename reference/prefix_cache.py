"""The reference scheduler's prefix cache: full blocks by key, per KV-cache group.

Small on purpose.  A full block is cached under its ``PrefixKey`` (spec/prefix_hash.py: the
token chain to its end and the request's domain), in the group that holds it; a block holds at
most one key and a key may name several blocks (two requests computing one prefix side by
side), of which a lookup takes the first cached.  The free queue stays the scheduler's
(reference/scheduler.py): a cached block whose last holder lets go stays cached in the queue
until the allocator hands it out again (``evict``), and a hit takes it back out (``touch``).

The hit searches (``full_hit``, ``window_hit``, ``chunk_hit``) are the three attention kinds'
rules, over a lookup function, so that each reads as the rule it is:

full attention   the longest run of cached blocks from position 0;
sliding window   from the end: the last run of ``ceil((W - 1) / B)`` consecutive cached blocks
                 (the window of the token after the hit), the blocks before it not needed
                 (None); a run reaching block 0 is a hit even if shorter;
chunked local    the blocks of the last chunk (the chunk of the token after the hit) from its
                 start, the blocks of earlier chunks not needed (None);
recurrent state  from the end: the last block whose state is cached (a Mamba state holds the
                 whole prefix before it), the blocks before it not needed (None).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
from kvspec.spec.prefix_hash import NO_EXTRA, ExtraKeys, PrefixKey
from kvspec.spec.window import ceil_div

Lookup = Callable[[int], int | None]  # block index -> the cached block holding it, or None


@attrs.frozen
class CacheKey:
    """What a block is cached under: its ``PrefixKey`` and the tokens after the block its key
    also covers (an EAGLE head's lookahead hashes), which the block does not hold."""

    key: PrefixKey
    lookahead: tuple[int, ...] = ()


class PrefixCache:
    """Cached full blocks: (group, key) -> blocks, block -> (group, key)."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[int, CacheKey], list[int]] = {}
        self._key: dict[int, tuple[int, CacheKey]] = {}

    def lookup(self, group: int, key: CacheKey) -> int | None:
        found = self._blocks.get((group, key))
        return found[0] if found else None

    def holds(self, block: int) -> bool:
        return block in self._key

    def insert(self, group: int, key: CacheKey, block: int) -> None:
        if block in self._key:
            return
        self._key[block] = (group, key)
        self._blocks.setdefault((group, key), []).append(block)

    def evict(self, block: int) -> None:
        """Forget ``block``'s key (the allocator hands the block out for new content)."""
        entry = self._key.pop(block, None)
        if entry is None:
            return
        blocks = self._blocks[entry]
        blocks.remove(block)
        if not blocks:
            del self._blocks[entry]

    def entries(self, group: int | None = None) -> tuple[tuple[PrefixKey, int], ...]:
        """(key, block) of every cached block (of one group), by block id."""
        return tuple(
            (key.key, block) for block, (g, key) in sorted(self._key.items()) if group is None or g == group
        )


def block_key(
    tokens: Sequence[int], end: int, extra: ExtraKeys = NO_EXTRA, lookahead: int = 0
) -> CacheKey | None:
    """The key of the block whose chain ends at token ``end``; with ``lookahead`` tokens the key
    also covers that many tokens after the block (None until they exist)."""
    if end + lookahead > len(tokens):
        return None
    return CacheKey(PrefixKey(tuple(tokens[:end]), extra.for_chain(end)), tuple(tokens[end : end + lookahead]))


def full_hit(lookup: Lookup, max_blocks: int) -> list[int]:
    """The longest run of cached blocks from block 0, at most ``max_blocks``."""
    hit: list[int] = []
    for i in range(max_blocks):
        block = lookup(i)
        if block is None:
            break
        hit.append(block)
    return hit


def window_hit(
    lookup: Lookup, max_blocks: int, block_size: int, window: int, alignment: int, drop_eagle: bool
) -> list[int | None]:
    """A sliding-window group's hit: searching from block ``max_blocks - 1`` down, the first run
    of ``ceil((W - 1) / B)`` consecutive cached blocks (one more with an EAGLE drop) whose end is
    a multiple of ``alignment`` tokens (a hit length every group can share), the blocks before
    it None; without such a run, the run from block 0 cut back to an aligned end.  With an
    EAGLE drop, the run's last block is then dropped (and the end aligned again)."""

    def aligned(blocks: int) -> bool:
        return blocks * block_size % alignment == 0

    needed = ceil_div(window - 1, block_size) + drop_eagle
    hit: list[int | None] = [None] * max_blocks
    run = 0
    found = False
    for i in range(max_blocks - 1, -1, -1):
        block = lookup(i)
        if block is None:
            run = 0
            continue
        if run == 0 and not aligned(i if drop_eagle else i + 1):
            continue
        hit[i] = block
        run += 1
        if run >= needed:
            del hit[i + run :]
            found = True
            break
    if not found:
        del hit[run:]
        while hit and not aligned(len(hit)):
            hit.pop()
    if drop_eagle and hit:
        hit.pop()
        while hit and not aligned(len(hit)):
            hit.pop()
    return hit


def chunk_hit(lookup: Lookup, max_blocks: int, first_block: int) -> list[int | None]:
    """A chunked-local group's hit: None for the blocks before ``first_block`` (the chunk of the
    token after the hit starts there), then the run of cached blocks from it."""
    hit: list[int | None] = [None] * first_block
    for i in range(first_block, max_blocks):
        block = lookup(i)
        if block is None:
            break
        hit.append(block)
    return hit


def state_hit(lookup: Lookup, max_blocks: int, block_size: int, alignment: int) -> list[int | None]:
    """A recurrent-state (Mamba "align") group's hit: searching from block ``max_blocks - 1``
    down, the first block whose state is cached and whose end is a multiple of ``alignment``
    tokens, the blocks before it None; none found, no hit.  One state is the whole prefix
    before it, so no run of blocks is needed (vLLM 0.33.0 single_type_kv_cache_manager.py
    :1522-1546, ``MambaManager.find_longest_cache_hit`` without hits inside a block)."""
    for i in range(max_blocks - 1, -1, -1):
        if (i + 1) * block_size % alignment:
            continue
        block = lookup(i)
        if block is not None:
            return [None] * i + [block]
    return []


def sparse_state_mask(
    start: int, end: int, block_size: int, alignment: int, retention: int | None, boundaries: Sequence[int] = ()
) -> list[bool]:
    """Which of a recurrent-state group's full blocks ``start .. end - 1`` have their state
    cached (vLLM 0.33.0 single_type_kv_cache_manager.py:1548-1606, ``MambaManager.
    reachable_block_mask``).  A hit needs the one block ending on its boundary, so no tail.

    ``retention`` None: every block (dense).  0: only the blocks ending on ``boundaries``
    (token positions, aligned down: the prompt's replay boundary and the shared-prefix
    junction).  Positive: the block ending each multiple of ``retention`` tokens (every block
    when the interval is at most one block), and those ending on ``boundaries``."""
    if retention is None:
        return [True] * (end - start)
    mask = [False] * (end - start)
    if retention:
        per_segment = retention // block_size
        if per_segment <= 1:
            return [True] * (end - start)
        mask = [(i + 1) % per_segment == 0 for i in range(start, end)]
    for boundary in boundaries:
        i = boundary // alignment * alignment // block_size - 1
        if start <= i < end:
            mask[i - start] = True
    return mask


def sparse_window_mask(
    start: int,
    end: int,
    block_size: int,
    window: int,
    alignment: int,
    eagle: bool,
    retention: int | None = None,
    boundaries: Sequence[int] = (),
) -> list[bool]:
    """Which of a sliding-window group's full blocks ``start .. end - 1`` are cached, with hits
    only at multiples of ``alignment`` tokens.  A tail is the ``needed`` blocks before a
    boundary (one block later with an EAGLE drop, which looks a block past the hit).

    ``retention`` (``Shape.retention_interval``) None: a tail before every aligned boundary
    (dense; every block when every block is such a tail).  0: no periodic tails.  Positive: a
    tail before every multiple of ``retention`` tokens (every block when every block is one).
    Under 0 or a positive retention, also the tail before each of ``boundaries`` (token
    positions, aligned down), where a later request can resume: the prompt's replay
    boundaries and a shared-prefix junction."""
    needed = ceil_div(window - 1, block_size) + eagle
    if alignment % block_size:
        return [True] * (end - start)
    shift = int(eagle)
    mask = [False] * (end - start)
    segment = alignment if retention is None else retention
    if segment:
        per_segment = segment // block_size
        if needed >= per_segment:
            return [True] * (end - start)
        mask = [i >= shift and (i - shift) % per_segment >= per_segment - needed for i in range(start, end)]
    if retention is not None:
        for boundary in boundaries:
            tail_end = boundary // alignment * alignment // block_size + shift
            for i in range(max(start, tail_end - needed), min(end, tail_end)):
                mask[i - start] = True
    return mask


def replay_boundaries(prompt: int, alignment: int, eagle: bool) -> tuple[int, ...]:
    """Token positions a later request sending this ``prompt``-token prompt again (or a longer
    one starting with it) can resume at: the prompt less its last token (recomputed for the
    logits); with an EAGLE drop, the aligned ends below that and below the prompt's last aligned
    end, each one ``alignment`` lower (the tail's shift adds the block back)."""
    if not eagle:
        return (prompt - 1,)
    resend = (prompt - 1) // alignment * alignment
    extension = prompt // alignment * alignment
    return tuple(sorted({max(resend - alignment, 0), max(extension - alignment, 0)}))


__all__ = [
    "CacheKey",
    "Lookup",
    "PrefixCache",
    "block_key",
    "chunk_hit",
    "full_hit",
    "replay_boundaries",
    "sparse_state_mask",
    "sparse_window_mask",
    "state_hit",
    "window_hit",
]
