"""The scheduler lockstep (testing/scheduler/lockstep.py) on vLLM 0.33.0's own scheduler: a copy of
the installed vllm/ tree as HEAD (symlinks, with vllm/v1/core/sched/scheduler.py a real file),
the release as BASE.  Three HEADs:

* one request admitted at a time (``max_num_active_reqs`` set to 1, scheduler.py:134-138,
  read at :1073): every invariant holds and every request finishes, so it is a behaviour change
  in what a step schedules, shrunk to a few operations;
* a finished request's blocks never returned (``_free_request_blocks`` skips
  ``kv_cache_manager.free``, scheduler.py:3088-3090): a regression;
* the unmodified copy: nothing, and the run says how many examples it compared;
* a block pool that caches nothing (``BlockPool.cache_full_blocks`` returns at once,
  block_pool.py:265-266): the first difference is the prefix-cache entries a step leaves, a
  behaviour change whose golden file must assert them (it fails on the copy only through them).

Through ``kvspec check --baseline`` the behaviour change comes with a golden file that fails on
the copy and passes on 0.33.0.

The copy is made at test time from the installed package (nothing of vLLM's is kept in this
repository).  Runs in the 0.33.0 venv (``kvspec test-targets 0.33.0``); each case starts two
target processes.  The same HEADs through ``kvspec check --baseline`` (the PR verdict) are the
last test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvspec.testing.lockstep import Kind, Side, run_lockstep
from kvspec.testing.scheduler.lockstep import SchedulerLockstepMachine, shape_strategy

from .conftest import requires_vllm

pytestmark = requires_vllm("0.33.0", "0.33.0")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not installed

from bench.lockstep_mutation import overlay  # noqa: E402

SCHEDULER = Path("v1/core/sched/scheduler.py")
ACTIVE = """        self.max_num_active_reqs = (
            self.scheduler_config.max_num_active_seqs
            if self.scheduler_config.max_num_active_seqs is not None
            else self.max_num_running_reqs
        )
"""
SERIAL = "        self.max_num_active_reqs = 1  # planted: one request at a time\n"
FREE = """        if self._request_blocks_can_be_freed(request):
            self.kv_cache_manager.free(request)
            return
"""
LEAK = """        if self._request_blocks_can_be_freed(request):
            return  # planted: the blocks are never returned
