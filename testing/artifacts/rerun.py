"""Re-running a recorded trace and comparing it with the record: what ``kvspec replay`` reports,
and how a run names the operation a nondeterministic target answered differently.

A re-run ends at the first check that finds a violation (or a policy difference, on the
scheduler machine), at a crash of the target (the driver
records the crashed step), or at a step the driver cannot apply because the target answered an
earlier step differently (the trace diverged); otherwise it frees every sequence and checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import attrs
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError, Unsupported
from kvspec.spec.invariants import Violation
from kvspec.testing.blockmanager.driver import Driver, TraceStep, apply_step
from kvspec.testing.guard import Crash

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
    """The block-manager driver (testing/blockmanager/driver.py) as a re-run's session: the trace ends by
    freeing every sequence."""

    def __init__(self, impl: Any, focus: Iterable[str] | None) -> None:
        self.driver = Driver(impl, focus=focus)

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
        return self.driver.free_all()


SessionFactory = Callable[[Any, Iterable[str] | None], Session]
"""The implementation and the watched invariants -> a session (it observes the target first)."""


def rerun(
    factory: Callable[[Any], Any],
    config: Any,
    trace: Iterable[TraceStep],
    *,
    focus: Iterable[str] | None = None,
    session: SessionFactory = DriverSession,
) -> Rerun:
    """Build the implementation and run ``trace`` through a session of its machine's driver
    (the block manager's by default; the scheduler's: testing/scheduler/replay.py), checking
    after every step.  A configuration the target refuses (ConfigError, Unsupported) is raised
    to the caller."""
    try:
        impl = factory(config)
    except (ConfigError, Unsupported, KeyboardInterrupt):
        raise
    except BaseException as error:
        return Rerun([], crash=Crash.of("construct", error), error=error)
    try:
        driver = session(impl, focus)
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        return Rerun([], crash=Crash.of("observe", error), error=error)
    for i, step in enumerate(trace, 1):
        try:
            driver.apply(step)
        except KeyboardInterrupt:
            raise
        except BaseException as error:
            return _stopped(driver, error, f"step {i} ({step.op})")
        found = driver.check()
        if found or getattr(driver, "difference", None) is not None:
            return Rerun(list(driver.trace), found, difference=getattr(driver, "difference", None))
    try:
        found = driver.finish()
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        return _stopped(driver, error, "finishing every request at the end")
    return Rerun(list(driver.trace), found, difference=getattr(driver, "difference", None))


def _stopped(driver: Session, error: BaseException, where: str) -> Rerun:
    if driver.crash is not None:
        return Rerun(list(driver.trace), crash=driver.crash, error=error)
    detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return Rerun(
        list(driver.trace),
        error=error,
        unapplied=f"{where} cannot be applied here: {type(error).__name__}: {detail}",
    )


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
) -> Difference | None:
    """Re-run a trace that failed once and not again; the first step answered differently from
    the record, or the last step when only the verdict after it changed.  None when ``tries``
    re-runs behave exactly as recorded."""
    recorded = list(recorded)
    for _ in range(tries):
        try:
            again = rerun(factory, config, recorded, focus=focus)
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
