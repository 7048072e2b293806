"""The lockstep PR verdict as the mutation bench's oracle.

Each mutant of a sampled mutation run (``mutation.json``) becomes HEAD of the real PR verdict
``kvspec check --vllm-source <tree> --source-version X --baseline X``, with its own release X
as BASE.  HEAD's tree is built cheaply: a folder whose ``vllm`` package mirrors the release's
installed package through symlinks, except the directories leading to the mutated module,
which are real, and the mutated module itself, written from the mutated AST
(``bench.mutants.mutate_tree``).  Symlinked sub-packages keep their byte-compiled caches; in
a folder holding a written module the cache is a real folder of links without that module's
bytecode.  The package's ``__init__.py`` is copied, so that the tree's ``vllm`` resolves to
the tree.

A mutant's outcome is read from the verdict's ``pr.json`` and exit code:

* ``regression``: HEAD violates what BASE does not (the lockstep, or the scheduler machine's
  verdict on HEAD that does not reproduce on BASE); exit 1;
* ``change``: no regression, at least one behaviour change;
* ``nothing``: both ran, no difference;
* ``timeout`` / ``crash``: no verdict (the run did not finish, or ended without ``pr.json``
  or with an exit code that is neither 0 nor 1).

One mutant at a time, each in its own process group, killed whole at its timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .mutants import mutate_tree

EXIT_OK, EXIT_FOUND = 0, 1
DETECTED = ("regression", "change")
DESCRIBE_CHARS = 110  # a mutant's description in the per-mutant table, cut with its code span closed
KVSPEC = Path(sys.executable).with_name("kvspec")


def parse_key(key: str) -> tuple[str, int, str, int]:
    """``module:site:op:variant`` (``Mutant.key``) split into its parts."""
    module, site, op, variant = key.split(":")
    return module, int(site), op, int(variant)


def mutated_source(site_packages: Path, key: str) -> str:
    """The mutant's module as source text: the release's module with the one mutation applied."""
    import ast

    module, site, op, variant = parse_key(key)
    source = (site_packages / (module.replace(".", "/") + ".py")).read_text()
    tree, _ = mutate_tree(source, module, site, op, variant)
    return ast.unparse(tree) + "\n"


def overlay(src: Path, dst: Path, replaced: dict[Path, str]) -> None:
    """``dst`` mirrors ``src``: every entry a symlink, except directories holding a replaced file
    (recreated, recursively) and the replaced files (written).  ``replaced`` maps paths relative
    to ``src`` to their new text."""
    dst.mkdir(parents=True, exist_ok=True)
    files = {p.parts[0]: t for p, t in replaced.items() if len(p.parts) == 1}
    dirs = {p.parts[0] for p in replaced if len(p.parts) > 1}
    for entry in src.iterdir():
        if entry.name in files:
            (dst / entry.name).write_text(files[entry.name])
        elif entry.name in dirs:
            inner = {Path(*p.parts[1:]): t for p, t in replaced.items() if p.parts[0] == entry.name}
            overlay(entry, dst / entry.name, inner)
        elif entry.name == "__pycache__" and files:
            # The other modules' bytecode stays linked; the replaced ones' is left out, and
            # whatever the interpreter writes lands here, never in the release's cache.
            stems = {Path(name).stem + "." for name in files}
            overlay(entry, dst / entry.name, {})
            for cached in (dst / entry.name).iterdir():
                if any(cached.name.startswith(stem) for stem in stems):
                    cached.unlink()
        else:
            (dst / entry.name).symlink_to(entry)


def mutant_tree(site_packages: Path, key: str, root: Path) -> Path:
    """A vLLM source tree (``root/vllm``) that is the release with the mutant applied."""
    module = parse_key(key)[0]
    rel = Path(*module.split(".")[1:]).with_suffix(".py")
    if root.exists():
        shutil.rmtree(root)
    # The package's __init__.py is a real file too: kvspec tells which vllm a process imports
    # by the resolved path of its origin (cli/target.py ``locate_vllm``).
    init = Path("__init__.py")
    replaced = {init: (site_packages / "vllm" / init).read_text(), rel: mutated_source(site_packages, key)}
    overlay(site_packages / "vllm", root / "vllm", replaced)
    return root


def impl_flags(impl: str) -> tuple[str, ...]:
    """The manager both sides run: V1's is a release's default wherever it ships, while a legacy
    release ships several managers, and the target's manager (whose modules the sample mutated)
    need not be the one the engine runs by default (cli/pr.py ``default_impl``): it is named."""
    return () if impl == "v1" else ("--impl", impl)


def verdict_command(tree: Path, version: str, out: Path, flags: Iterable[str] = ()) -> list[str]:
    return [str(KVSPEC), "check", "--vllm-source", str(tree), "--source-version", version,
            "--baseline", version, *flags, "--out", str(out)]


def classify(code: int | None, summary: dict[str, Any] | None) -> str:
    """The outcome of one PR verdict from its exit code (None: timed out) and ``pr.json``."""
    if code is None:
        return "timeout"
    if summary is None or code not in (EXIT_OK, EXIT_FOUND):
        return "crash"
    if summary.get("regressions", 0):
        return "regression"
    if summary.get("changes", 0):
        return "change"
    return "nothing" if code == EXIT_OK else "crash"


def _first(summary: dict[str, Any]) -> str:
    """The first verdict in one line: what differed (or which invariant), in which call."""
    scheduler_lockstep = summary.get("scheduler_lockstep", {}).get("verdicts", [])
    for half, entries in (("", summary.get("verdicts", [])), ("scheduler lockstep: ", scheduler_lockstep)):
        for entry in entries:
            differs = f"{entry.get('differs') or entry.get('field')} differs"
            # A behaviour change's violations (if any) are on both sides alike: what differs is its news.
            news = [] if entry["verdict"] == "behaviour change" else entry.get("head_violations", [])
            what = "; ".join(news[:1]) or differs
            return f"{half}{entry['verdict']}: {what} in {entry.get('operation')}"[:400]
    for entry in summary.get("scheduler", []):
        if entry.get("regression") or entry.get("change"):
            fp = entry.get("fingerprint", {})
            return f"scheduler: {fp.get('invariant')} in {fp.get('operation')} (BASE: {entry.get('base')})"[:400]
    return ""


def found_lines(log: str) -> list[str]:
    """The PR verdict's progress lines (cli/pr.py: ``  found: <verdict>``) in its log."""
    return [ln.strip().removeprefix("found: ") for ln in log.splitlines() if ln.startswith("  found: ")]


