"""``--time-budget``: parts stop starting examples at their deadline, never cut a part's first
example or a failure's shrinking, and report what each part got.  Driven on the reference (no
vLLM); the only bound on time is a generous one (speed figures live in BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvspec.cli.budget import MIN_ROUND_SECONDS, UNBOUNDED_EXAMPLES, BudgetSpent, Part, TimeBudget
from kvspec.cli.main import main
from kvspec.cli.run import config_strategy, run_machine
from kvspec.cli.search import TIME_SPENT, run_search
from kvspec.testing.implementations import factory

# A budget run may pass its budget by one example per part and by shrinking; on a loaded
# two-core machine that is seconds, not minutes.
GENEROUS_OVERSHOOT_S = 120.0


def _past_deadline(name: str = "p") -> Part:
    now = time.monotonic()
    return Part(name, 0.0, now - 1.0, started=now)


def test_a_part_past_its_deadline_starts_its_first_example_and_no_other():
    part = _past_deadline()
    part.start_example()  # the first one always runs: a part that ran nothing claims nothing
    with pytest.raises(BudgetSpent):
        part.start_example()
    assert part.examples == 1 and part.cut


def test_a_failure_in_flight_is_never_cut():
    part = _past_deadline()
    part.start_example()
    part.failing = True  # the examples that follow are hypothesis shrinking it
    for _ in range(5):
        part.start_example()
    assert part.examples == 6 and not part.cut


def test_budget_spent_ends_a_hypothesis_run_without_replay():
    """BudgetSpent must end the run at once: any other exception is a failure hypothesis
    replays and shrinks (cli/budget.py docstring)."""
    assert issubclass(BudgetSpent, KeyboardInterrupt) and not issubclass(BudgetSpent, Exception)


def test_a_round_whose_deadline_passed_runs_one_example_and_holds():
    part = _past_deadline("round")
    outcome = run_machine(
        factory("reference"),
        config_strategy("reference", {}),
        profile="ci",
        examples=UNBOUNDED_EXAMPLES,
        steps=5,
        seed=1,
        focus=None,
        label="budget",
        part=part,
    )
    assert outcome.status == "holds", outcome.error  # cut by time: not "incomplete"
    assert outcome.tally.examples == 1 and part.cut


def test_without_the_budget_the_same_shortfall_is_incomplete():
    """The counter-check: a run the deadline did not excuse is still reported incomplete."""
    part = _past_deadline("round")  # never asked to start an example, so it cut nothing
    assert not part.excuses(50) and part.excuses(UNBOUNDED_EXAMPLES)


def test_a_search_spends_its_budget_over_rounds_and_reports_each():
    budget = TimeBudget(3.0)
    search = run_search(
        factory("reference"),
        config_strategy("reference", {}),
        profile="ci",
        examples=None,
        steps=10,
        seed=2,
        focus=None,
        label="reference",
        budget=budget,
    )
    assert search.rounds and len(budget.parts) == len(search.rounds)
    report = budget.to_json()
    assert report["parts"][0]["part"].startswith("round 1")
    for p, o in zip(report["parts"], search.rounds, strict=True):
        assert p["examples_started"] >= max(1, o.tally.examples)
        assert p["allotted_seconds"] >= 0
    assert report["spent"] < budget.seconds + GENEROUS_OVERSHOOT_S
    assert search.last.status == "holds"
    assert search.stopped in (None, TIME_SPENT)


def test_rounds_stop_starting_when_the_search_time_is_spent():
    budget = TimeBudget(MIN_ROUND_SECONDS / 2)  # spent before the second round could start
    search = run_search(
        factory("broken:double-free"),
        config_strategy("broken:double-free", {}),
        profile="ci",
        examples=None,
        steps=10,
        seed=3,
        focus=None,
        label="broken",
        budget=budget,
    )
    assert len(search.rounds) == 1
    if search.found:  # the first round found (and shrank) the bug: the next round was not started
        assert search.stopped == TIME_SPENT


def test_check_cli_prints_what_each_part_got():
    from kvspec.cli import common

    with common.out.capture() as captured:
        code = main(["check", "--impl", "reference", "--time-budget", "2", "--profile", "ci", "--steps", "10"])
    lines = captured.get().splitlines()
    assert code == 0
    assert any(line.startswith("time budget 2 s") for line in lines), lines
    assert any("round 1" in line and "examples started" in line for line in lines), lines


def test_fuzz_reports_what_each_worker_got(tmp_path: Path):
    out = tmp_path / "campaign"
    run = subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "fuzz", "--impl", "reference", "--workers", "1",
         "--time-budget", "3", "--out", str(out)],
        cwd=tmp_path, text=True, capture_output=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["time_budget"] == 3
    assert summary["per_worker"]["0"]["examples"] >= 1
    assert "worker 0:" in run.stdout
