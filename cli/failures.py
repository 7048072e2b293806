"""How ``kvspec check`` and ``kvspec replay`` report a target that crashed, hung, ran away with
memory or behaved nondeterministically (the guard: ``kvspec.testing.guard``).

Outcomes besides ``violated``: ``error`` (the target raised under a valid protocol, or could not
be built or observed), ``hung``, ``memory`` and ``nondeterministic``; each exits 1, like a
violation, with the trace up to the operation and a report.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from hypothesis.errors import Flaky
from kvspec.spec.config import Config
from kvspec.testing.artifacts.rerun import Rerun, first_difference, name_nondeterminism
from kvspec.testing.blockmanager.driver import SpecViolation, TraceStep
from kvspec.testing.guard import (
    DEFAULT_MEMORY_CAP_GIB,
    DEFAULT_OP_TIMEOUT,
    Crash,
    Guard,
    GuardTripped,
    Limits,
    crash_traceback,
    raised_in_kvspec,
)
from kvspec.testing.known import CRASH, GoPast
from rich.markup import escape

from .common import EXIT_FOUND, EXIT_KVSPEC_ERROR, EXIT_OK, UsageError, out

KVSPEC_ERROR = "kvspec-error"  # kvspec's own code raised (testing/guard.py ``raised_in_kvspec``)
GUARD_OUTCOMES = ("error", KVSPEC_ERROR, "hung", "memory", "nondeterministic")
STOPPED_BY_TARGET = ("hung", "memory", "nondeterministic")  # the search cannot go on after these
HEADLINE = {
    "error": "the target crashed",
    KVSPEC_ERROR: "kvspec failed (not the target)",
    "hung": "the target hung",
    "memory": "the target exceeded its memory cap",
    "nondeterministic": "the target is nondeterministic",
}
TRACEBACK_LINES = 12  # of the target's traceback, printed (the report keeps them all)
REPORT_IT = "this is a bug in kvspec, please report it (with this output and the report folder)"


def add_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits (enforced in the target's process)")
    g.add_argument(
        "--op-timeout",
        type=float,
        metavar="SECONDS",
        help=f"longest one call into the target may run; 0 for no limit (default {DEFAULT_OP_TIMEOUT:g}; "
        "replay: the recorded run's)",
    )
    g.add_argument(
        "--memory-cap",
        type=float,
        metavar="GIB",
        help="most memory the run may add to the process, in GiB; 0 for no cap "
        f"(default {DEFAULT_MEMORY_CAP_GIB:g}; replay: the recorded run's)",
    )


def limits_from(args: argparse.Namespace, recorded: Mapping[str, Any] | None = None) -> Limits:
    """The flags, else the recorded run's limits (replay), else the defaults; 0 turns one off."""
    recorded = recorded or {}
    values: dict[str, float | None] = {}
    for flag, field, default in (
        ("op_timeout", "op_timeout", DEFAULT_OP_TIMEOUT),
        ("memory_cap", "memory_cap_gib", DEFAULT_MEMORY_CAP_GIB),
    ):
        given = getattr(args, flag, None)
        if given is not None and given < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0, got {given:g}", "0 turns the limit off")
        value = given if given is not None else recorded.get(field, default)
        values[field] = None if not value else float(value)
    return Limits(values["op_timeout"], values["memory_cap_gib"])


def guard_of(factory: Callable[[Config], Any]) -> Guard | None:
    return getattr(factory, "guard", None)


def guard_of_outcome(o: Any) -> str | None:
    """The implementation's own name, as the guard saw it built (None: never built)."""
    return getattr(o, "implementation_name", None)


# ------------------------------------------------------------------------------ filling an outcome


