"""Reach: which lines, branches and functions of the target's block-management code a run
executed.

coverage.py measures the process that drives the target, with branch coverage, restricted to
the block-management files of the engine (``BLOCK_MANAGEMENT``).  It is started before vLLM is
imported, so a module's top-level lines (imports, ``def`` and ``class`` statements) count as
executed as they are in production.  Any Python child process the run starts in the same
interpreter's venv is measured too (coverage's ``patch = subprocess``: the child reads the
configuration from ``COVERAGE_PROCESS_CONFIG`` at start-up and writes its own data file, which
``Measurement.finish`` combines).

A function is *never entered* when no line of its body executed (the body's lines are read with
``ast``; a nested function's lines count for the function around it too, since running them
means the outer one ran).  ``changed_lines`` gives the lines of a file that differ from another
version of it (``difflib``), so a run can say whether the lines a pull request changed ran.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

# The block-management code of each engine generation, relative to the ``vllm`` package folder.
# V1: the block pool and its free queue and hashing (kv_cache_utils), the single-type managers,
# the manager, the coordinator, and the scheduler whose KV paths drive them.
V1_FILES = (
    "v1/core/block_pool.py",
    "v1/core/kv_cache_utils.py",
    "v1/core/single_type_kv_cache_manager.py",
    "v1/core/kv_cache_manager.py",
    "v1/core/kv_cache_coordinator.py",
    "v1/core/sched/scheduler.py",
)
LEGACY_FOLDER = "core"  # vllm/core: the block managers, allocators, evictors and the scheduler
REACH_ENV = "COVERAGE_PROCESS_CONFIG"  # coverage's variable that makes child processes measure
JSON_NAME = "coverage.json"
HTML_FOLDER = "coverage-html"


class ReachUnavailable(Exception):
    """coverage.py is not importable in the interpreter that drives the target."""


def block_management_files(vllm_root: Path, engine: str) -> list[Path]:
    """The files whose reach a run of ``engine`` ("v1" or "legacy") reports, that exist under
    ``vllm_root`` (the ``vllm`` package folder)."""
    if engine == "legacy":
        return sorted(p for p in (vllm_root / LEGACY_FOLDER).rglob("*.py") if p.name != "__init__.py")
    return [vllm_root / rel for rel in V1_FILES if (vllm_root / rel).is_file()]


def measured_patterns(vllm_root: Path) -> list[str]:
    """coverage ``include`` patterns for every engine's block-management files (the engine is
    chosen after measuring starts: choosing it imports vLLM)."""
    root = vllm_root.resolve()
    return [str(root / rel) for rel in V1_FILES] + [str(root / LEGACY_FOLDER / "*")]


# ------------------------------------------------------------------------------ measuring


class Measurement:
    """One coverage.py measurement of this process (and its Python children) into ``folder``."""

    def __init__(self, patterns: Sequence[str], folder: Path | None = None) -> None:
        try:
            import coverage
        except ImportError as error:
            raise ReachUnavailable(f"coverage.py is not importable: {error}") from None
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="kvspec-reach-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rc = self.folder / "coveragerc"
        include = "".join(f"\n    {p}" for p in patterns)
        # A config file, not keyword arguments: coverage's subprocess patch hands the child the
        # serialized configuration, and needs one to serialize.
        self.rc.write_text(
            "[run]\nbranch = True\nparallel = True\n"
            f"data_file = {self.folder / '.coverage'}\n"
            f"include ={include}\npatch = subprocess\n"
        )
        self._env_before = os.environ.get(REACH_ENV)
        self.cov = coverage.Coverage(config_file=str(self.rc))
        self._stopped = False

    def start(self) -> Measurement:
        self.cov.start()
        return self

    def stop(self) -> None:
        """Stop measuring and save this process's data; children started later are not measured."""
        if self._stopped:
            return
        self._stopped = True
        self.cov.stop()
        self.cov.save()
        if self._env_before is None:
            os.environ.pop(REACH_ENV, None)
        else:
            os.environ[REACH_ENV] = self._env_before

    def finish(self) -> Any:
        """Stop, combine this process's data with its children's; the combined ``Coverage``."""
        import coverage

        self.stop()
        combined = coverage.Coverage(config_file=str(self.rc))
        combined.combine([str(self.folder)], keep=False)
        combined.save()
        return combined

    def discard(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def measuring(patterns: Sequence[str], folder: Path | None = None) -> Iterator[Measurement]:
    """Measure the block of code; the measurement is stopped (not combined) on the way out."""
    m = Measurement(patterns, folder).start()
    try:
        yield m
    finally:
        m.stop()


# ------------------------------------------------------------------------------ functions


@attrs.frozen
class Function:
    """A function or method of a source file: its qualified name and the lines of its body."""

    name: str
    line: int  # the ``def`` line
    body: tuple[int, int]  # first and last line of the body (inclusive)

    def entered(self, executed: set[int]) -> bool:
        first, last = self.body
        return any(first <= n <= last for n in executed)


def functions(source: str) -> list[Function]:
    """Every function and method of ``source``, qualified by its classes and outer functions
    (``typing.overload`` stubs left out)."""
    found: list[Function] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                if any(_names_overload(d) for d in child.decorator_list):
                    continue  # a typing stub: its body never runs by design
                name = f"{prefix}{child.name}"
                end = child.end_lineno or child.body[-1].lineno
                found.append(Function(name, child.lineno, (child.body[0].lineno, end)))
                walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return found


def _names_overload(decorator: ast.expr) -> bool:
    return (isinstance(decorator, ast.Name) and decorator.id == "overload") or (
        isinstance(decorator, ast.Attribute) and decorator.attr == "overload"
    )


def changed_lines(new: str, old: str) -> set[int]:
    """The lines of ``new`` (1-based) that are not in ``old``: replaced or inserted."""
    matcher = difflib.SequenceMatcher(a=old.splitlines(), b=new.splitlines(), autojunk=False)
    changed: set[int] = set()
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag in ("replace", "insert"):
            changed.update(range(j1 + 1, j2 + 1))
    return changed


# ------------------------------------------------------------------------------ results


@attrs.frozen
class FileReach:
    """What a run executed of one file."""

    name: str  # relative to the reported root, e.g. v1/core/block_pool.py
    path: str
    imported: bool
    statements: int
    executed: int
    branches: int
    branches_taken: int
    functions: int
    never_entered: tuple[str, ...]  # "name:line" of each function no line of whose body ran
    changed: tuple[int, ...] = ()  # executable lines the compared version does not have
    changed_executed: tuple[int, ...] = ()

    @property
    def line_percent(self) -> float:
        return 100.0 * self.executed / self.statements if self.statements else 100.0

    @property
    def branch_percent(self) -> float:
        return 100.0 * self.branches_taken / self.branches if self.branches else 100.0

    def to_json(self) -> dict[str, Any]:
        return {
            **attrs.asdict(self),
            "never_entered": list(self.never_entered),
            "changed": list(self.changed),
            "changed_executed": list(self.changed_executed),
            "line_percent": round(self.line_percent, 1),
            "branch_percent": round(self.branch_percent, 1),
        }


@attrs.frozen
class Reach:
    """A run's reach over a set of files, with the HTML map and coverage JSON written."""

    files: tuple[FileReach, ...]
    html: Path | None
    data: Path | None

    def totals(self) -> tuple[int, int, int, int]:
        """Statements executed and total, branches taken and total, over every file."""
        return (
            sum(f.executed for f in self.files),
            sum(f.statements for f in self.files),
            sum(f.branches_taken for f in self.files),
            sum(f.branches for f in self.files),
        )

    def to_json(self) -> dict[str, Any]:
        lines, statements, taken, branches = self.totals()
        return {
            "files": [f.to_json() for f in self.files],
            "lines_executed": lines,
            "lines": statements,
            "branches_taken": taken,
            "branches": branches,
            "html": str(self.html) if self.html else None,
            "data": str(self.data) if self.data else None,
        }


def analyse(
    cov: Any,
    files: Iterable[Path],
    root: Path,
    out_dir: Path,
    *,
    compared: Path | None = None,
) -> Reach:
    """The reach of ``files`` (relative names from ``root``) in the combined measurement
    ``cov``; writes ``coverage.json`` and the HTML map into ``out_dir``.  With ``compared``
    (another version's package folder), each file's changed executable lines and which ran."""
    files = [Path(f).resolve() for f in files]
    out_dir.mkdir(parents=True, exist_ok=True)
    measured = {str(Path(f).resolve()) for f in cov.get_data().measured_files()}
    shown = [str(f) for f in files if str(f) in measured]
    data_path: Path | None = None
    html: Path | None = None
    per_file: dict[str, dict[str, Any]] = {}
    if shown:
        data_path = out_dir / JSON_NAME
        cov.json_report(morfs=shown, outfile=str(data_path))
        per_file = {str(Path(k).resolve()): v for k, v in json.loads(data_path.read_text())["files"].items()}
        html = out_dir / HTML_FOLDER
        cov.html_report(morfs=shown, directory=str(html), title="kvspec check: the target's block-management code")
    results = []
    for f in files:
        source = f.read_text(encoding="utf-8")
        entry = per_file.get(str(f))
        if entry is None:  # never imported: every statement missed
            _, statements, _, _, _ = cov.analysis2(str(f))
            summary = {"num_statements": len(statements), "covered_lines": 0, "num_branches": 0,
                       "covered_branches": 0}
            executed: set[int] = set()
            executable = set(statements)
        else:
            summary = entry["summary"]
            executed = set(entry["executed_lines"])
            executable = executed | set(entry["missing_lines"])
        funcs = functions(source)
        changed: set[int] = set()
        if compared is not None:
            other = compared / f.relative_to(root)
            old = other.read_text(encoding="utf-8") if other.is_file() else ""
            changed = changed_lines(source, old) & executable
        results.append(
            FileReach(
                name=str(f.relative_to(root)),
                path=str(f),
                imported=entry is not None,
                statements=int(summary["num_statements"]),
                executed=int(summary["covered_lines"]),
                branches=int(summary.get("num_branches", 0)),
                branches_taken=int(summary.get("covered_branches", 0)),
                functions=len(funcs),
                never_entered=tuple(f"{fn.name}:{fn.line}" for fn in funcs if not fn.entered(executed)),
                changed=tuple(sorted(changed)),
                changed_executed=tuple(sorted(changed & executed)),
            )
        )
    return Reach(tuple(results), html, data_path)


__all__ = [
    "HTML_FOLDER",
    "JSON_NAME",
    "V1_FILES",
    "FileReach",
    "Function",
    "Measurement",
    "Reach",
    "ReachUnavailable",
    "analyse",
    "block_management_files",
    "changed_lines",
    "functions",
    "measured_patterns",
    "measuring",
]
