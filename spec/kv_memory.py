"""Shadow KV memory: a model of what the worker writes, and what reading it back must give.

vLLM's model runner writes the key/value of the token at position p into the slot
``block_table[p // B] * B + p % B`` (legacy ``_compute_slot_mapping`` in
vllm/attention/backends/utils.py; V1 ``BlockTable.compute_slot_mapping`` in
vllm/v1/worker/block_table.py).  The shadow memory records, per (device, block, offset),
the token written there.  A block's content lives from its allocation until the block
returns to the free list (or is evicted and reused); a prefix-cache hit keeps it alive.

Functional property (invariant ``kv-readback``): reading a live sequence through its block
table yields its own token at every position its next token attends.  Count-based
invariants cannot see wrong sharing, a missed copy-on-write or a wrong eviction; this can.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

from .state import DROPPED, Device, KVState, SeqModel, TableView
from .violation import Violation, fact
from .window import block_of, first_needed_position

Cell = tuple[Device, int, int]
KV = tuple[int, int]
"""What a slot holds: (position, token).  KV depends on both (rotary position encoding), so
the same token written at another position is different content."""
Memory = Mapping[Cell, KV]


@attrs.frozen
class Write:
    cell: Cell
    kv: KV


UNMAPPED = "unmapped"  # a position the step computes has no slot
OVERWRITE = "overwrite"  # a slot written twice in one block lifetime
SHARED_WRITE = "shared-write"  # a write into a block other slots hold (no copy-on-write)
CACHED_WRITE = "cached-write"  # a write contradicting the prefix-cache key of the block
COPY_OVERWRITE = "copy-overwrite"  # a block copy overwriting live content
FaultKind = Literal["unmapped", "overwrite", "shared-write", "cached-write", "copy-overwrite"]


@attrs.frozen
class WriteFault:
    """A fact about one planned write that some invariant forbids; which one is the invariant
    functions' business (spec/invariants.py: ``immutability``, ``admission-soundness``).

    ``positions``: the position written first, then (an overwrite) the one it overwrites;
    ``expected``/``observed``: the (position, token) a slot should keep and the one written
    (an overwrite, a write against a cached key), or the holders a written block should have
    and has (a missed copy-on-write)."""

    kind: FaultKind
    message: str
    seq: int | None = None
    device: str = ""
    blocks: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    expected: Any = None
    observed: Any = None
    detail: str = ""  # the violation's kind when it is narrower than the fault's: "no-table"

    def violation(self) -> Violation:
        """The fault as a violation's facts, its kind the fault's (or its ``detail``)."""
        return fact(
            self.detail or self.kind,
            self.message,
            seqs=() if self.seq is None else (self.seq,),
            device=self.device,
            blocks=self.blocks,
            positions=self.positions,
            expected=self.expected,
            observed=self.observed,
        )


# ---------------------------------------------------------------- accessors


def cell_of(table: TableView, position: int, block_size: int) -> Cell | None:
    """The memory cell position ``position`` of this table lives in, or None if unmapped."""
    index = block_of(position, block_size)
    slots = table.slots
    if index >= len(slots) or slots[index] is DROPPED:
        return None
    return (table.device, slots[index], position % block_size)


def block_contents(memory: Memory, device: Device, block: int, block_size: int) -> list[KV | None]:
    return [memory.get((device, block, off)) for off in range(block_size)]


# ---------------------------------------------------------------- transitions


def plan_step_writes(
    state: KVState,
    seq: SeqModel,
    start: int,
    end: int,
    block_size: int,
    memory: Memory,
    before: KVState | None = None,
    dead: set[tuple[Device, int]] | None = None,
) -> tuple[list[Write], list[WriteFault]]:
    """The writes a step computing positions ``start .. end-1`` performs, and their faults.

    Immutability: a slot is written at most once per block lifetime (a full block is never
    overwritten in place -- BlockSpaceManagerV1's sliding-window reuse does exactly that),
    and a block that is shared or registered in the prefix cache is never written (a write
    into it must go through copy-on-write first).  Rewriting a slot with the very KV it
    holds (same position, same token: a recompute) changes nothing and is allowed, so is
    rewriting a position past the block's key in a block only the writer holds
    (``_sole_rewrite_past_key``: legacy V1's partial-key sharing), and so is
    filling an empty slot of a cached block with exactly the KV its key claims (legacy vLLM
    and V1 register a block's key when they allocate it, before the worker computes it),
    shared or not (V1 shares such a block with a request of the same step).
    "Registered" means registered before the step and still the same block after it
    (``before``, when given; ``dead``: ``ended_lifetimes(before, state)`` if already known).
    """
    table = state.tables.get(seq.seq_id)
    writes: list[Write] = []
    faults: list[WriteFault] = []
    if table is None:
        faults.append(WriteFault(UNMAPPED, f"seq {seq.seq_id} has no block table", seq.seq_id, detail="no-table"))
        return writes, faults
    pool = state.pool(table.device)
    cached = registered_through(before or state, state, table.device, dead)
    for pos in range(start, end):
        cell = cell_of(table, pos, block_size)
        if cell is None:
            faults.append(
                WriteFault(
                    UNMAPPED,
                    f"seq {seq.seq_id}: the step was accepted but position {pos} has no slot "
                    f"(table has {len(table.slots)} slots)",
                    seq.seq_id,
                    table.device.value,
                    positions=(pos,),
                )
            )
            continue
        _, block, off = cell
        kv = (pos, seq.tokens[pos])
        writes.append(Write(cell, kv))
        if memory.get(cell) == kv:
            continue
        refcount = pool.refcounts.get(block, 0) if pool is not None else 0
        claimed = _claimed(cached.get(block), off, block_size)
        if cell in memory and not _sole_rewrite_past_key(
            memory[cell], kv, refcount, claimed, state, seq.seq_id, cell
        ):
            was_pos, was_token = memory[cell]
            faults.append(
                WriteFault(
                    OVERWRITE,
                    f"seq {seq.seq_id}: writing position {pos} into block {block} slot {off} "
                    f"overwrites position {was_pos} (token {was_token}) written there in this "
                    f"block's life",
                    seq.seq_id,
                    table.device.value,
                    (block,),
                    (pos, was_pos),
                    expected=(was_pos, was_token),
                    observed=kv,
                )
            )
        # Filling an empty slot of a shared block with exactly what its cache key claims is
        # no change to what any sharer reads: V1's scheduler hands a block it cached at
        # allocation to a second request of the same step, which reads it after the step's
        # KV writes (Scheduler.schedule -> KVCacheManager.allocate_slots caching up to the
        # scheduled tokens, vllm/v1/core/kv_cache_manager.py).
        if refcount > 1 and not (cell not in memory and claimed == kv):
            faults.append(
                WriteFault(
                    SHARED_WRITE,
                    f"seq {seq.seq_id}: writing position {pos} into block {block}, shared by "
                    f"{refcount} slots (missed copy-on-write)",
                    seq.seq_id,
                    table.device.value,
                    (block,),
                    (pos,),
                    expected=1,
                    observed=refcount,
                )
            )
        if claimed is not None and claimed != kv:
            faults.append(
                WriteFault(
                    CACHED_WRITE,
                    f"seq {seq.seq_id}: writing position {pos} (token {kv[1]}) into block "
                    f"{block} slot {off}, which the prefix cache holds as position {claimed[0]} "
                    f"token {claimed[1]}",
                    seq.seq_id,
                    table.device.value,
                    (block,),
                    (pos,),
                    expected=claimed,
                    observed=kv,
                )
            )
    return writes, faults


def _other_holders(state: KVState, seq_id: int, device: Device, block: int) -> int:
    """Block tables other than ``seq_id``'s that map a position to ``block``."""
    return sum(
        1 for sid, t in state.tables.items() if sid != seq_id and t.device == device and block in t.slots
    )


def _sole_rewrite_past_key(
    was: KV, kv: KV, refcount: int, claimed: KV | None, state: KVState, seq_id: int, cell: Cell
) -> bool:
    """Whether rewriting a slot changes nothing any reader can see: the same position, in a
    block only the writer holds, past every key the block is cached under.  Legacy
    BlockSpaceManagerV1 with prefix caching shares a partly filled block by its partial key
    (0.6.3 block_manager_v1.py:332-335), whose later slots may already hold the first
    holder's own tokens; when that holder appends it copies the block on write and leaves
    (:490-500), and the remaining holder then writes its own tokens into those slots.  Only
    a table mapping that position to the block could read the old value, and only the writer's
    does; no key covers the slot.  A write at another position (F3's cyclic reuse) or into a
    block others hold (by refcount or by their tables) is still a fault."""
    # The other tables are walked last, and only for a rewrite that passes the cheap tests.
    return (
        was[0] == kv[0]
        and refcount == 1
        and claimed is None
        and _other_holders(state, seq_id, cell[0], cell[1]) == 0
    )


def _claimed(key, off: int, block_size: int) -> KV | None:
    """The KV a cached block's key says slot ``off`` holds (None past a partial key)."""
    if key is None:
        return None
    tokens = key.block_tokens(block_size)
    if off >= len(tokens):
        return None
    return (key.block_index(block_size) * block_size + off, tokens[off])


def ended_lifetimes(before: KVState, after: KVState) -> set[tuple[Device, int]]:
    """Blocks whose content died during an operation (freed, or evicted and reallocated).

    With allocation epochs a block's content dies exactly when it is handed out again.
    Without them, a block freed and re-allocated within one operation is invisible; the
    free list and the cache map are all there is to go by.
    """
    dead: set[tuple[Device, int]] = set()
    if before is after or before == after:  # nothing changed: no life ended
        return dead
    for device in Device:
        pool_after = after.pool(device)
        pool_before = before.pool(device)
        if pool_after is None:
            continue
        if (
            pool_before is not None
            and pool_before.epochs is not None
            and pool_after.epochs is not None
        ):
            for block, epoch in pool_after.epochs.items():
                if pool_before.epochs.get(block) != epoch:
                    dead.add((device, block))
        cached_after = pool_after.cached_key_of()
        # A block that was already free and uncached before the operation lost its content
        # when it got there; counting it again would make every step cost O(pool).
        cached_before = pool_before.cached_key_of() if pool_before is not None else {}
        already = (
            set()
            if pool_before is None
            else {b for b in pool_before.free if b not in cached_before}
        )
        for block in pool_after.free:
            if block not in cached_after and block not in already:
                dead.add((device, block))
        if pool_before is None:
            continue
        for block, key in cached_before.items():
            unreferenced = pool_before.refcounts.get(block, 0) == 0
            if unreferenced and cached_after.get(block) != key:
                dead.add((device, block))
        if pool_before.epochs is None or pool_after.epochs is None:
            dead |= _rehomed(before, after, device, cached_before, cached_after)
    return dead


def _rehomed(before: KVState, after: KVState, device: Device, cached_before, cached_after):
    """Without epochs: a block that now sits in table slots none of which held it before,
    while none of its earlier slots still hold it, was released and handed out again (a
    sliding-window drop followed by an allocation inside one operation).  A cache hit on
    content that stayed registered is not a new life."""

    def holders(state: KVState) -> dict[int, set[tuple[int, int]]]:
        out: dict[int, set[tuple[int, int]]] = {}
        for sid, table in state.tables.items():
            if table.device is device:
                for i, b in enumerate(table.slots):
                    if b is not None:
                        out.setdefault(b, set()).add((sid, i))
        return out

    if all(before.tables.get(sid) == table for sid, table in after.tables.items()):
        return set()  # no table took a block anywhere new
    was, now = holders(before), holders(after)
    return {
        (device, b)
        for b, slots in now.items()
        if b in was
        and not (slots & was[b])
        and not (b in cached_before and cached_after.get(b) == cached_before[b])
    }


def registered_through(
    before: KVState, after: KVState, device: Device, dead: set | None = None
) -> dict:
    """Blocks (with their keys) in the prefix cache before an operation that are still the
    same cached block (same key, same life) after it."""
    pb, pa = before.pool(device), after.pool(device)
    if pb is None or pa is None:
        return {}
    if dead is None:
        dead = ended_lifetimes(before, after)
    dead = {b for d, b in dead if d is device}
    keys_after = pa.cached_key_of()
    return {b: k for b, k in pb.cached_key_of().items() if keys_after.get(b) == k and b not in dead}


def copy_cells(
    memory: Memory, src: tuple[Device, int], dst: tuple[Device, int], block_size: int, below: int | None = None
) -> list[Write]:
    """Writes a block copy (copy-on-write, swap) performs.

    ``below``: the copy is the copy-on-write of a partial prefix hit, into the private block
    of a request that hit ``below`` tokens; the source slots holding positions from ``below``
    on are left out.  vLLM 0.33.0's worker copies the whole block (worker/utils.py:909-955,
    ``blocks[dst] = blocks[src]``, run before the forward, gpu_model_runner.py:1207-1212), so
    those slots of the destination hold the source holder's later tokens; but they are no
    content of the destination's life: the hit request takes the copy as computed only up to
    its hit (single_type_kv_cache_manager.py:320-324 caps its cached blocks below the tail,
    388-398 and 455-475 give it the copy), no key covers them when the copy runs, and the
    request writes them itself before it reads them.  Garbage, like a rejected draft's KV: left
    unwritten, so the request's own write there is a first write, while a copy that misses
    the hit's positions still fails ``kv-readback``."""
    out = []
    for off in range(block_size):
        kv = memory.get((src[0], src[1], off))
        if kv is not None and (below is None or kv[0] < below):
            out.append(Write((dst[0], dst[1], off), kv))
    return out


def starts_no_life(state: KVState, device: Device, block: int) -> bool:
    """A copy into ``block`` starts no life there when the operation that reported the copy
    leaves the block free, uncached and in no table: nothing can read what the copy writes,
    and the next allocation that hands the block out starts a new life.  Legacy
    BlockSpaceManagerV2 reports such a copy: copy-on-write into a fresh block, which
    ``promote_to_immutable_block`` then frees in the same call because its content is already
    cached, while ``append_slots`` still returns the copy (0.6.3 vllm/core/block/naive_block.py:381-383,
    prefix_caching_block.py:453-460 and 464-487, block_manager_v2.py:245)."""
    pool = state.pool(device)
    if pool is None or block not in pool.free or block in pool.cached_key_of():
        return False
    return not any(table.device is device and block in table.slots for table in state.tables.values())


def copy_overwrites(
    memory: Memory, src: tuple[Device, int], dst: tuple[Device, int], writes: Iterable[Write]
) -> list[WriteFault]:
    """The faults of a block copy's writes (``copy_cells``): a destination slot holding other
    live content is overwritten."""
    return [
        WriteFault(
            COPY_OVERWRITE,
            f"copying {src[0].value} block {src[1]} into {dst[0].value} block {dst[1]} "
            f"overwrites live content at slot {w.cell[2]}",
            device=dst[0].value,
            blocks=(src[1], dst[1]),
            expected=memory[w.cell],
            observed=w.kv,
        )
        for w in writes
        if w.cell in memory and memory[w.cell] != w.kv
    ]


# ---------------------------------------------------------------- predicates


def readback_faults(
    table: TableView, seq: SeqModel, block_size: int, window: int | None, memory: Memory
) -> Iterable[Violation]:
    """Positions the sequence's next token attends whose slot does not hold its own token."""
    lo = first_needed_position(seq.num_computed, window)
    slots, device, tokens = table.slots, table.device, seq.tokens
    for pos in range(lo, seq.num_computed):
        # The common case first, inlined (cell_of): this runs for every attended position of
        # every live sequence after every operation.
        index = pos // block_size
        block = slots[index] if index < len(slots) else DROPPED
        if block is not DROPPED and memory.get((device, block, pos % block_size)) == (
            pos,
            tokens[pos],
        ):
            continue
        cell = cell_of(table, pos, block_size)
        got = memory.get(cell) if cell is not None else None
        if cell is None:
            yield fact(
                "no-slot",
                f"seq {seq.seq_id}: attended position {pos} has no slot (dropped or missing)",
                seqs=(seq.seq_id,),
                device=device.value,
                positions=(pos,),
            )
            continue
        if got != (pos, seq.tokens[pos]):
            shown = "nothing written" if got is None else f"position {got[0]} token {got[1]}"
            yield fact(
                "wrong-kv",
                f"seq {seq.seq_id}: position {pos} reads {shown} from block {cell[1]} "
                f"slot {cell[2]}, expected its own token {seq.tokens[pos]}",
                seqs=(seq.seq_id,),
                device=device.value,
                blocks=(cell[1],),
                positions=(pos,),
                expected=(pos, seq.tokens[pos]),
                observed=got,
            )


# ---------------------------------------------------------------- recurrent state (Mamba)

STATE_SLOT = 0
"""The one cell of a state block: a Mamba layer's block holds one state (SSM and conv state
after some number of tokens), not one KV per position."""


def state_of(tokens: Sequence[int]) -> KV:
    """The recurrent state after exactly ``tokens``: it depends on every token and on how
    many there are, so it is named by the count and a digest of the chain (a tuple of ints
    hashes the same in every process)."""
    return (len(tokens), hash(tuple(tokens)))


def state_block(table: TableView, num_tokens: int, block_size: int) -> int | None:
    """The block holding the state after ``num_tokens`` tokens: slot ``(n - 1) // B`` holds the
    state after a prefix ending inside its block (vLLM 0.33.0 sched/scheduler.py:604-607,
    "slot p holds the state after exactly (p + 1) * block_size tokens"); None: no real block."""
    index = block_of(num_tokens - 1, block_size)
    if num_tokens < 1 or index >= len(table.slots):
        return None
    return table.slots[index]


def plan_state_write(
    state: KVState,
    seq: SeqModel,
    end: int,
    block_size: int,
    memory: Memory,
    before: KVState | None = None,
) -> tuple[list[Write], list[WriteFault]]:
    """The write of a step that leaves the state after ``end`` tokens, and its faults.

    The state goes into ``state_block(table, end)``.  Rewriting it in place is the rule, not an
    overwrite: the running state advances in its block until the block is full ("align" mode
    hands a decode step no new block, single_type_kv_cache_manager.py:1827-1833; "none" mode has
    one block per request).  A block registered in the prefix cache (before the step and still
    after it) claims the state after exactly its key's chain, and a shared block is read by
    its other holders: writing any other state into either is a fault.
    """
    table = state.tables.get(seq.seq_id)
    block = None if table is None else state_block(table, end, block_size)
    if table is None or block is None:
        shown = "no block table" if table is None else f"{len(table.slots)} slots"
        return [], [
            WriteFault(
                UNMAPPED,
                f"seq {seq.seq_id}: the step leaves the state after {end} tokens but slot "
                f"{(end - 1) // block_size} has no block ({shown})",
                seq.seq_id,
                positions=(end - 1,),
                detail="no-state-block",
            )
        ]
    kv = state_of(seq.tokens[:end])
    cell = (table.device, block, STATE_SLOT)
    faults = []
    key = registered_through(before or state, state, table.device).get(block)
    claimed = None if key is None else state_of(key.chain)
    if claimed is not None and claimed != kv:
        faults.append(
            WriteFault(
                CACHED_WRITE,
                f"seq {seq.seq_id}: writing the state after {end} tokens into block {block}, "
                f"which the prefix cache holds as the state after {claimed[0]} tokens",
                seq.seq_id,
                table.device.value,
                (block,),
                expected=claimed[0],
                observed=end,
            )
        )
    pool = state.pool(table.device)
    refcount = pool.refcounts.get(block, 0) if pool is not None else 0
    if refcount > 1 and memory.get(cell, claimed) != kv:
        faults.append(
            WriteFault(
                SHARED_WRITE,
                f"seq {seq.seq_id}: writing the state after {end} tokens into block {block}, "
                f"shared by {refcount} slots",
                seq.seq_id,
                table.device.value,
                (block,),
                expected=1,
                observed=refcount,
            )
        )
    return [Write(cell, kv)], faults


def state_readback_faults(
    table: TableView, seq: SeqModel, block_size: int, memory: Memory
) -> Iterable[Violation]:
    """The state the sequence's next token reads: the state after exactly its computed tokens,
    in ``state_block``."""
    p = seq.num_computed
    if p < 1:
        return
    block = state_block(table, p, block_size)
    if block is None:
        yield fact(
            "no-state-block",
            f"seq {seq.seq_id}: the state after its {p} computed tokens has no block",
            seqs=(seq.seq_id,),
            positions=(p - 1,),
        )
        return
    got = memory.get((table.device, block, STATE_SLOT))
    if got != state_of(seq.tokens[:p]):
        shown = "nothing written" if got is None else f"the state after {got[0]} tokens"
        yield fact(
            "wrong-kv",
            f"seq {seq.seq_id}: block {block} holds {shown}, expected the state after its "
            f"{p} computed tokens",
            seqs=(seq.seq_id,),
            device=table.device.value,
            blocks=(block,),
            positions=(p - 1,),
            expected=p,
            observed=None if got is None else got[0],
        )
