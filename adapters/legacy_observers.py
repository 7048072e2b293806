"""What each legacy block-manager family shows of its state, read-only: one observer per family.

``BlockSpaceV2Observer`` reads ``BlockSpaceManagerV2`` and its rename
``SelfAttnBlockSpaceManager`` (vllm/core/block/: one block layer); ``BlockSpaceV1Observer``
reads ``BlockSpaceManagerV1`` (vllm/core/block_manager_v1.py).  An observer learns prefix keys
from the release's own hash of every token sequence the adapter is given, and turns the
manager's private allocator state into a ``KVState`` (adapters/legacy.py's module docstring
lists the attributes read and the mapping choices).  Each also declares the facts of its
family the adapter acts on, with the vLLM 0.6.3 code that makes them so.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import attrs
from kvspec.spec.config import Config
from kvspec.spec.prefix_hash import PrefixKey
from kvspec.spec.state import Device, KVState, PoolView, Slot, TableView, table_view

from .harness import legacy as harness


class LegacyObserver:
    """Prefix keys and observation of one legacy manager (``raw``: never recorded)."""

    #: BlockSpaceManagerV1 raises NotImplementedError for prefix caching with a sliding
    #: window (block_manager_v1.py:245-247).
    caching_with_window: ClassVar[bool] = True
    #: Chunked prefill with a sliding window (arg_utils.py:1081-1085 refuses it for V1).
    chunked_prefill_with_window: ClassVar[bool] = True
    #: Lookahead slots (V1 asserts num_lookahead_slots == 0, block_manager_v1.py:290, 378).
    lookahead: ClassVar[bool] = True
    #: ``can_append_slots`` counts one block per running sequence (block_manager_v1.py:381-385)
    #: rather than the blocks the step touches (block_manager_v2.py:202-229).
    step_block_per_sequence: ClassVar[bool] = False
    #: ``compute_full_blocks_in_seq``: the per-sequence body of ``mark_blocks_as_computed``.
    marks_per_sequence: ClassVar[bool] = False

    def __init__(self, config: Config, raw: Any, device_names: Any, seqs: Mapping[int, Any]) -> None:
        self.config = config
        self._raw = raw
        self._device = device_names  # vllm.utils.Device
        self._seqs = seqs  # the adapter's seq_id -> vllm Sequence, read only
        self.keys: dict[int, PrefixKey] = {}  # release hash -> PrefixKey
        # The last observation's block tables: unchanged tables are handed out again.
        self._last_tables: Mapping[int, TableView] = MappingProxyType({})

    def learn(self, seq_id: int, seq: Any) -> None:
        """Register the prefix key of every block hash ``seq``'s tokens produce."""
        raise NotImplementedError

    def forget(self, seq_id: int) -> None:
        """``seq_id`` starts again from no tokens (a new sequence or a fork's child)."""
        raise NotImplementedError

    def observe(self) -> KVState:
        raise NotImplementedError

    def _hit_rate(self, device: Device) -> float | None:
        """The prefix-cache hit rate the manager reports for ``device``'s pool (read as the
        engine's stats read it every step: a crash in it is the engine's crash)."""
        return harness.prefix_cache_hit_rate(self._raw, device.name)

    def _tables(self, slots_of: Iterable[tuple[int, Device, tuple[Slot, ...]]]) -> dict[int, TableView]:
        tables = {sid: table_view(self._last_tables, sid, dev, slots) for sid, dev, slots in slots_of}
        self._last_tables = tables
        return tables


