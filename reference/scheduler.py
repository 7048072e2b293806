"""The reference scheduler: the smallest scheduler over KV-cache groups sharing one pool.

It answers the same calls as vLLM's V1 scheduler under kvspec (adapters/v1_scheduler.py:
``add``, ``schedule``, ``update``, ``abort``, ``observe``), so the scheduler machine runs on
it without vLLM, and its deliberately broken variants (reference/broken.py) show that each
production shape's checks can fail.  Kept small on purpose: first come first served, a token
budget per step, preemption by recompute of the newest running request, draft tokens on
every decode step, output placeholders under async scheduling, one table per (request,
group), sliding-window groups dropping the blocks before the window of the worker's
processed position, and recurrent-state (Mamba) groups holding the block of the processed
state and the block each step leaves its state in.  No prefix caching (a hit is the manager's business, and
reference/manager.py models it): ``Shape.prefix_caching`` is ignored here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
from kvspec.spec.config import Config
from kvspec.spec.groups import GroupSpec, GroupState, HybridState, Plan, Scheduled, Shape
from kvspec.spec.state import Device, PoolView, TableView
from kvspec.spec.window import blocks_for_tokens

from .policies import REFERENCE_OWN, SchedulerPolicy


@attrs.define
class _Req:
    seq_id: int
    tokens: list[int]
    max_tokens: int
    computed: int = 0  # optimistic: every scheduled token counts at once (as in vLLM)
    in_flight: int = 0  # scheduled tokens whose output has not come back
    placeholders: int = 0  # sampled/draft tokens of steps in flight (async)
    outputs: int = 0
    drafts: list[int] = attrs.Factory(list)
    tables: list[list[int | None]] = attrs.Factory(list)
    running: bool = False
    preemptions: int = 0  # output of a step planned before a preemption is stale: dropped
    prefill_chunk: bool = False  # its last step left prompt to compute

    def known(self) -> int:
        return len(self.tokens) + self.placeholders


class NoRoom(Exception):
    """The pool cannot hold a step's blocks."""


