"""``kvspec check`` end to end on a real vLLM: release 0.6.3 (BlockSpaceManagerV2, the seed
bug), the standalone reproducer under the target venv's plain pytest, and ``--vllm-source`` on
an unpacked copy of the release's source tree (with and without a fix)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kvspec.cli.search import run_index
from kvspec.targets.registry import target

RELEASE = target("0.6.3")

pytestmark = [
    pytest.mark.target,
    pytest.mark.skipif(
        not RELEASE.is_provisioned(),
        reason=f"vLLM 0.6.3 is not provisioned at {RELEASE.venv}: run `kvspec provision 0.6.3`",
    ),
]

SEED = ["--impl", "legacy-v2", "--config", "block_size=4", "--config", "num_blocks=4",
        "--config", "sliding_window=8", "--invariant", "admission-soundness",
        "--profile", "ci"]


def seed_report(out: Path) -> Path:
    """The seed bug's report among the run's distinct violations (FINDINGS F1)."""
    (entry,) = [e for e in run_index(out) if e["known_finding"] == "F1"]
    return Path(entry["report"])


def kvspec(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvspec.cli", *args], capture_output=True,
                          text=True, env=env, timeout=900, check=False)


def venv_pytest(path: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [str(RELEASE.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        capture_output=True, text=True, cwd=path.parent, env=env, timeout=600, check=False,
    )


@pytest.fixture(scope="module")
def release_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    proc = kvspec("check", "--vllm", "0.6.3", *SEED, "--out", str(out))
    return proc, out


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    """The release's vllm/ package as a source tree: Python files only, no compiled kernels."""
    root = tmp_path_factory.mktemp("vllm-src")
    (installed,) = RELEASE.venv.glob("lib/python*/site-packages/vllm")
    shutil.copytree(installed, root / "vllm",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return root


def test_check_finds_the_seed_bug_and_writes_a_reproducer(release_run):
    proc, out = release_run
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "VIOLATED" in proc.stdout
    report = json.loads(seed_report(out).read_text())
    assert report["target"]["kind"] == "release" and report["target"]["vllm_version"] == "0.6.3"
    assert report["target"]["engine"] == "legacy"
    assert {v["invariant"] for v in report["violations"]} == {"admission-soundness"}
    assert any("answered OK, then the allocation failed" in v["message"]
               for v in report["violations"])
    repro = report["reproducer"]
    assert repro["status"] == "verified", repro
    assert Path(repro["path"]).is_file()


def test_the_seed_reports_page_shows_the_pool_the_need_and_what_allocate_took(release_run, shown_report):
    """report.html of the seed bug, read back in a browser (conftest.py ``shown_report``): every
    operation, the sequence refused, and the facts: can_allocate answered OK to an admission
    whose need exceeds the pool, and allocate kept the blocks it took."""
    _, out = release_run
    path = seed_report(out)
    report = json.loads(path.read_text())
    shown = shown_report(path.with_name("report.html"), report)
    (v,) = [v for v in report["violations"] if v.get("kind") == "ok-then-failed"]
    assert v["need"] > v["pool"]["free"] + v["pool"]["evictable"], v
    assert v["taken"], v
    assert shown["verdict"]["need"] == str(v["need"])


def test_reproducer_fails_under_plain_pytest_naming_the_invariant(release_run):
    _, out = release_run
    repro = Path(json.loads(seed_report(out).read_text())["reproducer"]["path"])
    imported = set()
    for node in ast.walk(ast.parse(repro.read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "kvspec" not in imported and imported <= {"vllm", "pytest", "__future__"}
    proc = venv_pytest(repro)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "[admission-soundness]" in text
    assert "can_allocate answered AllocStatus.OK, so expected allocate to succeed" in text


def test_replay_of_the_report_reproduces_on_the_release(release_run):
    _, out = release_run
    proc = kvspec("replay", str(seed_report(out)))  # the report's release by default
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the recorded violation reproduces" in proc.stdout


def test_vllm_source_needs_a_version_for_a_bare_tree(source_tree):
    proc = kvspec("check", "--vllm-source", str(source_tree), "--impl", "legacy-v2")
    assert proc.returncode == 2
    assert "--source-version" in proc.stderr


def test_vllm_source_behaves_like_the_release(release_run, source_tree, tmp_path):
    _, release_out = release_run
    proc = kvspec("check", "--vllm-source", str(source_tree), "--source-version", "0.6.3",
                  *SEED, "--out", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(seed_report(tmp_path).read_text())
    release = json.loads(seed_report(release_out).read_text())
    assert report["target"]["kind"] == "source"
    assert report["target"]["vllm_path"] == str(source_tree / "vllm")
    assert report["target"]["venv_release"] == "0.6.3"
    # The same derandomized search on the same code finds the same bug.  The traces may
    # differ: hypothesis seeds its generation with constants it reads from *local* source
    # files (hypothesis.internal.conjecture.providers._get_local_constants), and a checkout
    # is local code where an installed release is not.  Each mode repeats itself exactly.
    assert report["violations"] == release["violations"]
    assert report["trace"][-1]["outcome"] == release["trace"][-1]["outcome"]
    assert report["violations"] == release["violations"]
    assert report["reproducer"]["status"] == "verified"


def test_reproducer_and_replay_pass_once_the_bug_is_fixed(release_run, source_tree, tmp_path):
    """A contributor's fix on a checkout: admission counts every prompt block.  (The fix is
    our own few lines appended to a copy of the tree; vLLM's code is not edited.)"""
    fixed = tmp_path / "fixed"
    shutil.copytree(source_tree, fixed)
    with open(fixed / "vllm" / "core" / "block_manager_v2.py", "a") as f:
        f.write(
            "\n\n_unfixed_can_allocate = BlockSpaceManagerV2.can_allocate\n\n\n"
            "def _fixed_can_allocate(self, seq_group, num_lookahead_slots=0):\n"
            "    saved, self.max_block_sliding_window = self.max_block_sliding_window, None\n"
            "    try:\n"
            "        return _unfixed_can_allocate(self, seq_group, num_lookahead_slots)\n"
            "    finally:\n"
            "        self.max_block_sliding_window = saved\n\n\n"
            "BlockSpaceManagerV2.can_allocate = _fixed_can_allocate\n"
        )
    _, out = release_run
    report = seed_report(out)
    repro = Path(json.loads(report.read_text())["reproducer"]["path"])
    still_broken = venv_pytest(repro, pythonpath=source_tree)
    assert still_broken.returncode == 1, still_broken.stdout
    passing = venv_pytest(repro, pythonpath=fixed)
    assert passing.returncode == 0, passing.stdout + passing.stderr
    replay = kvspec("replay", str(report), "--vllm-source", str(fixed), "--source-version", "0.6.3")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "no violation" in replay.stdout
