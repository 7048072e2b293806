"""The JSON report of a ``kvspec check`` run that found a violation: building, writing, loading.

Pure helpers (no vLLM, no display).  The format is documented in docs/report-format.md; the
``format`` field names its version and ``load_report`` refuses any other.  A report carries
the trace exactly as the driver recorded it (``TraceStep.to_json``), so
``kvspec replay`` / ``kvspec.testing.blockmanager.driver.replay`` re-runs it against any implementation.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError
from kvspec.spec.invariants import INVARIANTS, Violation
from kvspec.testing.blockmanager.driver import TraceStep
from kvspec.testing.guard import Crash

FORMAT = "kvspec-report/1"


def config_to_json(config: Config) -> dict[str, Any]:
    return attrs.asdict(config)


def config_from_json(data: Mapping[str, Any]) -> Config:
    """The Config a report recorded; unknown or missing fields are a ConfigError."""
    names = {f.name for f in attrs.fields(Config)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"unknown configuration field(s) in report: {sorted(unknown)}")
    try:
        return Config(**dict(data))
    except TypeError as err:
        raise ConfigError(f"incomplete configuration in report: {err}") from err


def trace_from_json(items: Iterable[Mapping[str, Any]]) -> list[TraceStep]:
    return [
        TraceStep(
            str(s["op"]),
            dict(s.get("args", {})),
            str(s.get("outcome", "")),
            Crash.from_json(s["crash"]) if isinstance(s.get("crash"), dict) else None,
        )
        for s in items
    ]


def invariant_entry(inv_id: str) -> dict[str, Any]:
    inv = INVARIANTS[inv_id]
    return {
        "id": inv.id,
        "title": inv.title,
        "statement": inv.statement,
        "concerns": inv.concerns,
        "kind": inv.kind,
    }


def build_report(
    *,
    outcome: str,
    impl: str,
    implementation_name: str,
    target: Mapping[str, Any],
    config: Config | None,
    run: Mapping[str, Any],
    trace: Sequence[TraceStep],
    violations: Sequence[Violation] = (),
    error: str | None = None,
    reproducer: Mapping[str, Any] | None = None,
    command: Sequence[str] = (),
) -> dict[str, Any]:
    """The report as a JSON-ready dict (see docs/report-format.md for every field)."""
    violated = list(dict.fromkeys(v.invariant for v in violations))
    return {
        "format": FORMAT,
        "outcome": outcome,
        "command": list(command),
        "impl": impl,
        "implementation_name": implementation_name,
        "target": dict(target),
        "config": config_to_json(config) if config is not None else None,
        "run": dict(run),
        "violations": [v.to_json() for v in violations],
        "invariants": {i: invariant_entry(i) for i in violated if i in INVARIANTS},
        "error": error,
        "trace": [s.to_json() for s in trace],
        "trace_text": [f"{i}. {s.describe()}" for i, s in enumerate(trace, 1)],
        "reproducer": dict(reproducer) if reproducer is not None else None,
    }


def write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder, then rename:
    a reader (or an interrupted run) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a report is for sharing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_report(path: Path, report: Mapping[str, Any]) -> Path:
    return write_atomic(path, json.dumps(report, indent=2, sort_keys=False) + "\n")


class ReportError(ValueError):
    """A file that is not a kvspec report (or not this format version)."""


def load_report(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ReportError(f"no such report: {path}") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReportError(f"{path} is not a JSON report: {err}") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ReportError(f"{path} is not a {FORMAT} report (format: {got!r})")
    for field in ("impl", "config", "trace"):
        if field not in data:
            raise ReportError(f"{path}: the report has no {field!r} field")
    # A scheduler verdict (``machine`` "scheduler") records the scheduler's shape instead.
    setting = "shape" if data.get("machine") == "scheduler" else "config"
    if data.get(setting) is None:
        raise ReportError(f"{path}: the report records no {'shape' if setting == 'shape' else 'configuration'}")
    return data
