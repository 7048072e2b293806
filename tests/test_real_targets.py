"""Runs tests/targets inside each pinned vLLM release's venv (they import vllm, which the
core environment never has).  Unprovisioned targets skip, naming the command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kvspec.targets.provision import REPO, install_kvspec
from kvspec.targets.registry import PINNED, target


@pytest.mark.target
@pytest.mark.parametrize("version", PINNED)
def test_stateful_real_target(version):
    t = target(version)
    if not t.is_provisioned():
        pytest.skip(f"vLLM {version} is not provisioned: run `kvspec provision {version}`")
    install_kvspec(t, lambda msg: print(msg, file=sys.stderr))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [str(t.python), "-m", "pytest", "tests/targets", "-q", "-rfEs", "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    print(proc.stdout[-6000:])
    # The skip list is long; the failures are what a red run must show first.
    failures = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert proc.returncode == 0, (
        f"tests/targets failed in vLLM {version}:\n" + "\n".join(failures) + "\n" + proc.stdout[-4000:]
    )
    assert " passed" in proc.stdout, f"nothing ran in vLLM {version}:\n{proc.stdout[-3000:]}"
