"""Hybrid models: several KV-cache groups sharing one block pool.

A hybrid model (Gemma-2/3, Llama-4, gpt-oss style) mixes full-attention layers with
sliding-window layers (Gemma, gpt-oss) or chunked-local layers (Llama-4).
vLLM's V1 engine gives each kind of layer a KV-cache *group* with its own block table per
request (``KVCacheGroupSpec``, vllm/v1/kv_cache_interface.py), all groups allocating from
one ``BlockPool`` through ``HybridKVCacheCoordinator`` (vllm/v1/core/kv_cache_coordinator.py).
The abstract state is then one table per (sequence, group) over one pool:

* per group, every state invariant holds on the group's *view* (``group_world``): its own
  tables, its block size and window, and the part of the pool it owns (the blocks its tables
  hold and the blocks cached under its keys).  A block two groups both claim shows in both
  views with the refcount of the whole pool, so ``refcount-exact`` reports it.
* over the one shared pool (``pool_world``), the pool invariants (``POOL_INVARIANTS``) hold
  with every group's tables counted together: conservation of the one pool, exact refcounts
  across groups, no leak once every sequence is gone.
* a prefix hit is one token count for the request, so it is a hit in every group: each
  group's ``kv-readback`` reads the hit positions its next token attends through that group's
  table (full attention: all of them; sliding window: the window; chunked local: its chunk).

Chunked-local attention (``ChunkedLocalAttentionSpec``, vLLM 0.10.1+): the token at position p
attends only the positions of its own chunk of C tokens, ``chunk_start(p, C) .. p``.  Once a
request has processed p positions every block wholly before ``chunk_start(p, C)`` is dead, and
vLLM frees it (``ChunkedLocalAttentionManager.get_num_skipped_tokens`` returns
``(num_computed_tokens // attention_chunk_size) * attention_chunk_size``, 0.33.0
vllm/v1/core/single_type_kv_cache_manager.py:1381-1425; ``remove_skipped_blocks`` frees the
blocks wholly before it, :682-720; 0.10.1.1 single_type_kv_cache_manager.py:393).  Its
group's ``kv-readback`` reads from the chunk's start, and its ``window-bound`` is the chunk's
own bound (``chunk_faults``): a step over positions [s, e) holds at most the blocks positions
``chunk_start(s, C) .. e - 1`` touch.

No new invariant ID: the groups change the world the invariants look at, not the properties.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import attrs

from .config import Config
from .events import CacheEvent
from .invariants import INVARIANTS, Violation, check_world
from .kv_memory import STATE_SLOT, readback_faults, state_of, state_readback_faults
from .prefix_hash import PrefixKey
from .state import Device, KVState, PoolView, SeqModel, Status, TableView, World
from .window import blocks_for_tokens, blocks_touched, first_needed_position

POOL_INVARIANTS = ("refcount-exact", "conservation", "no-leak")
# The per-position readings a recurrent-state group's own checks (``state_faults``) replace.
PER_POSITION = ("kv-readback", "prefix-cache-consistency")
"""The invariants about the one shared pool, checked with all groups' tables together."""


@attrs.frozen
class GroupSpec:
    """One KV-cache group: the layers of one attention kind.

    name            a label for reports ("full", "swa", "chunked", "mamba").
    block_size      tokens per block of this group (a divisor of the scheduler's block size).
    sliding_window  W of the group's sliding-window layers; None for full attention.
    attention_chunk_size  C of the group's chunked-local layers; None otherwise.
    state_blocks    a recurrent-state (Mamba) group: the real blocks a request holds at most
                    between two steps (``state_faults``); None for an attention group.
    """

    name: str
    block_size: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    state_blocks: int | None = None

    @property
    def local(self) -> bool:
        """Whether the group's layers attend less than the whole prefix (blocks die)."""
        return (
            self.sliding_window is not None
            or self.attention_chunk_size is not None
            or self.state_blocks is not None
        )

    @property
    def state(self) -> bool:
        """A recurrent-state group: a block holds one state, not one KV per position."""
        return self.state_blocks is not None

    def first_attended(self, position: int) -> int:
        """The first position the token at ``position`` attends in this group's layers (a
        state group reads the state after ``position`` tokens, kept in the block of the
        position before it)."""
        if self.attention_chunk_size is not None:
            return chunk_start(position, self.attention_chunk_size)
        if self.state_blocks is not None:
            return max(position - 1, 0)
        return first_needed_position(position, self.sliding_window)


