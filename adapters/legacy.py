"""Adapters over vLLM's legacy (V0) block managers, driven as the legacy scheduler drives them.

Targets: ``BlockSpaceManagerV1`` (vllm/core/block_manager_v1.py, cyclic sliding-window block
reuse, releases up to 0.6.3), ``BlockSpaceManagerV2`` (vllm/core/block_manager_v2.py, up to
0.6.3) and its rename ``SelfAttnBlockSpaceManager`` (vllm/core/block_manager.py, 0.6.3.post1
until the V0 engine was removed).  Everything release-specific is detected by import
availability and ``inspect.signature``, never by version numbers.

The protocol, as vllm/core/scheduler.py of 0.6.3 runs it (line numbers from that file unless
another release is named):

* manager class: ``BlockSpaceManager.get_block_space_manager_class(version)`` (scheduler.py:315-
  337; "v1"/"v2" up to 0.6.3, "selfattn" from 0.6.3.post1), built with block_size,
  num_gpu_blocks, num_cpu_blocks, sliding_window, enable_caching and the default watermark
  (0.01: ``watermark_blocks = int(0.01 * N)``, i.e. 0 below 100 blocks).  The watermark is a
  spec freedom; this adapter keeps the release default unless told otherwise.  The prefix
  caching + sliding window pair is put to the release's own ``CacheConfig`` (config.py:644-651
  rejects it) and refused with ``ConfigError`` when it rejects it.
* admission (``_schedule_prefills``): ``can_allocate(seq_group, num_lookahead_slots=0)``
  (scheduler.py:911; lookahead only in multi-step chunked prefill) -> OK / LATER / NEVER; then
  ``_allocate_and_set_running`` (950, 1413-1416): ``allocate(seq_group)`` takes blocks for
  EVERY prompt token, whole or chunked prefill alike; status -> RUNNING.  From 0.6.4 on, with
  prefix caching, ``get_num_cached_tokens(seq)`` comes first (0.10.1.1 scheduler.py:1926) and
  a refusal drops the tracker entry (``remove_seq_from_computed_blocks_tracker``, 1109-1125).
* per scheduled group, in ``schedule()`` (1257-1268): ``get_block_table``,
  ``access_all_blocks_in_seq(seq, now)`` (a logical clock stands in for ``time.time()``) and,
  with prefix caching, ``get_common_computed_block_ids(running seqs)``.  The hit ``admit``
  returns is what the release skips: up to 0.6.3 the worker skips those blocks
  (worker/model_runner.py:505-559, not with a sliding window); from 0.6.4 the scheduler counts
  ``get_num_cached_tokens`` as scheduled, and a fully cached prompt still computes its last
  token (0.10.1.1 scheduler.py:1955-1959), so that hit can be ``len - 1``.  The legacy first
  chunk counts from position 0: the driver's first step ``[hit, hit + k)`` is the legacy chunk
  ``hit + k``, and ``commit`` accounts it that way.
* end of ``schedule()`` (1341-1343): ``mark_blocks_as_computed(seq_group, token_chunk_size)``.
  vLLM calls it before the worker runs, relying on a synchronous engine (no lookup happens
  before the batch executes).  The driver observes between scheduling and execution, so the
  adapter calls it in ``commit`` -- the same order relative to every other block-manager call
  -- then ``update_num_computed_tokens`` (llm_engine.py:1098).  For a multi-sequence group
  BlockSpaceManagerV1 gets its per-sequence body ``compute_full_blocks_in_seq`` instead: the
  scheduler marks a group once per step, the driver commits its members one by one.
* running groups: ``can_append_slots(seq_group, num_lookahead_slots)`` (565) false -> preempt
  (here ``NotAdmitted``); else ``_append_slots`` (615, 1418-1453): ``append_slots(seq,
  num_lookahead_slots)``, returning copy-on-write pairs.  Lookahead is 0 for prefill chunks
  (``_get_num_lookahead_slots``, 1561-1588).  The check is per group; ``reserve`` asks it for
  the sequence's group (conservative when siblings were already served this step).
* preemption by recompute (1501-1510): status WAITING, ``free(seq)``,
  ``seq.reset_state_for_recompute()``; the same Sequence is re-admitted later with all its
  tokens.  A sequence freed while siblings live is finished instead (FINISHED_STOPPED, then
  ``free``, as output_processor/single_step.py does), and re-admitting it builds a fresh group.
* swapping (1529-1543; ``_schedule_swapped`` 687-732): ``can_swap_out(group)`` false -> the
  scheduler aborts (here ``NotAdmitted``); ``swap_out(group)``, status SWAPPED.
  ``can_swap_in(group, lookahead)`` != OK -> not now (``NotAdmitted``); ``swap_in(group)``,
  status RUNNING, and ``_append_slots`` follows WITHOUT a ``can_append_slots`` check (731-732):
  the first ``reserve`` after a swap-in skips the check likewise.  Legacy swaps whole groups:
  swapping one member of a group with several live sequences is refused (``NotAdmitted``).
* fork (output_processor/single_step.py:173-205, after sampling only): ``child =
  parent.fork(id)``, ``seq_group.add(child)``, ``scheduler.fork_seq(parent, child)``.  Releases
  without ``SequenceGroup.add`` (0.6.4 on; n > 1 became separate requests) never fork: no FORK.
  A fork of a sequence still in prefill is refused (``Unsupported``): vLLM never does it.

Failures: an allocation that raises vLLM's out-of-blocks error
(``BlockAllocator.NoFreeBlocksError``; V1's ``ValueError("Out of memory! ...")`` or
``ValueError("No usable cache memory left")``) is re-raised as ``NoFreeBlocks``; the state is
left exactly as vLLM leaves it (no roll-back).  Any other exception from vLLM (assertions,
double frees) propagates unchanged: it is a crash.

Observation reads private attributes, read-only: V2 ``CpuGpuBlockAllocator._allocators``,
``_null_block``, ``RefCounter._refcounts``, ``NaiveBlockAllocator._free_block_indices``,
``PrefixCachingBlockAllocator._cached_blocks/_hashless_allocator/evictor.free_table`` and
``block_is_computed``; V1 ``PhysicalTokenBlock`` objects, ``UncachedBlockAllocator.free_blocks``,
``CachedBlockAllocator.cached_blocks/evictor.free_table/current_num_blocks``; and it calls the
manager's public ``get_prefix_cache_hit_rate`` per device, as the engine's stats do every step.

Mapping choices:

* V2's null block (``allocate_or_get_null_block``, core/block/cpu_gpu_block_allocator.py:113)
  is carved lazily out of the GPU pool on the first sliding-window append; it is not a pool
  block, so once it exists it leaves ``ids`` (the pool shrinks by one) and table slots holding
  it read ``None``.
* CPU block ids are device-relative (what ``swap_out``/``swap_in`` return).
* Prefix keys: a dict from the release's own block hashes to ``PrefixKey``, filled by hashing
  every token sequence the adapter is given (V2: ``PrefixCachingBlock.hash_block_tokens``
  chain; V1: ``Sequence.hash_of_block``).  V1 also registers the partial last block of a
  prompt under the hash of its partial prefix (block_manager_v1.py:332-335): those entries are
  reported with their partial chain (a partial key).  V1's placeholder hashes for unfilled
  blocks (a counter, block_manager_v1.py:114-115) are not content: such blocks count as free
  when unreferenced.
* V1 sliding window: vLLM keeps a logical-length table whose entry i is physical block
  ``i % ceil(W / B)`` (block_manager_v1.py:326-331, 465-469).  ``v1_window_slots="tail"``
  (default) reports the last ``ceil(W/B)`` logical slots and ``None`` before them;
  ``"cyclic"`` reports every logical slot (the aliasing the worker really uses, at the price
  of counting a block once per alias).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvspec.spec.admission import AdmissionPolicy
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError, NoFreeBlocks, NotAdmitted, Unsupported
from kvspec.spec.interface import Admission, BlockCopy, Capability
from kvspec.spec.state import KVState

from .harness import legacy as harness
from .legacy_observers import BlockSpaceV1Observer, BlockSpaceV2Observer, LegacyObserver
from .recording import Recorder, real

# vLLM is imported lazily (inside functions) so that importing kvspec.adapters never needs it.

MANAGERS = tuple(harness.VERSION_STRINGS)


# ---------------------------------------------------------------- release detection


_params = harness.params
_kw = harness.accepted


def manager_class(manager: str):
    """The legacy block-manager class the release's scheduler would build for ``manager``."""
    if manager not in MANAGERS:
        raise ValueError(f"manager must be one of {MANAGERS}, got {manager!r}")
    # A vLLM that does not import at all is an import failure, not a missing manager.
    import vllm.core.interfaces  # noqa: F401

    try:
        return harness.manager_class(manager)
    except (ValueError, ImportError) as err:
        raise Unsupported(
            f"this vLLM release has no {manager!r} legacy block manager: {err}"
        ) from err