def fill_failure(
    outcome: Any, error: BaseException, factory: Callable[[Config], Any], go_past: GoPast | None = None
) -> None:
    """Complete an outcome that ended in ``error``: the message, the crash (call, exception,
    target file:line) and traceback, the trace and configuration a trip carries, and for a
    nondeterministic target the step it answered differently (re-running the trace, going past
    what ``go_past`` goes past, as the search did)."""
    guard = guard_of(factory)
    failure = guard.failure if guard is not None else None
    outcome.exception = error
    outcome.implementation_name = guard.implementation_name if guard is not None else None
    if isinstance(error, GuardTripped):
        outcome.error = error.message
        outcome.trace = list(error.trace) or list(outcome.trace)
        outcome.config = error.config or outcome.config
    elif isinstance(error, Flaky):
        outcome.error = f"{type(error).__name__}: {_first_line(error)}"
        inner = _inner(error)
        if isinstance(inner, SpecViolation):
            outcome.trace = list(inner.trace)
            outcome.violations = list(inner.violations)
        elif not outcome.trace:
            outcome.trace = list(outcome.tally.last_trace)
        outcome.config = outcome.config or outcome.tally.last_config
    else:
        outcome.error = f"{type(error).__name__}: {error}"
    if outcome.config is None and failure is not None:
        outcome.config = failure.config  # the constructor or the first observation failed
    crashed = outcome.trace[-1].crash if outcome.trace else None
    if crashed is not None:
        outcome.crash = crashed
    elif failure is not None and failure.error is error:
        outcome.crash = Crash.of(failure.call, error)
    elif not isinstance(error, Flaky):
        outcome.crash = Crash.of("?", error)
    cause = _inner(error) if isinstance(error, Flaky) else error
    if cause is not None and not isinstance(cause, SpecViolation):
        outcome.traceback = crash_traceback(cause, None if outcome.status == KVSPEC_ERROR else TRACEBACK_LINES)
    if isinstance(error, Flaky) and outcome.config is not None:
        focus = outcome.focus
        outcome.difference = name_nondeterminism(
            factory, outcome.config, outcome.trace, outcome.violations, focus=focus, go_past=go_past
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _inner(error: BaseException) -> BaseException | None:
    """The failure a Flaky error wraps (hypothesis keeps the first run's exceptions)."""
    for e in getattr(error, "exceptions", ()) or ():
        return e
    return error.__cause__ or error.__context__


# ------------------------------------------------------------------------------ printing


def print_failure(o: Any) -> None:
    """The headline of a crash, hang, memory runaway or nondeterminism, and what explains it."""
    where = f" ({escape(o.config.describe())})" if o.config is not None else ""
    _say(f"\n[bold red]{HEADLINE.get(o.status, o.status)}[/]{where}:")
    crash: Crash | None = getattr(o, "crash", None)
    if o.status == "nondeterministic":
        _say(f"  {escape(o.error or '')}")
        difference = getattr(o, "difference", None)
        if difference is not None:
            _say(f"  {escape(difference.describe())}")
        else:
            _say(
                "  re-running the trace gave the recorded answers every time: which operation differs is not known",
            )
        return
    if crash is not None:
        step = len(o.trace) if o.trace and o.trace[-1].crash is not None else 0
        at = f"step {step} ({crash.call})" if step else _outside(crash.call)
        _say(f"  in {at}: {escape(crash.describe())}")
    else:
        _say(f"  {escape(o.error or '')}")
    lines = getattr(o, "traceback", None) or []
    if o.status == KVSPEC_ERROR:
        print_kvspec_error(lines)
    elif lines and o.status == "error":
        shown = _whole_frames(lines[-TRACEBACK_LINES:])
        _say("  traceback (the target's innermost frames):", markup=False)
        for line in shown:
            _say(f"    {line}", markup=False)


def print_kvspec_error(lines: list[str]) -> None:
    """The whole traceback of an exception kvspec's own code raised, and whom to tell."""
    _say("  traceback (kvspec's own code raised it):", markup=False)
    for line in lines:
        _say(f"    {line}", markup=False)
    _say(f"  [bold]{REPORT_IT}[/]")


def _whole_frames(lines: list[str]) -> list[str]:
    """Lines cut from a traceback, starting at a frame's first line."""
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("File ")), 0)
    return lines[start:]


def _kind(crash: Crash) -> str:
    return {"TargetHung": "hang", "TargetExceededMemory": "memory runaway"}.get(crash.type, "crash")


def _say(text: str, **kw: Any) -> None:
    out.print(text, soft_wrap=True, **kw)  # long lines stay whole: logs and tests grep them


def _outside(call: str) -> str:
    return {"construct": "the constructor", "observe": "the first observation"}.get(call, call)


def failure_json(o: Any, limits: Limits | None) -> dict[str, Any]:
    """The report fields of a guard outcome (docs/report-format.md)."""
    crash: Crash | None = getattr(o, "crash", None)
    data: dict[str, Any] = {}
    if crash is not None:
        step = len(o.trace) if o.trace and o.trace[-1].crash is not None else 0
        data["crash"] = {**crash.to_json(), "step": step, "traceback": list(getattr(o, "traceback", []))}
    difference = getattr(o, "difference", None)
    if o.status == "nondeterministic":
        data["nondeterminism"] = difference.to_json() if difference is not None else None
    if limits is not None:
        data["limits"] = limits.to_json()
    return data


