"""Differential runs: the implementation and the reference, in lockstep, under one machine.

Both get every operation; the spec's invariants are checked on both after every step (each
through its own Driver), and the two are compared in an explicit mode:

outcomes  every operation is accepted by both or refused by both;
counts    also, every sequence both track holds the same number of blocks;
renaming  also, the block tables are equal up to renaming block ids: the same slots are
          dropped, and (with prefix caching off, where sharing comes only from fork) the
          same slots share a block.  With prefix caching on, which blocks end up shared is
          policy (eviction order, V1's duplicate cached blocks), so only the dropped pattern
          is compared.  The default.

A difference that a known divergence (``divergences.KNOWN``) explains is allowed and noted;
any other is a violation, reported under the mode's ID (``differential/<mode>``).  When one
side refuses what the other accepts, the sequence stops being compared (and is freed on the
side that has it), so the two keep running on the same operations.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

import attrs
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from kvspec.reference import ReferenceManager
from kvspec.spec.invariants import Violation
from kvspec.spec.state import Status
from kvspec.testing.blockmanager.completeness import cached_prefix, policy_of, window_hit
from kvspec.testing.blockmanager.driver import Driver, SpecViolation
from kvspec.testing.blockmanager.machine import KVCacheMachine
from kvspec.testing.divergences import KNOWN, Divergence, Mismatch, explained


class Mode(StrEnum):
    OUTCOMES = "outcomes"
    COUNTS = "counts"
    RENAMING = "renaming"


_ORDER = [Mode.OUTCOMES, Mode.COUNTS, Mode.RENAMING]


class Lockstep:
    """Looks like a Driver to the machine; drives the target and the reference."""

    def __init__(
        self, target: Driver, reference: Driver, mode: Mode, known: tuple[Divergence, ...] = KNOWN
    ) -> None:
        self.target, self.reference, self.mode, self.known = target, reference, mode, known
        self.untracked: set[int] = set()
        self.mismatches: list[Violation] = []
        self.allowed: list[tuple[Mismatch, Divergence]] = []
        self.caches_differ = False  # the two prefix caches have held different keys

    def __getattr__(self, name):
        return getattr(self.target, name)

    def _compares(self, mode: Mode) -> bool:
        return _ORDER.index(self.mode) >= _ORDER.index(mode)

    def _mirror(
        self, op: str, seq: int | None, run: Callable[[Driver], bool | None]
    ) -> bool | None:
        prefill = (
            seq is not None
            and seq in self.target.seqs
            and (self.target.seqs[seq].num_computed < len(self.target.seqs[seq].tokens) - 1)
        )
        if not self.caches_differ and _findable(self.target) != _findable(self.reference):
            # Eviction order (and V1's duplicate cached blocks) made the two caches hold
            # different keys: from here on, hits and so outcomes may differ (cache-hit-policy).
            self.caches_differ = True
            note("the prefix caches now hold different keys (eviction policy)")
        got = run(self.target)
        if seq is not None and seq in self.untracked:
            return got
        want = run(self.reference)
        if got is not None and want is not None and got != want:
            self._differ(Mode.OUTCOMES, op, seq, got, want, prefill)
            if seq is not None:
                self._untrack(seq)
        elif seq is not None and self._progress(self.target, seq) != self._progress(
            self.reference, seq
        ):
            # Prefix-cache hits differ (eviction order, hit granularity: policy); from here
            # the two sequences would compute different positions, so stop comparing them.
            note(f"seq {seq}: cache hits differ from the reference; no longer compared")
            self._untrack(seq)
        return got

    @staticmethod
    def _progress(driver: Driver, seq: int):
        model = driver.seqs.get(seq)
        return None if model is None else (model.num_computed, len(model.tokens))

    def _untrack(self, seq: int) -> None:
        self.untracked.add(seq)
        model = self.reference.seqs.get(seq)
        if model is not None and model.status is not Status.WAITING:
            self.reference.free(seq)

    def _differ(self, mode: Mode, op: str, seq, got, want, prefill: bool) -> None:
        m = Mismatch(
            mode.value,
            op,
            seq,
            got,
            want,
            self.target.impl.name,
            prefill,
            self.target.config.prefix_caching,
            self.target.refusal_window_drops > 0,
            within_declared_reserve=not any(
                v.invariant == "admission-completeness" for v in self.target.pending
            ),
            earlier_difference=bool(self.allowed or self.untracked or self.caches_differ),
            target_holds_untracked=any(
                s in self.target.seqs and self.target.seqs[s].status is not Status.WAITING
                for s in self.untracked
            ),
            window_hit_from_the_end=op in ("admit", "readmit") and self._hit_from_the_end(seq),
        )
        why = explained(m, self.known)
        if why is not None:
            self.allowed.append((m, why))
            note(f"allowed divergence {why.id}: {op} seq {seq}: target {got}, reference {want}")
        elif self._compares(mode):
            self.mismatches.append(
                Violation(
                    f"differential/{mode.value}",
                    f"{op} on seq {seq}: {self.target.impl.name} gave {got}, the reference {want}",
                    kind=op,
                    seqs=() if seq is None else (seq,),
                    expected=want,
                    observed=got,
                )
            )

    def _hit_from_the_end(self, seq: int | None) -> bool:
        """Whether the target, declaring ``window_hits_from_the_end``, could take a longer hit
        for ``seq``'s prompt in its pool before this admission than the cached prefix from the
        prompt's start, the reference's lookup."""
        config = self.target.config
        policy = policy_of(self.target.impl)
        model = self.target.seqs.get(seq) if seq is not None else None
        if model is None or config.sliding_window is None or not config.prefix_caching:
            return False
        if not policy.window_hits_from_the_end:
            return False
        pool, B = self.target.before_op.gpu, config.block_size
        end, _ = window_hit(pool, model.tokens, model.extra, B, config.sliding_window, policy.hit_drops_last_block)
        start, _ = cached_prefix(pool, model.tokens, model.extra, B)
        return end > start

    # ------------------------------------------------ the Driver surface the machine uses

    def admit(self, seq_id, tokens, num_new_tokens, next_token=0, extra=()):
        return self._mirror(
            "admit", seq_id, lambda d: d.admit(seq_id, tokens, num_new_tokens, next_token, extra)
        )

    def readmit(self, seq_id, num_new_tokens, next_token=0):
        return self._mirror(
            "readmit", seq_id, lambda d: d.readmit(seq_id, num_new_tokens, next_token)
        )

    def step(self, seq_id, num_new_tokens, next_token=0):
        return self._mirror("step", seq_id, lambda d: d.step(seq_id, num_new_tokens, next_token))

    def fork(self, parent_id, child_id):
        self.target.fork(parent_id, child_id)
        if parent_id in self.untracked:
            self.untracked.add(child_id)
        else:
            self.reference.fork(parent_id, child_id)

    def free(self, seq_id):
        self._mirror("free", seq_id, lambda d: d.free(seq_id))
        self.untracked.discard(seq_id)

    def preempt(self, seq_id):
        self._mirror("preempt", seq_id, lambda d: d.preempt(seq_id))

    def swap_out(self, seq_id):
        return self._mirror("swap_out", seq_id, lambda d: d.swap_out(seq_id))

    def swap_in(self, seq_id):
        return self._mirror("swap_in", seq_id, lambda d: d.swap_in(seq_id))

    def reset_prefix_cache(self):
        return self._mirror("reset_prefix_cache", None, lambda d: d.reset_prefix_cache())

    # ------------------------------------------------ checking

    def check(self) -> list[Violation]:
        found = self.target.check() + [
            attrs.evolve(v, message=f"(reference) {v.message}") for v in self.reference.check()
        ]
        self._compare_tables()
        found += self.mismatches
        self.mismatches = []
        return found

    def free_all(self) -> list[Violation]:
        return self.target.free_all() + self.reference.free_all()

    def _compare_tables(self) -> None:
        if not self._compares(Mode.COUNTS):
            return
        shared = [
            s
            for s, m in self.target.seqs.items()
            if s not in self.untracked
            and m.status is not Status.WAITING
            and s in self.reference.state.tables
            and s in self.target.state.tables
        ]
        for s in shared:
            t, r = self.target.state.tables[s], self.reference.state.tables[s]
            model = self.target.seqs[s]
            prefill = model.num_computed < len(model.tokens) - 1
            if len(t.held()) != len(r.held()):
                self._differ(Mode.COUNTS, "held blocks", s, len(t.held()), len(r.held()), prefill)
            elif self._compares(Mode.RENAMING):
                dropped_t = [i for i, b in enumerate(t.slots) if b is None]
                dropped_r = [i for i, b in enumerate(r.slots) if b is None]
                if dropped_t != dropped_r:
                    self._differ(Mode.RENAMING, "dropped slots", s, dropped_t, dropped_r, prefill)
        if self._compares(Mode.RENAMING) and not self.target.config.prefix_caching:
            if _sharing(self.target, shared) != _sharing(self.reference, shared):
                self._differ(
                    Mode.RENAMING,
                    "shared slots",
                    None,
                    _sharing(self.target, shared),
                    _sharing(self.reference, shared),
                    False,
                )


def _findable(driver: Driver) -> frozenset:
    """The keys a lookup of this side's prefix cache can hit."""
    pool = driver.state.gpu
    return frozenset(key for key, block in pool.cached if block in pool.computed)