def available_managers() -> list[str]:
    out = []
    for m in MANAGERS:
        try:
            manager_class(m)
        except Unsupported:
            continue
        out.append(m)
    return out


def default_manager() -> str:
    """The manager the release's engine picks by default (EngineArgs.use_v2_block_manager)."""
    avail = available_managers()
    if "self_attn" in avail:
        return "self_attn"
    try:
        from vllm.engine.arg_utils import EngineArgs

        if not getattr(EngineArgs, "use_v2_block_manager", True) and "v1" in avail:
            return "v1"
    except ImportError:
        pass
    return "v2" if "v2" in avail else avail[0]


def _release_rejects_caching_with_window(config: Config) -> str | None:
    """Ask the release's own CacheConfig whether it accepts this cache configuration."""
    if not (config.prefix_caching and config.sliding_window is not None):
        return None
    try:
        from vllm.config import CacheConfig
    except ImportError:
        return None
    kwargs = _kw(
        CacheConfig.__init__,
        block_size=config.block_size,
        gpu_memory_utilization=0.9,
        swap_space=0,
        cache_dtype="auto",
        sliding_window=config.sliding_window,
        enable_prefix_caching=True,
    )
    try:
        CacheConfig(**kwargs)
    except (NotImplementedError, ValueError) as err:
        return str(err)
    except TypeError:
        return None
    return None


