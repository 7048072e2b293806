"""Straight-line reproducers for every FINDINGS.md entry on vLLM 0.6.3's legacy managers.

Each vector is a finding's shrunk trace.  The file kvspec writes for it must be short, import
only vllm, pytest and the standard library, and fail under plain pytest naming the
invariant (or the crash).  All files run in one pytest process: vLLM's import is the cost.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvspec.spec.config import Config
from kvspec.testing.artifacts.reproducer import NotReproducible, Reproducer, generate
from kvspec.testing.blockmanager.driver import TraceStep

from .conftest import requires_vllm

pytestmark = requires_vllm("0.6.3", "0.6.3")


def _op(op: str, **args) -> TraceStep:
    return TraceStep(op, args)


def _admit(seq: int, tokens: list[int], k: int) -> TraceStep:
    return _op("admit", seq=seq, tokens=tokens, num_new_tokens=k)


# finding -> (impl, config, trace, the invariants the run watched (none: a crash), what the failure names)
FINDINGS = {
    "F1": ("legacy-v2", Config(block_size=1, num_blocks=3, sliding_window=1), [_admit(0, [0, 0, 0, 0], 4)],
           None, "admission-soundness"),
    "F2": ("legacy-v2", Config(block_size=1, num_blocks=4, sliding_window=1), [_admit(0, [0, 0], 1)],
           None, "window-bound"),
    "F3": ("legacy-v1", Config(block_size=1, num_blocks=4, sliding_window=1),
           [_admit(0, [0], 1), _op("step", seq=0, num_new_tokens=1)], ["immutability"], "immutability"),
    "F4": ("legacy-v2", Config(block_size=2, num_blocks=8, prefix_caching=True),
           [_admit(0, [0, 0, 0, 0, 0], 2), _admit(1, [0, 0, 0, 0, 0, 1], 6)],
           ["prefix-cache-consistency"], "prefix-cache-consistency"),
    "F5": ("legacy-v2", Config(block_size=2, num_blocks=1, num_cpu_blocks=1, prefix_caching=True),
           [_admit(0, [0], 1), _op("swap_out", seq=0), _op("free", seq=0)], None, "crash"),
    "F6": ("legacy-v2", Config(block_size=4, num_blocks=2, sliding_window=4),
           [_admit(0, [0, 0, 0, 0], 4), _op("step", seq=0, num_new_tokens=1)], None, "admission-soundness"),
    "F7": ("legacy-v2", Config(block_size=4, num_blocks=12, num_cpu_blocks=12, sliding_window=4),
           [_admit(0, list(range(20)), 20), _op("step", seq=0, num_new_tokens=1), _op("swap_out", seq=0)],
           [], "crash"),
    "F8": ("legacy-v2", Config(block_size=2, num_blocks=12, sliding_window=2),
           [_admit(0, list(range(8)), 8), _op("step", seq=0, num_new_tokens=1), _op("fork", parent=0, child=1)],
           [], "crash"),
    "F9": ("legacy-v1", Config(block_size=4, num_blocks=8),
           [_admit(0, [0], 1), _op("fork", parent=0, child=1), _op("free", seq=1), _op("preempt", seq=0),
            _op("readmit", seq=0, num_new_tokens=2)], ["refcount-exact"], "refcount-exact"),
    "F10": ("legacy-v1", Config(block_size=4, num_blocks=8, sliding_window=8),
            [_admit(0, list(range(8)), 8), _op("fork", parent=0, child=1),
             *(_op("step", seq=0, num_new_tokens=1) for _ in range(9))], ["refcount-exact"], "refcount-exact"),
    "F11": ("legacy-v1", Config(block_size=1, num_blocks=1, num_cpu_blocks=1, sliding_window=1),
            [_admit(0, [0, 0], 2), _op("swap_out", seq=0)], [], "crash"),
    "F12": ("legacy-v2", Config(block_size=4, num_blocks=4, num_cpu_blocks=1, max_lookahead=3),
            [_admit(0, [0], 1), _op("step", seq=0, num_new_tokens=1), _op("swap_out", seq=0)],
            None, "admission-soundness"),
    "F13": ("legacy-v2", Config(block_size=8, num_blocks=5, num_cpu_blocks=1),
            [*(_admit(i, [0], 1) for i in range(5)), *(_op("free", seq=i) for i in range(4)),
             _op("swap_out", seq=4), _op("free", seq=4), _admit(5, [0], 1), _op("swap_out", seq=5)], [], "crash"),
}
META = {"vllm_version": "0.6.3"}
ALLOWED_IMPORTS = {"vllm", "pytest", "__future__", "typing"}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[Reproducer, Path]]:
    folder = tmp_path_factory.mktemp("straight")
    out = {}
    for name, (impl, config, trace, focus, _) in FINDINGS.items():
        made = generate(impl, config, trace, [], {**META, "focus": focus})
        assert isinstance(made, Reproducer), f"{name}: {made}"
        path = folder / f"test_{name}.py"
        path.write_text(made.text)
        out[name] = (made, path)
    return out


@pytest.fixture(scope="module")
def pytest_output(written) -> str:
    folder = next(iter(written.values()))[1].parent
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "--rootdir", str(folder), str(folder)],
        capture_output=True, text=True, cwd=folder, timeout=600, check=False,
        env={**os.environ, "COLUMNS": "400"},  # the short summary keeps each failure's first words
    )
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(FINDINGS))
def test_reproducer_fails_under_plain_pytest_naming_the_invariant(name, written, pytest_output):
    made, _ = written[name]
    named = FINDINGS[name][4]
    assert made.checks[0] == named
    assert f"FAILED test_{name}.py::test_{named.replace('-', '_')} - Failed: [{named}]" in pytest_output, pytest_output


@pytest.mark.parametrize("name", sorted(FINDINGS))
def test_reproducer_imports_only_vllm_pytest_and_the_standard_library(name, written):
    made, _ = written[name]
    tree = ast.parse(made.text)
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots <= ALLOWED_IMPORTS, roots


def test_the_seed_bug_reads_in_under_forty_lines(written):
    made, _ = written["F1"]
    assert len(made.text.splitlines()) < 40, made.text
    # the property at the failing call: allocate only where can_allocate says OK
    assert "if mgr.can_allocate(g0, num_lookahead_slots=0) == AllocStatus.OK:" in made.text
    assert "mgr.allocate(g0)" in made.text


def test_a_trace_the_target_does_not_violate_gets_no_file():
    impl, config, _, _, _ = FINDINGS["F1"]
    made = generate(impl, config, [_admit(0, [0], 1)], [], META)
    assert isinstance(made, NotReproducible) and "found no violation" in made.reason
