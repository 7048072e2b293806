"""Incremental evaluation of the state invariants: an optimisation equal to ``check_world``.

``spec.invariants.check_world`` is the definition: every state invariant over the whole world.
After an operation most of the world is what it was, so this module looks only at what the
operation touched -- the sequences whose block table or model changed, the blocks whose holders
or pool entries (refcount, free list, evictable set, cache map, computed set) changed, the blocks
whose shadow memory changed, the keys the cache map or new KV-cache events changed -- and keeps
the counts the invariants need (who holds each block, what is cached on it, the free list's
multiplicities, the event stream replayed so far) up to date from those changes alone.

Why it equals the definition: every state invariant is a conjunction over entities (a block, a
block table, a cache entry, a key), each conjunct reading only that entity's part of the world
(the per-entity functions of ``spec.invariants`` and ``spec.tenancy``, which the definition
itself is written with).  If an invariant held on the last world checked, a conjunct can only
fail now on an entity whose part changed, and those are exactly the touched entities.  An
invariant that did not hold on the last world, a world with no last world (the first check),
or a change this module does not follow (a pool appearing or going, an event stream that is
not an extension of the last one, the memory cleared wholesale) is checked whole.  A state invariant
with no incremental rule here (registered by a plugin or a test) is always checked whole.

When an invariant's incremental rule finds a violation, the invariant is re-checked whole, so
the reported violations are the definition's own, in its order.  ``KVSPEC_CHECK`` picks the
mode: ``incremental`` (default), ``full`` (every check whole) or ``both`` (both, and a
disagreement raises ``IncrementalMismatch``); tests/test_incremental.py runs ``both`` over the
reference and every broken variant.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping

import attrs
from kvspec.spec.config import Config
from kvspec.spec.errors import KVSpecError
from kvspec.spec.events import EventKind, EventReplay
from kvspec.spec.invariants import (
    block_conservation,
    cache_entry_fault,
    check_world,
    freed_table_fault,
    idle_pool_fault,
    refcount_fault,
    tableless_fault,
    usage_fault,
    window_fault,
)
from kvspec.spec.kv_memory import readback_faults
from kvspec.spec.prefix_hash import PrefixKey
from kvspec.spec.registry import INVARIANTS, Invariant, Violation
from kvspec.spec.state import Device, KVState, PoolView, SeqModel, Status, TableView, World
from kvspec.spec.tenancy import block_isolation, event_key_fault, key_order

CHECK_ENV = "KVSPEC_CHECK"
MODES = ("incremental", "full", "both")
DEFAULT_MODE = "incremental"

Block = tuple[Device, int]


class IncrementalMismatch(KVSpecError):
    """The incremental evaluation and the whole-world definition disagreed on a world."""


class UnknownCheckMode(KVSpecError):
    """A check mode (``KVSPEC_CHECK`` or an argument) that is not one of ``MODES``."""


def check_mode(mode: str | None = None) -> str:
    """The check mode: ``mode`` if given, else ``KVSPEC_CHECK``, else incremental."""
    chosen = mode if mode is not None else os.environ.get(CHECK_ENV) or DEFAULT_MODE
    if chosen not in MODES:
        raise UnknownCheckMode(f"check mode {chosen!r} is not one of {', '.join(MODES)} ({CHECK_ENV})")
    return chosen


class TouchedMemory(dict):
    """Shadow KV memory that notes which blocks' cells change (cell = (device, block, offset))."""

    def __init__(self) -> None:
        super().__init__()
        self.touched: set[Block] = set()
        self.wholesale = False  # a change not followed cell by cell (clear, update)

    def __setitem__(self, cell, kv) -> None:
        self.touched.add(cell[:2])
        super().__setitem__(cell, kv)

    def __delitem__(self, cell) -> None:
        self.touched.add(cell[:2])
        super().__delitem__(cell)

    def pop(self, cell, *default):
        if cell in self:
            self.touched.add(cell[:2])
        return super().pop(cell, *default)

    def setdefault(self, cell, kv=None):
        if cell not in self:
            self.touched.add(cell[:2])
        return super().setdefault(cell, kv)

    def clear(self) -> None:
        self.wholesale = True
        super().clear()

    def update(self, *args, **kwargs) -> None:
        self.wholesale = True
        super().update(*args, **kwargs)

    def popitem(self):
        self.wholesale = True
        return super().popitem()

    def take(self) -> set[Block] | None:
        """The blocks touched since the last call (None: the memory changed wholesale)."""
        touched, wholesale = self.touched, self.wholesale
        self.touched, self.wholesale = set(), False
        return None if wholesale else touched


