"""The reference scheduler's scheduling policies, declared per vLLM release.

The spec allows several schedulers: every invariant in spec/ holds whether a waiting request's
first step reserves EAGLE lookahead slots or not, whether a one-token admission is padded to a
uniform decode or not, whether a sliding window's blocks are dropped by the optimistic or the
processed token count (when the steps in flight do not read them).  Which choice a vLLM
release makes is a fact about that release, not a rule of the spec, so the table lives here,
beside the reference scheduler that it configures (reference/scheduler.py
``ReferenceScheduler``), and spec/ stays release-agnostic.  The scheduler differential
(testing/scheduler/machine.py ``SchedulerLockstep``) runs the reference with the policy
declared for the release under test, compares only what that policy declares, and runs no
comparison at all for a release without one.

Every choice names the vLLM file and lines (in that release) that make it.  An entry covers the
releases from ``first`` to ``last``; each entry here covers one release, because only the
releases whose code was read and whose runs were checked against the reference are declared:
a range would need the code of every release between its ends read as well.
"""

from __future__ import annotations

import itertools
import re
from enum import StrEnum

import attrs


class Comparison(StrEnum):
    """What the differential compares after a step (testing/scheduler/machine.py), in the
    order of the modes that add them (testing/blockmanager/differential.py ``Mode``)."""

    SCHEDULED = "scheduled"  # outcomes: which requests a step schedules
    PREEMPTED = "preempted"  # outcomes: which it preempts, in order
    STEP_COUNTS = "scheduled (start, tokens, drafts)"  # counts: per scheduled request
    HELD_BLOCKS = "held blocks"  # counts: per (request, KV-cache group)
    TABLE_LAYOUT = "(table length, dropped slots)"  # renaming: per (request, group)
    SHARED_SLOTS = "shared slots"  # renaming: per group, up to renaming block ids
    ENCODER_INPUTS = "encoder inputs"  # outcomes: the (request, image) pairs a step encodes


@attrs.frozen
class Choice:
    """One scheduling choice of a release and the vLLM code that makes it."""

    value: bool
    source: str  # "vllm/<file>:<lines>", in the entry's releases


@attrs.frozen
class Omission:
    """A comparison an entry does not make, and why."""

    comparison: Comparison
    why: str


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


