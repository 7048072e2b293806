"""What the default ``kvspec check --vllm X --seed S`` says, release by release and seed by seed.

A newcomer's first run is the default command on the release they ship; this records, for a
grid of releases and seeds, its exit code, wall time, and every verdict line it printed (the
invariant table's VIOLATED rows, each violation's heading and known-finding label, the scheduler
part's status, policy differences, kvspec errors), so that BENCHMARKS.md shows what each default
run ends in and FINDINGS.md can triage every verdict.  Each run writes its reports under the
results folder, so a verdict in the table can be replayed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import RESULTS, command_line, header, machine_info, save_result, table, write_section

# Lines of `kvspec check`'s output that carry a verdict (rich's table rows included).
VERDICT = re.compile(
    r"VIOLATED|violation \d+ of|verdict \d+ of|known finding|crash|kvspec error|differs from|"
    r"every applicable invariant|every invariant holds|nothing ran|not run|exit",
    re.I,
)
KEEP_LINES = 40


def verdict_lines(stdout: str) -> list[str]:
    """The lines of one run's output that say what it found, in order, without box drawing."""
    found: list[str] = []
    for raw in stdout.splitlines():
        line = re.sub(r"[\u2500-\u257f]+", " ", raw).strip()
        line = re.sub(r"\s{2,}", "  ", line)
        if line and VERDICT.search(line) and line not in found:
            found.append(line)
    return found[:KEEP_LINES]


def run_one(version: str, seed: int, out: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvspec.cli", "check", "--vllm", version, "--seed", str(seed), "--out", str(out)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        code, stdout = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code = None
        stdout = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
    seconds = time.monotonic() - start
    (out.parent / f"{out.name}.log").write_text(stdout)
    return {
        "release": version,
        "seed": seed,
        "exit": code,
        "seconds": round(seconds, 1),
        "verdicts": verdict_lines(stdout),
        "log": str(out.parent / f"{out.name}.log"),
    }


def cmd_verdicts(
    *, releases: list[str], seeds: list[int], timeout: float, results: str | None, md: str | None
) -> None:
    """The default ``kvspec check --vllm X --seed S`` for every release and seed, each under
    ``timeout`` seconds: exit code, time and every verdict line."""
    info = machine_info()
    results_dir = Path(results) if results else RESULTS
    runs_dir = results_dir / "verdict-runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    start = time.monotonic()
    for version in releases:
        for seed in seeds:
            row = run_one(version, seed, runs_dir / f"{version}-seed{seed}", timeout)
            print(f"{version} seed {seed}: exit {row['exit']} in {row['seconds']} s", flush=True)
            for line in row["verdicts"]:
                print(f"    {line}", flush=True)
            rows.append(row)
    data = {"machine": info, "command": command_line(), "runs": rows}
    save_result("verdicts", data, results_dir)
    body = header(command_line(), info, time.monotonic() - start) + "\n\n" + table(
        ("release", "seed", "exit", "s", "verdict lines (kvspec check's own words)"),
        ([r["release"], r["seed"], r["exit"], r["seconds"], "<br>".join(r["verdicts"])] for r in rows),
    )
    write_section("verdicts", body, Path(md) if md else None)
