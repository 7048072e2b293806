"""The named invariants.  One ID names the spec function, the machine check, the z3
obligation and the report line.

Each invariant is a small function yielding the violations it finds, each with its facts
(``spec.violation``: kind, sequences, blocks, positions, expected and observed) and a plain
sentence made from them, and every violation of an ID comes from that ID's function.  An invariant also
states when it applies: a function of the configuration that gives the reason it says nothing
(window-bound without a sliding window), read by ``check_world``, the command line's table and
``kvspec explain``.  State invariants look at a ``World`` after every operation; transition
invariants look at one operation: a refusal's before/after and an accepted step's writes
(admission-soundness), the worker's writes (immutability; the write facts come from
``kv_memory.plan_step_writes``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet

import attrs

from .admission import (
    AdmissionFacts,
    HitFacts,
    ProgressFacts,
    ReserveFacts,
    may_answer_never,
    must_admit,
    reserve_refusal_allowed,
)
from .kv_memory import UNMAPPED, WriteFault, block_contents, readback_faults
from .prefix_hash import PrefixKey, is_well_formed
from .registry import (
    INVARIANTS,
    Violation,
    invariant,
    live_tables,
    needs_prefix_caching,
    needs_window,
    pools,
)
from .state import Device, KVState, PoolView, SeqModel, Status, TableView, World
from .violation import PoolFacts, fact
from .window import blocks_for_tokens, window_cover

# A reported usage is a float ``1 - free / total`` (V1 block_pool.py:921-932): equal to the
# exact share up to rounding, and any miscount is at least one block in a pool of far fewer
# than a billion.
USAGE_TOLERANCE = 1e-9

# ---------------------------------------------------------------- state invariants


@invariant(
    "refcount-exact",
    "Refcounts are exact",
    "BlockPool/KVCacheBlock.ref_cnt (V1), RefCounter in vllm/core/block/common.py, "
    "PhysicalTokenBlock.ref_count (BlockSpaceManagerV1)",
)
def refcount_exact(world: World) -> Iterator[Violation]:
    """A block's refcount equals the number of live block-table slots holding it.

    Too high leaks the block forever; too low frees it while a sequence still reads it.
    """
    for device, pool in pools(world.state):
        holders: Counter[int] = Counter()
        for table in live_tables(world, device):
            holders.update(table.held())
        for block in sorted(set(holders) | set(pool.refcounts)):
            want = holders.get(block, 0)
            holding = tuple(sorted(t.seq_id for t in live_tables(world, device) if block in t.slots))
            fault = refcount_fault(device, block, want, pool.refcounts.get(block), holding)
            if fault is not None:
                yield fault


def refcount_fault(
    device: Device, block: int, want: int, got: int | None, holding: tuple[int, ...] = ()
) -> Violation | None:
    """``refcount-exact`` on one block: ``want`` live slots hold it (those of ``holding``), the
    pool says ``got`` (None: the pool has no such block)."""
    if got is None:
        if not want:
            return None
        return fact(
            "not-in-pool",
            f"{device.value} block {block} is held by a table but is not in the pool",
            seqs=holding,
            device=device.value,
            blocks=(block,),
        )
    if got != want:
        return fact(
            "wrong-refcount",
            f"{device.value} block {block} has refcount {got} but {want} live block-table slot(s) hold it",
            seqs=holding,
            device=device.value,
            blocks=(block,),
            expected=want,
            observed=got,
        )
    return None


@invariant(
    "conservation",
    "Blocks are conserved",
    "FreeKVCacheBlockQueue and BlockPool (V1), NaiveBlockAllocator/PrefixCachingBlockAllocator "
    "free lists and evictor (legacy)",
)
def conservation(world: World) -> Iterator[Violation]:
    """Free + evictable + in-use is exactly the pool, pairwise disjoint; nothing is freed twice
    and no block id is out of range.  A free block is not in the prefix-cache map: the next
    allocation may overwrite it while a lookup still hands it out (unreferenced cached
    blocks are evictable, not free).  The usage a pool reports is the share of its blocks in
    use: free and evictable blocks are both reclaimable (V1 ``BlockPool.get_usage``, 0.33.0
    block_pool.py:921-932, counts every block on the free queue, cached or not).
    """
    for device, pool in pools(world.state):
        ids = set(pool.ids)
        on_free = Counter(pool.free)
        evictable, in_use, cached = set(pool.evictable), pool.in_use(), pool.cached_key_of()
        for block in sorted(ids | set(on_free) | evictable | in_use):
            yield from block_conservation(
                device, block, in_pool=block in ids, on_free=on_free.get(block, 0),
                evictable=block in evictable, in_use=block in in_use, cached=block in cached,
            )
        fault = usage_fault(device, pool, len(in_use & ids))
        if fault is not None:
            yield fault


def usage_fault(device: Device, pool: PoolView, used: int) -> Violation | None:
    """``conservation`` on a pool's reported KV-cache usage: the share of its blocks in use
    (``used`` of them; None when the pool reports no usage)."""
    total = len(pool.ids)
    if pool.usage is None or not total:
        return None
    share = used / total
    if abs(pool.usage - share) <= USAGE_TOLERANCE:
        return None
    return fact(
        "wrong-usage",
        f"{device.value} pool reports usage {pool.usage:.4f} but {used} of its {total} blocks are in use "
        f"({share:.4f})",
        device=device.value,
        expected=share,
        observed=pool.usage,
    )


def block_conservation(
    device: Device, block: int, *, in_pool: bool, on_free: int, evictable: bool, in_use: bool, cached: bool
) -> Iterator[Violation]:
    """``conservation`` on one block: ``on_free`` is how many times the free list holds it,
    ``cached`` whether the prefix-cache map names it."""
    name, free = device.value, on_free > 0

    def found(kind: str, message: str, **facts: object) -> Violation:
        return fact(kind, message, device=name, blocks=(block,), **facts)

    if on_free > 1:
        yield found("double-free", f"{name} block {block} is on the free list {on_free} times (double free)",
                    expected=1, observed=on_free)
    if not in_pool:
        for label, member in (("free", free), ("evictable", evictable), ("in-use", in_use)):
            if member:
                yield found("out-of-range", f"{name} {label} block {block} is out of the pool's id range",
                            observed=label)
    for a, b, in_a, in_b in (
        ("free", "in-use", free, in_use),
        ("evictable", "in-use", evictable, in_use),
        ("free", "evictable", free, evictable),
    ):
        if in_a and in_b:
            yield found("in-two-sets", f"{name} block {block} is both {a} and {b}", observed=(a, b))
    if in_pool and not (free or evictable or in_use):
        yield found("lost", f"{name} block {block} is lost: not free, not evictable and not in use")
    if evictable and not cached:
        yield found("evictable-uncached", f"{name} block {block} is evictable but holds no cached content")
    if free and cached:
        yield found("free-but-cached", f"{name} block {block} is on the free list yet still in the prefix-cache map")


@invariant(
    "no-leak",
    "No leaks",
    "free()/free_block_table() in every block manager; KVCacheManager.free (V1)",
)
def no_leak(world: World) -> Iterator[Violation]:
    """Freeing every sequence returns every block: with no live sequence, no block is in use,
    and a freed sequence keeps no block table.
    """
    for seq_id, table in world.state.tables.items():
        fault = freed_table_fault(table, world.seqs.get(seq_id))
        if fault is not None:
            yield fault
    if any(s.status is not Status.WAITING for s in world.seqs.values()):
        return
    for device, pool in pools(world.state):
        fault = idle_pool_fault(device, pool)
        if fault is not None:
            yield fault


def freed_table_fault(table: TableView, seq: SeqModel | None) -> Violation | None:
    """``no-leak`` on one block table: its sequence is gone or waiting, yet it holds blocks."""
    if (seq is None or seq.status is Status.WAITING) and table.held():
        return fact(
            "freed-holds",
            f"seq {table.seq_id} was freed but still holds blocks {list(table.held())}",
            seqs=(table.seq_id,),
            device=table.device.value,
            blocks=table.held(),
            expected=0,
            observed=len(table.held()),
        )
    return None


def idle_pool_fault(device: Device, pool: PoolView) -> Violation | None:
    """``no-leak`` on a pool while no sequence is live: no block may be in use."""
    in_use = sorted(pool.in_use())
    if not in_use:
        return None
    return fact(
        "in-use-when-idle",
        f"no sequence is live, yet {device.value} blocks {in_use} are still in use "
        f"(refcounts {[pool.refcounts[b] for b in in_use]})",
        device=device.value,
        blocks=in_use,
        expected=0,
        observed=[pool.refcounts[b] for b in in_use],
    )


@invariant(
    "window-bound",
    "Sliding-window sequences hold only their window",
    "BlockSpaceManagerV2.can_allocate/max_block_sliding_window and BlockTable.append_token_ids "
    "(legacy), BlockSpaceManagerV1 block_sliding_window, SlidingWindowManager (V1)",
    applies=needs_window,
)
def window_bound(world: World) -> Iterator[Violation]:
    """A sliding-window sequence holds no more blocks than the most that the window and the
    tokens of its current step can touch: ``ceil((W - 1 + k - 1) / B) + 1`` for a step of k
    tokens, which is ``ceil((W - 1) / B) + 1`` for a decode step -- and never more than its
    tokens fill.
    """
    if world.config.sliding_window is None:  # not applicable (needs_window); a direct call says nothing
        return
    for table in live_tables(world, Device.GPU):
        fault = window_fault(world, table)
        if fault is not None:
            yield fault


def window_fault(world: World, table: TableView) -> Violation | None:
    """``window-bound`` on one live GPU block table (a sliding window configured)."""
    window, block_size = world.config.sliding_window, world.config.block_size
    assert window is not None
    seq = world.seqs[table.seq_id]
    start, end = seq.step
    scheduled = max(1, end - start)
    bound = min(window_cover(window + scheduled - 1, block_size), blocks_for_tokens(end, block_size))
    held = len(table.held())
    if held > bound:
        return fact(
            "over-window",
            f"seq {seq.seq_id} holds {held} blocks but a step over positions {start}..{end - 1} "
            f"with window {window} needs at most {bound} (block size {block_size})",
            seqs=(seq.seq_id,),
            device=Device.GPU.value,
            blocks=table.held(),
            expected=bound,
            observed=held,
        )
    return None


@invariant(
    "prefix-cache-consistency",
    "The prefix cache tells the truth",
    "PrefixCachingBlockAllocator and its computed-block tracking (legacy), "
    "BlockPool.cached_block_hash_to_block / get_cached_block (V1)",
    applies=needs_prefix_caching,
)
def prefix_cache_consistency(world: World) -> Iterator[Violation]:
    """Every cached key maps to blocks holding exactly that key's tokens, and a block a lookup
    may hand out has its KV written.

    Freedoms: one key may map to several blocks (V1's BlockPool keeps duplicates, NOTE #1 in
    vllm/v1/core/block_pool.py), each holding the key's tokens; a partial last block may be
    cached under its partial chain (legacy BlockSpaceManagerV1) if its first slots hold exactly
    those; the slots past the key may fill later.  Every entry names a block of the pool:
    never the null block (vLLM 0.10.1.1-0.12.0 cache it, FINDINGS V1-S2b; broken variant
    ``caches-the-null-block``).

    Partial keys: a partial entry claims its own tokens only, and that claim is what is checked,
    in every state -- so a superseded partial key left behind when its block is promoted and
    later reused names someone else's tokens and is caught (broken variant
    ``unretired-partial``).  A retired partial key may come back on a block that still holds
    its tokens: 0.33.0 ``BlockPool.cache_partial_block`` registers a partial entry on a block
    that already has a full primary hash (block_pool.py:495-505), so content, not history,
    decides.  Promotion retires a block's partial keys (block_pool.py:288-297,
    ``_remove_cached_block_hashes``) with their ``BlockRemoved`` events (``event-consistency``).
    """
    for device, pool in pools(world.state):
        pool_blocks = set(pool.ids)
        for key, block in pool.cached:
            fault = cache_entry_fault(world, device, pool, pool_blocks, key, block)
            if fault is not None:
                yield fault


def cache_entry_fault(
    world: World, device: Device, pool: PoolView, pool_blocks: AbstractSet[int], key: PrefixKey, block: int
) -> Violation | None:
    """``prefix-cache-consistency`` on one entry of the map: ``key`` names ``block``."""
    block_size = world.config.block_size
    if block not in pool_blocks:
        # The null block (or an id the pool does not hold): nothing is written there,
        # so the content checks below cannot see it, yet a lookup would hand it out.
        return fact(
            "not-a-pool-block",
            f"{device.value} block {block} is cached under a {len(key.chain)}-token "
            "key but is not a block of the pool (the null block or an unknown id)",
            device=device.value,
            blocks=(block,),
        )
    if not is_well_formed(key, block_size):
        return fact("empty-key", f"{device.value} block {block} is cached under an empty key",
                    device=device.value, blocks=(block,))
    want = list(key.block_tokens(block_size))
    first = key.block_index(block_size) * block_size
    expected = [(first + i, t) for i, t in enumerate(want)]
    got = block_contents(world.memory, device, block, block_size)
    written = [(i, g) for i, g in enumerate(got) if g is not None]
    # A partial key claims only its own tokens; slots past it may fill later.
    if any(i < len(expected) and g != expected[i] for i, g in written):
        return fact(
            "wrong-content",
            f"{device.value} block {block} is cached as tokens {want} but holds {got}",
            device=device.value,
            blocks=(block,),
            expected=want,
            observed=got,
        )
    if block in pool.computed and None in got[: len(want)]:
        return fact(
            "uncomputed-hit",
            f"{device.value} block {block} can be handed out as a cache hit for {want} "
            f"but its KV is only allocated, not written ({got})",
            device=device.value,
            blocks=(block,),
            expected=want,
            observed=got,
        )
    return None


@invariant(
    "kv-readback",
    "Every sequence reads back its own tokens",
    "slot mapping from block tables: legacy compute_slot_mapping, V1 BlockTable.compute_slot_mapping",
)
def kv_readback(world: World) -> Iterator[Violation]:
    """Reading a live sequence through its block table yields exactly its own token at every
    position its next token attends (every position, or the window).
    """
    for table in live_tables(world, Device.GPU):
        seq = world.seqs[table.seq_id]
        yield from readback_faults(
            table, seq, world.config.block_size, world.config.sliding_window, world.memory
        )
    for seq in world.seqs.values():
        fault = tableless_fault(seq, seq.seq_id in world.state.tables)
        if fault is not None:
            yield fault


def tableless_fault(seq: SeqModel, has_table: bool) -> Violation | None:
    """``kv-readback`` on a running sequence without a block table: it has nothing to read; on a
    sequence whose KV a connector is still sending: the transfer reads blocks already freed."""
    if seq.status is Status.SENDING and not has_table and seq.num_computed:
        return fact(
            "freed-while-sending",
            f"seq {seq.seq_id} finished and its KV is still being sent, but its blocks were freed "
            f"(the transfer reads {seq.num_computed} positions from blocks the pool may hand out)",
            seqs=(seq.seq_id,),
        )
    if seq.status is Status.RUNNING and not has_table and seq.num_computed:
        return fact(
            "no-table",
            f"seq {seq.seq_id} is running with {seq.num_computed} computed tokens but has no block table",
            seqs=(seq.seq_id,),
        )
    return None


# ---------------------------------------------------------------- transition invariants


@invariant(
    "admission-soundness",
    "Admission is sound and refusals are clean",
    "BlockSpaceManagerV2.can_allocate vs allocate (the seed issue), "
    "KVCacheManager.allocate_slots (V1)",
    kind="transition",
)
def admission_soundness(
    answered_ok: bool | None = None,
    error: Exception | None = None,
    before: KVState | None = None,
    after: KVState | None = None,
    first_needed: Mapping[int, int] | None = None,
    unmapped: Iterable[WriteFault] = (),
    seq: int | None = None,
    need: int | None = None,
    device: Device = Device.GPU,
) -> Iterator[Violation]:
    """An admission check that answers OK is followed by an allocation that succeeds, and a
    refused or failed allocation leaves the state unchanged.

    Three observations of it: a refusal by the check itself (``answered_ok`` False, no
    ``error``) changes nothing at all; a failed allocation (``error``) after an OK answer is
    unsound, and leaves the state unchanged; an accepted step maps every position it computes
    to a slot (``unmapped``: the write plan's positions that have none).

    Freedom: a failed allocation may still release slots a sliding window no longer needs
    (those before ``first_needed[seq]``); V1's ``allocate_slots`` frees them "even if we cannot
    schedule" (vllm/v1/core/kv_cache_manager.py).

    Facts: the sequence (``seq``), the pool the operation allocates from (``device``: the CPU
    pool for a swap-out) as it met it, the need kvspec computes for it (``need``, when the driver
    knows it) and the blocks the failed allocation took there.
    """
    for fault in unmapped:
        if fault.kind == UNMAPPED:
            yield fault.violation()
    if before is None or after is None:
        return
    seqs = () if seq is None else (seq,)
    was, now = before.pool(device), after.pool(device)
    if was is None or now is None:
        device, was, now = Device.GPU, before.gpu, after.gpu
    met = PoolFacts(len(was.free), len(was.evictable), len(was.ids))
    taken = _taken(was, now)
    # Equal states satisfy both comparisons below, and most refusals change nothing.
    same = before == after
    if error is None:
        if answered_ok is False and not same and normalized(before) != normalized(after):
            yield fact(
                "refusal-changed-state",
                f"an admission check that refused changed the state: {_state_diff(before, after)}",
                seqs=seqs, device=device.value, pool=met, need=need, taken=taken,
            )
        return
    if answered_ok:
        yield fact(
            "ok-then-failed",
            f"the admission check answered OK, then the allocation failed: {type(error).__name__}: {error}",
            seqs=seqs, device=device.value, pool=met, need=need, taken=taken,
            expected="the allocation succeeds", observed=type(error).__name__,
        )
    if not same and not unchanged_but_window_drops(before, after, first_needed or {}):
        yield fact(
            "failure-changed-state",
            f"a refused/failed allocation changed the state: {_state_diff(before, after)}",
            seqs=seqs, device=device.value, pool=met, need=need, taken=taken,
        )


@invariant(
    "immutability",
    "Written blocks are immutable",
    "BlockSpaceManagerV1 sliding-window reuse (block_table[i % block_sliding_window]), "
    "copy-on-write in legacy BlockTable/CopyOnWriteTracker",
    kind="transition",
)
def immutability(faults: Iterable[WriteFault]) -> Iterator[Violation]:
    """A block that is full, shared or in the prefix cache never has its contents changed: each
    slot is written at most once per block lifetime, and a write into a shared or cached block
    goes through copy-on-write.

    ``faults`` are the write facts of one operation (``kv_memory.plan_step_writes``,
    ``kv_memory.copy_overwrites``): every kind but an unmapped position breaks this.
    """
    for fault in faults:
        if fault.kind != UNMAPPED:
            yield fault.violation()


@invariant(
    "admission-completeness",
    "What fits is admitted",
    "BlockSpaceManagerV1/V2.can_allocate watermark and NEVER (legacy), "
    "KVCacheManager.allocate_slots full_sequence_must_fit and watermark (V1)",
    kind="transition",
)
def admission_completeness(facts: AdmissionFacts) -> Iterator[Violation]:
    """An admission whose need (``spec.admission.admission_need``), plus the prefix hits it
    revives from the evictable set, plus the target's declared reserve, fits the free and
    evictable blocks is answered OK and succeeds; NEVER only when the sequence alone, plus the
    reserve, exceeds the whole pool.

    The need and the reserve are what the target's ``AdmissionPolicy`` declares (legacy
    watermark and whole-prompt counting, V1 ``full_sequence_must_fit``), each with its vLLM
    source: there is no blanket freedom to refuse.
    """
    f = facts
    room = f"{f.free} free + {f.evictable} evictable"
    want = f"need {f.need} + {f.evictable_hits} evictable hit(s) + reserve {f.reserve}"
    met = PoolFacts(f.free, f.evictable, f.num_blocks)
    if f.answer == "never" and not may_answer_never(f.held_alone, f.reserve, f.num_blocks):
        yield fact(
            "never-but-fits-alone",
            f"seq {f.seq} ({f.prompt_len} tokens) was answered NEVER, yet alone it holds "
            f"{f.held_alone} block(s) + reserve {f.reserve} <= {f.num_blocks} in the pool "
            f"(policy: {f.policy})",
            seqs=(f.seq,), pool=met, need=f.need, expected="later or OK", observed=f.answer,
        )
    elif must_admit(f.need, f.evictable_hits, f.reserve, f.free, f.evictable):
        yield fact(
            "refused-but-fits",
            f"seq {f.seq} ({f.prompt_len} tokens) was refused ({f.answer}) although {want} "
            f"fits {room} (policy: {f.policy})",
            seqs=(f.seq,), pool=met, need=f.need, expected="OK", observed=f.answer,
        )


@invariant(
    "reserve-completeness",
    "A running sequence's step that fits is granted",
    "BlockSpaceManagerV2.can_append_slots / BlockSpaceManagerV1.can_append_slots (legacy), "
    "KVCacheManager.allocate_slots for a running request (V1)",
    kind="transition",
)
def reserve_completeness(facts: ReserveFacts) -> Iterator[Violation]:
    """A reservation (append slots / allocate_slots for a running sequence) whose need -- new
    slots up to its lookahead plus a copy of every shared block it writes -- fits the free and
    evictable blocks is granted.

    Freedoms, declared per target (``AdmissionPolicy``): legacy V2 counts every block the
    group's append touches, legacy V1 wants one free block per running sibling.
    """
    f = facts
    if not reserve_refusal_allowed(
        f.need, f.group_touched, f.group_running, f.available, f.policy
    ):
        yield fact(
            "refused-but-fits",
            f"seq {f.seq}: a step of {f.num_new_tokens} token(s) + {f.lookahead} lookahead was "
            f"refused although it needs {f.need} block(s) and {f.available} are free or "
            f"evictable (policy: {f.policy.describe()})",
            seqs=(f.seq,), need=f.need, expected="granted", observed="refused",
        )


@invariant(
    "hit-completeness",
    "Cached, computed prefixes are found",
    "PrefixCachingBlockAllocator / get_common_computed_block_ids (legacy), "
    "KVCacheManager.get_computed_blocks / BlockPool.cache_full_blocks (V1)",
    kind="transition",
)
def hit_completeness(facts: HitFacts) -> Iterator[Violation]:
    """A prefix lookup returns every leading full block whose key is cached and whose KV is
    computed, and a full block becomes findable by its key by the end of the operation that
    computed it.

    Freedoms, declared per target (``AdmissionPolicy``): the last token is always recomputed
    (so a prompt's last block never counts); V1 with EAGLE drops the last hit block; legacy up
    to 0.6.3 gives a sliding-window sequence no hit.  Lookups are block-aligned (the hash block
    size is the block size).
    """
    f = facts
    if f.got_tokens < f.min_blocks * f.block_size:
        yield fact(
            "missed-hit",
            f"seq {f.seq}: {f.expected_blocks} leading block(s) are cached and computed, the "
            f"lookup may leave out {f.expected_blocks - f.min_blocks}, yet it returned "
            f"{f.got_tokens} token(s)",
            seqs=(f.seq,), expected=f.min_blocks * f.block_size, observed=f.got_tokens,
        )
    if f.unpublished:
        # The table slots (block indices of the sequence), not block ids.
        yield fact(
            "unpublished",
            f"seq {f.seq}: full block(s) {list(f.unpublished)} were computed by this operation "
            f"but none is findable by its key afterwards",
            seqs=(f.seq,), expected="findable", observed=f.unpublished,
        )


@invariant(
    "progress",
    "With no new arrivals, every request finishes",
    "the scheduler loop over can_allocate/can_append_slots (legacy), allocate_slots and "
    "preemption (V1); max_admission_blocks_per_request sizing (V1 0.33)",
    kind="transition",
)
def progress(facts: ProgressFacts) -> Iterator[Violation]:
    """With no new arrivals, the modelled scheduler loop (oldest first, preempting the newest)
    finishes every admitted request within ``progress_bound`` iterations, and a request that
    fits an empty pool is admitted once the pool is empty.

    A request that cannot fit an empty pool even alone (NEVER) is dropped, as vLLM ignores it.
    A scheduler-driven target plans its own steps: there the requests in scope are those that
    can run to their end alone in the pool (``least_blocks_alone``), and the bound's premise is
    that the oldest running request is preempted for nobody, itself included, once it is the
    only one holding blocks.
    """
    f = facts
    for seq, held_alone in f.refused_when_empty:
        yield fact(
            "refused-alone",
            f"seq {seq} was refused while no sequence held a block, although alone it holds "
            f"{held_alone} block(s) of {f.num_blocks}",
            seqs=(seq,), need=held_alone, expected="admitted", observed="refused",
        )
    for seq, held_alone in f.preempted_alone:
        yield fact(
            "preempted-alone",
            f"seq {seq} was preempted while no other sequence held a block, although it can run "
            f"to its end alone holding {held_alone} block(s) of {f.num_blocks}",
            seqs=(seq,), need=held_alone, expected="runs to its end", observed="preempted",
        )
    if f.unfinished and f.repeated:
        yield fact(
            "livelock",
            f"after {f.iterations} scheduler iteration(s) with no new arrivals the loop is back in "
            f"a state it was in, with request(s) {list(f.unfinished)} unfinished: it never ends",
            seqs=f.unfinished, expected="every request finishes", observed="a state repeats",
        )
    elif f.unfinished:
        yield fact(
            "unfinished",
            f"after {f.iterations} scheduler iteration(s) with no new arrivals (bound "
            f"{f.bound}), request(s) {list(f.unfinished)} have not finished",
            seqs=f.unfinished, expected=f.bound, observed=f.iterations,
        )


# ---------------------------------------------------------------- accessors


def unchanged_but_window_drops(
    before: KVState, after: KVState, first_needed: Mapping[int, int]
) -> bool:
    """``after`` equals ``before`` except for GPU slots before each sequence's first needed
    slot turning DROPPED, their refcounts going down, and blocks that reach zero being
    released to the free or evictable set.
    """
    refcounts = dict(before.gpu.refcounts)
    tables = dict(before.tables)
    for sid, tb in before.tables.items():
        ta = after.tables.get(sid)
        if ta is None or ta.device is not Device.GPU or tb.device is not Device.GPU:
            continue
        slots = list(tb.slots)
        for i, (was, now) in enumerate(zip(tb.slots, ta.slots, strict=False)):
            if was is not None and now is None and i < first_needed.get(sid, 0):
                slots[i] = None
                refcounts[was] -= 1
        tables[sid] = attrs.evolve(tb, slots=tuple(slots))
    released = {b for b, rc in refcounts.items() if rc == 0 and before.gpu.refcounts.get(b)}
    gpu = attrs.evolve(
        before.gpu,
        refcounts=refcounts,
        free=tuple(b for b in before.gpu.free if b not in released),
        evictable=tuple(b for b in before.gpu.evictable if b not in released),
    )
    after_gpu = attrs.evolve(
        after.gpu,
        free=tuple(b for b in after.gpu.free if b not in released),
        evictable=tuple(b for b in after.gpu.evictable if b not in released),
    )
    landed = set(after.gpu.free) | set(after.gpu.evictable)
    return released <= landed and normalized(
        attrs.evolve(before, gpu=gpu, tables=tables)
    ) == normalized(attrs.evolve(after, gpu=after_gpu))


def normalized(state: KVState) -> tuple:
    """A state with policy-only orderings removed, for unchanged-state comparisons."""

    def pool(p: PoolView | None):
        if p is None:
            return None
        return (
            tuple(sorted(p.refcounts.items())),
            tuple(sorted(p.free)),
            tuple(sorted(p.evictable)),
            tuple(sorted(((k.chain, k.extra), b) for k, b in p.cached)),
        )

    tables = tuple(sorted((sid, t.device.value, t.slots) for sid, t in state.tables.items()))
    return (pool(state.gpu), pool(state.cpu), tables)


def _taken(before: PoolView, after: PoolView) -> tuple[int, ...]:
    """Blocks of a pool that left its free and evictable sets between ``before`` and ``after``:
    what an allocation took."""
    was = set(before.free) | set(before.evictable)
    return tuple(sorted(was - set(after.free) - set(after.evictable)))


def _state_diff(before: KVState, after: KVState) -> str:
    parts = []
    if len(before.gpu.free) != len(after.gpu.free):
        parts.append(f"free blocks {len(before.gpu.free)} -> {len(after.gpu.free)}")
    changed = sorted(
        sid
        for sid in set(before.tables) | set(after.tables)
        if before.tables.get(sid) != after.tables.get(sid)
    )
    if changed:
        parts.append(f"block tables of seqs {changed} changed")
    return "; ".join(parts) or "pool bookkeeping changed"


def _short(chain: tuple[int, ...]) -> str:
    return (
        str(list(chain)) if len(chain) <= 12 else f"[{len(chain)} tokens ending {list(chain[-4:])}]"
    )


def check_world(world: World, only: Collection[str] | None = None) -> list[Violation]:
    """Every state invariant that applies to the world's configuration (of those named in
    ``only``, if given), on one world."""
    out: list[Violation] = []
    for inv in INVARIANTS.values():
        if inv.kind == "state" and inv.applies(world.config) is None and (only is None or inv.id in only):
            out.extend(inv.check(world))
    return out


# The prefix cache as tenants and routers see it (isolation, events) has its own module, which
# registers its invariants in the same registry: importing this module registers every invariant.
from . import tenancy  # noqa: E402, F401