class ReferenceScheduler:
    name = "reference-scheduler"

    def __init__(
        self,
        shape: Shape,
        *,
        num_blocks: int | None = None,
        max_num_seqs: int | None = None,
        num_lookahead_tokens: int | None = None,
        policy: SchedulerPolicy = REFERENCE_OWN,
    ) -> None:
        """``num_blocks``, ``max_num_seqs`` (running requests at most) and
        ``num_lookahead_tokens`` are those of a target the reference runs beside (the
        differential): its pool is sized by its own startup check, and whether its EAGLE
        reserves lookahead slots is its release's configuration.  Alone, the reference sizes
        its pool itself, runs any number of requests and reserves as 0.33.0 does.  ``policy``:
        the scheduling choices of the release it stands for (reference/policies.py: lookahead
        slots at admission, uniform-decode padding, the count out-of-window blocks are dropped
        by, the batches in flight the admission cap counts); alone, its own (the newest declared
        release's)."""
        self.shape = shape
        self.group_specs: tuple[GroupSpec, ...] = shape.groups()
        self.minimum_blocks = self._minimum(shape)
        self.num_blocks = self.minimum_blocks + shape.extra_blocks if num_blocks is None else num_blocks
        self.max_num_seqs = max_num_seqs
        self.config = Config(
            block_size=shape.block_size,
            num_blocks=self.num_blocks,
            max_lookahead=shape.num_spec_tokens,
        )
        # EAGLE proposes from the target's hidden states: vLLM reserves slots for the next
        # step's drafts beyond every step (scheduler.py:298, vllm_config.num_lookahead_tokens).
        self.num_lookahead_tokens = (
            (shape.num_spec_tokens if shape.eagle else 0)
            if num_lookahead_tokens is None
            else num_lookahead_tokens
        )
        self.policy = policy
        self.lookahead_at_admission = policy.lookahead_at_admission.value
        self.pad_admissions = policy.pad_admissions.value
        self.free_by_processed = policy.free_by_processed.value
        self.admission_cap_all_batches = policy.admission_cap_all_batches.value
        self.free: list[int] = list(range(self.num_blocks))
        self.refcounts: dict[int, int] = dict.fromkeys(self.free, 0)
        self.epochs: dict[int, int] = dict.fromkeys(self.free, 0)
        self.reqs: dict[int, _Req] = {}
        self.waiting: list[int] = []
        self.running: list[int] = []
        self._step = 0

    # ------------------------------------------------------------ sizing

    def _minimum(self, shape: Shape) -> int:
        """One request of max_model_len in every group (no window savings: kept simple; a
        state group holds its ``state_blocks``)."""
        return sum(
            g.state_blocks if g.state_blocks is not None else blocks_for_tokens(shape.max_model_len, g.block_size)
            for g in self.group_specs
        )

    # ------------------------------------------------------------ requests

    def add(self, seq_id: int, tokens: Sequence[int], max_tokens: int) -> None:
        self.reqs[seq_id] = _Req(seq_id, list(tokens), max_tokens)
        self.waiting.append(seq_id)

    def abort(self, seq_id: int) -> None:
        self._finish(seq_id)

    def live(self, seq_id: int) -> bool:
        return seq_id in self.reqs

    def tokens(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self.reqs[seq_id].tokens)

    def _finish(self, seq_id: int) -> None:
        req = self.reqs.pop(seq_id, None)
        if req is None:
            return
        self._release(req)
        for queue in (self.waiting, self.running):
            if seq_id in queue:
                queue.remove(seq_id)

    # ------------------------------------------------------------ blocks

    def _allocate(self) -> int:
        if not self.free:
            raise NoRoom
        block = self.free.pop(0)
        self.refcounts[block] = 1
        self.epochs[block] += 1
        return block

    def _decref(self, block: int) -> None:
        self.refcounts[block] -= 1
        if self.refcounts[block] == 0:
            self.free.append(block)

    def _release(self, req: _Req) -> None:
        for table in req.tables:
            for block in reversed(table):
                if block is not None:
                    self._decref(block)
        req.tables = []

    def _first_needed(self, req: _Req, group: GroupSpec) -> int:
        """The first position the worker still reads: the window (or the attention chunk) of
        its processed count."""
        return group.first_attended(req.computed - req.in_flight * self.free_by_processed)

    def _slots_for(self, req: _Req, end: int, group: GroupSpec) -> int:
        return blocks_for_tokens(end, group.block_size)

    def _grow(self, req: _Req, end: int) -> None:
        """Tables cover positions < end in every group; all or nothing."""
        if not req.tables:
            req.tables = [[] for _ in self.group_specs]
        for table, group in zip(req.tables, self.group_specs, strict=True):
            if group.local:
                first = self._first_needed(req, group) // group.block_size
                for i in range(min(first, len(table))):
                    if table[i] is not None:
                        self._decref(table[i])
                        table[i] = None
        need = sum(
            min(1, max(0, self._slots_for(req, end, g) - len(t)))
            if g.state
            else max(0, self._slots_for(req, end, g) - len(t))
            for t, g in zip(req.tables, self.group_specs, strict=True)
        )
        if need > len(self.free):
            raise NoRoom
        for table, group in zip(req.tables, self.group_specs, strict=True):
            slots = self._slots_for(req, end, group)
            if group.state and len(table) < slots:
                # A state group holds the block of the state the step leaves, not one per
                # block of positions: the slots between are null (vLLM's "align" mode).
                table.extend([None] * (slots - 1 - len(table)))
                table.append(self._allocate())
            while len(table) < slots:
                table.append(self._allocate())

    # ------------------------------------------------------------ a step

    def _tokens_for(self, req: _Req, budget: int) -> tuple[int, tuple[int, ...]]:
        """Tokens the next step of a request computes, and its draft ids."""
        if self._done_in_flight(req):
            return 0, ()
        remaining = req.known() - req.computed
        if remaining > 1 or (req.outputs == 0 and req.placeholders == 0):
            return min(remaining, budget), ()
        k = self.shape.num_spec_tokens
        if self.shape.async_scheduling:
            drafts: tuple[int, ...] = (-1,) * k
        else:
            drafts = tuple(req.drafts[:k])
        # No input position at or past max_model_len - 1: the drafts are cut to fit (vLLM
        # 0.12.0 scheduler.py:264-268; 0.33.0 scheduler.py:851-857, one sampled token a step).
        n = min(1 + len(drafts), budget, self.shape.max_model_len - 1 - req.computed)
        return n, drafts[: n - 1]

    def _done_in_flight(self, req: _Req) -> bool:
        """Async: the steps in flight already sample the request's last token, even if every
        draft among them is rejected, so it gets no step (vLLM 0.33.0 scheduler.py:802-816)."""
        prompt = len(req.tokens) - req.outputs
        return req.placeholders > 0 and req.computed + 2 - req.placeholders >= prompt + req.max_tokens

    def _padded(self, req: _Req, budget: int, running_scheduled: bool) -> tuple[int, tuple[int, ...]] | None:
        """A request admitted with one token to compute while others decode is padded with
        ``num_spec_tokens`` placeholder drafts, so the batch decodes uniformly (vLLM 0.33.0
        scheduler.py:1308-1330: not beside a prefill chunk, only within max_model_len).  ``(0,
        ())`` when the padded step does not fit the budget (vLLM then admits nobody more);
        None when no padding applies."""
        k = self.shape.num_spec_tokens if self.pad_admissions else 0
        if not k or req.known() - req.computed != 1 or not (running_scheduled or req.computed):
            return None
        if req.computed + 1 + k + 1 > self.shape.max_model_len:
            return None
        return (0, ()) if 1 + k > budget else (1 + k, (-1,) * k)

    def _schedule_one(
        self, req: _Req, budget: int, planned: tuple[int, tuple[int, ...]] | None = None
    ) -> Scheduled | None:
        n, drafts = self._tokens_for(req, budget) if planned is None else planned
        if n < 1:
            return None
        fresh = req.computed == 0
        lookahead = 0 if fresh and not self.lookahead_at_admission else self.num_lookahead_tokens
        # Slots beyond max_model_len are never reserved, lookahead included (vLLM caps the tokens
        # needing a slot there: kv_cache_manager.py:272-275 in 0.12.0, :551-553 in 0.33.0).
        self._grow(req, min(req.computed + n + lookahead, self.shape.max_model_len))
        start = req.computed
        req.computed += n
        req.in_flight += n
        req.prefill_chunk = req.computed < req.known()
        if req.computed >= req.known():
            req.placeholders += 1 + len(drafts) if self.shape.async_scheduling else 0
        req.drafts = []
        return Scheduled(req.seq_id, start, n, len(drafts), drafts)

    def _admissible(self, req: _Req) -> bool:
        """``full_sequence_must_fit`` (``scheduler_reserve_full_isl``): a waiting request is
        admitted only if the pool's free blocks hold its whole sequence so far
        (spec/admission.py ``AdmissionPolicy``; vLLM 0.33.0 kv_cache_manager.py:531-548).  A
        local group's share is capped at what it can hold at its peak: the window (or chunk)
        plus every token in flight, as vLLM's startup sizing counts it
        (kv_cache_interface.py ``max_admission_blocks_per_request``, :864-881, :918-943)."""
        if not self.shape.full_sequence_must_fit:
            return True
        tokens = min(len(req.tokens), self.shape.max_model_len)
        return sum(self._admission_blocks(tokens, g) for g in self.group_specs) <= len(self.free)

    def _admission_blocks(self, tokens: int, group: GroupSpec) -> int:
        blocks = blocks_for_tokens(tokens, group.block_size)
        batches = 2 if self.shape.async_scheduling and self.admission_cap_all_batches else 1
        in_flight = batches * self.shape.max_num_batched_tokens
        length = self.shape.max_model_len
        chunk = group.attention_chunk_size
        if group.state_blocks is not None:
            return min(blocks, group.state_blocks)
        if group.sliding_window is not None:
            span = min(group.sliding_window - 1 + in_flight, length)
            return min(blocks, blocks_for_tokens(span, group.block_size) + 1)
        if chunk is not None:
            return min(blocks, blocks_for_tokens(min(chunk + in_flight, length), group.block_size))
        return blocks

    def _full(self) -> bool:
        return self.max_num_seqs is not None and len(self.running) >= self.max_num_seqs

    def _preempt(self, seq_id: int) -> None:
        req = self.reqs[seq_id]
        self._release(req)
        req.computed = req.in_flight = req.placeholders = 0
        req.drafts = []
        req.preemptions += 1
        req.running = False
        self.running.remove(seq_id)
        self.waiting.insert(0, seq_id)

    def schedule(self) -> Plan:
        budget = self.shape.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        preempted: list[int] = []
        prefill_scheduled = False
        for seq_id in list(self.running):
            if seq_id not in self.running or budget == 0:
                continue
            req = self.reqs[seq_id]
            was_prefill_chunk = req.prefill_chunk
            while True:
                try:
                    s = self._schedule_one(req, budget)
                    break
                except NoRoom:
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim == seq_id:
                        s = None
                        break
            if s is not None:
                scheduled.append(s)
                budget -= s.num_tokens
                prefill_scheduled |= was_prefill_chunk
        running_scheduled = bool(scheduled)
        while self.waiting and budget > 0 and not preempted and not self._full():
            req = self.reqs[self.waiting[0]]
            padded = None if prefill_scheduled else self._padded(req, budget, running_scheduled)
            if padded == (0, ()) or not self._admissible(req):
                break
            try:
                s = self._schedule_one(req, budget, padded)
            except NoRoom:
                break
            self.waiting.pop(0)
            req.running = True
            self.running.append(req.seq_id)
            if s is not None:
                scheduled.append(s)
                budget -= s.num_tokens
        self._step += 1
        lives = {s.seq_id: self.reqs[s.seq_id].preemptions for s in scheduled}
        return Plan(tuple(scheduled), tuple(preempted), (), handle=(self._step, lives))

    def update(
        self,
        plan: Plan,
        sampled: Mapping[int, Sequence[int]],
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        _, lives = plan.handle
        for s in plan.scheduled:
            req = self.reqs.get(s.seq_id)
            if req is None:
                continue  # finished
            new = list(sampled.get(s.seq_id, ()))
            if req.preemptions != lives[s.seq_id]:
                # Planned before a preemption: the tokens are still delivered, the counters
                # (reset by the preemption) stay as they are (vLLM 0.33.0 scheduler.py:1824-1835).
                self._deliver(req, new)
                continue
            req.in_flight -= s.num_tokens
            if not new:
                continue
            rejected = s.drafts - (len(new) - 1)
            self._roll_back(req, rejected)
            if self.shape.async_scheduling:
                req.placeholders -= 1 + s.drafts
            self._deliver(req, new)
        if drafts and not self.shape.async_scheduling:
            for seq_id, ids in drafts.items():
                if seq_id in self.reqs:
                    self.reqs[seq_id].drafts = list(ids)

    def _deliver(self, req: _Req, new: list[int]) -> None:
        req.tokens.extend(new)
        req.outputs += len(new)
        if new and req.outputs >= req.max_tokens:
            self._finish(req.seq_id)

    def _roll_back(self, req: _Req, rejected: int) -> None:
        if req.running and req.computed > 0:
            req.computed -= rejected

    # ------------------------------------------------------------ observation

    def observe(self) -> HybridState:
        ids = tuple(range(self.num_blocks))
        pool = PoolView(
            ids=ids,
            refcounts=dict(self.refcounts),
            free=tuple(self.free),
            epochs=dict(self.epochs),
        )
        groups = []
        for gi, spec in enumerate(self.group_specs):
            tables = {
                r.seq_id: TableView(r.seq_id, Device.GPU, tuple(r.tables[gi]))
                for r in self.reqs.values()
                if r.tables
            }
            groups.append(GroupState(spec, tables))
        return HybridState(pool, tuple(groups))


__all__ = ["ReferenceScheduler"]
