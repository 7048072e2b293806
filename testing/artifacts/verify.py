"""Plain pytest on one generated reproducer: does it fail on this target, naming its invariant?

A verdict's reproducer is kept only if plain pytest fails on it (``cli/check.py``
``keep_reproducer``).  Run as ``python -m pytest`` in a fresh interpreter, that costs vLLM's
import (several seconds, more under load) per verdict.  ``pytest_in_fork`` runs the same
``pytest.main`` in a child forked from the process that has already imported vLLM: the child
gets fresh standard streams on a file, its own process group, stdin from /dev/null, the default
signal handlers, and the run's limits (``testing/guard.py`` ``Limits``): an address-space limit
of the memory cap above what it inherited, and a parent that samples its resident memory and
its wall time and kills the group when either is exceeded.  The child leaves with ``os._exit``,
so none of the parent's exit handlers run twice.

``pytest_in_subprocess`` is the fresh interpreter; ``judge`` reads either run the same way.
A forked run that does not reproduce (it passed, was killed, timed out, or did not run
cleanly) may be an artefact of the fork (state the parent holds), so ``verify`` runs the file
again in a fresh interpreter before saying so.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
from kvspec.testing.guard import GIB, Limits, address_space_limit

VERIFY_TIMEOUT = 600.0  # seconds: a fresh interpreter imports vLLM and torch first
# A forked child has vLLM imported already: it gets the run's per-call time limit, at least this.
MIN_FORK_SECONDS = 30.0
POLL = 0.02  # seconds between two looks at the child
EXIT_CHILD_CRASHED = 70  # the child's own code (not pytest) raised: EX_SOFTWARE

EXITED = "exited"  # pytest ran to its end; ``exit_code`` is its exit code
HUNG = "hung"  # killed after ``timeout`` seconds
MEMORY = "memory"  # killed when it grew past the memory cap
KILLED = "killed"  # ended by a signal it was not sent by its parent


@attrs.frozen
class PytestRun:
    """How one pytest run of a reproducer ended, and what it printed."""

    status: str  # EXITED, HUNG, MEMORY or KILLED
    exit_code: int | None  # pytest's, when EXITED
    output: str
    seconds: float
    how: str  # "fork" or "subprocess"


def pytest_args(path: Path, rootdir: Path) -> list[str]:
    """What ``python -m pytest`` is given: quiet, no cache, the file's folder as the root."""
    return ["-q", "-p", "no:cacheprovider", "--rootdir", str(rootdir), str(path)]


def fork_timeout(limits: Limits) -> float:
    return VERIFY_TIMEOUT if limits.op_timeout is None else max(limits.op_timeout, MIN_FORK_SECONDS)


def can_fork() -> bool:
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def pytest_in_fork(
    path: Path,
    *,
    rootdir: Path,
    limits: Limits,
    timeout: float | None = None,
    child: Callable[[list[str]], int] | None = None,
) -> PytestRun:
    """Run ``pytest.main`` on ``path`` in a forked child under ``limits`` (module docstring).
    ``child``: what the child runs instead of ``pytest.main`` (tests give a hang or a runaway)."""
    limit = fork_timeout(limits) if timeout is None else timeout
    cap = limits.memory_cap_gib
    with tempfile.TemporaryFile(prefix="kvspec-verify-") as log:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(log.fileno(), rootdir, pytest_args(path, rootdir), cap, child)
        status, code = _supervise(pid, start, limit, cap)
        log.seek(0)
        output = log.read().decode("utf-8", "replace")
    return PytestRun(status, code, output, time.monotonic() - start, "fork")


