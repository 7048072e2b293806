"""The reference block manager: small, and obviously right.

It satisfies every invariant of ``kvspec.spec`` by construction:

* admission computes the exact need of the first step (``spec.admission``) and answers OK
  only when it fits, so the allocation that follows cannot fail;
* every operation checks what it needs before it mutates, so a refusal changes nothing;
* a sliding-window sequence drops the slots before the first block its step still needs
  and takes fresh blocks for new positions (``BlockTable``): it holds at most the window's
  blocks plus those of the step, and never writes into a full block;
* a write into a shared block goes to a copy first (copy-on-write);
* full blocks are published to the prefix cache only once their KV is written (commit),
  so a hit is always computed;
* a key names the sequence's domain too (cache salt, LoRA adapter, multimodal features
  placed before the block's end: ``ExtraKeys.for_chain``), so no hit crosses domains;
* the pool logs a KV-cache event for every change of its cache map (``spec.events``);
* with ``partial_tails`` (``PartialTailReference``), a prompt whose last token ends inside a
  block publishes that block under its partial chain once computed, and the block's partial
  key is retired (removed, with its event) when the block is promoted to a full key -- the
  behaviour of vLLM 0.33.0 ``FullAttentionManager._cache_partial_tail_block`` /
  ``BlockPool.cache_partial_block`` (single_type_kv_cache_manager.py:840-897,
  block_pool.py:486-603, promotion 288-297) and of legacy ``BlockSpaceManagerV1``
  (block_manager_v1.py:332-335, ``_promote_last_block``).  Lookups use full keys only: 0.33.0
  serves partial hits only with a Mamba "align" group (``partial_hash_hits_enabled``,
  kv_cache_utils.py:762-801), and a partial hit needs a copy-on-write at admission.

Policy choices (free under the spec): FIFO free list, LRU eviction of unreferenced cached
blocks, the first block to publish a key keeps it, no watermark.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs
from kvspec.spec.admission import fits, new_blocks_for_step
from kvspec.spec.config import Config
from kvspec.spec.errors import NoFreeBlocks, NotAdmitted, Unsupported
from kvspec.spec.interface import Admission, BlockCopy, Capability
from kvspec.spec.prefix_hash import ExtraKeys, as_extra, block_keys, key_of
from kvspec.spec.state import DROPPED, Device, KVState, TableView, table_view
from kvspec.spec.window import first_needed_block

from .block_table import BlockTable
from .pool import BlockPool


@attrs.define
class _Seq:
    tokens: list[int]
    extra: ExtraKeys
    table: BlockTable
    num_computed: int
    device: Device = Device.GPU
    published: int = 0  # leading full blocks already offered to the prefix cache
    prompt_len: int = 0  # tokens at (re)admission: a partial prompt tail may be published


@attrs.frozen
class _AdmissionPlan:
    hits: list[int]  # hit blocks from block 0 on
    hit_tokens: int
    first: int  # first slot the step needs
    end: int
    new_blocks: int
    evictable_hits: int

    @property
    def kept_hits(self) -> list[int]:
        return self.hits[self.first :]


class ReferenceManager:
    name = "reference"
    partial_tails = False  # publish a prompt's partial last block (PartialTailReference)
    _last_tables: Mapping[int, TableView] = MappingProxyType({})  # the last observation's

    def __init__(self, config: Config, admit_lookahead: int | None = None) -> None:
        """``admit_lookahead``: the lookahead slots an admission reserves past its first step
        (spec/interface.py ``admit``); None: the run's, ``config.max_lookahead``."""
        self.config = config
        self.admit_lookahead = config.max_lookahead if admit_lookahead is None else admit_lookahead
        self.gpu = BlockPool(config.num_blocks, config.prefix_caching)
        self.cpu = BlockPool(config.num_cpu_blocks) if config.num_cpu_blocks else None
        self.seqs: dict[int, _Seq] = {}
        caps = {
            Capability.ADMISSION_CHECK,
            Capability.CHUNKED_PREFILL,
            Capability.LOOKAHEAD,
            Capability.FORK,
            Capability.RESET_PREFIX_CACHE,
            Capability.CACHE_SALT,
            Capability.LORA,
            Capability.MULTIMODAL,
        }
        if config.prefix_caching:
            caps |= {Capability.PREFIX_CACHING, Capability.KV_EVENTS}
        if config.sliding_window is not None:
            caps.add(Capability.SLIDING_WINDOW)
        if self.cpu is not None:
            caps.add(Capability.SWAP)
        self.capabilities = frozenset(caps)

    # ------------------------------------------------------------ admission

    def _plan(
        self, tokens: Sequence[int], num_new_tokens: int, extra: ExtraKeys
    ) -> _AdmissionPlan:
        B, W = self.config.block_size, self.config.sliding_window
        hits: list[int] = []
        # The last token is always computed, so at most (len-1)//B blocks can hit.
        for key in block_keys(tokens[: len(tokens) - 1], B, self._keyed(extra)):
            block = self.gpu.lookup(key)
            if block is None:
                break
            hits.append(block)
        hit_tokens = len(hits) * B
        # The first step's slots, plus the lookahead slots admission reserves.
        end = min(hit_tokens + max(1, num_new_tokens), len(tokens)) + self.admit_lookahead
        first = min(first_needed_block(hit_tokens, W, B), len(hits))
        kept = hits[first:]
        return _AdmissionPlan(
            hits=hits,
            hit_tokens=hit_tokens,
            first=first,
            end=end,
            new_blocks=new_blocks_for_step(hit_tokens, end, W, B),
            evictable_hits=sum(1 for b in kept if self.gpu.refcount[b] == 0),
        )

    def can_admit(
        self, seq_id: int, tokens: Sequence[int], num_new_tokens: int, extra: tuple = ()
    ) -> Admission:
        plan = self._plan(tokens, num_new_tokens, as_extra(extra))
        if plan.new_blocks + len(plan.kept_hits) > self.config.num_blocks:
            return Admission.NEVER
        if fits(plan.new_blocks, plan.evictable_hits, len(self.gpu.free), len(self.gpu.evictable)):
            return Admission.OK
        return Admission.LATER

    def admit(
        self, seq_id: int, tokens: Sequence[int], num_new_tokens: int, extra: tuple = ()
    ) -> int:
        assert seq_id not in self.seqs, f"seq {seq_id} is already live"
        extra = as_extra(extra)
        plan = self._plan(tokens, num_new_tokens, extra)
        if not fits(
            plan.new_blocks, plan.evictable_hits, len(self.gpu.free), len(self.gpu.evictable)
        ):
            raise NoFreeBlocks(f"seq {seq_id} needs {plan.new_blocks} new blocks")
        for block in plan.kept_hits:
            self.gpu.incref(block)
        table = BlockTable([DROPPED] * plan.first + plan.kept_hits)
        table.first_live = plan.first
        table.grow_to((plan.end - 1) // self.config.block_size + 1, self.gpu)
        self.seqs[seq_id] = _Seq(
            list(tokens),
            extra,
            table,
            plan.hit_tokens,
            published=len(plan.hits),
            prompt_len=len(tokens),
        )
        return plan.hit_tokens

    # ------------------------------------------------------------ steps

    def _first_needed(self, start: int) -> int:
        return first_needed_block(start, self.config.sliding_window, self.config.block_size)

    def _shared_in(self, table: BlockTable, start: int, stop: int) -> list[int]:
        """Slot indices of shared blocks the positions start .. stop-1 would write into."""
        B = self.config.block_size
        last = min((stop - 1) // B, len(table.slots) - 1)
        return [
            i
            for i in range(start // B, last + 1)
            if table.slots[i] is not DROPPED and self.gpu.refcount[table.slots[i]] > 1
        ]

    def reserve(self, seq_id: int, num_new_tokens: int, lookahead: int = 0) -> list[BlockCopy]:
        seq = self._running(seq_id)
        B = self.config.block_size
        start = seq.num_computed
        end = start + num_new_tokens + lookahead
        first = self._first_needed(start)
        released = [b for b in seq.table.droppable(first) if self.gpu.refcount[b] == 1]
        cow = self._shared_in(seq.table, start, start + num_new_tokens)
        grow = max(0, (end - 1) // B + 1 - len(seq.table.slots))
        if grow + len(cow) > self.gpu.available() + len(released):
            raise NotAdmitted(f"seq {seq_id} needs {grow + len(cow)} blocks for its next step")
        seq.table.drop_before(first, self.gpu)
        copies = []
        for i in cow:
            old = seq.table.slots[i]
            new = self.gpu.allocate()
            seq.table.slots[i] = new
            self.gpu.decref(old)
            copies.append((old, new))
        seq.table.grow_to((end - 1) // B + 1, self.gpu)
        return copies

    def commit(self, seq_id: int, num_tokens: int) -> None:
        seq = self._running(seq_id)
        seq.num_computed += num_tokens
        assert seq.num_computed <= len(seq.tokens)
        self._publish(seq)

    def _publish(self, seq: _Seq) -> None:
        if not self.config.prefix_caching:
            return
        B = self.config.block_size
        full = seq.num_computed // B
        for i in range(seq.published, full):
            block = seq.table.slots[i]
            if block is not DROPPED:
                self.gpu.register(key_of(seq.tokens, (i + 1) * B, self._keyed(seq.extra)), block)
        seq.published = max(seq.published, full)
        tail = seq.num_computed
        if self.partial_tails and tail == seq.prompt_len and tail % B and tail // B < len(
            seq.table.slots
        ):
            block = seq.table.slots[tail // B]
            if block is not DROPPED:
                self.gpu.register(key_of(seq.tokens, tail, self._keyed(seq.extra)), block)

    def _keyed(self, extra: ExtraKeys) -> ExtraKeys:
        """The domain the prefix cache keys a sequence's blocks by: all of it."""
        return extra

    def append_token(self, seq_id: int, token: int) -> None:
        self.seqs[seq_id].tokens.append(token)

    # ------------------------------------------------------------ lifecycle

    def fork(self, parent_id: int, child_id: int) -> None:
        parent = self._running(parent_id)
        assert child_id not in self.seqs
        self.seqs[child_id] = _Seq(
            list(parent.tokens),
            parent.extra,
            parent.table.fork(self.gpu),
            parent.num_computed,
            published=parent.published,
            prompt_len=parent.prompt_len,
        )

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        seq.table.release(self._pool(seq.device))

    def swap_out(self, seq_id: int) -> list[BlockCopy]:
        seq = self._running(seq_id)
        return self._move(seq, self.gpu, self._cpu(), Device.CPU)

    def swap_in(self, seq_id: int) -> list[BlockCopy]:
        seq = self.seqs[seq_id]
        assert seq.device is Device.CPU, f"seq {seq_id} is not swapped out"
        copies = self._move(seq, self._cpu(), self.gpu, Device.GPU)
        seq.published = seq.table.first_live  # re-offer its full blocks to the cache
        self._publish(seq)
        return copies

    def _move(self, seq: _Seq, src: BlockPool, dst: BlockPool, device: Device) -> list[BlockCopy]:
        held = seq.table.held()
        if len(held) > dst.available():
            raise NotAdmitted(f"{len(held)} blocks do not fit the {device.value} pool")
        copies = []
        for i, block in enumerate(seq.table.slots):
            if block is DROPPED:
                continue
            moved = dst.allocate()
            seq.table.slots[i] = moved
            src.decref(block)
            copies.append((block, moved))
        seq.device = device
        return copies

    def reset_prefix_cache(self) -> bool:
        # Like V1's KVCacheManager.reset_prefix_cache: only when no block is in use, so a
        # reset never drops the cache entry of content a running sequence still holds.
        if any(self.gpu.refcount):
            return False
        self.gpu.reset_cache()
        return True

    # ------------------------------------------------------------ observation

    def observe(self) -> KVState:
        tables = {
            sid: table_view(self._last_tables, sid, s.device, tuple(s.table.slots)) for sid, s in self.seqs.items()
        }
        self._last_tables = tables  # unchanged tables are handed out again (table_view)
        return KVState(gpu=self.gpu.view(), cpu=self.cpu.view() if self.cpu is not None else None, tables=tables)

    # ------------------------------------------------------------ helpers

    def _running(self, seq_id: int) -> _Seq:
        seq = self.seqs[seq_id]
        assert seq.device is Device.GPU, f"seq {seq_id} is swapped out"
        return seq

    def _pool(self, device: Device) -> BlockPool:
        return self.gpu if device is Device.GPU else self._cpu()

    def _cpu(self) -> BlockPool:
        if self.cpu is None:
            raise Unsupported("swap needs num_cpu_blocks > 0")
        return self.cpu


class PartialTailReference(ReferenceManager):
    """The reference with partial-block prefix caching: prompt tails published under their
    partial chain, promoted to full keys, superseded partial keys retired."""

    name = "reference-partial-tails"
    partial_tails = True
