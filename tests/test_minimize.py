"""kvspec's trace minimizer (testing/artifacts/minimize.py) on the reference's seed bug
(``broken:window-capped-admission``, F1's stand-in): a counterexample padded the way
hypothesis leaves one (filler sequences on a large pool, then the admission that shows the
bug) is cut to the admission alone on the smallest pool that keeps it, what it returns is what
a re-run of the target really does, and a ``keeps`` that refuses the finding leaves the
counterexample as it was.  No vLLM needed."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from kvspec.cli.check import minimize_verdicts
from kvspec.cli.main import main
from kvspec.cli.search import run_index
from kvspec.cli.shapes import run_scheduler_search
from kvspec.reference.broken import WindowCappedAdmission
from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS
from kvspec.reference.manager import ReferenceManager
from kvspec.spec.config import Config
from kvspec.spec.window import blocks_for_tokens, window_cover
from kvspec.testing import Driver
from kvspec.testing.artifacts.minimize import minimize
from kvspec.testing.artifacts.rerun import Rerun, rerun
from kvspec.testing.blockmanager.driver import END, TraceStep
from kvspec.testing.guard import Guard, Limits, TargetHung
from kvspec.testing.known import Fingerprint
from kvspec.testing.scheduler.replay import in_context, scheduler_session

# W=1 on 1-token blocks: the capped admission counts the window's cover (one block), allocation
# takes a block per prompt token, so a two-token prompt is admitted, then fails, when exactly one
# block is free -- no slack, as F1 on vLLM's V2 (cover 3, prompt 4): a filler deleted alone frees
# its block and the admission succeeds; only the filler with its block deleted keeps the bug.
BLOCK_SIZE = 1
WINDOW = 1
FILLERS = 5
PROMPT = [0, 0]


def _padded_trace() -> tuple[Config, list[TraceStep]]:
    """Fillers admitted and stepped on a pool sized so that the free blocks are then what the
    capped admission counts for ``PROMPT``: the admission that follows shows the seed bug."""
    capped = min(blocks_for_tokens(len(PROMPT), BLOCK_SIZE), window_cover(WINDOW, BLOCK_SIZE))
    assert capped < blocks_for_tokens(len(PROMPT), BLOCK_SIZE)
    probe = Driver(WindowCappedAdmission(Config(block_size=BLOCK_SIZE, num_blocks=64, sliding_window=WINDOW)))
    probe.admit(0, [0], 1)
    probe.step(0, 1)
    held = 64 - probe.impl.gpu.available()  # what one filler holds once stepped (the window's cover)
    config = Config(block_size=BLOCK_SIZE, num_blocks=capped + FILLERS * held, sliding_window=WINDOW)
    driver = Driver(WindowCappedAdmission(config))
    for seq in range(FILLERS):
        driver.admit(seq, [0], 1)
    for seq in range(FILLERS):
        driver.step(seq, 1)
    assert driver.impl.gpu.available() == capped
    return config, [step for step in driver.trace if not step.args.get(END)]


def _with_final_admission(config: Config, trace: list[TraceStep]) -> list[TraceStep]:
    return [
        *trace,
        TraceStep("admit", {"seq": FILLERS, "tokens": PROMPT, "num_new_tokens": len(PROMPT), "next_token": 0}),
    ]


def _shows_seed_bug(config: Config, result: Rerun) -> bool:
    return any(v.invariant == "admission-soundness" for v in result.violations)


def test_the_padded_trace_shows_the_seed_bug():
    config, trace = _padded_trace()
    result = rerun(WindowCappedAdmission, config, _with_final_admission(config, trace))
    assert _shows_seed_bug(config, result), [str(v) for v in result.violations]
    assert len(result.trace) > FILLERS * 2


def test_the_padded_seed_bug_is_cut_to_its_admission_on_the_smallest_pool():
    config, trace = _padded_trace()
    full = _with_final_admission(config, trace)
    cut = minimize(WindowCappedAdmission, config, full, _shows_seed_bug)
    assert cut is not None
    assert [s.op for s in cut.trace if not s.args.get(END)] == ["admit"], [s.describe() for s in cut.trace]
    assert cut.config.num_blocks < config.num_blocks
    assert cut.config == attrs.evolve(config, num_blocks=cut.config.num_blocks)
    assert f"{len(full)} operation(s) to 1, num_blocks {config.num_blocks} ->" in cut.describe(full, config)
    # What it returns is what the target does: the cut trace re-runs to the same finding.
    again = rerun(WindowCappedAdmission, cut.config, [s for s in cut.trace if not s.args.get(END)])
    assert _shows_seed_bug(cut.config, again)
    assert [str(v) for v in again.violations] == [str(v) for v in cut.violations]


def test_a_keeps_that_refuses_the_finding_cuts_nothing():
    config, trace = _padded_trace()
    full = _with_final_admission(config, trace)
    assert minimize(WindowCappedAdmission, config, full, lambda c, r: False) is None


def test_a_keeps_tied_to_the_pool_size_keeps_that_pool():
    """``keeps`` is the only judge: a finding defined on this pool size is not moved off it."""
    config, trace = _padded_trace()
    full = _with_final_admission(config, trace)
    cut = minimize(
        WindowCappedAdmission, config, full, lambda c, r: _shows_seed_bug(c, r) and c.num_blocks == config.num_blocks
    )
    assert cut is not None and cut.config.num_blocks == config.num_blocks
    assert cut.trace[-1].op == "admit" and cut.trace[-1].args["seq"] == FILLERS


def test_a_correct_manager_keeps_nothing():
    """On the reference the same trace shows no violation: the minimizer claims nothing."""
    config, trace = _padded_trace()
    assert minimize(ReferenceManager, config, _with_final_admission(config, trace), _shows_seed_bug) is None


def test_the_budget_of_reruns_is_kept():
    config, trace = _padded_trace()
    full = _with_final_admission(config, trace)
    cut = minimize(WindowCappedAdmission, config, full, _shows_seed_bug, max_reruns=3)
    assert cut is None or cut.reruns <= 3


def _reports(out: Path) -> dict[str, dict]:
    return {
        json.dumps(e["fingerprint"], sort_keys=True): json.loads(Path(e["report"]).read_text()) for e in run_index(out)
    }


def test_check_reports_the_cut_trace_and_it_replays(tmp_path, capsys):
    """``kvspec check`` reports each violation as cut (saying by how much) and its report
    replays; ``--no-minimize`` reports hypothesis' shrunk trace.  Seed 3 of ``leak-on-free``
    leaves a 15-operation trace the minimizer cuts."""
    args = ["check", "--impl", "broken:leak-on-free", "--profile", "ci", "--seed", "3", "--examples", "50"]
    assert main([*args, "--out", str(tmp_path / "cut")]) == 1
    assert "kvspec's trace minimizer cut hypothesis'" in capsys.readouterr().out
    assert main([*args, "--no-minimize", "--out", str(tmp_path / "shrunk")]) == 1
    assert "minimizer" not in capsys.readouterr().out
    cut, shrunk = _reports(tmp_path / "cut"), _reports(tmp_path / "shrunk")
    assert cut.keys() == shrunk.keys()
    assert all(r["run"]["minimized"] is None for r in shrunk.values())
    shorter = [fp for fp in cut if len(cut[fp]["trace"]) < len(shrunk[fp]["trace"])]
    assert shorter, {fp: (len(cut[fp]["trace"]), len(shrunk[fp]["trace"])) for fp in cut}
    for fp in cut:
        assert len(cut[fp]["trace"]) <= len(shrunk[fp]["trace"])
    for fp in shorter:
        assert "cut hypothesis'" in cut[fp]["run"]["minimized"]
    (path,) = [
        e["report"] for e in run_index(tmp_path / "cut") if json.dumps(e["fingerprint"], sort_keys=True) == shorter[0]
    ]
    assert main(["replay", path]) == 1
    assert "the recorded violation reproduces" in capsys.readouterr().out


class HangsOnSmallerPools(WindowCappedAdmission):
    """The seed bug, and a hang in every admission on a pool smaller than the padded one's: the
    minimizer's first lowered candidate hangs."""

    def can_admit(self, seq_id, tokens, num_new_tokens, extra=()):
        if self.config.num_blocks < PADDED_BLOCKS:
            while True:
                pass
        return super().can_admit(seq_id, tokens, num_new_tokens, extra)


