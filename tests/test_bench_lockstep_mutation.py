"""The lockstep mutation oracle's pieces that need no vLLM: HEAD's overlay tree (only the
mutated module is a real file, its bytecode is not linked) and the reading of a verdict."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not installed

from bench.lockstep_mutation import classify, mutated_source, overlay, two_by_two


def _package(root: Path) -> Path:
    core = root / "vllm" / "v1" / "core"
    core.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "config").mkdir()
    (core / "pool.py").write_text("def f(n):\n    return n > 0\n")
    (core / "other.py").write_text("X = 1\n")
    (core / "__pycache__").mkdir()
    (core / "__pycache__" / "pool.cpython-311.pyc").write_bytes(b"")
    (core / "__pycache__" / "other.cpython-311.pyc").write_bytes(b"")
    return root


def test_the_overlay_links_everything_but_the_mutated_module(tmp_path):
    site = _package(tmp_path / "site")
    text = mutated_source(site, "vllm.v1.core.pool:5:ROR:0")
    assert "n > 0" not in text and text != (site / "vllm/v1/core/pool.py").read_text()
    head = tmp_path / "head"
    overlay(site / "vllm", head / "vllm", {Path("v1/core/pool.py"): text})
    core = head / "vllm" / "v1" / "core"
    assert not core.is_symlink() and not (head / "vllm" / "v1").is_symlink()
    assert not (core / "pool.py").is_symlink() and (core / "pool.py").read_text() == text
    assert (core / "other.py").is_symlink() and (head / "vllm" / "config").is_symlink()
    cache = core / "__pycache__"
    assert not cache.is_symlink() and [p.name for p in cache.iterdir()] == ["other.cpython-311.pyc"]
    assert (site / "vllm/v1/core/pool.py").read_text() == "def f(n):\n    return n > 0\n"


def test_a_verdict_is_read_from_its_exit_code_and_summary():
    assert classify(None, None) == "timeout"
    assert classify(2, {"regressions": 0}) == "crash"
    assert classify(0, None) == "crash"
    assert classify(1, {"regressions": 1, "changes": 3}) == "regression"
    assert classify(0, {"regressions": 0, "changes": 1}) == "change"
    assert classify(0, {"regressions": 0, "changes": 0}) == "nothing"
    assert classify(1, {"regressions": 0, "changes": 0}) == "crash"  # exit 1 with nothing found
    mutants = [{"key": "a", "vllm_tests": {"status": "killed"}}, {"key": "b", "vllm_tests": {"status": "survived"}}]
    rows = [{"key": "a", "status": "change"}, {"key": "b", "status": "timeout"}]
    assert two_by_two(rows, mutants) == {"lockstep detects, tests kill": 1, "lockstep timeout, tests miss": 1}