# ---------------------------------------------------------------- sequences


class _Vllm:
    """The handful of vLLM names the adapter uses, resolved once per release."""

    def __init__(self, recorder: Recorder | None = None) -> None:
        from vllm import sequence as vseq
        from vllm.core.interfaces import AllocStatus
        from vllm.utils import Device as VDevice

        self.recorder = recorder
        self.SequenceGroup = vseq.SequenceGroup
        self.SequenceStatus = vseq.SequenceStatus
        self.AllocStatus = AllocStatus
        self.Device = VDevice

    def construct(self, call: harness.Call, prefix: str) -> Any:
        cls, kwargs = call
        if self.recorder is not None:
            return self.recorder.construct(cls, kwargs, prefix)
        return cls(**kwargs)

    def make_sequence(self, seq_id: int, tokens: Sequence[int], block_size: int):
        return self.construct(harness.sequence_call(seq_id, tokens, block_size), "s")

    def make_group(self, request_id: str, seqs: list, arrival: float):
        return self.construct(harness.group_call(request_id, seqs, arrival), "g")

    def append_token(self, seq, token: int) -> None:
        seq.append_token_id(token, harness.token_logprobs(token))

    def is_out_of_blocks(self, err: BaseException) -> bool:
        return harness.is_out_of_blocks(err)


_copies = harness.block_copies


# ---------------------------------------------------------------- the adapter


