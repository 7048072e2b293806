"""The table ``kvspec prove`` prints."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence

import attrs
from rich.console import Console
from rich.table import Table

from .core import Result


def table(results: Sequence[Result], title: str) -> Table:
    t = Table(title=title, show_lines=True, expand=True)
    t.add_column("obligation", overflow="fold", min_width=30, max_width=44)
    t.add_column("serves", overflow="fold", max_width=24)
    t.add_column("bounds", overflow="fold", ratio=3)
    t.add_column("result", overflow="fold", ratio=7)
    t.add_column("expected", ratio=2)
    t.add_column("twin / non-vacuity", overflow="fold", ratio=4)
    t.add_column("s", justify="right", ratio=1)
    for r in results:
        mark = "[green]" if r.ok else "[bold red]"
        result = f"{mark}{r.outcome}[/]" + (f": {r.detail}" if r.detail else "")
        twin = r.twin if r.twin_ok else f"[bold red]{r.twin}[/]"
        t.add_row(r.obligation, ", ".join(r.serves), r.bounds, result, r.expected, twin, f"{r.seconds:.1f}")
    return t


def console() -> Console:
    # Wide even when piped (CI logs), so a model in plain numbers stays on few lines.
    width = max(shutil.get_terminal_size((200, 40)).columns, 160)
    return Console(width=width, highlight=False)


def summary(results: Sequence[Result]) -> str:
    bad = [r for r in results if not r.ok]
    total = sum(r.seconds for r in results)
    if not bad:
        return f"{len(results)} obligations, all as expected ({total:.0f}s)"
    names = ", ".join(r.obligation for r in bad)
    return f"{len(bad)} of {len(results)} obligations UNEXPECTED: {names} ({total:.0f}s)"


def to_json(results: Sequence[Result]) -> str:
    return json.dumps([attrs.asdict(r) | {"ok": r.ok} for r in results], indent=2, default=str)
