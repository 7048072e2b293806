"""Bounded model checking of the reference's transition system, and k-induction.

The reference (reference/manager.py, pool.py, block_table.py) is encoded as a symbolic
transition system over ``num_blocks`` blocks and ``num_seqs`` sequence slots, each with a block
table of at most ``max_slots`` slots.  A transition is one driver operation, done the way the
reference does it:

* ADMIT s: prefix hits (any cached blocks), can_admit's answer from ``spec.admission``, revive
  the kept hits, allocate the step's other slots and the run's lookahead slots, the worker
  writes positions hit..end-1, commit (optionally publishing full blocks to the prefix cache);
* STEP s: reserve k tokens plus lookahead (drop slots before first_needed_block(start), copy-on-
  write the shared blocks the step writes, grow), the worker writes, commit, publish;
* FORK p c; FREE s; RESET (reset_prefix_cache, refused while a block is in use); or nothing.

Refcounts move only by the reference's incref/decref/allocate, never recomputed from tables, so
refcount-exact is a real property.  Which free or evictable block an allocation takes is left to
the solver (a spec freedom; the reference's FIFO/LRU choice is one of them).  Shadow memory
``wr[b][o]`` records written cells; a block's content dies when it is allocated again.

Properties: refcount-exact, conservation, window-bound (state; tests/test_proofs_bmc_properties.py
checks each against the spec function of the same ID on concrete states); immutability and
admission-soundness (transition: a step that was answered OK and then found too few blocks; the
write flag is stronger than the spec's write faults, see ``_writes``).
BMC proves them for every run of length <= depth.  k-induction tries to close them for every
depth: the invariants plus auxiliary ones (table shape, dropped prefix, shadow memory agreeing
with the computed positions, cached blocks full) are checked to be inductive.
Non-vacuity: seeded bugs (mutants) must each be caught within the same depth.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import attrs
import z3
from kvspec.spec import admission, window

from .core import DEFAULT_TIMEOUT_MS, Verdict, obligation

NONE = -1  # an empty or dropped slot (DROPPED, vLLM's null block)
OPS = ("nop", "admit", "step", "fork", "free", "reset")
WIDTH = 8  # every quantity here is small; bit-vectors make the unrolling a SAT problem


def bv(x: int) -> z3.BitVecRef:
    return z3.BitVecVal(x, WIDTH)


def bvar(name: str) -> z3.BitVecRef:
    return z3.BitVec(name, WIDTH)


@attrs.frozen
class Bounds:
    block_size: int = 2
    window: int | None = 3
    num_blocks: int = 6
    num_seqs: int = 3
    max_slots: int = 4
    max_lookahead: int = 1
    prefix_caching: bool = True
    depth: int = 8

    @property
    def positions(self) -> int:
        return self.max_slots * self.block_size

    def describe(self) -> str:
        w = "none" if self.window is None else self.window
        return (
            f"N={self.num_blocks} S={self.num_seqs} k<={self.depth} B={self.block_size} W={w} "
            f"slots<={self.max_slots} lookahead<={self.max_lookahead} "
            f"caching={'on' if self.prefix_caching else 'off'}"
        )


DEFAULT_BOUNDS = Bounds()
DEEP_BOUNDS = (
    Bounds(depth=12),
    Bounds(block_size=2, window=2, num_blocks=7, max_slots=5, depth=10),
    Bounds(block_size=3, window=4, num_blocks=6, max_slots=3, depth=10),
    Bounds(block_size=1, window=2, num_blocks=6, max_slots=6, depth=10),
    Bounds(block_size=2, window=None, num_blocks=6, max_slots=4, depth=10),
)

Mutant = str  # "" is the reference itself


# ---------------------------------------------------------------- helpers


def _count(conds: Sequence[z3.BoolRef]) -> z3.BitVecRef:
    if not conds:
        return bv(0)
    return z3.Sum([z3.If(c, bv(1), bv(0)) for c in conds])


def _at(values: Sequence[z3.ExprRef], index: z3.ExprRef) -> z3.ExprRef:
    """values[index] for a symbolic index (the last value for an index out of range)."""
    out = values[-1]
    for i in range(len(values) - 2, -1, -1):
        out = z3.If(index == i, values[i], out)
    return out


def _max(a, b):
    return z3.If(a >= b, a, b)


def _min(a, b):
    return z3.If(a <= b, a, b)


@attrs.frozen
class Tables:
    """The spec's arithmetic at this block size and window, computed by the spec's own Python
    functions over every position the bounds allow, and read back by symbolic lookup."""

    div: tuple[int, ...]  # v // B
    first: tuple[int, ...]  # window.first_needed_block(v, W, B)
    new: tuple[tuple[int, ...], ...]  # admission.new_blocks_for_step(hit, end, W, B)
    bound: tuple[tuple[int, ...], ...]  # the window-bound invariant's limit for step (st, en)

    @staticmethod
    def of(b: Bounds) -> Tables:
        P, B, W = b.positions, b.block_size, b.window
        span = range(P + 1)
        new = tuple(
            tuple(admission.new_blocks_for_step(h, e, W, B) if e > h else 0 for e in span)
            for h in span
        )
        bound = tuple(
            tuple(
                min(
                    window.window_cover(W + max(1, en - st) - 1, B), window.blocks_for_tokens(en, B)
                )
                if W is not None
                else P
                for en in span
            )
            for st in span
        )
        return Tables(
            tuple(v // B for v in span),
            tuple(window.first_needed_block(v, W, B) for v in span),
            new,
            bound,
        )

    def div_b(self, v):
        return _at([bv(x) for x in self.div], v)

    def first_needed(self, v):
        return _at([bv(x) for x in self.first], v)

    def new_blocks(self, hit, end):
        return _at([_at([bv(x) for x in row], end) for row in self.new], hit)

    def window_limit(self, st, en):
        return _at([_at([bv(x) for x in row], en) for row in self.bound], st)


@attrs.define
class Pool:
    rc: list[z3.BitVecRef]
    fl: list[z3.BitVecRef]  # multiplicity on the free list (2 = double free)
    ev: list[z3.BoolRef]  # on the evictable set
    key: list[z3.BoolRef]  # registered in the prefix cache
    wr: list[list[z3.BoolRef]]  # shadow memory: offset written in this lifetime

    def copy(self) -> Pool:
        return Pool(
            list(self.rc), list(self.fl), list(self.ev), list(self.key), [list(w) for w in self.wr]
        )

    def flat(self) -> list[z3.ExprRef]:
        out: list[z3.ExprRef] = [*self.rc, *self.fl, *self.ev, *self.key]
        for w in self.wr:
            out.extend(w)
        return out


@attrs.define
class Seq:
    live: z3.BoolRef
    n: z3.BitVecRef  # computed positions
    st: z3.BitVecRef  # the driver's step (start, end)
    en: z3.BitVecRef
    tl: z3.BitVecRef  # table length
    sl: list[z3.BitVecRef]  # slot -> block id or NONE

    def copy(self) -> Seq:
        return Seq(self.live, self.n, self.st, self.en, self.tl, list(self.sl))

    def flat(self) -> list[z3.ExprRef]:
        return [self.live, self.n, self.st, self.en, self.tl, *self.sl]


@attrs.define
class State:
    pool: Pool
    seqs: list[Seq]

    @staticmethod
    def fresh(b: Bounds, tag: str) -> State:
        N, S, T, B = b.num_blocks, b.num_seqs, b.max_slots, b.block_size
        pool = Pool(
            [bvar(f"rc{tag}_{i}") for i in range(N)],
            [bvar(f"fl{tag}_{i}") for i in range(N)],
            [z3.Bool(f"ev{tag}_{i}") for i in range(N)],
            [z3.Bool(f"key{tag}_{i}") for i in range(N)],
            [[z3.Bool(f"wr{tag}_{i}_{o}") for o in range(B)] for i in range(N)],
        )
        seqs = [
            Seq(
                z3.Bool(f"live{tag}_{s}"),
                bvar(f"n{tag}_{s}"),
                bvar(f"st{tag}_{s}"),
                bvar(f"en{tag}_{s}"),
                bvar(f"tl{tag}_{s}"),
                [bvar(f"sl{tag}_{s}_{i}") for i in range(T)],
            )
            for s in range(S)
        ]
        return State(pool, seqs)

    def flat(self) -> list[z3.ExprRef]:
        out = self.pool.flat()
        for s in self.seqs:
            out.extend(s.flat())
        return out


def initial(b: Bounds) -> State:
    N, S, B = b.num_blocks, b.num_seqs, b.block_size
    no = z3.BoolVal(False)
    pool = Pool([bv(0)] * N, [bv(1)] * N, [no] * N, [no] * N, [[no] * B for _ in range(N)])
    return State(pool, [_dead(b) for _ in range(S)])


def _dead(b: Bounds) -> Seq:
    return Seq(z3.BoolVal(False), bv(0), bv(0), bv(0), bv(0), [bv(NONE)] * b.max_slots)


# ---------------------------------------------------------------- pool operations


def _decref(p: Pool, dec: Sequence[z3.BitVecRef]) -> Pool:
    """BlockPool.decref, ``dec[b]`` times: at zero a cached block turns evictable, else free."""
    out = p.copy()
    for b in range(len(p.rc)):
        rc = p.rc[b] - dec[b]
        zero = z3.And(dec[b] > 0, rc == 0)
        out.rc[b] = rc
        out.ev[b] = z3.Or(p.ev[b], z3.And(zero, p.key[b]))
        out.fl[b] = p.fl[b] + z3.If(z3.And(zero, z3.Not(p.key[b])), bv(1), bv(0))
    return out


def _incref(p: Pool, inc: Sequence[z3.BitVecRef]) -> Pool:
    """BlockPool.incref, ``inc[b]`` times: a hit revives an evictable block."""
    out = p.copy()
    for b in range(len(p.rc)):
        out.ev[b] = z3.And(p.ev[b], z3.Not(z3.And(inc[b] > 0, p.rc[b] == 0)))
        out.rc[b] = p.rc[b] + inc[b]
    return out


def _available(p: Pool, b: int) -> z3.BoolRef:
    return z3.Or(p.fl[b] >= 1, p.ev[b])


def _allocate(p: Pool, chosen: Sequence[z3.BoolRef], mutant: Mutant) -> Pool:
    """BlockPool.allocate for every chosen block: off the free list if it is there, else evicted
    (its cache entry dropped); refcount 1; its old content dies."""
    out = p.copy()
    keep_on_free = mutant == "alloc-keeps-free-entry"
    for b in range(len(p.rc)):
        c = chosen[b]
        from_free = p.fl[b] >= 1
        out.fl[b] = z3.If(z3.And(c, from_free, not keep_on_free), p.fl[b] - 1, p.fl[b])
        out.ev[b] = z3.And(p.ev[b], z3.Not(c))
        out.key[b] = z3.And(p.key[b], z3.Not(z3.And(c, z3.Not(from_free))))
        out.rc[b] = z3.If(c, bv(1), p.rc[b])
        out.wr[b] = [z3.And(w, z3.Not(c)) for w in p.wr[b]]
    return out


# ---------------------------------------------------------------- transition


@attrs.define
class Choice:
    """The nondeterministic parameters of one transition."""

    op: z3.BitVecRef
    s: z3.BitVecRef
    c: z3.BitVecRef
    h: z3.BitVecRef  # prefix-hit blocks
    prompt: z3.BitVecRef
    k: z3.BitVecRef
    la: z3.BitVecRef
    hb: list[z3.BitVecRef]  # hit block per slot
    a: list[z3.BitVecRef]  # allocated block per slot
    reg: list[z3.BoolRef]  # publish this slot's block

    @staticmethod
    def fresh(b: Bounds, tag: str) -> Choice:
        T = b.max_slots
        return Choice(
            *(bvar(f"{n}{tag}") for n in ("op", "s", "c", "h", "prompt", "k", "la")),
            [bvar(f"hb{tag}_{i}") for i in range(T)],
            [bvar(f"a{tag}_{i}") for i in range(T)],
            [z3.Bool(f"reg{tag}_{i}") for i in range(T)],
        )

    def domain(self, b: Bounds) -> list[z3.BoolRef]:
        N, S, T, P = b.num_blocks, b.num_seqs, b.max_slots, b.positions
        out = [
            self.op >= 0,
            self.op < len(OPS),
            self.s >= 0,
            self.s < S,
            self.c >= 0,
            self.c < S,
            self.h >= 0,
            self.h <= T,
            self.prompt >= 1,
            self.prompt <= P,
            self.k >= 1,
            self.k <= P,
            self.la >= 0,
            self.la <= b.max_lookahead,
        ]
        if not b.prefix_caching:
            out.append(self.h == 0)
        for i in range(T):
            out += [self.hb[i] >= 0, self.hb[i] < N, self.a[i] >= 0, self.a[i] < N]
            if not b.prefix_caching:
                out.append(z3.Not(self.reg[i]))
        return out


class Defs:
    """Names intermediate terms with fresh constants (one equation each), so an unrolling is a
    flat system of definitions rather than deeply nested terms."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.eqs: list[z3.BoolRef] = []
        self.count = 0

    def name(self, e: z3.ExprRef, hint: str) -> z3.ExprRef:
        self.count += 1
        v = z3.Const(f"{hint}{self.tag}#{self.count}", e.sort())
        self.eqs.append(v == e)
        return v

    def pool(self, p: Pool, hint: str) -> Pool:
        return Pool(
            [self.name(x, f"{hint}.rc") for x in p.rc],
            [self.name(x, f"{hint}.fl") for x in p.fl],
            [self.name(x, f"{hint}.ev") for x in p.ev],
            [self.name(x, f"{hint}.key") for x in p.key],
            [[self.name(x, f"{hint}.wr") for x in w] for w in p.wr],
        )

    def seq(self, s: Seq, hint: str) -> Seq:
        return Seq(
            self.name(s.live, f"{hint}.live"),
            self.name(s.n, f"{hint}.n"),
            self.name(s.st, f"{hint}.st"),
            self.name(s.en, f"{hint}.en"),
            self.name(s.tl, f"{hint}.tl"),
            [self.name(x, f"{hint}.sl") for x in s.sl],
        )


