"""When a lockstep PR run is a verdict (cli/pr.py ``run_compare``): a run that compared no
example to its end is one only if it found something -- every example ending in a shrunk
difference still answers the PR, while nothing compared and nothing found is no verdict
(exit 2, ``UsageError``).  Runs the scheduler lockstep on kvspec's own schedulers (two child
processes of this interpreter); no vLLM."""

from __future__ import annotations

import argparse
import json
import sys

import attrs
import pytest
from kvspec.cli import pr
from kvspec.cli.common import UsageError
from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS
from kvspec.testing.implementations import BROKEN_SCHEDULER_PREFIX
from kvspec.testing.lockstep import Kind, LockstepStats, Side, run_lockstep
from kvspec.testing.scheduler.lockstep import SchedulerLockstepMachine
from kvspec.testing.scheduler.machine import shapes

BROKEN = BROKEN_SCHEDULER_PREFIX + "unreserved-placeholders"
BUDGET = dict(profile="ci", examples=12, max_verdicts=1, machine=SchedulerLockstepMachine, golden=False)


def _side(label: str, impl: str) -> Side:
    return Side(label, impl, sys.executable, impl)


def _args() -> argparse.Namespace:
    return argparse.Namespace(config=None, compare="renaming", no_verify=True)


@pytest.fixture(scope="module")
def regression_run():
    assert BROKEN.removeprefix(BROKEN_SCHEDULER_PREFIX) in BROKEN_SCHEDULERS
    asynchronous = shapes().filter(lambda s: s.async_scheduling and s.extra_blocks > 0)
    return run_lockstep(_side("HEAD", BROKEN), _side("BASE", "reference-scheduler"), asynchronous, **BUDGET)


def test_every_example_ending_in_a_difference_is_still_a_verdict(monkeypatch, tmp_path, regression_run):
    (verdict,) = regression_run.verdicts
    assert verdict.kind is Kind.REGRESSION
    # As when every drawn example ends at a difference: none was compared to its end.
    ended = attrs.evolve(regression_run, stats=LockstepStats())
    monkeypatch.setattr(pr, "lockstep", lambda *a, **k: ended)
    run = pr.run_compare(_args(), ended.head, ended.base, tmp_path)
    assert run is ended
    summary = json.loads((tmp_path / "pr.json").read_text())
    assert summary["examples"] == 0 and summary["regressions"] == 1, summary


def test_nothing_compared_and_nothing_found_is_no_verdict(monkeypatch, tmp_path, regression_run):
    empty = attrs.evolve(regression_run, verdicts=[], stats=LockstepStats())
    monkeypatch.setattr(pr, "lockstep", lambda *a, **k: empty)
    with pytest.raises(UsageError, match="compared 0 example"):
        pr.run_compare(_args(), empty.head, empty.base, tmp_path)


def test_first_verdict_skips_the_halves_after_a_verdict_only_when_asked(regression_run):
    asked, plain = argparse.Namespace(first_verdict=True), argparse.Namespace()
    assert pr.answered(asked, [regression_run])
    assert not pr.answered(plain, [regression_run])
    assert not pr.answered(asked, [attrs.evolve(regression_run, verdicts=[])])