def chunk_start(position: int, chunk: int) -> int:
    """The first position of the attention chunk of ``chunk`` tokens that holds ``position``
    (vLLM's ``get_num_skipped_tokens`` of a chunked-local group)."""
    assert chunk >= 1 and position >= 0
    return position // chunk * chunk


SHAPE_TAGS = (
    "hybrid",
    "hybrid-block-sizes",
    "hybrid-chunked-local",
    "hybrid-mamba",
    "mamba-partial-hits",
    "async",
    "pipeline-parallel",
    "spec-decode",
    "spec-decode-eagle",
    "budget-chunked",
    "full-isl-on",
    "full-isl-off",
    "startup-min",
    "kv-connector",
    "multimodal",
)
"""The production shapes a scheduler-driven run counts operations in (``Shape.tags``)."""

KV_CONNECTORS = ("NixlConnector",)
"""The KV connectors a shape may be built with: those whose scheduler side vLLM builds offline
on CPU (NIXL itself is needed by the worker side only) and that defer a finished request's
frees until the worker reports its KV sent.  vLLM 0.33.0's OffloadingConnector and
SimpleCPUOffloadConnector build offline too but never defer a free (``request_finished``
answers False: offloading/scheduler.py:2336-2376, simple_kv_offload/manager.py:1216-1248)."""


@attrs.frozen
class RetentionOffer:
    """What a vLLM release lets a deployment choose of the prefix-cache retention of its
    sliding-window and Mamba groups (``CacheConfig.prefix_cache_retention_interval``, 0.33.0
    config/cache.py:275, 0.31.0 :160, 0.30.0 :148), which the engine copies into the
    ``KVCacheConfig`` the scheduler reads (0.33.0 kv_cache_planning.py:665-667, 738-740).

    configurable    the release's ``CacheConfig`` has the field (0.30.0 and later; 0.25.1 and
                    0.23.0 read ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` from the environment
                    instead, unset by default: dense, kv_cache_coordinator.py:125 of 0.25.1).
    engine_default  the retention the engine runs when nobody sets it: the field's default (0,
                    sparse) where it exists, dense (None) where it does not.
    """

    configurable: bool
    engine_default: int | None


DENSE_ONLY = RetentionOffer(configurable=False, engine_default=None)
"""A release (or a reference scheduler) whose only retention is dense."""