def recorded_crash(report: Mapping[str, Any], trace: Iterable[TraceStep]) -> tuple[int, Crash] | None:
    """The crash a report recorded: (its step, 0 for the constructor or first observation)."""
    steps = list(trace)
    if steps and steps[-1].crash is not None:
        return len(steps), steps[-1].crash
    data = report.get("crash")
    if isinstance(data, dict):
        return int(data.get("step") or 0), Crash.from_json(data)
    error = report.get("error")
    if report.get("outcome") == "error" and isinstance(error, str) and error:
        # A report from before crashes were recorded on their step: its trace ends with the
        # crashing operation recorded as answered (fork, free, ...) or stops just before it
        # (an admission or a step that raised); the error names the exception's type.
        kind, _, message = error.partition(": ")
        return len(steps), Crash("?", kind.strip(), message.strip(), "?")
    return None


def _same_crash(recorded: tuple[int, Crash], report: Mapping[str, Any], step: int, crash: Crash) -> bool:
    if recorded[1].type != crash.type:
        return False
    if recorded[1].location == "?" and "crash" not in report:  # an older report (above)
        return step in (recorded[0], recorded[0] + 1)
    return recorded[0] == step


# ------------------------------------------------------------------------------ same code?


def code_digest(vllm_path: Path | None, impl: str) -> dict[str, str]:
    """The implementation's name and SHA-256 over the Python sources a verdict depends on: the
    target's block managers (``vllm/core``, ``vllm/v1/core``; none for kvspec's own
    implementations) and kvspec's driver, spec, adapters and reference.  Equal digests: a
    replay runs the same code."""
    import kvspec.adapters
    import kvspec.reference
    import kvspec.spec
    import kvspec.testing

    roots = [Path(next(iter(m.__path__))) for m in (kvspec.spec, kvspec.testing, kvspec.adapters, kvspec.reference)]
    digest = {"impl": impl, "kvspec": _digest(roots)}
    if vllm_path is not None:
        digest["target"] = _digest([vllm_path / "core", vllm_path / "v1" / "core"])
    return digest