@attrs.define
class Effect:
    """One operation on the selected sequence: whether it is enabled, whether it goes ahead (a
    refused operation changes nothing), the next pool and sequence, constraints on the solver's
    allocation choices, and transition-property violations."""

    enabled: z3.BoolRef
    go: z3.BoolRef
    pool: Pool
    seq: Seq | None
    constraints: list[z3.BoolRef] = attrs.Factory(list)
    immutability: z3.BoolRef = attrs.Factory(lambda: z3.BoolVal(False))
    admission: z3.BoolRef = attrs.Factory(lambda: z3.BoolVal(False))


def _writes(b: Bounds, pool: Pool, slots, lo, hi) -> tuple[Pool, z3.BoolRef]:
    """The worker writes positions lo..hi-1 through ``slots``; returns the new memory and
    whether any write breaks immutability (cell already written, shared or cached block).

    This flag is stronger than the spec's write faults (``kv_memory.plan_step_writes``, which
    ``immutability`` and ``admission-soundness`` read): any rewrite of a written cell, a block
    with refcount other than 1, any cached block and an unmapped position all count, where the
    spec forbids only a rewrite with other KV, a block shared by several slots, a write that
    contradicts the cached key, and (under admission-soundness) an unmapped position.  Every
    spec fault is therefore flagged here, so proving this flag never raised proves both spec
    properties for the reference's writes."""
    N, B = b.num_blocks, b.block_size
    out = pool.copy()
    bad = []
    for i, blk in enumerate(slots):
        for o in range(B):
            pos = i * B + o
            w = z3.And(lo <= pos, pos < hi)
            cell_written = _at([pool.wr[x][o] for x in range(N)], blk)
            bad.append(
                z3.And(
                    w, z3.Or(blk == NONE, cell_written, _at(pool.rc, blk) != 1, _at(pool.key, blk))
                )
            )
            for x in range(N):
                out.wr[x][o] = z3.Or(out.wr[x][o], z3.And(w, blk == x))
    return out, z3.Or(*bad)


