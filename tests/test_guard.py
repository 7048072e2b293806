"""The target guard and crash fidelity: a target that hangs, runs away with memory, cannot be
built or observed, crashes, or answers nondeterministically is reported as exactly that, through
the real command line (in process), with its exit code and report; a crash replays as itself.

The misbehaving targets are kvspec.reference.misbehaving's (``--impl broken:<name>``); the limits
are small (``--op-timeout``, ``--memory-cap``) so that the runs are quick and the machine safe.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import kvspec.testing.guard as guard_module
import pytest
from kvspec.cli.failures import replay_verdict
from kvspec.cli.main import main
from kvspec.cli.target import _import_failed
from kvspec.reference.misbehaving import MISBEHAVING, FlakyAdmission
from kvspec.spec.config import Config
from kvspec.testing.artifacts.rerun import Rerun
from kvspec.testing.blockmanager.driver import TraceStep
from kvspec.testing.guard import (
    GIB,
    Crash,
    Guard,
    GuardTripped,
    Limits,
    TargetExceededMemory,
    TargetHung,
    crash_site,
)

FAST = ["--profile", "ci", "--no-known", "--examples", "30", "--max-violations", "1"]


@pytest.fixture
def run(tmp_path, capsys):
    """``kvspec check --impl broken:<name>``: exit code, stdout, its report and the report's path."""

    def go(name: str, *extra: str) -> tuple[int, str, dict, Path]:
        out_dir = tmp_path / name
        code = main(["check", "--impl", f"broken:{name}", *FAST, "--out", str(out_dir), *extra])
        out = capsys.readouterr().out
        reports = sorted(out_dir.rglob("report.json"))
        assert reports, f"no report.json under {out_dir}:\n{out}"
        return code, out, json.loads(reports[0].read_text()), reports[0]

    return go


def test_every_misbehaving_variant_has_a_test():
    """A check that cannot fail is a defect: each outcome has its variant, each variant a test."""
    outcomes = {m.outcome for m in MISBEHAVING.values()}
    assert outcomes == {"hung", "memory", "error", "nondeterministic"}
    tested = {
        "hang-in-free",
        "runaway-admission",
        "raise-in-constructor",
        "raise-in-observe",
        "keyerror-in-free",
        "assert-in-reserve",
        "recursion-in-append",
        "flaky-admission",
    }
    assert set(MISBEHAVING) == tested


# ------------------------------------------------------------------------------ the guard itself


def test_guard_interrupts_a_python_loop_and_restores_the_process():
    handler = signal.getsignal(signal.SIGALRM)
    limit = resource.getrlimit(resource.RLIMIT_AS)
    guard = Guard(Limits(op_timeout=0.2, memory_cap_gib=1.0))
    start = time.monotonic()
    with guard.armed(), pytest.raises(TargetHung) as caught:
        guard.call("spin", None, lambda: [None for _ in iter(int, 1)])
    assert 0.2 <= time.monotonic() - start < 5
    assert str(caught.value) == "target hung in spin after 0.2 s"
    assert isinstance(caught.value, GuardTripped) and not isinstance(caught.value, Exception)
    with pytest.raises(TargetHung):
        guard.call("anything", None, lambda: None)  # a tripped target is abandoned
    assert signal.getsignal(signal.SIGALRM) == handler
    assert resource.getrlimit(resource.RLIMIT_AS) == limit


def test_a_tick_at_the_recursion_limit_is_skipped_not_raised_into_the_running_code():
    """A tick landing near the recursion limit (seen during a deep shrink on 0.6.3) must not raise
    RecursionError into the code it interrupted, which would be blamed for it."""
    guard = Guard(Limits(op_timeout=60.0, memory_cap_gib=1.0))
    with guard.armed():
        guard._op = "deep"
        guard._start = guard._progress = time.monotonic()
        limit = sys.getrecursionlimit()
        for headroom in range(1, 10):  # frames left to the handler and what it calls
            lowest = 1  # the lowest limit the interpreter accepts at this depth
            while True:
                try:
                    sys.setrecursionlimit(lowest)
                    break
                except RecursionError:
                    lowest += 1
            sys.setrecursionlimit(lowest + headroom)
            try:
                guard._tick(signal.SIGALRM, None)
            finally:
                sys.setrecursionlimit(limit)
        guard._op = None