PADDED_BLOCKS = 6  # _padded_trace's pool: one block for the cover and one per filler


def test_a_candidate_that_hangs_stops_the_minimizer_not_the_run():
    """A candidate re-run that hangs the target is the minimizer's, not the run's: the guard
    collects it, is restored, and what was cut before it stands and replays."""
    config, trace = _padded_trace()
    assert config.num_blocks == PADDED_BLOCKS
    guard = Guard(Limits(op_timeout=0.3, memory_cap_gib=None))
    factory = guard.wrap(HangsOnSmallerPools)
    with guard.armed():
        with guard.contained() as trips:
            cut = minimize(factory, config, _with_final_admission(config, trace), _shows_seed_bug)
        assert [type(t) for t in trips] == [TargetHung]
        assert guard.tripped is None and guard.failure is None
        assert guard.call("after", None, lambda: 7) == 7  # the run goes on
    assert cut is not None and cut.config.num_blocks == PADDED_BLOCKS
    assert _shows_seed_bug(cut.config, rerun(HangsOnSmallerPools, cut.config, cut.trace))


def test_a_trip_outside_contained_abandons_the_target():
    guard = Guard(Limits(op_timeout=0.3, memory_cap_gib=None))
    with guard.armed():
        with pytest.raises(TargetHung):
            guard.call("spin", None, lambda: [None for _ in iter(int, 1)])
        with pytest.raises(TargetHung):
            guard.call("after", None, lambda: 7)