def _digest(roots: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.py")):
            h.update(f"{root.name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def same_code(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> bool | None:
    """Whether the replay runs the code the report was recorded on (None: cannot tell)."""
    was, got = recorded.get("code_digest"), now.get("code_digest")
    if not isinstance(was, dict) or not isinstance(got, dict):
        return None
    return was == got


# ------------------------------------------------------------------------------ replay verdicts


def _replayed_difference(report: Mapping[str, Any], result: Rerun, same: bool | None, unchanged: dict) -> int:
    """A replay of (or ending in) a policy difference of the scheduler machine: the target
    differs from its release's declared policy with every invariant holding, or no longer does."""
    recorded = (report.get("policy_difference") or {}).get("message")
    if result.difference is not None:
        again = recorded == str(result.difference)
        headline = "the recorded difference reproduces" if again else "the scheduler differs"
        _say(f"[bold red]{headline}[/]: {escape(str(result.difference))}")
        if recorded and not again:
            _say(f"  the report recorded: {escape(recorded)}")
        return EXIT_FOUND
    if same is not False:
        _say(
            f"[yellow]nondeterministic[/]: the recorded difference did not recur {unchanged[same]}: "
            + escape(recorded)
        )
        return EXIT_FOUND
    _say(f"[green]no difference[/]: the recorded one ({escape(recorded)}) does not occur on this code")
    return EXIT_OK


def replay_verdict(
    report: Mapping[str, Any],
    trace: list[TraceStep],
    result: Rerun,
    same: bool | None,
) -> int:
    """Print what a replay shows against its report; the exit code (docs/report-format.md)."""
    recorded = recorded_crash(report, trace)
    recorded_ids = {v["invariant"] for v in report.get("violations", [])}
    difference = first_difference(trace, result.trace)
    unchanged = {True: "on the same code", None: "on code whose identity the report does not record"}
    if result.gone_past:
        gone = ", ".join(f"{k} ({n} check{'s' if n != 1 else ''})" for k, n in result.gone_past.items())
        _say(
            f"went past known finding(s) {escape(gone)}: go_on findings of this target, not the "
            "report's own, as the search did (--no-known stops at them)"
        )
    if result.crash is not None and result.error is not None and raised_in_kvspec(result.error):
        step = result.crash_step or 0
        at = f"step {step} ({result.crash.call})" if step else _outside(result.crash.call)
        _say(f"[bold red]{HEADLINE[KVSPEC_ERROR]}[/] in {at}: {escape(result.crash.describe())}")
        print_kvspec_error(crash_traceback(result.error, None))
        return EXIT_KVSPEC_ERROR
    if result.crash is not None:
        step = result.crash_step or 0
        at = f"step {step} ({result.crash.call})" if step else _outside(result.crash.call)
        if recorded is not None and _same_crash(recorded, report, step, result.crash):
            moved = (
                f" (recorded at {recorded[1].location})"
                if recorded[1].location not in ("?", result.crash.location)
                else ""
            )
            _say(
                f"[bold red]the recorded {_kind(result.crash)} reproduces[/] in {at}: "
                f"{escape(result.crash.describe())}{escape(moved)}"
            )
        else:
            was = f"in step {recorded[0]}: {recorded[1].describe()}" if recorded else "no crash"
            _say(f"[bold red]the target crashed[/] in {at}: {escape(result.crash.describe())}")
            _say(f"  the report recorded {escape(was)}")
            if same is not False:
                _say(f"  [yellow]nondeterministic[/]: a different outcome {unchanged[same]}")
        if result.error is not None and result.crash.type not in ("TargetHung", "TargetExceededMemory"):
            _say("  traceback (the target's innermost frames):", markup=False)
            for line in _whole_frames(crash_traceback(result.error)[-TRACEBACK_LINES:]):
                _say(f"    {line}", markup=False)
        return EXIT_FOUND
    if result.unapplied is not None:
        said = f": {difference.describe()}" if difference is not None else ""
        if same is not False:
            _say(f"[yellow]nondeterministic[/]: the target answered differently {unchanged[same]}{escape(said)}")
        else:
            _say(f"[yellow]the trace diverged[/]{escape(said)}")
        _say(f"  {escape(result.unapplied)}; nothing is claimed either way")
        return EXIT_FOUND
    if recorded is not None:
        what = f"step {recorded[0]}: {recorded[1].describe()}" if recorded[0] else _outside(recorded[1].call)
        if same is not False:
            _say(
                f"[yellow]nondeterministic[/]: the recorded {_kind(recorded[1])} ({escape(what)}) did not recur "
                f"{unchanged[same]}" + (f"; {escape(difference.describe())}" if difference else "")
            )
            return EXIT_FOUND
        _say(f"the recorded {_kind(recorded[1])} ({escape(what)}) does not occur on this code")
    if result.difference is not None or (report.get("policy_difference") and not result.violations):
        return _replayed_difference(report, result, same, unchanged)
    found = result.violations
    if not found:
        if recorded_ids and same is True:
            _say(
                f"[yellow]nondeterministic[/]: the recorded {', '.join(sorted(recorded_ids))} did not "
                "recur on the same code" + (f"; {escape(difference.describe())}" if difference else "")
            )
            return EXIT_FOUND
        _say(
            "[green]no violation[/]: every invariant holds through the trace and after "
            "freeing every sequence"
            + (f" (the report recorded {', '.join(sorted(recorded_ids))})" if recorded_ids else "")
        )
        return EXIT_OK
    for v in found:
        _say(f"  [red]{escape(str(v))}[/]")
    found_ids = {v.invariant for v in found}
    # The report is about its fingerprint's invariant; the other invariants its operation broke
    # were verdicts of their own, or go_on findings the search went past (V1-e's usage figure on
    # 0.9.1-0.10.x), which a later release replaying the trace need not show.
    own = _own_invariant(report)
    wanted = {own} if own is not None else recorded_ids
    if wanted and wanted <= found_ids:
        extra = sorted(found_ids - recorded_ids)
        missing = sorted(recorded_ids - found_ids)
        _say(
            "the recorded violation reproduces"
            + (f" (and {', '.join(extra)})" if extra else "")
            + (f"; the report also recorded {', '.join(missing)}, not shown here" if missing else "")
        )
    else:
        _say(
            f"[yellow]violations differ[/] from the report's ({', '.join(sorted(wanted)) or 'none'}): "
            "another failure on this trace; the recorded one is not claimed"
        )
    return EXIT_FOUND


def _own_invariant(report: Mapping[str, Any]) -> str | None:
    """The invariant a report's verdict is about (its fingerprint's), when it records one."""
    fp = report.get("fingerprint") or (report.get("verdict") or {}).get("fingerprint")
    invariant = fp.get("invariant") if isinstance(fp, Mapping) else None
    return invariant if isinstance(invariant, str) and invariant != CRASH else None


__all__ = [
    "GUARD_OUTCOMES",
    "HEADLINE",
    "KVSPEC_ERROR",
    "STOPPED_BY_TARGET",
    "add_limit_args",
    "code_digest",
    "failure_json",
    "fill_failure",
    "guard_of",
    "guard_of_outcome",
    "limits_from",
    "print_failure",
    "recorded_crash",
    "replay_verdict",
    "same_code",
]
