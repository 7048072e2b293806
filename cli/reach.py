"""``kvspec check --coverage``: what of the target's block-management code the run executed.

The measurement starts in the process that drives the target, before vLLM is imported
(``start``), and ends after the scheduler shapes (``report``): a per-file table of lines and
branches executed, the functions never entered, the HTML map and ``coverage.json`` in the run's
report folder, and the JSON the run's ``summary.json`` carries.  In PR mode the run is also
told the BASE's package folder and says which of the lines HEAD changed ran.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvspec.testing.reach import (
    Measurement,
    Reach,
    ReachUnavailable,
    analyse,
    block_management_files,
    measured_patterns,
)
from rich.markup import escape
from rich.table import Table

from .common import UsageError, out
from .target import VllmHere, current_engine

NEVER_ENTERED_SHOWN = 12  # functions named per file in the terminal; the JSON has all


def start(here: VllmHere, folder: Path) -> Measurement:
    """Start measuring this process (and its Python children) before vLLM is imported."""
    try:
        return Measurement(measured_patterns(here.path), folder).start()
    except ReachUnavailable as error:
        raise UsageError(
            f"--coverage: {error} in the target's interpreter",
            "kvspec provision the release again (coverage is one of kvspec's requirements)",
        ) from None


def report(
    measurement: Measurement, here: VllmHere, impl: str, out_dir: Path, args: argparse.Namespace
) -> Reach:
    """Combine, print the per-file table, write the HTML map beside the run's reports."""
    cov = measurement.finish()
    engine = current_engine(impl) or "v1"
    against = getattr(args, "coverage_against", None)
    reach = analyse(
        cov,
        block_management_files(here.path, engine),
        here.path,
        out_dir,
        compared=Path(against) if against else None,
    )
    measurement.discard()  # the combined data is in coverage.json and the HTML map now
    print_reach(reach, here, compared=against)
    return reach


def print_reach(reach: Reach, here: VllmHere, *, compared: str | None = None) -> None:
    table = Table(title=f"Coverage of vLLM {here.version}'s block-management code", title_justify="left")
    table.add_column("file", no_wrap=True)
    table.add_column("lines", justify="right")
    table.add_column("%", justify="right")
    table.add_column("branches", justify="right")
    table.add_column("%", justify="right")
    table.add_column("functions never entered", justify="right")
    for f in reach.files:
        if not f.imported:
            table.add_row(escape(f.name), f"0/{f.statements}", "0", "-", "-", f"{f.functions}/{f.functions}")
            continue
        table.add_row(
            escape(f.name),
            f"{f.executed}/{f.statements}",
            f"{f.line_percent:.0f}",
            f"{f.branches_taken}/{f.branches}",
            f"{f.branch_percent:.0f}",
            f"{len(f.never_entered)}/{f.functions}",
        )
    lines, statements, taken, branches = reach.totals()
    table.add_row(
        "all",
        f"{lines}/{statements}",
        f"{100 * lines / max(statements, 1):.0f}",
        f"{taken}/{branches}",
        f"{100 * taken / max(branches, 1):.0f}",
        str(sum(len(f.never_entered) for f in reach.files)),
    )
    out.print(table)
    for f in reach.files:
        if f.never_entered:
            shown = ", ".join(f.never_entered[:NEVER_ENTERED_SHOWN])
            more = len(f.never_entered) - NEVER_ENTERED_SHOWN
            tail = f" (+{more} more in coverage.json / summary.json)" if more > 0 else ""
            out.print(f"  never entered in {f.name}: {shown}{tail}", markup=False, soft_wrap=True)
    if compared is not None:
        changed = sum(len(f.changed) for f in reach.files)
        ran = sum(len(f.changed_executed) for f in reach.files)
        out.print(
            f"lines the change makes to the block-management code (against {compared}): "
            f"{ran} of {changed} executable changed lines executed",
            markup=False,
            soft_wrap=True,
        )
        for f in reach.files:
            missed = sorted(set(f.changed) - set(f.changed_executed))
            if missed:
                out.print(f"  changed and never executed in {f.name}: lines {_spans(missed)}", markup=False)
    if reach.html is not None:
        out.print(f"coverage map: {reach.html / 'index.html'}", markup=False, soft_wrap=True)


def _spans(lines: list[int]) -> str:
    """``1-3, 7`` for [1, 2, 3, 7]."""
    spans: list[str] = []
    start = prev = lines[0]
    for n in [*lines[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        spans.append(f"{start}-{prev}" if prev != start else str(start))
        if n is not None:
            start = prev = n
    return ", ".join(spans)


__all__ = ["print_reach", "report", "start"]
