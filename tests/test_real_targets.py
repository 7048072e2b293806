"""Runs tests/targets inside each pinned vLLM release's venv (they import vllm, which the
core environment never has).  Unprovisioned targets skip, naming the command.

Each release's files run in ``SHARDS`` subprocesses, so that ``pytest -n`` spreads one
release's suite over its workers instead of leaving one worker on it for the whole run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kvspec.targets.provision import REPO, install_kvspec
from kvspec.targets.registry import PINNED, target

SHARDS = 4
RELEASE_RANGE = ", this venv has "  # tests/targets/conftest.py's skip for another release's test
TARGET_FILES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests" / "targets").glob("test_*.py"))


def shard_files(shard: int) -> list[str]:
    """The target test files of ``shard``: every ``SHARDS``-th file, in name order."""
    return TARGET_FILES[shard::SHARDS]


def test_the_shards_cover_every_target_file_once():
    sharded = [f for shard in range(SHARDS) for f in shard_files(shard)]
    assert sorted(sharded) == TARGET_FILES and len(set(sharded)) == len(sharded)
    assert all(shard_files(shard) for shard in range(SHARDS)), "more shards than files"


@pytest.mark.target
@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("version", PINNED)
def test_stateful_real_target(version, shard):
    t = target(version)
    if not t.is_provisioned():
        pytest.skip(f"vLLM {version} is not provisioned: run `kvspec provision {version}`")
    install_kvspec(t, lambda msg: print(msg, file=sys.stderr))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    files = shard_files(shard)
    proc = subprocess.run(
        [str(t.python), "-m", "pytest", *files, "-q", "-rfEs", "-p", "no:cacheprovider", "--durations=15"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    print(proc.stdout[-6000:])
    # The skip list is long; the failures are what a red run must show first.
    failures = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert proc.returncode in (0, 5), (
        f"tests/targets (shard {shard}) failed in vLLM {version}:\n" + "\n".join(failures) + "\n" + proc.stdout[-4000:]
    )
    if " passed" not in proc.stdout:
        # Nothing ran: a skip only when every test said it is for other releases (the target
        # tests' ``requires_vllm``); any other reason (vLLM not importable, ...) fails.
        reasons = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
        other = [line for line in reasons if RELEASE_RANGE not in line]
        assert reasons and not other, f"nothing ran in vLLM {version} (shard {shard}):\n{proc.stdout[-3000:]}"
        pytest.skip(f"no test of {', '.join(files)} applies to vLLM {version}:\n{proc.stdout[-1500:]}")