@attrs.frozen
class Shape:
    """A production configuration of vLLM's V1 scheduler (adapters/v1_scheduler.py builds it).

    block_size        the full-attention group's block size (and the scheduler's).
    swa_block_size    the second group's block size (a divisor of block_size).
    sliding_window    W of the sliding-window group; None: no sliding-window group.
    extra_blocks      pool blocks beyond vLLM's startup minimum for the shape (0: exactly it;
                      a pool below it is one vLLM refuses to start with).
    prefix_caching    ``enable_prefix_caching``.
    num_spec_tokens   ngram draft tokens per decode step (0: no speculative decoding).
    async_scheduling  ``AsyncScheduler`` with two batches in flight.
    pipeline_parallel the pipeline's stages (``ParallelConfig.pipeline_parallel_size``): the engine
                      keeps that many batches in flight (``max_concurrent_batches``, 0.33.0
                      config/vllm.py:588-598; the executor's before 0.25, 0.20.1
                      v1/executor/multiproc_executor.py:474-478), scheduling the next before the
                      oldest's output returns (``step_with_batch_queue``, engine/core.py:708-776).
                      The scheduler itself is the synchronous one: a request whose step is in
                      flight has nothing left to compute until its output comes back, a prefill
                      chunk's successor is planned at once.  1: no pipeline.  With more than one
                      stage: no async scheduling (0.33.0's V1 model runner refuses it,
                      config/vllm.py:1660-1690) and no drafts (the engine takes a sync step's
                      drafts after the call that executed it, engine/core.py:699-706, which the
                      worker model does not play when another batch is in flight).
    max_num_batched_tokens  the token budget per step.
    max_model_len     the context length.
    full_sequence_must_fit  ``scheduler_reserve_full_isl``.
    max_tokens        sampled tokens after which a request finishes.
    attention_chunk_size  C of a chunked-local second group (instead of a sliding-window one);
                      None: no chunked-local group.
    eagle             the drafts come from an EAGLE head (``SpeculativeConfig(method="eagle")``)
                      rather than the ngram proposer: vLLM then drops the last block of every
                      prefix-cache hit (the hit-completeness policy's EAGLE drop) -- unless
    lookahead_hashes  the block hashes cover the token after each block instead (0.33.0's default
                      for EAGLE with prefix caching, ``VllmConfig.num_hash_lookahead_tokens``,
                      config/vllm.py:678-692; the scheduler then drops nothing, scheduler.py:342-345).
    mamba             a Mamba (recurrent-state) second group (Jamba, Granite-4, Qwen3-Next,
                      Nemotron-H): ``MambaSpec`` in ``mamba_cache_mode`` "align" with prefix
                      caching, "none" without (vLLM derives the mode so, 0.33.0
                      model_executor/models/config.py:760-787), and the Mamba block size vLLM
                      picks for the mode (``mamba_block``).
    prefix_match_unit the finest token boundary a prefix hit lands on (vLLM's
                      ``CacheConfig.prefix_match_unit``, the scheduler's ``hash_block_size``): a
                      proper divisor of ``block_size`` in a Mamba "align" shape, whose Mamba
                      block is then larger than the hash block (vLLM 0.33.0 sets the Mamba block
                      to the attention block in "align" mode, platforms/interface.py
                      ``_align_hybrid_block_size``, and hashes at the unit,
                      kv_cache_utils.py:885-891): hits inside a block
                      (``partial_hash_hits_enabled``, kv_cache_utils.py:762-783), the partial
                      tail a prompt caches and the copy-on-write of a shared tail
                      (single_type_kv_cache_manager.py:1497-1518, 1746-1753, 1872-1918,
                      2028-2137).  None: hashes at the groups' block sizes' divisor.
    retention_interval  ``KVCacheConfig.prefix_cache_retention_interval``, which thins the prefix
                      cache of sliding-window and Mamba groups (``_validate_prefix_cache_retention_
                      interval``, 0.33.0 kv_cache_coordinator.py:33-62; full-attention and
                      chunked-local groups cache densely whatever it is).  None: dense, every
                      full block cached (the dataclass default, kv_cache_interface.py:1541, and
                      the only retention of releases without the field, ``RetentionOffer``); 0:
                      sparse, only the semantic checkpoints (the latest replay boundary and
                      shared-prefix junctions; ``CacheConfig``'s default, config/cache.py:275);
                      positive: those and one per interval, a multiple of the scheduler's block
                      size (single_type_kv_cache_manager.py:1074-1140 for sliding windows,
                      ``reachable_block_mask`` :1556-1610 for Mamba).
    kv_connector      the KV connector the scheduler is built with (``KV_CONNECTORS``), None: none.
                      "NixlConnector" as a disaggregated prefill instance (``kv_role``
                      "kv_producer"; every request asks ``do_remote_decode``): a finished request's
                      blocks stay held until the worker reports its KV sent
                      (``request_finished`` answers delay_free_blocks, 0.33.0
                      nixl/pull_scheduler.py:191-270, sched/scheduler.py:3040-3060, 3579-3582).
    mm_item_tokens    a multimodal model (a vision encoder feeding the language model): every
                      image a request carries fills this many placeholder positions of its prompt
                      (a BLIP-2 image is ``num_query_tokens`` of them, 0.33.0
                      model_executor/models/blip2.py:434-436), and the scheduler schedules each
                      image's encoder input against the encoder compute budget and the encoder
                      cache, both ``max(max_num_batched_tokens, mm_item_tokens)`` embeddings
                      (``compute_mm_encoder_budget``, v1/core/encoder_cache_manager.py:333-378;
                      SchedulerConfig sets both to the token budget, config/scheduler.py:306-307).
                      A synchronous scheduler without drafts, pipeline, Mamba group or KV connector
                      (when an encoder output is freed depends on the output placeholders and
                      drafts in flight, which releases count differently: scheduler.py:2828-2850
                      against 0.20.1's :1660-1676).  None: a text-only model (no encoder budget).
    """

    block_size: int
    swa_block_size: int
    sliding_window: int | None
    extra_blocks: int
    prefix_caching: bool
    num_spec_tokens: int
    async_scheduling: bool
    max_num_batched_tokens: int
    max_model_len: int
    full_sequence_must_fit: bool
    max_tokens: int = 4
    attention_chunk_size: int | None = None
    eagle: bool = False
    lookahead_hashes: bool = False
    mamba: bool = False
    prefix_match_unit: int | None = None
    retention_interval: int | None = None
    kv_connector: str | None = None
    pipeline_parallel: int = 1
    mm_item_tokens: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.pipeline_parallel < 1:
            raise ValueError("a pipeline has at least one stage")
        if self.pipeline_parallel > 1 and (self.async_scheduling or self.num_spec_tokens):
            raise ValueError("pipeline parallel shapes run the synchronous scheduler without drafts")
        if self.kv_connector is not None and self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"unknown KV connector {self.kv_connector!r} (one of {', '.join(KV_CONNECTORS)})")
        second = (self.sliding_window is not None, self.attention_chunk_size is not None, self.mamba)
        if sum(second) > 1:
            raise ValueError("one second group: a sliding window, a chunked-local or a Mamba one")
        unit = self.prefix_match_unit
        if unit is not None and not (self.mamba and self.prefix_caching and 0 < unit < self.block_size
                                     and self.block_size % unit == 0):
            raise ValueError("a prefix match unit is a proper divisor of the block size of a Mamba shape "
                             "with prefix caching")
        if self.mm_item_tokens is not None and (
            self.mm_item_tokens < 1
            or self.async_scheduling
            or self.num_spec_tokens
            or self.pipeline_parallel > 1
            or self.mamba
            or self.kv_connector is not None
        ):
            raise ValueError(
                "a multimodal shape has images of at least one token and runs the synchronous "
                "scheduler without drafts, pipeline, Mamba group or KV connector"
            )

    @property
    def sparse_retention(self) -> bool:
        """Whether the prefix cache of a sliding-window or Mamba group keeps fewer blocks than
        dense retention would: a retention interval is set, with prefix caching, on such a group."""
        return (
            self.retention_interval is not None
            and self.prefix_caching
            and (self.sliding_window is not None or self.mamba)
        )

    @property
    def multimodal(self) -> bool:
        """Requests may carry images, encoded against an encoder budget (``mm_item_tokens``)."""
        return self.mm_item_tokens is not None

    @property
    def encoder_budget(self) -> int:
        """The encoder compute budget and the encoder cache size of a multimodal shape, in
        embeddings: the token budget, or one image where that is larger (0 without images)."""
        if self.mm_item_tokens is None:
            return 0
        return max(self.max_num_batched_tokens, self.mm_item_tokens)

    @property
    def mamba_partial_hits(self) -> bool:
        """Mamba "align" blocks larger than the hash block: prefix hits inside a Mamba block."""
        return self.prefix_match_unit is not None

    @property
    def batches_in_flight(self) -> int:
        """Batches the engine keeps in flight at most (vLLM's ``max_concurrent_batches``): two
        under async scheduling, else one per pipeline stage."""
        return 2 if self.async_scheduling else self.pipeline_parallel

    @property
    def hybrid(self) -> bool:
        return self.sliding_window is not None or self.attention_chunk_size is not None or self.mamba

    @property
    def mamba_cache_mode(self) -> str | None:
        """vLLM's ``CacheConfig.mamba_cache_mode`` of a Mamba shape: "align" with prefix caching,
        "none" without (model_executor/models/config.py:760-787)."""
        if not self.mamba:
            return None
        return "align" if self.prefix_caching else "none"

    @property
    def mamba_block(self) -> int:
        """The Mamba group's block size: the scheduler's block size in "align" mode, the whole
        context in "none" mode (one state block per request; model_executor/models/config.py:
        778-787)."""
        return self.block_size if self.prefix_caching else self.max_model_len

    @property
    def scheduler_block_size(self) -> int:
        """The scheduling granularity: the least common multiple of the groups' block sizes
        (0.33.0 kv_cache_utils.py:860-863)."""
        return math.lcm(*(g.block_size for g in self.groups()))

    @property
    def budget_bound(self) -> bool:
        return self.max_num_batched_tokens < self.max_model_len

    @property
    def at_minimum(self) -> bool:
        return self.extra_blocks == 0

    def groups(self) -> tuple[GroupSpec, ...]:
        full = GroupSpec("full", self.block_size)
        if self.attention_chunk_size is not None:
            return (full, GroupSpec("chunked", self.swa_block_size, None, self.attention_chunk_size))
        if self.mamba:
            # One state block per request in "none" mode; in "align" mode the block the next
            # step reads and the block it writes (MambaSpec.max_memory_usage_bytes, 0.33.0
            # kv_cache_interface.py:1135-1141; no speculative or prefill-checkpoint blocks
            # here), and for every batch in flight (async scheduling, a pipeline) the block
            # that step writes.
            held = 1 + self.prefix_caching * self.batches_in_flight
            return (full, GroupSpec("mamba", self.mamba_block, state_blocks=held))
        if self.sliding_window is None:
            return (full,)
        return (full, GroupSpec("swa", self.swa_block_size, self.sliding_window))

    def tags(self) -> tuple[str, ...]:
        out = []
        if self.hybrid:
            out.append("hybrid")
            if self.swa_block_size != self.block_size:
                out.append("hybrid-block-sizes")
            if self.attention_chunk_size is not None:
                out.append("hybrid-chunked-local")
            if self.mamba:
                out.append("hybrid-mamba")
            if self.mamba_partial_hits:
                out.append("mamba-partial-hits")
        if self.async_scheduling:
            out.append("async")
        if self.pipeline_parallel > 1:
            out.append("pipeline-parallel")
        if self.num_spec_tokens:
            out.append("spec-decode")
            if self.eagle:
                out.append("spec-decode-eagle")
        if self.max_num_batched_tokens < self.max_model_len:
            out.append("budget-chunked")
        out.append("full-isl-on" if self.full_sequence_must_fit else "full-isl-off")
        if self.extra_blocks == 0:
            out.append("startup-min")
        if self.kv_connector is not None:
            out.append("kv-connector")
        if self.multimodal:
            out.append("multimodal")
        return tuple(out)

    def describe(self) -> str:
        parts = [f"B={self.block_size}"]
        if self.attention_chunk_size is not None:
            parts.append(f"hybrid(chunked C={self.attention_chunk_size} B={self.swa_block_size})")
        elif self.mamba:
            unit = "" if self.prefix_match_unit is None else f" unit={self.prefix_match_unit}"
            parts.append(f"hybrid(mamba {self.mamba_cache_mode} B={self.mamba_block}{unit})")
        elif self.hybrid:
            parts.append(f"hybrid(swa W={self.sliding_window} B={self.swa_block_size})")
        parts.append(f"N=startup-min+{self.extra_blocks}")
        parts.append("prefix caching" if self.prefix_caching else "no prefix caching")
        if self.num_spec_tokens:
            method = " ngram"
            if self.eagle:
                method = " eagle (lookahead hashes)" if self.lookahead_hashes else " eagle (drops a hit block)"
            parts.append(f"spec={self.num_spec_tokens}{method}")
        if self.async_scheduling:
            parts.append("async")
        if self.pipeline_parallel > 1:
            parts.append(f"pp={self.pipeline_parallel}")
        parts.append(f"budget={self.max_num_batched_tokens}/len={self.max_model_len}")
        parts.append(f"full_isl={'on' if self.full_sequence_must_fit else 'off'}")
        if self.prefix_caching and (self.sliding_window is not None or self.mamba):
            interval = self.retention_interval
            retained = "dense" if interval is None else f"every {interval}" if interval else "sparse"
            parts.append(f"retention={retained}")
        if self.kv_connector is not None:
            parts.append(f"connector={self.kv_connector}")
        if self.multimodal:
            parts.append(f"multimodal({self.mm_item_tokens} tokens/image)")
        return " ".join(parts)