def test_a_scheduler_verdict_is_cut_in_its_shape_and_replays():
    """The scheduler machine's invariant verdicts are cut the same way, in their shape (its
    blocks over the startup minimum, never its features), and a policy difference is left as
    shrunk.  ``short-budget-chunk`` at seed 4 leaves a 6-operation admission-soundness verdict (and a
    policy difference)."""
    run = run_scheduler_search(
        BROKEN_SCHEDULERS["short-budget-chunk"].cls, profile="ci", examples=100, steps=None, seed=4, focus=None
    )
    before = {f.fingerprint: (f.outcome.trace, f.outcome.shape) for f in run.search.found}
    minimize_verdicts(run, [], None, Guard(Limits(op_timeout=None, memory_cap_gib=None)), None)
    after = {f.fingerprint: f.outcome for f in run.search.found}
    assert after.keys() == before.keys()
    for fp, o in after.items():
        trace, shape = before[fp]
        if o.status == "differs":
            assert o.trace == trace and o.minimized is None
            continue
        assert len(o.trace) <= len(trace)
        assert {f: v for f, v in attrs.asdict(o.shape).items() if f != "extra_blocks"} == {
            f: v for f, v in attrs.asdict(shape).items() if f != "extra_blocks"
        }
    cut = after[Fingerprint("admission-soundness", "step")]
    assert len(cut.trace) < len(before[Fingerprint("admission-soundness", "step")][0])
    assert "cut hypothesis'" in cut.minimized
    again = in_context(
        lambda: rerun(
            BROKEN_SCHEDULERS["short-budget-chunk"].cls,
            cut.shape,
            cut.trace,
            session=scheduler_session(cut.shape, None),
        )
    )
    assert {v.invariant for v in again.violations} >= {"admission-soundness"}


def test_pr_mode_replays_heads_verdicts_on_base_as_heads_search_shrank_them(monkeypatch, tmp_path):
    """PR mode replays each of HEAD's scheduler verdicts on BASE: HEAD's own check runs without
    the minimizer, whose cut would be made against HEAD alone."""
    import argparse
    import subprocess

    import kvspec.cli.pr as pr

    calls: list[list[str]] = []

    def fake(args: list[str], *, capture: bool = False) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(pr, "_kvspec", fake)
    args = argparse.Namespace(vllm="0.33.0", vllm_source=None, source_version=None, venv=None, seed=None)
    argv = ["check", "--vllm", "0.33.0", "--baseline", "0.30.0"]
    assert pr.scheduler_verdicts(args, argv, ["--vllm", "0.30.0"], tmp_path) == []
    (head,) = calls
    assert head.count("--no-minimize") == 1


# ------------------------------------------------------------------ a target's crash


class CrashesOnItsLastFreeBlocks(ReferenceManager):
    """Crashes (as vLLM's legacy pools do on a corrupted free list) when an admission would take
    every free block: only a pool filled to exactly that point shows it, as F1's admission."""

    name = "crashes-on-its-last-free-blocks"

    def admit(self, seq_id, tokens, num_new_tokens, extra=()):
        if blocks_for_tokens(num_new_tokens, self.config.block_size) == len(self.gpu.free):
            raise IndexError("took the pool's last free block")
        return super().admit(seq_id, tokens, num_new_tokens, extra)


