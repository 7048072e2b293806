"""Adapter: vLLM's own V1 ``Scheduler`` / ``AsyncScheduler``, in the shapes production runs.

``adapters/v1.py`` drives the ``KVCacheManager`` directly, one operation at a time, with the
scheduler's protocol written out by hand (unit level).  This adapter builds the release's real
scheduler instead and lets it decide: requests are added, ``schedule()`` plans a step,
kvspec's worker model executes it (testing/scheduler/driver.py), and ``update_from_output``
receives a fabricated ``ModelRunnerOutput`` (sampled tokens, accepted and rejected drafts).
Nothing of the scheduler's protocol is re-modelled here; what it does to the block pool is
observed after every call.

Shapes (``Shape``), each read off the installed release (0.33.0 file:line):

hybrid groups   a full-attention group and a sliding-window group in one ``KVCacheConfig``:
                ``get_kv_cache_coordinator`` builds ``HybridKVCacheCoordinator``
                (vllm/v1/core/kv_cache_coordinator.py:617).  Different block sizes per group
                need the Scheduler's ``hash_block_size`` (scheduler.py:92-93; the coordinator's
                divisibility asserts kv_cache_coordinator.py:113-116, 679-686): 0.33.0 has it,
                0.12.0, 0.10.1.1 and 0.9.1 do not (one block size for every group there).
chunked local   a full-attention group and a chunked-local group (Llama-4):
                ``ChunkedLocalAttentionSpec`` / ``ChunkedLocalAttentionManager``
                (kv_cache_interface.py:861, single_type_kv_cache_manager.py:1276; 0.12.0 :199,
                :501; 0.10.1.1 :138, :393; absent in 0.9.1).  One block size for both groups
                (single_type_kv_cache_manager.py:1338-1341) and no EAGLE beside it (:1333-1335).
pipeline        ``ParallelConfig.pipeline_parallel_size`` > 1 with the synchronous ``Scheduler``:
                the engine keeps one batch per stage in flight (``max_concurrent_batches``,
                0.33.0 config/vllm.py:588-598; before 0.25 the executor's, 0.20.1
                v1/executor/multiproc_executor.py:474-478), which the driver plays as it
                plays async scheduling's; the scheduler's ``use_pp`` only changes what its
                output carries (scheduler.py:1945), and from 0.30.0 ``max_in_flight_tokens``
                (config/vllm.py:601-609) sizes windows and the admission cap for those batches.
async           ``AsyncScheduler`` (vllm/v1/core/sched/async_scheduler.py):
                ``schedule()`` for step t+1 before ``update_from_output`` of step t, output
                placeholders (async_scheduler.py:25-56).  The engine keeps two batches in
                flight (``step_with_batch_queue``, vllm/v1/engine/core.py:708).
spec decode     ``SpeculativeConfig(method="ngram")``: ``num_spec_tokens`` draft slots per
                decode step (scheduler.py:297, 1312-1361, 1579); drafts arrive through
                ``update_draft_token_ids`` (sync, engine/core.py:700-706) or as placeholders the
                worker fills (async); rejections roll ``num_computed_tokens`` back
                (scheduler.py:2364-2376).  0.10.1.1 takes the next drafts in
                ``ModelRunnerOutput.spec_token_ids`` instead; 0.12.0 refuses async with
                ngram drafts (VllmConfig validation).
EAGLE           ``SpeculativeConfig(method="eagle")`` with the tiny model's folder as the head
                (its config only; config/speculative.py:1514-1532): the scheduler's
                ``use_eagle`` (scheduler.py:330-331) drops the last block of every prefix hit
                (kv_cache_coordinator.py:590-594, 867-901; 0.12.0 and 0.10.1.1 always) unless
                the block hashes cover the next token (0.33.0's default,
                ``num_hash_lookahead_tokens``, config/vllm.py:678-692, scheduler.py:342-345;
                ``Shape.lookahead_hashes``).  Async scheduling with drafts is EAGLE-only in 0.12.0.
budget          ``SchedulerConfig.max_num_batched_tokens`` below ``max_model_len``: the
                scheduler chunks long prompts by the token budget (scheduler.py:719);
                ``scheduler_reserve_full_isl`` (0.33: scheduler.py:426, 1449; absent in
                0.12.0 and before) on and off.
Mamba           a full-attention group and a ``MambaSpec`` group (Jamba, Granite-4, Qwen3-Next):
                ``MambaManager`` (single_type_kv_cache_manager.py:1428-2137) in
                ``mamba_cache_mode`` "align" with prefix caching (Mamba block = the block size)
                and "none" without (Mamba block = ``max_model_len``, the scheduler's block size
                the groups' least common multiple, kv_cache_utils.py:860-863); no drafts beside
                it.  0.33.0 only (``_mamba_supported``).  With ``Shape.prefix_match_unit`` the
                hashes are finer than the blocks (``CacheConfig.prefix_match_unit``, the
                Scheduler's ``hash_block_size``): hits inside a Mamba block, the prompt's partial
                tail cached, and the copy-on-write of a shared tail that the scheduler output
                hands the worker (``kv_cache_block_copies``, ``Plan.copies``).
retention       ``Shape.retention_interval`` into the ``KVCacheConfig`` the scheduler reads, and
                into ``CacheConfig`` beside it, as the engine copies one into the other
                (kv_cache_planning.py:665-667, 738-740); vLLM's own validation
                (``_validate_prefix_cache_retention_interval``, kv_cache_coordinator.py:33-62)
                decides which values a shape takes.  Releases whose ``CacheConfig`` lacks the
                field (before 0.30.0) run dense retention only (``retention_offer``).
KV connector    ``Shape.kv_connector``: ``KVTransferConfig`` names the connector vLLM builds for the
                scheduler (``KVConnectorFactory.create_connector``, 0.33.0
                sched/scheduler.py:174-205); kvspec plays the worker side and reports, in the
                ``ModelRunnerOutput``'s ``kv_connector_output``, the requests whose KV it has
                sent (``finished_sending``).  "NixlConnector" as a disaggregated prefill instance:
                every request asks ``do_remote_decode`` (its ``kv_transfer_params``, read by
                Request from ``SamplingParams.extra_args``, request.py:105-121), so a request
                that finishes by length keeps its blocks (``request_finished`` answers
                delay_free_blocks, nixl/pull_scheduler.py:235-270; scheduler.py:3040-3060) until
                ``finished_sending`` names it (``_update_from_kv_xfer_finished``, :3579-3582);
                an aborted one frees at once (pull_scheduler.py:235-244).  Only the scheduler
                side is built: NIXL itself is not needed.  A release whose connector factory
                lacks it refuses the shape (``kv_connectors_offered``).
multimodal      ``Shape.mm_item_tokens``: the model is a tiny BLIP-2 kvspec writes
                (adapters/v1_scheduler_mm.py), whose images are that many tokens, so the scheduler
                builds an encoder budget and an encoder cache (0.33.0 scheduler.py:265-293) and
                schedules each request's images (``_try_schedule_encoder_inputs``, :2018).
                Requests carry ``mm_features`` (``MultiModalFeatureSpec`` with a
                ``PlaceholderRange``, its identifier the image's), as adapters/v1.py builds them;
                the plan reports the encoder inputs each step computes
                (``SchedulerOutput.scheduled_encoder_inputs``, ``Plan.encoder_inputs``).  A
                release that cannot build the model's processor refuses the shape
                (``multimodal_refusal`` says why).
sizing          ``extra_blocks=0``: the pool vLLM's own startup check accepts at its edge,
                ``sum(cdiv(spec.max_memory_usage_bytes(cfg), spec.page_size_bytes))`` over the
                groups plus the null block (``check_enough_kv_cache_memory`` and
                ``_max_memory_usage_bytes_from_groups``, vllm/v1/core/kv_cache_planning.py:151,
                1253).

Releases: run on 0.33.0, 0.12.0, 0.10.1.1 and 0.9.1 (FINDINGS.md).  0.9.1's
``StructuredOutputManager`` builds a tokenizer even with ``skip_tokenizer_init``: the tiny model's
folder holds a word-level tokenizer kvspec writes (``_tiny_tokenizer``); 0.9.1 has no
``AsyncScheduler``, no chunked-local attention, one ``CachedRequestData`` per request in the
scheduler output.  Where the API moved the adapter
reads the release (``Scheduler`` parameters, config dataclass fields, ``Request`` parameters)
and passes what it takes: ``Scheduler(block_size=...)`` is 0.11+ (before, the cache config's
block size), request-side block hashing is 0.10.1+ (before, the manager's
``req_to_block_hashes``), 0.9-0.10 cache keys are ``BlockHashWithGroupId`` tuples.  A shape a
release lacks or refuses raises ``ConfigError`` (the machine skips the example, the summary
names it), never a guess.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import tempfile
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError
from kvspec.spec.groups import (
    DENSE_ONLY,
    KV_CONNECTORS,
    GroupState,
    HybridState,
    Plan,
    RetentionOffer,
    Scheduled,
    Shape,
)
from kvspec.spec.prefix_hash import NO_EXTRA, ExtraKeys, HashCollision, PrefixKey
from kvspec.spec.state import Device, PoolView, TableView

from .recording import Recorder, real
from .v1 import _build, _config_default, _load_vllm, _params
from .v1_scheduler_cache import SchedulerCacheView
from .v1_scheduler_mm import blip2_files, root_cause

RETENTION_FIELD = "prefix_cache_retention_interval"  # CacheConfig's and KVCacheConfig's field

# The tiny model whose config.json the scheduler's ModelConfig reads (no weights; a tiny
# tokenizer beside it for the releases that load one): two layers, one per KV-cache group.
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 65536,
    "torch_dtype": "float16",
}
HEAD_SIZE = 64
LAYER_FULL = "model.layers.0.self_attn.attn"
LAYER_SWA = "model.layers.1.self_attn.attn"
MAX_NUM_SEQS = 16  # running requests at most (SchedulerConfig asks the budget to be >= it)
NGRAM_LOOKUP = 2  # prompt_lookup_max of the ngram proposer (required by SpeculativeConfig)
# The tiny tokenizer's words: unknown, begin and end of sequence, and a few plain words.
TINY_VOCAB = ("<unk>", "<s>", "</s>", "a", "b", "c", "d")


def _hash_fn(name: str) -> Any:
    """The release's prefix-cache hash function by name (it moved in 0.11)."""
    for module in ("vllm.utils.hashing", "vllm.utils"):
        try:
            fn = getattr(importlib.import_module(module), "get_hash_fn_by_name", None)
        except ImportError:
            continue
        if fn is not None:
            return fn(name)
    raise ConfigError("this vLLM release has no get_hash_fn_by_name")


