"""A legacy golden test whose difference is an admission check's answer.

``kvspec diff 0.6.2 0.6.3 --impl legacy-v2`` finds that 0.6.3's V2 manager refuses to swap out a
one-block sequence with one appended token into a one-block CPU pool (``can_swap_out`` False)
where 0.6.2 swaps it: 0.6.3's ``_can_swap`` (block_manager_v2.py:473-492) adds the blocks that
appending the sequence's unseen tokens would touch to its full blocks (1 + 1 > 1 CPU block:
NEVER), 0.6.2's counts the table's blocks only (``get_num_blocks_touched``, :470-472). The
golden file must assert BASE's answer at that call as a ``[behaviour-change]`` failure, or
kvspec cannot verify it (it fails on HEAD for another reason). Needs the provisioned 0.6.2 and
0.6.3 venvs; skips loudly without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvspec.targets.provision import REPO
from kvspec.targets.registry import target

BASE, HEAD = target("0.6.2"), target("0.6.3")

pytestmark = [
    pytest.mark.target,
    pytest.mark.skipif(
        not (BASE.is_provisioned() and HEAD.is_provisioned()),
        reason="vLLM 0.6.2 and 0.6.3 must be provisioned: run `kvspec provision 0.6.2 0.6.3`",
    ),
]

WRITE = """
import sys
from kvspec.spec.config import Config
from kvspec.testing.blockmanager.driver import TraceStep
from kvspec.testing.artifacts.golden import write_golden

config = Config(block_size=1, num_blocks=1, num_cpu_blocks=1, sliding_window=None, prefix_caching=False,
                max_lookahead=0)
trace = [TraceStep("admit", {"seq": 0, "tokens": [0], "num_new_tokens": 1, "next_token": 0}),
         TraceStep("swap_out", {"seq": 0})]
golden = write_golden("legacy-v2", config, trace, "swap_out differs", 2)
open(sys.argv[1], "w").write(golden["text"])
"""


def _run(python: Path, *args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python *args`` with this checkout's kvspec (and ``pythonpath`` first on the path: a vLLM tree)."""
    env = {**os.environ, "KVSPEC_CHECKOUT": str(REPO)}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([str(python), *args], capture_output=True, text=True, env=env, timeout=600,
                          check=False)


def golden_on_both(write: str, folder: Path, base: Path, head: Path, head_path: str | None = None) -> str:
    """Write the golden file with ``write`` in ``base``'s python, run it there (it must pass)
    and in ``head``'s (with ``head_path`` first on the path; it must fail): HEAD's output."""
    path = folder / "test_golden.py"
    wrote = _run(base, "-c", write, str(path))
    assert wrote.returncode == 0, wrote.stderr[-3000:]
    pytest_args = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(folder), str(path))
    on_base = _run(base, *pytest_args)
    assert on_base.returncode == 0, on_base.stdout[-3000:]
    on_head = _run(head, *pytest_args, pythonpath=head_path)
    assert on_head.returncode == 1, on_head.stdout[-3000:]
    return on_head.stdout


def test_a_differing_admission_answer_fails_tagged_on_head_and_passes_on_base(tmp_path):
    out = golden_on_both(WRITE, tmp_path, BASE.python, HEAD.python)
    assert "Failed: [behaviour-change] can_swap_out: expected True (BASE)" in out, out[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
