"""Scheduler lockstep: vLLM's own scheduler on BASE and HEAD at once, the spec judging every difference.

The scheduler machine's rules (testing/scheduler/machine.py: requests arrive, the engine steps,
requests are aborted, then the teardown drains) run on two targets, each vLLM's own V1
``Scheduler`` / ``AsyncScheduler`` (adapters/v1_scheduler.py) driven by the scheduler machine's
worker model (testing/scheduler/driver.py) in a child process of its own -- the same children,
protocol, guard, verdicts and search rounds as the block manager's lockstep
(testing/lockstep.py: ``Remote``, ``Side``, ``judge``, ``Verdict``, ``run_lockstep``).  After
every operation the two sides' ``SchedulerObservation`` are compared, in the lockstep's modes:

outcomes  the same crash, the same requests admitted with the same prefix-hit computed tokens,
          each scheduled request at the same position for the same tokens (drafts included),
          the same requests preempted (in order) and finished;
counts    also the blocks each request holds in each KV-cache group, the pool's free and
          evictable counts and each group's prefix-cache entries;
renaming  also every group's block tables up to a renaming of block ids (one renaming over the
          shared pool), each group's prefix-cache keys and the KV events each operation emitted.

At the first difference the spec judges on each side's own check (``SchedulerDriver.check``:
every invariant per group and over the shared pool): HEAD violates an invariant BASE does not
-> regression, the reverse -> fix, neither -> behaviour change; each shrunk on its own, a
behaviour change with a golden pytest file BASE writes (testing/artifacts/golden.py
``write_scheduler_golden``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import attrs
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from kvspec.reference.broken_scheduler import DIFFERENTIAL_ONLY, PREFIX_CACHE_ONLY
from kvspec.spec.errors import ConfigError, Unsupported
from kvspec.spec.groups import HybridState, Shape
from kvspec.spec.invariants import Violation
from kvspec.spec.prefix_hash import NO_EXTRA, ExtraKeys
from kvspec.spec.state import Status
from kvspec.testing.guard import Guard, GuardTripped
from kvspec.testing.implementations import SCHEDULERS
from kvspec.testing.lockstep import (
    FIELD_MODES,
    Limits,
    LockstepDriver,
    LockstepStats,
    Mode,
    Remote,
    Reply,
    _key,
    _Session,
    both,
    crash_function,
    crash_violation,
    settle_build,
)
from kvspec.testing.lockstep import serve as serve_requests
from kvspec.testing.scheduler.driver import SchedulerDriver
from kvspec.testing.scheduler.machine import SchedulerMachine, shapes
from kvspec.testing.scheduler.progress import drain

SCHEDULER_IMPL = "v1-scheduler"  # testing/implementations.py SCHEDULERS: vLLM's own V1 scheduler
TEARDOWN = "teardown"
# kvspec's own schedulers a side may name instead of a vLLM block manager (the lockstep's own
# tests): the reference, its broken variants, and those only a comparison sees.
KVSPEC_SCHEDULERS: dict[str, Callable[[Shape], Any]] = {
    **{name: impl.factory for name, impl in SCHEDULERS.items() if not impl.is_vllm},
    **{name: cls for name, (cls, _) in DIFFERENTIAL_ONLY.items()},
    **PREFIX_CACHE_ONLY,
}


def scheduler_factory(impl: str) -> Callable[[Shape], Any]:
    """What a side named ``impl`` schedules with: the kvspec scheduler of that name, else (a
    vLLM block manager's name: the side runs a vLLM tree) vLLM's own V1 scheduler."""
    return KVSPEC_SCHEDULERS.get(impl) or SCHEDULERS[SCHEDULER_IMPL].factory


@attrs.frozen
class SchedulerObservation:
    """What one side's scheduler did in one operation, free of block ids.

    outcome     the operation's name ("step: crashed" when the target raised)
    crash       (exception type, vLLM module, function) of what escaped the target, or ()
    hits        (request, computed tokens at admission) for each request the step admitted:
                the prefix hit (0: none), preempted requests readmitted included
    scheduled   (request, start, tokens, drafts) for each request the step scheduled, by request
    preempted   the requests the step preempted, in the scheduler's order
    finished    the requests that finished in this operation (their output reached the scheduler)
    held        (group, request, blocks held) for every block table
    free        free blocks holding no cached content (the shared pool)
    evictable   unreferenced blocks kept for their cached content (the shared pool)
    cached      prefix-cache entries per group
    tables      (group, request, slots) with block ids renamed by first appearance over the pool
    cached_keys each group's prefix-cache keys (token chain and extra keys), sorted
    events      (group, event) for the KV events this operation emitted, in order
    """

    outcome: str = ""
    crash: tuple[str, ...] = ()
    hits: tuple[tuple[int, int], ...] = ()
    scheduled: tuple[tuple[int, int, int, int], ...] = ()
    preempted: tuple[int, ...] = ()
    finished: tuple[int, ...] = ()
    held: tuple[tuple[str, int, int], ...] = ()
    free: int = 0
    evictable: int = 0
    cached: tuple[int, ...] = ()
    tables: tuple[tuple[Any, ...], ...] = ()
    cached_keys: tuple[tuple[str, ...], ...] = ()
    events: tuple[tuple[str, str], ...] = ()


FIELD_MODES[SchedulerObservation] = {
    "outcome": Mode.OUTCOMES,
    "crash": Mode.OUTCOMES,
    "hits": Mode.OUTCOMES,
    "scheduled": Mode.OUTCOMES,
    "preempted": Mode.OUTCOMES,
    "finished": Mode.OUTCOMES,
    "held": Mode.COUNTS,
    "free": Mode.COUNTS,
    "evictable": Mode.COUNTS,
    "cached": Mode.COUNTS,
    "tables": Mode.RENAMING,
    "cached_keys": Mode.RENAMING,
    "events": Mode.RENAMING,
}


def event_counts(state: HybridState) -> tuple[int, ...]:
    """How many KV events each group has emitted so far."""
    return tuple(len(g.events or ()) for g in state.groups)


def observe_scheduler(
    driver: SchedulerDriver,
    op: str,
    plan: Any,
    before: dict[int, Status],
    events_before: tuple[int, ...],
    crash: tuple[str, ...] = (),
) -> SchedulerObservation:
    """The renaming-free observation of ``driver``'s scheduler after operation ``op`` (``plan``:
    what a step planned; ``before``: the requests' statuses before the operation)."""
    state = driver.state
    names: dict[int, int] = {}

    def name(block: int) -> int:
        return names.setdefault(block, len(names))

    groups = state.groups
    scheduled = plan.scheduled if plan is not None else ()
    return SchedulerObservation(
        outcome=f"{op}: crashed" if crash else op,
        crash=crash,
        hits=tuple(sorted((s.seq_id, s.start) for s in scheduled if before.get(s.seq_id) is not Status.RUNNING)),
        scheduled=tuple(sorted((s.seq_id, s.start, s.num_tokens, s.drafts) for s in scheduled)),
        preempted=tuple(plan.preempted) if plan is not None else (),
        finished=tuple(sorted(set(before) - set(driver.seqs))) if op == "step" else (),
        held=tuple((g.spec.name, seq, len(g.tables[seq].held())) for g in groups for seq in sorted(g.tables)),
        free=len(state.pool.free),
        evictable=len(state.pool.evictable),
        cached=tuple(len(g.cached) for g in groups),
        tables=tuple(
            (g.spec.name, seq, tuple(None if b is None else name(b) for b in g.tables[seq].slots))
            for g in groups
            for seq in sorted(g.tables)
        ),
        cached_keys=tuple(tuple(sorted(_key(k) for k, _ in g.cached)) for g in groups),
        events=tuple(
            (g.spec.name, e.describe() + ":" + ";".join(_key(k) for k in e.keys))
            for g, seen in zip(groups, events_before, strict=False)
            for e in (g.events or ())[seen:]
        ),
    )


# ------------------------------------------------------------------------------ the child


class SchedulerSession:
    """One child's scheduler: the example's target and driver, under the child's guard."""

    def __init__(self, guard: Guard, impl: str) -> None:
        self.guard = guard
        self.factory = scheduler_factory(impl)
        self.driver: SchedulerDriver | None = None
        self.focus: frozenset[str] | None = None
        self.events_seen: tuple[int, ...] = ()

    def build(self, shape: Shape, focus: tuple[str, ...] | None) -> dict[str, Any]:
        self.driver = None
        self.focus = frozenset(focus) if focus is not None else None
        factory = self.guard.wrap(self.factory)  # type: ignore[arg-type]
        try:
            with self.guard.armed():
                target = factory(shape)  # type: ignore[arg-type]
                driver = SchedulerDriver.for_shape(target, shape)
        except (ConfigError, Unsupported) as error:
            return {"unsupported": str(error)}
        except GuardTripped as trip:
            return {"crash": (type(trip).__name__, "guard", "construct"), "tripped": True}
        except Exception as error:
            return {"crash": crash_function(error)}
        self.driver = driver
        self.events_seen = event_counts(driver.state)
        return {"extra_kinds": frozenset(getattr(target, "extra_kinds", frozenset())),
                "name": str(getattr(target, "name", SCHEDULER_IMPL))}

    def op(self, name: str, args: tuple[Any, ...]) -> Reply:
        d = self.driver
        assert d is not None, "op before build"
        before = {s: m.status for s, m in d.seqs.items()}
        plan, crash = self._guarded(lambda: getattr(d, name)(*args))
        return self._reply(name, plan if name == "step" else None, before, crash, [] if crash else d.check())

    def finish(self, progress: bool) -> Reply:
        """The machine's teardown: the scheduler steps with no new arrivals until every request
        finished (``progress``), then every request is aborted (``no-leak``)."""
        d = self.driver
        assert d is not None, "finish before build"
        found: list[Violation] = []

        def run() -> None:
            if progress:
                found.extend(drain(d, d.check))
            if not found:
                found.extend(d.finish())

        _, crash = self._guarded(run)
        return self._reply(TEARDOWN, None, {}, crash, found)

    def _guarded(self, call: Callable[[], Any]) -> tuple[Any, tuple[str, ...]]:
        try:
            with self.guard.armed():
                return call(), ()
        except GuardTripped as trip:
            return None, (type(trip).__name__, "guard", trip.op)
        except Exception as error:  # the target crashed (the driver recorded the step)
            return None, crash_function(error)

    def _reply(
        self, op: str, plan: Any, before: dict[int, Status], crash: tuple[str, ...], found: list[Violation]
    ) -> Reply:
        d = self.driver
        assert d is not None
        observation = observe_scheduler(d, op, plan, before, self.events_seen, crash)
        self.events_seen = event_counts(d.state)
        if self.focus is not None:
            found = [v for v in found if v.invariant in self.focus]
        if crash:
            found = [*found, crash_violation(crash)]
        return Reply(
            result=None,
            observation=observation,
            violations=tuple(found),
            step=d.trace[-1] if d.trace else None,
            seqs=dict(d.seqs),
            operations=d.operations,
            tripped=self.guard.tripped is not None,
        )


class SchedulerChild(_Session):
    """A target process of the scheduler lockstep: the block manager's session (its guard,
    ``hello``, ``golden``) and a ``scheduler`` session beside it."""

    def __init__(self, limits: Limits) -> None:
        super().__init__(limits)
        self.scheduler_session: SchedulerSession | None = None  # built on the first call

    def hello(self, impl: str) -> dict[str, Any]:
        if impl not in KVSPEC_SCHEDULERS:
            return super().hello(impl)
        self.impl = impl  # a kvspec scheduler: nothing of vLLM's to import
        return {"python": sys.executable, "vllm": None, "pid": os.getpid(), "version": None}

    def scheduler(self, method: str, *args: Any) -> Any:
        """A call on the child's scheduler session, under the child's guard."""
        if self.scheduler_session is None:
            self.scheduler_session = SchedulerSession(self.guard, self.impl)
        return getattr(self.scheduler_session, method)(*args)


def serve() -> None:
    """A scheduler lockstep's target process (``SchedulerLockstepMachine.child``)."""
    serve_requests(SchedulerChild)


# ------------------------------------------------------------------------------ the parent's side


@attrs.frozen
class Kinds:
    """What the machine reads off the driver's target: the domain kinds both sides key by."""

    extra_kinds: frozenset[str]


class SchedulerLockstepDriver(LockstepDriver):
    """Looks like a ``SchedulerDriver`` to the scheduler machine; every operation goes to both
    sides' scheduler sessions."""

    observation = SchedulerObservation

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.target = Kinds(self._extra_kinds)

    def _ask(self, method: str, *args: Any) -> list[Any]:
        return both(self.remotes, "scheduler", method, *args)

    def arrive(self, seq_id: int, tokens: Iterable[int], max_tokens: int, extra: ExtraKeys = NO_EXTRA) -> Any:
        return self._both("arrive", seq_id, tuple(tokens), max_tokens, extra)

    def step(self, accept: bytes, tokens: bytes) -> Any:
        return self._both("step", accept, tokens)

    def abort(self, seq_id: int) -> Any:
        return self._both("abort", seq_id)


class SchedulerLockstepMachine(SchedulerMachine):
    """The scheduler machine's rules, each operation run on HEAD and BASE and compared."""

    child = "kvspec.testing.scheduler.lockstep"  # what its target processes run (``serve``)

    def __init__(
        self,
        remotes: tuple[Remote, Remote],
        shape_strategy: st.SearchStrategy[Shape] | None = None,
        *,
        mode: Mode = Mode.RENAMING,
        skip: frozenset[tuple[str, str, str]] = frozenset(),
        stats: LockstepStats,
        focus: Iterable[str] | None = None,
        features: Any = None,  # the block manager's feature pins: no scheduler shape reads them
        log: Callable[[str], None] = note,
    ) -> None:
        super().__init__(lambda _shape: None, shape_strategy, focus=frozenset(focus) if focus is not None else None)  # type: ignore[arg-type,return-value]
        self.remotes = remotes
        self.mode = mode
        self.skip = skip
        self.lockstep_stats = stats
        self.log = log
        self.both: SchedulerLockstepDriver | None = None

    @initialize(data=st.data())
    def build(self, data):
        shape = data.draw(self.shape_strategy, label="shape")
        note(f"shape: {shape!r}")
        focus = tuple(self.focus) if self.focus is not None else None
        answers = both(self.remotes, "scheduler", "build", shape, focus)
        head, base = settle_build(self.remotes, answers, shape, self.lockstep_stats, SchedulerObservation)
        self.shape = shape
        self.both = SchedulerLockstepDriver(
            self.remotes, shape, frozenset(), head["extra_kinds"] & base["extra_kinds"], self.mode, self.skip,
            self.lockstep_stats, self.log,
        )
        self.driver = self.both  # type: ignore[assignment]  # the rules' preconditions read it

    def _checks(self) -> list[Violation]:
        return []  # every operation is compared and judged as it happens

    def teardown(self):
        if self.both is None or self.failed or sys.exc_info()[1] is not None:
            return
        self.both.finish(self.focus is None or "progress" in self.focus)
        self.lockstep_stats.examples += 1  # compared to its end


def shape_strategy() -> st.SearchStrategy[Shape]:
    """Every production shape the scheduler machine draws (testing/scheduler/machine.py)."""
    return shapes()


__all__ = [
    "SchedulerLockstepMachine",
    "SchedulerObservation",
    "SchedulerSession",
    "observe_scheduler",
    "serve",
    "shape_strategy",
]
