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


def _runtime_nodes(tree: ast.AST):
    """Every node of the tree but those under ``if TYPE_CHECKING:`` (never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in (child, *_runtime_nodes(child)))
            continue
        yield node
        yield from _runtime_nodes(node)


def _module_graph(package: str) -> dict[str, set[str]]:
    """Which modules of one layer import which others of it (relative and absolute imports,
    at any depth in the file: an import inside a function still makes a run-time cycle)."""
    folder = ROOT / package
    names = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        deps: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:
                    deps.add(node.module.split(".")[0])
                elif node.level == 1:
                    deps.update(a.name for a in node.names)
                elif node.module and node.module.startswith(f"kvspec.{package}."):
                    deps.add(node.module.split(".")[2])
        graph[path.stem] = {d for d in deps if d in names and d != path.stem}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("package", sorted(LAYER))
def test_no_import_cycle_inside_a_layer(package):
    found = _cycle(_module_graph(package))
    assert found is None, f"{package}/ modules import each other: {' -> '.join(found)}"


def test_the_cycle_check_sees_a_cycle():
    assert _cycle({"invariants": {"tenancy"}, "tenancy": {"invariants"}}) == ["invariants", "tenancy", "invariants"]
    assert _cycle({"invariants": {"registry", "tenancy"}, "tenancy": {"registry"}, "registry": set()}) is None


def _argparse_imports(source: str) -> list[int]:
    """The lines of ``source`` that import argparse (``import argparse``, ``import argparse as
    a``, ``from argparse import ...``), at any depth."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "argparse":
            lines.append(node.lineno)
    return lines


def _modules_outside_cli() -> list[Path]:
    """Every .py of the repository but cli/'s, the tests' and those of hidden folders (.venv)."""
    tops = [p for p in ROOT.iterdir() if p.is_dir() and p.name not in ("cli", "tests") and not p.name.startswith(".")]
    return sorted([*ROOT.glob("*.py"), *(p for top in tops for p in top.rglob("*.py"))])


def test_only_cli_parses_command_lines():
    """Every command line is parsed in cli/ (``python -m bench``'s too: cli/bench.py); the
    modules below take typed parameters, never an argparse Namespace."""
    walked = _modules_outside_cli()
    testing = ROOT / "testing"
    walks = {ROOT / "bench" / "commands.py", ROOT / "proofs" / "core.py",
             testing / "blockmanager" / "driver.py", testing / "scheduler" / "driver.py"}
    assert walks <= set(walked)
    found = [f"{p.relative_to(ROOT)}:{line}" for p in walked for line in _argparse_imports(p.read_text())]
    assert found == [], f"argparse imported outside cli/: {found}"


@pytest.mark.parametrize(
    "source",
    ["import argparse\n", "import os, argparse as ap\n", "from argparse import Namespace\n",
     "def f():\n    import argparse\n"],
)
def test_the_argparse_check_sees_an_import(source):
    assert _argparse_imports(source) == [source.count("\n")]


def test_the_argparse_check_passes_other_imports():
    assert _argparse_imports("import argparsex\nfrom kvspec.cli import bench\n# import argparse\n") == []
