"""The one interface every implementation answers: the reference, and each vLLM adapter.

The operations are the scheduler's, in the order vLLM's schedulers call them:

* ``can_admit`` then ``admit``: admission of a sequence whose first step computes
  ``num_new_tokens`` tokens (legacy ``can_allocate``/``allocate``; V1 ``get_computed_blocks``
  then ``allocate_slots``).  ``admit`` returns the number of leading tokens the prefix cache
  already holds (they count as computed).  ``extra`` is the sequence's domain
  (``spec.prefix_hash.ExtraKeys``: cache salt, LoRA adapter, multimodal features; ``()`` is
  the plain domain).  The first step's slots may be followed by the run's lookahead slots or
  not: an implementation declares how many in ``admit_lookahead`` (undeclared: the run's,
  ``Config.max_lookahead``).  vLLM's V1 scheduler reserves them at admission in 0.33.0
  (vllm/v1/core/sched/scheduler.py:1403-1406, zero only for a pending KV load) and none in
  0.12.0 (:556-558) and 0.20.1 (:728-730), whose ``effective_lookahead_tokens`` is 0 while
  ``num_computed_tokens == 0``; every invariant holds either way, and the next ``reserve``
  asks for them.
* ``reserve``: slots for the next ``num_new_tokens`` tokens plus ``lookahead`` speculative
  slots (legacy ``can_append_slots``/``append_slots``, V1 ``allocate_slots``).  It returns the
  block copies the worker must perform first (copy-on-write).
* ``commit``: the worker computed those tokens (``update_num_computed_tokens`` /
  ``num_computed_tokens +=``; legacy prefix caching marks blocks computed here).
* ``append_token``: the sampler produced a token.
* ``fork``, ``free``, ``swap_out``, ``swap_in``, ``reset_prefix_cache``.

Operations an implementation lacks are declared in ``capabilities`` and raise ``Unsupported``.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol, runtime_checkable

from .config import Config
from .state import KVState


class Admission(StrEnum):
    OK = "ok"  # admit now; the allocation that follows must succeed
    LATER = "later"  # not now (pool busy, watermark); nothing changed
    NEVER = "never"  # cannot fit even in an empty pool


class Capability(StrEnum):
    PREFIX_CACHING = "prefix_caching"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_PREFILL = "chunked_prefill"
    LOOKAHEAD = "lookahead"
    FORK = "fork"
    SWAP = "swap"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    ADMISSION_CHECK = "admission_check"  # a separate can_admit answer (legacy); V1 has none
    # Extra keys the implementation keys its prefix cache by (``spec.prefix_hash.ExtraKeys``);
    # the machines draw only the kinds an implementation declares.
    CACHE_SALT = "cache_salt"
    LORA = "lora"
    MULTIMODAL = "multimodal"
    KV_EVENTS = "kv_events"  # the pool reports its KV-cache event stream (PoolView.events)


BlockCopy = tuple[int, int]


@runtime_checkable
class Implementation(Protocol):
    """A block manager under the spec's contract."""

    name: str
    config: Config
    capabilities: frozenset[Capability]

    def can_admit(
        self, seq_id: int, tokens: Sequence[int], num_new_tokens: int, extra: tuple = ()
    ) -> Admission: ...

    def admit(
        self, seq_id: int, tokens: Sequence[int], num_new_tokens: int, extra: tuple = ()
    ) -> int:
        """Allocate for the first step; return the number of prefix-cache-hit tokens.

        Raises ``NotAdmitted``/``NoFreeBlocks`` (a ``Rejected``) with the state unchanged.
        """
        ...

    def reserve(self, seq_id: int, num_new_tokens: int, lookahead: int = 0) -> list[BlockCopy]:
        """Slots for the next tokens; raises ``NotAdmitted`` (state unchanged) when they do not fit."""
        ...

    def commit(self, seq_id: int, num_tokens: int) -> None: ...

    def append_token(self, seq_id: int, token: int) -> None: ...

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def free(self, seq_id: int) -> None: ...

    def swap_out(self, seq_id: int) -> list[BlockCopy]: ...

    def swap_in(self, seq_id: int) -> list[BlockCopy]: ...

    def reset_prefix_cache(self) -> bool: ...

    def observe(self) -> KVState:
        """The abstract state (see ``kvspec.spec.state``)."""
        ...
