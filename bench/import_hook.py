"""The import hook mutation runs load vLLM's modules through: each mutated (or served)
module comes from a copy of its source, optionally with one mutation applied, so that every
importer binds that code (a ``sys.meta_path`` finder)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from typing import Any

from .mutants import mutate_tree


class _Loader(importlib.abc.Loader):
    def __init__(self, path: str, mutation: dict[str, Any] | None) -> None:
        self.path = path
        self.mutation = mutation

    def create_module(self, spec):  # default module creation
        return None

    def exec_module(self, module) -> None:
        source = Path(self.path).read_text()
        if self.mutation is None:
            code = compile(source, self.path, "exec")
        else:
            m = self.mutation
            tree, _ = mutate_tree(source, m["module"], m["site"], m["op"], m["variant"])
            code = compile(tree, self.path, "exec")
        module.__file__ = self.path
        exec(code, module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the target modules from the temporary copies (one of them mutated)."""

    def __init__(self, paths: dict[str, str], mutation: dict[str, Any] | None = None) -> None:
        self.paths = paths
        self.mutation = mutation

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.paths:
            return None
        mutation = self.mutation if (self.mutation or {}).get("module") == fullname else None
        return importlib.machinery.ModuleSpec(
            fullname, _Loader(self.paths[fullname], mutation), origin=self.paths[fullname]
        )


def install(paths: dict[str, str], mutation: dict[str, Any] | None = None) -> None:
    loaded = [m for m in paths if m in sys.modules]
    if loaded:
        raise RuntimeError(f"mutated modules already imported before the hook: {loaded}")
    sys.meta_path.insert(0, _Finder(paths, mutation))


def check_loaded(paths: dict[str, str]) -> None:
    for name, path in paths.items():
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None) != path:
            raise RuntimeError(f"{name} was imported from {mod.__file__}, not the copy {path}")
