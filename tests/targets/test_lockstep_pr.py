"""PR mode in lockstep on the V1 engine: a copy of vLLM 0.33.0's vllm/ tree as HEAD, the release as BASE.

The copy is made at test time from the installed package (nothing of vLLM's is kept in this
repository).  Three HEADs:

* the free queue's eviction order reversed (``BlockPool.free_blocks`` puts freed cached blocks at
  the front of the queue, so the most recently used is evicted first): no invariant breaks, so
  it must be a behaviour change, shrunk, with a golden pytest file that fails on the copy and
  passes on 0.33.0;
* ``free_blocks`` keeps block 1 referenced when it is freed: a regression (exit 1);
* the unmodified copy: nothing (exit 0), and the run says how many examples it compared.

Runs in the 0.33.0 venv (``kvspec test-targets 0.33.0``); each case starts two target processes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import requires_vllm

pytestmark = requires_vllm("0.33.0", "0.33.0")

EVICT_LAST = "        self.free_block_queue.append_n(blocks_to_evict_last)\n"
DECREF = "            block.ref_cnt -= 1\n            if block.ref_cnt == 0:\n                if block.block_hash"
BUDGET = ["--profile", "ci", "--examples", "40", "--max-violations", "1"]


def _copy(tmp_path: Path, name: str, old: str | None = None, new: str | None = None) -> Path:
    import vllm

    root = tmp_path / name
    shutil.copytree(Path(vllm.__file__).parent, root / "vllm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    if old is not None and new is not None:
        pool = root / "vllm" / "v1" / "core" / "block_pool.py"
        text = pool.read_text()
        assert text.count(old) == 1, "the planted line moved: update the test for this release"
        pool.write_text(text.replace(old, new))
    return root


def _pr(head: Path, out: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "check", "--vllm-source", str(head), "--source-version", "0.33.0",
         "--baseline", "0.33.0", *BUDGET, *flags, "--out", str(out)],
        capture_output=True, text=True, timeout=3000, check=False,
    )
    summary = out / "pr.json"
    assert summary.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads(summary.read_text())


def _compared(proc: subprocess.CompletedProcess[str]) -> int:
    m = re.search(r"compared (\d+) examples, (\d+) operations", proc.stdout)
    assert m, proc.stdout[-3000:]
    return int(m.group(1))


def test_reversed_eviction_order_is_a_behaviour_change_with_a_verified_golden_test(tmp_path):
    planted = "        self.free_block_queue.prepend_n(blocks_to_evict_last)  # planted: MRU first\n"
    head = _copy(tmp_path, "evict", EVICT_LAST, planted)
    proc, summary = _pr(head, tmp_path / "out", "--config", "caching=on", "--config", "window=off")
    assert proc.returncode == 0, proc.stdout[-4000:]
    # One block-manager lockstep change (plus what the scheduler half sees: vLLM's scheduler
    # evicts through the same free queue).
    assert summary["regressions"] == 0, summary
    scheduler = summary.get("scheduler_changes", 0) + summary.get("scheduler_lockstep_changes", 0)
    assert summary["changes"] == 1 + scheduler, summary["verdicts"]
    (verdict,) = summary["verdicts"]
    assert verdict["verdict"] == "behaviour change"
    assert len(verdict["trace"]) <= 4, verdict["trace"]  # shrunk
    golden = verdict["golden"]
    assert golden["status"] == "verified", golden
    test_file = Path(golden["path"])
    # Independently of kvspec's own verification: the file fails on the copy, passes on 0.33.0.
    plain = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]
    on_head = subprocess.run(plain, capture_output=True, text=True, cwd=test_file.parent, check=False,
                             env={**_env(), "PYTHONPATH": str(head)})
    on_base = subprocess.run(plain, capture_output=True, text=True, cwd=test_file.parent, check=False, env=_env())
    assert on_head.returncode == 1 and "[behaviour-change]" in on_head.stdout, on_head.stdout[-2000:]
    assert on_base.returncode == 0, on_base.stdout[-2000:]
    assert _compared(proc) > 0
    failing, _ = _pr(head, tmp_path / "out-fail", "--config", "caching=on", "--config", "window=off",
                     "--fail-on-change", "--no-verify")
    assert failing.returncode == 1, failing.stdout[-3000:]  # --fail-on-change: a change fails the PR


def test_a_leaked_block_is_a_regression(tmp_path):
    planted = DECREF.replace("block.ref_cnt -= 1", "block.ref_cnt -= 0 if block.block_id == 1 else 1  # planted", 1)
    head = _copy(tmp_path, "leak", DECREF, planted)
    proc, summary = _pr(head, tmp_path / "out", "--no-verify")
    assert proc.returncode == 1, proc.stdout[-4000:]
    # The block-manager lockstep's one regression, plus what the scheduler half adds (the leak
    # breaks vLLM's scheduler too: the scheduler lockstep, and HEAD's own check).
    scheduler = summary.get("scheduler_regressions", 0) + summary.get("scheduler_lockstep_regressions", 0)
    assert summary["regressions"] == 1 + scheduler, summary["verdicts"]
    (verdict,) = summary["verdicts"]
    assert verdict["head_violations"] and not verdict["base_violations"], verdict
    assert "HEAD regressed" in proc.stdout


def test_an_unmodified_copy_reports_nothing_and_says_what_it_compared(tmp_path):
    proc, summary = _pr(_copy(tmp_path, "unmodified"), tmp_path / "out")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert summary["verdicts"] == [] and summary["regressions"] == 0 and summary["changes"] == 0, summary
    assert summary["scheduler_lockstep"]["verdicts"] == [] and summary["scheduler_lockstep"]["examples"] > 0
    assert _compared(proc) == summary["examples"] >= 40
    assert summary["operations"] > summary["examples"]
    assert "no regression" in proc.stdout


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONHASHSEED"] = "0"
    return env
