"""The reference scheduler: the smallest scheduler over KV-cache groups sharing one pool.

It answers the same calls as vLLM's V1 scheduler under kvspec (adapters/v1_scheduler.py:
``add``, ``schedule``, ``update``, ``abort``, ``observe``), so the scheduler machine runs on
it without vLLM, and its deliberately broken variants (reference/broken.py) show that each
production shape's checks can fail.  Kept small on purpose: first come first served, a token
budget per step, preemption by recompute of the newest running request, draft tokens on
every decode step, output placeholders under async scheduling, one table per (request,
group), sliding-window groups dropping the blocks before the window of the worker's
processed position, and recurrent-state (Mamba) groups holding the block of the processed
state and the block each step leaves its state in.

In a Mamba "align" shape (Mamba with prefix caching) under ``mamba_aligned_split``, prefill
chunks end at Mamba block ends, where the states a prefix cache keeps are written
(``_aligned``).  Under ``mamba_state_cache`` (hits at block ends only: no
``Shape.prefix_match_unit``) the Mamba group caches those states like blocks (``_cache_blocks``,
reference/prefix_cache.py ``sparse_state_mask``), a hit takes the last cached state at or below
the full-attention hit (``state_hit``), a state cached in the same step is not hit in that step
(``_adopt``), and a chunk stops at the junction where the two groups' hits part (``_aligned``).
Hits inside a Mamba block are not modelled: such a shape caches nothing here, and the
differential stops where vLLM's Mamba prefix cache could change a step
(testing/scheduler/machine.py ``SchedulerLockstep``).

With ``Shape.prefix_caching`` (a Mamba shape as just said), full
blocks are cached under their keys per group as they are computed (reference/prefix_cache.py),
a request admitted with nothing computed starts at its longest hit (every group agreeing on
one length, a multiple of the scheduler's block size, at most the prompt less one token), and
the free queue is vLLM's: the allocator takes its head and forgets the key of a cached block it
takes, a freed block goes to its tail (an uncached one to its head under ``uncached_freed_first``),
a hit takes its blocks back out of it.  A second group's sliding-window blocks are cached as the
shape's ``retention_interval`` says (``_cache_blocks``, reference/prefix_cache.py
``sparse_window_mask``): densely, or sparsely, keeping the tails a later request can resume at.

In a multimodal shape (``Shape.mm_item_tokens``) a request's images are encoded in the step whose
tokens first reach them, against the step's encoder compute budget and the encoder cache
(reference/encoder_cache.py): an image already cached is read, not encoded; one that the budget
or the cache cannot take stops the step's tokens just before it (none, when the step starts
inside it), as vLLM's ``_try_schedule_encoder_inputs`` does (0.33.0
vllm/v1/core/sched/scheduler.py:2018-2215; 0.12.0 :861-990).  The outputs are allocated once the
step's KV slots are, a request not admitted after all stops reading the images it touched
(``free``, :1458-1461), a preempted or finished one reads none, and after a step's output every
image whose positions are all computed is released (``_free_encoder_inputs``, :2828-2858;
0.12.0 frees at the end of ``schedule()`` itself, :790-797, which for a synchronous scheduler
is the same point: nothing runs between a step's plan and its output).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
from kvspec.spec.config import Config
from kvspec.spec.groups import KV_CONNECTORS, GroupSpec, GroupState, HybridState, Plan, Scheduled, Shape
from kvspec.spec.prefix_hash import NO_EXTRA, ExtraKeys
from kvspec.spec.state import Device, PoolView, TableView
from kvspec.spec.window import blocks_for_tokens, ceil_div

from .encoder_cache import EncoderCache
from .policies import REFERENCE_OWN, SchedulerPolicy
from .prefix_cache import (
    CacheKey,
    PrefixCache,
    block_key,
    chunk_hit,
    full_hit,
    replay_boundaries,
    sparse_state_mask,
    sparse_window_mask,
    state_hit,
    window_hit,
)


@attrs.frozen
class Hit:
    """A waiting request's prefix hit: its length in tokens and, per group, the table it
    starts with (None: a block the group's layers no longer read)."""

    length: int
    tables: tuple[tuple[int | None, ...], ...]


NO_HIT = Hit(0, ())


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
    decoding: bool = False  # a step of its present life finished its prefill (drafts follow)
    extra: ExtraKeys = NO_EXTRA  # its domain (cache salt, LoRA adapter): part of every block key
    cached: list[int] = attrs.Factory(list)  # per group: table slots already cached (or skipped)
    hit: Hit | None = None  # the prefix hit its admission is adopting (``_grow`` takes it)
    prompt: int = 0  # its prompt's tokens (the replay boundaries are the prompt's)
    junction: int = 0  # its last lookup's full-attention hit, where longer than the hit (else 0)
    stale: int = 0  # tokens of steps planned before its last preemption whose output is in flight

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
        drop_eagle_block: bool | None = None,
        hash_lookahead: int | None = None,
        encoder_budget: int | None = None,
        encoder_cache_size: int | None = None,
    ) -> None:
        """``num_blocks``, ``max_num_seqs`` (running requests at most) and
        ``num_lookahead_tokens`` are those of a target the reference runs beside (the
        differential): its pool is sized by its own startup check, and whether its EAGLE
        reserves lookahead slots is its release's configuration.  Alone, the reference sizes
        its pool itself, runs any number of requests and reserves as 0.33.0 does.  ``policy``:
        the scheduling choices of the release it stands for (reference/policies.py: lookahead
        slots at admission, uniform-decode padding, the count out-of-window blocks are dropped
        by, the batches in flight the admission cap counts, where freed blocks go in the free
        queue, which sliding-window blocks are cached); alone, its own (the newest declared
        release's).  ``drop_eagle_block`` (every prefix hit loses its last block to the EAGLE
        head) and ``hash_lookahead`` (tokens after a block its key also covers) are the
        target's configuration, as ``num_lookahead_tokens``; alone, as 0.33.0 configures an
        EAGLE head (``Shape.lookahead_hashes`` chooses).  ``encoder_budget`` and
        ``encoder_cache_size`` (embeddings) are the target's too; alone, the shape's
        (``Shape.encoder_budget``)."""
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
        self.padding_waits_for_budget = policy.padding_waits_for_budget.value
        self.free_by_processed = policy.free_by_processed.value
        self.admission_cap_all_batches = policy.admission_cap_all_batches.value
        eagle = shape.eagle and shape.num_spec_tokens > 0
        self.drop_eagle_block = eagle and not shape.lookahead_hashes if drop_eagle_block is None else drop_eagle_block
        self.hash_lookahead = int(eagle and shape.lookahead_hashes) if hash_lookahead is None else hash_lookahead
        self.trims_computed_at_stop = policy.trims_computed_at_stop.value
        self.drops_stale_output = policy.producer_drops_stale_output.value and shape.kv_connector is not None
        self.waits_for_stale_output = policy.waits_for_stale_output.value and not self.drops_stale_output
        self.mamba_split = policy.mamba_aligned_split.value and shape.mamba_cache_mode == "align"
        # A step's output caches blocks when the release does so, for a request with output
        # placeholders (async) or, where the release says so, draft tokens
        # (reference/policies.py ``caches_at_output``).
        self._caches_at_output = policy.caches_at_output.value and (
            shape.async_scheduling
            or (shape.num_spec_tokens > 0 and policy.caches_at_output_with_drafts.value)
        )
        self._output_cache_counts_chunks = policy.output_cache_counts_chunks_in_flight.value
        # A Mamba "align" group's states are cached where the release's cache is modelled
        # (``mamba_state_cache``) and hits end at block ends; with hits inside a block (partial
        # tails, copy-on-write) nothing is cached.
        self.caches_mamba_states = (
            self.mamba_split and policy.mamba_state_cache.value and shape.prefix_match_unit is None
        )
        self.cache = PrefixCache() if shape.prefix_caching and (not shape.mamba or self.caches_mamba_states) else None
        # The keys the Mamba group cached in the step being planned: a hit on one waits a step.
        self._states_cached_this_step: set[CacheKey] = set()
        # Hits are whole multiples of every group's block size (vLLM: the scheduler block size).
        self.alignment = shape.scheduler_block_size
        self.extra_kinds = frozenset({"cache_salt", "lora"}) if self.cache is not None else frozenset()
        # A multimodal shape: images are encoded against the encoder budget and cache.
        self.encoder_budget = shape.encoder_budget if encoder_budget is None else encoder_budget
        cache_size = shape.encoder_budget if encoder_cache_size is None else encoder_cache_size
        self.encoder = EncoderCache(cache_size) if shape.multimodal else None
        if self.encoder is not None:
            self.extra_kinds |= {"mm"}
        self.encoder_passes_blocked = policy.encoder_blocked_admission_passes.value
        self._encoder_left = self.encoder_budget  # the budget left in the step being planned
        self._encoder_blocked = False  # the last request tried: its images stopped its step
        self._encoded: list[tuple[int, int]] = []  # (request, image) encoded in the step
        self._decision: tuple[int, tuple[int, ...], list[int], int] = (0, (), [], 0)
        # Steps in which an image stopped a request's tokens short: the budget, or the cache.
        self.encoder_stops: dict[str, int] = {"budget": 0, "cache": 0}
        self.free: list[int] = list(range(self.num_blocks))
        self.refcounts: dict[int, int] = dict.fromkeys(self.free, 0)
        self.epochs: dict[int, int] = dict.fromkeys(self.free, 0)
        # Blocks holding a partial tail (``_cache_partial_tail``): cached for the free queue.
        self.partial_tails: set[int] = set()
        self.reqs: dict[int, _Req] = {}
        self.hits = 0  # admissions that started at a prefix hit
        # Under a KV connector (a prefill instance sending every finished request's KV): the
        # finished requests whose blocks are held until the worker reports the send.
        self.sends_kv = shape.kv_connector is not None
        self.held: dict[int, _Req] = {}
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

    def add(self, seq_id: int, tokens: Sequence[int], max_tokens: int, extra: ExtraKeys = NO_EXTRA) -> None:
        self.reqs[seq_id] = _Req(seq_id, list(tokens), max_tokens, extra=extra, prompt=len(tokens))
        self.waiting.append(seq_id)

    def abort(self, seq_id: int) -> None:
        self._finish(seq_id)

    def live(self, seq_id: int) -> bool:
        return seq_id in self.reqs

    @staticmethod
    def kv_connectors_offered() -> tuple[str, ...]:
        """The reference models every connector of ``KV_CONNECTORS`` as one thing: a finished
        request's blocks are held until its KV is reported sent."""
        return KV_CONNECTORS

    @staticmethod
    def multimodal_refusal() -> str | None:
        """The reference models the encoder budget and cache itself: it runs the multimodal
        shape (None: nothing refuses it)."""
        return None

    def held_for_sending(self) -> tuple[int, ...]:
        """The finished requests whose blocks a KV send holds."""
        return tuple(self.held)

    def lookup_requests(self) -> list[tuple[tuple[int, ...], ExtraKeys, bool]]:
        """The tokens and domain of every live request, and whether it waits (to be admitted
        at a prefix hit)."""
        return [(tuple(r.tokens), r.extra, r.seq_id in self.waiting) for r in self.reqs.values()]

    def tokens(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self.reqs[seq_id].tokens)

    def _finish(self, seq_id: int, send: bool = False) -> None:
        """The request is done; with ``send`` (it finished by length under a KV connector), its
        blocks are held for the send (``_sent`` releases them), as vLLM defers their free
        (0.33.0 sched/scheduler.py:3040-3060); an aborted one's go at once.  A held request
        keeps only what its local groups still read: vLLM frees the rest before it hands the
        table to the connector (``_connector_finished``, 0.33.0 scheduler.py:3367-3375; 0.20.1
        and 0.25.1 do the same on the computed count)."""
        req = self.reqs.pop(seq_id, None)
        if req is None:
            return
        self._stop_reading(req)
        if send:
            self._hold_for_send(req)
        else:
            if self.sends_kv:
                # vLLM hands every finished request to the connector, an aborted one too, and
                # frees its out-of-window blocks before the rest (``_free_request`` calls
                # ``_connector_finished``): they join the free queue first.
                self._drop_unattended(req)
            self._release(req)
        for queue in (self.waiting, self.running):
            if seq_id in queue:
                queue.remove(seq_id)

    def _hold_for_send(self, req: _Req) -> None:
        self._drop_unattended(req)
        self.held[req.seq_id] = req

    def _sent(self, seq_id: int) -> None:
        """The worker reports the request's KV sent: its blocks go (scheduler.py:3579-3582)."""
        req = self.held.pop(seq_id, None)
        if req is not None:
            self._release(req)

    # ------------------------------------------------------------ blocks

    def _allocate(self) -> int:
        if not self.free:
            raise NoRoom
        block = self.free.pop(0)
        if self.cache is not None:
            self.cache.evict(block)
        self.partial_tails.discard(block)
        self.refcounts[block] = 1
        self.epochs[block] += 1
        return block

    def _free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of ``blocks``, in eviction order (the first to go first).
        The unreferenced ones join the free queue's tail; the uncached ones its head instead
        under ``uncached_freed_first`` (they can never be hit, so they are reused first)."""
        first: list[int] = []
        last: list[int] = []
        for block in blocks:
            self.refcounts[block] -= 1
            if self.refcounts[block] == 0:
                cached = self.cache is not None and (self.cache.holds(block) or block in self.partial_tails)
                (last if cached or not self.policy.uncached_freed_first.value else first).append(block)
        self.free[:0] = first
        self.free.extend(last)

    def _release(self, req: _Req) -> None:
        # Each group's blocks last to first: the tail of a sequence is the least likely to be hit.
        for table in req.tables:
            self._free([b for b in reversed(table) if b is not None])
        req.tables = []
        req.cached = []

    def _first_needed(self, req: _Req, group: GroupSpec) -> int:
        """The first position the worker still reads: the window (or the attention chunk) of
        its processed count."""
        return group.first_attended(req.computed - req.in_flight * self.free_by_processed)

    def _slots_for(self, req: _Req, end: int, group: GroupSpec) -> int:
        return blocks_for_tokens(end, group.block_size)

    def _drop_unattended(self, req: _Req) -> None:
        """Free the blocks of every local group (window, attention chunk, state) before the
        first position the worker still reads."""
        if not req.tables:
            return  # holds nothing (preempted, or never admitted)
        for table, group in zip(req.tables, self.group_specs, strict=True):
            if group.local:
                # Last to first, down to the first slot already dropped (a state group's table
                # has null slots between its blocks: all of them are passed).
                first = self._first_needed(req, group) // group.block_size
                dropped = []
                for i in range(min(first, len(table)) - 1, -1, -1):
                    if table[i] is None and not group.state:
                        break
                    if table[i] is not None:
                        dropped.append(table[i])
                        table[i] = None
                self._free(dropped)

    def _grow(self, req: _Req, end: int) -> None:
        """Tables cover positions < end in every group; all or nothing."""
        if not req.tables:
            req.tables = [[] for _ in self.group_specs]
        self._drop_unattended(req)
        hit, req.hit = req.hit, None
        if hit is not None:
            self._adopt(req, end, hit)
            return
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

    def _decref(self, block: int) -> None:
        self._free([block])

    # ------------------------------------------------------------ prefix cache

    def _lookup(self, req: _Req, gi: int) -> Callable[[int], int | None]:
        """Group ``gi``'s cached block for block ``i`` of the request's tokens."""
        cache = self.cache
        assert cache is not None
        size = self.group_specs[gi].block_size

        def lookup(i: int) -> int | None:
            key = block_key(req.tokens, (i + 1) * size, req.extra, self.hash_lookahead)
            return None if key is None else cache.lookup(gi, key)

        return lookup

    def _hashed_tokens(self, req: _Req) -> int:
        """Tokens covered by the request's block keys: whole blocks of the smallest block size,
        each with its ``hash_lookahead`` tokens after it known."""
        size = min(g.block_size for g in self.group_specs)
        return (len(req.tokens) - self.hash_lookahead) // size * size

    def _find_hit(self, req: _Req) -> Hit:
        """The longest prefix every group has cached, at most the request's tokens less one (its
        last token is computed for the logits), a multiple of ``alignment``.  Full attention
        looks first; the second group looks up to the full group's hit and sets the length;
        the full group's blocks are cut to it.  An EAGLE drop takes one block off each group's
        run; with two groups, under ``eagle_looks_further``, each looks one block further first
        (up to the request's last full block under ``eagle_looks_past_hit_limit``, else up to
        its tokens less one).  A Mamba group's hit is its last cached state at or below the full
        group's hit (``state_hit``)."""
        if self.cache is None or req.computed:
            return NO_HIT
        groups = self.group_specs
        full = groups[0]
        drop = self.drop_eagle_block
        limit = len(req.tokens) - 1
        further = drop and len(groups) > 1 and self.policy.eagle_looks_further.value
        cap = self._hashed_tokens(req) if self.policy.eagle_looks_past_hit_limit.value else limit
        if further:
            limit = min(limit + full.block_size, cap)
        blocks: list[int | None] = list(full_hit(self._lookup(req, 0), limit // full.block_size))
        length = len(blocks) * full.block_size
        if drop and length:
            length = self._after_eagle_drop(length, full)
        length -= length % self.alignment
        full_length = length
        tables: list[tuple[int | None, ...]] = [()] * len(groups)
        for gi, group in enumerate(groups[1:], start=1):
            limit = min(length + group.block_size, cap) if further else length
            lookup = self._lookup(req, gi)
            if group.state:
                found = self._state_hit(lookup, limit // group.block_size, group)
            elif group.sliding_window is not None:
                found = window_hit(
                    lookup, limit // group.block_size, group.block_size, group.sliding_window, self.alignment, drop
                )
            else:
                chunk = group.attention_chunk_size
                assert chunk is not None
                found = chunk_hit(lookup, limit // group.block_size, limit // chunk * chunk // group.block_size)
            length = len(found) * group.block_size
            tables[gi] = tuple(found)
        tables[0] = tuple(blocks[: ceil_div(length, full.block_size)])
        # A shared prefix the second group has not cached (yet): its tail (a Mamba group: its
        # state) is kept under a sparse retention (``_cache_blocks``), so the next request can
        # hit it; a Mamba prefill chunk stops there (``_aligned``).  vLLM 0.33.0
        # kv_cache_manager.py:318-325, kept on the request (scheduler.py:1120-1126).
        req.junction = full_length if full_length > length else 0
        return Hit(length, tuple(tables)) if length else NO_HIT

    def _state_hit(self, lookup: Callable[[int], int | None], max_blocks: int, group: GroupSpec) -> list[int | None]:
        """A Mamba group's hit within ``max_blocks`` blocks (``state_hit``)."""
        return state_hit(lookup, max_blocks, group.block_size, self.alignment)

    def _after_eagle_drop(self, length: int, full: GroupSpec) -> int:
        """A full-attention hit of ``length`` tokens less the block an EAGLE head drops (one
        alignment unit when hits are finer than the block: vLLM 0.33.0
        single_type_kv_cache_manager.py:826-830)."""
        return length - min(self.alignment, full.block_size)

    def _skipped_blocks(self, computed: int, group: GroupSpec) -> int:
        return group.first_attended(computed) // group.block_size if group.local else 0

    def _hit_need(self, hit: Hit, slots: int, gi: int) -> int:
        """Free blocks a hit's admission takes in group ``gi`` to hold ``slots`` table slots: the
        new blocks past the hit's (or past the blocks its window skips), and the hit blocks it
        takes back out of the free queue."""
        group = self.group_specs[gi]
        table = hit.tables[gi] if hit.tables else ()
        skipped = self._skipped_blocks(hit.length, group)
        new = max(slots - max(skipped, len(table)), 0)
        if group.state:
            # One new block: the state the step leaves (0.33.0 single_type_kv_cache_manager.py
            # :1785-1790 caps the count at one for a request holding none of its own yet).
            new = min(new, 1)
        return new + sum(b is not None and self.refcounts[b] == 0 for b in table[skipped:])

    def _adopt(self, req: _Req, end: int, hit: Hit) -> None:
        """Admit ``req`` with ``hit``: all or nothing, its hit blocks (those its windows still
        read) taken from the free queue first, then new blocks up to ``end``."""
        slots = [self._slots_for(req, end, g) for g in self.group_specs]
        if self._hits_state_cached_this_step(req, hit):
            raise NoRoom
        if sum(self._hit_need(hit, n, gi) for gi, n in enumerate(slots)) > len(self.free):
            raise NoRoom
        for gi, (table, group) in enumerate(zip(req.tables, self.group_specs, strict=True)):
            found = hit.tables[gi]
            skipped = self._skipped_blocks(hit.length, group)
            table[:] = [None] * skipped + list(found[skipped:])
            for block in table:
                if block is None:
                    continue
                if self.refcounts[block] == 0:
                    self.free.remove(block)
                self.refcounts[block] += 1
            req.cached.append(len(table))
        for table, group, n in zip(req.tables, self.group_specs, slots, strict=True):
            if group.state and len(table) < n:
                # Null slots up to the block the step leaves its state in (as ``_grow``).
                table.extend([None] * (n - 1 - len(table)))
                table.append(self._allocate())
            while len(table) < n:
                table.append(self._allocate())

    def _hits_state_cached_this_step(self, req: _Req, hit: Hit) -> bool:
        """Whether ``hit``'s Mamba state was cached in the step being planned (by any request,
        under the same key): its state is written by that step, so vLLM admits the request a
        step later (0.33.0 single_type_kv_cache_manager.py:1704-1712 asks for more blocks than
        the pool has; scheduler.py:1453-1461 then stops the admissions)."""
        if not self.caches_mamba_states or not hit.length:
            return False
        key = block_key(req.tokens, hit.length, req.extra, self.hash_lookahead)
        return key in self._states_cached_this_step

    def _cacheable(self, tokens: int, group: GroupSpec) -> int:
        """Tokens ``group`` caches the blocks of: under ``hybrid_caches_aligned``, with two groups,
        those before the last multiple of ``alignment`` (hits are such multiples), and one block
        more for an EAGLE drop (which looks a block past the hit)."""
        if len(self.group_specs) == 1 or not self.policy.hybrid_caches_aligned.value:
            return tokens
        aligned = tokens - tokens % self.alignment
        if self.drop_eagle_block and aligned:
            return min(tokens, aligned + group.block_size)
        return aligned

    def _cache_blocks(self, req: _Req, tokens: int) -> None:
        """Cache the request's full blocks of its first ``tokens`` tokens (computed, no drafts),
        group by group, past those already cached; a sliding-window group under
        ``sparse_window_cache`` caches only the blocks a hit can use."""
        cache = self.cache
        if cache is None:
            return
        if not req.cached:
            req.cached = [0] * len(self.group_specs)
        hashed = self._hashed_tokens(req)
        for gi, (table, group) in enumerate(zip(req.tables, self.group_specs, strict=True)):
            full = min(self._cacheable(tokens, group), hashed) // group.block_size
            start = req.cached[gi]
            if start >= full:
                continue
            mask = [True] * (full - start)
            if group.sliding_window is not None and len(self.group_specs) > 1 and self.policy.sparse_window_cache.value:
                mask = sparse_window_mask(
                    start, full, group.block_size, group.sliding_window, self.alignment, self.drop_eagle_block,
                    *self._retention(req, group),
                )
            elif group.state:
                mask = sparse_state_mask(start, full, group.block_size, self.alignment, *self._state_retention(req))
            for i, keep in zip(range(start, full), mask, strict=True):
                block = table[i]
                key = block_key(req.tokens, (i + 1) * group.block_size, req.extra, self.hash_lookahead)
                if block is not None and keep and key is not None:
                    cache.insert(gi, key, block)
                    if group.state:
                        self._states_cached_this_step.add(key)
            req.cached[gi] = full
        self._cache_partial_tail(req, tokens, hashed)

    def _cache_partial_tail(self, req: _Req, tokens: int, hashed: int) -> None:
        """Under ``caches_partial_tails``: the full-attention group, when its blocks are coarser
        than the hash unit, also caches the block holding the prompt's last hash boundary below
        its last token (with an EAGLE drop, within the prompt), once the tokens it caches reach
        that boundary (0.33.0 single_type_kv_cache_manager.py:839-898).  0.30.0 takes the last
        boundary within the prompt either way (:857-884); the two differ only without an EAGLE
        drop, where the tokens cached are a multiple of the scheduler's block size, so the
        boundary's block is full and cached whole in the same call under either rule.  Hits never
        land inside a block here, so only the free queue sees it: the block is cached when
        freed."""
        if not self.policy.caches_partial_tails.value:
            return
        unit = min(g.block_size for g in self.group_specs)
        limit = req.prompt if self.drop_eagle_block else req.prompt - 1
        boundary = min(limit, hashed) // unit * unit
        for table, group in zip(req.tables, self.group_specs, strict=True):
            if group.name != "full" or group.block_size == unit:
                continue
            if not 0 < boundary <= self._cacheable(tokens, group) or boundary % group.block_size == 0:
                continue
            index = boundary // group.block_size
            if index < len(table) and table[index] is not None:
                self.partial_tails.add(table[index])

    def _retention(self, req: _Req, group: GroupSpec) -> tuple[int | None, tuple[int, ...]]:
        """The retention a sliding-window group caches by (``sparse_window_mask``) and the
        positions it keeps a tail before: the prompt's replay boundaries and the request's
        junction (with an EAGLE drop under ``eagle_junction_tail``, the junction less a block
        too).  Dense where the policy models no sparse retention."""
        retention = self.shape.retention_interval
        if retention is None or not self.policy.sparse_retention_tails.value:
            return None, ()
        boundaries = replay_boundaries(req.prompt, self.alignment, self.drop_eagle_block)
        if req.junction:
            boundaries += (req.junction,)
            if self.drop_eagle_block and self.policy.eagle_junction_tail.value:
                boundaries += (req.junction - group.block_size,)
        return retention, boundaries

    def _state_retention(self, req: _Req) -> tuple[int | None, tuple[int, ...]]:
        """The retention a Mamba group caches its states by (``sparse_state_mask``) and the
        positions it keeps the state at: the prompt's replay boundary and the request's junction
        (vLLM 0.33.0 kv_cache_coordinator.py:358-381 and single_type_kv_cache_manager.py
        :506-520; no EAGLE beside a Mamba group here)."""
        boundaries = replay_boundaries(req.prompt, self.alignment, False)
        return self.shape.retention_interval, boundaries + ((req.junction,) if req.junction else ())

    # ------------------------------------------------------------ a step

    def _tokens_for(self, req: _Req, budget: int) -> tuple[int, tuple[int, ...]]:
        """Tokens the next step of a request computes, and its draft ids."""
        if self._done_in_flight(req):
            return 0, ()
        remaining = req.known() - req.computed
        if remaining < 1 and req.in_flight:
            # Every known position is planned: a synchronous step in flight under a pipeline
            # (vLLM 0.33.0 scheduler.py:839-843, 891-896: no new tokens, no step).
            return 0, ()
        # Drafts (async: placeholders) only once a step of this life finished the prefill: vLLM
        # gives a request spec tokens after a step that is no prefill chunk and takes them at a
        # preemption (0.20.1 async_scheduler.py:26-35, scheduler.py:977-979), so a resumed
        # request computes its last recomputed position alone, its outputs notwithstanding.
        if remaining > 1 or not req.decoding:
            return self._aligned(req, min(remaining, budget)), ()
        k = self.shape.num_spec_tokens
        if self.shape.async_scheduling:
            drafts: tuple[int, ...] = (-1,) * k
        else:
            drafts = tuple(req.drafts[:k])
        # No input position at or past max_model_len - 1: the drafts are cut to fit (vLLM
        # 0.12.0 scheduler.py:264-268; 0.33.0 scheduler.py:851-857, one sampled token a step).
        n = min(1 + len(drafts), budget, self.shape.max_model_len - 1 - req.computed)
        return n, drafts[: n - 1]

    def _aligned(self, req: _Req, n: int) -> int:
        """Under ``mamba_split``, the first ``n`` prefill tokens cut where a Mamba state must be
        written: a chunk that does not finish the prefill (the prompt, or a resumed request's
        tokens but the last) ends at a block end; none runs past the block end it starts inside,
        nor past the last block end before the request's last token, nor past its lookup's
        junction (floored to a block from the chunk's start), nor (hits inside a block) past the
        prompt's last hash-unit boundary before its last token.  0: not even one block's end
        fits."""
        start = req.computed
        prompt = len(req.tokens) - req.outputs
        prefill_end = max(prompt, len(req.tokens) - 1)
        if not self.mamba_split or start >= prefill_end:
            return n
        size = self.shape.block_size
        end = start + n
        # A block wider than the whole budget advances inside itself instead.
        if end < prefill_end and (end - end % size > start or size <= self.shape.max_num_batched_tokens):
            end -= end % size
        last_cached = (len(req.tokens) - 1) // size * size
        stops = [last_cached]
        if start % size:
            stops.append(start + size - start % size)
        if start < req.junction < end:
            # The junction of its lookup, block-floored from the chunk's start, so the state
            # there is cached for the requests sharing the prefix (0.33.0 scheduler.py:632-650;
            # no shared-prefix checkpoint in kvspec's shapes).
            stops.append(start + (req.junction - start) // size * size)
        unit = self.shape.prefix_match_unit
        if unit is not None:
            tail = (prompt - 1) // unit * unit
            if last_cached < tail < prompt:
                stops.append(tail)
        end = min([s for s in stops if start < s < end], default=end)
        return max(end - start, 0)

    def _done_in_flight(self, req: _Req) -> bool:
        """Async: the steps in flight already sample the request's last token, even if every
        draft among them is rejected, so it gets no step (vLLM 0.33.0 scheduler.py:802-816)."""
        prompt = len(req.tokens) - req.outputs
        return req.placeholders > 0 and req.computed + 2 - req.placeholders >= prompt + req.max_tokens

    def _padded(
        self, req: _Req, budget: int, running_scheduled: bool, hit: int = 0
    ) -> tuple[int, tuple[int, ...]] | None:
        """A request admitted with one token to compute while others decode is padded with
        ``num_spec_tokens`` placeholder drafts, so the batch decodes uniformly (vLLM 0.33.0
        scheduler.py:1308-1330: not beside a prefill chunk, only within max_model_len).  When
        the padded step does not fit the budget: ``(0, ())`` where the policy waits for the
        budget (vLLM then admits nobody more in the step), else None (it is scheduled unpadded);
        None too when no padding applies.  ``hit``: the prefix hit it is admitted with."""
        k = self.shape.num_spec_tokens if self.pad_admissions else 0
        computed = req.computed + hit
        if not k or req.known() - computed != 1 or not (running_scheduled or computed):
            return None
        if computed + 1 + k + 1 > self.shape.max_model_len:
            return None
        if 1 + k > budget:
            return (0, ()) if self.padding_waits_for_budget else None
        return (1 + k, (-1,) * k)

    def _schedule_one(
        self,
        req: _Req,
        budget: int,
        planned: tuple[int, tuple[int, ...]] | None = None,
        hit: Hit = NO_HIT,
        decided: tuple[int, tuple[int, ...], list[int], int] | None = None,
        admit: bool = False,
    ) -> Scheduled | None:
        """The request's step: its tokens (``planned``, else ``_tokens_for``), cut by its
        images (``_encoder_inputs``), its slots grown (``NoRoom``: they do not fit).  The
        decision, tokens and images, is kept in ``_decision``: a retry after a preemption
        passes it back as ``decided``, since vLLM decides once and then preempts until the
        slots fit (0.33.0 scheduler.py:865-940).  ``admit``: a waiting request's
        ``scheduler_reserve_full_isl`` gate is checked here, after its images (vLLM's
        ``allocate_slots`` checks it, scheduler.py:1433-1461), and not admitted it stops
        reading the images it touched."""
        fresh = req.computed == 0
        req.computed += hit.length
        self._encoder_blocked = False
        try:
            if decided is None:
                n, drafts = self._tokens_for(req, budget) if planned is None else planned
                chosen, left = [], self._encoder_left
                if n >= 1 and self.encoder is not None and req.extra.mm:
                    n, chosen, left = self._encoder_inputs(req, n)
                    self._encoder_blocked = n < 1
                decided = (n, drafts, chosen, left)
            self._decision = decided
            n, drafts, chosen, left = decided
            if n < 1:
                req.computed -= hit.length
                return None
            if admit and not self._admissible(req, hit):
                raise NoRoom
            lookahead = 0 if fresh and not self.lookahead_at_admission else self.num_lookahead_tokens
            # Slots beyond max_model_len are never reserved, lookahead included (vLLM caps the
            # tokens needing a slot there: kv_cache_manager.py:272-275 in 0.12.0, :551-553 in 0.33.0).
            req.hit = hit if hit.length else None
            self._grow(req, min(req.computed + n + lookahead, self.shape.max_model_len))
        except NoRoom:
            req.computed -= hit.length
            req.hit = None
            if admit:
                self._stop_reading(req)
            raise
        if self.encoder is not None:
            for i in chosen:
                image = req.extra.mm[i]
                self.encoder.allocate(req.seq_id, i, image.identifier, image.length)
            self._encoder_left = left
            self._encoded.extend((req.seq_id, i) for i in chosen)
        self.hits += hit.length > 0
        # Only the tokens the request knows are cached, not drafts or placeholders.
        self._cache_blocks(req, min(req.computed + n, len(req.tokens)))
        start = req.computed
        req.computed += n
        req.in_flight += n
        req.prefill_chunk = req.computed < req.known()
        req.decoding = req.decoding or not req.prefill_chunk
        if req.computed >= req.known():
            req.placeholders += 1 + len(drafts) if self.shape.async_scheduling else 0
        req.drafts = []
        return Scheduled(req.seq_id, start, n, len(drafts), drafts)

    def _encoder_inputs(self, req: _Req, n: int) -> tuple[int, list[int], int]:
        """The images the request's next ``n`` tokens reach that must be encoded in the step,
        the tokens left once an image the encoder cannot take stops them, and the step's
        encoder budget left after the images chosen (vLLM's ``_try_schedule_encoder_inputs``,
        0.33.0 scheduler.py:2018-2215).  An image is reached when its positions overlap the
        step's; one already cached is read from the cache (``touch``); one the budget or the
        cache cannot hold stops the step just before it, or gives it no tokens when it starts
        inside the image (a prefix hit past its start: the image is encoded whole)."""
        cache = self.encoder
        assert cache is not None
        start, end = req.computed, req.computed + n
        left, pending, chosen = self._encoder_left, 0, []
        for i, image in enumerate(req.extra.mm):
            if image.end <= start:
                continue
            if image.offset >= end:
                break
            if cache.touch(req.seq_id, i, image.identifier):
                continue
            if not cache.fits(image.length, left, pending):
                self.encoder_stops["budget" if image.length > left else "cache"] += 1
                return (min(n, image.offset - start) if start < image.offset else 0), chosen, left
            pending += image.length
            left -= image.length
            chosen.append(i)
        return n, chosen, left

    def _stop_reading(self, req: _Req) -> None:
        """The request reads none of its images' encoder outputs any longer (vLLM's
        ``EncoderCacheManager.free``: at a preemption, a finish, an admission that failed)."""
        if self.encoder is not None and req.extra.mm:
            self.encoder.release_all(req.seq_id, {i: f.identifier for i, f in enumerate(req.extra.mm)})

    def _release_computed_images(self, req: _Req) -> None:
        """After a step's output: the request stops reading every image whose positions are
        all computed (vLLM's ``_free_encoder_inputs``, 0.33.0 scheduler.py:2828-2858)."""
        if self.encoder is None or not req.extra.mm:
            return
        for i in sorted(self.encoder.reads(req.seq_id)):
            image = req.extra.mm[i]
            if image.end <= req.computed:
                self.encoder.release(req.seq_id, i, image.identifier)

    def _admissible(self, req: _Req, hit: Hit = NO_HIT) -> bool:
        """``full_sequence_must_fit`` (``scheduler_reserve_full_isl``): a waiting request is
        admitted only if the pool's free blocks hold its whole sequence so far
        (spec/admission.py ``AdmissionPolicy``; vLLM 0.33.0 kv_cache_manager.py:531-548).  A
        local group's share is capped at what it can hold at its peak: the window (or chunk)
        plus every token in flight, as vLLM's startup sizing counts it
        (kv_cache_interface.py ``max_admission_blocks_per_request``, :864-881, :918-943).  A
        prefix hit's blocks count as held, but those it takes out of the free queue as taken."""
        if not self.shape.full_sequence_must_fit:
            return True
        tokens = min(len(req.tokens), self.shape.max_model_len)
        if hit.length:
            # A Mamba group's slots past its hit state, of which ``_hit_need`` counts one.
            slots = [
                blocks_for_tokens(tokens, g.block_size) if g.state else self._admission_blocks(tokens, g)
                for g in self.group_specs
            ]
            need = sum(self._hit_need(hit, n, gi) for gi, n in enumerate(slots))
        else:
            need = sum(self._admission_blocks(tokens, g) for g in self.group_specs)
        return need <= len(self.free)

    def _admission_blocks(self, tokens: int, group: GroupSpec) -> int:
        blocks = blocks_for_tokens(tokens, group.block_size)
        batches = self.shape.batches_in_flight if self.admission_cap_all_batches else 1
        in_flight = batches * self.shape.max_num_batched_tokens
        length = self.shape.max_model_len
        chunk = group.attention_chunk_size
        if group.state_blocks is not None:
            # The state its first chunk leaves: "align" mode asks one physical block of a
            # request holding none (0.33.0 single_type_kv_cache_manager.py:1785-1790), and
            # "none" mode's one block spans max_model_len.
            return min(blocks, 1)
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
        self._stop_reading(req)
        req.stale += req.in_flight
        req.computed = req.in_flight = req.placeholders = 0
        req.drafts = []
        req.decoding = False
        req.preemptions += 1
        req.running = False
        self.running.remove(seq_id)
        self.waiting.insert(0, seq_id)

    def schedule(self) -> Plan:
        self._states_cached_this_step.clear()  # 0.33.0 scheduler.py:746, new_step_starts
        self._encoder_left = self.encoder_budget
        self._encoded = []
        budget = self.shape.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        preempted: list[int] = []
        prefill_scheduled = False
        for seq_id in list(self.running):
            if seq_id not in self.running or budget == 0:
                continue
            req = self.reqs[seq_id]
            was_prefill_chunk = req.prefill_chunk
            decided = None
            while True:
                try:
                    s = self._schedule_one(req, budget, decided=decided)
                    break
                except NoRoom:
                    decided = self._decision
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
        at = 0  # the waiting requests before it are passed over
        while at < len(self.waiting) and budget > 0 and not preempted and not self._full():
            req = self.reqs[self.waiting[at]]
            if self.waits_for_stale_output and req.stale:
                at += 1  # its output of before the preemption has yet to arrive
                continue
            hit = self._find_hit(req)
            padded = None if prefill_scheduled else self._padded(req, budget, running_scheduled, hit.length)
            # With images the gate follows them (``_schedule_one``'s ``admit``).
            images = self.encoder is not None
            if padded == (0, ()) or (not images and not self._admissible(req, hit)):
                break
            try:
                s = self._schedule_one(req, budget, padded, hit, admit=images)
            except NoRoom:
                break
            if s is None and self._encoder_blocked and self.encoder_passes_blocked:
                at += 1  # its image waits for the encoder: the requests behind it go on
                continue
            if s is None:
                break  # nothing fits the budget (a Mamba split to no whole block), or an image
            self.waiting.pop(at)
            req.running = True
            self.running.append(req.seq_id)
            scheduled.append(s)
            budget -= s.num_tokens
        self._step += 1
        lives = {s.seq_id: self.reqs[s.seq_id].preemptions for s in scheduled}
        encoded = tuple(sorted(self._encoded))
        return Plan(tuple(scheduled), tuple(preempted), (), handle=(self._step, lives), encoder_inputs=encoded)

    def update(
        self,
        plan: Plan,
        sampled: Mapping[int, Sequence[int]],
        drafts: Mapping[int, Sequence[int]] | None = None,
        sent: Sequence[int] = (),
    ) -> None:
        _, lives = plan.handle
        for s in plan.scheduled:
            req = self.reqs.get(s.seq_id)
            if req is None:
                continue  # finished
            new = list(sampled.get(s.seq_id, ()))
            if req.preemptions != lives[s.seq_id]:
                req.stale = max(req.stale - s.num_tokens, 0)
                # Planned before a preemption: the tokens are still delivered, the counters
                # (reset by the preemption) stay as they are (vLLM 0.33.0 scheduler.py:1824-1835);
                # under a sending connector they are dropped (``producer_drops_stale_output``).
                if not self.drops_stale_output:
                    self._deliver(req, new)
                continue
            req.in_flight -= s.num_tokens
            self._release_computed_images(req)
            if not new:
                continue
            rejected = s.drafts - (len(new) - 1)
            self._roll_back(req, rejected)
            if self.shape.async_scheduling:
                req.placeholders -= 1 + s.drafts
            self._deliver(req, new, cache=req.running and self._caches_at_output, current=True)
        if drafts and not self.shape.async_scheduling:
            for seq_id, ids in drafts.items():
                if seq_id in self.reqs:
                    self.reqs[seq_id].drafts = list(ids)
        # The sends of requests finished in earlier outputs, after this output's requests
        # (their frees come later in the free queue: 0.33.0 scheduler.py:2582, 0.20.1 :1512).
        for seq_id in sent:
            self._sent(seq_id)

    def _deliver(self, req: _Req, new: list[int], cache: bool = False, current: bool = False) -> None:
        """Append a step's sampled tokens, up to the request's ``max_tokens`` (the rest are cut,
        and so are the positions computed for them); with ``cache``, cache the blocks of the
        processed tokens they complete (their keys may cover a token just sampled), before a
        request they finish releases its blocks (vLLM 0.33.0 scheduler.py:2401-2415, 2752-2764).
        A ``current`` output (planned in the request's present life) that finishes it takes the
        cut positions off its computed count under ``trims_computed_at_stop``."""
        kept = new[: req.max_tokens - req.outputs]
        req.tokens.extend(kept)
        req.outputs += len(kept)
        if cache:
            # Less the tokens still in flight: every one, or (``output_cache_counts_chunks_in_
            # flight``) only the output placeholders of the decode steps among them.
            pending = req.placeholders if self._output_cache_counts_chunks else req.in_flight
            self._cache_blocks(req, req.computed - pending - (len(new) - len(kept)))
        if new and req.outputs >= req.max_tokens:
            if current and self.trims_computed_at_stop:
                req.computed -= len(new) - len(kept)
            self._finish(req.seq_id, send=self.sends_kv)

    def _roll_back(self, req: _Req, rejected: int) -> None:
        if req.running and req.computed > 0:
            req.computed -= rejected

    # ------------------------------------------------------------ observation

    def observe(self) -> HybridState:
        ids = tuple(range(self.num_blocks))
        cached = self.cache.entries() if self.cache is not None else ()
        held = frozenset(b for _, b in cached)
        pool = PoolView(
            ids=ids,
            refcounts=dict(self.refcounts),
            free=tuple(b for b in self.free if b not in held),
            evictable=tuple(b for b in self.free if b in held),
            cached=cached,
            computed=held,
            epochs=dict(self.epochs),
        )
        groups = []
        for gi, spec in enumerate(self.group_specs):
            tables = {
                r.seq_id: TableView(r.seq_id, Device.GPU, tuple(r.tables[gi]))
                for r in (*self.reqs.values(), *self.held.values())
                if r.tables
            }
            groups.append(GroupState(spec, tables, self.cache.entries(gi) if self.cache is not None else ()))
        return HybridState(pool, tuple(groups))


__all__ = ["ReferenceScheduler"]