# ---------------------------------------------------------------- the index


@attrs.define
class PoolIndex:
    """One pool as the invariants need it, kept up to date from what changes."""

    view: PoolView
    ids: frozenset[int]
    holders: dict[int, dict[int, tuple[int, ...]]]  # block -> live seq -> slot indices
    keys_of: dict[int, Counter[PrefixKey]]  # block -> keys the cache map names it under
    cached: Counter[PrefixKey]  # key -> entries of the map under it
    free: frozenset[int]  # blocks on the free list
    free_dupes: Counter[int]  # block -> times on the free list, for blocks on it more than once
    evictable: frozenset[int]
    in_use: int  # blocks with a positive refcount
    events: EventReplay | None


@attrs.frozen
class Delta:
    """What changed between the last world checked and this one."""

    seqs: frozenset[int]  # sequences whose table, model or liveness changed
    blocks: Mapping[Device, frozenset[int]]  # blocks whose holders or pool entries changed
    memory: Mapping[Device, frozenset[int]]  # blocks whose shadow memory changed
    keys: Mapping[Device, frozenset[PrefixKey]]  # keys whose map count or event count changed
    event_faults: Mapping[Device, tuple[str, ...]]  # faults among the new events


class Rebuild(Exception):  # control flow: never escapes this module
    """A change the index does not follow: rebuild it from the world."""


def _live_device(table: TableView | None, seq: SeqModel | None) -> Device | None:
    """The device a block table is live on (``registry.live_tables``), or None."""
    if table is None or seq is None:
        return None
    on_gpu = seq.status is Status.RUNNING or seq.status is Status.SENDING
    wanted = Device.GPU if on_gpu else Device.CPU if seq.status is Status.SWAPPED else None
    return table.device if table.device is wanted else None


def _pool_index(view: PoolView) -> PoolIndex:
    keys_of: dict[int, Counter[PrefixKey]] = {}
    for key, block in view.cached:
        keys_of.setdefault(block, Counter())[key] += 1
    events = None
    if view.events is not None:
        events = EventReplay()
        events.feed(view.events)  # its faults are the definition's to report (first check)
    return PoolIndex(
        view=view,
        ids=frozenset(view.ids),
        holders={},
        keys_of=keys_of,
        cached=Counter(key for key, _ in view.cached),
        free=frozenset(view.free),
        free_dupes=Counter(view.free) if len(set(view.free)) != len(view.free) else Counter(),
        evictable=frozenset(view.evictable),
        in_use=sum(1 for rc in view.refcounts.values() if rc > 0),
        events=events,
    )