class BlockSpaceV2Observer(LegacyObserver):
    """``BlockSpaceManagerV2`` / ``SelfAttnBlockSpaceManager``: hashes chain over full blocks."""

    def __init__(self, config: Config, raw: Any, device_names: Any, seqs: Mapping[int, Any]) -> None:
        super().__init__(config, raw, device_names, seqs)
        from vllm.core.block.prefix_caching_block import PrefixCachingBlock

        self._hash_block_tokens = PrefixCachingBlock.hash_block_tokens
        self._hash_extra = "extra_hash" in harness.params(self._hash_block_tokens)
        self._learned: dict[int, tuple[tuple[int, ...], Any]] = {}
        self._ids: dict[tuple[int, int | None], list[int]] = {}  # (allocator, null id) -> ids

    def learn(self, seq_id: int, seq: Any) -> None:
        """V2 chains ``hash_block_tokens(is_first, prev_hash, block tokens)`` over full blocks."""
        B = self.config.block_size
        tokens = tuple(int(t) for t in seq.get_token_ids())
        done, prev = self._learned.get(seq_id, ((), None))
        if tokens[: len(done)] != done:
            done, prev = (), None
        for i in range(len(done) // B, len(tokens) // B):
            block = list(tokens[i * B : (i + 1) * B])
            args: dict[str, Any] = {}
            if self._hash_extra:
                args["extra_hash"] = None
            h = self._hash_block_tokens(i == 0, prev, block, **args)
            self.keys.setdefault(h, PrefixKey(tokens[: (i + 1) * B]))
            prev = h
        self._learned[seq_id] = (tokens[: len(tokens) // B * B], prev)

    def forget(self, seq_id: int) -> None:
        self._learned.pop(seq_id, None)

    def observe(self) -> KVState:
        alloc = self._raw.block_allocator
        gpu = alloc._allocators[self._device.GPU]
        cpu = alloc._allocators[self._device.CPU]
        null = getattr(alloc, "_null_block", None)
        null_id = null.block_id if null is not None else None
        if self.config.prefix_caching:
            self._learn_from_live_blocks(null)
        gpu_view = attrs.evolve(self._pool(gpu, exclude=null_id, offset=0), hit_rate=self._hit_rate(Device.GPU))
        cpu_offset = min(cpu.all_block_ids) if cpu.all_block_ids else 0
        cpu_view = attrs.evolve(self._pool(cpu, exclude=None, offset=cpu_offset), hit_rate=self._hit_rate(Device.CPU))
        gpu_ids = gpu.all_block_ids

        def slots_of() -> Iterable[tuple[int, Device, tuple[Slot, ...]]]:
            for seq_id, bt in self._raw.block_tables.items():
                ids = list(bt.physical_block_ids)
                real = [b for b in ids if b is not None and b != null_id]
                on_cpu = bool(real) and all(b not in gpu_ids for b in real)
                slots = tuple(
                    None if b is None or b == null_id else (b - cpu_offset if on_cpu else b) for b in ids
                )
                yield seq_id, (Device.CPU if on_cpu else Device.GPU), slots

        return KVState(
            gpu=gpu_view, tables=self._tables(slots_of()),
            cpu=cpu_view if self.config.num_cpu_blocks > 0 else None,
        )

    def _learn_from_live_blocks(self, null: Any) -> None:
        """Second source of keys: the hash a live block already computed for itself (the
        memoized ``_cached_content_hash``, read without triggering a computation)."""
        B = self.config.block_size
        for seq_id, bt in self._raw.block_tables.items():
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            tokens = tuple(int(t) for t in seq.get_token_ids())
            for i, block in enumerate(_table_blocks(bt)):
                if block is null:
                    continue
                h = getattr(block, "_cached_content_hash", None)
                if h is not None and h not in self.keys and (i + 1) * B <= len(tokens):
                    self.keys[h] = PrefixKey(tokens[: (i + 1) * B])

    def _pool(self, allocator: Any, *, exclude: int | None, offset: int) -> PoolView:
        # A pool's ids change once at most: when the null block is carved out of it (the first
        # windowed append), so they are sorted again only when the excluded id changes.
        ids = self._ids.get((id(allocator), exclude))
        if ids is None:
            ids = self._ids[(id(allocator), exclude)] = sorted(
                b for b in allocator.all_block_ids if b != exclude
            )
        hashless = getattr(allocator, "_hashless_allocator", None)
        naive = hashless if hashless is not None else allocator
        counts = naive.refcounter._refcounts  # shared with the prefix-caching allocator
        free = tuple(b - offset for b in naive._free_block_indices if b != exclude)
        evictable: tuple[int, ...] = ()
        cached: list[tuple[PrefixKey, int]] = []
        computed: set[int] = set()
        if hashless is not None:
            evictable = tuple(b - offset for b in _evictor_ids(allocator.evictor))
            for h, b in allocator._cached_blocks.items():
                key = self.keys.get(h)
                if key is None:
                    key = PrefixKey((), ("unknown vLLM block hash", h))
                cached.append((key, b - offset))
                if allocator.block_is_computed(b):
                    computed.add(b - offset)
        return PoolView(
            ids=tuple(b - offset for b in ids),
            refcounts={b - offset: counts[b] for b in ids},
            free=free,
            evictable=evictable,
            cached=tuple(cached),
            computed=frozenset(computed),
        )


class BlockSpaceV1Observer(LegacyObserver):
    """``BlockSpaceManagerV1``: a hash per logical block, physical block objects, cyclic windows."""

    caching_with_window = False
    chunked_prefill_with_window = False
    lookahead = False
    step_block_per_sequence = True
    marks_per_sequence = True

    def __init__(
        self, config: Config, raw: Any, device_names: Any, seqs: Mapping[int, Any], *, window_slots: str
    ) -> None:
        super().__init__(config, raw, device_names, seqs)
        self._window_slots = window_slots
        # seq_id -> (full blocks learned, prompt length they were hashed with)
        self._learned: dict[int, tuple[int, int]] = {}
        # UncachedBlockAllocator keeps no list of allocated blocks: remember every block object
        # while they all sit on the free list (read-only references).
        self._blocks: dict[str, list] = {
            name: list(getattr(getattr(raw, name), "free_blocks", []))
            for name in ("gpu_allocator", "cpu_allocator")
        }
        self._epochs: dict[str, Counter] = {}
        self._count_allocations()

    def learn(self, seq_id: int, seq: Any) -> None:
        """V1 hashes every logical block, the partial last one included, with
        ``Sequence.hash_of_block`` (a hash of the token prefix, split into prompt and outputs)."""
        B = self.config.block_size
        tokens = tuple(int(t) for t in seq.get_token_ids())
        full, prompt_len = self._learned.get(seq_id, (0, seq.get_prompt_len()))
        if prompt_len != seq.get_prompt_len():
            full = 0
        n_blocks = -(-len(tokens) // B)
        for i in range(full, n_blocks):
            end = min((i + 1) * B, len(tokens))
            self.keys.setdefault(seq.hash_of_block(i), PrefixKey(tokens[:end]))
        self._learned[seq_id] = (len(tokens) // B, seq.get_prompt_len())

    def forget(self, seq_id: int) -> None:
        self._learned.pop(seq_id, None)

    def _count_allocations(self) -> None:
        """Count how often each block starts a new life (a block's content lives one).

        Observation only: the wrapper calls the allocator's own ``allocate`` and returns what
        it returns.  A cache hit (the hash already cached or parked in the evictor) revives
        the same content and is not a new life.  The cyclic sliding-window reuse never
        allocates, which is exactly why its in-place overwrite stays visible.
        """
        for name in ("gpu_allocator", "cpu_allocator"):
            allocator = getattr(self._raw, name)
            epochs: Counter = Counter()
            self._epochs[name] = epochs
            allocate = allocator.allocate

            def counted(*args, _allocate=allocate, _allocator=allocator, _epochs=epochs, **kw):
                h = args[0] if args else kw.get("block_hash")
                cached = getattr(_allocator, "cached_blocks", None)
                evictor = getattr(_allocator, "evictor", None)
                known = cached is not None and h is not None and (
                    h in cached or (evictor is not None and h in evictor.free_table)
                )
                block = _allocate(*args, **kw)
                if not known:
                    _epochs[block.block_number] += 1
                return block

            allocator.allocate = counted

    def observe(self) -> KVState:
        gpu_view = self._pool("gpu_allocator", self.config.num_blocks)
        cpu_view = self._pool("cpu_allocator", self.config.num_cpu_blocks)
        bsw = getattr(self._raw, "block_sliding_window", None)

        def slots_of() -> Iterable[tuple[int, Device, tuple[Slot, ...]]]:
            for seq_id, bt in self._raw.block_tables.items():
                blocks = list(bt)
                on_cpu = bool(blocks) and blocks[0].device == self._device.CPU
                slots: list[Slot] = [b.block_number for b in blocks]
                if bsw is not None and self._window_slots == "tail" and len(slots) > bsw:
                    slots = [None] * (len(slots) - bsw) + slots[-bsw:]
                yield seq_id, (Device.CPU if on_cpu else Device.GPU), tuple(slots)

        return KVState(
            gpu=gpu_view, tables=self._tables(slots_of()),
            cpu=cpu_view if self.config.num_cpu_blocks > 0 else None,
        )

    def _pool(self, name: str, num_blocks: int) -> PoolView:
        view = self._pool_view(name, num_blocks)
        epochs = self._epochs[name]
        device = Device.GPU if name == "gpu_allocator" else Device.CPU
        return attrs.evolve(view, epochs={b: epochs[b] for b in view.ids}, hit_rate=self._hit_rate(device))

    def _pool_view(self, name: str, num_blocks: int) -> PoolView:
        allocator = getattr(self._raw, name)
        ids = tuple(range(num_blocks))
        if hasattr(allocator, "free_blocks"):  # UncachedBlockAllocator
            refcounts = {b.block_number: b.ref_count for b in self._blocks[name]}
            free = tuple(b.block_number for b in allocator.free_blocks)
            return PoolView(ids=ids, refcounts=refcounts, free=free)
        # CachedBlockAllocator: blocks are created lazily; every created block is either
        # referenced (in cached_blocks) or in the evictor.
        live = dict(allocator.cached_blocks)
        parked = dict(allocator.evictor.free_table)
        refcounts = {b: 0 for b in ids}
        free = list(range(allocator.current_num_blocks, num_blocks))
        evictable: list[int] = []
        cached: list[tuple[PrefixKey, int]] = []
        computed: set[int] = set()
        for h, block in itertools.chain(live.items(), parked.items()):
            refcounts[block.block_number] = block.ref_count
            key = self.keys.get(h)
            if key is None:  # a placeholder (counter) hash: no content
                if block.ref_count == 0:
                    free.append(block.block_number)
                continue
            cached.append((key, block.block_number))
            if block.ref_count == 0:
                evictable.append(block.block_number)
            if block.computed:
                computed.add(block.block_number)
        return PoolView(
            ids=ids,
            refcounts=refcounts,
            free=tuple(free),
            evictable=tuple(evictable),
            cached=tuple(cached),
            computed=frozenset(computed),
        )


def _table_blocks(bt: Any) -> list:
    """A V2 BlockTable's block objects (a ``blocks`` property from 0.5 on, ``_blocks`` before)."""
    blocks = getattr(bt, "blocks", None)
    return list(blocks if blocks is not None else bt._blocks)


def _evictor_ids(evictor: Any) -> Iterable[int]:
    table = getattr(evictor, "free_table", None)
    if table is None:
        raise AttributeError("unknown evictor layout (no free_table)")
    return list(table.keys())