def _padded_crash() -> tuple[Config, list[TraceStep]]:
    """Fillers of one block each, then an admission that needs the pool's free blocks exactly."""
    config = Config(block_size=BLOCK_SIZE, num_blocks=len(PROMPT) + FILLERS)
    driver = Driver(CrashesOnItsLastFreeBlocks(config))
    for seq in range(FILLERS):
        driver.admit(seq, [0], 1)
    trace = [step for step in driver.trace if not step.args.get(END)]
    return config, [*trace, TraceStep("admit", {"seq": FILLERS, "tokens": PROMPT, "num_new_tokens": len(PROMPT)})]


def _same_crash(expected: Fingerprint):
    from kvspec.testing.known import fingerprint

    return lambda config, result: result.error is not None and fingerprint(result.error, result.trace) == expected


def test_a_padded_crash_is_cut_to_its_admission_and_stays_the_same_crash():
    from kvspec.testing.known import fingerprint

    config, trace = _padded_crash()
    first = rerun(CrashesOnItsLastFreeBlocks, config, trace)
    assert first.crash is not None and len(first.trace) == FILLERS + 1
    expected = fingerprint(first.error, first.trace)
    cut = minimize(CrashesOnItsLastFreeBlocks, config, trace, _same_crash(expected), crashes=True)
    assert cut is not None
    assert [s.op for s in cut.trace] == ["admit"] and cut.trace[-1].crash is not None
    # On the smallest pool: the blocks its one admission takes, every one of them free.
    assert cut.config.num_blocks == blocks_for_tokens(cut.trace[-1].args["num_new_tokens"], BLOCK_SIZE)
    assert cut.config.num_blocks < config.num_blocks
    # The cut's crash and exception are the re-run's, and the cut re-runs to the same crash.
    assert cut.crash == cut.trace[-1].crash and isinstance(cut.error, IndexError)
    again = rerun(CrashesOnItsLastFreeBlocks, cut.config, cut.trace)
    assert again.crash is not None and fingerprint(again.error, again.trace) == expected


def test_a_crash_is_not_cut_as_a_violation_nor_a_violation_as_a_crash():
    config, trace = _padded_crash()
    assert minimize(CrashesOnItsLastFreeBlocks, config, trace, lambda c, r: True) is None
    seed_config, seed_trace = _padded_trace()
    full = _with_final_admission(seed_config, seed_trace)
    assert minimize(WindowCappedAdmission, seed_config, full, lambda c, r: True, crashes=True) is None


def test_check_cuts_a_crash_verdict_and_reports_the_reruns_crash():
    """``kvspec check``'s verdict for a crash (minimize_found): the outcome's trace,
    configuration, crash, exception, error line and traceback all become the cut re-run's,
    and the fingerprint stays the crash's.  A guard's trip is never re-run."""
    from collections import Counter

    from kvspec.cli.check import minimize_found
    from kvspec.cli.run import Outcome, Tally
    from kvspec.cli.search import Found, Search
    from kvspec.testing.blockmanager.machine import RunStats
    from kvspec.testing.known import fingerprint

    config, trace = _padded_crash()
    guard = Guard(Limits(op_timeout=None, memory_cap_gib=None))
    factory = guard.wrap(CrashesOnItsLastFreeBlocks)
    with guard.armed():
        shrunk = rerun(factory, config, trace)
    assert shrunk.crash is not None

    def outcome(error: BaseException) -> Outcome:
        return Outcome(
            status="error", tally=Tally(), stats=RunStats(), requested=1, steps=1, seed=None, profile="ci",
            focus=None, seconds=0.0, trace=list(shrunk.trace), config=config, error=f"IndexError: {error}",
            exception=error, crash=shrunk.crash, traceback=["shrunk"],
        )

    expected = fingerprint(shrunk.error, shrunk.trace)
    crash = Found(expected, outcome(shrunk.error))
    hung = Found(expected, outcome(TargetHung("admit", 1.0)))
    search = Search(found=[crash, hung], rounds=[], fired=Counter(), known=[])
    with guard.armed():
        minimize_found(search, factory, [], "reference", None, guard, {})
    o = crash.outcome
    assert o.minimized is not None and f"{len(shrunk.trace)} operation(s) to 1" in o.minimized
    assert [s.op for s in o.trace] == ["admit"] and o.config.num_blocks < config.num_blocks
    assert o.crash == o.trace[-1].crash and o.exception is not shrunk.error
    assert o.error.startswith("IndexError: took the pool's last free block")
    assert o.traceback != ["shrunk"] and crash.fingerprint == expected
    assert hung.outcome.minimized is None and hung.outcome.trace == shrunk.trace