class IncrementalChecker:
    """Follows the worlds a driver checks and evaluates each state invariant over what changed."""

    def __init__(self, config: Config, only: Collection[str] | None = None) -> None:
        """``only``: the invariants to evaluate (None: every state invariant)."""
        self.config = config
        self.only = None if only is None else frozenset(only)
        self.state: KVState | None = None
        self.seqs: Mapping[int, SeqModel] = {}
        self.pools: dict[Device, PoolIndex] = {}
        self.live: dict[int, tuple[Device, tuple[int | None, ...]]] = {}  # seq -> its live table
        self.active = 0  # sequences not waiting
        self.dirty: set[str] | None = None  # invariants the last world broke (None: unknown)
        self._applies: tuple[int, list[Invariant]] = (-1, [])

    # ------------------------------------------------------------ following worlds

    def rebuild(self, world: World) -> None:
        """Index ``world`` from scratch."""
        self.state, self.seqs = world.state, dict(world.seqs)
        self.pools, self.live, self.active = {}, {}, 0
        for device in Device:
            view = world.state.pool(device)
            if view is not None:
                self.pools[device] = _pool_index(view)
        for sid, seq in world.seqs.items():
            self.active += seq.status is not Status.WAITING
            table = world.state.tables.get(sid)
            device = _live_device(table, seq)
            if device is not None and table is not None:
                self._hold(sid, device, table.slots, set())

    def _hold(self, sid: int, device: Device, slots: tuple[int | None, ...], touched: set[int]) -> None:
        self.live[sid] = (device, slots)
        where: dict[int, list[int]] = {}
        for i, block in enumerate(slots):
            if block is not None:
                where.setdefault(block, []).append(i)
        holders = self.pools[device].holders
        for block, idx in where.items():
            holders.setdefault(block, {})[sid] = tuple(idx)
            touched.add(block)

    def _release(self, sid: int, touched: dict[Device, set[int]]) -> None:
        device, slots = self.live.pop(sid)
        holders = self.pools[device].holders
        for block in slots:
            if block is not None and block in holders:
                holders[block].pop(sid, None)
                if not holders[block]:
                    del holders[block]
                touched[device].add(block)

    def advance(self, world: World, memory: set[Block] | None) -> Delta | None:
        """Move the index to ``world``; what changed, or None when it had to be rebuilt (then
        only the definition can judge this world)."""
        try:
            if self.state is None or memory is None:
                raise Rebuild
            return self._advance(world, memory)
        except Rebuild:
            self.rebuild(world)
            return None

    def _advance(self, world: World, memory: set[Block]) -> Delta:
        before, after = self.state, world.state
        assert before is not None
        touched: dict[Device, set[int]] = {d: set() for d in self.pools}
        keys: dict[Device, set[PrefixKey]] = {d: set() for d in self.pools}
        event_faults: dict[Device, tuple[str, ...]] = {}
        for device in Device:
            old, new = before.pool(device), after.pool(device)
            if (old is None) != (new is None):
                raise Rebuild
            if old is not None and new is not None and old is not new:
                event_faults[device] = self._pool_changed(self.pools[device], old, new, touched[device], keys[device])
        changed = {
            sid
            for sid in self.seqs.keys() | world.seqs.keys()
            if self.seqs.get(sid) is not world.seqs.get(sid)
        }
        if before.tables is not after.tables:
            for sid, table in after.tables.items():
                was = before.tables.get(sid)
                if was is not table and was != table:
                    changed.add(sid)
            changed.update(before.tables.keys() - after.tables.keys())
        for sid in changed:
            old_seq, seq = self.seqs.get(sid), world.seqs.get(sid)
            self.active += (seq is not None and seq.status is not Status.WAITING) - (
                old_seq is not None and old_seq.status is not Status.WAITING
            )
            if sid in self.live:
                self._release(sid, touched)
            table = after.tables.get(sid)
            device = _live_device(table, seq)
            if device is not None and table is not None:
                if device not in self.pools:
                    raise Rebuild
                self._hold(sid, device, table.slots, touched[device])
        self.state, self.seqs = after, dict(world.seqs)
        by_device: dict[Device, set[int]] = {d: set() for d in self.pools}
        for device, block in memory:
            if device in by_device:
                by_device[device].add(block)
        return Delta(
            seqs=frozenset(changed),
            blocks={d: frozenset(b) for d, b in touched.items()},
            memory={d: frozenset(b) for d, b in by_device.items()},
            keys={d: frozenset(k) for d, k in keys.items()},
            event_faults=event_faults,
        )

    def _pool_changed(
        self, index: PoolIndex, old: PoolView, new: PoolView, touched: set[int], keys: set[PrefixKey]
    ) -> tuple[str, ...]:
        """Fold one pool's change into its index; the faults among its new events."""
        index.view = new
        if old.ids != new.ids:  # a group's view owns the blocks it holds or caches
            ids = frozenset(new.ids)
            touched.update(index.ids ^ ids)
            index.ids = ids
        if old.refcounts != new.refcounts:
            # Each block once (it appears twice when its count changed), whether or not an
            # earlier change of this pool already touched it.
            for block in {b for b, _ in old.refcounts.items() ^ new.refcounts.items()}:
                touched.add(block)
                index.in_use += (new.refcounts.get(block, 0) > 0) - (old.refcounts.get(block, 0) > 0)
        if old.free != new.free:
            free = frozenset(new.free)
            # Multiplicities only matter for a double free: counted when the list has one.
            dupes = Counter(new.free) if len(free) != len(new.free) else Counter()
            touched.update(index.free ^ free, index.free_dupes.keys() ^ dupes.keys())
            touched.update(b for b in dupes.keys() & index.free_dupes.keys() if dupes[b] != index.free_dupes[b])
            index.free, index.free_dupes = free, dupes
        if old.evictable != new.evictable:
            evictable = frozenset(new.evictable)
            touched.update(index.evictable ^ evictable)
            index.evictable = evictable
        if old.computed != new.computed:
            touched.update(old.computed ^ new.computed)
        if old.cached != new.cached:
            was, now = set(old.cached), set(new.cached)
            if len(was) == len(old.cached) and len(now) == len(new.cached):
                entries = [(e, 1) for e in now - was] + [(e, -1) for e in was - now]
            else:  # an entry held twice: compare multiplicities
                many, few = Counter(new.cached), Counter(old.cached)
                entries = [(e, many[e] - few[e]) for e in was | now if many[e] != few[e]]
            for entry, delta in entries:
                key, block = entry
                touched.add(block)
                keys.add(key)
                index.cached[key] += delta
                on_block = index.keys_of.setdefault(block, Counter())
                on_block[key] += delta
                if on_block[key] <= 0:
                    del on_block[key]
                    if not on_block:
                        del index.keys_of[block]
        if new.events is None or old.events is new.events:
            return ()
        if old.events is None or index.events is None:
            raise Rebuild
        seen = len(old.events)
        if new.events[:seen] != old.events:
            raise Rebuild  # not an extension of the stream already replayed
        fresh = new.events[seen:]
        if any(e.kind is EventKind.CLEARED for e in fresh):
            keys.update(index.events.live)  # every key the stream held may have changed
        faults = index.events.feed(fresh)
        for event in fresh:
            keys.update(event.keys)
        return tuple(faults)

    # ------------------------------------------------------------ checking

    def _applicable(self) -> list[Invariant]:
        """The state invariants that apply to the configuration, in the registry's order."""
        if self._applies[0] != len(INVARIANTS):  # an invariant registered since
            found = [
                i for i in INVARIANTS.values()
                if i.kind == "state" and i.applies(self.config) is None and (self.only is None or i.id in self.only)
            ]
            self._applies = (len(INVARIANTS), found)
        return self._applies[1]

    def check(self, world: World, memory: set[Block] | None) -> list[Violation]:
        """The violations of ``world``: each invariant's incremental rule where the last world
        satisfied it, the definition where it did not, and the definition's own report for
        every invariant a rule finds broken.  Equal to ``check_world(world)``."""
        dirty = self.dirty
        delta = self.advance(world, memory)
        found: list[Violation] = []
        for inv in self._applicable():
            rule = RULES.get(inv.id)
            if delta is None or dirty is None or inv.id in dirty or rule is None or any(rule(self, world, delta)):
                found.extend(inv.check(world))
        self.dirty = {v.invariant for v in found}
        return found

    def verdicts(self, world: World, memory: set[Block] | None) -> dict[str, list[str]]:
        """What each incremental rule says of ``world`` (invariant -> its messages), or, where
        a rule cannot judge (no rule, no clean last world), the definition's; for comparing."""
        dirty = self.dirty
        delta = self.advance(world, memory)
        out: dict[str, list[str]] = {}
        for inv in self._applicable():
            rule = RULES.get(inv.id)
            if delta is None or dirty is None or inv.id in dirty or rule is None:
                messages = [v.message for v in inv.check(world)]
            else:
                messages = [f.message if isinstance(f, Violation) else f for f in rule(self, world, delta)]
            if messages:
                out[inv.id] = messages
        self.dirty = set(out)
        return out