def _publish(b: Bounds, pool: Pool, slots, reg, lo_slot, hi_slot) -> Pool:
    """Commit publishes full blocks of slots lo_slot..hi_slot-1 (if the key is not taken)."""
    if not b.prefix_caching:
        return pool
    out = pool.copy()
    for x in range(b.num_blocks):
        out.key[x] = z3.Or(
            pool.key[x],
            *[z3.And(reg[i], slots[i] == x, lo_slot <= i, i < hi_slot) for i in range(len(slots))],
        )
    return out


def _distinct_available(fresh, choice, avail) -> list[z3.BoolRef]:
    T = len(fresh)
    out = [z3.Implies(fresh[i], _at(avail, choice[i])) for i in range(T)]
    out += [
        z3.Implies(z3.And(fresh[i], fresh[j]), choice[i] != choice[j])
        for i in range(T)
        for j in range(i)
    ]
    return out


def _admit(
    b: Bounds, tb: Tables, pool: Pool, seq: Seq, ch: Choice, mutant: Mutant, d: Defs
) -> Effect:
    N, T, B = b.num_blocks, b.max_slots, b.block_size
    hit = d.name(ch.h * B, "hit")
    end = d.name(_min(hit + ch.k, ch.prompt), "end")  # the first step computes hit..end-1
    reserved = d.name(end + b.max_lookahead, "reserved")  # and reserves the run's lookahead
    first = d.name(tb.first_needed(hit), "first")
    last = d.name(tb.div_b(reserved - 1), "last")
    kept = [d.name(z3.And(first <= i, i < ch.h), "kept") for i in range(T)]
    fresh = [d.name(z3.And(ch.h <= i, i <= last), "fresh") for i in range(T)]
    hits_ok = [z3.Implies(i < ch.h, _at(pool.key, ch.hb[i])) for i in range(T)]
    hits_ok += [
        z3.Implies(z3.And(i < ch.h, j < ch.h), ch.hb[i] != ch.hb[j])
        for i in range(T)
        for j in range(i)
    ]
    new = tb.new_blocks(hit, reserved)
    if mutant == "admission-one-short":
        new = new - 1
    evictable_hits = _count([z3.And(kept[i], _at(pool.rc, ch.hb[i]) == 0) for i in range(T)])
    total_free, total_ev = z3.Sum(pool.fl), _count(pool.ev)
    # can_admit: NEVER when it cannot fit even an empty pool, OK when admission.fits.
    ok = d.name(
        z3.And(new + _count(kept) <= N, new + evictable_hits <= total_free + total_ev), "ok"
    )

    inc = [_count([z3.And(kept[i], ch.hb[i] == x) for i in range(T)]) for x in range(N)]
    revived = d.pool(_incref(pool, inc), "revived")
    avail = [d.name(_available(revived, x), "avail") for x in range(N)]
    fail = d.name(z3.And(ok, _count(fresh) > _count(avail)), "fail")
    chosen = [z3.Or(*[z3.And(fresh[i], ch.a[i] == x) for i in range(T)]) for x in range(N)]
    allocated = d.pool(_allocate(revived, chosen, mutant), "alloc")
    slots = [
        d.name(
            z3.If(
                i < first, bv(NONE), z3.If(i < ch.h, ch.hb[i], z3.If(i <= last, ch.a[i], bv(NONE)))
            ),
            "slot",
        )
        for i in range(T)
    ]
    written, imm = _writes(b, allocated, slots, hit, end)
    published = d.pool(_publish(b, written, slots, ch.reg, ch.h, tb.div_b(end)), "admitted")
    go = z3.And(ok, z3.Not(fail))
    return Effect(
        enabled=z3.And(z3.Not(seq.live), reserved <= b.positions),
        go=go,
        pool=published,
        seq=Seq(z3.BoolVal(True), end, hit, reserved, last + 1, slots),
        constraints=[
            hit < ch.prompt,
            *hits_ok,
            z3.Implies(go, z3.And(*_distinct_available(fresh, ch.a, avail))),
        ],
        immutability=z3.And(go, imm),
        admission=fail,
    )


