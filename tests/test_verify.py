"""The reproducer verifier (testing/artifacts/verify.py): plain pytest in a forked child gives
the verdict a fresh interpreter gives, and a child that hangs or runs away is killed and said so."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from kvspec.testing.artifacts.verify import (
    BROKEN,
    EXITED,
    HUNG,
    MEMORY,
    PASSES,
    REPRODUCES,
    TIMEOUT,
    can_fork,
    judge,
    pytest_in_fork,
    pytest_in_subprocess,
    verify,
)
from kvspec.testing.guard import Limits

pytestmark = pytest.mark.skipif(not can_fork(), reason="forking verifier: Linux only")

FAILS = '''
import pytest

def test_reproduces():
    observed = 3
    if observed != 2:
        pytest.fail("[no-leak] expected 2 free blocks; observed 3")
'''
PASSES_TEXT = '''
def test_holds():
    assert 1 + 1 == 2
'''
OTHER_FAILURE = '''
def test_fails_otherwise():
    assert {}["missing"]
'''
UNIMPORTABLE = "import no_such_module_kvspec\n\ndef test_x():\n    pass\n"
HANGS = "import time\n\ndef test_hangs():\n    time.sleep(120)\n"
RUNS_AWAY = '''
import time

def test_runs_away():
    held = []
    while True:
        held.append(bytearray(32 * 1024 * 1024))
        time.sleep(0.005)
'''
CHECKS = ("no-leak", "refcount-exact")
LIMITS = Limits(op_timeout=60.0, memory_cap_gib=4.0)


def _file(tmp_path: Path, name: str, text: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    path = folder / f"test_kvspec_{name}.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "verdict"),
    [(FAILS, REPRODUCES), (PASSES_TEXT, PASSES), (OTHER_FAILURE, BROKEN), (UNIMPORTABLE, BROKEN)],
    ids=["fails-naming-its-invariant", "passes", "fails-otherwise", "does-not-import"],
)
def test_the_forked_verdict_is_the_fresh_interpreters(tmp_path, text, verdict):
    path = _file(tmp_path, "case", text)
    forked = pytest_in_fork(path, rootdir=path.parent, limits=LIMITS)
    fresh = pytest_in_subprocess(path, rootdir=path.parent)
    assert (forked.status, fresh.status) == (EXITED, EXITED)
    assert forked.exit_code == fresh.exit_code
    assert judge(forked, CHECKS)[0] == judge(fresh, CHECKS)[0] == verdict
    if verdict == REPRODUCES:
        assert judge(forked, CHECKS) == judge(fresh, CHECKS)
        assert judge(forked, CHECKS)[1].startswith("[no-leak] expected 2 free blocks")


def test_a_failure_naming_no_checked_invariant_does_not_reproduce(tmp_path):
    path = _file(tmp_path, "case", FAILS)
    assert judge(pytest_in_fork(path, rootdir=path.parent, limits=LIMITS), ("conservation",))[0] == BROKEN


def _gone(pid_file: Path) -> bool:
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_forked_child_that_hangs_is_killed_and_reported(tmp_path):
    pids = tmp_path / "pid"
    note = f"open({str(pids)!r}, 'w').write(str(__import__('os').getpid()))"
    path = _file(tmp_path, "hang", HANGS.replace("time.sleep(120)", f"{note}; time.sleep(120)"))
    start = time.monotonic()
    run = pytest_in_fork(path, rootdir=path.parent, limits=LIMITS, timeout=3.0)
    assert run.status == HUNG and time.monotonic() - start < 30
    assert judge(run, CHECKS)[0] == TIMEOUT
    assert _gone(pids)


def test_a_forked_child_that_exceeds_the_memory_cap_is_killed_and_reported(tmp_path):
    pids = tmp_path / "pid"
    note = f"open({str(pids)!r}, 'w').write(str(__import__('os').getpid()))"
    text = RUNS_AWAY.replace("    held = []", f"    {note}\n    held = []")
    path = _file(tmp_path, "runaway", text)
    run = pytest_in_fork(path, rootdir=path.parent, limits=Limits(op_timeout=60.0, memory_cap_gib=0.25), timeout=60.0)
    assert run.status == MEMORY, run.output[-2000:]
    assert judge(run, CHECKS) == (BROKEN, "does not run cleanly: it exceeded the memory cap under pytest")
    assert _gone(pids)


def test_the_child_runs_none_of_the_parents_exit_handlers(tmp_path):
    marker = tmp_path / "ran"

    def child(_args: list[str]) -> int:
        import atexit

        atexit.register(lambda: marker.write_text("the parent's handler ran in the child"))
        return 0

    path = _file(tmp_path, "case", PASSES_TEXT)
    run = pytest_in_fork(path, rootdir=path.parent, limits=LIMITS, child=child)
    assert (run.status, run.exit_code) == (EXITED, 0)
    assert not marker.exists()


def test_verify_trusts_a_fork_only_when_it_reproduces(tmp_path):
    failing = _file(tmp_path, "failing", FAILS)
    verdict, _detail, runs = verify(failing, CHECKS, rootdir=failing.parent, limits=LIMITS)
    assert verdict == REPRODUCES and [r.how for r in runs] == ["fork"]
    passing = _file(tmp_path, "passing", PASSES_TEXT)
    verdict, _detail, runs = verify(passing, CHECKS, rootdir=passing.parent, limits=LIMITS)
    assert verdict == PASSES and [r.how for r in runs] == ["fork", "subprocess"]
    verdict, _detail, runs = verify(failing, CHECKS, rootdir=failing.parent, limits=LIMITS, fork=False)
    assert verdict == REPRODUCES and [r.how for r in runs] == ["subprocess"]


def test_kvspec_check_keeps_a_file_only_when_plain_pytest_fails_it(tmp_path, monkeypatch):
    """cli/check.py ``verify_reproducer``: forked by default, a fresh interpreter with
    KVSPEC_VERIFY_NO_FORK; the same verdict either way, the file kept only when it reproduces."""
    from kvspec.cli.check import NO_FORK_ENV, verify_reproducer
    from kvspec.testing.artifacts.reproducer import Reproducer

    for fork in (True, False):
        if not fork:
            monkeypatch.setenv(NO_FORK_ENV, "1")
        out = tmp_path / f"fork-{fork}"
        failing = Reproducer("test_kvspec_case.py", FAILS, CHECKS)
        verdict, detail, how = verify_reproducer(failing, out / "failing", LIMITS)
        assert verdict == REPRODUCES and detail.startswith("[no-leak]")
        assert how == ("fork" if fork else "subprocess")
        assert (out / "failing" / "test_kvspec_case.py").is_file()
        passing = Reproducer("test_kvspec_case.py", PASSES_TEXT, CHECKS)
        verdict, _, _ = verify_reproducer(passing, out / "passing", LIMITS)
        assert verdict == PASSES and not (out / "passing" / "test_kvspec_case.py").exists()
