"""Re-running a recorded trace and comparing it with the record: what ``kvspec replay`` reports,
and how a run names the operation a nondeterministic target answered differently.

A re-run ends at the first check that finds a violation (or a policy difference, on the
scheduler machine), at a crash of the target (the driver
records the crashed step), or at a step the driver cannot apply because the target answered an
earlier step differently (the trace diverged); otherwise it frees every sequence and checks.
Given a ``go_past`` policy (testing/known.py ``GoPast``), it goes on past the violations that are
the target's ``go_on`` known findings other than the report's own, as the search that recorded
the trace went on past them (V1-e shows at every state of 0.9.1 and 0.10.1.1), and counts them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError, Unsupported
from kvspec.spec.invariants import Violation
from kvspec.testing.blockmanager.driver import END, Driver, SpecViolation, TraceStep, apply_step
from kvspec.testing.blockmanager.machine import CONTINUE
from kvspec.testing.blockmanager.progress import drain
from kvspec.testing.guard import Crash

if TYPE_CHECKING:
    from kvspec.testing.known import GoPast

RERUNS = 3  # re-runs of a trace that failed once and not again, to name the differing step


@attrs.define
class Rerun:
    trace: list[TraceStep]  # the steps as performed now
    violations: list[Violation] = attrs.Factory(list)
    crash: Crash | None = None  # the target crashed (at step ``len(trace)``; 0: while building)
    error: BaseException | None = None  # the exception of the crash, or of the unapplied step
    unapplied: str | None = None  # a step the driver could not apply: the trace diverged
    # The scheduler machine's target differed from its release's declared policy, every
    # invariant holding (testing/scheduler/machine.py ``PolicyDifference``).
    difference: Exception | None = None
    # The known findings gone past (``go_past``): id -> checks gone past.
    gone_past: dict[str, int] = attrs.Factory(dict)

    @property
    def crash_step(self) -> int | None:
        return None if self.crash is None else len(self.trace)


class Session(Protocol):
    """A machine's driver as a re-run uses it: ``trace`` as performed, ``crash`` once the
    target crashed (the driver records the crashed step)."""

    trace: list[TraceStep]
    crash: Crash | None
    driver: Any  # the machine's driver (what a reproducer's checks read after the re-run)

    def apply(self, step: TraceStep) -> None: ...
    def check(self) -> list[Violation]: ...
    def finish(self) -> list[Violation]: ...


class DriverSession:
    """The block-manager driver (testing/blockmanager/driver.py) as a re-run's session: the trace
    ends as the machine's examples end, with the progress drain (where ``progress`` is watched)
    and then freeing every sequence."""

    def __init__(
        self, impl: Any, focus: Iterable[str] | None, go_past: GoPast | None = None, drains: bool = True
    ) -> None:
        self.driver = Driver(impl, focus=focus)
        self.drains = drains and (focus is None or "progress" in focus)
        # The drain's verdicts are gone past by the re-run's policy, as the machine's step-past
        # policy goes past them before it frees every sequence.
        self.go_past = go_past

    @property
    def trace(self) -> list[TraceStep]:
        return self.driver.trace

    @property
    def crash(self) -> Crash | None:
        return self.driver.crash

    def apply(self, step: TraceStep) -> None:
        apply_step(self.driver, step)

    def check(self) -> list[Violation]:
        return self.driver.check()

    def finish(self) -> list[Violation]:
        if self.drains and self.driver.crash is None:
            found = drain(self.driver)
            if found and not self._gone_past(found):
                return found
        return self.driver.free_all()

    def _gone_past(self, found: list[Violation]) -> bool:
        if self.go_past is None:
            return False
        return self.go_past(SpecViolation(found, list(self.driver.trace)), self.driver) == CONTINUE


SessionFactory = Callable[[Any, Iterable[str] | None], Session]
"""The implementation and the watched invariants -> a session (it observes the target first)."""


def rerun(
    factory: Callable[[Any], Any],
    config: Any,
    trace: Iterable[TraceStep],
    *,
    focus: Iterable[str] | None = None,
    session: SessionFactory = DriverSession,
    go_past: GoPast | None = None,
    run_end: bool = True,
) -> Rerun:
    """Build the implementation and run ``trace`` through a session of its machine's driver
    (the block manager's by default; the scheduler's: testing/scheduler/replay.py), checking
    after every step.  ``go_past``: the policy by which a check's violations are gone past
    (testing/known.py ``GoPast``; a scheduler session applies the same policy to the checks of
    its own end, testing/scheduler/replay.py).  ``run_end``: the recorded operations of the
    example's end (``END``) are not applied; the session's end runs them again (``False``: every
    recorded operation is applied, then the end, as a straight-line file does).  A
    configuration the target refuses (ConfigError, Unsupported) is raised to the caller."""
    gone = dict(go_past.gone) if go_past is not None else {}
    if session is DriverSession:
        session = functools.partial(DriverSession, go_past=go_past, drains=run_end)

    def done(session: Session | None, **kw: Any) -> Rerun:
        passed = {k: n - gone.get(k, 0) for k, n in go_past.gone.items()} if go_past is not None else {}
        steps = list(session.trace) if session is not None else []
        return Rerun(steps, gone_past={k: n for k, n in passed.items() if n}, **kw)

    def judged(found: list[Violation], session: Session) -> list[Violation]:
        if not found or go_past is None:
            return found
        return [] if go_past(SpecViolation(found, list(session.trace)), session.driver) == CONTINUE else found

    try:
        impl = factory(config)
    except (ConfigError, Unsupported, KeyboardInterrupt):
        raise
    except BaseException as error:
        return done(None, crash=Crash.of("construct", error), error=error)
    try:
        driver = session(impl, focus)
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        return done(None, crash=Crash.of("observe", error), error=error)
    for i, step in enumerate(trace, 1):
        if run_end and step.args.get(END):
            break  # the example's end began here: ``finish`` runs it again, and judges it
        try:
            driver.apply(step)
        except KeyboardInterrupt:
            raise
        except BaseException as error:
            return done(driver, **_stopped(driver, error, f"step {i} ({step.op})"))
        found = judged(driver.check(), driver)
        if found or getattr(driver, "difference", None) is not None:
            return done(driver, violations=found, difference=getattr(driver, "difference", None))
    try:
        found = judged(driver.finish(), driver)
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        return done(driver, **_stopped(driver, error, "finishing every request at the end"))
    return done(driver, violations=found, difference=getattr(driver, "difference", None))


def _stopped(driver: Session, error: BaseException, where: str) -> dict[str, Any]:
    """What a re-run that stopped at ``error`` records: a crash, else a step not applied."""
    if driver.crash is not None:
        return {"crash": driver.crash, "error": error}
    detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return {"error": error, "unapplied": f"{where} cannot be applied here: {type(error).__name__}: {detail}"}


@attrs.frozen
class Difference:
    """The first step a re-run performed differently from the record."""

    step: int
    operation: str
    recorded: str
    now: str

    def describe(self) -> str:
        return f"step {self.step} ({self.operation}) answered {self.recorded!r} when recorded, {self.now!r} now"

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def first_difference(recorded: Sequence[TraceStep], now: Sequence[TraceStep]) -> Difference | None:
    for i, (was, got) in enumerate(zip(recorded, now, strict=False), 1):
        if (was.op, was.args, was.outcome) != (got.op, got.args, got.outcome):
            return Difference(i, was.op, was.outcome, got.outcome)
    return None


def name_nondeterminism(
    factory: Callable[[Config], Any],
    config: Config,
    recorded: Sequence[TraceStep],
    recorded_violations: Sequence[Violation],
    *,
    focus: Iterable[str] | None = None,
    tries: int = RERUNS,
    go_past: GoPast | None = None,
) -> Difference | None:
    """Re-run a trace that failed once and not again; the first step answered differently from
    the record, or the last step when only the verdict after it changed.  None when ``tries``
    re-runs behave exactly as recorded.  ``go_past``: what the re-runs go past (``rerun``)."""
    recorded = list(recorded)
    for _ in range(tries):
        try:
            again = rerun(factory, config, recorded, focus=focus, go_past=go_past)
        except (ConfigError, Unsupported):
            return None
        difference = first_difference(recorded, again.trace)
        if difference is not None:
            return difference
        if again.crash is None and len(again.trace) < len(recorded):
            nxt = recorded[len(again.trace)]
            return Difference(len(again.trace) + 1, nxt.op, nxt.outcome, "not reached")
        if recorded and recorded_violations and not again.violations and again.crash is None:
            last = recorded[-1]
            found = ", ".join(sorted({v.invariant for v in recorded_violations}))
            return Difference(
                len(recorded), last.op, f"{last.outcome}, then {found} violated", f"{last.outcome}, no violation"
            )
    return None


__all__ = ["RERUNS", "Difference", "Rerun", "first_difference", "name_nondeterminism", "rerun"]
