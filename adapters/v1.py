"""Adapter: vLLM's V1-engine ``KVCacheManager`` under the kvspec ``Implementation`` contract.

One class covers every V1 release from 0.9.0 on (the first that ships
vllm/v1/core/single_type_kv_cache_manager.py, which it imports; targets/registry.py refuses
earlier ones); its branches still follow the API back to 0.8.3, whose lines are cited below.
Where the API moved, the adapter reads the
installed release (``inspect.signature`` of the manager, the request and the config
dataclasses) and takes one of a few branches; it never re-implements vLLM logic.

How the scheduler drives the manager, and how each kvspec operation maps onto it
(file:line in ``vllm/v1/core/sched/scheduler.py`` of the release named):

admit   0.33.0  1110-1127 ``get_computed_blocks`` (through ``_get_local_prefix_cache_hit``,
                665-676; the third return value goes to ``request.shared_prefix_boundary``),
                1435-1451 ``allocate_slots(request, num_new_tokens, num_new_computed_tokens=hit,
                new_computed_blocks=blocks, num_lookahead_tokens=<the spec lookahead>,
                full_sequence_must_fit=scheduler_reserve_full_isl,
                has_scheduled_reqs=bool(running))``; ``None`` -> the request stays waiting
                (1453-1460); else 1571-1573 ``status = RUNNING``, ``num_computed_tokens = hit``,
                then ``_update_after_schedule`` 1845-1859 adds the scheduled tokens to
                ``num_computed_tokens`` and ``num_in_flight_tokens``.
        0.10.1.1 379 ``get_computed_blocks``, 440-455 ``allocate_slots`` (lookahead 0 while
                ``num_computed_tokens == 0``, i.e. at every local admission), 504-505, 611.
        0.8.3   296 ``get_computed_blocks``, 323 ``allocate_slots(request, n, computed_blocks)``,
                354-355, 447.
reserve 0.33.0  914-918 ``allocate_slots(request, n, num_lookahead_tokens=...)`` for a running
                request, ``None`` -> preempt (the driver decides: we raise ``NotAdmitted``);
                0.10.1.1 247-250; 0.8.3 190-191 (no lookahead argument).
commit  0.33.0  ``update_from_output`` 2318: ``num_in_flight_tokens -= scheduled``.  Older
                releases advance only ``num_computed_tokens``, at schedule time (above), so
                commit is bookkeeping only.  The ``cache_blocks`` call at 2412-2415 (spec decode
                / async placeholders) caches up to ``num_computed - num_in_flight`` tokens,
                which ``allocate_slots`` already cached at schedule time in this flow (no draft
                tokens are ever rejected), so it is not repeated.
append  0.33.0  2753, 0.10.1.1 937, 0.8.3 619: ``request.append_output_token_ids(token)``.
free    preemption: 0.33.0 ``_preempt_request`` 1799-1843 (``kv_cache_manager.free``,
                ``status = PREEMPTED``, ``num_computed_tokens = 0``); 0.10.1.1 263-265;
                0.8.3 196-198.  The Request object is kept: re-admitting the same tokens
                resumes it (``scheduled_resumed_reqs``), as the scheduler does.  A finished
                request (0.8.3 ``_free_request`` 711-714 also drops its block hashes) is
                told apart only when the driver re-admits the id with other tokens.
reset   0.33.0 3212, 0.10.1.1 1047, 0.8.3 731: ``kv_cache_manager.reset_prefix_cache()``.
copies  0.33.0 1698-1706: ``take_kv_cache_block_copies`` after scheduling; with no KV
        connector the retained endpoints are freed at once (``_free_cow_retained_blocks``).

Block hashing: 0.10.1+ hashes in the Request through ``block_hasher`` built by
``vllm/v1/engine/core.py`` (0.33.0 219-230, 0.10.1.1 151-156: ``init_none_hash`` then
``get_request_block_hasher``); before that the manager hashed (``hash_request_tokens``,
``req_to_block_hashes``).  Either way the adapter reads the release's own hashes and maps each
to the ``PrefixKey`` of the same block (the token chain up to its end), so ``observe`` can
translate ``cached_block_hash_to_block``.

Extra keys (the request's domain, ``spec.prefix_hash.ExtraKeys``) go into the ``Request`` in
the form the release takes: ``cache_salt`` (0.9+), ``lora_request`` (a ``LoRARequest`` per
adapter name, with a stable int id and path: the key is the int id up to 0.10.x, name and path
in 0.33.0, kv_cache_utils.py:590-607), multimodal placements as ``mm_features``
(``MultiModalFeatureSpec(identifier, mm_position=PlaceholderRange)``, 0.10.2+) or, before,
``multi_modal_hashes`` + ``multi_modal_placeholders``.  No encoder runs: the block manager reads
only the identifier and the placement.  The capabilities declare the kinds the release takes.

KV-cache events: with prefix caching the manager is built with ``enable_kv_cache_events=True``
(as the scheduler does when ``KVEventsConfig.enable_kv_cache_events``, scheduler.py:148-151 of
0.33.0) and ``observe`` drains ``block_pool.take_events()`` -- what the engine core publishes
after every step -- translating each event's hashes back to ``PrefixKey``s.  Both external hash
formats are driven: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (vllm/envs.py, read at every
emission) is set per adapter, by default from the pool size's parity so that every run draws
both.

Not in V1: fork (parallel sampling shares prompt blocks through the prefix cache instead), swap
(recompute-only preemption), and a separate admission check.  Hybrid models (several KV cache
groups sharing one pool) are not exposed: the abstract state has one table per sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import itertools
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from types import MappingProxyType, SimpleNamespace
from typing import Any

from kvspec.spec.admission import AdmissionPolicy
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError, NoFreeBlocks, NotAdmitted, Unsupported
from kvspec.spec.events import CacheEvent, EventKind
from kvspec.spec.interface import Admission, BlockCopy, Capability
from kvspec.spec.prefix_hash import ExtraKeys, HashCollision, PrefixKey, as_extra, key_of
from kvspec.spec.state import Device, KVState, PoolView, TableView, table_view

from .harness import v1 as harness_v1
from .recording import Recorder, real

# The NONE_HASH seed is process-global in vLLM; seeding it again would change the hashes of
# every manager already alive in this process, so it is seeded once, like the engine core does.
_NONE_HASH_SEEDED = False


def _load_vllm() -> SimpleNamespace:
    """Import the pieces of the installed vLLM the adapter calls (lazily: only this module
    may import vllm, and only when an adapter is built)."""
    mods = SimpleNamespace()
    mods.version = importlib.import_module("vllm").__version__
    mods.kcm = importlib.import_module("vllm.v1.core.kv_cache_manager")
    mods.kcu = importlib.import_module("vllm.v1.core.kv_cache_utils")
    mods.kci = importlib.import_module("vllm.v1.kv_cache_interface")
    mods.request = importlib.import_module("vllm.v1.request")
    mods.sampling = importlib.import_module("vllm.sampling_params")
    mods.config = importlib.import_module("vllm.config")
    mods.torch = importlib.import_module("torch")
    mods.lora = importlib.import_module("vllm.lora.request")
    mods.mm = importlib.import_module("vllm.multimodal.inputs")
    return mods


INT_EVENT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


@functools.cache
def _params(fn: Any) -> Mapping[str, inspect.Parameter]:
    # Memoised: the signatures are read for every request built, and inspect.signature
    # was a quarter of the oracle's time on this adapter.  Keys are vLLM's unbound
    # functions and classes, so the cache holds no manager alive.
    return MappingProxyType(dict(inspect.signature(fn).parameters))


def _config_default(cls: Any, name: str, fallback: Any) -> Any:
    """The default of a vLLM config field (dataclass in newer releases, __init__ in older)."""
    try:
        for field in dataclasses.fields(cls):
            if field.name == name:
                if field.default is not dataclasses.MISSING:
                    # A pydantic dataclass's ``Field(default=...)`` (0.30+ ``CacheConfig``) is
                    # the field's default, wrapped.
                    return getattr(field.default, "default", field.default)
                return fallback
        return fallback
    except TypeError:
        pass
    param = _params(cls.__init__).get(name)
    if param is None or param.default is inspect.Parameter.empty:
        return fallback
    return param.default


def _build(
    cls: Any, recorder: Recorder | None = None, prefix: str = "", *, across_releases: bool = False, **candidates: Any
) -> Any:
    """Construct a vLLM dataclass/class passing only the keyword arguments it accepts (through
    ``recorder`` when given: the call is written down as ``prefix<n> = cls(...)``, or with
    ``across_releases`` as ``cls(**accepted(cls, <every candidate>))``, which a file written on
    this release runs on others too).

    A required parameter no candidate supplies is an API change this adapter does not know:
    fail loudly rather than guess.
    """
    params = _params(cls.__init__) if inspect.isclass(cls) else _params(cls)
    kwargs = {k: v for k, v in candidates.items() if k in params}
    missing = [
        name
        for name, p in params.items()
        if name != "self"
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and name not in kwargs
    ]
    if missing:
        raise ConfigError(f"{cls.__name__} of this vLLM release needs {missing}; adapter unaware")
    if recorder is not None:
        offered = (harness_v1.accepted, candidates) if across_releases else None
        return recorder.construct(cls, kwargs, prefix, offered=offered)
    return cls(**kwargs)


def external_forms(h: Any) -> list[Any]:
    """The forms a KV event may carry for the release's block hash ``h``: the bytes, their
    low 64 bits as an int (0.11+), or the ``hash_value`` int (0.9-0.10 ``BlockHash``)."""
    forms = [h]
    if isinstance(h, bytes | bytearray):
        forms.append(int.from_bytes(h, byteorder="big") & ((1 << 64) - 1))
    value = getattr(h, "hash_value", None)
    if value is not None:
        forms.append(value)
    return forms


def learn_hash_keys(
    hashes: Sequence[Any],
    tokens: tuple[int, ...],
    extra: ExtraKeys,
    unit: int,
    keys: dict[Any, PrefixKey],
    external: dict[Any, PrefixKey],
    collisions: list[HashCollision],
    seq: int | None,
    owners: dict[Any, int],
) -> None:
    """Map the release's hash of every ``unit``-token block of ``tokens`` to its PrefixKey (the
    chain up to the block's end, in ``extra``'s domain) in ``keys``, and every form a KV event
    carries it in (``external_forms``) in ``external``; a hash that stands for two chains goes
    to ``collisions`` (the adapters report it under prefix-cache-consistency), with the
    sequence that first carried it (``owners``, filled here) and ``seq``, whose tokens these are."""
    for i, h in enumerate(hashes):
        end = (i + 1) * unit
        if end > len(tokens):
            break
        key = key_of(tokens, end, extra)
        old = keys.setdefault(h, key)
        if old is key:
            if seq is not None:
                owners[h] = seq
            for form in external_forms(h):
                external.setdefault(form, key)
        elif old != key:
            seqs = tuple(s for s in (owners.get(h), seq) if s is not None)
            collisions.append(HashCollision(h, old, key, seqs))


def spec_event(
    event: Any, external: Mapping[Any, PrefixKey], formats: Counter[str], vllm_version: str
) -> CacheEvent:
    """One KV event the release emitted, as the spec's ``CacheEvent``: ``AllBlocksCleared``, or
    a ``BlockStored`` / ``BlockRemoved`` of the keys its hashes stand for (through
    ``external``, filled by ``learn_hash_keys``); ``formats`` counts the hash forms seen.  A
    hash no request produced becomes a key that says so (not dropped): event-consistency
    then names it."""
    kind = type(event).__name__
    if kind == "AllBlocksCleared":
        return CacheEvent(EventKind.CLEARED)
    if kind not in ("BlockStored", "BlockRemoved"):
        raise RuntimeError(f"vLLM {vllm_version}: unknown KV event {kind}")
    keys = []
    for h in event.block_hashes:
        formats[type(h).__name__] += 1
        key = external.get(h)
        keys.append(key if key is not None else PrefixKey((), ("unknown event hash", h)))
    return CacheEvent(EventKind.STORED if kind == "BlockStored" else EventKind.REMOVED, tuple(keys))


class VLLMV1Adapter:
    """kvspec ``Implementation`` over vLLM V1's ``KVCacheManager`` (single KV cache group).

    Options beyond ``Config`` (each one a knob of the real engine config; defaults are the
    release's own defaults):

    use_eagle              EAGLE speculative decoding: the manager drops the last hit block
                           (``KVCacheManager(use_eagle=...)``; 0.33 passes
                           ``use_eagle_block_drop``, i.e. EAGLE with lookahead block hashes off).
    max_model_len          the model's context length (caps every allocation).
    max_in_flight_tokens   0.33+: the sliding-window admission cap's in-flight allowance.
    full_sequence_must_fit 0.33+: ``SchedulerConfig.scheduler_reserve_full_isl`` (default: the
                           release's default) -- the admission gate over the whole sequence.
    admit_lookahead        lookahead slots ``allocate_slots`` reserves at admission; default:
                           what this release's scheduler passes (0 up to the releases that
                           zero it while ``num_computed_tokens == 0``, else
                           ``config.max_lookahead``).
    hash_algo              ``CacheConfig.prefix_caching_hash_algo`` (default: the release's).
    int_event_hashes       KV events carry 64-bit int hashes (True) or the raw hash bytes
                           (False); default: int when the pool size is even, so a run covers
                           both (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, 0.33.0 default int).
    """

    # The last observation's block tables: unchanged tables are handed out again (table_view).
    _last_tables: Mapping[int, TableView] = MappingProxyType({})

    name = "vllm-v1"

    def __init__(
        self,
        config: Config,
        *,
        use_eagle: bool = False,
        max_model_len: int = 8192,
        max_in_flight_tokens: int | None = None,
        full_sequence_must_fit: bool | None = None,
        admit_lookahead: int | None = None,
        hash_algo: str | None = None,
        int_event_hashes: bool | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self.config = config
        self._rec = recorder
        self.int_event_hashes = (
            config.num_blocks % 2 == 0 if int_event_hashes is None else int_event_hashes
        )
        self._v = v = _load_vllm()
        self.vllm_version: str = v.version
        self.name = f"vllm-v1-{v.version}"
        B = config.block_size
        self._B = B

        self._alloc_params = _params(v.kcm.KVCacheManager.allocate_slots)
        ctor_params = _params(v.kcm.KVCacheManager.__init__)
        self._has_lookahead = "num_lookahead_tokens" in self._alloc_params

        if use_eagle and "use_eagle" not in ctor_params:
            raise ConfigError(f"vLLM {v.version}: KVCacheManager has no use_eagle")

        # ------------------------------------------------ KV cache config (one group)
        torch = v.torch
        spec_common = dict(block_size=B, num_kv_heads=1, head_size=64, dtype=torch.float16,
                           use_mla=False)
        if config.sliding_window is None:
            spec = _build(v.kci.FullAttentionSpec, **spec_common)
        else:
            if not hasattr(v.kci, "SlidingWindowSpec"):
                raise ConfigError(f"vLLM {v.version} has no SlidingWindowSpec")
            spec = _build(v.kci.SlidingWindowSpec, sliding_window=config.sliding_window,
                          **spec_common)
        group = _build(v.kci.KVCacheGroupSpec, layer_names=["model.layers.0.attn"],
                       kv_cache_spec=spec)
        # num_blocks counts vLLM's null block (block 0), which is not a pool block in the spec.
        kv_cache_config = _build(v.kci.KVCacheConfig, num_blocks=config.num_blocks + 1,
                                 tensors={}, kv_cache_tensors=[], kv_cache_groups=[group])

        # ------------------------------------------------ hashing
        if hash_algo is None:
            hash_algo = _config_default(v.config.CacheConfig, "prefix_caching_hash_algo",
                                        "builtin")
        self.hash_algo = hash_algo
        self._block_hasher = None
        if config.prefix_caching and hasattr(v.kcu, "get_request_block_hasher"):
            hash_fn = self._hash_fn_by_name(hash_algo)
            global _NONE_HASH_SEEDED
            if not _NONE_HASH_SEEDED and hasattr(v.kcu, "init_none_hash"):
                v.kcu.init_none_hash(hash_fn)
                _NONE_HASH_SEEDED = True
            if recorder is not None and hasattr(v.kcu, "init_none_hash"):
                recorder.note(v.kcu.init_none_hash, hash_fn)  # a fresh process seeds it too
            # Positional: the first parameter is ``block_size`` up to 0.20 and ``hash_block_size``
            # from 0.30 (kv_cache_utils.py:635 of 0.20.1, :812 of 0.30.0), one value either way,
            # so a reproducer written on one release builds the hasher on the other.
            hasher_args = (B, hash_fn)
            hasher = v.kcu.get_request_block_hasher
            self._block_hasher = (
                recorder.construct(hasher, {}, "hasher", hasher_args) if recorder is not None else hasher(*hasher_args)
            )

        # ------------------------------------------------ the manager, as the scheduler builds it
        # ``_manager`` is what the protocol calls (recorded when a recorder is given); ``_raw``
        # is what observation reads, never recorded.
        self._manager = _build(
            v.kcm.KVCacheManager,
            recorder,
            "mgr",
            across_releases=True,
            kv_cache_config=kv_cache_config,
            max_model_len=max_model_len,
            enable_caching=config.prefix_caching,
            caching_hash_algo=hash_algo,
            use_eagle=use_eagle,
            # As the engine runs with its default ``log_stats``: the usage ``observe`` reads
            # is what it exports (0.33.0 sched/scheduler.py:3294).
            log_stats=True,
            enable_kv_cache_events=self._emits_events(config),
            scheduler_block_size=B,
            hash_block_size=B,
            max_in_flight_tokens=max_in_flight_tokens,
            pcp_world_size=1,
        )
        self._raw = real(self._manager)
        self.max_model_len = max_model_len
        self.use_eagle = use_eagle
        self._count_allocations()

        if full_sequence_must_fit is None:
            full_sequence_must_fit = bool(
                _config_default(v.config.SchedulerConfig, "scheduler_reserve_full_isl", False)
            )
        self.full_sequence_must_fit = (
            full_sequence_must_fit and "full_sequence_must_fit" in self._alloc_params
        )
        if admit_lookahead is None:
            admit_lookahead = config.max_lookahead if self._scheduler_admits_lookahead() else 0
        self.admit_lookahead = admit_lookahead
        # What allocate_slots keeps back: the room the completeness invariants leave it.
        self.admission_policy = AdmissionPolicy(
            watermark_blocks=int(getattr(self._manager, "watermark_blocks", 0)),
            watermark_when_idle=False,
            full_sequence_must_fit=self.full_sequence_must_fit,
            hit_drops_last_block=use_eagle,
            window_hits_from_the_end=hasattr(
                importlib.import_module("vllm.v1.core.single_type_kv_cache_manager"),
                "SlidingWindowManager",
            ),
            window_retains_reachable_only=hasattr(
                importlib.import_module("vllm.v1.core.single_type_kv_cache_manager"),
                "SlidingWindowManager",
            )
            and hasattr(
                importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
                .SlidingWindowManager,
                "reachable_block_mask",
            ),
            sources=(
                ("watermark_blocks", "v1/core/kv_cache_manager.py:210,518-525 (0.33.0)"),
                ("watermark_when_idle", "v1/core/kv_cache_manager.py:520-525 (0.33.0)"),
                ("full_sequence_must_fit", "v1/core/kv_cache_manager.py:530-548 (0.33.0)"),
                ("hit_drops_last_block", "KVCacheManager(use_eagle=True)"),
                ("window_retains_reachable_only", "single_type_kv_cache_manager.py:1067-1145"),
                ("window_hits_from_the_end", "single_type_kv_cache_manager.py:509-580, 152-161 (0.20.1)"),
            ),
        )

        caps = {Capability.PREFIX_CACHING, Capability.CHUNKED_PREFILL,
                Capability.RESET_PREFIX_CACHE}
        if hasattr(v.kci, "SlidingWindowSpec"):
            caps.add(Capability.SLIDING_WINDOW)
        if self._has_lookahead:
            caps.add(Capability.LOOKAHEAD)
        caps |= self._extra_capabilities()
        if self._emits_events(config):
            caps.add(Capability.KV_EVENTS)
        self.capabilities = frozenset(caps)

        self._live: dict[int, Any] = {}  # seq_id -> running Request
        self._parked: dict[int, Any] = {}  # seq_id -> preempted / refused Request
        self._extra: dict[int, ExtraKeys] = {}
        self._pending: dict[int, int] = {}  # scheduled, not yet committed tokens
        self._keys: dict[Any, PrefixKey] = {}  # vLLM block hash -> PrefixKey
        self._external: dict[Any, PrefixKey] = {}  # a KV event's hash (either format) -> key
        self.hash_collisions: list[HashCollision] = []
        self._hash_owners: dict[Any, int] = {}  # a block hash -> the sequence that first carried it
        self._events: list[CacheEvent] = []
        self.event_hash_formats: Counter[str] = Counter()  # type name of event hashes seen
        self._lora_ids: dict[str, int] = {}
        self._ids = itertools.count()

    def _count_allocations(self) -> None:
        """Count how often the pool hands each block out (a block's content lives one epoch).

        Observation only: the wrapper calls the pool's own ``get_new_blocks`` and returns
        what it returns.  Without it a block freed and handed out again inside one
        ``allocate_slots`` (sliding-window rotation, eviction of a cached block) would look
        like the same block, and its new writes like overwrites.
        """
        self._epochs: Counter[int] = Counter()
        pool = self._raw.block_pool
        allocate = pool.get_new_blocks

        def counted(*args: Any, **kwargs: Any) -> Any:
            blocks = allocate(*args, **kwargs)
            for block in blocks:
                self._epochs[block.block_id] += 1
            return blocks

        pool.get_new_blocks = counted

    # ------------------------------------------------------------------ release probing

    def _hash_fn_by_name(self, name: str) -> Any:
        for mod in ("vllm.utils.hashing", "vllm.utils"):
            try:
                fn = getattr(importlib.import_module(mod), "get_hash_fn_by_name", None)
            except ImportError:
                continue
            if fn is not None:
                return fn(name)
        raise ConfigError(f"vLLM {self.vllm_version}: no get_hash_fn_by_name")

    def _scheduler_admits_lookahead(self) -> bool:
        """Whether this release's scheduler passes the lookahead to ``allocate_slots`` when it
        admits a waiting request.  Read off the scheduler source (not imported: it pulls in the
        whole engine): the admission call is the one passing ``new_computed_blocks``; 0.10.x
        passes ``effective_lookahead_tokens``, zero while ``num_computed_tokens == 0``; 0.33
        zeroes it only for a pending async KV load; 0.8.3 has no lookahead at all."""
        if not self._has_lookahead:
            return False
        spec = importlib.util.find_spec("vllm.v1.core.sched.scheduler")
        if spec is None or spec.origin is None:
            return False
        with open(spec.origin, encoding="utf-8") as f:
            src = f.read()
        for call in src.split("allocate_slots(")[1:]:
            call = call[: call.find("\n\n")]
            if "new_computed_blocks" not in call:
                continue
            if "num_lookahead_tokens=" not in call:
                return False
            value = call.split("num_lookahead_tokens=", 1)[1].split(",", 1)[0].strip()
            if value == "self.num_lookahead_tokens":
                return True
            start = src.find(f"{value} =")
            if start < 0:
                return False
            stmt = src[start : src.find("\n\n", start)]
            return "num_computed_tokens" not in stmt
        return False

    # ------------------------------------------------------------------ requests

    # ------------------------------------------------------------------ extra keys and events

    def _emits_events(self, config: Config) -> bool:
        """KV-cache events exist in this release (``BlockPool.take_events``) and mean something
        (prefix caching on: nothing is cached otherwise)."""
        return (
            config.prefix_caching
            and "enable_kv_cache_events" in _params(self._v.kcm.KVCacheManager.__init__)
            and hasattr(importlib.import_module("vllm.v1.core.block_pool").BlockPool, "take_events")
        )

    def _extra_capabilities(self) -> set[Capability]:
        """The kinds of extra key this release's ``Request`` takes."""
        params = _params(self._v.request.Request.__init__)
        caps = set()
        if "cache_salt" in params:
            caps.add(Capability.CACHE_SALT)
        if "lora_request" in params:
            caps.add(Capability.LORA)
        if "mm_features" in params or "multi_modal_hashes" in params:
            caps.add(Capability.MULTIMODAL)
        return caps

    def _lora_request(self, name: str) -> Any:
        """One ``LoRARequest`` per adapter name: a stable int id (>= 1) and path, so that every
        release's key (int id, or name and path) tells the adapters apart."""
        lora_id = self._lora_ids.setdefault(name, len(self._lora_ids) + 1)
        return self._v.lora.LoRARequest(
            lora_name=name, lora_int_id=lora_id, lora_path=f"/kvspec/lora/{name}"
        )

    def _mm_fields(self, extra: ExtraKeys, params: Mapping[str, Any]) -> dict[str, Any]:
        """The request's multimodal placements in this release's form (no encoder input: the
        block manager reads only identifiers and placements)."""
        if not extra.mm:
            return {}
        mm = self._v.mm
        ranges = [mm.PlaceholderRange(offset=f.offset, length=f.length) for f in extra.mm]
        if "mm_features" in params:
            spec_params = _params(mm.MultiModalFeatureSpec)
            features = []
            for f, where in zip(extra.mm, ranges, strict=True):
                fields = dict(
                    data=None, modality="image", identifier=f.identifier, mm_position=where
                )
                if "mm_hash" in spec_params:
                    fields["mm_hash"] = f.identifier
                features.append(mm.MultiModalFeatureSpec(**fields))
            return {"mm_features": features}
        if "multi_modal_hashes" in params:
            return {  # 0.9.x calls the per-item inputs multi_modal_inputs, 0.10.x _kwargs
                "multi_modal_inputs": [None] * len(ranges),
                "multi_modal_kwargs": [None] * len(ranges),
                "multi_modal_hashes": [f.identifier for f in extra.mm],
                "multi_modal_placeholders": ranges,
            }
        raise Unsupported(f"vLLM {self.vllm_version}: the Request takes no multimodal inputs")

    def _set_event_hash_format(self) -> None:
        # Read by maybe_convert_block_hash at every emission; several adapters may share a
        # process, so each sets its own before every operation that may emit.
        os.environ[INT_EVENT_HASHES_ENV] = "1" if self.int_event_hashes else "0"

    def _drain_events(self) -> None:
        """Translate what ``take_events`` hands the engine into spec events, in order."""
        if Capability.KV_EVENTS not in self.capabilities:
            return
        for event in self._raw.block_pool.take_events():
            self._events.append(
                spec_event(event, self._external, self.event_hash_formats, self.vllm_version)
            )

    # ------------------------------------------------------------------ requests

    def _new_request(self, seq_id: int, tokens: Sequence[int], extra: ExtraKeys) -> Any:
        v = self._v
        req_params = _params(v.request.Request.__init__)
        wanted = {
            Capability.CACHE_SALT: bool(extra.cache_salt),
            Capability.LORA: bool(extra.lora),
            Capability.MULTIMODAL: bool(extra.mm),
        }
        for cap, used in wanted.items():
            if used and cap not in self.capabilities:
                raise Unsupported(f"vLLM {self.vllm_version}: requests take no {cap.value}")
        sampling_args = {"max_tokens": self.max_model_len}
        if self._rec is not None:
            sampling = self._rec.construct(v.sampling.SamplingParams, sampling_args, "sampling")
        else:
            sampling = v.sampling.SamplingParams(**sampling_args)
        fields: dict[str, Any] = dict(
            multi_modal_inputs=None,
            multi_modal_kwargs=None,
            multi_modal_hashes=None,
            multi_modal_placeholders=None,
            mm_features=None,
        )
        fields.update(self._mm_fields(extra, req_params))
        return _build(
            v.request.Request,
            self._rec,
            "req",
            request_id=f"seq{seq_id}-{next(self._ids)}",
            prompt=None,
            prompt_token_ids=list(tokens),
            sampling_params=sampling,
            pooling_params=None,
            eos_token_id=None,
            arrival_time=0.0,
            lora_request=self._lora_request(extra.lora) if extra.lora else None,
            cache_salt=extra.cache_salt or None,
            block_hasher=self._block_hasher,
            **fields,
        )

    def requests(self) -> list[tuple[Any, ExtraKeys]]:
        """Every request the adapter holds (running, preempted or refused) with its domain."""
        held = [*self._live.items(), *self._parked.items()]
        return [(real(request), self._extra[seq_id]) for seq_id, request in held]

    def _finish(self, request: Any) -> None:
        """A parked request that will not come back: drop what the scheduler drops on finish."""
        if hasattr(self._manager, "free_block_hashes"):
            self._manager.free_block_hashes(request)

    def _learn_hashes(self, seq_id: int, request: Any) -> None:
        """Map the release's hash of every full block of the request to its PrefixKey."""
        hashes = getattr(request, "block_hashes", None)
        if not hashes and hasattr(self._raw, "req_to_block_hashes"):
            hashes = self._raw.req_to_block_hashes.get(real(request).request_id)
        if not hashes:
            return
        extra = self._extra.get(seq_id, as_extra(()))
        learn_hash_keys(
            hashes, tuple(request.all_token_ids), extra, self._B,
            self._keys, self._external, self.hash_collisions, seq_id, self._hash_owners,
        )

    def _group_blocks(self, request_id: str) -> list[Any]:
        m = self._raw
        if hasattr(m, "coordinator"):
            return list(m.coordinator.get_blocks(request_id)[0])
        if hasattr(m, "single_type_manager"):
            return list(m.single_type_manager.req_to_blocks.get(request_id, []))
        return list(m.req_to_blocks.get(request_id, []))

    def _drain_copies(self) -> list[BlockCopy]:
        m = self._manager
        if not hasattr(m, "take_kv_cache_block_copies"):
            return []
        copies, retained = m.take_kv_cache_block_copies()
        if retained:
            # No KV connector -> no deferred free: the scheduler frees them right away.
            m.block_pool.free_blocks(retained)
        return [(c.src_block_id, c.dst_block_id) for c in copies]

    def _alloc(self, request: Any, num_new: int, **kw: Any) -> Any:
        args = {k: val for k, val in kw.items() if k in self._alloc_params}
        try:
            return self._manager.allocate_slots(request, num_new, **args)
        except ValueError as err:
            # allocate_slots checked the free count and said yes, then BlockPool.get_new_blocks
            # ran out ("Cannot get N free blocks from the pool"): the check was unsound.
            if "free blocks" not in str(err):
                raise
            raise NoFreeBlocks(f"vLLM V1 allocate_slots: {err}") from err

    def _scheduled(self, seq_id: int, request: Any, num_new: int) -> None:
        """``_update_after_schedule``: the scheduled tokens count as computed at once."""
        request.num_computed_tokens += num_new
        if hasattr(request, "num_in_flight_tokens"):
            request.num_in_flight_tokens += num_new
        self._pending[seq_id] = self._pending.get(seq_id, 0) + num_new

    # ------------------------------------------------------------------ Implementation

    def can_admit(
        self, seq_id: int, tokens: Sequence[int], num_new_tokens: int, extra: tuple = ()
    ) -> Admission:
        raise Unsupported("vLLM V1 has no admission check separate from allocate_slots")

    def admit(
        self, seq_id: int, tokens: Sequence[int], num_new_tokens: int, extra: tuple = ()
    ) -> int:
        if seq_id in self._live:
            raise ValueError(f"seq {seq_id} is already running")
        if not tokens or num_new_tokens < 1:
            raise ValueError("admit needs tokens and num_new_tokens >= 1")
        v = self._v
        extra = as_extra(extra)
        self._set_event_hash_format()
        request = self._parked.pop(seq_id, None)
        if request is not None and (
            tuple(request.all_token_ids) != tuple(tokens) or self._extra.get(seq_id) != extra
        ):
            self._finish(request)
            request = None
        if request is None:
            self._extra[seq_id] = extra
            request = self._new_request(seq_id, tokens, extra)
        self._learn_hashes(seq_id, request)

        computed = self._manager.get_computed_blocks(request)
        blocks, hit = computed[0], computed[1]
        if len(computed) > 2 and hasattr(request, "shared_prefix_boundary"):
            request.shared_prefix_boundary = computed[2]
        self._learn_hashes(seq_id, request)

        num_new = min(num_new_tokens, len(tokens) - hit)
        kw: dict[str, Any] = dict(
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=self.admit_lookahead,
            has_scheduled_reqs=bool(self._live),
        )
        if self.full_sequence_must_fit:
            kw["full_sequence_must_fit"] = True
        new_blocks = self._alloc(request, num_new, **kw)
        if new_blocks is None:
            self._parked[seq_id] = request
            raise NotAdmitted(
                f"vLLM V1 allocate_slots refused seq {seq_id}: {num_new} new tokens after a "
                f"{hit}-token hit"
            )
        request.status = v.request.RequestStatus.RUNNING
        request.num_computed_tokens = hit
        self._scheduled(seq_id, request, num_new)
        self._live[seq_id] = request
        self._learn_hashes(seq_id, request)
        copies = self._drain_copies()
        if copies:
            # Only sub-block (fine-grained) hits copy-on-write at admission; block-aligned
            # hashing (hash_block_size == block_size) never does.
            raise RuntimeError(f"unexpected block copies at admission: {copies}")
        return hit

    def reserve(self, seq_id: int, num_new_tokens: int, lookahead: int = 0) -> list[BlockCopy]:
        request = self._live.get(seq_id)
        if request is None:
            raise ValueError(f"seq {seq_id} is not running")
        if num_new_tokens < 1:
            raise ValueError("reserve needs num_new_tokens >= 1")
        if lookahead and not self._has_lookahead:
            raise Unsupported(f"vLLM {self.vllm_version}: no lookahead slots")
        self._set_event_hash_format()
        new_blocks = self._alloc(request, num_new_tokens, num_lookahead_tokens=lookahead)
        if new_blocks is None:
            raise NotAdmitted(
                f"vLLM V1 allocate_slots refused {num_new_tokens}+{lookahead} slots for seq "
                f"{seq_id}"
            )
        self._scheduled(seq_id, request, num_new_tokens)
        self._learn_hashes(seq_id, request)
        return self._drain_copies()

    def commit(self, seq_id: int, num_tokens: int) -> None:
        request = self._live.get(seq_id)
        if request is None:
            raise ValueError(f"seq {seq_id} is not running")
        pending = self._pending.get(seq_id, 0)
        if num_tokens > pending:
            raise ValueError(f"seq {seq_id}: commit {num_tokens} > {pending} scheduled tokens")
        self._pending[seq_id] = pending - num_tokens
        if hasattr(request, "num_in_flight_tokens"):
            request.num_in_flight_tokens -= num_tokens

    def append_token(self, seq_id: int, token: int) -> None:
        request = self._live.get(seq_id)
        if request is None:
            raise ValueError(f"seq {seq_id} is not running")
        request.append_output_token_ids(token)
        self._learn_hashes(seq_id, request)

    def fork(self, parent_id: int, child_id: int) -> None:
        raise Unsupported("vLLM V1 has no fork (parallel sampling shares via the prefix cache)")

    def free(self, seq_id: int) -> None:
        request = self._live.pop(seq_id, None)
        if request is None:
            raise ValueError(f"seq {seq_id} is not running")
        self._manager.free(request)
        # _preempt_request: back to waiting, recomputed from scratch when resumed.
        request.status = self._v.request.RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if hasattr(request, "num_in_flight_tokens"):
            # update_from_output drains the in-flight share of a preempted request; no
            # update comes for it here, so drain it now.
            request.num_in_flight_tokens = 0
        if hasattr(request, "num_preemptions"):
            request.num_preemptions += 1
        if getattr(request, "spec_token_ids", None):
            request.spec_token_ids = []
        self._pending.pop(seq_id, None)
        self._parked[seq_id] = request

    def swap_out(self, seq_id: int) -> list[BlockCopy]:
        raise Unsupported("vLLM V1 preempts by recompute only (no swap)")

    def swap_in(self, seq_id: int) -> list[BlockCopy]:
        raise Unsupported("vLLM V1 preempts by recompute only (no swap)")

    def reset_prefix_cache(self) -> bool:
        self._set_event_hash_format()
        return bool(self._manager.reset_prefix_cache())

    def observe(self) -> KVState:
        self._drain_events()
        pool = self._raw.block_pool
        null = pool.null_block
        blocks = [b for b in pool.blocks if b is not null]
        ids = tuple(b.block_id for b in blocks)
        refcounts = {b.block_id: b.ref_cnt for b in blocks}
        queue = self._free_queue(pool)
        free = tuple(b.block_id for b in queue if b.block_hash is None)
        evictable = tuple(b.block_id for b in queue if b.block_hash is not None)
        cached = []
        for vkey, block in self._cache_entries(pool):
            h = self._strip_group(vkey)
            key = self._keys.get(h)
            if key is None:
                raise RuntimeError(
                    f"block {block.block_id} is cached under a hash no request of this adapter "
                    f"produced ({h!r})"
                )
            cached.append((key, block.block_id))
        computed = frozenset(b for _, b in cached)
        tables = {}
        for seq_id, request in self._live.items():
            slots = tuple(
                None if (b is null or getattr(b, "is_null", False)) else b.block_id
                for b in self._group_blocks(request.request_id)
            )
            tables[seq_id] = table_view(self._last_tables, seq_id, Device.GPU, slots)
        self._last_tables = tables
        gpu = PoolView(
            ids=ids,
            refcounts=refcounts,
            free=free,
            evictable=evictable,
            cached=tuple(cached),
            computed=computed,
            epochs={b: self._epochs[b] for b in ids},
            events=tuple(self._events) if Capability.KV_EVENTS in self.capabilities else None,
            usage=getattr(self._raw, "usage", None),
        )
        return KVState(gpu=gpu, tables=tables, cpu=None)

    # ------------------------------------------------------------------ observation helpers

    @staticmethod
    def _free_queue(pool: Any) -> list[Any]:
        queue = pool.free_block_queue
        if hasattr(queue, "get_all_free_blocks"):
            return list(queue.get_all_free_blocks())
        out, block = [], queue.free_list_head  # 0.8.x: no sentinels
        while block is not None:
            out.append(block)
            block = block.next_free_block
        return out

    @staticmethod
    def _cache_entries(pool: Any) -> list[tuple[Any, Any]]:
        table = pool.cached_block_hash_to_block
        raw = getattr(table, "_cache", table)  # BlockHashToBlockMap (newer) or a dict
        out = []
        for vkey, entry in raw.items():
            if isinstance(entry, dict):
                out.extend((vkey, b) for b in entry.values())
            else:
                out.append((vkey, entry))
        return out

    def _strip_group(self, vkey: Any) -> Any:
        kcu = self._v.kcu
        if hasattr(kcu, "get_block_hash") and isinstance(vkey, bytes | bytearray):
            return kcu.get_block_hash(vkey)  # 0.11+: hash bytes + 4-byte group id
        if hasattr(vkey, "group_id") and hasattr(vkey, "block_hash"):
            return vkey.block_hash  # 0.9-0.10: BlockHashWithGroupId(block_hash, group_id)
        return vkey  # 0.8: the block hash itself


def make_v1(config: Config, **kwargs: Any) -> VLLMV1Adapter:
    """Factory for the machines: ``KVCacheMachine(functools.partial(make_v1, use_eagle=True))``."""
    return VLLMV1Adapter(config, **kwargs)


__all__ = ["VLLMV1Adapter", "make_v1"]