def _child(fd: int, cwd: Path, args: list[str], cap: float | None, run: Callable[[list[str]], int] | None) -> None:
    code = EXIT_CHILD_CRASHED
    try:
        os.setpgid(0, 0)  # its own group: killing it kills whatever it started
        for sig in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, 0)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # Fresh stream objects: the parent's may have been locked by another thread at the fork.
        sys.stdout = open(1, "w", closefd=False, buffering=1, errors="backslashreplace")
        sys.stderr = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")
        sys.stdin = open(0, closefd=False)
        if cap is not None:
            want = address_space_limit(cap)
            if want is not None:
                with contextlib.suppress(ValueError, OSError):
                    resource.setrlimit(resource.RLIMIT_AS, (want, resource.getrlimit(resource.RLIMIT_AS)[1]))
        os.chdir(cwd)
        if run is None:
            import pytest

            code = int(pytest.main(args))
        else:
            code = int(run(args))
    except BaseException:  # whatever it is, the parent reads it from the log
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
        code = EXIT_CHILD_CRASHED
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _supervise(pid: int, start: float, limit: float, cap: float | None) -> tuple[str, int | None]:
    """Wait for the child; kill its group past ``limit`` seconds or ``cap`` GiB of growth."""
    baseline = _rss(pid)
    try:
        while True:
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                if os.WIFEXITED(wait_status):
                    return EXITED, os.WEXITSTATUS(wait_status)
                return KILLED, None
            if time.monotonic() - start > limit:
                _kill(pid)
                return HUNG, None
            if cap is not None and baseline is not None:
                rss = _rss(pid)
                if rss is not None and rss - baseline > cap * GIB:
                    _kill(pid)
                    return MEMORY, None
            time.sleep(POLL)
    except BaseException:
        _kill(pid)  # interrupted: the child does not outlive the check
        raise


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


def pytest_in_subprocess(path: Path, *, rootdir: Path, timeout: float = VERIFY_TIMEOUT) -> PytestRun:
    """``python -m pytest`` on ``path`` in a fresh interpreter (this one's, same environment)."""
    cmd = [sys.executable, "-m", "pytest", *pytest_args(path, rootdir)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=rootdir, check=False)
    except subprocess.TimeoutExpired as expired:
        text = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        return PytestRun(HUNG, None, text, time.monotonic() - start, "subprocess")
    if proc.returncode < 0:
        return PytestRun(KILLED, None, proc.stdout + proc.stderr, time.monotonic() - start, "subprocess")
    return PytestRun(EXITED, proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start, "subprocess")


REPRODUCES, PASSES, BROKEN, TIMEOUT = "reproduces", "passes", "broken", "timeout"


def judge(run: PytestRun, checks: Sequence[str]) -> tuple[str, str]:
    """The verdict of plain pytest semantics: it *reproduces* when pytest exits 1 and a failure
    names one of ``checks`` (``[invariant]`` as the reproducer's failure messages begin);
    *passes* when pytest exits 0; else *timeout* or *broken*, with what it printed."""
    if run.status == HUNG:
        return TIMEOUT, "timed out under pytest"
    if run.status == MEMORY:
        return BROKEN, "does not run cleanly: it exceeded the memory cap under pytest"
    if run.status == KILLED:
        return BROKEN, f"does not run cleanly: pytest was killed by a signal: {_first_lines(run.output, 4)}"
    named = [
        line.strip()
        for line in run.output.splitlines()
        if any(line.lstrip().startswith(f"[{c}]") or f"Failed: [{c}]" in line for c in checks)
    ]
    if run.exit_code == 1 and named:
        return REPRODUCES, named[0].split("Failed: ", 1)[-1]
    if run.exit_code == 0:
        return PASSES, "passes on this target (the standalone harness does not reach it)"
    return BROKEN, f"does not run cleanly (pytest exit {run.exit_code}): {_first_lines(run.output, 4)}"


def verify(path: Path, checks: Sequence[str], *, rootdir: Path, limits: Limits,
           fork: bool = True) -> tuple[str, str, list[PytestRun]]:
    """Judge ``path`` under plain pytest: in a forked child when this platform forks (and
    ``fork``), and again in a fresh interpreter unless the forked run reproduced: a fork can
    only save the fresh interpreter's time, never lose a reproducer.  The verdict, its detail,
    and every run made."""
    runs: list[PytestRun] = []
    if fork and can_fork():
        runs.append(pytest_in_fork(path, rootdir=rootdir, limits=limits))
        verdict, detail = judge(runs[-1], checks)
        if verdict == REPRODUCES:
            return verdict, detail, runs
    runs.append(pytest_in_subprocess(path, rootdir=rootdir))
    verdict, detail = judge(runs[-1], checks)
    return verdict, detail, runs


def _first_lines(text: str, n: int) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[:n] + ([f"... ({len(lines) - n} more lines)"] if len(lines) > n else []))


__all__ = [
    "BROKEN",
    "PASSES",
    "REPRODUCES",
    "TIMEOUT",
    "PytestRun",
    "judge",
    "pytest_in_fork",
    "pytest_in_subprocess",
    "verify",
]
