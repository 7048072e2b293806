"""``python -m bench <command>`` from the repository root (see bench/__init__.py); the command
line is cli/bench.py's."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from kvspec.cli.bench import parse_bench


def _worker(task: str, params: str, out: str) -> None:
    if task.startswith("mutation-"):
        from .mutation_worker import worker_main

        worker_main(task, params, out)
    else:
        from .worker import main as worker_main

        worker_main(task, params, out)


def _mutate(**options: Any) -> Any:
    from .mutation import MutateOptions, cmd_mutate

    return cmd_mutate(MutateOptions(**options))


def _lean_trace(*, lean_command: str, **options: Any) -> int:
    from .lean_trace import report, run

    if lean_command == "run":
        return run(options["out"], [c for c in options["cmd"] if c != "--"])
    return report(options["venv"].expanduser().resolve(), options["traces"])


def _command(name: str) -> Callable[..., Any]:
    """The function that runs subcommand ``name`` (imported only when it is the one run)."""
    if name == "_worker":
        return _worker
    if name == "mutate":
        return _mutate
    if name == "lean-trace":
        return _lean_trace
    module, function = {
        "throughput": ("commands", "cmd_throughput"),
        "ttc": ("commands", "cmd_ttc"),
        "scale": ("commands", "cmd_scale"),
        "render": ("commands", "cmd_render"),
        "proofs": ("proofcost", "cmd_proofs"),
        "crosshair": ("crosshair", "cmd_crosshair"),
        "verdicts": ("verdicts", "cmd_verdicts"),
        "reproducers": ("reproducers", "cmd_reproducers"),
        "checktime": ("checktime", "cmd_checktime"),
    }[name]
    return getattr(__import__(f"bench.{module}", fromlist=[function]), function)


def main(argv: list[str] | None = None) -> int:
    from .common import pin_kvspec_to_checkout

    pin_kvspec_to_checkout()
    name, options = parse_bench(argv)
    result = _command(name)(**options)
    # lean-trace's functions return an exit code; the others their results (or nothing).
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
