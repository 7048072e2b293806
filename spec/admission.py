"""Admission arithmetic: exactly how many blocks admitting a sequence's first step takes.

Admission must be sound (``admission-soundness``): answering OK promises that the
allocation that follows fits.  The exact need of a first step over positions
``hit .. hit + k - 1`` (``hit`` leading tokens already in the prefix cache, whole blocks) is
the slots of the needed range (see ``window.needed_blocks``) that no hit covers.  Hit blocks
that sit unreferenced in the evictable set are taken out of it, so they count against the
same capacity.  vLLM's legacy BlockSpaceManagerV2 instead caps the need of a whole prompt at
``max_block_sliding_window`` while ``allocate`` takes every prompt block: the seed bug.

Admission must also be complete (``admission-completeness``): an admission whose need fits
the free and evictable blocks, less the reserve the target *declares* (``AdmissionPolicy``),
is answered OK; NEVER only when the sequence could not fit an empty pool.  The same holds for
reservations of running sequences (``reserve-completeness``) and for prefix lookups
(``hit-completeness``).  The only room a target has is what its ``AdmissionPolicy`` states,
field by field, with the vLLM code that needs it.  Free policy, not pinned: which free block
is picked; eviction order among unreferenced cached blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from .window import blocks_for_tokens, blocks_touched, first_needed_block, needed_blocks


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


# ---------------------------------------------------------------- completeness: what a target may hold back


@attrs.frozen
class AdmissionPolicy:
    """What a target may keep back when it answers an admission, a reservation or a lookup:
    the only room ``admission-completeness``, ``reserve-completeness`` and ``hit-completeness``
    leave it.  Each implementation reports its own (``admission_policy``); the default is
    none at all (the reference).  Every field that departs from the default names the vLLM
    code that needs it in ``sources``.

    watermark_blocks         blocks an admission keeps free on top of its need: legacy
                             ``watermark_blocks = int(watermark * num_gpu_blocks)``
                             (0.6.3 block_manager_v2.py:91, 139-145; block_manager_v1.py
                             309-315); V1 0.33.0 ``KVCacheManager.watermark_blocks``
                             (kv_cache_manager.py:210, 518-525; 0 by default).
    watermark_when_idle      whether the watermark applies when nothing else is running
                             (legacy: always; V1 0.33.0: only ``has_scheduled_reqs``).
    whole_prompt             the admission counts every block of the prompt and no prefix hit
                             (legacy ``can_allocate``: ``get_num_required_blocks(seq.get_token_ids())``,
                             block_manager_v2.py:117-121; ``_get_seq_num_required_blocks``,
                             block_manager_v1.py:295-300).
    full_sequence_must_fit   the admission needs the whole request to fit, not its first step
                             (V1 0.33.0 ``allocate_slots(full_sequence_must_fit=True)``,
                             kv_cache_manager.py:530-548).
    step_counts_touched      a reservation counts every block the step touches as a new one,
                             the partly filled last block included (legacy V2
                             ``can_append_slots`` "worst-case heuristic",
                             block_manager_v2.py:202-229, block_table.py:336-354).
    step_block_per_sequence  a reservation wants one free block per running sequence of the
                             group, whatever it needs (legacy V1 ``can_append_slots``,
                             block_manager_v1.py:381-385).
    step_checks_group        a reservation checks the sequence's whole group (all running
                             siblings after a fork), not the sequence alone (legacy, both).
    hit_drops_last_block     a lookup may leave out the last hit block (V1 with EAGLE,
                             ``KVCacheManager(use_eagle=True)``: the drafter recomputes it).
    hits_with_window         whether a sliding-window sequence gets prefix hits at all (legacy
                             up to 0.6.3: the worker skips cached blocks only without a window,
                             worker/model_runner.py:505-559).
    window_retains_reachable_only  a sliding-window sequence's computed blocks are published
                             only where a later hit can use them: the ``ceil((W-1)/B)`` blocks
                             before each alignment boundary, none at all when that is 0 (V1
                             0.33.0 ``SlidingWindowManager.reachable_block_mask``,
                             single_type_kv_cache_manager.py:1067-1145, 956-966).
    window_hits_from_the_end a sliding-window lookup takes the last run of ``ceil((W-1)/B)``
                             cached blocks, searching from the prompt's end, even when blocks
                             before that run are gone (they become the null block): V1
                             ``SlidingWindowManager.find_longest_cache_hit`` (0.20.1
                             single_type_kv_cache_manager.py:509-580).  Reviving that hit's
                             in-window evictable blocks spends free capacity (``_get_num_evictable_blocks``
                             over the non-skipped hit blocks, :152-161), so the admission may
                             need more than the hit from the prompt's start would.
    """

    watermark_blocks: int = 0
    watermark_when_idle: bool = True
    whole_prompt: bool = False
    full_sequence_must_fit: bool = False
    step_counts_touched: bool = False
    step_block_per_sequence: bool = False
    step_checks_group: bool = False
    hit_drops_last_block: bool = False
    hits_with_window: bool = True
    window_retains_reachable_only: bool = False
    window_hits_from_the_end: bool = False
    sources: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        shown = [
            f"{f.name}={getattr(self, f.name)}"
            for f in attrs.fields(AdmissionPolicy)
            if f.name != "sources" and getattr(self, f.name) != f.default
        ]
        return ", ".join(shown) or "no reserve"


NO_RESERVE = AdmissionPolicy()


def admission_reserve(policy: AdmissionPolicy, others_running: bool) -> int:
    """Blocks an admission may keep free beyond its need."""
    return policy.watermark_blocks if (others_running or policy.watermark_when_idle) else 0


def admission_need(
    prompt_len: int,
    num_new_tokens: int,
    hit_tokens: int,
    lookahead: int,
    window: int | None,
    block_size: int,
    policy: AdmissionPolicy,
) -> int:
    """New blocks an admission may ask for, under ``policy``: the exact need of the first
    step (``new_blocks_for_step`` up to its lookahead slots), every prompt block with no hit
    discount (``whole_prompt``), or the whole request past the hit (``full_sequence_must_fit``).
    """
    if policy.whole_prompt:
        return blocks_for_tokens(prompt_len, block_size)
    if policy.full_sequence_must_fit:
        end = prompt_len + lookahead
    else:
        end = min(hit_tokens + max(1, num_new_tokens), prompt_len) + lookahead
    return new_blocks_for_step(hit_tokens, end, window, block_size)


def blocks_held_alone(
    prompt_len: int,
    num_new_tokens: int,
    hit_tokens: int,
    lookahead: int,
    window: int | None,
    block_size: int,
    policy: AdmissionPolicy,
) -> int:
    """Blocks the sequence holds after its first step, hits included: what it takes out of an
    otherwise empty pool."""
    if policy.whole_prompt:
        return blocks_for_tokens(prompt_len, block_size)
    if policy.full_sequence_must_fit:
        end = prompt_len + lookahead
    else:
        end = min(hit_tokens + max(1, num_new_tokens), prompt_len) + lookahead
    return needed_blocks(hit_tokens, end, window, block_size)


def must_admit(need: int, evictable_hits: int, reserve: int, free: int, evictable: int) -> bool:
    """``admission-completeness``: an admission whose need, plus the hits it revives from the
    evictable set, plus the declared reserve, fits the free and evictable blocks must be
    answered OK (and succeed)."""
    return need + evictable_hits + reserve <= free + evictable


def may_answer_never(held_alone: int, reserve: int, num_blocks: int) -> bool:
    """NEVER is allowed only when the blocks the sequence holds alone, plus the reserve,
    exceed the whole pool: no amount of waiting admits it."""
    return held_alone + reserve > num_blocks


def step_need(table_len: int, start: int, num_new_tokens: int, lookahead: int, block_size: int, copies: int) -> int:
    """Exact new blocks a reservation needs: slots past the table's end up to the step's last
    lookahead slot, plus a copy of every shared block the step writes into (copy-on-write)."""
    end = start + num_new_tokens + lookahead
    return max(0, blocks_for_tokens(end, block_size) - table_len) + copies


def step_touched(start: int, num_new_tokens: int, lookahead: int, block_size: int) -> int:
    """Blocks the positions ``start .. start+k+lookahead-1`` fall in, the partly filled first
    one included: legacy V2's worst-case count."""
    return blocks_touched(start, start + num_new_tokens + lookahead - 1, block_size)


