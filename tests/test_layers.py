"""Imports flow one way: spec <- reference/adapters/targets <- testing <- proofs <- cli; only
adapters import vllm."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYER = {
    "spec": 0,
    "reference": 1,
    "adapters": 1,
    "targets": 1,
    "testing": 2,
    "proofs": 3,
    "cli": 4,
}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("package", sorted(LAYER))
def test_imports_flow_one_way(package):
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "vllm":
                assert package == "adapters", f"{path}: only adapters/ may import vllm"
            if parts[0] == "kvspec" and len(parts) > 1 and parts[1] in LAYER:
                dep = parts[1]
                assert dep == package or LAYER[dep] < LAYER[package], (
                    f"{path} (layer {package}) imports kvspec.{dep}"
                )
                if LAYER[dep] == LAYER[package] and dep != package:
                    pytest.fail(f"{path}: sibling layers must not import each other ({dep})")
