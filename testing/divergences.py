"""Known divergences between an implementation and the reference, in one place.

Each is a difference the spec allows (a policy freedom), with its reason, the upstream
reference, and a narrow predicate over the comparison at hand.  Comparison code never
swallows a difference any other way.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs


@attrs.frozen
class Mismatch:
    """One difference the lockstep comparison saw."""

    mode: str  # "outcomes", "counts" or "renaming"
    op: str
    seq: int | None
    target: object
    reference: object
    target_name: str
    prefill: bool  # the sequence had uncomputed prompt tokens at the time
    caching: bool = False  # prefix caching on
    dropped_on_refusal: bool = False  # a refusal earlier in the run released window blocks
    # The target's own driver judged this refusal within the reserve the target declares
    # (its admission-completeness check passed): spec/admission.py AdmissionPolicy.
    within_declared_reserve: bool = False
    # An allowed difference, a sequence no longer compared, or prefix caches holding different
    # keys came earlier in the run: only after one can the two sides' hits differ.
    earlier_difference: bool = False
    # The scheduler runs asynchronously (outputs of the previous step still in flight).
    async_scheduling: bool = False
    # A sequence no longer compared still holds blocks on the target; the reference freed its
    # copy when the two disagreed (differential.py ``Lockstep._untrack``).
    target_holds_untracked: bool = False
    # The target declares ``window_hits_from_the_end`` (spec/admission.py) and, in the pool
    # before this admission, such a hit is longer than the cached prefix from the prompt's start.
    window_hit_from_the_end: bool = False


@attrs.frozen
class Divergence:
    id: str
    reason: str
    upstream: str
    applies: Callable[[Mismatch], bool]


def _legacy(m: Mismatch) -> bool:
    return m.target_name.startswith("vllm-legacy") or "BlockSpaceManager" in m.target_name


KNOWN: tuple[Divergence, ...] = (
    Divergence(
        "legacy-whole-prompt-allocation",
        "legacy allocate() takes a block for every prompt token at admission, whatever the "
        "first chunk computes; the reference allocates per step (a policy freedom, except "
        "for sliding windows, where window-bound reports it)",
        "vllm/core/block_manager_v2.py allocate (0.6.3); seed issue",
        lambda m: (
            _legacy(m)
            and m.mode == "counts"
            and m.prefill
            and isinstance(m.target, int)
            and isinstance(m.reference, int)
            and m.target > m.reference
        ),
    ),
    Divergence(
        "conservative-admission",
        "an implementation may refuse an admission whose exact need fits only within the reserve "
        "it declares (spec/admission.py AdmissionPolicy, judged by admission-completeness): "
        "legacy can_allocate keeps watermark_blocks back and counts the whole prompt; V1 0.33's "
        "allocate_slots(full_sequence_must_fit=True) admits only if the whole request fits",
        "vllm/core/block_manager_v2.py can_allocate (0.6.3); "
        "vllm/v1/core/kv_cache_manager.py allocate_slots full_sequence_must_fit (0.33.0)",
        lambda m: (
            m.mode == "outcomes"
            and m.op in ("admit", "readmit")
            and m.target is False
            and m.reference is True
            and m.within_declared_reserve
        ),
    ),
    Divergence(
        "refusal-drops-window-blocks",
        "V1's allocate_slots releases a sliding-window request's out-of-window blocks before "
        "it checks capacity, 'even if we cannot schedule' (a freedom of admission-soundness); "
        "the reference's refusals change nothing, so after such a refusal the target may have "
        "room for an operation the reference refuses",
        "vllm/v1/core/kv_cache_manager.py allocate_slots (remove_skipped_blocks first, 0.33.0)",
        lambda m: (
            m.mode == "outcomes"
            and m.dropped_on_refusal
            and m.op in ("admit", "readmit", "step")
            and m.target is True
            and m.reference is False
        ),
    ),
    Divergence(
        "untracked-sequence-holds-blocks",
        "once one side refused what the other granted, that sequence is no longer compared and "
        "the reference frees its copy while the target keeps running it, so the target's pool "
        "holds blocks the reference's does not: the target may refuse an admission or a step "
        "the reference grants (its own completeness invariants still judge each refusal), or a "
        "prefix-cache reset, which V1 allows only while no block is in use",
        "testing/blockmanager/differential.py Lockstep._untrack; "
        "vllm/v1/core/block_pool.py reset_prefix_cache (0.20.1 :452-459)",
        lambda m: (
            m.mode == "outcomes"
            and m.target_holds_untracked
            and m.op in ("admit", "readmit", "step", "reset_prefix_cache")
            and m.target is False
            and m.reference is True
        ),
    ),
    Divergence(
        "window-hits-from-the-end",
        "a sliding-window lookup may take the last run of cached blocks the window needs, "
        "searching from the prompt's end past blocks already gone (AdmissionPolicy "
        "window_hits_from_the_end, declared by the target); the reference's lookup runs from "
        "the prompt's start, so with such a longer hit the target may admit a prompt the "
        "reference's pool cannot hold (hit-completeness judges the hit itself)",
        "vllm/v1/core/single_type_kv_cache_manager.py SlidingWindowManager.find_longest_cache_hit "
        "(0.20.1 :509-580)",
        lambda m: (
            m.mode == "outcomes"
            and m.window_hit_from_the_end
            and m.op in ("admit", "readmit")
            and m.target is True
            and m.reference is False
        ),
    ),
    Divergence(
        "cache-hit-policy",
        "with prefix caching, which cached blocks survive is eviction policy (and V1 keeps "
        "duplicate cached blocks), so once the two caches hold different keys (or another "
        "allowed difference came first), an implementation may find more of a prompt cached "
        "than the reference (or less), share differently, and so admit or step where the "
        "reference's pool is full (or the other way round); while the caches hold the same "
        "keys, outcomes must agree (hit-completeness judges each lookup on its own)",
        "vllm/v1/core/block_pool.py (eviction order, NOTE #1 on duplicates)",
        lambda m: (
            m.caching
            and m.earlier_difference
            and m.mode == "outcomes"
            and m.op in ("admit", "readmit", "step")
        ),
    ),
)


def explained(m: Mismatch, known: tuple[Divergence, ...] = KNOWN) -> Divergence | None:
    for d in known:
        if d.applies(m):
            return d
    return None


SCHEDULER_KNOWN: tuple[Divergence, ...] = ()
"""Differences between vLLM's V1 scheduler and the reference scheduler the spec allows
(testing/scheduler/machine.py ``SchedulerLockstep``).  Same form as ``KNOWN``: ``Mismatch.op``
names what was compared (``scheduled``, ``preempted``, ``scheduled (start, tokens, drafts)``,
``held blocks in group G``, ``(table length, dropped slots) in group G``).  Where a release's
scheduling policy differs from another's, the reference scheduler follows the policy declared
for the target's release (reference/policies.py), so the comparison goes on; the invariants
judge each release's safety on their own.  A difference the spec allows and no declared policy
follows would be stated here, and would end the example's comparison: none is needed on the
declared releases."""