@attrs.frozen
class Scheduled:
    """One request's part of a planned step, as the model runner receives it from a scheduler.

    start      the first position the step computes (vLLM's ``num_computed_tokens``).
    num_tokens positions start .. start+num_tokens-1 (drafts included).
    drafts     how many of them are draft tokens (the last ones).
    draft_ids  the draft token ids the scheduler sent (-1: a placeholder the worker fills).
    """

    seq_id: int
    start: int
    num_tokens: int
    drafts: int
    draft_ids: tuple[int, ...]


@attrs.frozen
class Plan:
    """What one ``schedule()`` call planned.  ``copies``: the (source, destination) block
    copies the worker runs before the step's forward (vLLM 0.33.0
    ``SchedulerOutput.kv_cache_block_copies``, sched/output.py:309: a shared partial tail's
    copy-on-write)."""

    scheduled: tuple[Scheduled, ...]
    preempted: tuple[int, ...]
    finished: tuple[int, ...]
    handle: Any = attrs.field(eq=False, repr=False)
    copies: tuple[tuple[int, int], ...] = ()
    encoder_inputs: tuple[tuple[int, int], ...] = ()


@attrs.frozen
class GroupState:
    """One group's part of the observed state: its tables, its prefix-cache entries, and the
    KV-cache events that name this group (0.33.0 ``BlockStored/BlockRemoved.group_idx``;
    None when the target reports no per-group stream, and ``event-consistency`` says nothing)."""

    spec: GroupSpec
    tables: Mapping[int, TableView]
    cached: tuple[tuple[PrefixKey, int], ...] = ()
    events: tuple[CacheEvent, ...] | None = None