def _sharing(driver: Driver, seqs: list[int]) -> list[list[tuple[int, int]]]:
    """Which (seq, slot) pairs share a block: the block tables up to renaming of ids."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for s in sorted(seqs):
        for i, b in enumerate(driver.state.tables[s].slots):
            if b is not None:
                groups.setdefault(b, []).append((s, i))
    return sorted(g for g in groups.values() if len(g) > 1)


class DifferentialMachine(KVCacheMachine):
    """The machine, with the reference run in lockstep and compared in ``mode``."""

    def __init__(
        self,
        factory,
        config_strategy=None,
        *,
        mode: Mode = Mode.RENAMING,
        known: tuple[Divergence, ...] = KNOWN,
        **kwargs,
    ) -> None:
        super().__init__(factory, config_strategy, **kwargs)
        self.mode = mode
        self.known = known
        self.lockstep: Lockstep | None = None

    @property
    def d(self):
        return self.lockstep if self.lockstep is not None else super().d

    @initialize(data=st.data())
    def build(self, data):
        self._build_driver(data)
        # The reference admits as the target declares it does (spec/interface.py ``admit``):
        # with or without the run's lookahead slots.
        admit_lookahead = getattr(self.driver.impl, "admit_lookahead", None)
        reference = Driver(ReferenceManager(self.driver.config, admit_lookahead), focus=self.focus)
        self.lockstep = Lockstep(self.driver, reference, self.mode, self.known)

    def teardown(self):
        if self.lockstep is None or self.failed:
            return
        self.stats.add(self.driver)
        for _, why in self.lockstep.allowed:
            self.stats.divergences[why.id] = self.stats.divergences.get(why.id, 0) + 1
        found = self.lockstep.free_all()
        if found:
            raise SpecViolation(found, self.driver.trace)
