"""PR mode (``kvspec check ... --baseline BASE``) and ``kvspec bisect``.

PR mode answers the question a pull request's author asks: what does HEAD violate that BASE
does not?  It runs the same search (same flags, same seed) on HEAD and on BASE, each as its
own ``kvspec check`` process with its own report folder, then compares the distinct violations
by fingerprint (invariant, operation, crash site).  A search is a sample: a violation found
only on HEAD may simply have been missed on BASE.  So each HEAD-only violation is replayed on
BASE: it is a regression only if its trace holds there; if BASE violates it too, it was there
before.  Likewise BASE-only violations replayed on HEAD are what HEAD fixed.

``kvspec bisect REPORT --releases A..B`` replays a report on every provisioned release in the
range and prints the first release where it reproduces and the first later one where it no
longer does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from kvspec.targets.registry import TargetError, parse, release_key
from rich.markup import escape
from rich.table import Table

from .common import EXIT_FOUND, EXIT_OK, EXIT_USAGE, UsageError, out
from .target import provisioned_targets

# What a `kvspec replay` printed when the trace could not be applied as recorded.
DIVERGED = ("trace diverged", "nondeterministic")


@attrs.frozen
class Finding:
    """One distinct violation a run reported."""

    key: tuple[str, str, str, str]  # invariant, operation, exception, location
    report: Path

    def describe(self) -> str:
        invariant, operation, exception, location = self.key
        site = f" {exception} at {location}" if exception else ""
        return f"{invariant} in {operation}{site}"


def target_flags(spec: str) -> list[str]:
    """``--vllm X`` for a release version, ``--vllm-source PATH`` for a checkout."""
    try:
        parse(spec)
    except TargetError:
        path = Path(spec).expanduser()
        if not path.exists():
            raise UsageError(f"--baseline {spec}: neither a vLLM release nor a folder") from None
        return ["--vllm-source", str(path.resolve())]
    return ["--vllm", spec]


def without(argv: Sequence[str], *flags: str) -> list[str]:
    """``argv`` less each of ``flags`` and its value (``--flag V`` or ``--flag=V``)."""
    out_args: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out_args.append(a)
    return out_args


def findings(folder: Path) -> list[Finding]:
    """The distinct violations under a ``kvspec check --out`` folder (one report.json each)."""
    found: dict[tuple[str, str, str, str], Finding] = {}
    for path in sorted(folder.rglob("report.json")):
        report = json.loads(path.read_text())
        fp = report.get("fingerprint") or {}
        if fp:
            key = (fp.get("invariant", ""), fp.get("operation", ""), fp.get("exception", ""), fp.get("location", ""))
        else:
            violations = report.get("violations") or []
            trace = report.get("trace") or []
            invariant = violations[0]["invariant"] if violations else str(report.get("outcome"))
            key = (invariant, trace[-1]["op"] if trace else "", "", "")
        found.setdefault(key, Finding(key, path))
    return list(found.values())


def _kvspec(args: list[str], *, capture: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvspec.cli", *args], capture_output=capture, text=True, check=False
    )


def replays_on(report: Path, flags: list[str], *, unusable_ok: bool = False) -> str:
    """'reproduces', 'holds' or 'diverged' (or, with ``unusable_ok``, 'cannot run': the target
    lacks the report's manager or configuration): ``kvspec replay`` of ``report`` on a target."""
    proc = _kvspec(["replay", str(report), *flags], capture=True)
    text = proc.stdout + proc.stderr
    if proc.returncode == EXIT_OK:
        return "holds"
    if proc.returncode == EXIT_FOUND:
        return "diverged" if any(d in text for d in DIVERGED) else "reproduces"
    if unusable_ok and proc.returncode == EXIT_USAGE:
        return "cannot run"
    raise UsageError(f"kvspec replay {report} {' '.join(flags)} failed (exit {proc.returncode}):\n{text[-2000:]}")


def searched(side: str, proc: subprocess.CompletedProcess[str], folder: Path) -> None:
    """A side's search must have ended in a verdict: it held (exit 0), or it wrote reports."""
    if proc.returncode == EXIT_OK:
        return
    if proc.returncode == EXIT_FOUND and any(folder.rglob("report.json")):
        return
    raise UsageError(
        f"the {side} search ended without a verdict (exit {proc.returncode}, no report written)",
        "its output is above; PR mode compares only completed searches",
    )


def cmd_pr(args: argparse.Namespace, argv: list[str]) -> int:
    """``kvspec check <HEAD target> --baseline BASE [flags]``."""
    if not (args.vllm or args.vllm_source):
        raise UsageError("--baseline compares two targets", "name HEAD with --vllm-source PATH (or --vllm X)")
    base_flags = target_flags(args.baseline)
    head_flags = ["--vllm-source", args.vllm_source] if args.vllm_source else ["--vllm", args.vllm]
    common = without(argv, "--baseline", "--vllm", "--vllm-source", "--out", "--source-version", "--venv")
    if args.seed is None:
        common += ["--seed", "0"]  # one search path for both sides
    root = Path(args.out).expanduser().resolve() if args.out else Path(tempfile.mkdtemp(prefix="kvspec-pr-"))
    head_out, base_out = root / "head", root / "base"
    extra = []
    if args.source_version:
        extra += ["--source-version", args.source_version]
    if args.venv:
        extra += ["--venv", args.venv]
    root.mkdir(parents=True, exist_ok=True)
    out.rule(f"HEAD: {' '.join(head_flags)}")
    searched("HEAD", _kvspec([*common, *head_flags, *extra, "--out", str(head_out)]), head_out)
    out.rule(f"BASE: {' '.join(base_flags)}")
    # A checkout BASE runs like HEAD: in the same venv, as the same release.
    base_extra = extra if base_flags[0] == "--vllm-source" else []
    searched("BASE", _kvspec([*common, *base_flags, *base_extra, "--out", str(base_out)]), base_out)
    head, base = findings(head_out), findings(base_out)
    base_keys = {f.key for f in base}
    head_keys = {f.key for f in head}
    rows: list[tuple[str, Finding, str]] = []
    regressions = 0
    for f in head:
        if f.key in base_keys:
            rows.append(("on both", f, "-"))
            continue
        verdict = replays_on(f.report, [*base_flags, *base_extra])
        kind = {"holds": "REGRESSION", "diverged": "REGRESSION (BASE takes another path)"}.get(
            verdict, "on both (BASE's search missed it)"
        )
        regressions += kind.startswith("REGRESSION")
        rows.append((kind, f, f"BASE: {verdict}"))
    for f in base:
        if f.key in head_keys:
            continue
        verdict = replays_on(f.report, [*head_flags, *extra])
        kind = "fixed by HEAD" if verdict == "holds" else "on both (HEAD's search missed it)"
        rows.append((kind, f, f"HEAD: {verdict}"))
    table = Table(title="HEAD against BASE", title_justify="left")
    for column in ("verdict", "violation", "replayed", "report"):
        table.add_column(column, overflow="fold")
    for kind, f, replayed in rows:
        style = "bold red" if kind.startswith("REGRESSION") else "green" if kind.startswith("fixed") else ""
        shown = f"[{style}]{escape(kind)}[/]" if style else escape(kind)
        table.add_row(shown, escape(f.describe()), escape(replayed), escape(str(f.report)))
    out.print(table)
    summary = {
        "head": head_flags,
        "base": base_flags,
        "rows": [{"verdict": k, "violation": f.describe(), "replayed": r, "report": str(f.report)} for k, f, r in rows],
        "regressions": regressions,
    }
    (root / "pr.json").write_text(json.dumps(summary, indent=1))
    out.print(f"pr summary: {root / 'pr.json'}", markup=False, soft_wrap=True)
    if regressions:
        out.print(f"[bold red]HEAD regressed[/]: {regressions} violation(s) BASE does not have")
        return EXIT_FOUND
    out.print("[green]no regression[/]: HEAD violates nothing that BASE does not")
    return EXIT_OK


# ---------------------------------------------------------------- bisect


def releases_between(span: str) -> list[str]:
    lo, sep, hi = span.partition("..")
    if not sep:
        raise UsageError(f"--releases {span!r} is not A..B", "e.g. --releases 0.6.0..0.33.0")
    # release_key orders every release (0.6.3 < 0.6.3.post1 < 0.6.4): first bad is the first
    # release in that order that reproduces.
    first = release_key(lo) if lo else (0,)
    last = release_key(hi) if hi else (10**6,)
    chosen = sorted(
        {t.version for t in provisioned_targets() if first <= release_key(t.version) <= last}, key=release_key
    )
    if not chosen:
        raise UsageError(f"no provisioned release in {span}", "kvspec provision VERSION ... first")
    return chosen


def cmd_bisect(args: argparse.Namespace) -> int:
    report = Path(args.report)
    if not report.is_file():
        raise UsageError(f"{report}: no such report", "pass a report.json written by kvspec check")
    verdicts: list[tuple[str, str]] = []
    for version in releases_between(args.releases):
        out.print(f"replaying on vLLM {version} ...", markup=False)
        verdict = replays_on(report, ["--vllm", version], unusable_ok=True)
        if verdict == "cannot run" and json.loads(report.read_text()).get("impl") == "legacy-v2":
            # SelfAttnBlockSpaceManager is BlockSpaceManagerV2 renamed (0.6.3.post1 on).
            verdict = replays_on(report, ["--vllm", version, "--impl", "legacy-self-attn"], unusable_ok=True)
        verdicts.append((version, verdict))
    table = Table(title=f"{report} across releases", title_justify="left")
    table.add_column("release")
    table.add_column("verdict")
    for version, verdict in verdicts:
        table.add_row(version, verdict)
    out.print(table)
    first_bad = next((v for v, verdict in verdicts if verdict == "reproduces"), None)
    first_fixed = None
    if first_bad is not None:
        after = verdicts[[v for v, _ in verdicts].index(first_bad) + 1 :]
        first_fixed = next((v for v, verdict in after if verdict == "holds"), None)
    out.print(f"first bad: {first_bad or 'none of these'}", markup=False)
    out.print(f"first fixed: {first_fixed or 'none of these'}", markup=False)
    result: dict[str, Any] = {"verdicts": dict(verdicts), "first_bad": first_bad, "first_fixed": first_fixed}
    out.print(json.dumps(result), markup=False, soft_wrap=True)
    return EXIT_OK
