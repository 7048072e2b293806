"""vLLM's own unit tests of a release, run on the same mutants as the oracle.

The tests come from the release's source distribution on PyPI (it carries ``tests/``), fetched
at bench time into ``$KVSPEC_HOME/vllm-tests/<version>/tests`` (default ``~/.cache/kvspec``)
and never copied into this repository.  ``pip download --no-binary :all:`` cannot build vLLM's
metadata without torch, but it unpacks the sdist before failing; with ``--no-clean`` and a
private ``TMPDIR`` the unpacked tree is found there (../shared/notes/vllm-sources-and-tests.md).

Worker side, ``run(...)`` runs ``pytest.main`` on the chosen files in the current (forked)
interpreter, which already has the mutation's import hook installed, and records every test's
outcome with a small plugin.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from pytest import hookimpl as pytest_hookimpl
except ImportError:  # the core venv without pytest: only the fetch side is used there
    def pytest_hookimpl(**_kw):
        return lambda f: f

# The unit tests of the modules under mutation, per release (paths inside the sdist).
SUITES: dict[str, list[str]] = {
    "0.33.0": [
        "tests/v1/core/test_prefix_caching.py",
        "tests/v1/core/test_kv_cache_utils.py",
        "tests/v1/core/test_single_type_kv_cache_manager.py",
    ],
    "0.6.3": [
        "tests/core/block/test_block_manager_v2.py",
        "tests/core/block/test_block_table.py",
        "tests/core/block/test_common.py",
        "tests/core/block/test_cpu_gpu_block_allocator.py",
        "tests/core/block/test_naive_block.py",
        "tests/core/block/test_prefix_caching_block.py",
    ],
}

# Test-only requirements of a release's tests/conftest.py that its venv lacks: installed with
# ``pip install --target`` beside the tests (the provisioned venv is not touched).
TEST_DEPS: dict[str, list[str]] = {"0.33.0": ["tblib"], "0.6.3": []}
# coverage.py (Apache-2.0) for the per-test line coverage of the clean run: its C tracer costs
# a fraction of a Python ``sys.settrace`` hook on code as hot as the block pool.
COVERAGE_DEP = "coverage>=7.4"

# Third-party modules vLLM's tests/conftest.py imports; the fork server imports them once
# (none of them imports vLLM's block managers), so a mutant's child only imports vLLM's own.
CONFTEST_PREIMPORT = ["numpy", "PIL.Image", "transformers", "huggingface_hub", "pytest"]


def cache_root(version: str) -> Path:
    home = Path(os.environ.get("KVSPEC_HOME", Path.home() / ".cache" / "kvspec"))
    return home / "vllm-tests" / version


def tests_root(version: str, log=print) -> Path:
    """The directory holding ``tests/`` of vLLM ``version``'s sdist (fetched on first use)."""
    root = cache_root(version)
    deps = [*TEST_DEPS.get(version, []), COVERAGE_DEP]
    if not (root / "deps" / "coverage").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(root / "deps"), *deps], check=True, timeout=600)
    if (root / "tests").is_dir():
        return root
    log(f"fetching vLLM {version}'s tests from its sdist into {root} ...")
    with tempfile.TemporaryDirectory(prefix="kvspec-sdist-") as tmp:
        env = dict(os.environ, TMPDIR=tmp)
        cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
               "--no-binary", ":all:", "--no-build-isolation", "--no-clean", "-d",
               str(Path(tmp) / "dl")]
        # Expected to fail while building metadata (no torch here); the tree stays unpacked.
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        trees = [Path(t).parent for t in glob.glob(f"{tmp}/pip-*/vllm*/tests")]
        trees = [t for t in trees if f"Version: {version}\n" in _read(t / "PKG-INFO")]
        if not trees:
            raise SystemExit(f"could not unpack vLLM {version}'s sdist:\n{proc.stderr[-2000:]}")
        root.mkdir(parents=True, exist_ok=True)
        shutil.copytree(trees[0] / "tests", root / "tests")
    return root


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


class _Outcomes:
    """pytest plugin: every test's outcome (a failure in setup or teardown counts)."""

    def __init__(self) -> None:
        self.tests: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.first_failure = ""
        self.collect_errors: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            self.tests[report.nodeid] = "failed"
            self.reasons.setdefault(report.nodeid, f"{report.when}: {_short(report)}")
            if not self.first_failure:
                self.first_failure = f"{report.nodeid}: {_short(report)}"
        elif report.skipped and report.nodeid not in self.tests:
            self.tests[report.nodeid] = "skipped"
        elif report.when == "call" and report.passed:
            self.tests.setdefault(report.nodeid, "passed")

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid}: {_short(report)}")