def run_one(site_packages: Path, key: str, version: str, work: Path, timeout: float,
            flags: Iterable[str] = ()) -> dict[str, Any]:
    """One mutant through the PR verdict; the row for the results file.  Its report folder and
    log stay in ``work`` under the mutant's key; HEAD's tree is rebuilt for each mutant."""
    tree = mutant_tree(site_packages, key, work / "tree")
    name = key.replace(":", "-")
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = verdict_command(tree, version, out, flags)
    log = work / f"{name}.log"
    start = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=work, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the verdict and both target processes
            proc.wait()
            code = None
    wall = time.monotonic() - start
    summary_path = out / "pr.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    row: dict[str, Any] = {"key": key, "status": classify(code, summary), "exit_code": code,
                           "wall": round(wall, 1), "loadavg": [round(x, 2) for x in os.getloadavg()]}
    if summary is not None:
        row.update({k: summary.get(k, 0) for k in ("examples", "operations", "regressions", "changes",
                                                   "scheduler_regressions", "scheduler_changes",
                                                   "scheduler_lockstep_regressions", "scheduler_lockstep_changes")})
        half = summary.get("scheduler_lockstep", {})
        row["scheduler_lockstep"] = {k: half.get(k) for k in ("status", "examples", "operations", "seconds")}
        row["first"] = _first(summary)
        row["imported"] = summary.get("imported", {})
    row["report"] = str(out)
    if row["status"] == "crash":
        row["tail"] = log.read_text(errors="replace").splitlines()[-8:]
    if row["status"] == "timeout":
        # What the lockstep had found before the limit (its progress lines), unshrunk and
        # unreported: evidence for the reader, never counted as a verdict.
        row["found_before_timeout"] = found_lines(log.read_text(errors="replace"))
    return row


