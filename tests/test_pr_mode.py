"""PR mode (``kvspec check --vllm-source HEAD --baseline BASE``) on vLLM 0.6.3's V2 manager.

HEAD is a copy of the release's own vllm/ tree, run in lockstep with the release: unmodified it
must report no regression; with one planted bug (``free`` forgets to free the block table) it
must report exactly that bug.
The configuration is pinned to features where 0.6.3 V2 has no known bug (no window, no prefix
caching, no swap, no lookahead), so BASE holds and the comparison is about the plant alone.
Needs the provisioned 0.6.3 venv (``kvspec provision 0.6.3``); skips loudly without it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvspec.targets.provision import REPO
from kvspec.targets.registry import target

RELEASE = target("0.6.3")
FREE_TABLE = "        self.block_tables[seq_id].free()\n"
QUIET_CONFIG = [
    "--config", "window=off", "--config", "caching=off", "--config", "swap=off",
    "--config", "lookahead=off", "--config", "fork=on",
]

pytestmark = [
    pytest.mark.target,
    pytest.mark.skipif(
        not RELEASE.is_provisioned(), reason="vLLM 0.6.3 is not provisioned: run `kvspec provision 0.6.3`"
    ),
]


def _head(tmp_path: Path, *, plant: bool) -> Path:
    (installed,) = RELEASE.venv.glob("lib/python*/site-packages/vllm")
    root = tmp_path / ("planted" if plant else "unmodified")
    shutil.copytree(installed, root / "vllm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    if plant:
        manager = root / "vllm" / "core" / "block_manager_v2.py"
        text = manager.read_text()
        assert text.count(FREE_TABLE) == 1
        manager.write_text(text.replace(FREE_TABLE, "        pass  # planted: the table's blocks are never freed\n"))
    return root


def _pr(head: Path, out: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "check", "--vllm-source", str(head), "--source-version", "0.6.3",
         "--baseline", "0.6.3", "--impl", "legacy-v2", "--profile", "ci", "--examples", "15",
         "--max-violations", "1", "--no-verify", *QUIET_CONFIG, "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=1500, check=False,
    )
    summary = out / "pr.json"
    assert summary.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads(summary.read_text())


def test_an_unmodified_copy_of_the_release_is_no_regression(tmp_path):
    proc, summary = _pr(_head(tmp_path, plant=False), tmp_path / "out")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert summary["regressions"] == 0
    assert "no regression" in proc.stdout


def test_a_planted_bug_is_reported_as_exactly_one_regression(tmp_path):
    proc, summary = _pr(_head(tmp_path, plant=True), tmp_path / "out")
    assert proc.returncode == 1, proc.stdout[-4000:]
    regressions = [r for r in summary["rows"] if r["verdict"].startswith("REGRESSION")]
    assert len(regressions) == 1 == summary["regressions"], summary
    assert regressions[0]["replayed"] == "BASE: holds"
    violated = set(regressions[0]["violation"].split(" in ")[0].split(","))
    assert violated and violated <= {"no-leak", "refcount-exact", "conservation"}, regressions
    assert "HEAD regressed" in proc.stdout