@attrs.frozen
class HybridState:
    """The whole observed state of a hybrid manager: the one pool and every group's part.

    ``pool.cached`` lists every group's entries; ``groups[i].cached`` the entries of group i.
    """

    pool: PoolView
    groups: tuple[GroupState, ...]


def group_config(config: Config, group: GroupSpec) -> Config:
    return attrs.evolve(config, block_size=group.block_size, sliding_window=group.sliding_window)


def group_state(state: HybridState, index: int) -> KVState:
    """Group ``index``'s view: its tables over the blocks it owns (held or cached by it)."""
    g = state.groups[index]
    pool = state.pool
    owned = {b for t in g.tables.values() for b in t.held()} | {b for _, b in g.cached}
    owned &= set(pool.ids)
    view = PoolView(
        ids=tuple(b for b in pool.ids if b in owned),
        refcounts={b: pool.refcounts[b] for b in pool.ids if b in owned},
        free=(),
        evictable=tuple(b for b in pool.evictable if b in owned),
        cached=g.cached,
        computed=frozenset(b for b in pool.computed if b in owned),
        epochs=None if pool.epochs is None else {b: pool.epochs[b] for b in owned},
        events=g.events,
    )
    return KVState(gpu=view, tables=g.tables, cpu=None)


def pool_state(state: HybridState) -> KVState:
    """The one shared pool with every group's tables counted together.

    A sequence's tables are laid end to end: the pool invariants count holders, not positions.
    """
    seqs = {sid for g in state.groups for sid in g.tables}
    tables = {}
    for sid in seqs:
        parts = [g.tables[sid] for g in state.groups if sid in g.tables]
        slots = tuple(s for t in parts for s in t.slots)
        tables[sid] = TableView(sid, parts[0].device, slots)
    return KVState(gpu=state.pool, tables=tables, cpu=None)