class LegacyAdapter:
    """kvspec ``Implementation`` over one legacy block manager (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        *,
        manager: str | None = None,
        watermark: float | None = None,
        v1_window_slots: str = "tail",
        recorder: Recorder | None = None,
    ) -> None:
        manager = manager or default_manager()
        if v1_window_slots not in ("tail", "cyclic"):
            raise ValueError("v1_window_slots must be 'tail' or 'cyclic'")
        self.config = config
        self.manager = manager
        self.v1_window_slots = v1_window_slots
        self._v = _Vllm(recorder)
        cls = manager_class(manager)
        family: type[LegacyObserver] = (
            BlockSpaceV1Observer
            if hasattr(cls, "_allocate_last_physical_block") or manager == "v1"
            else BlockSpaceV2Observer
        )
        rejected = _release_rejects_caching_with_window(config)
        if rejected is not None:
            raise ConfigError(f"the release's CacheConfig rejects this configuration: {rejected}")
        if not family.caching_with_window and config.prefix_caching and config.sliding_window is not None:
            raise ConfigError("BlockSpaceManagerV1 rejects prefix caching with a sliding window")
        # ``mgr`` is what the protocol calls (recorded when a recorder is given); ``_raw`` is
        # what observation reads, never recorded.
        self.mgr = self._v.construct(
            harness.manager_call(
                manager,
                block_size=config.block_size,
                num_gpu_blocks=config.num_blocks,
                num_cpu_blocks=config.num_cpu_blocks,
                sliding_window=config.sliding_window,
                enable_caching=config.prefix_caching,
                watermark=watermark,
            ),
            "mgr",
        )
        self._raw = real(self.mgr)
        self.name = f"vllm-legacy-{manager}"
        self.watermark = getattr(self.mgr, "watermark", watermark)

        caps = {Capability.ADMISSION_CHECK}
        # Forked sequences join their parent's group (SequenceGroup.add); releases without
        # it (0.6.4 on: parallel sampling became separate requests) never fork.
        if hasattr(self._v.SequenceGroup, "add"):
            caps.add(Capability.FORK)
        # Chunked prefill is out for V1 + sliding window (0.6.3 arg_utils.py:1081-1085), and for
        # prefix caching where mark_blocks_as_computed cannot be told the chunk size: those
        # releases (0.4.x) have the worker refuse the pair (0.4.3 model_runner.py:285-290).
        self._chunk_aware_marking = "token_chunk_size" in _params(self.mgr.mark_blocks_as_computed)
        if (family.chunked_prefill_with_window or config.sliding_window is None) and not (
            config.prefix_caching and not self._chunk_aware_marking
        ):
            caps.add(Capability.CHUNKED_PREFILL)
        if config.prefix_caching:
            caps.add(Capability.PREFIX_CACHING)
        if config.sliding_window is not None:
            caps.add(Capability.SLIDING_WINDOW)
        if family.lookahead:
            caps.add(Capability.LOOKAHEAD)
        # 0.4.x BlockSpaceManagerV2 has no swapping (can_swap_out is always False there);
        # its allocator learned ``swap`` together with the feature.
        alloc = getattr(self.mgr, "block_allocator", None)
        if config.num_cpu_blocks > 0 and (alloc is None or hasattr(alloc, "swap")):
            caps.add(Capability.SWAP)
        if hasattr(self.mgr, "reset_prefix_cache"):
            caps.add(Capability.RESET_PREFIX_CACHE)
        self.capabilities = frozenset(caps)
        self._family = family

        self._seqs: dict[int, Any] = {}  # seq_id -> vllm Sequence
        self._groups: dict[int, Any] = {}  # seq_id -> vllm SequenceGroup
        self._pending_hit: dict[int, int] = {}  # hit tokens folded into the first commit
        # 0.6.4 on, the scheduler asks get_num_cached_tokens before can_allocate and counts
        # those tokens as scheduled; the answer is kept here until admit.
        self._cached_api = config.prefix_caching and hasattr(self.mgr, "get_num_cached_tokens")
        self._admission_cached: dict[int, int] = {}
        self.admission_policy = self._policy()
        # The sequence swapped in by the last operation: its next reserve skips
        # can_append_slots, as _schedule_swapped appends right after swap_in in the same
        # schedule() call.  Any other operation in between (a fork, an admission) cannot
        # happen there, so it ends the exemption.
        self._just_swapped: int | None = None
        self._request_ids = itertools.count()
        self._clock = 0.0
        self._observer: LegacyObserver = (
            BlockSpaceV1Observer(config, self._raw, self._v.Device, self._seqs, window_slots=v1_window_slots)
            if family is BlockSpaceV1Observer
            else BlockSpaceV2Observer(config, self._raw, self._v.Device, self._seqs)
        )

    # ------------------------------------------------------------ helpers

    def _now(self) -> float:
        # A logical clock: the scheduler passes time.time(); only its order matters (LRU).
        self._clock += 1.0
        return self._clock

    def _status(self, name: str):
        return getattr(self._v.SequenceStatus, name)

    def _seq(self, seq_id: int):
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id}")
        return seq

    def _live_siblings(self, seq_id: int) -> list:
        group = self._groups[seq_id]
        return [s for s in group.get_seqs() if s.seq_id != seq_id and not s.is_finished()]

    def _prepare(self, seq_id: int, tokens: Sequence[int], extra: tuple):
        """The WAITING Sequence/SequenceGroup an admission of ``seq_id`` uses."""
        if extra:
            raise Unsupported("the legacy adapter keys cached blocks by tokens only (extra=())")
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("a sequence needs at least one token")
        seq = self._seqs.get(seq_id)
        waiting = self._status("WAITING")
        if (
            seq is not None
            and seq.status == waiting
            and list(seq.get_token_ids()) == tokens
            and not self._live_siblings(seq_id)
        ):
            # Preempted by recompute (or checked by can_admit): the scheduler re-admits the
            # same Sequence, prompt and outputs as they were.
            return self._groups[seq_id]
        if seq is not None and seq.status not in (waiting,) and not seq.is_finished():
            raise AssertionError(f"seq {seq_id} admitted while live in vLLM")
        seq = self._v.make_sequence(seq_id, tokens, self.config.block_size)
        group = self._v.make_group(f"kvspec-{next(self._request_ids)}", [seq], self._clock)
        self._seqs[seq_id] = seq
        self._groups[seq_id] = group
        self._observer.forget(seq_id)
        return group

    def _schedule_metadata(self, seq_id: int) -> list[int]:
        """What ``schedule()`` does per scheduled group (scheduler.py:1257-1268)."""
        group = self._groups[seq_id]
        now = self._now()
        running = group.get_seqs(status=self._status("RUNNING"))
        for seq in running:
            self.mgr.get_block_table(seq)
            self.mgr.access_all_blocks_in_seq(seq, now)
        if self.config.prefix_caching:
            return list(self.mgr.get_common_computed_block_ids(running))
        return []

    # ------------------------------------------------------------ admission

    def _policy(self) -> AdmissionPolicy:
        """What this manager keeps back (file:line of 0.6.3 unless named): the room
        ``admission-completeness``, ``reserve-completeness`` and ``hit-completeness`` leave it."""
        v1 = self._family.step_block_per_sequence
        sources = [
            ("watermark_blocks", "block_manager_v2.py:91,139-145; block_manager_v1.py:260,309-315"),
            ("whole_prompt", "block_manager_v2.py:117-121; block_manager_v1.py:295-300"),
            ("step_checks_group", "block_manager_v2.py:216-229; block_manager_v1.py:384-385"),
            (
                "step_block_per_sequence" if v1 else "step_counts_touched",
                "block_manager_v1.py:381-385" if v1 else "block_manager_v2.py:202-229",
            ),
        ]
        if not self._cached_api:
            sources.append(("hits_with_window", "worker/model_runner.py:505-559"))
        return AdmissionPolicy(
            watermark_blocks=int(getattr(self.mgr, "watermark_blocks", 0)),
            whole_prompt=True,
            step_counts_touched=not v1,
            step_block_per_sequence=v1,
            step_checks_group=True,
            hits_with_window=self._cached_api,
            sources=tuple(sources),
        )

    def can_admit(
        self, seq_id: int, tokens: Sequence[int], num_new_tokens: int, extra: tuple = ()
    ) -> Admission:
        group = self._prepare(seq_id, tokens, extra)
        if self._cached_api:
            # _get_num_new_uncached_and_cached_tokens (0.10.1.1 scheduler.py:1926) runs first.
            seq = self._seqs[seq_id]
            self._admission_cached[seq_id] = self.mgr.get_num_cached_tokens(seq)
        fn = self.mgr.can_allocate
        status = fn(group, **_kw(fn, num_lookahead_slots=0))
        a = self._v.AllocStatus
        if status != a.OK and self._cached_api:
            # LATER / NEVER: the scheduler drops the tracker entry (scheduler.py:1109-1125).
            self._admission_cached.pop(seq_id, None)
            drop = getattr(self.mgr, "remove_seq_from_computed_blocks_tracker", None)
            if drop is not None:
                drop(self._seqs[seq_id])
        if status == a.OK:
            return Admission.OK
        if status == a.LATER:
            return Admission.LATER
        return Admission.NEVER

    def admit(
        self, seq_id: int, tokens: Sequence[int], num_new_tokens: int, extra: tuple = ()
    ) -> int:
        if num_new_tokens < 1:
            raise ValueError("num_new_tokens must be >= 1")
        self._just_swapped = None
        group = self._prepare(seq_id, tokens, extra)
        seq = self._seqs[seq_id]
        remaining = seq.get_len()
        if num_new_tokens < remaining and Capability.CHUNKED_PREFILL not in self.capabilities:
            raise Unsupported(
                "this release rejects chunked prefill with this configuration (V1 + sliding "
                "window, or prefix caching without a chunk-aware mark_blocks_as_computed)"
            )
        self._learn(seq_id)  # before allocate: a failed allocate may leave cached hashes behind
        if self._cached_api and seq_id not in self._admission_cached:
            self._admission_cached[seq_id] = self.mgr.get_num_cached_tokens(seq)
        try:
            self.mgr.allocate(group)
        except Exception as err:
            if self._v.is_out_of_blocks(err):
                # The scheduler would crash here; vLLM's state stays as allocate left it.
                self._forget(seq_id)
                raise NoFreeBlocks(
                    f"{type(self._raw).__name__}.allocate: {type(err).__name__}: {err}"
                ) from err
            raise
        for s in group.get_seqs(status=self._status("WAITING")):
            s.status = self._status("RUNNING")
        computed = self._schedule_metadata(seq_id)
        hit = 0
        if self._cached_api:
            # 0.6.4 on: the scheduler schedules the cached tokens as computed; a fully cached
            # prompt still computes its last token (scheduler.py:1951-1956 of 0.10.1.1).
            hit = self._admission_cached.pop(seq_id, 0)
            if hit >= seq.get_len():
                hit = seq.get_len() - 1
        elif computed and self.config.sliding_window is None:
            # Up to 0.6.3: the worker skips the common computed blocks
            # (model_runner._compute_for_prefix_cache_hit); the tracker already leaves out
            # the last block, so the hit stays below the prompt length.
            hit = len(computed) * self.config.block_size
            hit = min(hit, (seq.get_len() - 1) // self.config.block_size * self.config.block_size)
        self._pending_hit[seq_id] = hit
        return hit

    def _forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._groups.pop(seq_id, None)
        self._pending_hit.pop(seq_id, None)
        self._admission_cached.pop(seq_id, None)

    # ------------------------------------------------------------ steps

    def reserve(self, seq_id: int, num_new_tokens: int, lookahead: int = 0) -> list[BlockCopy]:
        seq = self._seq(seq_id)
        group = self._groups[seq_id]
        if seq.status != self._status("RUNNING"):
            raise NotAdmitted(f"seq {seq_id} is not running in vLLM (status {seq.status.name})")
        if lookahead and Capability.LOOKAHEAD not in self.capabilities:
            raise Unsupported("BlockSpaceManagerV1 has no lookahead slots")
        if seq.is_prefill():
            # _get_num_lookahead_slots(is_prefill=True) is 0 outside multi-step chunked
            # prefill (scheduler.py:1561-1588): prefill chunks reserve no speculative slots.
            lookahead = 0
        if self._cached_api and seq.is_prefill():
            # A running prefill chunk is sized with get_num_cached_tokens first (0.6.4 on).
            self.mgr.get_num_cached_tokens(seq)
        # Right after a swap-in the scheduler appends slots without asking (scheduler.py:716).
        skip_check = self._just_swapped == seq_id
        self._just_swapped = None
        if not skip_check:
            fn = self.mgr.can_append_slots
            if not fn(group, **_kw(fn, num_lookahead_slots=lookahead)):
                raise NotAdmitted(f"can_append_slots refused seq {seq_id} (lookahead {lookahead})")
        fn = self.mgr.append_slots
        try:
            result = fn(seq, **_kw(fn, num_lookahead_slots=lookahead))
        except Exception as err:
            if self._v.is_out_of_blocks(err):
                raise NoFreeBlocks(
                    f"{type(self._raw).__name__}.append_slots after "
                    f"{'swap-in' if skip_check else 'can_append_slots'} said yes: "
                    f"{type(err).__name__}: {err}"
                ) from err
            raise
        self._schedule_metadata(seq_id)
        return _copies(result)

    def commit(self, seq_id: int, num_tokens: int) -> None:
        seq = self._seq(seq_id)
        group = self._groups[seq_id]
        chunk = self._pending_hit.pop(seq_id, 0) + num_tokens
        if chunk <= 0:
            return
        self._mark_computed(seq, group, chunk)
        seq.data.update_num_computed_tokens(chunk)

    def _mark_computed(self, seq, group, chunk: int) -> None:
        mark = self.mgr.mark_blocks_as_computed
        per_seq = getattr(self.mgr, "compute_full_blocks_in_seq", None)
        if self._family.marks_per_sequence and per_seq is not None and len(group.get_seqs()) > 1:
            # V1's mark_blocks_as_computed is, per sequence of the group, exactly
            # compute_full_blocks_in_seq(seq, chunk); the scheduler calls it once per group
            # step, before any sibling's count advances.  The driver commits one sequence
            # at a time, so apply the per-sequence body to this sequence only.
            per_seq(seq, **_kw(per_seq, token_chunk_size=chunk))
            return
        mark(group, **_kw(mark, token_chunk_size=chunk))

    def append_token(self, seq_id: int, token: int) -> None:
        self._v.append_token(self._seq(seq_id), int(token))
        self._learn(seq_id)

    # ------------------------------------------------------------ fork, free, swap

    def fork(self, parent_id: int, child_id: int) -> None:
        if Capability.FORK not in self.capabilities:
            raise Unsupported("this release's engine never forks a sequence (no SequenceGroup.add)")
        self._just_swapped = None
        parent = self._seq(parent_id)
        if child_id in self._seqs and not self._seqs[child_id].is_finished():
            raise AssertionError(f"child seq {child_id} already exists")
        if parent.is_prefill():
            # The output processor forks only after sampling (decode stage): a fork in the
            # middle of a prefill would share a block both sequences still have to write.
            raise Unsupported(
                f"legacy vLLM forks only after sampling; seq {parent_id} is still in prefill"
            )
        group = self._groups[parent_id]
        child = parent.fork(child_id)
        group.add(child)
        self._seqs[child_id] = child
        self._groups[child_id] = group
        self.mgr.fork(parent, child)
        self._observer.forget(child_id)
        self._learn(child_id)

    def free(self, seq_id: int) -> None:
        seq = self._seq(seq_id)
        self._pending_hit.pop(seq_id, None)
        self._admission_cached.pop(seq_id, None)
        self._just_swapped = None
        if self._live_siblings(seq_id):
            # One member of a multi-sequence group ends: it finishes (single_step.py).
            seq.status = self._status("FINISHED_STOPPED")
            self.mgr.free(seq)
            return
        # The only live member: preemption by recompute (scheduler.py:1501-1510); a
        # sequence that simply finishes is freed by the same block-manager call.
        seq.status = self._status("WAITING")
        self.mgr.free(seq)
        seq.reset_state_for_recompute()

    def swap_out(self, seq_id: int) -> list[BlockCopy]:
        if Capability.SWAP not in self.capabilities:
            raise Unsupported(
                "no swapping: num_cpu_blocks == 0, or this release's manager cannot swap"
            )
        self._just_swapped = None
        seq = self._seq(seq_id)
        group = self._groups[seq_id]
        if seq.status != self._status("RUNNING"):
            raise NotAdmitted(f"seq {seq_id} is not running")
        if self._live_siblings(seq_id):
            raise NotAdmitted(
                "legacy vLLM swaps whole sequence groups; seq "
                f"{seq_id} shares its group with live sequences"
            )
        if not self.mgr.can_swap_out(group):
            raise NotAdmitted(f"can_swap_out refused seq {seq_id} (the scheduler aborts here)")
        try:
            mapping = _copies(self.mgr.swap_out(group))
        except Exception as err:
            if self._v.is_out_of_blocks(err):
                raise NoFreeBlocks(f"swap_out after can_swap_out said yes: {err}") from err
            raise
        seq.status = self._status("SWAPPED")
        return mapping

    def swap_in(self, seq_id: int) -> list[BlockCopy]:
        if Capability.SWAP not in self.capabilities:
            raise Unsupported(
                "no swapping: num_cpu_blocks == 0, or this release's manager cannot swap"
            )
        self._just_swapped = None
        seq = self._seq(seq_id)
        group = self._groups[seq_id]
        if seq.status != self._status("SWAPPED"):
            raise NotAdmitted(f"seq {seq_id} is not swapped out")
        lookahead = self.config.max_lookahead if self._family.lookahead and not seq.is_prefill() else 0
        fn = self.mgr.can_swap_in
        status = fn(group, **_kw(fn, num_lookahead_slots=lookahead))
        if status != self._v.AllocStatus.OK:
            raise NotAdmitted(f"can_swap_in answered {status.name} for seq {seq_id}")
        try:
            mapping = _copies(self.mgr.swap_in(group))
        except Exception as err:
            if self._v.is_out_of_blocks(err):
                raise NoFreeBlocks(f"swap_in after can_swap_in said OK: {err}") from err
            raise
        seq.status = self._status("RUNNING")
        self._just_swapped = seq_id
        return mapping

    def reset_prefix_cache(self) -> bool:
        fn = getattr(self.mgr, "reset_prefix_cache", None)
        if fn is None:
            raise Unsupported("this release's legacy block manager has no reset_prefix_cache")
        self._just_swapped = None
        return bool(fn())

    # ------------------------------------------------------------ prefix keys, observation

    def _learn(self, seq_id: int) -> None:
        seq = self._seqs.get(seq_id)
        if seq is None or not self.config.prefix_caching:
            return
        self._observer.learn(seq_id, seq)

    def observe(self) -> KVState:
        return self._observer.observe()


def make_legacy(config: Config, manager: str | None = None, **kwargs: Any) -> LegacyAdapter:
    """An adapter over the named legacy manager (``None``: the release's engine default)."""
    return LegacyAdapter(config, manager=manager or default_manager(), **kwargs)


__all__ = [
    "MANAGERS",
    "LegacyAdapter",
    "available_managers",
    "default_manager",
    "make_legacy",
    "manager_class",
]