def _engine_refuses_async_drafts() -> bool:
    """Whether the release's ``EngineArgs`` refuses speculative decoding with async scheduling
    (0.10.1.1 arg_utils.py:1220-1225; later releases refuse in VllmConfig, which raises
    here by itself).  Read off the source: importing the engine args pulls in the engine."""
    spec = importlib.util.find_spec("vllm.engine.arg_utils")
    if spec is None or spec.origin is None:
        return False
    with open(spec.origin, encoding="utf-8") as f:
        src = f.read()
    return "speculative decoding is not supported with" in src and "async scheduling" in src


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` unless the file holds it already; atomically, as several processes
    (hypothesis workers, a CI run beside a helper) share the folder."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _tiny_tokenizer() -> dict[str, str]:
    """A word-level tokenizer over ``TINY_VOCAB``, built with the ``tokenizers`` library the
    release depends on (through transformers): ``tokenizer.json`` and a ``tokenizer_config.json``
    naming the fast tokenizer class, so ``AutoTokenizer`` loads it without a SentencePiece model
    (a Llama ``config.json`` alone makes it pick the slow Llama tokenizer).  The scheduler never
    tokenizes: before 0.10 the ``StructuredOutputManager`` loads a tokenizer when it is built
    even with ``skip_tokenizer_init`` (0.9.1 vllm/v1/structured_output/__init__.py:49), and
    offline there is no other."""
    tokenizers = importlib.import_module("tokenizers")
    vocab = {word: i for i, word in enumerate(TINY_VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=TINY_VOCAB[0]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": TINY_VOCAB[0],
        "bos_token": TINY_VOCAB[1],
        "eos_token": TINY_VOCAB[2],
        "model_max_length": TINY_MODEL["max_position_embeddings"],
    }
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=1)}


def model_files(shape: Shape) -> dict[str, str]:
    """The files, by name, of the model folder the adapter gives vLLM's ``ModelConfig`` in
    ``shape``: the tiny BLIP-2 for a multimodal shape, else the tiny Llama's config.json (with
    its tokenizer where ``tokenizers`` imports).  A reproducer writes the same files."""
    if shape.mm_item_tokens is not None:
        return blip2_files(shape.mm_item_tokens, TINY_MODEL)
    files = {"config.json": json.dumps(TINY_MODEL, indent=1)}
    if importlib.util.find_spec("tokenizers") is not None:
        files.update(_tiny_tokenizer())
    return files


def _model_folder(shape: Shape) -> Path:
    name = "kvspec-tiny-llama" if shape.mm_item_tokens is None else f"kvspec-tiny-blip2-q{shape.mm_item_tokens}"
    root = Path(tempfile.gettempdir()) / name
    root.mkdir(parents=True, exist_ok=True)
    for file, text in model_files(shape).items():
        _write_if_changed(root / file, text)
    return root


_MM_PROBE: list[str | None] = []  # the probe's answer, once per process


def _multimodal_refusal() -> str | None:
    """``VLLMV1SchedulerAdapter.multimodal_refusal``: build the smallest multimodal shape."""
    if not _MM_PROBE:
        probe = Shape(
            block_size=4,
            swa_block_size=4,
            sliding_window=None,
            extra_blocks=0,
            prefix_caching=False,
            num_spec_tokens=0,
            async_scheduling=False,
            max_num_batched_tokens=8,
            max_model_len=32,
            full_sequence_must_fit=False,
            mm_item_tokens=2,
        )
        try:
            VLLMV1SchedulerAdapter(probe)
            _MM_PROBE.append(None)
        except ConfigError as err:
            _MM_PROBE.append(str(err))
    return _MM_PROBE[0]


def _supports_hma() -> type | None:
    """The release's ``SupportsHMA`` (the connectors that keep the hybrid KV cache manager,
    0.12.0 kv_connector/v1/base.py:79); None before it (0.10.1.1: none does)."""
    try:
        base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
    except ImportError:
        return None
    return getattr(base, "SupportsHMA", None)


class SentInOrder(set):
    """The requests whose KV the worker reports sent in one output, iterated in the order
    reported.  vLLM frees their blocks in its iteration order of this set (0.33.0
    sched/scheduler.py:3579-3582), which for a plain set of strings follows the process's
    string hashing: any order is one vLLM may meet, and kvspec fixes the one the reference
    scheduler frees them in (``update``'s ``sent``), so that the free queue's order, and what
    a later allocation evicts, can be compared."""

    def __init__(self, request_ids: Iterable[str] = ()) -> None:
        self._order = list(dict.fromkeys(request_ids))
        super().__init__(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)


class VLLMV1SchedulerAdapter:
    """vLLM's V1 scheduler over one shared block pool, one KV-cache group per attention kind."""

    def __init__(self, shape: Shape, recorder: Recorder | None = None) -> None:
        """``recorder``: every construction and every call the scheduler's protocol makes is
        written down as a line of a straight-line reproducer (adapters/recording.py); the
        observation reads the real objects and is not written."""
        self.shape = shape
        self._rec = recorder
        self._model_dir = str(_model_folder(shape))
        if recorder is not None:
            recorder.alias(self._model_dir, "model_dir")  # the reproducer writes its own config.json
        self._v = v = _load_vllm()
        self.vllm_version: str = v.version
        self.name = f"vllm-v1-scheduler-{v.version}"
        sched_mod = importlib.import_module("vllm.v1.core.sched.scheduler")
        self._outputs = importlib.import_module("vllm.v1.outputs")
        so_mod = importlib.import_module("vllm.v1.structured_output")

        groups = shape.groups()
        if shape.mamba:
            self._mamba_supported(v)
        # The scheduling granularity: the groups' least common multiple (one Mamba state block
        # per request spans the whole context in "none" mode).
        B = shape.scheduler_block_size
        if any(B % g.block_size for g in groups):
            raise ConfigError(f"group block sizes must divide the scheduler's block size {B}")
        self.hash_block_size = math.gcd(*(g.block_size for g in groups))
        if shape.prefix_match_unit is not None:
            self._partial_hits_supported(v)
            self.hash_block_size = shape.prefix_match_unit
        # The groups' block sizes above the hash block: their cache keys are derived (``_learn``).
        self._coarser_block_sizes = sorted({g.block_size for g in groups} - {self.hash_block_size})
        self._sched_params = _params(sched_mod.Scheduler.__init__)
        if self.hash_block_size != B and "hash_block_size" not in self._sched_params:
            raise ConfigError(
                f"vLLM {v.version}: one block size for every KV-cache group (the Scheduler "
                "takes no hash_block_size)"
            )
        fields = {f.name for f in dataclasses.fields(v.config.SchedulerConfig)}
        self._has_full_isl = "scheduler_reserve_full_isl" in fields
        if shape.full_sequence_must_fit and not self._has_full_isl:
            raise ConfigError(f"vLLM {v.version}: no SchedulerConfig.scheduler_reserve_full_isl")
        # Request domains and the KV event stream (adapters/v1_scheduler_cache.py).
        self.cache_view = SchedulerCacheView(
            v, prefix_caching=shape.prefix_caching, num_groups=len(groups)
        )
        try:
            vllm_config = self._vllm_config(shape)
        except ValueError as err:  # pydantic's ValidationError: the release refuses the shape
            raise ConfigError(f"vLLM {v.version} refuses the shape: {str(err).splitlines()[-2:]}") from err
        specs = self._specs(shape)
        kcg = [
            _build(v.kci.KVCacheGroupSpec, recorder, "group", layer_names=[name], kv_cache_spec=spec)
            for name, spec in specs
        ]
        # vLLM's startup check at its edge: one request of max_model_len fits exactly.
        self.minimum_blocks = sum(
            -(-real(spec).max_memory_usage_bytes(real(vllm_config)) // real(spec).page_size_bytes)
            for _, spec in specs
        )
        pool_blocks = self.minimum_blocks + shape.extra_blocks
        self.cache_view.int_event_hashes = pool_blocks % 2 == 0  # both formats across a run
        self.num_blocks = pool_blocks
        kv_cache_config = _build(
            v.kci.KVCacheConfig,
            recorder,
            "kv_cache_config",
            num_blocks=pool_blocks + 1,  # + vLLM's null block
            kv_cache_tensors=[],
            kv_cache_groups=kcg,
            **self._retention_fields(shape),
        )
        self._retention_valid(shape, kv_cache_config)
        vllm_config.cache_config.num_gpu_blocks = pool_blocks + 1
        cls = sched_mod.Scheduler
        if shape.async_scheduling and shape.num_spec_tokens and _engine_refuses_async_drafts():
            raise ConfigError(f"vLLM {v.version}'s EngineArgs refuses async scheduling with drafts")
        if shape.async_scheduling:
            try:
                cls = importlib.import_module("vllm.v1.core.sched.async_scheduler").AsyncScheduler
            except ImportError as err:
                raise ConfigError(f"vLLM {v.version} has no AsyncScheduler") from err
        if shape.kv_connector is not None and len(kcg) > 1 and _supports_hma() is None:
            # Before SupportsHMA (0.10.1.1) vLLM turns the hybrid manager off under any connector
            # (config/__init__.py:3661-3663) and its Scheduler asserts one group (scheduler.py:83).
            raise ConfigError(self._hybrid_connector_refused(shape.kv_connector))
        try:
            structured = _build(so_mod.StructuredOutputManager, recorder, "structured", vllm_config=vllm_config)
        except (OSError, TypeError, ValueError) as err:
            # 0.9.x builds a tokenizer here even with skip_tokenizer_init: from the tiny
            # tokenizer beside config.json, or, where ``tokenizers`` is missing, not at all.
            raise ConfigError(
                f"vLLM {v.version}: StructuredOutputManager needs a tokenizer ({type(err).__name__})"
            ) from err
        # The parameters of Scheduler.__init__ (AsyncScheduler takes *args, **kwargs).
        # Before 0.11 the Scheduler read its block size off the cache config.
        extra = {"block_size": B, "hash_block_size": self.hash_block_size}
        # ``scheduler`` is what the protocol calls (recorded when a recorder is given);
        # ``_sched`` is what observation reads, never recorded.
        try:
            self.scheduler = self._construct(
                cls,
                "scheduler",
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                structured_output_manager=structured,
                # The engine's default (``disable_log_stats`` off): ``update_from_output`` builds
                # the scheduler stats, prefix-cache stats included (0.33.0 scheduler.py:3260-3300).
                log_stats=True,
                **{k: x for k, x in extra.items() if k in self._sched_params},
            )
        except Exception as err:
            if not shape.multimodal:
                raise
            # The encoder budget builds the model's HF processor (MultiModalBudget): a release
            # that cannot (a missing dependency, a processor API it does not match) refuses.
            cause = root_cause(err)
            raise ConfigError(
                f"vLLM {v.version}: the multimodal model's processor cannot be built "
                f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''})"
            ) from err
        self._sched = real(self.scheduler)
        # The encoder compute budget and cache size (embeddings), which the reference runs with.
        self.encoder_budget: int = getattr(self._sched, "max_num_encoder_input_tokens", 0)
        encoder_cache = getattr(self._sched, "encoder_cache_manager", None)
        self.encoder_cache_size: int = getattr(encoder_cache, "cache_size", 0)
        if shape.multimodal and not self.encoder_budget:
            raise ConfigError(f"vLLM {v.version} gives the multimodal model no encoder budget")
        if shape.pipeline_parallel > 1 and not getattr(self._sched, "use_pp", False):
            raise ConfigError(f"vLLM {v.version}'s scheduler does not see the pipeline")
        # Every request finished in an output has its KV sent (``do_remote_decode``, ``add``).
        self.sends_kv = shape.kv_connector is not None
        if shape.kv_connector is not None and getattr(self._sched, "connector", None) is None:
            raise ConfigError(f"vLLM {v.version}'s scheduler built no KV connector for {shape.kv_connector}")
        if shape.kv_connector is not None and len(self._sched.kv_cache_config.kv_cache_groups) > 1:
            self._hybrid_connector_built(shape.kv_connector)
        self.manager = self._sched.kv_cache_manager
        self.cache_view.watch(self.manager)
        self.extra_kinds = self.cache_view.kinds_for(self._sched)
        self.event_hash_formats = self.cache_view.event_hash_formats
        self.group_specs = groups
        self.config = Config(
            block_size=shape.block_size,
            num_blocks=pool_blocks,
            sliding_window=None,
            prefix_caching=shape.prefix_caching,
            max_lookahead=shape.num_spec_tokens,
        )
        self.num_lookahead_tokens: int = self._sched.num_lookahead_tokens
        # Whether every prefix hit loses its last block (EAGLE): 0.33.0 scheduler.py:331-345,
        # before that the scheduler's ``use_eagle`` itself (0.12.0, 0.10.1.1, 0.9.1).
        sched = self._sched
        self.drops_eagle_block = bool(getattr(sched, "use_eagle_block_drop", getattr(sched, "use_eagle", False)))
        self._hasher = None
        # 0.10.1+ hashes blocks on the request; before, the manager hashes with its own
        # function (0.9.1 kv_cache_manager.py:82) and the adapter has nothing to set up.
        if shape.prefix_caching and hasattr(v.kcu, "get_request_block_hasher"):
            algo = _config_default(v.config.CacheConfig, "prefix_caching_hash_algo", "sha256")
            hash_fn = _hash_fn(algo)
            from . import v1 as _v1

            if not _v1._NONE_HASH_SEEDED and hasattr(v.kcu, "init_none_hash"):
                v.kcu.init_none_hash(hash_fn)
                _v1._NONE_HASH_SEEDED = True
            if recorder is not None and hasattr(v.kcu, "init_none_hash"):
                recorder.note(v.kcu.init_none_hash, hash_fn)  # a fresh process seeds it too
            # As the engine core builds it (0.33.0 engine/core.py:219-230): with EAGLE and
            # prefix caching each hash also covers the tokens after its block
            # (``num_hash_lookahead_tokens``, config/vllm.py:678-692), which the scheduler's
            # coordinator relies on not to drop a hit block.  Positional: the block size is
            # ``block_size`` before 0.30, ``hash_block_size`` after (kv_cache_utils.py 0.20.1
            # :635, 0.33.0 :953), so a reproducer runs on either.
            lookahead = getattr(vllm_config, "num_hash_lookahead_tokens", 0)
            takes = "num_hash_lookahead_tokens" in _params(v.kcu.get_request_block_hasher)
            hasher_args = (self.hash_block_size, hash_fn, *((lookahead,) if takes else ()))
            hasher = v.kcu.get_request_block_hasher
            self._hasher = (
                recorder.construct(hasher, {}, "hasher", hasher_args) if recorder is not None else hasher(*hasher_args)
            )
        self._epochs: dict[int, int] = {}
        self._count_allocations()
        self._req: dict[int, Any] = {}  # seq id -> Request (until finished)
        self._seq_of: dict[str, int] = {}
        self._keys: dict[Any, PrefixKey] = self.cache_view.keys
        self.hash_collisions: list[HashCollision] = self.cache_view.hash_collisions
        self._extra: dict[str, ExtraKeys] = {}  # request id -> its domain

    # ------------------------------------------------------------------ construction

    def _vllm_config(self, shape: Shape) -> Any:
        # The config classes are pydantic dataclasses (0.11+): built with the arguments
        # vLLM's own tests/v1/core/utils.py create_scheduler passes, and no others.
        c = self._v.config
        model_fields = {f.name for f in dataclasses.fields(c.ModelConfig)}
        make = self._construct
        model_config = make(
            c.ModelConfig,
            "model_config",
            model=self._model_dir,
            # A multimodal model's processor needs its tokenizer (the image token's id).
            skip_tokenizer_init=not shape.multimodal,
            max_model_len=shape.max_model_len,
            dtype="float16",
            seed=0,
            # Before 0.11 VllmConfig asks the platform about the V0 async output processor,
            # which an unnamed (CPU, no GPU) platform cannot answer.
            **({"use_async_output_proc": False} if "use_async_output_proc" in model_fields else {}),
        )
        scheduler_config = make(
            c.SchedulerConfig,
            "scheduler_config",
            max_num_seqs=min(MAX_NUM_SEQS, shape.max_num_batched_tokens),
            max_num_batched_tokens=shape.max_num_batched_tokens,
            max_model_len=shape.max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            async_scheduling=shape.async_scheduling,
            **(
                {"scheduler_reserve_full_isl": shape.full_sequence_must_fit}
                if self._has_full_isl
                else {}
            ),
        )
        cache_config = make(
            c.CacheConfig,
            "cache_config",
            block_size=shape.block_size,
            enable_prefix_caching=shape.prefix_caching,
            **(
                {"mamba_cache_mode": shape.mamba_cache_mode, "mamba_block_size": shape.mamba_block}
                if shape.mamba
                else {}
            ),
            **({"prefix_match_unit": shape.prefix_match_unit} if shape.prefix_match_unit is not None else {}),
            **self._retention_fields(shape),
        )
        speculative_config = None
        if shape.num_spec_tokens and shape.eagle:
            # The EAGLE head's config is the tiny model's own (vLLM wraps it in an EAGLEConfig,
            # 0.33.0 config/speculative.py:1514-1532); nothing is loaded, the scheduler only
            # reads ``use_eagle()`` (scheduler.py:330-331) and reserves the draft slots.
            spec_fields = {f.name for f in dataclasses.fields(c.SpeculativeConfig)}
            # 0.33.0 hashes a block with the token after it for EAGLE by default and then drops
            # no hit block; before, there are no such hashes and every hit loses its last block.
            has_lookahead = "disable_lookahead_block_hashes" in spec_fields
            if shape.lookahead_hashes and not has_lookahead:
                raise ConfigError(f"vLLM {self._v.version}: no lookahead block hashes for EAGLE")
            speculative_config = make(
                c.SpeculativeConfig,
                "speculative_config",
                method="eagle",
                model=self._model_dir,
                num_speculative_tokens=shape.num_spec_tokens,
                target_model_config=model_config,
                target_parallel_config=make(c.ParallelConfig, "parallel_config"),
                **({"disable_lookahead_block_hashes": not shape.lookahead_hashes} if has_lookahead else {}),
            )
        elif shape.num_spec_tokens:
            speculative_config = make(
                c.SpeculativeConfig,
                "speculative_config",
                method="ngram",
                num_speculative_tokens=shape.num_spec_tokens,
                prompt_lookup_max=NGRAM_LOOKUP,
                prompt_lookup_min=1,
            )
        kv_transfer = {}
        if shape.kv_connector is not None:
            if shape.mamba:
                # A producer's Mamba boundary states go to the connector (0.33.0
                # single_type_kv_cache_manager.py:149-160, kv_cache_manager.py:906-927), which
                # kvspec's worker does not play.
                raise ConfigError("a KV connector beside a Mamba group: the worker plays no boundary-state offloads")
            if shape.kv_connector not in self.kv_connectors_offered():
                raise ConfigError(f"vLLM {self._v.version}: no {shape.kv_connector} in its KV connector factory")
            kv_transfer["kv_transfer_config"] = make(
                c.KVTransferConfig, "kv_transfer_config", kv_connector=shape.kv_connector, kv_role="kv_producer"
            )
        # A pipeline: the scheduler reads only that there is one (``use_pp``: which tokens its
        # output carries, 0.33.0 scheduler.py:1945); the engine's batch queue is what keeps
        # ``pipeline_parallel`` batches in flight, and kvspec's driver plays it.
        parallel = {}
        if shape.pipeline_parallel > 1:
            parallel["parallel_config"] = make(
                c.ParallelConfig, "parallel_config", pipeline_parallel_size=shape.pipeline_parallel
            )
        return make(
            c.VllmConfig,
            "vllm_config",
            **kv_transfer,
            **parallel,
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            device_config=make(c.DeviceConfig, "device_config", device="cpu"),
            speculative_config=speculative_config,
            **self.cache_view.config_fields(make),
        )

    def _construct(self, cls: Any, prefix: str, **kwargs: Any) -> Any:
        """``cls(**kwargs)``, written down as ``prefix<n> = cls(...)`` under a recorder."""
        if self._rec is not None:
            return self._rec.construct(cls, kwargs, prefix)
        return cls(**kwargs)

    def _specs(self, shape: Shape) -> list[tuple[str, Any]]:
        kci, torch = self._v.kci, self._v.torch
        common = dict(num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.float16, use_mla=False)
        # One page size for every group (the hybrid allocator's precondition): a group with
        # smaller blocks takes more heads per block.
        out = [(LAYER_FULL, _build(kci.FullAttentionSpec, self._rec, "spec", block_size=shape.block_size, **common))]
        if shape.sliding_window is not None:
            scale = shape.block_size // shape.swa_block_size
            swa = _build(
                kci.SlidingWindowSpec,
                self._rec,
                "spec",
                block_size=shape.swa_block_size,
                sliding_window=shape.sliding_window,
                **{**common, "num_kv_heads": scale},
            )
            out.append((LAYER_SWA, swa))
        if shape.attention_chunk_size is not None:
            spec_cls = getattr(kci, "ChunkedLocalAttentionSpec", None)
            if spec_cls is None:  # 0.10.1+ (kv_cache_interface.py:138 there)
                raise ConfigError(f"vLLM {self._v.version} has no ChunkedLocalAttentionSpec")
            if shape.swa_block_size != shape.block_size:
                # 0.33.0 single_type_kv_cache_manager.py:1338-1341 asserts one block size.
                raise ConfigError("chunked-local groups take the scheduler's block size")
            chunked = _build(
                spec_cls,
                self._rec,
                "spec",
                block_size=shape.block_size,
                attention_chunk_size=shape.attention_chunk_size,
                **common,
            )
            out.append((LAYER_SWA, chunked))
        if shape.mamba:
            # A one-number state (vLLM's own test recipe, tests/v1/core/test_scheduler.py
            # ``_create_hybrid_mamba_connector_scheduler``): the scheduler reads only the block
            # size, the cache mode and the speculative block count (none here).
            mamba = _build(
                kci.MambaSpec,
                self._rec,
                "spec",
                block_size=shape.mamba_block,
                shapes=((1, 1),),
                dtypes=(torch.float32,),
                mamba_cache_mode=shape.mamba_cache_mode,
                num_speculative_blocks=0,
            )
            out.append((LAYER_SWA, mamba))
        return out

    def _hybrid_connector_built(self, connector: str) -> None:
        """A connector beside more than one KV-cache group only where it supports the hybrid
        KV cache manager (``SupportsHMA``): vLLM turns the manager off under any other
        connector (0.12.0 config/vllm.py:892-905, always; 0.20.1 :1288-1305, unless asked),
        and its scheduler asserts one group when a request finishes (0.12.0
        sched/scheduler.py:1508-1513).  A hybrid shape with such a connector is one vLLM never
        builds: refused."""
        supports = _supports_hma()
        if supports is None or not isinstance(self._sched.connector, supports):
            raise ConfigError(self._hybrid_connector_refused(connector))

    def _hybrid_connector_refused(self, connector: str) -> str:
        return (f"vLLM {self._v.version}: {connector} does not support the hybrid KV cache manager, "
                "which vLLM turns off under it (a hybrid shape with it is never built)")

    @staticmethod
    def kv_connectors_offered() -> tuple[str, ...]:
        """The connectors of ``KV_CONNECTORS`` the installed release's connector factory
        registers (0.33.0 kv_connector/factory.py:177); none where it has no V1 KV transfer
        config or no ``kv_connector_output`` in the model runner's output."""
        v = _load_vllm()
        if not hasattr(v.config, "KVTransferConfig"):
            return ()
        outputs = importlib.import_module("vllm.v1.outputs")
        fields = {f.name for f in dataclasses.fields(outputs.ModelRunnerOutput)}
        if "kv_connector_output" not in fields or not hasattr(outputs, "KVConnectorOutput"):
            return ()
        try:
            factory = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.factory").KVConnectorFactory
        except ImportError:
            return ()
        registry = getattr(factory, "_registry", {})
        return tuple(name for name in KV_CONNECTORS if name in registry)

    @staticmethod
    def multimodal_refusal() -> str | None:
        """Why the installed release cannot run the multimodal shape (None: it can): a small
        multimodal shape is built once per process, and its refusal read."""
        return _multimodal_refusal()

    @staticmethod
    def retention_offer() -> RetentionOffer:
        """The retentions the installed release lets a deployment choose, and the one its engine
        runs by default: ``CacheConfig``'s field and its default (0.33.0 config/cache.py:275)
        where the release has it, dense only where it does not."""
        cache_config = _load_vllm().config.CacheConfig
        if RETENTION_FIELD not in {f.name for f in dataclasses.fields(cache_config)}:
            return DENSE_ONLY
        return RetentionOffer(configurable=True, engine_default=_config_default(cache_config, RETENTION_FIELD, None))

    def _retention_fields(self, shape: Shape) -> dict[str, int | None]:
        """The retention keyword of ``CacheConfig`` and ``KVCacheConfig``: the shape's, where the
        release has the field; none where it has not and the shape is dense (the release's only
        retention).  A sparse shape on such a release is refused."""
        if RETENTION_FIELD in {f.name for f in dataclasses.fields(self._v.config.CacheConfig)}:
            return {RETENTION_FIELD: shape.retention_interval}
        if shape.retention_interval is not None:
            raise ConfigError(f"vLLM {self._v.version}: no CacheConfig.{RETENTION_FIELD} (dense retention only)")
        return {}

    def _retention_valid(self, shape: Shape, kv_cache_config: Any) -> None:
        """vLLM's own check of the retention against the groups (kv_cache_coordinator.py:33-62),
        run before the scheduler is built so that a value the release refuses is a refused
        shape (``ConfigError``), not a failure of the run."""
        if shape.retention_interval is None:
            return
        try:  # a release with the retention field ships the coordinator; an older one needs no check
            coordinator = importlib.import_module("vllm.v1.core.kv_cache_coordinator")
        except ImportError:
            return
        validate = getattr(coordinator, "_validate_prefix_cache_retention_interval", None)
        if validate is None:
            return
        try:
            validate(shape.retention_interval, shape.scheduler_block_size, real(kv_cache_config))
        except ValueError as err:
            raise ConfigError(f"vLLM {self._v.version} refuses the retention: {err}") from err

    @staticmethod
    def _mamba_supported(v: Any) -> None:
        """Refuse a Mamba shape on a release whose ``MambaManager`` kvspec has not read: the
        state-group rules (spec/groups.py ``state_faults``) cite 0.33.0's block layout per
        ``mamba_cache_mode`` (single_type_kv_cache_manager.py:1428-2137)."""
        spec_cls = getattr(v.kci, "MambaSpec", None)
        fields = {f.name for f in dataclasses.fields(spec_cls)} if spec_cls is not None else set()
        if "mamba_cache_mode" not in fields or v.version != "0.33.0":
            raise ConfigError(
                f"vLLM {v.version}: Mamba state groups are modelled on 0.33.0's MambaManager only"
            )

    def _partial_hits_supported(self, v: Any) -> None:
        """Refuse hits inside a Mamba block on a release without them: the cache config's
        ``prefix_match_unit`` and ``partial_hash_hits_enabled`` (0.33.0 config/cache.py:203,
        kv_cache_utils.py:762; 0.31.0 and 0.30.0 have the field but not the function, and kvspec
        drives their Mamba groups not at all, ``_mamba_supported``)."""
        fields = {f.name for f in dataclasses.fields(v.config.CacheConfig)}
        if "prefix_match_unit" not in fields or not hasattr(v.kcu, "partial_hash_hits_enabled"):
            raise ConfigError(f"vLLM {v.version}: no prefix hits inside a Mamba block (no partial_hash_hits_enabled)")

    def _count_allocations(self) -> None:
        """Count how often the pool hands each block out (observation only, as in v1.py)."""
        pool = self.manager.block_pool
        allocate = pool.get_new_blocks
        epochs = self._epochs

        def counted(*args: Any, **kwargs: Any) -> Any:
            blocks = allocate(*args, **kwargs)
            for block in blocks:
                epochs[block.block_id] = epochs.get(block.block_id, 0) + 1
            return blocks

        pool.get_new_blocks = counted

    # ------------------------------------------------------------------ requests

    def add(
        self, seq_id: int, tokens: Sequence[int], max_tokens: int, extra: ExtraKeys = NO_EXTRA
    ) -> None:
        v = self._v
        # A disaggregated prefill instance's request: its KV is sent to a decode instance.
        transfer = {"extra_args": {"kv_transfer_params": {"do_remote_decode": True}}} if self.shape.kv_connector else {}
        sampling = self._construct(
            v.sampling.SamplingParams, "sampling", max_tokens=max_tokens, ignore_eos=True, **transfer
        )
        request = _build(
            v.request.Request,
            self._rec,
            "req",
            request_id=f"seq{seq_id}",
            prompt_token_ids=list(tokens),
            sampling_params=sampling,
            pooling_params=None,
            eos_token_id=None,
            arrival_time=0.0,
            block_hasher=self._hasher,
            # cache salt, LoRA, multimodal (none: the plain domain), in the release's form
            **self.cache_view.request_fields(extra),
        )
        self.scheduler.add_request(request)
        request = real(request)
        self._req[seq_id] = request
        self._seq_of[request.request_id] = seq_id
        self._extra[request.request_id] = extra
        self._learn(request)
        self.cache_view.set_hash_format()

    def abort(self, seq_id: int) -> None:
        request = self._req[seq_id]
        status = self._v.request.RequestStatus.FINISHED_ABORTED
        self.cache_view.set_hash_format()
        self.scheduler.finish_requests([request.request_id], status)

    def sending(self, seq_id: int) -> bool:
        """Whether the request finished but the scheduler keeps it, and its blocks, until the
        worker reports its KV sent (a connector's deferred free)."""
        request = self._req.get(seq_id)
        return (
            request is not None
            and request.is_finished()
            and self._sched.requests.get(request.request_id) is request
        )

    def held_for_sending(self) -> tuple[int, ...]:
        """The requests ``sending`` holds now."""
        return tuple(s for s in self._req if self.sending(s))

    def requests(self) -> list[tuple[Any, ExtraKeys]]:
        """Every request the scheduler holds (until finished) with its domain."""
        return [(r, self._extra.get(r.request_id, NO_EXTRA)) for r in self._req.values()]

    def live(self, seq_id: int) -> bool:
        request = self._req.get(seq_id)
        return request is not None and not request.is_finished()

    def tokens(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._req[seq_id].all_token_ids)

    # ------------------------------------------------------------------ a step

    def schedule(self) -> Plan:
        running = [r.request_id for r in self._sched.running]
        self.cache_view.set_hash_format()
        so = real(self.scheduler.schedule())
        if self._rec is not None:
            # What the scheduler planned, which the recorded outputs after it answer.
            self._rec.expect(self._rec.names[id(so)], "num_scheduled_tokens", dict(so.num_scheduled_tokens))
        scheduled = []
        starts: dict[str, int] = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        if isinstance(cached, list):  # before 0.10: one CachedRequestData per request
            starts.update((r.req_id, r.num_computed_tokens) for r in cached)
        else:
            starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, n in so.num_scheduled_tokens.items():
            drafts = tuple(so.scheduled_spec_decode_tokens.get(req_id, ()))
            scheduled.append(
                Scheduled(self._seq_of[req_id], starts[req_id], n, len(drafts), drafts)
            )
        if hasattr(so, "preempted_req_ids"):  # a set (0.33.0 sched/output.py:276)
            ids = set(so.preempted_req_ids or ())
        else:  # before 0.11 the output does not say; the request's status does
            status = self._v.request.RequestStatus.PREEMPTED
            ids = {r for r in running if self._sched.requests[r].status == status}
        # Listed in the order vLLM preempted them: from the end of the running queue
        # (``self.running.pop()``, 0.33.0 sched/scheduler.py:970), not in the set's order.
        place = {r: i for i, r in enumerate(running)}
        preempted = tuple(self._seq_of[r] for r in sorted(ids, key=lambda r: -place.get(r, -1)))
        finished = tuple(self._seq_of[r] for r in so.finished_req_ids if r in self._seq_of)
        for r in self._req.values():
            self._learn(r)
        # The copy-on-write copies the worker runs before this step's forward (0.33.0
        # sched/output.py:309, scheduler.py:1698-1707; absent before).
        copies = tuple((c.src_block_id, c.dst_block_id) for c in getattr(so, "kv_cache_block_copies", None) or ())
        encoded = tuple(
            sorted((self._seq_of[r], i) for r, inputs in (so.scheduled_encoder_inputs or {}).items() for i in inputs)
        )
        return Plan(tuple(scheduled), preempted, finished, so, copies, encoded)

    def update(
        self,
        plan: Plan,
        sampled: Mapping[int, Sequence[int]],
        drafts: Mapping[int, Sequence[int]] | None = None,
        sent: Collection[int] = (),
    ) -> None:
        """``update_from_output`` with the worker's sampled tokens (accepted drafts + one
        token) per request, and the requests whose KV the worker has finished sending (the
        connector's ``finished_sending``); then, synchronously, the next drafts
        (``update_draft_token_ids``)."""
        so = plan.handle
        req_ids = list(so.num_scheduled_tokens)
        connector: dict[str, Any] = {}
        if self.shape.kv_connector is not None:
            connector["kv_connector_output"] = _build(
                self._outputs.KVConnectorOutput,
                self._rec,
                "kv_output",
                finished_sending=SentInOrder(self._req[s].request_id for s in sent) or None,
            )
        out = _build(
            self._outputs.ModelRunnerOutput,
            self._rec,
            "output",
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[list(sampled.get(self._seq_of[r], ())) for r in req_ids],
            # Before 0.11 the next drafts came back in the output itself.
            spec_token_ids=[list((drafts or {}).get(self._seq_of[r], ())) for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            **connector,
        )
        self.cache_view.set_hash_format()
        self.scheduler.update_from_output(so, out)
        takes_drafts = hasattr(self._sched, "update_draft_token_ids")
        if drafts and takes_drafts and not self.shape.async_scheduling:
            ids = [self._req[s].request_id for s in drafts if self.live(s)]
            lists = [list(drafts[s]) for s in drafts if self.live(s)]
            if ids:
                self.scheduler.update_draft_token_ids(
                    _build(self._outputs.DraftTokenIds, self._rec, "drafts", req_ids=ids, draft_token_ids=lists)
                )
        for r in self._req.values():
            self._learn(r)

    # ------------------------------------------------------------------ observation

    def _learn(self, request: Any) -> None:
        """Map the release's hash of every block to its PrefixKey (the token chain up to the
        block's end, in the request's domain): of every hash block, and of every block of a
        group whose blocks are a multiple of the hash block, as the release's own
        ``BlockHashListWithBlockSize`` derives it when ``cache_full_blocks`` caches such a block
        (block_pool.py: 0.20.1 :241-252).  Releases derive it differently: 0.12.0 and 0.20.1
        concatenate the hash blocks' hashes (kv_cache_utils.py 0.20.1 :2115-2118, 0.12.0
        :1462-1468), 0.30.0 and 0.33.0 take the last one (0.33.0 :1224-1227)."""
        hashes = getattr(request, "block_hashes", None)
        if not hashes and hasattr(self.manager, "req_to_block_hashes"):
            hashes = self.manager.req_to_block_hashes.get(request.request_id)  # before 0.10.1
        if not hashes:
            return
        extra = self._extra.get(request.request_id, NO_EXTRA)
        tokens = tuple(request.all_token_ids)
        seq = self._seq_of.get(request.request_id)
        self.cache_view.learn(hashes, tokens, extra, self.hash_block_size, seq)
        for size in self._coarser_block_sizes:
            coarse = self._v.kcu.BlockHashListWithBlockSize(hashes, self.hash_block_size, size)
            self.cache_view.learn(coarse, tokens, extra, size, seq)

    def _usage(self) -> float | None:
        """The KV-cache usage the scheduler reports (``get_kv_cache_usage``, 0.33.0
        scheduler.py:2924; the manager's ``usage`` where it has no such method)."""
        read = getattr(self.scheduler, "get_kv_cache_usage", None)
        if read is not None:
            return float(read())
        usage = getattr(self.manager, "usage", None)
        return None if usage is None else float(usage)

    def _cache_entries(self) -> list[tuple[int, PrefixKey, Any]]:
        """(group, key, blocks) for every entry of the pool's prefix-cache map."""
        kcu = self._v.kcu
        raw = self.manager.block_pool.cached_block_hash_to_block
        raw = getattr(raw, "_cache", raw)
        out = []
        for vkey, entry in raw.items():
            if hasattr(kcu, "get_group_id"):  # 0.11+: hash bytes + a 4-byte group id
                group, h = kcu.get_group_id(vkey), kcu.get_block_hash(vkey)
            else:  # 0.9-0.10: BlockHashWithGroupId(block_hash, group_id)
                group, h = vkey.group_id, vkey.block_hash
            key = self._keys.get(h)
            if key is None:
                raise RuntimeError(f"a block is cached under a hash no request produced ({h!r})")
            out.append((group, key, entry.values() if isinstance(entry, dict) else (entry,)))
        return out

    def cached_keys(self, group: int) -> frozenset[PrefixKey]:
        """The keys KV-cache group ``group``'s prefix cache holds now (read without draining
        events)."""
        return frozenset(key for g, key, _ in self._cache_entries() if g == group)

    def observe(self) -> HybridState:
        self.cache_view.drain(self.manager)
        pool = self.manager.block_pool
        null = pool.null_block
        blocks = [b for b in pool.blocks if b is not null]
        ids = tuple(b.block_id for b in blocks)
        queue = list(pool.free_block_queue.get_all_free_blocks())
        free = tuple(b.block_id for b in queue if b.block_hash is None)
        evictable = tuple(b.block_id for b in queue if b.block_hash is not None)
        per_group: list[list[tuple[PrefixKey, int]]] = [[] for _ in self.group_specs]
        for group, key, entries in self._cache_entries():
            per_group[group].extend((key, b.block_id) for b in entries)
        # A block may be cached under several keys of one group (0.33 registers a block
        # under each hash-block boundary it holds, for fine-grained hits): listed by block and
        # key length, so that its longest key is the one ``PoolView.cached_key_of`` keeps
        # whatever order vLLM's map iterates in.
        per_group = [sorted(g, key=lambda e: (e[1], len(e[0].chain))) for g in per_group]
        cached_all = tuple(sorted((e for g in per_group for e in g), key=lambda e: (e[1], len(e[0].chain))))
        gpu = PoolView(
            ids=ids,
            refcounts={b.block_id: b.ref_cnt for b in blocks},
            free=free,
            evictable=evictable,
            cached=cached_all,
            computed=frozenset(b for _, b in cached_all),
            epochs={b: self._epochs.get(b, 0) for b in ids},
            usage=self._usage(),
        )
        coordinator = self.manager.coordinator
        groups = []
        for gi, spec in enumerate(self.group_specs):
            manager = coordinator.single_type_managers[gi]
            tables = {}
            for seq_id, request in self._req.items():
                held = manager.req_to_blocks.get(request.request_id)
                if held is None:
                    continue
                slots = tuple(
                    None if (b is null or getattr(b, "is_null", False)) else b.block_id
                    for b in held
                )
                tables[seq_id] = TableView(seq_id, Device.GPU, slots)
            events = self.cache_view.group_events(gi)
            groups.append(GroupState(spec, tables, tuple(per_group[gi]), events))
        return HybridState(gpu, tuple(groups))


__all__ = ["VLLMV1SchedulerAdapter", "model_files"]
