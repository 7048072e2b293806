"""Run the invoking checkout's kvspec inside a target venv, whichever checkout is installed there.

A target venv holds one editable install of kvspec, but several checkouts (git worktrees, a CI
clone, a PR branch of kvspec itself) drive the same provisioned release.  ``kvspec`` exports
``KVSPEC_CHECKOUT`` (its own source root) into the environment of every process it starts; this
module, copied into the target venv's site-packages with a ``.pth`` line that installs it, puts
a finder first on ``sys.meta_path`` that maps ``kvspec`` and ``kvspec.<layer>`` to that root's
folders (the layout of pyproject.toml's ``package-dir``).  Without the variable nothing changes.

It imports nothing of kvspec's: it runs at interpreter start, before kvspec can be found.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

ENV = "KVSPEC_CHECKOUT"
TOP = "kvspec"
# pyproject.toml [tool.setuptools.package-dir]: kvspec.<layer> lives in the root's <layer>/.
LAYERS = ("spec", "reference", "adapters", "targets", "testing", "proofs", "cli")


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``kvspec`` and its modules in one checkout's folders."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if parts[0] != TOP:
            return None
        if len(parts) > 1 and parts[1] in LAYERS:
            base, rest = self.root / parts[1], parts[2:]
        else:
            base, rest = self.root / TOP, parts[1:]
        if not rest:
            return _package(fullname, base)
        return _module(fullname, base.joinpath(*rest[:-1]), rest[-1])


def _package(fullname: str, folder: Path) -> importlib.machinery.ModuleSpec | None:
    init = folder / "__init__.py"
    if not init.is_file():
        return None
    return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(folder)])


def _module(fullname: str, folder: Path, leaf: str) -> importlib.machinery.ModuleSpec | None:
    found = _package(fullname, folder / leaf)
    if found is not None:
        return found
    module = folder / f"{leaf}.py"
    return importlib.util.spec_from_file_location(fullname, module) if module.is_file() else None


def install() -> None:
    root = os.environ.get(ENV)
    if not root or not (Path(root) / TOP / "__init__.py").is_file():
        return
    if not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder(Path(root)))