class _CoveragePyPerTest:
    """pytest plugin: per-test line coverage of the given files with coverage.py's C tracer,
    one dynamic context per test (the same result as ``_PerTestCoverage``, faster)."""

    def __init__(self, files: dict[str, str]) -> None:
        import coverage

        self.files = files
        self.cov = coverage.Coverage(data_file=None, include=list(files), branch=False,
                                     config_file=False)
        self.durations: dict[str, float] = {}

    def pytest_sessionstart(self, session) -> None:
        self.cov.start()

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self.cov.switch_context(nodeid)

    def pytest_runtest_logreport(self, report) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    def to_json(self) -> dict[str, dict[str, list[int]]]:
        self.cov.stop()
        data = self.cov.get_data()
        out: dict[str, dict[str, list[int]]] = {}
        for path in data.measured_files():
            module = self.files.get(path)
            if module is None:
                continue
            for line, contexts in data.contexts_by_lineno(path).items():
                for nodeid in contexts:
                    if nodeid:
                        out.setdefault(nodeid, {}).setdefault(module, []).append(line)
        return {t: {m: sorted(v) for m, v in per.items()} for t, per in out.items()}


class _PerTestCoverage:
    """pytest plugin: the lines of the given files each test executes (setup, call and
    teardown).  A test that never executes a mutated line cannot observe the mutation, so a
    mutant inside a function only needs the tests that cover its lines (what mutmut and
    cosmic-ray call covered tests); the unmutated run records them once."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files  # path of a served copy -> module name
        self.current: set[tuple[str, int]] | None = None
        self.lines: dict[str, set[tuple[str, int]]] = {}
        self.durations: dict[str, float] = {}

    def _local(self, frame, event, arg):
        if event == "line" and self.current is not None:
            self.current.add((frame.f_code.co_filename, frame.f_lineno))
        return self._local

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename in self.files:
            if self.current is not None:
                self.current.add((frame.f_code.co_filename, frame.f_lineno))
            return self._local
        return None

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        import threading

        self.current = self.lines.setdefault(nodeid, set())
        sys.settrace(self._global)
        threading.settrace(self._global)

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        import threading

        sys.settrace(None)
        threading.settrace(None)
        self.current = None

    def pytest_runtest_logreport(self, report) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    def to_json(self) -> dict[str, dict[str, list[int]]]:
        out: dict[str, dict[str, list[int]]] = {}
        for nodeid, seen in self.lines.items():
            per: dict[str, list[int]] = {}
            for f, line in seen:
                per.setdefault(self.files[f], []).append(line)
            out[nodeid] = {k: sorted(v) for k, v in per.items()}
        return out


class TestTooSlow(Exception):
    """A test ran past the clean run's per-test limit."""


class _PerTestLimit:
    """pytest plugin for the clean run: a test past ``seconds`` fails (and is then deselected
    for every mutant, and listed).  On 0.33.0 the tests that build a model config spawn
    ``python -m vllm.model_executor.models.registry`` per model and, offline, fail after
    minutes of it; the limit keeps the clean run within a benchmark's budget."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds

    def _alarm(self, signum, frame):
        raise TestTooSlow(f"over {self.seconds} s on the clean run")

    @pytest_hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        import signal

        previous = signal.signal(signal.SIGALRM, self._alarm)
        signal.alarm(self.seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _short(report) -> str:
    text = str(report.longrepr) if report.longrepr is not None else ""
    lines = [x for x in text.splitlines() if x.startswith("E ")]
    return " ".join((lines[-1] if lines else text.splitlines()[-1] if text else "").split())[:240]


def run(root: str, files: list[str], deselect: list[str], *, first_failure: bool,
        coverage: dict[str, str] | None = None, per_test_limit: int | None = None
        ) -> dict[str, Any]:
    """Run the files (or test node ids) with pytest here; ``first_failure`` stops at the
    first failing test; ``coverage`` (copy path -> module) records each test's lines."""
    import pytest

    os.chdir(root)
    sys.path.insert(0, root)  # the tests import ``tests.<...>`` helpers
    sys.path.append(os.path.join(root, "deps"))  # TEST_DEPS, after the venv's own packages
    args = [*files, "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"--rootdir={root}",
            "-W", "ignore::DeprecationWarning"]
    args += [f"--deselect={d}" for d in deselect]
    if first_failure:
        args.append("-x")
    plugin = _Outcomes()
    plugins: list[Any] = [plugin]
    cov: Any = None
    if coverage:
        try:
            cov = _CoveragePyPerTest(coverage)
        except ImportError:  # no coverage.py beside the tests: the slow pure-Python tracer
            cov = _PerTestCoverage(coverage)
    if cov is not None:
        plugins.append(cov)
    if per_test_limit:
        plugins.append(_PerTestLimit(per_test_limit))
    start = time.perf_counter()
    code = int(pytest.main(args, plugins=plugins))
    counts: dict[str, int] = {}
    for outcome in plugin.tests.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"exit_code": code, "seconds": time.perf_counter() - start, "counts": counts,
            "tests": plugin.tests, "reasons": plugin.reasons, "first_failure": plugin.first_failure,
            "collect_errors": plugin.collect_errors,
            **({"coverage": cov.to_json(), "durations": cov.durations} if cov else {})}
