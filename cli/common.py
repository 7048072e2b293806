"""What every subcommand shares: the consoles, the bad-input error, output capture."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from kvspec.testing.artifacts.timeline import Film

# Results go to stdout; progress, notes and errors to stderr, so `kvspec ... > out` keeps the
# results clean.  Width is fixed when not on a terminal so that captured output (tests, CI
# logs, a README) does not wrap at 80 columns.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 110)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 110)

EXIT_OK = 0
EXIT_FOUND = 1
EXIT_USAGE = 2
EXIT_KVSPEC_ERROR = 3  # kvspec's own code raised (testing/guard.py ``raised_in_kvspec``): a bug of kvspec


class UsageError(Exception):
    """Bad input: one line saying what is wrong, one line saying what to do.  Exit code 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def fail_usage(error: UsageError) -> int:
    err.print(f"[bold red]kvspec: error:[/] {error.message}", markup=True, soft_wrap=True)
    if error.hint:
        err.print(f"[dim]hint:[/] {error.hint}", markup=True, soft_wrap=True)
    return EXIT_USAGE


def first_lines(text: str, n: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    shown = lines[:n]
    if len(lines) > n:
        shown.append(f"... ({len(lines) - n} more lines)")
    return "\n".join(shown)


@contextlib.contextmanager
def captured_fds() -> Iterator[list[str]]:
    """Capture what is written to file descriptors 1 and 2 (vLLM's import-time logging and
    warnings go straight to the process's stdout/stderr).  The text is appended to the list
    on exit, for showing when something went wrong."""
    sink: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        try:
            os.dup2(tmp.fileno(), 1)
            os.dup2(tmp.fileno(), 2)
            yield sink
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            tmp.seek(0)
            sink.append(tmp.read().decode("utf-8", "replace"))


def write_picture(out_dir: Path, report: Mapping[str, Any], shoot: Callable[[], Film], setting: str) -> None:
    """The block-table timeline (timeline.svg) and the one-file report.html beside report.json:
    ``shoot`` replays the report's trace into a film (testing/artifacts/timeline.py), ``setting`` names
    the configuration or shape in the picture's title.  The picture is a courtesy: when it
    cannot be drawn the report stands without it, and the reason is printed."""
    try:
        from kvspec.testing.artifacts.report import write_atomic
        from kvspec.testing.artifacts.timeline import report_html, timeline_svg
    except ImportError as error:  # a target venv provisioned before drawsvg was a dependency
        out.print(f"[yellow]no timeline picture[/]: {escape(str(error))} (run `kvspec provision` again)")
        return
    try:
        with captured_fds():
            shot = shoot()
        svg = timeline_svg(shot, setting)
    except Exception as error:
        out.print(f"[yellow]no timeline picture[/]: {escape(f'{type(error).__name__}: {error}')}")
        return
    write_atomic(out_dir / "timeline.svg", svg)
    page = write_atomic(out_dir / "report.html", report_html(report, svg))
    out.print(f"picture: {page}", markup=False, soft_wrap=True)
