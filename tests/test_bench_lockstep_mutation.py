"""The lockstep mutation oracle's pieces that need no vLLM: HEAD's overlay tree (only the
mutated module is a real file, its bytecode is not linked) and the reading of a verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is not installed

import bench.lockstep_mutation as lockstep
from bench.lockstep_mutation import by_verdict, classify, mutant_tree, mutated_source, overlay, render, two_by_two


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


def _legacy_package(root: Path) -> Path:
    block = root / "vllm" / "core" / "block"
    block.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("__version__ = '0.6.3'\n")
    (block / "common.py").write_text("def f(n):\n    return n > 1\n")
    (root / "vllm" / "core" / "block_manager_v2.py").write_text("Y = 2\n")
    return root


def test_a_legacy_mutant_tree_mutates_its_module_under_vllm_core(tmp_path):
    site = _legacy_package(tmp_path / "site")
    tree = mutant_tree(site, "vllm.core.block.common:5:ROR:0", tmp_path / "tree")
    common = tree / "vllm" / "core" / "block" / "common.py"
    assert not common.is_symlink() and "n > 1" not in common.read_text()
    assert not (tree / "vllm" / "__init__.py").is_symlink()  # so that the tree's vllm resolves to the tree
    assert (tree / "vllm" / "core" / "block_manager_v2.py").is_symlink()


def test_a_legacy_target_runs_the_pr_verdict_on_its_own_manager(tmp_path, monkeypatch):
    """A legacy release ships several managers and runs the first by default, so the verdict
    names the target's; a V1 target's command is the release default's."""
    results = tmp_path / "results"
    results.mkdir()
    mutant = {"key": "vllm.core.block.common:5:CRP:0", "status": "survived", "covered": True,
              "describe": "vllm.core.block.common:2 CRP: `1` -> `2`", "vllm_tests": {"status": "killed"}}
    runs = [{"target": t, "settings": {"oracle": "check"}, "mutants": [mutant]}
            for t in ("legacy-v2@0.6.3", "v1@0.33.0")]
    (results / "mutation.json").write_text(json.dumps({"results": runs}))
    seen: dict[str, list[str]] = {}

    def fake_run_keys(site, keys, version, out, work, timeout, flags):
        seen[version] = lockstep.verdict_command(Path("<tree>"), version, Path("<out>"), flags)
        out.touch()
        return []

    monkeypatch.setattr(lockstep, "run_keys", fake_run_keys)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    lockstep.measure("legacy-v2@0.6.3", "0.6.3", tmp_path, results, 300)
    lockstep.measure("v1@0.33.0", "0.33.0", tmp_path, results, 300)
    legacy = seen["0.6.3"]
    assert legacy[legacy.index("--impl") + 1] == "legacy-v2"
    assert legacy[legacy.index("--baseline") + 1] == "0.6.3" and "--no-verify" in legacy
    assert "--impl" not in seen["0.33.0"]


def test_regressions_and_changes_are_counted_apart_beside_the_tests():
    mutants = [{"key": k, "describe": f"vllm.core.block.common:{n} CRP", "status": "survived",
                "vllm_tests": {"status": t}} for n, (k, t) in enumerate((("a", "killed"), ("b", "killed"),
                                                                         ("c", "survived")))]
    rows = [{"key": "a", "status": "regression", "wall": 1.0}, {"key": "b", "status": "change", "wall": 1.0},
            {"key": "c", "status": "nothing", "wall": 1.0}]
    assert by_verdict(rows, mutants) == {"regression, tests kill": 1, "change, tests kill": 1, "nothing, tests miss": 1}
    text = render(rows, mutants)
    assert "| regression | 1 | 0 |" in text and "| change | 1 | 0 |" in text and "| nothing | 0 | 1 |" in text
    assert "| block.common:0 CRP |" in text  # the legacy package prefix is dropped like V1's


def test_a_behaviour_change_is_shown_by_what_differs_not_by_the_violations_both_sides_share():
    shared = ["[window-bound] seq 0 holds 2 blocks"]
    change = {"verdict": "behaviour change", "operation": "teardown", "differs": "free",
              "head_violations": shared, "base_violations": shared}
    regression = {"verdict": "regression", "operation": "swap_out", "head_violations": ["[crash] KeyError"]}
    assert lockstep._first({"verdicts": [change]}) == "behaviour change: free differs in teardown"
    assert lockstep._first({"verdicts": [regression]}) == "regression: [crash] KeyError in swap_out"


def test_a_timed_out_verdict_keeps_what_it_had_found():
    log = "starting both targets ...\n  found: regression: outcome differs at admit (operation 3)\nHEAD imported\n"
    assert lockstep.found_lines(log) == ["regression: outcome differs at admit (operation 3)"]