def reserve_refusal_allowed(
    need: int,
    group_touched: int,
    group_running: int,
    available: int,
    policy: AdmissionPolicy,
) -> bool:
    """``reserve-completeness``: a reservation may be refused only when what the target
    declares it counts exceeds the free and evictable blocks: its exact need, or legacy's
    touched blocks of the group, or legacy V1's one block per running sibling."""
    bound = need
    if policy.step_counts_touched:
        bound = max(bound, group_touched)
    if policy.step_block_per_sequence:
        bound = max(bound, group_running)
    return bound > available


def publication_required(window: int | None, block_size: int, policy: AdmissionPolicy) -> bool:
    """Whether a computed full block must become findable by its key (``hit-completeness``):
    always, except for a sliding window of which no earlier block can serve a hit
    (``ceil((W-1)/B) == 0``) under ``window_retains_reachable_only``."""
    if window is None or not policy.window_retains_reachable_only:
        return True
    return blocks_for_tokens(window - 1, block_size) > 0


def window_hit_blocks(cached: Sequence[bool], window: int, block_size: int, drop_last: bool) -> tuple[int, int]:
    """The hit a ``window_hits_from_the_end`` lookup returns, given which full blocks of the
    prompt (``tokens[:-1]``) have their key cached on a computed block: ``(end, first)``, the
    hit covers blocks ``0 .. end-1`` of which ``first .. end-1`` are real blocks (those before
    are the null block).  The search runs from the end for ``ceil((W-1)/B)`` contiguous cached
    blocks (one more, then dropped, when ``drop_last``: EAGLE recomputes the last); without
    such a run the leading run of cached blocks is the hit."""
    assert block_size >= 1 and window >= 1
    wanted = blocks_for_tokens(window - 1, block_size) + int(drop_last)
    run = 0
    for i in range(len(cached) - 1, -1, -1):
        if not cached[i]:
            run = 0
            continue
        run += 1
        if run >= wanted:
            end = i + run - int(drop_last)
            return end, min(i, end)
    end = max(0, run - int(drop_last))
    return end, 0