def test_a_call_that_keeps_importing_is_not_hung_but_one_that_stops_is(monkeypatch, tmp_path):
    """vLLM imports lazily (over a minute on a loaded machine): a call whose imports go on is
    given up to ``IMPORT_ALLOWANCE`` more; the limit counts from its last import."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = [f"kvspec_slow_import_{i}" for i in range(6)]
    for name in names:
        (tmp_path / f"{name}.py").write_text("import time\ntime.sleep(0.1)\n")

    def imports_then_spins() -> None:
        for name in names:  # 0.6 s of importing under a 0.25 s limit
            __import__(name)
        while True:
            pass

    guard = Guard(Limits(op_timeout=0.25, memory_cap_gib=None))
    start = time.monotonic()
    with guard.armed(), pytest.raises(TargetHung):
        guard.call("construct", None, imports_then_spins)
    assert all(name in sys.modules for name in names)  # the imports were not cut
    assert time.monotonic() - start >= 0.5 + 0.25  # from the start of the last import
    monkeypatch.setattr(guard_module, "IMPORT_ALLOWANCE", 0.0)
    for name in names:
        sys.modules.pop(name, None)
    guard = Guard(Limits(op_timeout=0.25, memory_cap_gib=None))
    with guard.armed(), pytest.raises(TargetHung):
        guard.call("construct", None, imports_then_spins)
    assert names[-1] not in sys.modules  # without the allowance the limit cut the imports


def test_a_call_waiting_on_a_child_process_is_not_hung():
    """vLLM inspects a model class in a subprocess on a cold model-info cache."""
    guard = Guard(Limits(op_timeout=0.25, memory_cap_gib=None))
    with guard.armed():
        guard.call("construct", None, subprocess.run, [sys.executable, "-c", "import time; time.sleep(0.8)"])
    with guard.armed(), pytest.raises(TargetHung):
        guard.call("construct", None, time.sleep, 0.8)


def test_a_child_the_host_already_had_does_not_keep_a_hung_call_alive():
    """Under pytest-xdist a worker may have a child of its own; it is not the call's work.
    (A child is told by its start time, to the clock tick: this one is started well before.)"""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    time.sleep(0.1)
    try:
        guard = Guard(Limits(op_timeout=0.25, memory_cap_gib=None))
        with guard.armed(), pytest.raises(TargetHung):
            guard.call("free", None, time.sleep, 2.0)
    finally:
        bystander.kill()
        bystander.wait()


def test_a_target_that_swallows_the_limit_is_stopped_again():
    def swallow_once() -> None:
        try:
            while True:
                pass
        except BaseException:  # what broken target code does
            pass
        while True:
            pass

    guard = Guard(Limits(op_timeout=0.2, memory_cap_gib=None))
    with guard.armed(), pytest.raises(TargetHung):
        guard.call("free", None, swallow_once)


def test_a_call_that_swallows_the_limit_and_returns_still_fails_as_that_call():
    """A trip raised where Python only prints exceptions (a gc callback) must not let the call
    return as if in time: the next call would fail instead, and the run read as nondeterministic."""

    def swallow_then_return() -> str:
        try:
            while True:
                pass
        except BaseException:
            pass
        return "done"

    guard = Guard(Limits(op_timeout=0.2, memory_cap_gib=None))
    with guard.armed(), pytest.raises(TargetHung):
        guard.call("construct", None, swallow_then_return)
    assert guard.failure is not None and guard.failure.call == "construct"


def test_guard_stops_a_runaway_allocation():
    guard = Guard(Limits(op_timeout=30, memory_cap_gib=0.25))
    hoard: list[bytearray] = []

    def runaway() -> None:
        while True:
            hoard.append(bytearray(8 * 1024 * 1024))

    with guard.armed(), pytest.raises(TargetExceededMemory) as caught:
        guard.call("admit", None, runaway)
    grown = len(hoard) * 8 * 1024 * 1024
    hoard.clear()
    assert "target exceeded 0.25 GiB in admit" in str(caught.value)
    assert grown < 2 * GIB  # stopped near the cap, far from the machine's memory


def test_a_crash_is_named_by_the_targets_frame():
    def target_code() -> None:
        {}[3]

    with pytest.raises(KeyError) as caught:
        Guard(Limits()).call("free", None, target_code)
    assert crash_site(caught.value).endswith(f"test_guard.py:{target_code.__code__.co_firstlineno + 1}")
    crash = Crash.of("free", caught.value)
    assert crash.describe().startswith("crashed in free: KeyError: 3 (at ")


def test_an_import_failure_is_told_from_a_constructor_crash():
    with pytest.raises(ModuleNotFoundError) as missing:
        import kvspec_no_such_module  # noqa: F401
    assert _import_failed(missing.value)
    with pytest.raises(RuntimeError) as built:
        MISBEHAVING["raise-in-constructor"].cls(Config(block_size=2, num_blocks=4))
    assert not _import_failed(built.value)


# ------------------------------------------------------------------------------ through the CLI


def test_a_hang_is_reported_with_the_trace_up_to_it(run):
    code, out, report, _ = run("hang-in-free", "--op-timeout", "0.3")
    assert code == 1
    assert "the target hung" in out and "target hung in free after 0.3 s" in out
    assert report["outcome"] == "hung"
    last = report["trace"][-1]
    assert last["op"] == "free" and last["crash"]["type"] == "TargetHung"
    assert last["crash"]["location"].startswith("kvspec/reference/misbehaving.py:")
    assert report["crash"]["step"] == len(report["trace"])
    assert report["limits"] == {"op_timeout": 0.3, "memory_cap_gib": 4.0}


def test_a_runaway_allocation_is_stopped_at_the_cap(run):
    limit = resource.getrlimit(resource.RLIMIT_AS)
    code, out, report, _ = run("runaway-admission", "--memory-cap", "0.25")
    assert code == 1
    assert "the target exceeded its memory cap" in out and "target exceeded 0.25 GiB in admit" in out
    assert report["outcome"] == "memory"
    assert report["trace"][-1]["op"] == "admit"
    assert report["crash"]["type"] == "TargetExceededMemory"
    assert resource.getrlimit(resource.RLIMIT_AS) == limit  # the cap is lifted after the run


def test_a_constructor_that_raises_is_a_target_crash(run):
    code, out, report, _ = run("raise-in-constructor")
    assert code == 1  # a finding, not bad input (2), not a kvspec crash
    assert "the target crashed" in out and "in the constructor" in out
    assert "RuntimeError: cannot size the pool" in out and "does not import" not in out
    assert report["outcome"] == "error" and report["trace"] == []
    assert report["crash"]["call"] == "construct" and report["crash"]["step"] == 0
    assert any("raise RuntimeError" in line for line in report["crash"]["traceback"])
    assert report["config"] is not None


def test_a_first_observation_that_raises_is_a_target_crash(run):
    code, out, report, _ = run("raise-in-observe")
    assert code == 1
    assert "the target crashed" in out and "in the first observation" in out
    assert report["outcome"] == "error"
    assert report["crash"]["call"] == "observe" and report["crash"]["type"] == "ValueError"


def test_nondeterministic_answers_are_reported_naming_the_operation(run):
    FlakyAdmission.arm()
    code, out, report, _ = run("flaky-admission")
    assert code == 1
    assert "the target is nondeterministic" in out
    assert "step 1 (admit) answered 'can_admit=ok, refused: NoFreeBlocks' when recorded" in out
    assert "Flaky" not in out.split("nondeterministic", 1)[0]  # not a bare hypothesis error
    assert report["outcome"] == "nondeterministic"
    assert report["nondeterminism"]["step"] == 1 and report["nondeterminism"]["operation"] == "admit"


# ------------------------------------------------------------------------------ crash fidelity


@pytest.mark.parametrize(
    ("name", "kind", "call"),
    [
        ("keyerror-in-free", "KeyError", "free"),
        ("assert-in-reserve", "AssertionError", "reserve"),
        ("recursion-in-append", "RecursionError", "append_token"),
    ],
)
def test_a_crash_is_recorded_as_crashed_and_replays_as_itself(run, capsys, name, kind, call):
    code, out, report, path = run(name)
    assert code == 1 and "the target crashed" in out
    last = report["trace"][-1]
    assert last["crash"]["type"] == kind and last["crash"]["call"] == call
    assert f"crashed in {call}: {kind}" in last["outcome"]
    assert last["crash"]["location"].startswith("kvspec/reference/misbehaving.py:")
    assert all("crash" not in step for step in report["trace"][:-1])

    assert main(["replay", str(path)]) == 1
    replayed = capsys.readouterr().out
    assert "the recorded crash reproduces" in replayed and kind in replayed
    assert "diverged" not in replayed and "holds" not in replayed

    # On other code (the reference) the crash does not occur and nothing else is wrong.
    assert main(["replay", str(path), "--impl", "reference"]) == 0
    other = capsys.readouterr().out
    assert "does not occur on this code" in other and "every invariant holds" in other


def test_a_crash_that_does_not_recur_on_the_same_code_is_nondeterministic(capsys):
    crash = Crash("free", "KeyError", "0", "vllm/core/block_manager.py:10")
    recorded = [TraceStep("admit", {"seq": 0}, "admitted"), TraceStep("free", {"seq": 0}, "crashed", crash)]
    now = Rerun([TraceStep("admit", {"seq": 0}, "admitted"), TraceStep("free", {"seq": 0}, "ok")])
    report = {"violations": [], "crash": {**crash.to_json(), "step": 2}}
    assert replay_verdict(report, recorded, now, True) == 1
    said = capsys.readouterr().out
    assert "nondeterministic" in said and "did not recur" in said and "holds" not in said
    # A report without a code digest cannot say the code is the same: never "holds" either.
    assert replay_verdict(report, recorded, now, None) == 1
    assert "nondeterministic" in capsys.readouterr().out


def test_a_nondeterministic_report_replays_as_nondeterministic(run, capsys):
    FlakyAdmission.arm()
    _, _, _, path = run("flaky-admission")
    assert main(["replay", str(path)]) == 1
    said = capsys.readouterr().out
    assert "nondeterministic" in said and "step 1 (admit)" in said


def test_a_crash_report_from_before_crashes_were_recorded_replays_as_the_crash(run, capsys, tmp_path):
    """Older reports recorded the crashing operation as answered ("-> ok") and kept only the
    error text: replay still reproduces the crash rather than calling it a divergence."""
    _, _, report, _ = run("keyerror-in-free")
    del report["crash"]
    for step in report["trace"]:
        step.pop("crash", None)
    report["trace"][-1]["outcome"] = "ok"
    old = tmp_path / "old-report.json"
    old.write_text(json.dumps(report))
    assert main(["replay", str(old)]) == 1
    said = capsys.readouterr().out
    assert "the recorded crash reproduces" in said and "KeyError" in said
    assert "diverged" not in said and "holds" not in said


def test_a_child_an_earlier_call_left_does_not_keep_a_later_hung_call_alive():
    """The children a call started are told by start time, not by a snapshot per call."""
    guard = Guard(Limits(op_timeout=0.25, memory_cap_gib=None))
    with guard.armed():
        sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
        leftover = guard.call("construct", None, subprocess.Popen, sleeper)
    try:
        time.sleep(0.1)
        with guard.armed(), pytest.raises(TargetHung):
            guard.call("free", None, time.sleep, 2.0)
    finally:
        leftover.kill()
        leftover.wait()


def test_children_since_tells_a_new_child_from_an_old_one():
    from kvspec.testing.guard import children_since

    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        new = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert new.pid in children_since(0.2)
            assert old.pid not in children_since(0.2)
            assert old.pid in children_since(5.0)
        finally:
            new.kill()
            new.wait()
    finally:
        old.kill()
        old.wait()
