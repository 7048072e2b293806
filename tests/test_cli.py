"""The ``kvspec`` command line on kvspec's own implementations (no vLLM needed): exit codes,
the per-invariant table, the JSON report and its replay, bad input, ``explain``."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvspec.cli.main import main
from kvspec.cli.search import run_index
from kvspec.spec.config import Config
from kvspec.spec.invariants import INVARIANTS, Violation
from kvspec.targets.registry import TargetError
from kvspec.testing import TraceStep
from kvspec.testing.artifacts.report import FORMAT, ReportError, load_report, write_atomic
from kvspec.testing.artifacts.reproducer import NotReproducible, generate

SEED_CONFIG = [
    "--config", "block_size=4", "--config", "num_blocks=4", "--config", "sliding_window=8",
]


def kvspec(*args: str, env: dict | None = None, cwd: Path | None = None):
    """The real entry point, in a subprocess (what a user runs)."""
    return subprocess.run(
        [sys.executable, "-m", "kvspec.cli", *args],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=600, check=False,
    )


def test_check_reference_holds_and_prints_the_table():
    proc = kvspec("check", "--impl", "reference", "--profile", "ci", "--examples", "30")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for inv in INVARIANTS:
        assert inv in proc.stdout
    assert "holds" in proc.stdout and "VIOLATED" not in proc.stdout
    assert "30 of 30 examples" in proc.stdout
    assert "every applicable invariant holds" in proc.stdout


def test_check_focus_marks_the_others_not_selected(capsys):
    code = main(["check", "--impl", "reference", "--profile", "ci", "--examples", "5",
                 "--invariant", "no-leak", "--config", "sliding_window=none"])
    out = capsys.readouterr().out
    assert code == 0
    assert "not selected" in out and "holds" in out


def test_not_applicable_without_a_window(capsys):
    code = main(["check", "--impl", "reference", "--profile", "ci", "--examples", "10",
                 "--config", "sliding_window=none", "--config", "prefix_caching=false"])
    out = capsys.readouterr().out
    assert code == 0
    assert "not applicable: window-bound" in out
    assert "not applicable: prefix-cache-consistency" in out


@pytest.fixture(scope="module")
def seed_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    proc = kvspec("check", "--impl", "broken:window-capped-admission", *SEED_CONFIG,
                  "--profile", "ci", "--examples", "60", "--out", str(out))
    return proc, out


def test_broken_variant_is_violated_with_a_replayable_report(seed_report):
    proc, out = seed_report
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "VIOLATED" in proc.stdout
    index = run_index(out)
    # the variant's bug; other invariants (completeness) may be reported beside it
    (entry,) = [e for e in index if e["fingerprint"]["invariant"] == "admission-soundness"]
    path = Path(entry["report"])
    report = json.loads(path.read_text())
    assert report["format"] == FORMAT
    assert report["outcome"] == "violated"
    assert report["impl"] == "broken:window-capped-admission"
    assert report["config"]["block_size"] == 4 and report["config"]["sliding_window"] == 8
    violated = {v["invariant"] for v in report["violations"]}
    assert violated <= {"admission-soundness", "window-bound"} and violated
    for inv in violated:
        assert report["invariants"][inv]["statement"] == INVARIANTS[inv].statement
    assert report["trace"] and len(report["trace"]) == len(report["trace_text"])
    assert report["run"]["examples_run"] >= 1
    # kvspec's own variants are not vLLM: no standalone file, and the output says why
    assert report["reproducer"]["status"] == "not-available"
    assert "no standalone reproducer" in proc.stdout
    # one folder per distinct violation, nothing else, no temp files
    assert sorted(out.iterdir()) == sorted([out / "summary.json", *(Path(e["report"]).parent for e in index)])
    for e in index:
        files = list(Path(e["report"]).parent.iterdir())
        assert Path(e["report"]) in files and not [f for f in files if f.name.startswith(".")], files
    assert report["fingerprint"] == entry["fingerprint"]

    replayed = kvspec("replay", str(path))
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "the recorded violation reproduces" in replayed.stdout
    for inv in violated:
        assert f"[{inv}]" in replayed.stdout


def test_replay_on_the_reference_finds_nothing(seed_report, capsys):
    _, out = seed_report
    (entry,) = [e for e in run_index(out) if e["fingerprint"]["invariant"] == "admission-soundness"]
    code = main(["replay", entry["report"], "--impl", "reference"])
    assert code == 0
    assert "no violation" in capsys.readouterr().out


def test_same_seed_same_trace(tmp_path):
    runs = []
    for name in ("a", "b"):
        proc = kvspec("check", "--impl", "broken:leak-on-free", "--profile", "dev",
                      "--seed", "12345", "--examples", "40", "--max-violations", "2",
                      "--out", str(tmp_path / name))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        index = run_index(tmp_path / name)
        runs.append([json.loads(Path(e["report"]).read_text()) for e in index])
    assert runs[0][0]["run"]["seed"] == 12345
    assert [r["trace"] for r in runs[0]] == [r["trace"] for r in runs[1]]  # every violation


# ------------------------------------------------------------------------------ bad input

BAD = [
    (["check", "--vllm", "banana"], "is not a vLLM release version"),
    (["check", "--vllm", "0.3.0"], "no supported engine generation"),
    (["check", "--impl", "reference", "--config", "block_size=0"], "block_size must be"),
    (["check", "--impl", "reference", "--config", "sliding_window=-3"], "sliding_window must be"),
    (["check", "--impl", "reference", "--config", "num_blocks=0"], "num_blocks"),
    (["check", "--impl", "reference", "--config", "colour=blue"], "no such configuration field"),
    (["check", "--impl", "reference", "--config", "block_size=four"], "not an integer"),
    (["check", "--impl", "reference", "--invariant", "no-leaks"], "unknown invariant ID"),
    (["check", "--impl", "nope"], "unknown implementation 'nope'"),
    (["check", "--impl", "broken:nope"], "unknown broken variant"),
    (["check", "--impl", "reference", "--examples", "0"], "--examples must be >= 1"),
    (["check", "--impl", "reference", "--vllm", "0.6.3"], "runs without vLLM"),
    (["check", "--vllm-source", "/nonexistent/vllm-checkout"], "no such directory"),
    (["explain", "no-such-invariant"], "unknown invariant ID"),
    (["replay", "/nonexistent/report.json"], "no such report"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_2_with_a_message(argv, message, capsys, tmp_path):
    out_dir = tmp_path / "out"
    code = main([*argv, "--out", str(out_dir)] if argv[0] == "check" else argv)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "hint:" in err
    assert not out_dir.exists()  # nothing half-written


def test_not_a_vllm_checkout(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    assert main(["check", "--vllm-source", str(tmp_path)]) == 2
    assert "is not a vLLM checkout" in capsys.readouterr().err


def test_checkout_without_a_version_asks_for_one(tmp_path, capsys):
    (tmp_path / "vllm" / "core").mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "core" / "interfaces.py").write_text("")
    assert main(["check", "--vllm-source", str(tmp_path)]) == 2
    assert "--source-version" in capsys.readouterr().err


def _fake_vllm(root: Path, init: str, *, legacy: bool) -> Path:
    (root / "vllm" / "core").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(init)
    if legacy:
        (root / "vllm" / "core" / "interfaces.py").write_text("")
    return root


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is not None, reason="this venv has a vLLM"
)
def test_vllm_that_does_not_import_shows_the_error(tmp_path):
    root = _fake_vllm(tmp_path, 'raise ImportError("libcudart.so.12: cannot open shared object")\n',
                      legacy=True)
    proc = kvspec("check", "--impl", "legacy-v2", env={**_env(), "PYTHONPATH": str(root)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "does not import" in proc.stderr
    assert "libcudart.so.12" in proc.stderr


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is not None, reason="this venv has a vLLM"
)
def test_unsupported_generation_is_refused_by_name(tmp_path):
    root = _fake_vllm(tmp_path, "", legacy=False)
    proc = kvspec("check", env={**_env(), "PYTHONPATH": str(root)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unsupported engine generation" in proc.stderr


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is not None, reason="this venv has a vLLM"
)
def test_no_vllm_here_suggests_the_alternatives(capsys):
    assert main(["check"]) == 2
    err = capsys.readouterr().err
    assert "no vLLM is importable" in err and "--impl reference" in err and "--vllm" in err


def test_provisioning_failure_is_bad_input(monkeypatch, capsys, tmp_path):
    import kvspec.targets.provision as provision

    def broken(version, progress=print, **_kw):
        raise TargetError(f"not enough disk for vLLM {version}: 0.1 GiB free")

    monkeypatch.setenv("KVSPEC_HOME", str(tmp_path))  # nothing provisioned there
    monkeypatch.setattr(provision, "provision", broken)
    assert main(["provision", "0.7.0"]) == 2
    assert "provisioning vLLM 0.7.0 failed: not enough disk" in capsys.readouterr().err
    assert main(["check", "--vllm", "0.7.0", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# ------------------------------------------------------------------------------ explain etc.


@pytest.mark.parametrize("inv_id", list(INVARIANTS))
def test_explain_every_invariant(inv_id, capsys):
    assert main(["explain", inv_id]) == 0
    out = capsys.readouterr().out
    inv = INVARIANTS[inv_id]
    assert inv.title in out
    # The statement's own module (spec/invariants.py, or spec/tenancy.py for the prefix
    # cache's tenant and router invariants).
    home = "spec/" + Path(inspect.getsourcefile(inv.check.__wrapped__)).name
    assert "Spec source" in out and home in out
    assert "vLLM code it concerns" in out
    assert "z3 obligations" in out


def test_explain_lists_the_ids(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert all(i in out for i in INVARIANTS)


def test_targets_lists_the_pinned_releases(capsys):
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    assert "0.6.3" in out and "0.33.0" in out


def test_help_mentions_the_library_machine(capsys):
    assert main(["--help"]) == 0
    assert "kvspec.testing.KVCacheMachine" in capsys.readouterr().out
    assert main(["check", "--help"]) == 0
    assert "kvspec.testing.KVCacheMachine" in capsys.readouterr().out


# ------------------------------------------------------------------------------ pure helpers


def test_report_loader_refuses_other_files(tmp_path):
    path = write_atomic(tmp_path / "r.json", json.dumps({"format": "something-else"}))
    with pytest.raises(ReportError):
        load_report(path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ReportError):
        load_report(tmp_path / "bad.json")


def _imports(text: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_a_v1_reproducer_is_straight_line_only():
    """One reproducer path: a V1 trace is replayed on vLLM under the recorder (no trace
    interpreter to fall back on), so where vLLM does not import there is no file and the reason
    says so; the files themselves are checked on real releases in tests/targets."""
    config = Config(block_size=4, num_blocks=4, sliding_window=8)
    trace = [TraceStep("admit", {"seq": 0, "tokens": list(range(20)), "num_new_tokens": 20,
                                 "next_token": 0}, "can_admit=ok, refused: NoFreeBlocks")]
    made = generate("v1", config, trace, [Violation("admission-soundness", "answered OK...")],
                    {"vllm_version": "0.6.3", "kvspec_version": "0.1.0"})
    assert isinstance(made, NotReproducible) and "does not import here" in made.reason


def test_no_reproducer_for_shadow_memory_invariants_or_kvspec_impls():
    config = Config(block_size=4, num_blocks=4)
    trace = [TraceStep("admit", {"seq": 0, "tokens": [1], "num_new_tokens": 1}, "ok")]
    memory_only = generate("v1", config, trace, [Violation("kv-readback", "x")], {})
    assert isinstance(memory_only, NotReproducible) and "shadow KV memory" in memory_only.reason
    own = generate("reference", config, trace, [Violation("no-leak", "x")], {})
    assert isinstance(own, NotReproducible)
    no_vllm = generate("legacy-v2", config, trace, [Violation("no-leak", "x")], {})
    assert isinstance(no_vllm, NotReproducible) and "does not import here" in no_vllm.reason


def test_a_crashing_target_is_reported_not_passed(monkeypatch, capsys, tmp_path):
    """An exception from the target under a valid protocol is a finding (exit 1) with a trace."""
    import kvspec.cli.check as check
    from kvspec.reference import ReferenceManager

    class Crashes(ReferenceManager):
        name = "crashes"

        def free(self, seq_id):
            raise RuntimeError("boom in free")

    monkeypatch.setattr(check, "factory_for", lambda impl: Crashes)
    code = main(["check", "--impl", "reference", "--profile", "ci", "--examples", "20",
                 "--max-violations", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "the target crashed" in out and "boom in free" in out
    report = json.loads(Path(run_index(tmp_path)[0]["report"]).read_text())
    assert report["outcome"] == "error" and "RuntimeError: boom in free" in report["error"]
    assert report["trace"] and report["trace"][-1]["op"] in ("free", "preempt")
    assert report["reproducer"]["status"] == "not-available"


def test_the_examples_line_does_not_read_more_examples_than_asked_as_a_fraction():
    from kvspec.cli.budget import UNBOUNDED_EXAMPLES
    from kvspec.cli.check import examples_line

    assert examples_line(100, 100) == "100 of 100 examples"
    assert examples_line(410, 100) == "410 examples over all rounds (100 asked per round)"
    assert examples_line(7, UNBOUNDED_EXAMPLES) == "7 of time-budgeted examples"
