"""The wall time of one verdict: the default ``kvspec check --vllm X --seed S`` beside vLLM's own
block-management test files, in one run, alternating, each ``--repeats`` times.

* *check*: ``python -m kvspec.cli check --vllm X --seed S --out TMP`` from this (core)
  interpreter, as a user types ``kvspec check`` (the re-execution in the release's venv included),
  at the default search effort (no --examples, the dev profile).
* *vLLM's tests*: ``python -m pytest`` on bench/vllm_tests.py ``SUITES[X]`` from the release's
  sdist (fetched once, bench/vllm_tests.py), in the release's venv, offline, without the tests
  that fail on the unmodified release here (a model download or a GPU: the list the mutation
  benchmark's clean run recorded, bench/results/mutation.json), as the mutation benchmark runs them.
* *with --planted*: a check that finds something: the same command on a copy of the release's
  ``vllm/`` with an abort that leaks its blocks planted in the V1 scheduler (the planted bug of
  tests/targets/test_scheduler_planted.py), with the reproducer verified in a forked child (the
  default) and, for comparison, in a fresh interpreter (``KVSPEC_VERIFY_NO_FORK=1``).

Every run is a subprocess timed from outside (``time.perf_counter``), user+system CPU of its
process tree from ``os.wait4``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvspec.testing.planted import LEAK

from .common import REPO, RESULTS, command_line, header, machine_info, python_for, save_result, table, write_section

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _timed(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``cmd``; its wall seconds, the CPU seconds of its process tree, exit code and tail."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _pid, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            raise
        wall = time.perf_counter() - start
        log.seek(0)
        text = log.read().decode("utf-8", "replace")
    del timeout  # the commands bound themselves (the guard's limits, pytest's tests)
    code = os.waitstatus_to_exitcode(status)
    return {"wall": round(wall, 2), "cpu": round(usage.ru_utime + usage.ru_stime, 2), "exit": code,
            "tail": text.strip().splitlines()[-4:]}


def _deselected(release: str) -> list[str]:
    """The tests the mutation benchmark's clean run saw fail on the unmodified release here."""
    path = RESULTS / "mutation.json"
    if not path.exists():
        return []
    for result in json.loads(path.read_text()).get("results", []):
        if str(result.get("target", "")).endswith(f"@{release}"):
            return [d["test"] for d in (result.get("vllm_tests") or {}).get("deselected", [])]
    return []