def _step(
    b: Bounds, tb: Tables, pool: Pool, seq: Seq, ch: Choice, mutant: Mutant, d: Defs
) -> Effect:
    N, T, B = b.num_blocks, b.max_slots, b.block_size
    start = seq.n
    wend = d.name(start + ch.k, "wend")
    rend = d.name(wend + ch.la, "rend")
    first = tb.first_needed(start)
    if mutant == "window-keeps-one-more":
        first = _max(bv(0), first - 1)
    first = d.name(first, "first")
    held = [seq.sl[i] != NONE for i in range(T)]
    rc_of = [d.name(_at(pool.rc, seq.sl[i]), "rcof") for i in range(T)]
    drop = [d.name(z3.And(i < first, held[i]), "drop") for i in range(T)]
    released = _count([z3.And(drop[i], rc_of[i] == 1) for i in range(T)])
    lo, hi = d.name(tb.div_b(start), "lo"), d.name(tb.div_b(wend - 1), "hi")
    cow = [
        d.name(z3.And(lo <= i, i <= hi, i < seq.tl, held[i], rc_of[i] > 1), "cow") for i in range(T)
    ]
    if mutant == "skip-copy-on-write":
        cow = [z3.BoolVal(False)] * T
    top = d.name(tb.div_b(rend - 1), "top")
    grow = [z3.And(seq.tl <= i, i <= top) for i in range(T)]
    fresh = [d.name(z3.Or(cow[i], grow[i]), "fresh") for i in range(T)]
    guard = d.name(_count(fresh) <= z3.Sum(pool.fl) + _count(pool.ev) + released, "guard")

    dec = [_count([z3.And(drop[i], seq.sl[i] == x) for i in range(T)]) for x in range(N)]
    dropped = d.pool(_decref(pool, dec), "dropped")
    avail = [d.name(_available(dropped, x), "avail") for x in range(N)]
    fail = d.name(z3.And(guard, _count(fresh) > _count(avail)), "fail")
    chosen = [z3.Or(*[z3.And(fresh[i], ch.a[i] == x) for i in range(T)]) for x in range(N)]
    allocated = _allocate(dropped, chosen, mutant)
    for x in range(N):  # copy-on-write copies the written cells of the old block
        for o in range(B):
            copied = z3.Or(
                *[
                    z3.And(
                        cow[i], ch.a[i] == x, _at([dropped.wr[y][o] for y in range(N)], seq.sl[i])
                    )
                    for i in range(T)
                ]
            )
            allocated.wr[x][o] = z3.Or(allocated.wr[x][o], copied)
    allocated = d.pool(allocated, "alloc")
    dec_cow = [_count([z3.And(cow[i], seq.sl[i] == x) for i in range(T)]) for x in range(N)]
    after = d.pool(_decref(allocated, dec_cow), "cowed")
    slots = [
        d.name(z3.If(i < first, bv(NONE), z3.If(fresh[i], ch.a[i], seq.sl[i])), "slot")
        for i in range(T)
    ]
    written, imm = _writes(b, after, slots, start, wend)
    published = d.pool(_publish(b, written, slots, ch.reg, lo, tb.div_b(wend)), "stepped")
    go = z3.And(guard, z3.Not(fail))
    return Effect(
        enabled=z3.And(seq.live, rend <= b.positions),
        go=go,
        pool=published,
        seq=Seq(z3.BoolVal(True), wend, start, _max(rend, seq.en), _max(seq.tl, top + 1), slots),
        constraints=[z3.Implies(go, z3.And(*_distinct_available(fresh, ch.a, avail)))],
        immutability=z3.And(go, imm),
        admission=fail,
    )


def _fork(b: Bounds, pool: Pool, parent: Seq, child: Seq, ch: Choice, d: Defs) -> Effect:
    N, T = b.num_blocks, b.max_slots
    inc = [_count([parent.sl[i] == x for i in range(T)]) for x in range(N)]
    return Effect(
        enabled=z3.And(parent.live, z3.Not(child.live), ch.s != ch.c),
        go=z3.BoolVal(True),
        pool=d.pool(_incref(pool, inc), "forked"),
        seq=parent,
    )


