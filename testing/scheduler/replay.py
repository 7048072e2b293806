"""Re-running a scheduler machine's trace (the report of a scheduler verdict of ``kvspec
check``) against a scheduler target: ``kvspec replay`` through testing/artifacts/rerun.py's loop.

The session is the scheduler machine itself (testing/scheduler/machine.py), started in the
recorded shape instead of a drawn one: the same driver, the same checks after every operation
(with the reference scheduler in lockstep when the report's run compared against it), and the
same end (the ``progress`` drain, then aborting every request and ``no-leak``).  The machine
notes what it does through hypothesis (``note``), which needs a test's context: ``in_context``
runs the re-run as a single hypothesis example.  A ``go_past`` policy (testing/known.py
``GoPast``) is the machine's step-past policy: the checks of its end (the drain's, the last
aborts') go on past the target's ``go_on`` known findings as the checks after each operation do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kvspec.spec.groups import Shape
from kvspec.spec.invariants import Violation
from kvspec.spec.prefix_hash import ExtraKeys
from kvspec.testing.artifacts.rerun import SessionFactory
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.blockmanager.driver import SpecViolation, TraceStep
from kvspec.testing.blockmanager.machine import StepPast
from kvspec.testing.guard import Crash
from kvspec.testing.scheduler.driver import SchedulerDriver
from kvspec.testing.scheduler.machine import PolicyDifference, SchedulerMachine

OPS = ("arrive", "abort", "step", "drain")
T = TypeVar("T")


def apply_scheduler_step(driver: SchedulerDriver, step: TraceStep) -> None:
    """Perform one recorded operation of the scheduler driver (what the scheduler plans is
    recomputed, not trusted)."""
    a = step.args
    if step.op == "arrive":
        driver.arrive(a["seq"], a["tokens"], a["max_tokens"], ExtraKeys.from_json(a.get("extra")))
    elif step.op == "abort":
        driver.abort(a["seq"])
    elif step.op == "step":
        driver.step(bytes.fromhex(a["accept"]), bytes.fromhex(a["tokens"]))
    elif step.op == "drain":
        driver.drain()
    else:
        raise ValueError(f"unknown operation in a scheduler trace: {step.op!r} (one of {', '.join(OPS)})")


class SchedulerSession:
    """The scheduler machine on one target in a recorded shape, as a re-run's session."""

    def __init__(
        self,
        impl: Any,
        shape: Shape,
        mode: Mode | None,
        focus: Iterable[str] | None,
        go_past: StepPast | None = None,
    ) -> None:
        self.difference: PolicyDifference | None = None  # once the target differs from its policy
        self.machine = SchedulerMachine(
            lambda _shape: impl, focus=frozenset(focus) if focus else None, differential=mode, step_past=go_past
        )
        self.machine.start(shape)

    @property
    def driver(self) -> Any:
        return self.machine.d

    @property
    def trace(self) -> list[TraceStep]:
        return self.machine.d.trace

    @property
    def crash(self) -> Crash | None:
        return self.machine.d.crash

    def apply(self, step: TraceStep) -> None:
        apply_scheduler_step(self.machine.d, step)

    def check(self) -> list[Violation]:
        return self._verdict(self.machine.invariants_hold)

    def finish(self) -> list[Violation]:
        return self._verdict(self.machine.teardown)

    def _verdict(self, check: Callable[[], None]) -> list[Violation]:
        """The violations ``check`` raised; a policy difference it raised is kept in
        ``difference`` (the re-run ends there, as the machine's example did)."""
        try:
            check()
        except SpecViolation as found:
            return list(found.violations)
        except PolicyDifference as found:
            self.difference = found
        return []


def scheduler_session(shape: Shape, mode: Mode | None, go_past: StepPast | None = None) -> SessionFactory:
    """A session factory for testing/artifacts/rerun.py ``rerun``: the scheduler machine in ``shape``,
    comparing against the reference scheduler in ``mode`` (None: no differential), going past
    what ``go_past`` goes past (pass the same policy to ``rerun``)."""

    def start(impl: Any, focus: Iterable[str] | None) -> SchedulerSession:
        return SchedulerSession(impl, shape, mode, focus, go_past)

    return start


def in_context(run: Callable[[], T]) -> T:
    """``run()`` as the one example of a hypothesis test (the machine's notes need one)."""
    result: list[T] = []

    @settings(
        max_examples=1,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.just(None))
    def once(_nothing: None) -> None:
        if not result:
            result.append(run())

    once()
    return result[0]


__all__ = ["SchedulerSession", "apply_scheduler_step", "in_context", "scheduler_session"]
