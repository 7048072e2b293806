"""The prefix cache as tenants and routers see it, observed under vLLM's own V1 scheduler.

``adapters/v1_scheduler.py`` builds the release's ``Scheduler``; this module gives its
requests their domains and collects the KV-cache event stream, the way ``adapters/v1.py``
does for the bare ``KVCacheManager`` (whose request-domain helpers it reuses: one home for how
a release takes salts, adapters and images).

Domains: ``cache_salt``, ``lora_request`` and multimodal placements go into the ``Request`` in
the form the release takes (``VLLMV1Adapter._mm_fields`` / ``_lora_request``).  Multimodal
placements only where the scheduler can compute them (``kinds_for``): a multimodal request
makes the scheduler schedule its encoder inputs (``_try_schedule_encoder_inputs``, 0.33.0
vllm/v1/core/sched/scheduler.py:2045), and the offline tiny model is text-only, so the encoder
budget is 0 (``supports_multimodal_inputs`` False, scheduler.py:266-281) and such a request
would never be computed past its first placeholder -- a request the engine's input processor
refuses for a text-only model.  A budget needs the model's HF processor
(``MultiModalBudget``, vllm/multimodal/encoder_budget.py), which offline there is none of.
Multimodal domains are driven on the bare ``KVCacheManager`` (adapters/v1.py).

Events: with prefix caching, on a release whose events name their KV-cache group
(``BlockStored.group_idx``, 0.33.0), the scheduler is built with
``KVEventsConfig(enable_kv_cache_events=True, publisher="null")`` (scheduler.py:148-151; the
null publisher binds no socket).  The scheduler drains ``KVCacheManager.take_events`` itself
after every step (``update_from_output``, scheduler.py:2623) and hands the batch to its
publisher; the adapter records what each ``take_events`` call returns, unchanged (observation
only, as the allocation counter), and drains the rest after every call, as the engine would
after the step.  Each event's hashes are translated back to ``PrefixKey``s and filed under its
``group_idx``, so ``event-consistency`` replays one stream per group.  Both external hash
formats are drawn (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, by the pool size's parity).
Earlier releases' events name no group (and 0.10.1.1-0.12.0 crash with events on a sliding
window, FINDINGS F-KV2): their scheduler runs collect none, and ``event-consistency`` says
nothing there.

Partial tails (0.33.0): with ``hash_block_size`` below the full-attention block size (the
hybrid shapes whose sliding-window group has smaller blocks), ``FullAttentionManager.cache_blocks``
registers the prompt's last hash boundary inside a block as a partial entry
(``_cache_partial_tail_block``, single_type_kv_cache_manager.py:840-897;
``BlockPool.cache_partial_block``, block_pool.py:486-603).  Without fine-grained hits (a Mamba
"align" group, ``partial_hash_hits_enabled``, kv_cache_utils.py:762-801) the hybrid
coordinator rounds the cacheable tokens down to the scheduler block size
(``_align_cacheable``, kv_cache_coordinator.py:777-787), so the entry is registered once the
block is already full, beside its full hash; it is retired with the block's other hashes on
eviction (``_maybe_evict_cached_block`` -> ``_remove_cached_block_hashes``, block_pool.py:769,
630-664).  The observation lists it like any other entry of the group (``GroupState.cached``).
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvspec.spec.errors import ConfigError, Unsupported
from kvspec.spec.events import CacheEvent, EventKind
from kvspec.spec.interface import Capability
from kvspec.spec.prefix_hash import ExtraKeys, HashCollision, PrefixKey

from .v1 import INT_EVENT_HASHES_ENV, VLLMV1Adapter, _params, learn_hash_keys, spec_event

# The kinds of extra key a request may carry (testing/blockmanager/strategies.py EXTRA_KINDS), by capability.
EXTRA_KIND_OF = {
    Capability.CACHE_SALT: "cache_salt",
    Capability.LORA: "lora",
    Capability.MULTIMODAL: "mm",
}


def events_name_groups() -> bool:
    """Whether the release's KV events say which KV-cache group they are about
    (``BlockStored.group_idx``, 0.33.0 vllm/distributed/kv_events.py:82)."""
    try:
        kv_events = importlib.import_module("vllm.distributed.kv_events")
    except ImportError:
        return False
    return "group_idx" in getattr(kv_events.BlockStored, "__struct_fields__", ())


class SchedulerCacheView:
    """Request domains, block-hash keys and the per-group KV event stream of one scheduler."""

    # The V1 adapter's helpers read only ``_v``, ``vllm_version`` and ``_lora_ids``.
    _extra_capabilities = VLLMV1Adapter._extra_capabilities
    _lora_request = VLLMV1Adapter._lora_request
    _mm_fields = VLLMV1Adapter._mm_fields

    def __init__(self, v: Any, *, prefix_caching: bool, num_groups: int) -> None:
        self._v = v
        self.vllm_version: str = v.version
        self._lora_ids: dict[str, int] = {}
        self.emits_events = prefix_caching and events_name_groups()
        self.int_event_hashes = True  # the adapter sets it from the pool size (both formats drawn)
        self.extra_kinds = frozenset(EXTRA_KIND_OF[c] for c in self._extra_capabilities())
        self.keys: dict[Any, PrefixKey] = {}  # the release's block hash -> its PrefixKey
        self.hash_collisions: list[HashCollision] = []
        self._owners: dict[Any, int] = {}  # a block hash -> the sequence that first carried it
        self._external: dict[Any, PrefixKey] = {}  # a KV event's hash (either format) -> key
        self._raw: list[Any] = []  # what take_events returned, not yet translated
        self._events: list[list[CacheEvent]] = [[] for _ in range(num_groups)]
        self.event_hash_formats: Counter[str] = Counter()

    # ------------------------------------------------------------ construction

    def config_fields(self, make: Callable[..., Any] | None = None) -> dict[str, Any]:
        """The ``VllmConfig`` arguments that turn the event stream on (none when it is off);
        ``make(cls, prefix, **kwargs)`` constructs (the adapter's, which may record it)."""
        if not self.emits_events:
            return {}
        cls = self._v.config.KVEventsConfig
        kwargs = {"enable_kv_cache_events": True, "publisher": "null"}
        cfg = make(cls, "kv_events_config", **kwargs) if make is not None else cls(**kwargs)
        return {"kv_events_config": cfg}

    def watch(self, manager: Any) -> None:
        """Record every batch ``manager.take_events`` hands out (to the scheduler or to us)."""
        if not self.emits_events:
            return
        take: Callable[[], Any] = manager.take_events
        raw = self._raw

        def recorded() -> Any:
            events = take()
            raw.extend(events or ())
            return events

        manager.take_events = recorded

    def set_hash_format(self) -> None:
        # Read by maybe_convert_block_hash at every emission; several adapters may share a
        # process, so each sets its own before every call that may emit.
        if self.emits_events:
            os.environ[INT_EVENT_HASHES_ENV] = "1" if self.int_event_hashes else "0"

    def kinds_for(self, scheduler: Any) -> frozenset[str]:
        """The kinds of extra key requests may carry under ``scheduler``: multimodal only with
        an encoder budget to compute the placements (``max_num_encoder_input_tokens``)."""
        if getattr(scheduler, "max_num_encoder_input_tokens", 0) > 0:
            return self.extra_kinds
        return self.extra_kinds - {"mm"}

    # ------------------------------------------------------------ requests

    def request_fields(self, extra: ExtraKeys) -> dict[str, Any]:
        """The ``Request`` arguments that carry ``extra`` in this release's form."""
        if extra and not extra.kinds() <= self.extra_kinds:
            raise Unsupported(f"vLLM {self.vllm_version}: requests take no {sorted(extra.kinds() - self.extra_kinds)}")
        fields: dict[str, Any] = dict(
            mm_features=None,
            multi_modal_kwargs=None,  # before 0.11
            multi_modal_inputs=None,  # before 0.10
            multi_modal_hashes=None,
            multi_modal_placeholders=None,
            lora_request=self._lora_request(extra.lora) if extra.lora else None,
            cache_salt=extra.cache_salt or None,
        )
        fields.update(self._mm_fields(extra, _params(self._v.request.Request.__init__)))
        return fields

    def learn(
        self, hashes: Any, tokens: tuple[int, ...], extra: ExtraKeys, hash_block_size: int, seq: int | None
    ) -> None:
        """Map the release's hash of every hash block of sequence ``seq`` to its PrefixKey (the
        token chain up to the block's end, in the request's domain) and each external form
        events carry."""
        learn_hash_keys(
            hashes, tokens, extra, hash_block_size, self.keys, self._external, self.hash_collisions, seq, self._owners
        )

    # ------------------------------------------------------------ events

    def drain(self, manager: Any) -> None:
        """Take what is queued (through the recorder) and translate every recorded event."""
        if not self.emits_events:
            return
        manager.take_events()
        raw, self._raw[:] = list(self._raw), []
        for event in raw:
            translated = spec_event(event, self._external, self.event_hash_formats, self.vllm_version)
            if translated.kind is EventKind.CLEARED:
                for stream in self._events:
                    stream.append(translated)
                continue
            group = event.group_idx
            if group is None or not 0 <= group < len(self._events):
                raise ConfigError(
                    f"vLLM {self.vllm_version}: a {type(event).__name__} event names group {group!r}"
                )
            self._events[group].append(translated)

    def group_events(self, group: int) -> tuple[CacheEvent, ...] | None:
        return tuple(self._events[group]) if self.emits_events else None

    @property
    def events_seen(self) -> int:
        return sum(len(s) for s in self._events)


__all__ = ["SchedulerCacheView", "events_name_groups"]
