"""Swarm configurations and targeted generation for the stateful machine.

``SwarmMachine`` is ``KVCacheMachine`` with a *swarm* drawn once per example (Groce et al.,
"Swarm testing", ISSTA 2012): a random subset of the operations is switched off for the whole
example, and prompt shaping steers admissions toward the states the invariants care about:

- ``repeat``: an admission that extends an earlier prompt repeats it exactly (same tokens,
  same length), so identical prompts -- several blocks under one prefix key, cache hits on
  freed blocks -- are common instead of needing two bytes to collide;
- ``aligned``: prompt lengths are rounded up to a multiple of the block size (full last
  blocks: where caching, windows and allocation meet block boundaries);
- ``fill``: a fresh prompt needs exactly the blocks the pool has left (a pool at exactly full).

With the default machine every operation is enabled in every example, so an operation that
interferes with a failure (a fork, a preemption, a swap) is almost always present and rare
combinations drown.  Every swarm flag shrinks toward the default machine (all operations on,
no shaping), so a shrunk counterexample needs only the flags it depends on.

Shaping rewrites the admission's bytes before ``KVCacheMachine`` decodes them (the same
``prompt_from``), so traces, replay and shrinking are unchanged.  ``target()`` (hypothesis'
targeted phase) is fed the pool's peak occupancy, the peak refcount and the peak number of
blocks cached under a key another block also has.
"""

from __future__ import annotations

import functools
import math

import attrs
from hypothesis import note, target
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from kvspec.testing.blockmanager.machine import KVCacheMachine
from kvspec.testing.generator_rules import EDGE_CODE, prompt_length, repeats_prefix

# Operations a swarm can switch off (admissions and scheduler iterations always run).
SWARM_OPS = ("step", "fork", "free", "preempt", "readmit", "swap_out", "swap_in",
             "reset_prefix_cache")
BYTE = 256
PROMPT_BYTES = 6  # source, cut, chunk, next token, length (two): prompt_from's header


@attrs.frozen
class Swarm:
    """One example's swarm: operations switched off, and prompt shaping switched on."""

    off: frozenset[str] = frozenset()
    chunked: bool = True  # chunked prefill (where the target supports it)
    repeat: bool = False
    aligned: bool = False
    fill: bool = False

    def describe(self) -> str:
        shaping = [name for name in ("repeat", "aligned", "fill") if getattr(self, name)]
        off = sorted(self.off) + ([] if self.chunked else ["chunked prefill"])
        return (f"swarm: off={','.join(off) or '-'} shaping={','.join(shaping) or '-'}")


@st.composite
def swarms(draw) -> Swarm:
    # Booleans shrink to False: every operation on, no shaping (the default machine).
    off = frozenset(op for op in SWARM_OPS if draw(st.booleans()))
    return Swarm(off=off, chunked=not draw(st.booleans()), repeat=draw(st.booleans()),
                 aligned=draw(st.booleans()), fill=draw(st.booleans()))


@functools.lru_cache(maxsize=4096)
def length_bytes(length: int, max_len: int) -> tuple[int, int] | None:
    """Two bytes ``(a, b)`` that ``prompt_from`` decodes to ``length`` (``1 + a*b*max_len //
    65536``), or None when no pair does."""
    for a in range(BYTE - 1, 0, -1):
        if a % EDGE_CODE == EDGE_CODE - 1:
            continue  # such a first byte snaps the length to an edge (generator_rules.prompt_length)
        b = math.ceil((length - 1) * 65536 / (a * max_len)) if length > 1 else 0
        if b < BYTE and 1 + a * b * max_len // 65536 == length:
            return a, b
    return (0, 0) if length == 1 else None


def shape(raw: bytes, swarm: Swarm, earlier: list[tuple[int, ...]], block_size: int,
          max_len: int, free_blocks: int) -> bytes:
    """The admission bytes ``raw`` rewritten by the swarm's prompt shaping."""
    if not (swarm.repeat or swarm.aligned or swarm.fill) or len(raw) < PROMPT_BYTES:
        return raw
    b = bytearray(raw)
    source, cut_code, _, _, len_a, len_b = b[:PROMPT_BYTES]
    length = prompt_length(len_a, len_b, max_len, block_size)
    extends = bool(earlier) and repeats_prefix(source)
    if swarm.repeat and extends and cut_code % 2 == 1:
        base = earlier[-1 - (source // 4) % len(earlier)]
        if 2 * len(base) + 1 < BYTE:
            b[1] = 2 * len(base) + 1  # cut at the whole earlier prompt ...
            length = len(base)  # ... and as long as it: an exact repeat
    elif swarm.fill and not extends and 0 < free_blocks * block_size <= max_len:
        length = free_blocks * block_size
    if swarm.aligned:
        length = min(max_len // block_size * block_size or max_len,
                     -(-length // block_size) * block_size)
    pair = length_bytes(length, max_len)
    if pair is not None:
        b[4], b[5] = pair
    return bytes(b)


def _swarmed(name: str):
    """The machine's rule ``name``, also switched off when the example's swarm says so."""
    parent = getattr(KVCacheMachine, name)
    spec = parent.hypothesis_stateful_rule

    def body(self, **kwargs):
        return parent(self, **kwargs)

    body.__name__ = body.__qualname__ = name
    fn = rule(**spec.arguments)(body)
    for pre in spec.preconditions:
        fn = precondition(pre)(fn)
    return precondition(lambda self: name not in self.swarm.off)(fn)


class SwarmMachine(KVCacheMachine):
    """``KVCacheMachine`` under a per-example swarm (see the module docstring)."""

    swarm: Swarm = Swarm()

    @initialize(data=st.data())
    def build(self, data):
        self.swarm = data.draw(swarms(), label="swarm")
        note(self.swarm.describe())
        self.peaks = {"pool-occupancy": 0.0, "max-refcount": 0.0, "duplicate-keys": 0.0}
        self._build_driver(data)

    step = _swarmed("step")
    fork = _swarmed("fork")
    free = _swarmed("free")
    preempt = _swarmed("preempt")
    readmit = _swarmed("readmit")
    swap_out = _swarmed("swap_out")
    swap_in = _swarmed("swap_in")
    reset_prefix_cache = _swarmed("reset_prefix_cache")

    def _chunk(self, code: int, remaining: int) -> int:
        return super()._chunk(code, remaining) if self.swarm.chunked else remaining

    def _admit(self, raw: bytes) -> int | None:
        B = self.d.config.block_size
        pool = self.d.state.gpu
        free = len(pool.free) + len(pool.evictable) if pool is not None else 0
        return super()._admit(shape(raw, self.swarm, self.prompts, B,
                                    B * self.max_prompt_blocks, free))

    @invariant()
    def measure(self):
        """Peaks for hypothesis' targeted phase (reported once, at teardown)."""
        if self.driver is None or self.d.state.gpu is None:
            return
        pool = self.d.state.gpu
        n = len(pool.ids) or 1
        used = n - len(pool.free) - len(pool.evictable)
        keys = [repr(k) for k, _ in pool.cached]
        peaks = self.peaks
        peaks["pool-occupancy"] = max(peaks["pool-occupancy"], used / n)
        peaks["max-refcount"] = max(peaks["max-refcount"], max(pool.refcounts.values(), default=0))
        peaks["duplicate-keys"] = max(peaks["duplicate-keys"], len(keys) - len(set(keys)))

    def teardown(self):
        if self.driver is not None:
            for label, value in self.peaks.items():
                target(float(value), label=label)
        super().teardown()