def _free(b: Bounds, pool: Pool, seq: Seq, mutant: Mutant, d: Defs) -> Effect:
    N, T = b.num_blocks, b.max_slots
    slots = seq.sl
    if mutant == "free-skips-last-slot":
        slots = [z3.If(seq.tl - 1 == i, bv(NONE), seq.sl[i]) for i in range(T)]
    dec = [_count([slots[i] == x for i in range(T)]) for x in range(N)]
    return Effect(
        enabled=seq.live,
        go=z3.BoolVal(True),
        pool=d.pool(_decref(pool, dec), "freed"),
        seq=_dead(b),
    )


def _reset(b: Bounds, pool: Pool) -> Effect:
    """reset_prefix_cache: refused while any block is in use (as V1's), else every cached
    entry is dropped and the evictable blocks go to the free list."""
    nxt = pool.copy()
    nxt.key = [z3.BoolVal(False)] * b.num_blocks
    nxt.ev = [z3.BoolVal(False)] * b.num_blocks
    nxt.fl = [pool.fl[x] + z3.If(pool.ev[x], bv(1), bv(0)) for x in range(b.num_blocks)]
    idle = z3.And(*[rc == 0 for rc in pool.rc])
    return Effect(enabled=z3.BoolVal(True), go=idle, pool=nxt, seq=None)


@attrs.define
class Transition:
    constraints: list[z3.BoolRef]
    immutability: z3.BoolRef
    admission: z3.BoolRef


def transition(
    b: Bounds,
    st: State,
    nxt: State,
    ch: Choice,
    mutant: Mutant = "",
    tag: str = "",
    fixed: tuple[int, int] | None = None,
) -> Transition:
    """Constraints tying ``nxt`` to ``st`` under the choice ``ch``.

    ``fixed=(s, c)`` pins the acting sequence (and the fork child): sequences are
    interchangeable, so from a state that satisfies symmetric invariants this loses nothing.
    """
    S = b.num_seqs
    tb = Tables.of(b)
    d = Defs(tag)

    def select(index, hint: str) -> Seq:
        flats = [s.flat() for s in st.seqs]
        picked = [_at([f[j] for f in flats], index) for j in range(len(flats[0]))]
        return d.seq(Seq(picked[0], picked[1], picked[2], picked[3], picked[4], picked[5:]), hint)

    if fixed is None:
        cur, child = select(ch.s, "cur"), select(ch.c, "child")
        acting, forked = ch.s, ch.c
    else:
        cur, child = st.seqs[fixed[0]], st.seqs[fixed[1]]
        acting, forked = fixed
    pin = [] if fixed is None else [ch.s == fixed[0], ch.c == fixed[1]]
    effects = [
        (1, _admit(b, tb, st.pool, cur, ch, mutant, d)),
        (2, _step(b, tb, st.pool, cur, ch, mutant, d)),
        (3, _fork(b, st.pool, cur, child, ch, d)),
        (4, _free(b, st.pool, cur, mutant, d)),
        (5, _reset(b, st.pool)),
    ]
    constraints = [*ch.domain(b), *pin]
    takes = []
    imm, adm = [], []
    for op, eff in effects:
        on = d.name(z3.And(ch.op == op, eff.enabled), "on")
        constraints += [z3.Implies(on, c) for c in eff.constraints]
        take = d.name(z3.And(on, eff.go), "take")
        takes.append((op, take, eff))
        imm.append(z3.And(on, eff.immutability))
        adm.append(z3.And(on, eff.admission))
    merged = st.pool.flat()
    for _, take, eff in reversed(takes):
        merged = [z3.If(take, x, y) for x, y in zip(eff.pool.flat(), merged, strict=True)]
    constraints += [x == y for x, y in zip(nxt.pool.flat(), merged, strict=True)]
    for j in range(S):
        value = st.seqs[j].flat()
        for op, take, eff in reversed(takes):
            if eff.seq is None:
                continue
            target = forked if op == 3 else acting
            hits_j = (
                take
                if isinstance(target, int) and target == j
                else (z3.BoolVal(False) if isinstance(target, int) else z3.And(take, target == j))
            )
            value = [z3.If(hits_j, x, y) for x, y in zip(eff.seq.flat(), value, strict=True)]
        constraints += [x == y for x, y in zip(nxt.seqs[j].flat(), value, strict=True)]
    constraints += d.eqs
    return Transition(constraints, z3.Or(*imm), z3.Or(*adm))


# ---------------------------------------------------------------- properties


def holders(b: Bounds, st: State, x: int) -> z3.BitVecRef:
    return _count([z3.And(s.live, sl == x) for s in st.seqs for sl in s.sl])


Blocks = Sequence[int] | None  # the blocks a property is checked for (None: all)


def _blocks(b: Bounds, blocks: Blocks) -> Sequence[int]:
    return range(b.num_blocks) if blocks is None else blocks


def refcount_exact(b: Bounds, st: State, blocks: Blocks = None) -> z3.BoolRef:
    return z3.And(*[st.pool.rc[x] == holders(b, st, x) for x in _blocks(b, blocks)])


def conservation(b: Bounds, st: State, blocks: Blocks = None) -> z3.BoolRef:
    p = st.pool
    out = []
    for x in _blocks(b, blocks):
        in_use = p.rc[x] > 0
        out += [
            p.rc[x] >= 0,
            p.fl[x] >= 0,
            p.fl[x] <= 1,
            _count([p.fl[x] == 1, p.ev[x], in_use]) == 1,
            z3.Implies(p.ev[x], p.key[x]),
            z3.Implies(p.fl[x] >= 1, z3.Not(p.key[x])),  # a free block is not in the cache map
        ]
    for s in st.seqs:
        out += [z3.Or(sl == NONE, z3.And(sl >= 0, sl < b.num_blocks)) for sl in s.sl]
    return z3.And(*out)