def run_keys(site_packages: Path, keys: list[str], version: str, results: Path, work: Path,
             timeout: float, flags: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Each key in turn; each row appended to ``results`` (JSON lines) as soon as it is known.
    Keys already in ``results`` are not run again."""
    done = {json.loads(line)["key"] for line in results.read_text().splitlines() if line.strip()} \
        if results.is_file() else set()
    rows = []
    for n, key in enumerate(keys, 1):
        if key in done:
            continue
        row = run_one(site_packages, key, version, work, timeout, flags)
        row["command"] = " ".join(verdict_command(Path("<tree>"), version, Path("<out>"), flags))
        with open(results, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(f"[{n}/{len(keys)}] {key}: {row['status']} ({row['wall']} s) {row.get('first', '')}", flush=True)
        rows.append(row)
    return rows


def sampled(mutation_json: Path, target: str) -> list[dict[str, Any]]:
    """The mutants of ``target``'s ``kvspec check`` run in ``mutation.json``, those vLLM's own
    tests kill and the check does not first, then the ones both kill, then the rest (each
    group: covered by the check's baseline first, then source order)."""
    data = json.loads(mutation_json.read_text())
    (result,) = [r for r in data["results"]
                 if r["target"] == target and r.get("settings", {}).get("oracle") == "check"]
    mutants = result["mutants"]
    order = {id(m): (not tests_kill(m), check_kills(m), not m.get("covered"), n) for n, m in enumerate(mutants)}
    return sorted(mutants, key=lambda m: order[id(m)])


def check_kills(m: dict[str, Any]) -> bool:
    return m["status"] in ("killed", "timeout")


def tests_kill(m: dict[str, Any]) -> bool:
    return m.get("vllm_tests", {}).get("status") in ("killed", "timeout")


def measure(target: str, version: str | None, site_packages: Path, results_dir: Path, timeout: float,
            keys: list[str] | None = None, flags: Iterable[str] = ("--no-verify",)) -> list[dict[str, Any]]:
    """``python -m bench mutate --oracle lockstep``: the sampled mutants of ``target`` (or just
    ``keys``) through the PR verdict, into ``mutation-lockstep-<impl>.jsonl``."""
    if not version:
        raise SystemExit(f"{target}: the lockstep oracle needs a release (e.g. v1@0.33.0)")
    mutants = sampled(results_dir / "mutation.json", target)
    chosen = keys or [m["key"] for m in mutants]
    impl = target.split("@", 1)[0]
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvspec-lockstep-mut-{impl}"
    work.mkdir(parents=True, exist_ok=True)
    # First-verdict rows answer a narrower question than whole PR verdicts: a file of their own.
    first = "-first" if "--first-verdict" in flags else ""
    results = results_dir / f"mutation-lockstep-{impl}{first}.jsonl"
    rows = run_keys(site_packages, chosen, version, results, work, timeout, (*impl_flags(impl), *flags))
    print(render([json.loads(line) for line in results.read_text().splitlines() if line.strip()], mutants))
    return rows


def two_by_two(rows: list[dict[str, Any]], mutants: list[dict[str, Any]]) -> dict[str, int]:
    """Counts of measured mutants by (lockstep detects, vLLM's tests kill); a timed-out or
    crashed verdict is counted apart, never as a detection."""
    by_key = {m["key"]: m for m in mutants}
    out: dict[str, int] = {}
    for row in rows:
        m = by_key[row["key"]]
        if row["status"] in DETECTED:
            lock = "detects"
        elif row["status"] == "nothing":
            lock = "misses"
        else:
            lock = row["status"]
        cell = f"lockstep {lock}, tests {'kill' if tests_kill(m) else 'miss'}"
        out[cell] = out.get(cell, 0) + 1
    return out


def by_verdict(rows: list[dict[str, Any]], mutants: list[dict[str, Any]]) -> dict[str, int]:
    """Counts of measured mutants by (the PR verdict's outcome, vLLM's tests kill): regressions
    and behaviour changes apart."""
    by_key = {m["key"]: m for m in mutants}
    out: dict[str, int] = {}
    for row in rows:
        cell = f"{row['status']}, tests {'kill' if tests_kill(by_key[row['key']]) else 'miss'}"
        out[cell] = out.get(cell, 0) + 1
    return out


def found_by(row: dict[str, Any]) -> str:
    """Which part of the PR verdict reported the mutant: the block-manager lockstep (HEAD and
    BASE compared call by call), the scheduler lockstep (the same, over vLLM's own scheduler),
    or the scheduler machine's verdict on HEAD replayed on BASE."""
    scheduler = row.get("scheduler_regressions", 0) + row.get("scheduler_changes", 0)
    sched_lockstep = row.get("scheduler_lockstep_regressions", 0) + row.get("scheduler_lockstep_changes", 0)
    lockstep = row.get("regressions", 0) + row.get("changes", 0) - scheduler - sched_lockstep
    parts = (("block-manager lockstep", lockstep), ("scheduler lockstep", sched_lockstep),
             ("scheduler on HEAD", scheduler))
    return ", ".join(n for n, k in parts if k) or "-"


def render(rows: list[dict[str, Any]], mutants: list[dict[str, Any]]) -> str:
    """The measured mutants as Markdown: the 2x2 against vLLM's own tests (with the plain
    check's kills beside it), then one row per mutant."""
    by_key = {m["key"]: m for m in mutants}
    cells = two_by_two(rows, mutants)
    states = sorted({c.split(",")[0] for c in cells}, key=lambda s: (s != "lockstep detects", s))
    lines = ["| | vLLM's tests kill | vLLM's tests miss |", "|---|---|---|"]
    lines += [f"| {s} | {cells.get(s + ', tests kill', 0)} | {cells.get(s + ', tests miss', 0)} |" for s in states]
    kinds = by_verdict(rows, mutants)
    order = [s for s in (*DETECTED, "nothing", "timeout", "crash") if any(c.startswith(s + ",") for c in kinds)]
    lines += ["", "| PR verdict | vLLM's tests kill | vLLM's tests miss |", "|---|---|---|"]
    lines += [f"| {s} | {kinds.get(s + ', tests kill', 0)} | {kinds.get(s + ', tests miss', 0)} |" for s in order]
    lines += ["", "| mutant | PR verdict | found by | first verdict | `kvspec check` (sample run) | vLLM's tests "
              "| wall |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        m = by_key[row["key"]]
        shown = m["describe"].removeprefix("vllm.v1.core.").removeprefix("vllm.core.")
        if len(shown) > DESCRIBE_CHARS:
            shown = shown[:DESCRIBE_CHARS] + "..." + "`" * (shown[:DESCRIBE_CHARS].count("`") % 2)
        cols = [shown, row["status"], found_by(row),
                row.get("first", "")[:120], "killed" if check_kills(m) else "survived",
                "kill" if tests_kill(m) else "miss", f"{row['wall']:.0f} s"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines)
