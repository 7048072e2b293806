"""The driver's side of the completeness invariants: what an admission, a reservation or a
lookup should have given, read off the state the implementation reported *before* the
operation, and judged by the spec (``spec.admission``, ``spec.invariants``).

The target's room is its declared ``AdmissionPolicy`` (attribute ``admission_policy``; an
implementation that declares none gets none).  Fork families stand in for legacy sequence
groups: legacy checks a reservation for the whole group (``step_checks_group``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvspec.spec.admission import (
    NO_RESERVE,
    AdmissionFacts,
    AdmissionPolicy,
    HitFacts,
    ReserveFacts,
    admission_need,
    admission_reserve,
    blocks_held_alone,
    min_hit_blocks,
    publication_required,
    step_need,
    step_touched,
    window_hit_blocks,
)
from kvspec.spec.invariants import (
    Violation,
    admission_completeness,
    hit_completeness,
    reserve_completeness,
)
from kvspec.spec.prefix_hash import PrefixKey, block_keys
from kvspec.spec.state import KVState, PoolView, Status
from kvspec.spec.window import first_needed_block

if TYPE_CHECKING:
    from kvspec.testing.blockmanager.driver import Driver


def policy_of(impl: object) -> AdmissionPolicy:
    """The policy an implementation declares (none declared: no reserve at all)."""
    policy = getattr(impl, "admission_policy", None)
    return policy if isinstance(policy, AdmissionPolicy) else NO_RESERVE


def findable(pool: PoolView) -> dict[PrefixKey, set[int]]:
    """Key -> the computed blocks a lookup may hand out for it."""
    out: dict[PrefixKey, set[int]] = {}
    for key, block in pool.cached:
        if block in pool.computed:
            out.setdefault(key, set()).add(block)
    return out


def cached_prefix(pool: PoolView, tokens: Sequence[int], extra, block_size: int) -> tuple[int, int]:
    """Leading full blocks of ``tokens[:-1]`` (the last token is always computed) whose key is
    cached on a computed block, and how many of those the target may take from the evictable
    set."""
    keyed = findable(pool)
    evictable = set(pool.evictable)
    hits = revived = 0
    for key in block_keys(tuple(tokens[: len(tokens) - 1]), block_size, extra):
        blocks = keyed.get(key)
        if not blocks:
            break
        hits += 1
        # With duplicates under one key (V1 keeps them, block_pool.py NOTE #1) the target may
        # hand out any of them, the evictable one included: reviving it spends that capacity.
        revived += bool(blocks & evictable)
    return hits, revived


def window_hit(
    pool: PoolView, tokens: Sequence[int], extra, block_size: int, window: int, drop_last: bool
) -> tuple[int, int]:
    """The hit a ``window_hits_from_the_end`` target takes (``spec.admission.window_hit_blocks``)
    and how many of its in-window blocks come from the evictable set."""
    keyed = findable(pool)
    evictable = set(pool.evictable)
    keys = block_keys(tuple(tokens[: len(tokens) - 1]), block_size, extra)
    end, first = window_hit_blocks([bool(keyed.get(k)) for k in keys], window, block_size, drop_last)
    kept = max(first, first_needed_block(end * block_size, window, block_size))
    return end, sum(bool(keyed.get(k, set()) & evictable) for k in keys[kept:end])


class CompletenessObserver:
    """Judges one driver's admissions, reservations and lookups against its target's policy."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.policy = policy_of(driver.impl)
        self.family: dict[int, int] = {}
        self._families = itertools.count()

    # ------------------------------------------------------------ bookkeeping

    def admitted_as(self, seq_id: int) -> None:
        self.family[seq_id] = next(self._families)

    def forked(self, parent_id: int, child_id: int) -> None:
        self.family[child_id] = self.family.get(parent_id, next(self._families))

    # ------------------------------------------------------------ admission

    def _lookup(self, state: KVState, tokens: Sequence[int], extra) -> tuple[int, int]:
        config = self.driver.config
        if not config.prefix_caching:
            return 0, 0
        return cached_prefix(state.gpu, tokens, extra, config.block_size)

    def admission_refused(
        self, before: KVState, seq_id: int, tokens: Sequence[int], k: int, extra, answer: str
    ) -> list[Violation]:
        return admission_completeness(self.admission_facts(before, seq_id, tokens, k, extra, answer))

    def admission_facts(
        self, before: KVState, seq_id: int, tokens: Sequence[int], k: int, extra, answer: str
    ) -> AdmissionFacts:
        """The admission of ``seq_id`` as the spec sees it in the pool ``before`` it: its need
        under the declared policy, the hits it revives, the reserve, what it holds alone."""
        config, policy = self.driver.config, self.policy
        B, W = config.block_size, config.sliding_window
        lookahead = self.driver.admit_lookahead
        expected, revived = self._lookup(before, tokens, extra)
        least = min_hit_blocks(expected, W, policy)
        if W is not None and config.prefix_caching and policy.window_hits_from_the_end:
            end, in_window = window_hit(before.gpu, tokens, extra, B, W, policy.hit_drops_last_block)
            if end > least:
                # The target's lookup returns this longer hit, not the one from the start.
                least, revived = end, in_window
        need = admission_need(len(tokens), k, least * B, lookahead, W, B, policy)
        held = max(
            blocks_held_alone(len(tokens), k, h * B, lookahead, W, B, policy)
            for h in {0, least, expected}
        )
        others = any(
            m.status is Status.RUNNING for s, m in self.driver.seqs.items() if s != seq_id
        )
        return AdmissionFacts(
            seq=seq_id,
            answer=answer,
            prompt_len=len(tokens),
            need=need,
            evictable_hits=0 if policy.whole_prompt else revived,
            reserve=admission_reserve(policy, others),
            free=len(before.gpu.free),
            evictable=len(before.gpu.evictable),
            held_alone=held,
            num_blocks=len(before.gpu.ids),
            policy=policy.describe(),
        )

    def lookup_done(
        self, before: KVState, seq_id: int, tokens: Sequence[int], extra, hit_tokens: int
    ) -> list[Violation]:
        expected, _ = self._lookup(before, tokens, extra)
        if not expected:
            return []
        config = self.driver.config
        facts = HitFacts(
            seq=seq_id,
            block_size=config.block_size,
            got_tokens=hit_tokens,
            expected_blocks=expected,
            min_blocks=min_hit_blocks(expected, config.sliding_window, self.policy),
        )
        return hit_completeness(facts)

    # ------------------------------------------------------------ reservation

    def reserve_refused(self, before: KVState, seq_id: int, k: int, lookahead: int) -> list[Violation]:
        return reserve_completeness(self.reserve_facts(before, seq_id, k, lookahead))

    def reserve_facts(self, before: KVState, seq_id: int, k: int, lookahead: int) -> ReserveFacts:
        """A running sequence's step as the spec sees it in the pool ``before`` it: its exact
        need, and the blocks its group touches under the declared policy."""
        config = self.driver.config
        B = config.block_size
        model = self.driver.seqs[seq_id]
        table = before.tables.get(seq_id)
        slots = table.slots if table is not None else ()
        start = model.num_computed
        last = min((start + k - 1) // B, len(slots) - 1)
        copies = sum(
            1
            for i in range(start // B, last + 1)
            if slots[i] is not None and before.gpu.refcounts.get(slots[i], 0) > 1
        )
        siblings = [
            (s, m)
            for s, m in self.driver.seqs.items()
            if s != seq_id
            and m.status is Status.RUNNING
            and self.policy.step_checks_group
            and self.family.get(s) == self.family.get(seq_id)
        ]
        touched = step_touched(start, k, lookahead, B) + sum(
            step_touched(m.num_computed, max(1, len(m.tokens) - m.num_computed), lookahead, B)
            for _, m in siblings
        )
        return ReserveFacts(
            seq=seq_id,
            num_new_tokens=k,
            lookahead=lookahead,
            need=step_need(len(slots), start, k, lookahead, B, copies),
            group_touched=touched,
            group_running=1 + len(siblings),
            available=len(before.gpu.free) + len(before.gpu.evictable),
            policy=self.policy,
        )

    # ------------------------------------------------------------ publication

    def computed(self, seq_id: int, start: int, end: int) -> list[Violation]:
        """Full blocks the positions ``start .. end-1`` completed must be findable by their key
        once the operation is over (every engine modelled publishes within the operation:
        V1 ``allocate_slots`` caches the scheduled full blocks, legacy marks them computed in
        ``mark_blocks_as_computed``, the reference at commit)."""
        config = self.driver.config
        if not config.prefix_caching:
            return []
        B = config.block_size
        if not publication_required(config.sliding_window, B, self.policy):
            return []
        state = self.driver.state
        model = self.driver.seqs.get(seq_id)
        table = state.tables.get(seq_id)
        if model is None or table is None or model.status is not Status.RUNNING:
            return []
        stop = end // B  # blocks up to here are full and computed
        keyed = findable(state.gpu)
        keys = block_keys(model.tokens[: stop * B], B, model.extra)
        missing = tuple(
            i
            for i in range(start // B, stop)
            if (i + 1) * B > start
            and i < len(table.slots)
            and table.slots[i] is not None
            and not keyed.get(keys[i])
        )
        if not missing:
            return []
        return hit_completeness(HitFacts(seq=seq_id, block_size=B, unpublished=missing))