def check_both(checker: IncrementalChecker, world: World, memory: set[Block] | None) -> list[Violation]:
    """The definition's violations of ``world``, after requiring that the incremental rules
    find the same invariants broken with the same messages (``IncrementalMismatch`` if not)."""
    full = check_world(world, checker.only)
    ours = checker.verdicts(world, memory)
    theirs: dict[str, list[str]] = {}
    for v in full:
        theirs.setdefault(v.invariant, []).append(v.message)
    if {k: sorted(v) for k, v in ours.items()} != {k: sorted(v) for k, v in theirs.items()}:
        raise IncrementalMismatch(
            "incremental and whole-world checks disagree:\n"
            f"  incremental: {ours}\n  whole world: {theirs}"
        )
    return full


class Judges:
    """A ``spec.groups.Judge`` per check mode for a driver of hybrid states: one checker per
    world key (the shared pool, each group), all fed the blocks whose memory changed."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.checkers: dict[str, IncrementalChecker] = {}

    def judge(self, memory: set[Block] | None) -> Callable[[str, World, Collection[str] | None], list[Violation]]:
        """The judge for one check, given the blocks whose memory changed since the last."""

        def judge(key: str, world: World, only: Collection[str] | None) -> list[Violation]:
            if self.mode == "full":
                return check_world(world, only)
            checker = self.checkers.get(key)
            if checker is None or checker.config != world.config:
                checker = self.checkers[key] = IncrementalChecker(world.config, only)
            if self.mode == "both":
                return check_both(checker, world, memory)
            return checker.check(world, memory)

        return judge


# ---------------------------------------------------------------- the rules

Rule = Callable[[IncrementalChecker, World, Delta], Iterator[str]]


def _faults(found: Iterable[str | None]) -> Iterator[str]:
    return (f for f in found if f is not None)


def refcount_rule(c: IncrementalChecker, world: World, delta: Delta) -> Iterator[str]:
    for device, index in c.pools.items():
        for block in sorted(delta.blocks[device]):
            want = sum(len(ix) for ix in index.holders.get(block, {}).values())
            fault = refcount_fault(device, block, want, index.view.refcounts.get(block))
            if fault is not None:
                yield fault


def conservation_rule(c: IncrementalChecker, world: World, delta: Delta) -> Iterator[str]:
    for device, index in c.pools.items():
        refcounts = index.view.refcounts
        for block in sorted(delta.blocks[device]):
            yield from block_conservation(
                device, block, in_pool=block in index.ids,
                on_free=index.free_dupes.get(block) or int(block in index.free),
                evictable=block in index.evictable, in_use=refcounts.get(block, 0) > 0,
                cached=block in index.keys_of,
            )
        if index.view.usage is not None:  # a pool-wide share: re-counted while it is reported
            used = sum(1 for block, rc in refcounts.items() if rc > 0 and block in index.ids)
            yield from _faults([usage_fault(device, index.view, used)])


def no_leak_rule(c: IncrementalChecker, world: World, delta: Delta) -> Iterator[str]:
    tables = world.state.tables
    yield from _faults(
        freed_table_fault(tables[sid], world.seqs.get(sid)) for sid in sorted(delta.seqs) if sid in tables
    )
    if c.active == 0:
        yield from _faults(idle_pool_fault(d, index.view) for d, index in c.pools.items() if index.in_use)


def _live_gpu(world: World, sids: Iterable[int]) -> Iterator[TableView]:
    for sid in sorted(sids):
        table = world.state.tables.get(sid)
        if _live_device(table, world.seqs.get(sid)) is Device.GPU:
            assert table is not None
            yield table


def window_rule(c: IncrementalChecker, world: World, delta: Delta) -> Iterator[str]:
    yield from _faults(window_fault(world, table) for table in _live_gpu(world, delta.seqs))


def cache_rule(c: IncrementalChecker, world: World, delta: Delta) -> Iterator[str]:
    for device, index in c.pools.items():
        for block in sorted(delta.blocks[device] | delta.memory[device]):
            for key, n in index.keys_of.get(block, {}).items():
                fault = cache_entry_fault(world, device, index.view, index.ids, key, block)
                if fault is not None:
                    yield from [fault] * n


def readback_rule(c: IncrementalChecker, world: World, delta: Delta) -> Iterator[str]:
    sids = set(delta.seqs)
    gpu = c.pools.get(Device.GPU)
    if gpu is not None:
        for block in delta.memory[Device.GPU]:
            sids.update(gpu.holders.get(block, ()))
    config = world.config
    for table in _live_gpu(world, sids):
        yield from readback_faults(
            table, world.seqs[table.seq_id], config.block_size, config.sliding_window, world.memory
        )
    tables = world.state.tables
    yield from _faults(
        tableless_fault(world.seqs[sid], sid in tables) for sid in sorted(delta.seqs) if sid in world.seqs
    )


def isolation_rule(c: IncrementalChecker, world: World, delta: Delta) -> Iterator[str]:
    for device, index in c.pools.items():
        for block in sorted(delta.blocks[device]):
            holders = index.holders.get(block)
            if holders:
                pairs = [(sid, i) for sid, idx in holders.items() for i in idx]
                yield from block_isolation(world, device, block, pairs, index.keys_of.get(block, ()))


def event_rule(c: IncrementalChecker, world: World, delta: Delta) -> Iterator[str]:
    for device, index in c.pools.items():
        if index.events is None:
            continue
        for fault in delta.event_faults.get(device, ()):
            yield f"{device.value}: {fault}"
        for key in sorted(delta.keys[device], key=key_order):
            fault = event_key_fault(device, index.view, key, index.events.live[key], index.cached[key])
            if fault is not None:
                yield fault


RULES: dict[str, Rule] = {
    "refcount-exact": refcount_rule,
    "conservation": conservation_rule,
    "no-leak": no_leak_rule,
    "window-bound": window_rule,
    "prefix-cache-consistency": cache_rule,
    "kv-readback": readback_rule,
    "prefix-cache-isolation": isolation_rule,
    "event-consistency": event_rule,
}
"""The incremental rule of each state invariant, by ID: the invariant's per-entity check over
the entities ``Delta`` names (module docstring)."""


def state_invariants_without_rule() -> list[Invariant]:
    """State invariants checked whole every time (no incremental rule)."""
    return [inv for inv in INVARIANTS.values() if inv.kind == "state" and inv.id not in RULES]