def window_bound(b: Bounds, st: State, blocks: Blocks = None) -> z3.BoolRef:
    if b.window is None:
        return z3.BoolVal(True)
    tb = Tables.of(b)
    out = []
    for s in st.seqs:
        held = _count([sl != NONE for sl in s.sl])
        out.append(z3.Implies(s.live, held <= tb.window_limit(s.st, s.en)))
    return z3.And(*out)


STATE_PROPERTIES: dict[str, Callable[..., z3.BoolRef]] = {
    "refcount-exact": refcount_exact,
    "conservation": conservation,
    "window-bound": window_bound,
}
TRANSITION_PROPERTIES = ("immutability", "admission-soundness")


def auxiliary(b: Bounds, st: State, blocks: Blocks = None) -> dict[str, z3.BoolRef]:
    """Strengthening invariants for induction (checked like the properties, never assumed
    unproved)."""
    T, B, P = b.max_slots, b.block_size, b.positions
    tb = Tables.of(b)
    p = st.pool
    shape, memory = [], []
    for s in st.seqs:
        dead = [
            z3.Not(s.live),
            s.n == 0,
            s.st == 0,
            s.en == 0,
            s.tl == 0,
            *[x == NONE for x in s.sl],
        ]
        first = tb.first_needed(s.st)
        alive = [
            s.live,
            0 <= s.st,
            s.st < s.n,
            s.n <= s.en,
            s.en <= P,
            s.tl == tb.div_b(s.en - 1) + 1,
        ]
        for i in range(T):
            alive.append(z3.If(z3.And(first <= i, i < s.tl), s.sl[i] != NONE, s.sl[i] == NONE))
        shape.append(z3.Or(z3.And(*dead), z3.And(*alive)))
        for i in range(T):
            for x in _blocks(b, blocks):
                for o in range(B):
                    memory.append(
                        z3.Implies(z3.And(s.live, s.sl[i] == x), p.wr[x][o] == (s.n > i * B + o))
                    )
    cached = [z3.Implies(p.key[x], z3.And(*p.wr[x])) for x in _blocks(b, blocks)]
    free_uncached = [z3.Implies(p.fl[x] >= 1, z3.Not(p.key[x])) for x in _blocks(b, blocks)]
    return {
        "table shape": z3.And(*shape),
        "memory = computed positions": z3.And(*memory),
        "cached blocks full": z3.And(*cached),
        "free blocks uncached": z3.And(*free_uncached),
    }


def invariant(b: Bounds, st: State, blocks: Blocks = None) -> dict[str, z3.BoolRef]:
    """Every state property and auxiliary invariant, by name."""
    out = {name: prop(b, st, blocks) for name, prop in STATE_PROPERTIES.items()}
    out.update({f"aux: {k}": v for k, v in auxiliary(b, st, blocks).items()})
    return out


# ---------------------------------------------------------------- checking


@attrs.frozen
class BmcResult:
    outcome: str  # "proved" | "counterexample" | "unknown"
    violated: str = ""
    depth: int = 0
    trace: str = ""
    reason: str = ""


class Unrolling:
    """The reference's runs from the initial state, one transition at a time, on one solver."""

    def __init__(self, b: Bounds, mutant: Mutant = "", timeout_ms: int = DEFAULT_TIMEOUT_MS):
        self.b, self.mutant = b, mutant
        self.states: list[State] = [initial(b)]
        self.choices: list[Choice] = []
        self.trans: list[Transition] = []
        self.solver = z3.Solver()
        self.solver.set("timeout", timeout_ms)

    def extend(self) -> None:
        t = len(self.trans)
        nxt = State.fresh(self.b, f"@{t + 1}")
        ch = Choice.fresh(self.b, f"@{t}")
        tr = transition(self.b, self.states[-1], nxt, ch, self.mutant, tag=f"@{t}")
        self.solver.add(*tr.constraints)
        self.states.append(nxt)
        self.choices.append(ch)
        self.trans.append(tr)

    def goals(self, blocks: Blocks) -> dict[str, z3.BoolRef]:
        """What must hold after the last transition."""
        out = invariant(self.b, self.states[-1], blocks)
        out["immutability"] = z3.Not(self.trans[-1].immutability)
        out["admission-soundness"] = z3.Not(self.trans[-1].admission)
        return out


def _first_failure(model: z3.ModelRef, goals: Mapping[str, z3.BoolRef]) -> str:
    for name, goal in goals.items():
        if z3.is_false(model.eval(goal, model_completion=True)):
            return name
    return "?"


def prove_runs(
    b: Bounds, timeout_ms: int = DEFAULT_TIMEOUT_MS, depth: int | None = None
) -> BmcResult:
    """Direct BMC: no run of length <= depth breaks a property or an auxiliary invariant.

    Depth by depth, each query asks for the FIRST failure: the states before it are asserted
    to satisfy everything (already proved at that depth).  Blocks are interchangeable (the
    initial state and every transition are symmetric under renaming them), so a failure on
    some block is a failure on block 0 in a renamed run: the query looks at block 0 only.
    """
    u = Unrolling(b, timeout_ms=timeout_ms)
    depth = b.depth if depth is None else depth
    if not initial_satisfies(b):
        return BmcResult("unknown", reason="the initial state breaks an invariant")
    for t in range(1, depth + 1):
        u.extend()
        goals = u.goals(blocks=(0,))
        u.solver.push()
        u.solver.add(z3.Not(z3.And(*goals.values())))
        answer = u.solver.check()
        if answer == z3.sat:
            model = u.solver.model()
            name = _first_failure(model, goals)
            u.solver.pop()
            return BmcResult("counterexample", name, t, _trace(b, model, u, name))
        if answer != z3.unsat:
            reason = u.solver.reason_unknown()
            u.solver.pop()
            return BmcResult("unknown", depth=t - 1, reason=f"depth {t}: {reason}")
        u.solver.pop()
        u.solver.add(*invariant(b, u.states[-1]).values())  # proved at this depth, every block
    return BmcResult("proved", depth=depth)


