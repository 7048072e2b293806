"""Straight-line reproducers on the V1 engine (vLLM 0.33.0's KVCacheManager).

A copy of the release's vllm/ tree gets one planted bug (``BlockPool.free_blocks`` leaves every
third block referenced).  kvspec writes the reproducer of a four-operation trace where the
planted tree is imported; the file must fail there under plain pytest naming refcount-exact,
and pass on the unmodified release: it checks the property, not the recorded answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import requires_vllm

pytestmark = requires_vllm("0.33.0", "0.33.0")

LEAK = (
    "            block.ref_cnt -= 1\n"
    "            if block.ref_cnt == 0:\n"
    "                if block.block_hash is None or not self.enable_caching:\n"
)
WRITE = """
import sys
from kvspec.spec.config import Config
from kvspec.testing.blockmanager.driver import TraceStep
from kvspec.testing.artifacts.reproducer import Reproducer, generate

def op(name, **args):
    return TraceStep(name, args)

trace = [op("admit", seq=0, tokens=[0], num_new_tokens=1), op("admit", seq=1, tokens=[0], num_new_tokens=1),
         op("step", seq=0, num_new_tokens=1), op("free", seq=0)]
made = generate("v1", Config(block_size=1, num_blocks=3), trace, [], {"vllm_version": "0.33.0", "focus": None})
assert isinstance(made, Reproducer), made
open(sys.argv[1], "w").write(made.text)
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    import vllm

    root = tmp_path_factory.mktemp("planted")
    shutil.copytree(Path(vllm.__file__).parent, root / "vllm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    pool = root / "vllm" / "v1" / "core" / "block_pool.py"
    text = pool.read_text()
    assert text.count(LEAK) == 1
    planted_leak = LEAK.replace("-= 1\n", "-= 1 if block.block_id % 3 else 0  # planted\n", 1)
    pool.write_text(text.replace(LEAK, planted_leak))
    return root


def _run(args: list[str], pythonpath: Path | None, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["COLUMNS"] = "400"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=900, check=False)


@pytest.fixture(scope="module")
def reproducer(planted, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("repro") / "test_v1_refcount.py"
    made = _run(["-c", WRITE, str(path)], planted, path.parent)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return path


def test_the_file_is_straight_line_v1_code(reproducer):
    text = reproducer.read_text()
    assert "mgr = KVCacheManager(" in text and "mgr.allocate_slots(req0, 1" in text and "mgr.free(req0)" in text
    assert "TRACE" not in text and "class Replay" not in text  # no interpreter


def test_it_fails_on_the_planted_bug_naming_the_invariant(reproducer, planted):
    proc = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(reproducer)], planted, reproducer.parent)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "Failed: [refcount-exact]" in proc.stdout


def test_it_passes_on_the_release_without_the_bug(reproducer):
    proc = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(reproducer)], None, reproducer.parent)
    assert proc.returncode == 0, proc.stdout[-3000:]
