"""Shared pieces: targets and where they run, machine runs, result files, BENCHMARKS.md.

A *target* is an implementation name plus, for vLLM, the release whose provisioned venv runs
it: ``reference``, ``v1@0.33.0``, ``legacy-v2@0.6.3``, ``broken:<variant>``.  Work that needs
vLLM runs in a subprocess with that venv's interpreter (``run_worker``); everything else runs
in the calling interpreter, which only needs kvspec.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
BENCHMARKS_MD = REPO / "BENCHMARKS.md"

# ---------------------------------------------------------------- which kvspec

def pin_kvspec_to_checkout() -> None:
    """Import kvspec from this checkout, whichever checkout the interpreter's venv has installed
    (targets/checkout_finder.py, loaded by path: kvspec itself may not be importable yet); the
    benchmark measures the code it is shipped with, and its worker processes inherit the pin."""
    import importlib.util

    if "kvspec" in sys.modules:
        return  # too late to redirect; kvspec is whatever was imported
    spec = importlib.util.spec_from_file_location("_kvspec_checkout", REPO / "targets" / "checkout_finder.py")
    assert spec is not None and spec.loader is not None
    finder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finder)
    os.environ[finder.ENV] = str(REPO)
    finder.install()


# ---------------------------------------------------------------- targets


def split_target(target: str) -> tuple[str, str | None]:
    """``"v1@0.33.0"`` -> ``("v1", "0.33.0")``; ``"reference"`` -> ``("reference", None)``."""
    impl, _, version = target.partition("@")
    return impl, (version or None)


def python_for(target: str) -> str:
    """The interpreter that runs ``target``: its vLLM venv, or this one (kvspec only)."""
    _, version = split_target(target)
    if version is None:
        return sys.executable
    from kvspec.targets.registry import target as registry_target
    from kvspec.testing.implementations import lookup

    t = registry_target(version, lookup(split_target(target)[0]).engine)
    if not t.is_provisioned():
        raise SystemExit(
            f"vLLM {version} is not provisioned: run `python -m kvspec.targets provision {version}`"
        )
    return str(t.python)


def factory(impl: str) -> Callable[[Any], Any]:
    """The implementation factory (Config -> Implementation) for an implementation name."""
    from kvspec.testing.implementations import UnknownImplementation, lookup

    try:
        return lookup(impl).factory
    except UnknownImplementation as error:
        raise SystemExit(str(error)) from None


def machine_options(workload: dict[str, Any]) -> dict[str, Any]:
    """KVCacheMachine keyword arguments a workload sets (``free_swapped``)."""
    return {k: workload[k] for k in ("free_swapped",) if k in workload}


def strategy(workload: dict[str, Any]):
    """The machine's config strategy for a workload description (plain JSON, so that it can
    cross into a worker process).

    window   "any" | "none" (full attention) | "only" (sliding window)
    caching  "any" | "on" | "off"
    swap, max_blocks, block_sizes, max_lookahead: as ``strategies.configs``.
    """
    from hypothesis import strategies as st
    from kvspec.testing.blockmanager.strategies import configs

    caching = workload.get("caching", "any")
    window = workload.get("window", "any")
    kwargs: dict[str, Any] = dict(
        max_blocks=workload.get("max_blocks", 32),
        swap=workload.get("swap", True),
        sliding_window=window != "none",
        prefix_caching=st.booleans() if caching == "any" else st.just(caching == "on"),
        max_lookahead=workload.get("max_lookahead", 3),
    )
    if "block_sizes" in workload:
        kwargs["block_sizes"] = st.sampled_from(workload["block_sizes"])
    strat = configs(**kwargs)
    if window == "only":
        strat = strat.filter(lambda c: c.sliding_window is not None)
    return strat


def hypothesis_settings(
    *, max_examples: int, steps: int = 40, derandomize: bool = True, **extra: Any
):
    """The ``ci`` profile (no explain phase, no deadline) with the bench's budget."""
    from hypothesis import settings
    from kvspec.testing import profiles  # noqa: F401  (registers the profiles)

    return settings(
        settings.get_profile("ci"),
        max_examples=max_examples,
        stateful_step_count=steps,
        derandomize=derandomize,
        database=None,
        report_multiple_bugs=False,
        print_blob=False,
        **extra,
    )


def run_machine(make_machine: Callable[[], Any], settings, seed: int | None = None) -> None:
    """``run_state_machine_as_test``, optionally under an explicit hypothesis seed."""
    from hypothesis import seed as hyp_seed
    from hypothesis.stateful import get_state_machine_test

    test = get_state_machine_test(make_machine, settings=settings)
    if seed is not None:
        test = hyp_seed(seed)(test)
    test()


# ---------------------------------------------------------------- workers


def run_worker(
    target: str, task: str, params: dict[str, Any], *, timeout: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run ``bench.worker.<task>(params)`` in the target's interpreter; return its JSON."""
    python = python_for(target)
    with tempfile.TemporaryDirectory(prefix="kvspec-bench-") as tmp:
        out = Path(tmp) / "out.json"
        errlog = Path(tmp) / "stderr.log"
        cmd = [python, "-m", "bench", "_worker", task, json.dumps({**params, "target": target}),
               str(out)]
        log(f"  [{target}] {task} ...")
        with open(errlog, "w") as err:
            proc = subprocess.run(cmd, cwd=REPO, stdout=err, stderr=subprocess.STDOUT,
                                  timeout=timeout, env=_worker_env())
        if proc.returncode != 0 or not out.exists():
            tail = errlog.read_text(errors="replace").splitlines()[-30:]
            raise RuntimeError(f"worker {task} on {target} failed ({proc.returncode}):\n"
                               + "\n".join(tail))
        return json.loads(out.read_text())


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # Quiet vLLM's import-time chatter; one thread each: the machine is shared (2 cores).
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("CI", None)
    return env


# ---------------------------------------------------------------- the machine and results


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
        if dirty:
            commit += " + uncommitted changes"  # other work in progress in the tree
    except OSError:
        commit = ""
    return {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory": mem,
        "gpu": "none",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": commit,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def header(command: str, info: dict[str, Any], seconds: float | None = None) -> str:
    load_end = info.get("loadavg_end") or [round(x, 2) for x in os.getloadavg()]
    took = f", took {seconds:.0f} s" if seconds is not None else ""
    return (
        f"Command: `{command}`  \n"
        f"Machine: {info['nproc']} cores ({info['cpu'] or 'unknown CPU'}), {info['memory']}, "
        f"no GPU; Python {info['python']}; {info['date']}; commit {info['commit']}{took}; "
        f"load average {info['loadavg'][0]} at start, {load_end[0]} at end "
        "(the 2 cores are shared with other jobs: timings are indicative)."
    )


def save_result(name: str, data: dict[str, Any], results_dir: Path | None = None) -> Path:
    directory = results_dir or RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    if "machine" in data:
        data["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    path = directory / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def write_section(name: str, body: str, md: Path | None = None) -> None:
    """Replace the generated section ``name`` of BENCHMARKS.md (or append it)."""
    path = md or BENCHMARKS_MD
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _m: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def table(headers: Iterable[str], rows: Iterable[Iterable[Any]]) -> str:
    headers = list(headers)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value >= 100:
            return f"{value:.0f}"
        if value >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"
    return str(value).replace("|", "\\|")


def command_line() -> str:
    return "python -m bench " + " ".join(sys.argv[1:])


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