def find_violation(
    b: Bounds, prop: str, mutant: Mutant, timeout_ms: int = DEFAULT_TIMEOUT_MS
) -> BmcResult:
    """The shortest run (<= depth) on which ``prop`` fails, for a seeded bug."""
    u = Unrolling(b, mutant, timeout_ms)
    for t in range(1, b.depth + 1):
        u.extend()
        if prop in STATE_PROPERTIES:
            bad = z3.Not(STATE_PROPERTIES[prop](b, u.states[-1]))
        elif prop == "immutability":
            bad = u.trans[-1].immutability
        else:
            bad = u.trans[-1].admission
        u.solver.push()
        u.solver.add(bad)
        answer = u.solver.check()
        if answer == z3.sat:
            return BmcResult("counterexample", prop, t, _trace(b, u.solver.model(), u, prop))
        u.solver.pop()
        if answer != z3.unsat:
            return BmcResult("unknown", reason=u.solver.reason_unknown())
    return BmcResult("proved", depth=b.depth)


def _trace(b: Bounds, model: z3.ModelRef, u: Unrolling, violated: str) -> str:
    """The run in plain numbers."""

    def ev(e):
        v = model.eval(e, model_completion=True)
        return v.as_signed_long() if z3.is_bv_value(v) else z3.is_true(v)

    lines = []
    for t, ch in enumerate(u.choices):
        op = OPS[ev(ch.op)]
        s, c = ev(ch.s), ev(ch.c)
        if op == "admit":
            hits = [ev(ch.hb[i]) for i in range(ev(ch.h))]
            desc = f"admit seq{s} prompt={ev(ch.prompt)} k={ev(ch.k)} hits={hits}"
        elif op == "step":
            desc = f"step seq{s} k={ev(ch.k)} lookahead={ev(ch.la)}"
        elif op == "fork":
            desc = f"fork seq{s}->seq{c}"
        elif op == "free":
            desc = f"free seq{s}"
        else:
            desc = op
        nxt = u.states[t + 1]
        tables = {i: [ev(x) for x in sq.sl] for i, sq in enumerate(nxt.seqs) if ev(sq.live)}
        lines.append(f"{t + 1}. {desc}: tables={tables} rc={[ev(x) for x in nxt.pool.rc]}")
    return f"{violated} fails: " + " | ".join(lines)


