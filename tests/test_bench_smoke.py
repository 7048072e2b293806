"""The benchmark commands run, with tiny budgets, and write sane output (no timing is asserted:
the figures live in BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bench(*args: str, tmp: Path) -> None:
    cmd = [sys.executable, "-m", "bench", *args, "--results", str(tmp), "--md", str(tmp / "B.md")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)  # a hang guard, not a speed check
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_bench_commands_run_on_the_reference_and_write_results(tmp_path):
    _bench("throughput", "--targets", "reference", "--examples", "5", "--profile-examples", "3",
           tmp=tmp_path)
    _bench("ttc", "--seeds", "1", "--variants", "leak-on-free", "--findings",
           "--max-examples", "100", tmp=tmp_path)
    _bench("scale", "--targets", "reference", "--quick", tmp=tmp_path)
    _bench("proofs", "--only", "window-bound/cover", "--grid", "none", tmp=tmp_path)

    t = json.loads((tmp_path / "throughput.json").read_text())["results"][0]
    assert t["target"] == "reference" and t["operations"] > 0 and t["raw_mismatches"] == 0
    assert t["oracle_steps_per_s"] > 0 and t["raw_steps_per_s"] > 0
    assert t["profile_oracle"]["layers"] and t["profile_oracle"]["top_tottime"]

    c = json.loads((tmp_path / "ttc.json").read_text())["results"][0]
    assert c["found"] == 1 and set(c["rows"][0]["invariants"]) <= {"no-leak", "refcount-exact"}

    s = json.loads((tmp_path / "scale.json").read_text())["results"][0]
    assert s["rows"] and all(r["ops"] > 0 and r["raw_mismatches"] == 0 for r in s["rows"])
    assert not any("violations" in r for r in s["rows"])

    p = json.loads((tmp_path / "proofs.json").read_text())
    assert p["obligations"] and all(o["ok"] for o in p["obligations"])

    md = (tmp_path / "B.md").read_text()
    for name in ("throughput", "ttc", "scale", "proofs"):
        assert f"<!-- bench:{name} -->" in md and f"<!-- /bench:{name} -->" in md
    assert "Command: `python -m bench" in md and "Python " in md


def test_ttc_runs_the_scheduler_machine_and_merges_runs(tmp_path):
    """The scheduler cases of ``bench ttc`` (a broken scheduler in its shape, a differential-only
    one under the differential) are found, and a ``--merge`` run keeps the rows it did not redo."""
    _bench("ttc", "--seeds", "1", "--variants", "--findings", "--scheduler-variants",
           "no-draft-rollback", "serial-admission", "--max-examples", "200", tmp=tmp_path)
    _bench("ttc", "--seeds", "1", "--variants", "leak-on-free", "--findings",
           "--scheduler-variants", "--max-examples", "100", "--merge", tmp=tmp_path)

    data = json.loads((tmp_path / "ttc.json").read_text())
    by_case = {r["case"]: r for r in data["results"]}
    assert set(by_case) == {"scheduler:no-draft-rollback", "scheduler:serial-admission",
                            "leak-on-free"}, sorted(by_case)
    assert [r["run"] for r in data["results"]] == [0, 0, 1] and len(data["runs"]) == 2
    assert by_case["scheduler:no-draft-rollback"]["found"] == 1
    assert by_case["scheduler:no-draft-rollback"]["rows"][0]["invariants"] == ["kv-readback"]
    assert by_case["scheduler:serial-admission"]["rows"][0]["invariants"] == []
    assert by_case["scheduler:serial-admission"]["rows"][0]["differs"] == "reference-scheduler: scheduled"
    md = (tmp_path / "B.md").read_text()
    assert "Run 1: Command: `python -m bench ttc" in md and "Run 2: Command:" in md


def test_mutation_operators_apply_and_compile():
    sys.path.insert(0, str(REPO))
    from bench.mutants import enumerate_mutants, mutate_tree
    from bench.mutation import sample

    source = (
        "import logging\nlogger = logging.getLogger()\n\n"
        "def f(a, b):\n"
        "    '''doc'''\n"
        "    assert a >= 0\n"
        "    logger.info('x %d', a)\n"
        "    n = a // b + 1\n"
        "    if not (a < b and b != 0):\n"
        "        n -= 1\n"
        "    g(a, b)\n"
        "    return n is None\n"
    )
    mutants = enumerate_mutants("m", source)
    ops = {m.op for m in mutants}
    assert {"ROR", "AOR", "ASR", "CRP", "LCR", "UOI", "SDL", "ARG"} <= ops
    # Nothing from the assert, the docstring or the logging call.
    assert all(m.lineno not in (5, 6, 7) for m in mutants)
    for m in mutants:
        tree, _text = mutate_tree(source, "m", m.site, m.op, m.variant)
        compile(tree, "m", "exec")
    assert sample(mutants, 5) == sample(mutants, 5) and len(sample(mutants, 5)) == 5


def test_mutation_report_keeps_the_narrowed_oracle_beside_the_checks(tmp_path):
    """One result per target and oracle: the run under `kvspec check`'s oracle is headed as
    such and the narrowed one is kept, each with its own 2x2; a cached vLLM-tests verdict of a
    mutant is reused (the tests never see the oracle)."""
    sys.path.insert(0, str(REPO))
    from bench.mutation import _verdicts
    from bench.mutation_report import render_mutation

    def result(oracle: str, kv: str) -> dict:
        m = {"key": "m:1:ROR:0", "module": "pkg.mod", "line": 3, "op": "ROR", "original": "<",
             "mutated": "<=", "describe": "pkg.mod:3 ROR", "covered": True, "status": kv,
             "kind": "violation", "invariants": ["conservation"],
             "vllm_tests": {"status": "survived"}}
        return {"target": "v1@0.33.0", "command": "x", "seconds": 1.0, "generated": 10,
                "machine": {"cpu": "c", "nproc": 2, "memory": "1 GiB", "python": "3", "date": "t",
                            "commit": "c", "loadavg": [0, 0, 0], "loadavg_end": [0, 0, 0]},
                "settings": {"examples": 1, "timeout": 1.0, "jobs": 1, "oracle": oracle},
                "workload": {}, "modules": ["pkg.mod"], "generated_by_module": {"pkg.mod": 10},
                "vllm_tests": {"files": ["t.py"]}, "mutants": [m]}

    text = render_mutation({"results": [result("check", "killed"), result("narrow", "survived")]})
    assert "### v1@0.33.0 -- the oracle `kvspec check` runs" in text
    assert "### v1@0.33.0 -- narrowed oracle" in text
    assert text.count("**Killed by kvspec only: 1**") == 1
    assert text.count("**Killed by kvspec only: 0**") == 1

    cache = tmp_path / "verdicts.jsonl"
    cache.write_text(json.dumps({"key": "m:1:ROR:0", "status": "killed"}) + "\n"
                     + json.dumps({"key": "m:2:ROR:0", "status": "missing"}) + "\n")
    assert set(_verdicts({"verdicts": str(cache)})) == {"m:1:ROR:0"}


def test_reach_scenarios_pass_the_reference_and_catch_a_broken_variant():
    """bench.reach's straight-line scenarios (admit and free one block-aligned prompt three
    times) hold on the reference and fail on a variant that keeps a freed block cached."""
    sys.path.insert(0, str(REPO))
    from kvspec.spec.config import Config
    from kvspec.testing.implementations import factory

    from bench.reach import scenarios

    assert scenarios(factory("reference"), Config) == []
    found = scenarios(factory("broken:release-cached-as-free"), Config)
    assert found and "[conservation]" in found[0]


def test_verdict_lines_keep_what_a_run_found_and_drop_the_rest(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    from bench.verdicts import verdict_lines

    out = "\n".join(
        [
            "kvspec 0.1.0: checking v1 on vLLM 0.30.0",
            "│ window-bound             │ VIOLATED │ 3 │ 40 │ Sliding-window sequences hold only their │",
            "│ conservation             │ holds    │ 3 │ 40 │ Blocks are conserved │",
            "──── violation 1 of 2: kv-readback in step (known finding V1-S2a) ────",
            "every applicable invariant holds over 100 examples",
        ]
    )
    assert verdict_lines(out) == [
        "window-bound  VIOLATED  3  40  Sliding-window sequences hold only their",
        "violation 1 of 2: kv-readback in step (known finding V1-S2a)",
        "every applicable invariant holds over 100 examples",
    ]