def _planted_copy(python: str, where: Path) -> Path:
    """A copy of the release's ``vllm/`` (compiled extensions and caches left out) with the leak
    planted, byte-compiled once so that every run reads bytecode."""
    found = subprocess.run([python, "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
                           capture_output=True, text=True, check=True, env={**os.environ, **OFFLINE})
    source = Path(found.stdout.strip().splitlines()[-1])
    shutil.copytree(source, where / "vllm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    path = where / "vllm" / LEAK.file
    try:
        path.write_text(LEAK.plant(path.read_text()))
    except ValueError as error:
        raise SystemExit(f"{path}: {error}") from None
    subprocess.run([python, "-m", "compileall", "-q", str(where / "vllm")], check=False,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    return where


def cmd_checktime(*, release: str, seed: int, repeats: int, planted: bool, timeout: float,
                  results: str | None, md: str | None) -> dict[str, Any]:
    from . import vllm_tests

    info = machine_info()
    began = time.perf_counter()
    python = python_for(f"v1@{release}")
    root = vllm_tests.tests_root(release)
    files = vllm_tests.SUITES[release]
    deselect = _deselected(release)
    env = {**os.environ, "KVSPEC_CHECKOUT": str(REPO)}
    env.pop("CI", None)  # the default check: the dev profile
    env.pop("KVSPEC_VERIFY_NO_FORK", None)
    tests_env = {**env, **OFFLINE, "PYTHONPATH": str(root / "deps")}
    tests_cmd = [python, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                 "-W", "ignore::DeprecationWarning", *[f"--deselect={d}" for d in deselect]]
    work = Path(tempfile.mkdtemp(prefix="kvspec-checktime-"))
    copy = _planted_copy(python, work / "planted") if planted else None
    rows: list[dict[str, Any]] = []
    data: dict[str, Any] = {}
    try:
        for n in range(repeats):
            out = work / f"check-{n}"
            check_cmd = [sys.executable, "-m", "kvspec.cli", "check", "--vllm", release, "--seed", str(seed),
                         "--out", str(out)]
            runs = [("check", check_cmd, REPO, env), ("vllm-tests", tests_cmd, root, tests_env)]
            if copy is not None:
                planted_cmd = [sys.executable, "-m", "kvspec.cli", "check", "--vllm-source", str(copy),
                               "--source-version", release, "--seed", str(seed)]
                runs.append(("planted", [*planted_cmd, "--out", str(work / f"planted-{n}")], REPO, env))
                runs.append(("planted-no-fork", [*planted_cmd, "--out", str(work / f"planted-nofork-{n}")], REPO,
                             {**env, "KVSPEC_VERIFY_NO_FORK": "1"}))
            for name, cmd, cwd, run_env in runs:
                row = {"run": name, "repeat": n, "load": round(os.getloadavg()[0], 2),
                       **_timed(cmd, cwd=cwd, env=run_env, timeout=timeout)}
                if name.startswith("planted"):
                    row["reproducers"] = _reproducers(Path(cmd[-1]))
                shown = f"{row['wall']} s wall, {row['cpu']} s CPU, exit {row['exit']}"
                print(f"[{n + 1}/{repeats}] {name}: {shown}", flush=True)
                rows.append(row)
                # Saved after every run: a long run cut short still leaves what it measured.
                data = {"machine": info, "command": command_line(), "release": release, "seed": seed,
                        "repeats": repeats, "tests": {"files": files, "deselected": len(deselect)},
                        "rows": rows, "seconds": time.perf_counter() - began}
                save_result("checktime", data, Path(results) if results else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_section("checktime", render_checktime(data, data["seconds"]), Path(md) if md else None)
    return data


def _reproducers(out: Path) -> list[str]:
    """The reproducer status of every report the run wrote."""
    found = []
    for path in sorted(out.rglob("report.json")):
        report = json.loads(path.read_text())
        found.append((report.get("reproducer") or {}).get("status", "none"))
    return found


def render_checktime(data: dict[str, Any], seconds: float | None = None) -> str:
    release, seed = data["release"], data["seed"]
    body = [header(data["command"], data["machine"], seconds), ""]
    body.append(
        f"*check*: `kvspec check --vllm {release} --seed {seed}` (default effort, dev profile) from the core "
        f"venv, its re-execution in the release's venv included. *vllm-tests*: `python -m pytest` on "
        f"{', '.join(data['tests']['files'])} from the release's sdist in its venv, offline, "
        f"{data['tests']['deselected']} tests deselected (they fail here: a model download or a GPU; the "
        "mutation benchmark's list). *planted*: the check of a copy of the release's `vllm/` with an abort "
        "that leaks (tests/targets/test_scheduler_planted.py), reproducers verified in a forked child; "
        "*planted-no-fork*: the same with `KVSPEC_VERIFY_NO_FORK=1` (a fresh interpreter per reproducer). "
        "Alternating, in one run; CPU = user+system of the process tree."
    )
    body.append("")
    by: dict[str, list[dict[str, Any]]] = {}
    for row in data["rows"]:
        by.setdefault(row["run"], []).append(row)
    lines = []
    for name, rows in by.items():
        walls = [r["wall"] for r in rows]
        cpus = [r["cpu"] for r in rows]
        extra = ""
        if name.startswith("planted"):
            extra = "; ".join(",".join(r.get("reproducers", [])) or "-" for r in rows)
        lines.append([name, len(rows), " / ".join(f"{w:.1f}" for w in walls), statistics.median(walls),
                      " / ".join(f"{c:.1f}" for c in cpus), statistics.median(cpus),
                      ",".join(str(r["exit"]) for r in rows), extra])
    body.append(table(["run", "repeats", "wall s (each)", "wall s (median)", "CPU s (each)", "CPU s (median)",
                       "exit", "reproducers"], lines))
    return "\n".join(body)