def min_hit_blocks(expected: int, window: int | None, policy: AdmissionPolicy) -> int:
    """``hit-completeness``: the fewest leading blocks a lookup may return when ``expected``
    leading full blocks are cached and computed (the last token is always recomputed, so
    ``expected`` counts blocks of the first ``len - 1`` tokens)."""
    if window is not None and not policy.hits_with_window:
        return 0
    if policy.hit_drops_last_block:
        return max(0, expected - 1)
    return expected


def progress_bound(tokens_per_request: Sequence[int], chunk: int) -> int:
    """Scheduler iterations within which, with no new arrivals, every request finishes (computes
    all its tokens and samples one more).

    The loop serves requests oldest first and preempts the newest: once a request is the oldest
    running one it is never preempted (unless it cannot fit alone), so it finishes within
    ``ceil(L / chunk)`` iterations; before that it may spend one iteration waiting for an empty
    pool and one being swapped in.  Each request adds at most ``ceil(L / chunk) + 2``; one more
    iteration observes that nothing is left.
    """
    assert chunk >= 1
    return sum(-(-n // chunk) + 2 for n in tokens_per_request) + 1


class AttendingGroup(Protocol):
    """What the capacity reasoning reads of a KV-cache group (spec/groups.py ``GroupSpec``)."""

    block_size: int

    def first_attended(self, position: int) -> int: ...


def least_blocks_alone(
    groups: Sequence[AttendingGroup], length: int, lookahead: int, in_flight: int
) -> int:
    """The fewest blocks, over every KV-cache group of one pool, that a request growing to
    ``length`` tokens must hold at once to run to its end alone, whatever the scheduler plans.

    A scheduler picks each step's token count up to its budget, drafts included (they are
    optional); the fewest blocks are held when every step computes one position and verifies
    no draft (a local group then keeps only that position's window).  The step at position p
    (every p below ``length - 1``: the last token is sampled, not computed) holds in each group
    the slots from the first position attended from ``p - in_flight`` (the steps still in
    flight read from there) through p, and the ``lookahead`` slots reserved beyond it (EAGLE's,
    which the target reserves on every step).  A request over this many blocks cannot finish in
    the pool under any schedule; one within it can, so a scheduler that never finishes it is
    not live (``progress``).
    """
    peak = 0
    for p in range(max(1, length - 1)):
        first = max(0, p - in_flight)
        held = sum(blocks_touched(g.first_attended(first), p + lookahead, g.block_size) for g in groups)
        peak = max(peak, held)
    return peak


# ---------------------------------------------------------------- what the checks are given


@attrs.frozen
class AdmissionFacts:
    """One refused admission, as ``admission-completeness`` judges it."""

    seq: int
    answer: str  # "later", "never" or the refusal's exception name
    prompt_len: int
    need: int
    evictable_hits: int
    reserve: int
    free: int
    evictable: int
    held_alone: int
    num_blocks: int
    policy: str


@attrs.frozen
class ReserveFacts:
    """One refused reservation, as ``reserve-completeness`` judges it."""

    seq: int
    num_new_tokens: int
    lookahead: int
    need: int
    group_touched: int
    group_running: int
    available: int
    policy: AdmissionPolicy


@attrs.frozen
class HitFacts:
    """One admission's lookup, or one operation's newly computed full blocks."""

    seq: int
    block_size: int
    got_tokens: int = 0
    expected_blocks: int = 0
    min_blocks: int = 0
    unpublished: tuple[int, ...] = ()


@attrs.frozen
class ProgressFacts:
    """One drain of the scheduler loop with no new arrivals."""

    iterations: int
    bound: int
    num_blocks: int
    repeated: bool = False  # the loop came back to an earlier state with nothing finished
    unfinished: tuple[int, ...] = ()
    refused_when_empty: tuple[tuple[int, int], ...] = ()
    # (seq, blocks it holds alone at least): preempted while no other request held a block
    preempted_alone: tuple[tuple[int, int], ...] = ()