@attrs.frozen
class SchedulerPolicy:
    """The policies of the vLLM releases ``first`` to ``last`` (inclusive) that the reference
    scheduler follows, and what the differential compares on them."""

    id: str
    first: str  # a release, "X.Y.Z"
    last: str
    # A waiting request's first step reserves the EAGLE lookahead slots as every later step
    # does (False: it reserves none).
    lookahead_at_admission: Choice
    # A request admitted with one token to compute beside decoding requests is padded with
    # ``num_spec_tokens`` placeholder drafts, so the batch decodes uniformly.
    pad_admissions: Choice
    # A local (sliding-window, chunked) group drops the blocks before the window of the
    # processed token count, the steps in flight excluded (False: of the optimistic computed
    # count, the steps in flight included).
    free_by_processed: Choice
    # The ``scheduler_reserve_full_isl`` admission gate caps a local group's share of the whole
    # sequence at its window (or chunk) plus the tokens of every batch in flight (async: two; a
    # pipeline: one per stage, ``Shape.batches_in_flight``); False: plus one batch's.
    admission_cap_all_batches: Choice
    # With prefix caching: a freed block that holds no cached content goes to the head of the
    # free queue, to be reused first (False: to its tail, as a cached one does).
    uncached_freed_first: Choice
    # With prefix caching and a second group of sliding-window layers: such a group caches only
    # the blocks a hit at a multiple of the scheduler's block size can use, the window's blocks
    # before each multiple (False: every full block).  That is the dense retention
    # (``KVCacheConfig.prefix_cache_retention_interval`` None, a shape's ``retention_interval``
    # None); the engine's default on 0.30.0+ is ``CacheConfig``'s 0 (0.33.0
    # kv_cache_planning.py:665-667), which ``sparse_retention_tails`` describes.
    sparse_window_cache: Choice
    # Under a sparse retention (a shape's ``retention_interval`` 0 or positive), such a group
    # caches the window's blocks before each multiple of the interval (none for 0) and before
    # each reachable boundary: the prompt's replay boundaries (its tokens less one; with an
    # EAGLE drop, the aligned ends below that and below its last aligned end, one alignment
    # unit lower) and the request's shared-prefix junction (where its full-attention hit ended
    # when the window group's hit was shorter).  False: the release's sparse retention is not
    # modelled, and such shapes are not compared (testing/scheduler/machine.py).
    sparse_retention_tails: Choice
    # ... and with an EAGLE drop, also before the junction less one block (False: the junction
    # alone).
    eagle_junction_tail: Choice
    # With prefix caching, an EAGLE head that drops a hit's last block, and two groups: each
    # group's lookup reaches one block past the candidate hit before dropping the block (False:
    # it looks up to the candidate, then drops).
    # With prefix caching and two groups: each group caches the blocks of the computed tokens
    # rounded down to the scheduler's block size, the length every hit is a multiple of (with an
    # EAGLE drop, a block more); False: the blocks of every computed token.
    hybrid_caches_aligned: Choice
    eagle_looks_further: Choice
    # ... and that reach may pass the request's tokens less one (up to its last full block);
    # False: it stops there.
    eagle_looks_past_hit_limit: Choice
    # With prefix caching, under async scheduling or with drafts: a running request's step
    # output, once its tokens are appended (the token after a block its key covers among them),
    # caches the full blocks of its processed tokens, the steps in flight excluded (False: only
    # a step's allocation caches, up to the tokens known when it is scheduled).
    caches_at_output: Choice
    # ... also a synchronous scheduler's step with drafts (False: only under async scheduling,
    # where the output placeholders are).
    caches_at_output_with_drafts: Choice
    # ... the count cached is the computed tokens less the output placeholders of the steps in
    # flight, so a prefill chunk in flight is counted (False: less every token in flight).
    output_cache_counts_chunks_in_flight: Choice
    # In a Mamba "align" shape (prefix caching): a prefill chunk that does not finish the
    # prefill ends at a Mamba block's end (the state is written at chunk ends, and only a
    # block-end state can be cached); a chunk starting inside a block stops at that block's
    # end; no chunk runs past the last block end before the request's last token; with hits
    # inside a block, none runs past the prompt's last hash-unit boundary before its last
    # token.  False: a chunk is the budget's cut, or the release's split differs from this rule
    # (its own source line says where).
    mamba_aligned_split: Choice
    # In a Mamba "align" shape whose hits end at Mamba block ends (no ``prefix_match_unit``): the
    # Mamba group caches the state block ending each block end its table holds (every one under
    # dense retention; under a sparse one those ending a multiple of the interval, the prompt's
    # replay boundary and the shared-prefix junction); a lookup takes the full-attention hit, then
    # the last cached state at or below it, searched from the right, and cuts the full group's
    # blocks to it; a hit on a state cached in the same step is not admitted in that step; a
    # prefill chunk stops at the junction (where the full-attention hit ended when the Mamba hit
    # was shorter).  False: the release's Mamba prefix cache is not modelled; the differential
    # ends where it may hit (testing/scheduler/machine.py ``_mamba_cache_may_hit``).
    mamba_state_cache: Choice
    # A request stopped by ``max_tokens`` inside a step's accepted tokens (drafts accepted past
    # its last wanted token) keeps a computed count covering the tokens kept less the last one:
    # the cut ones are taken off (False: the count keeps them).  Seen under a KV connector, which
    # frees the out-of-window blocks of that count before holding the rest for the send.
    trims_computed_at_stop: Choice
    # Under a KV connector that sends every finished request's KV (a producer), a preemption
    # drops the preempted request's output still in flight instead of delivering it: the request
    # is recomputed rather than finished by that output (False: the output is delivered, as
    # without a connector).
    producer_drops_stale_output: Choice
    # A preempted request whose output planned before the preemption is still in flight, and
    # will be delivered, is not resumed until that output has arrived: the admission passes
    # over it to the requests behind it (False: it is resumed as any other).  Only a pipeline
    # deeper than two batches resumes a request with such output still in flight.
    waits_for_stale_output: Choice
    # A padded admission (``pad_admissions``) whose 1 + num_spec_tokens tokens the step's
    # budget cannot hold is not scheduled, and the admissions stop for the step (False: it is
    # scheduled with its one token, unpadded).  Where the budget is below 1 + num_spec_tokens
    # for good, a request admitted at a prefix hit with one token left waits forever (FINDINGS
    # C6): vLLM's choice is declared for its releases, the reference's own scheduler does not
    # wait.
    padding_waits_for_budget: Choice
    # With prefix caching and a full-attention group whose block is coarser than the hash unit
    # (a second group of smaller blocks): the group also caches the block in which the prompt's
    # last hash boundary falls, under that boundary's key (a partial tail).  It is never hit
    # here (hits are multiples of the scheduler's block size), but the block counts as cached:
    # freed, it joins the free queue's tail, not its head (False: no partial tails).
    caches_partial_tails: Choice
    # In a multimodal shape: a waiting request whose first image the encoder budget or cache
    # cannot take now (its step would compute no token) is passed over, and the admissions go
    # on with the requests behind it (False: the admissions stop for the step).
    encoder_blocked_admission_passes: Choice
    not_compared: tuple[Omission, ...] = ()

    @property
    def releases(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return _version(self.first), _version(self.last)

    def covers(self, release: tuple[int, ...]) -> bool:
        first, last = self.releases
        return first <= release <= last

    def compares(self, comparison: Comparison) -> bool:
        return all(o.comparison != comparison for o in self.not_compared)

    def choices(self) -> dict[str, Choice]:
        return {
            "lookahead_at_admission": self.lookahead_at_admission,
            "pad_admissions": self.pad_admissions,
            "free_by_processed": self.free_by_processed,
            "admission_cap_all_batches": self.admission_cap_all_batches,
            "uncached_freed_first": self.uncached_freed_first,
            "sparse_window_cache": self.sparse_window_cache,
            "sparse_retention_tails": self.sparse_retention_tails,
            "eagle_junction_tail": self.eagle_junction_tail,
            "hybrid_caches_aligned": self.hybrid_caches_aligned,
            "eagle_looks_further": self.eagle_looks_further,
            "eagle_looks_past_hit_limit": self.eagle_looks_past_hit_limit,
            "caches_at_output": self.caches_at_output,
            "caches_at_output_with_drafts": self.caches_at_output_with_drafts,
            "output_cache_counts_chunks_in_flight": self.output_cache_counts_chunks_in_flight,
            "mamba_aligned_split": self.mamba_aligned_split,
            "mamba_state_cache": self.mamba_state_cache,
            "trims_computed_at_stop": self.trims_computed_at_stop,
            "producer_drops_stale_output": self.producer_drops_stale_output,
            "waits_for_stale_output": self.waits_for_stale_output,
            "padding_waits_for_budget": self.padding_waits_for_budget,
            "caches_partial_tails": self.caches_partial_tails,
            "encoder_blocked_admission_passes": self.encoder_blocked_admission_passes,
        }

    def span(self) -> str:
        return self.first if self.first == self.last else f"{self.first}-{self.last}"


_SCHED = "vllm/v1/core/sched/scheduler.py"
_KVM = "vllm/v1/core/kv_cache_manager.py"
_POOL = "vllm/v1/core/block_pool.py"
_SINGLE = "vllm/v1/core/single_type_kv_cache_manager.py"
_COORD = "vllm/v1/core/kv_cache_coordinator.py"

DECLARED: tuple[SchedulerPolicy, ...] = (
    SchedulerPolicy(
        "v1-0.12.0",
        "0.12.0",
        "0.12.0",
        # effective_lookahead_tokens is 0 while num_computed_tokens is 0.
        lookahead_at_admission=Choice(False, f"{_SCHED}:556-558"),
        # A waiting request's token count is its uncomputed tokens capped by the budget; no padding.
        pad_admissions=Choice(False, f"{_SCHED}:515-529"),
        padding_waits_for_budget=Choice(False, f"{_SCHED}:515-529"),
        caches_partial_tails=Choice(False, "vllm/v1/core/single_type_kv_cache_manager.py:147-170"),
        # remove_skipped_blocks(request_id, request.num_computed_tokens): the optimistic count.
        free_by_processed=Choice(False, f"{_KVM}:265-267"),
        # SchedulerConfig has no scheduler_reserve_full_isl: no gate (the scheduler adapter
        # refuses full_sequence_must_fit shapes on this release), so the cap never applies.
        admission_cap_all_batches=Choice(False, "vllm/config/scheduler.py:28-50"),
        # free_blocks appends every block whose refcount drops to 0 to the queue's tail.
        uncached_freed_first=Choice(False, f"{_POOL}:384-398"),
        # cache_blocks caches every full block (num_tokens // block_size) of every group.
        sparse_window_cache=Choice(False, f"{_SINGLE}:147-171"),
        # No prefix_cache_retention_interval: cache_blocks takes no retention (dense only).
        sparse_retention_tails=Choice(False, f"{_SINGLE}:147-171"),
        eagle_junction_tail=Choice(False, f"{_SINGLE}:147-171"),
        hybrid_caches_aligned=Choice(False, f"{_COORD}:147-158"),
        # The full group looks up to max_cache_hit_length, the other group up to its hit.
        eagle_looks_further=Choice(False, f"{_COORD}:470-500"),
        eagle_looks_past_hit_limit=Choice(False, f"{_COORD}:470-500"),
        # AsyncScheduler._update_request_with_output: cache_blocks(request, num_computed_tokens -
        # num_output_placeholders) for a request RUNNING before the output.
        caches_at_output=Choice(True, "vllm/v1/core/sched/async_scheduler.py:43-68"),
        # The synchronous Scheduler caches nothing at output.
        caches_at_output_with_drafts=Choice(False, "vllm/v1/core/sched/async_scheduler.py:43-68"),
        output_cache_counts_chunks_in_flight=Choice(True, "vllm/v1/core/sched/async_scheduler.py:43-68"),
        # A chunk is min(uncomputed tokens, budget); no Mamba split in this release.
        mamba_aligned_split=Choice(False, f"{_SCHED}:515-529"),
        # Its MambaManager's hit is not read (kvspec builds no Mamba shape on this release).
        mamba_state_cache=Choice(False, f"{_SINGLE}:656-702"),
        # _update_request_with_output trims the new tokens at a stop, not num_computed_tokens.
        trims_computed_at_stop=Choice(False, f"{_SCHED}:1233-1249"),
        # _preempt_request takes no drop_stale_output.
        producer_drops_stale_output=Choice(False, f"{_SCHED}:749-780"),
        # The waiting loop resumes a preempted request with no regard to its output in flight.
        waits_for_stale_output=Choice(False, f"{_SCHED}:418-440"),
        # ``if num_new_tokens == 0: break`` after _try_schedule_encoder_inputs.
        encoder_blocked_admission_passes=Choice(False, f"{_SCHED}:547-549"),
    ),
    SchedulerPolicy(
        "v1-0.20.1",
        "0.20.1",
        "0.20.1",
        lookahead_at_admission=Choice(False, f"{_SCHED}:728-730"),
        pad_admissions=Choice(False, f"{_SCHED}:677-693"),
        padding_waits_for_budget=Choice(False, f"{_SCHED}:677-693"),
        caches_partial_tails=Choice(False, "vllm/v1/core/single_type_kv_cache_manager.py:273-300"),
        # remove_skipped_blocks(request_id, total_computed_tokens), :364-367: computed plus hits.
        free_by_processed=Choice(False, f"{_KVM}:380-382"),
        # SlidingWindowSpec: sliding_window - 1 + max_num_batched_tokens (ChunkedLocalAttentionSpec
        # likewise, :388-392), passed in by single_type_kv_cache_manager.py:1159-1164.
        admission_cap_all_batches=Choice(False, "vllm/v1/kv_cache_interface.py:432-441"),
        uncached_freed_first=Choice(False, f"{_POOL}:408-422"),
        sparse_window_cache=Choice(False, f"{_SINGLE}:273-297"),
        sparse_retention_tails=Choice(False, f"{_SINGLE}:273-297"),
        eagle_junction_tail=Choice(False, f"{_SINGLE}:273-297"),
        hybrid_caches_aligned=Choice(False, f"{_COORD}:187-198"),
        # min(curr_hit_length + spec.block_size, max_cache_hit_length).
        eagle_looks_further=Choice(True, f"{_COORD}:539-544"),
        eagle_looks_past_hit_limit=Choice(False, f"{_COORD}:539-544"),
        # AsyncScheduler._update_request_with_output: cache_blocks(request, num_computed_tokens -
        # num_output_placeholders) for a request RUNNING before the output.
        caches_at_output=Choice(True, "vllm/v1/core/sched/async_scheduler.py:37-60"),
        # The synchronous Scheduler caches nothing at output.
        caches_at_output_with_drafts=Choice(False, "vllm/v1/core/sched/async_scheduler.py:37-60"),
        output_cache_counts_chunks_in_flight=Choice(True, "vllm/v1/core/sched/async_scheduler.py:37-60"),
        # Its split caches the last chunk at num_tokens rounded down to the block (the request's
        # last token included) and has no stop at a block's end for a chunk starting inside one:
        # not this rule (kvspec builds no Mamba shape on this release, adapters/v1_scheduler.py).
        mamba_aligned_split=Choice(False, f"{_SCHED}:302-350"),
        # Its MambaManager's hit is not read (kvspec builds no Mamba shape on this release).
        mamba_state_cache=Choice(False, f"{_SINGLE}:806-852"),
        trims_computed_at_stop=Choice(False, f"{_SCHED}:1635-1649"),
        producer_drops_stale_output=Choice(False, f"{_SCHED}:965-990"),
        # The waiting loop resumes a preempted request with no regard to its output in flight.
        waits_for_stale_output=Choice(False, f"{_SCHED}:576-600"),
        encoder_blocked_admission_passes=Choice(False, f"{_SCHED}:709-711"),
    ),
    SchedulerPolicy(
        "v1-0.30.0",
        "0.30.0",
        "0.30.0",
        # Lookahead withheld only during an async KV-connector load (none here).
        lookahead_at_admission=Choice(True, f"{_SCHED}:1134-1137"),
        pad_admissions=Choice(True, f"{_SCHED}:1042-1064"),
        padding_waits_for_budget=Choice(True, f"{_SCHED}:1060-1062"),
        caches_partial_tails=Choice(True, "vllm/v1/core/single_type_kv_cache_manager.py:838-884"),
        # total_computed_tokens - request.num_in_flight_tokens.
        free_by_processed=Choice(True, f"{_KVM}:540-544"),
        # max_in_flight_tokens = max_concurrent_batches (async: 2, :589-597) * the budget, which
        # kv_cache_interface.py:835-842 adds to the window.
        admission_cap_all_batches=Choice(True, "vllm/config/vllm.py:602-610"),
        # Uncached blocks are prepended (LIFO reuse), cached ones appended (LRU eviction).
        uncached_freed_first=Choice(True, f"{_POOL}:779-798"),
        # cache_blocks passes reachable_block_mask (SlidingWindowManager's, :1065-...) to
        # cache_full_blocks: only the needed blocks before each aligned boundary.
        sparse_window_cache=Choice(True, f"{_SINGLE}:505-515"),
        # reachable_block_mask: segment tails (:1104-1133), reachable-boundary tails (:1135-1142);
        # the boundaries are get_replay_boundaries (kv_cache_coordinator.py:314-333) and the
        # request's shared_prefix_boundary (kv_cache_manager.py:316-318, scheduler.py:918-924).
        sparse_retention_tails=Choice(True, f"{_SINGLE}:1065-1144"),
        # cache_blocks adds the junction alone.
        eagle_junction_tail=Choice(False, f"{_SINGLE}:501-503"),
        hybrid_caches_aligned=Choice(True, f"{_COORD}:795-830"),
        eagle_looks_further=Choice(True, f"{_COORD}:905-921"),
        eagle_looks_past_hit_limit=Choice(False, f"{_COORD}:905-921"),
        # AsyncScheduler._update_request_with_output: cache_blocks(request, num_computed_tokens -
        # num_output_placeholders) for a request RUNNING before the output.
        caches_at_output=Choice(True, "vllm/v1/core/sched/async_scheduler.py:51-70"),
        # The synchronous Scheduler caches nothing at output.
        caches_at_output_with_drafts=Choice(False, "vllm/v1/core/sched/async_scheduler.py:51-70"),
        output_cache_counts_chunks_in_flight=Choice(True, "vllm/v1/core/sched/async_scheduler.py:51-70"),
        # Its last cacheable position is num_tokens rounded down to the block (the request's last
        # token included), and its partial-tail stop the prompt rounded down: not this rule
        # (kvspec builds no Mamba shape on this release, adapters/v1_scheduler.py).
        mamba_aligned_split=Choice(False, f"{_SCHED}:438-444"),
        # Its MambaManager's hit is not read (kvspec builds no Mamba shape on this release).
        mamba_state_cache=Choice(False, f"{_SINGLE}:1487-1564"),
        trims_computed_at_stop=Choice(False, f"{_SCHED}:2347-2362"),
        # drop_stale_output=self.requires_kv_delivery (the producer role, connector base.py).
        producer_drops_stale_output=Choice(True, f"{_SCHED}:786-791"),
        # A deliverable stale output in flight skips the request (``skip_request``).
        waits_for_stale_output=Choice(True, f"{_SCHED}:886-895"),
        encoder_blocked_admission_passes=Choice(False, f"{_SCHED}:1127-1129"),
    ),
    SchedulerPolicy(
        "v1-0.33.0",
        "0.33.0",
        "0.33.0",
        lookahead_at_admission=Choice(True, f"{_SCHED}:1403-1406"),
        pad_admissions=Choice(True, f"{_SCHED}:1308-1330"),
        padding_waits_for_budget=Choice(True, f"{_SCHED}:1326-1328"),
        caches_partial_tails=Choice(True, "vllm/v1/core/single_type_kv_cache_manager.py:839-898"),
        free_by_processed=Choice(True, f"{_KVM}:564-568"),
        # As 0.30.0; the window's share at kv_cache_interface.py:937-944.
        admission_cap_all_batches=Choice(True, "vllm/config/vllm.py:601-609"),
        uncached_freed_first=Choice(True, f"{_POOL}:826-847"),
        sparse_window_cache=Choice(True, f"{_SINGLE}:522-531"),
        # reachable_block_mask (:1067-1146); the boundaries are replay_boundaries
        # (kv_cache_coordinator.py:65-86) and shared_prefix_boundary (kv_cache_manager.py:320-325,
        # kept on the request, scheduler.py:1120-1126).
        sparse_retention_tails=Choice(True, f"{_SINGLE}:1067-1146"),
        # With use_eagle, the junction less one block as well.
        eagle_junction_tail=Choice(True, f"{_SINGLE}:511-520"),
        hybrid_caches_aligned=Choice(True, f"{_COORD}:777-803"),
        # min(curr_hit_length + eagle_margin, len(block_hashes) * hash_block_size).
        eagle_looks_further=Choice(True, f"{_COORD}:869-887"),
        eagle_looks_past_hit_limit=Choice(True, f"{_COORD}:869-887"),
        # cache_blocks(request, num_computed_tokens - num_in_flight_tokens) after the output's
        # tokens are appended, for a request RUNNING before the output, its output not stale,
        # with output placeholders (async) or num_spec_tokens > 0.
        caches_at_output=Choice(True, f"{_SCHED}:2401-2415"),
        caches_at_output_with_drafts=Choice(True, f"{_SCHED}:2401-2415"),
        output_cache_counts_chunks_in_flight=Choice(False, f"{_SCHED}:2401-2415"),
        # _mamba_block_aligned_split (applied to running requests, :860-862, and to waiting
        # ones, :1350-1356, which a 0-token split stops admitting); the last cacheable position
        # is get_mamba_prefill_checkpoint_position (kv_cache_interface.py:1169-1186: before the
        # last token).  No prefill-checkpoint blocks or shared-prefix junction in kvspec's shapes.
        mamba_aligned_split=Choice(True, f"{_SCHED}:546-650"),
        # MambaManager.find_longest_cache_hit (:1522-1546) after the full group's
        # (kv_cache_coordinator.py:846-941, one pass for one full group and one other), its
        # reachable_block_mask (:1548-1606), the same-step refusal (:1704-1712, scheduler.py
        # :1453-1461 stops the admissions), the junction (kv_cache_manager.py:318-325) and its
        # stop (scheduler.py:632-650, block-floored: no shared-prefix checkpoint in kvspec's
        # shapes, cache.py:312).
        mamba_state_cache=Choice(True, f"{_SINGLE}:1470-1606"),
        # num_computed_tokens -= len(new_token_ids) - num_new, for an output not stale.
        trims_computed_at_stop=Choice(True, f"{_SCHED}:2758-2763"),
        # drop_stale_output=self.requires_kv_delivery; the dropped output skipped at :2338-2339.
        producer_drops_stale_output=Choice(True, f"{_SCHED}:972-976"),
        # A deliverable stale output in flight skips the request (``skip_request``).
        waits_for_stale_output=Choice(True, f"{_SCHED}:1084-1089"),
        # ``skip_request`` (requeued, the loop goes on) after _try_schedule_encoder_inputs.
        encoder_blocked_admission_passes=Choice(True, f"{_SCHED}:1393-1398"),
    ),
)
"""The declared policies, by release.  No two entries cover one release (``validate``, run
when this module loads)."""


class PolicyTableError(ValueError):
    """A table of declared policies that cites no source for a choice, has a range that ends
    before it starts, or covers a release twice."""


_SOURCE = re.compile(r"^vllm/[\w/]+\.py:\d+(-\d+)?$")


def validate(table: tuple[SchedulerPolicy, ...]) -> tuple[SchedulerPolicy, ...]:
    """``table`` if every entry cites ``vllm/<file>.py:<lines>`` for every choice and says why
    it leaves a comparison out, its releases run forward, and no two entries cover one release
    (or share an ID); else ``PolicyTableError``."""
    ids = [p.id for p in table]
    if len(set(ids)) != len(ids):
        raise PolicyTableError(f"an ID declared twice: {ids}")
    for p in table:
        first, last = p.releases
        if not (len(first) == len(last) == 3 and first <= last):
            raise PolicyTableError(f"{p.id}: releases {p.first} to {p.last}")
        for name, choice in p.choices().items():
            if not _SOURCE.match(choice.source):
                raise PolicyTableError(f"{p.id}: {name} cites {choice.source!r}, not vllm/<file>.py:<lines>")
        if any(not o.why for o in p.not_compared):
            raise PolicyTableError(f"{p.id}: a comparison left out with no reason")
    spans = sorted((p.releases, p.id) for p in table)
    for ((_, last), a), ((first, _), b) in itertools.pairwise(spans):
        if first <= last:
            raise PolicyTableError(f"{a} and {b} both cover {'.'.join(map(str, first))}")
    return table


validate(DECLARED)

REFERENCE_OWN = attrs.evolve(
    DECLARED[-1],
    id="reference-scheduler",
    padding_waits_for_budget=Choice(False, "reference/scheduler.py ReferenceScheduler._padded (FINDINGS C6)"),
)
"""The policy the reference scheduler runs alone (and beside its own broken variants): the
newest declared release's, less its wait for a budget that may never hold a padded decode
(C6): a scheduler that waits there breaks ``progress``."""


def parse_release(text: str) -> tuple[int, ...] | None:
    """``X.Y.Z`` of a release string; None for anything else (a dev build, a local version),
    which no entry covers."""
    parts = text.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def declared_for(release: str) -> SchedulerPolicy | None:
    """The policy declared for a vLLM release, or None."""
    version = parse_release(release)
    if version is None:
        return None
    found = [p for p in DECLARED if p.covers(version)]
    return found[0] if found else None


def declared_spans() -> str:
    return ", ".join(p.span() for p in DECLARED)


__all__ = [
    "DECLARED",
    "REFERENCE_OWN",
    "Choice",
    "Comparison",
    "Omission",
    "PolicyTableError",
    "SchedulerPolicy",
    "declared_for",
    "declared_spans",
    "parse_release",
    "validate",
]