"""
POOL = Path("v1/core/block_pool.py")
CACHE = """        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
"""
NO_CACHE = """        return  # planted: nothing is ever cached
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
"""
BUDGET = dict(profile="ci", examples=25, max_verdicts=1, machine=SchedulerLockstepMachine, golden=False)


def _copy(tmp_path: Path, name: str, old: str | None = None, new: str | None = None, where: Path = SCHEDULER) -> Path:
    import vllm

    package = Path(vllm.__file__).parent
    replaced = {Path("__init__.py"): (package / "__init__.py").read_text()}
    if old is not None and new is not None:
        text = (package / where).read_text()
        assert text.count(old) == 1, "the planted line moved: update the test for this release"
        replaced[where] = text.replace(old, new)
    root = tmp_path / name
    overlay(package, root / "vllm", replaced)
    return root


def _sides(head: Path) -> tuple[Side, Side]:
    return (Side("HEAD", f"the copy {head}", sys.executable, "v1", pythonpath=str(head)),
            Side("BASE", "vLLM 0.33.0", sys.executable, "v1"))


def _run(head: Path, **budget):
    sides = _sides(head)
    run = run_lockstep(*sides, shape_strategy(), **{**BUDGET, **budget})
    assert run.status == "compared", run.status
    assert str(head) in run.imported["HEAD"] and str(head) not in run.imported["BASE"], run.imported
    return run


def test_the_unmodified_copy_differs_nowhere(tmp_path):
    run = _run(_copy(tmp_path, "plain"))
    assert run.verdicts == [], [v.describe() for v in run.verdicts]
    assert run.stats.examples >= 15 and run.stats.by_op.get("step", 0) > run.stats.examples


def test_one_request_at_a_time_is_a_behaviour_change_in_what_a_step_schedules(tmp_path):
    run = _run(_copy(tmp_path, "serial", ACTIVE, SERIAL))
    (verdict,) = run.verdicts
    assert verdict.kind is Kind.CHANGE, "\n".join(verdict.describe())
    assert verdict.op == "step" and verdict.field in ("hits", "scheduled"), "\n".join(verdict.describe())
    assert not verdict.head_violations and not verdict.base_violations
    head, base = verdict.values()
    assert len(base) > len(head), (head, base)  # BASE batches both requests, HEAD one
    assert len(verdict.trace) <= 4, "\n".join(verdict.describe())  # shrunk: two arrivals and a step


def test_blocks_never_returned_are_a_regression(tmp_path):
    run = _run(_copy(tmp_path, "leak", FREE, LEAK))
    (verdict,) = run.verdicts
    assert verdict.kind is Kind.REGRESSION, "\n".join(verdict.describe())
    assert verdict.head_violations and not verdict.base_violations
    assert {v.invariant for v in verdict.head_violations} & {"no-leak", "refcount-exact", "conservation"}


def test_a_change_in_what_is_cached_alone_gets_a_golden_file_that_asserts_it(tmp_path):
    import attrs
    from kvspec.cli.pr import keep_golden
    from kvspec.testing.artifacts.golden import write_scheduler_golden

    head = _copy(tmp_path, "nocache", CACHE, NO_CACHE, where=POOL)
    run = _run(head, golden=True)
    (verdict,) = run.verdicts
    assert verdict.kind is Kind.CHANGE, "\n".join(verdict.describe())
    assert verdict.op == "step" and verdict.field in ("free", "cached", "cached_keys"), "\n".join(verdict.describe())
    kept = keep_golden(run.goldens[0], tmp_path, *_sides(head), verify=True)
    assert kept["status"] == "verified", kept
    # The shrunk trace finishes its request, so the pool's free blocks differ too; with the
    # request still running at the differing step only the prefix-cache entries do, and the
    # golden file BASE writes there must fail on the copy through them.
    trace = [attrs.evolve(s, args={**s.args, "max_tokens": 8}) if s.op == "arrive" else s for s in verdict.trace]
    running = write_scheduler_golden(verdict.config, trace, "cached entries only", verdict.index)
    assert "error" not in running, running
    (tmp_path / "running").mkdir()
    kept = keep_golden(running, tmp_path / "running", *_sides(head), verify=True)
    assert kept["status"] == "verified", kept
    assert kept["head_failure"].startswith("[behaviour-change] cached:"), kept


def test_the_pr_verdict_reports_the_scheduler_change(tmp_path):
    """``kvspec check --baseline``: the scheduler lockstep's behaviour change is in pr.json and
    counted; the block-manager half (which never runs scheduler.py) reports nothing."""
    head = _copy(tmp_path, "serial", ACTIVE, SERIAL)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "check", "--vllm-source", str(head), "--source-version", "0.33.0",
         "--baseline", "0.33.0", "--profile", "ci", "--examples", "20", "--max-violations", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=3000, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "pr.json").read_text())
    assert summary["regressions"] == 0, summary
    half = summary["scheduler_lockstep"]
    assert half["status"] == "compared" and half["examples"] > 0, half
    (verdict,) = half["verdicts"]
    assert verdict["verdict"] == "behaviour change" and verdict["operation"] == "step", verdict
    assert summary["scheduler_lockstep_changes"] == 1 and summary["changes"] >= 1, summary
    # Its golden file asserts BASE's plan at the differing step: kvspec ran it, it failed on the
    # copy (tagged) and passed on 0.33.0.
    assert verdict["golden"]["status"] == "verified", verdict["golden"]
    assert "scheduled" in verdict["golden"]["head_failure"], verdict["golden"]
    assert "vLLM's own V1 scheduler in lockstep" in proc.stdout