def induction(b: Bounds, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> dict[str, str]:
    """1-induction: from ANY state satisfying every property and auxiliary invariant, one
    transition keeps each of them and breaks no transition property.

    Sequences are interchangeable, so the acting sequence is 0 and a fork's child 1; blocks
    are interchangeable, so the goals look at block 0 (the assumptions cover every block).
    """
    s0 = State.fresh(b, "@i0")
    s1 = State.fresh(b, "@i1")
    ch = Choice.fresh(b, "@i")
    tr = transition(b, s0, s1, ch, tag="@i", fixed=(0, 1))
    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    solver.add(*tr.constraints)
    solver.add(*invariant(b, s0).values())
    goals = invariant(b, s1, blocks=(0,))
    goals["immutability"] = z3.Not(tr.immutability)
    goals["admission-soundness"] = z3.Not(tr.admission)
    out = {}
    for name, goal in goals.items():
        if name == "window-bound" and b.window is None:
            continue
        solver.push()
        solver.add(z3.Not(goal))
        answer = solver.check()
        if answer == z3.unsat:
            out[name] = "inductive"
        elif answer == z3.sat:
            out[name] = "not inductive"
        else:
            out[name] = f"unknown ({solver.reason_unknown()})"
        solver.pop()
    return out


def initial_satisfies(b: Bounds) -> bool:
    """The base case: the empty pool satisfies every property and auxiliary invariant."""
    solver = z3.Solver()
    solver.add(z3.Not(z3.And(*invariant(b, initial(b)).values())))
    return solver.check() == z3.unsat


MUTANTS: dict[str, str] = {
    # seeded bug -> the property that must catch it
    "free-skips-last-slot": "refcount-exact",
    "alloc-keeps-free-entry": "conservation",
    "skip-copy-on-write": "immutability",
    "window-keeps-one-more": "window-bound",
    "admission-one-short": "admission-soundness",
}


def _properties_for(b: Bounds) -> list[str]:
    names = list(STATE_PROPERTIES) + list(TRANSITION_PROPERTIES)
    return [n for n in names if not (n == "window-bound" and b.window is None)]


def check_reference(b: Bounds, deep: bool) -> Verdict:
    """Induction (every depth), direct BMC (to a depth), and the seeded bugs."""
    timeout = 600_000 if deep else 120_000
    props = _properties_for(b)
    parts = []
    t0 = time.perf_counter()
    ind = induction(b, timeout)
    t_ind = time.perf_counter() - t0
    open_ = {k: v for k, v in ind.items() if v != "inductive"}
    if not initial_satisfies(b):
        open_["base case"] = "the initial state breaks an invariant"
    unbounded = [p for p in props if p in ind and not open_]
    direct_depth = min(b.depth, DEEP_DIRECT_DEPTH if deep else DEFAULT_DIRECT_DEPTH)
    t0 = time.perf_counter()
    runs = prove_runs(b, timeout, depth=direct_depth)
    t_bmc = time.perf_counter() - t0
    if runs.outcome == "counterexample" and runs.violated in props:
        return Verdict("counterexample", b.describe(), runs.trace, twin="-", twin_ok=False)
    if not open_:
        parts.append(
            f"1-induction with the auxiliary invariants closes every property and itself "
            f"({t_ind:.0f}s): {', '.join(unbounded)} hold at EVERY depth, so on every run of "
            f"length <= {b.depth}"
        )
    else:
        parts.append(f"induction open: {', '.join(f'{k} ({v})' for k, v in open_.items())}")
    if runs.outcome == "proved":
        parts.append(
            f"direct unrolling from the initial state agrees to depth {runs.depth} ({t_bmc:.0f}s)"
        )
    else:
        parts.append(f"direct BMC: {runs.outcome} ({runs.reason or runs.trace})")
    proved_to = b.depth if not open_ else (runs.depth if runs.outcome == "proved" else 0)
    if open_:
        parts.append(f"proved only to depth {proved_to}")
    outcome = "proved" if (not open_ or proved_to >= b.depth) else "unknown"
    # Non-vacuity: every seeded bug is caught within the depth.
    caught, missed = [], []
    for mutant, prop in MUTANTS.items():
        if prop not in props:
            continue
        r = find_violation(b, prop, mutant, timeout)
        (caught if r.outcome == "counterexample" else missed).append(f"{mutant}->{prop}@{r.depth}")
    twin = f"seeded bugs caught: {len(caught)}/{len(caught) + len(missed)} ({', '.join(caught)})"
    if missed:
        twin += f"; MISSED: {', '.join(missed)}"
    return Verdict(outcome, b.describe(), "; ".join(parts), twin=twin, twin_ok=not missed)


DEFAULT_DIRECT_DEPTH = 2  # the unrolled cross-check; induction covers every depth
DEEP_DIRECT_DEPTH = 3


@obligation(
    "refcount-exact/reference-bmc",
    also_serves=(*STATE_PROPERTIES, *TRANSITION_PROPERTIES),
)
def reference_bmc(deep: bool) -> Verdict:
    """For every run of the reference's operations (admit with prefix hits, step with
    copy-on-write, lookahead and window drops, fork, free, reset): refcount-exact,
    conservation, window-bound, immutability and admission-soundness hold -- by induction at
    every depth where it closes, else to the stated depth; each seeded bug is caught."""
    bounds = [DEFAULT_BOUNDS] if not deep else [DEFAULT_BOUNDS, *DEEP_BOUNDS]
    verdicts = [check_reference(b, deep) for b in bounds]
    bad = [v for v in verdicts if v.outcome != "proved" or not v.twin_ok]
    if bad:
        return bad[0]
    if len(verdicts) == 1:
        return verdicts[0]
    return Verdict(
        "proved",
        " + ".join(v.bounds for v in verdicts),
        " || ".join(v.detail for v in verdicts),
        twin=" || ".join(v.twin for v in verdicts),
    )


@attrs.define
class _Stepper:
    s0: State
    s1: State
    ch: Choice
    tr: Transition
    solver: z3.Solver


_STEPPERS: dict[Bounds, _Stepper] = {}


def concrete_step(b: Bounds, before: Mapping[str, object], choice: Mapping[str, object]) -> dict:
    """One transition on concrete values (for the conformance test against the reference):
    the next state, the transition-property flags, and whether the successor is unique."""
    if b not in _STEPPERS:
        s0, s1, ch = State.fresh(b, "c0"), State.fresh(b, "c1"), Choice.fresh(b, "c")
        tr = transition(b, s0, s1, ch, tag="c")
        solver = z3.Solver()
        solver.add(*tr.constraints)
        _STEPPERS[b] = _Stepper(s0, s1, ch, tr, solver)
    k = _STEPPERS[b]
    k.solver.push()
    try:
        k.solver.add(*_bind(b, k.s0, before))
        for name, value in choice.items():
            target = getattr(k.ch, name)
            if isinstance(target, list):
                k.solver.add(*[target[i] == v for i, v in enumerate(value)])  # type: ignore[arg-type]
            else:
                k.solver.add(target == value)
        answer = k.solver.check()
        if answer != z3.sat:
            raise AssertionError(f"the transition has no successor: {answer}")
        model = k.solver.model()
        out = _read(b, model, k.s1)
        out["immutability_violation"] = z3.is_true(
            model.eval(k.tr.immutability, model_completion=True)
        )
        out["admission_violation"] = z3.is_true(model.eval(k.tr.admission, model_completion=True))
        k.solver.add(z3.Or(*[x != model.eval(x, model_completion=True) for x in k.s1.flat()]))
        out["unique"] = k.solver.check() == z3.unsat
        return out
    finally:
        k.solver.pop()


def initial_values(b: Bounds) -> dict:
    """The initial state as plain values (``concrete_step``'s format)."""
    return {
        "rc": [0] * b.num_blocks,
        "fl": [1] * b.num_blocks,
        "ev": [False] * b.num_blocks,
        "key": [False] * b.num_blocks,
        "wr": [[False] * b.block_size for _ in range(b.num_blocks)],
        "seqs": [
            {"live": False, "n": 0, "st": 0, "en": 0, "tl": 0, "sl": [NONE] * b.max_slots}
            for _ in range(b.num_seqs)
        ],
    }


def _bind(b: Bounds, st: State, values: Mapping[str, object]) -> list[z3.BoolRef]:
    p = st.pool
    out = []
    for x in range(b.num_blocks):
        out += [
            p.rc[x] == values["rc"][x],
            p.fl[x] == values["fl"][x],  # type: ignore[index]
            p.ev[x] == values["ev"][x],
            p.key[x] == values["key"][x],
        ]  # type: ignore[index]
        out += [p.wr[x][o] == values["wr"][x][o] for o in range(b.block_size)]  # type: ignore[index]
    for s, seq in enumerate(st.seqs):
        v = values["seqs"][s]  # type: ignore[index]
        out += [
            seq.live == v["live"],
            seq.n == v["n"],
            seq.st == v["st"],
            seq.en == v["en"],
            seq.tl == v["tl"],
        ]
        out += [seq.sl[i] == v["sl"][i] for i in range(b.max_slots)]
    return out


def _read(b: Bounds, model: z3.ModelRef, st: State) -> dict:
    def ev(e):
        v = model.eval(e, model_completion=True)
        return v.as_signed_long() if z3.is_bv_value(v) else z3.is_true(v)

    p = st.pool
    return {
        "rc": [ev(x) for x in p.rc],
        "fl": [ev(x) for x in p.fl],
        "ev": [ev(x) for x in p.ev],
        "key": [ev(x) for x in p.key],
        "wr": [[ev(x) for x in w] for w in p.wr],
        "seqs": [
            {
                "live": ev(s.live),
                "n": ev(s.n),
                "st": ev(s.st),
                "en": ev(s.en),
                "tl": ev(s.tl),
                "sl": [ev(x) for x in s.sl],
            }
            for s in st.seqs
        ],
    }