def group_world(
    config: Config,
    state: HybridState,
    index: int,
    seqs: Mapping[int, SeqModel],
    memory: Mapping,
) -> World:
    spec = state.groups[index].spec
    return World(group_config(config, spec), group_state(state, index), seqs, memory)


Judge = Callable[[str, World, "Collection[str] | None"], list[Violation]]
"""Evaluates the state invariants that apply (those named, if given) on one of a hybrid state's
worlds, named by a key that is the same world after world ("pool", "group <i>").  ``check_world``
is the definition; an equal evaluation that remembers the last world of each key may stand in
(kvspec.testing.blockmanager.incremental)."""


def whole_world(_key: str, world: World, only: Collection[str] | None = None) -> list[Violation]:
    """The definition as a ``Judge``: ``check_world``."""
    return check_world(world, only)


def check_hybrid(
    config: Config,
    state: HybridState,
    seqs: Mapping[int, SeqModel],
    memory: Mapping,
    judge: Judge = whole_world,
) -> list[Violation]:
    """Every state invariant per group view, and the pool invariants over the shared pool.

    One memory serves every group: a block belongs to one group at a time, and its cells are
    (device, block, offset).  Each violation names the group it was found in.
    """
    out: list[Violation] = []
    whole = World(config, pool_state(state), seqs, memory)
    out.extend(attrs.evolve(v, message=f"shared pool: {v.message}") for v in judge("pool", whole, POOL_INVARIANTS))
    for i, g in enumerate(state.groups):
        world = group_world(config, state, i, seqs, memory)
        chunk = g.spec.attention_chunk_size
        # The readings a group's own checks replace are not evaluated at all: evaluated and
        # dropped, they would build a violation per attended position at every check of a
        # chunked-local or Mamba group.  A chunked-local group's config has no sliding window, so
        # kv-readback would read every position back (full attention); its chunk is what its
        # layers attend.  A state block holds one state, not a KV per position: the
        # per-position readings of kv-readback and prefix-cache-consistency are the state
        # group's own.
        replaced = (PER_POSITION if g.spec.state else ()) + (("kv-readback",) if chunk is not None else ())
        only = None
        if replaced:
            only = [inv.id for inv in INVARIANTS.values() if inv.kind == "state" and inv.id not in replaced]
        found = judge(f"group {i}", world, only)
        if chunk is not None:
            found = [*found, *chunk_faults(world, chunk)]
        if g.spec.state:
            found = [*found, *state_faults(world, g.spec)]
        out.extend(v.in_group(g.spec.name) for v in found)
    return out


