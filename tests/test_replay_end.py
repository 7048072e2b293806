"""A verdict the example's end judges (``progress``, in the block-manager machine's drain) replays:
the drain's operations are recorded as the end's (``END``), and a re-run applies the recorded
operations up to the first of them, then runs the end itself.  Before, the drain's steps were
applied as ordinary operations and the re-run's end met a finished loop, so a ``progress``
verdict never recurred (and could not be bisected).  The scheduler machine's case is in
tests/test_scheduler_reports.py.  On a deliberately broken reference manager; no vLLM needed."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.broken import Livelock
from kvspec.reference.manager import ReferenceManager
from kvspec.testing import KVCacheMachine
from kvspec.testing.artifacts.rerun import rerun
from kvspec.testing.blockmanager.driver import END, SpecViolation

WATCHED = frozenset({"progress"})


def _found() -> tuple[object, SpecViolation]:
    configs = []

    class Machine(KVCacheMachine):
        def __init__(self) -> None:
            super().__init__(Livelock, focus=WATCHED)

        def teardown(self) -> None:
            if self.driver is not None:
                configs.append(self.driver.config)
            super().teardown()

    try:
        run_state_machine_as_test(
            Machine, settings=settings(max_examples=300, derandomize=True, database=None, stateful_step_count=20)
        )
    except SpecViolation as found:
        return configs[-1], found
    raise AssertionError("the livelock was not found")


def test_a_progress_verdict_of_the_drain_replays():
    config, found = _found()
    assert [v.invariant for v in found.violations] == ["progress"]
    ends = [bool(s.args.get(END)) for s in found.trace]
    assert any(ends) and ends == sorted(ends), found.trace  # the end's operations, last
    again = rerun(Livelock, config, found.trace, focus=WATCHED)
    assert [v.invariant for v in again.violations] == ["progress"], again
    assert [s.op for s in again.trace] == [s.op for s in found.trace]  # the same end, re-run
    # The reference manager runs the same operations to their end.
    clean = rerun(ReferenceManager, config, found.trace, focus=WATCHED)
    assert clean.violations == [] and clean.unapplied is None, clean