def chunk_faults(world: World, chunk: int) -> Iterator[Violation]:
    """A chunked-local group's ``kv-readback`` and ``window-bound``, its chunk for the window.

    kv-readback   the positions the next token (at p = ``num_computed``) attends,
                  ``chunk_start(p, C) .. p - 1``, read back the sequence's own tokens.
    window-bound  a step over positions [s, e) (``SeqModel.step``) holds at most the blocks
                  that positions ``chunk_start(s, C) .. e - 1`` touch, and never more than its
                  tokens fill: vLLM frees the blocks wholly before the chunk of the processed
                  count before it allocates (see the module docstring).

    Freedom: one held block before the chunk, if it is cached.  0.10.1.1 keeps a request's last
    cached block to chain the next block's hash from ("Make sure we don't delete the last
    cached block", ``ChunkedLocalAttentionManager.remove_skipped_blocks``,
    vllm/v1/core/single_type_kv_cache_manager.py:473-492 there); 0.12.0 and later free it.
    """
    B = world.config.block_size
    cached = {b for _, b in world.state.gpu.cached}
    for sid, table in world.state.tables.items():
        seq = world.seqs.get(sid)
        if seq is None or seq.status is not Status.RUNNING or table.device is not Device.GPU:
            continue
        p = seq.num_computed
        # The sliding window that starts where p's chunk starts: first_needed_position(p, span).
        span = p - chunk_start(p, chunk) + 1
        for v in readback_faults(table, seq, B, span, world.memory):
            yield v.named("kv-readback")
        start, end = seq.step
        last = max(end, start + 1) - 1
        first = chunk_start(start, chunk)
        bound = min(blocks_touched(first, last, B), blocks_for_tokens(end, B))
        before = [b for b in table.slots[: first // B] if b is not None]
        kept = int(len(before) == 1 and before[0] in cached)
        held = len(table.held())
        if held > bound + kept:
            yield Violation(
                "window-bound",
                f"seq {sid} holds {held} blocks but a step over positions {start}..{last} "
                f"with attention chunk {chunk} needs at most {bound} (block size {B})",
                kind="over-window",
                seqs=(sid,),
                device=Device.GPU.value,
                blocks=table.held(),
                expected=bound + kept,
                observed=held,
            )


def state_faults(world: World, spec: GroupSpec) -> Iterator[Violation]:
    """A recurrent-state (Mamba) group's ``kv-readback``, ``prefix-cache-consistency`` and
    ``window-bound``.

    A Mamba layer keeps one state per request, not a KV per position: the token at position p
    reads the state after exactly p tokens (``kv_memory.state_block``).  vLLM's ``MambaManager``
    (0.33.0 vllm/v1/core/single_type_kv_cache_manager.py:1428-2137) frees every block before
    the processed count's (``get_num_skipped_tokens`` is ``num_computed_tokens - 1``, :1971-1976).

    kv-readback   a running sequence's state block holds the state after exactly its computed
                  tokens.
    prefix-cache-consistency  a block cached under a key holds the state after exactly the
                  key's chain ("align" mode caches a block's state at its boundary,
                  ``cache_blocks`` :1978-2023; the scheduler ends prefill chunks there,
                  sched/scheduler.py:604-613), and a block a lookup can hand out has it written.
    window-bound  a request holds at most ``spec.state_blocks`` real blocks: one in "none" mode
                  (the state block spans the context); two in "align" mode, the block the next
                  step reads and the block it writes, the older ones nulled
                  (``remove_skipped_blocks`` :1629-1657, ``allocate_new_blocks`` :1846-1856).
                  vLLM sizes the pool by that count (``MambaSpec.max_memory_usage_bytes``,
                  kv_cache_interface.py:1135-1141).  Freedom: one more for each other batch the
                  engine keeps in flight (async scheduling, a pipeline; ``Shape.groups``): step
                  t+1 is planned, and its block taken, before step t's output comes back, and
                  vLLM frees the block step t reads only by the processed count
                  (kv_cache_manager.py:561-568; ``remove_skipped_blocks`` :1640-1657).
    """
    B = world.config.block_size
    bound = spec.state_blocks
    assert bound is not None
    for sid, table in world.state.tables.items():
        seq = world.seqs.get(sid)
        if seq is None or seq.status is not Status.RUNNING or table.device is not Device.GPU:
            continue
        for v in state_readback_faults(table, seq, B, world.memory):
            yield v.named("kv-readback")
        held = len(table.held())
        if held > bound:
            yield Violation(
                "window-bound",
                f"seq {sid} holds {held} state blocks, at most {bound} in this state group "
                f"(block size {B})",
                kind="over-window",
                seqs=(sid,),
                device=Device.GPU.value,
                blocks=table.held(),
                expected=bound,
                observed=held,
            )
    pool = world.state.gpu
    for key, block in pool.cached:
        got = world.memory.get((Device.GPU, block, STATE_SLOT))
        want = state_of(key.chain)
        if got is not None and got != want:
            yield Violation(
                "prefix-cache-consistency",
                f"state block {block} is cached as the state after {want[0]} tokens but holds "
                f"the state after {got[0]} tokens (or another chain)",
                kind="wrong-content",
                device=Device.GPU.value,
                blocks=(block,),
                expected=want[0],
                observed=got[0],
            )
        elif got is None and block in pool.computed:
            yield Violation(
                "prefix-cache-consistency",
                f"state block {block} can be handed out as a cache hit for {want[0]} tokens but "
                "holds no state",
                kind="uncomputed-hit",
                device=Device.GPU.value,
                blocks=(block,),
                expected=want[0],
            )
