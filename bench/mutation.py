"""Mutation score of the oracle on vLLM's own block-manager code.

Nothing in the installed venv is touched.  For a target release:

1. the orchestrator copies each mutated module's source from the venv's site-packages into a
   temporary directory and enumerates mutants there (``bench.mutants``: operators, and why
   not mutmut/cosmic-ray);
2. *baseline*: a worker in the target venv loads every module from those copies, unmutated,
   through the same import hook the mutants use (bench/import_hook.py, a ``sys.meta_path`` finder),
   runs the oracle with the mutants' budget and records line coverage of the copies.  It
   must pass (no false alarm) or the target gets no score.  It also replays its own traces
   and keeps a digest of every observed state, for the equivalence check below;
3. a *uniform* sample of every generated mutant is drawn (per module in proportion, fixed
   seed); a sampled mutant whose lines the baseline never executed is *not covered*: it
   survives the oracle by construction (nothing it changes runs) and is not run;
4. a fork server in the target venv imports torch/vLLM's heavy parts once (none of the
   mutated modules), then forks one child per mutant, two at a time: the child installs the
   finder with the one mutation, imports the adapter (which imports the mutated module
   fresh, so every importer binds the mutated code), runs the oracle and reports:
   *killed* (SpecViolation, or a crash: any other exception), *timed out* (the parent kills
   the child at the limit), *survived*.  A survivor is replayed on the baseline's traces: if
   every observed state and outcome is identical it is *suspected equivalent*; otherwise the
   first difference is recorded (behaviour the spec accepts, or a bug the budget missed);
5. vLLM's own unit tests of the release (``bench.vllm_tests``: from its sdist) run through
   the same fork server on the same sample: once unmutated, recording which lines of the
   copies each test executes (the tests failing there -- a GPU, a model download -- are
   deselected and listed), then per mutant only the tests that execute one of its lines
   (every test for module-level code), stopping at the first failure.

Steps 2, 4 and 5 run in the target venv (bench/mutation_worker.py); this module orchestrates
them from the core venv, and bench/mutation_report.py renders the assembled result.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import shutil
import subprocess
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import attrs

from .common import (
    REPO,
    RESULTS,
    Timer,
    command_line,
    header,
    machine_info,
    python_for,
    save_result,
    split_target,
    table,
    write_section,
)
from .mutants import Mutant, enumerate_mutants
from .mutation_report import KILLED, _oracle_of, _progress_name, render_mutation


@attrs.frozen(kw_only=True)
class MutateOptions:
    """What one ``python -m bench mutate`` run does (cli/bench.py documents each option)."""

    targets: list[str] | None  # None: every target of TARGETS
    max_mutants: int  # the uniform sample's size per target
    invariants: list[str] | None  # the only invariants the oracle watches (None: every one)
    oracle: str  # "check" (what `kvspec check --vllm X` runs) or "narrow" (the KVCacheMachine)
    shape_examples: int | None  # scheduler-shape examples per mutant (None: ``examples``)
    reach: bool  # bench.reach's straight-line scenarios instead of the oracle (with ``assemble``)
    seeds: int | None  # each of ``keys`` under this many hypothesis seeds (with ``assemble``)
    search: str  # the machine: "default" (KVCacheMachine) or "swarm"
    assemble: str | None  # a kept work directory to rebuild a cut-short run's result from
    keys: list[str] | None  # exactly these mutants instead of a sample
    no_replay: bool  # do not replay a survivor on the baseline's traces
    no_vllm_tests: bool  # skip vLLM's own unit tests on the mutants
    vllm_tests_from: str | None = None  # an earlier mutation.json whose tests' verdicts to reuse
    first_verdict: bool = False  # --oracle lockstep: each PR verdict stops at its first verdict
    examples: int  # hypothesis examples per mutant
    timeout: float  # seconds per mutant
    jobs: int  # mutants run at a time
    modules: list[str] | None  # restrict to these module names
    list_only: bool  # only generate and count the mutants
    keep: bool  # keep the temporary work directory
    results: str | None  # the JSON results' directory (None: bench/results)
    md: str | None  # the markdown file to update (None: BENCHMARKS.md)

TARGETS: dict[str, dict[str, Any]] = {
    "v1@0.33.0": {
        # Mutated: the block pool, kv_cache_utils and the single-type managers; "served" ones
        # are loaded unmutated from the copies too, so that they bind the mutated modules when
        # they import them.
        "mutate": [
            "vllm.v1.core.block_pool",
            "vllm.v1.core.kv_cache_utils",
            "vllm.v1.core.single_type_kv_cache_manager",
        ],
        "served": ["vllm.v1.core.kv_cache_manager"],
        "preimport": ["torch", "vllm", "vllm.config", "vllm.sampling_params",
                      "vllm.v1.kv_cache_interface", "vllm.v1.request", "vllm.utils.hashing"],
        "workload": {"window": "any", "caching": "any", "swap": False, "max_blocks": 16},
    },
    "legacy-v2@0.6.3": {
        # vllm/core/block/*.py and block_manager_v2.py; the evictor is served, not mutated.
        "mutate": [
            "vllm.core.block.block_table",
            "vllm.core.block.common",
            "vllm.core.block.cpu_gpu_block_allocator",
            "vllm.core.block.interfaces",
            "vllm.core.block.naive_block",
            "vllm.core.block.prefix_caching_block",
            "vllm.core.block.utils",
            "vllm.core.block_manager_v2",
        ],
        "served": ["vllm.core.evictor_v2"],
        "preimport": ["torch", "vllm", "vllm.sequence", "vllm.core.interfaces", "vllm.utils",
                      "vllm.inputs", "vllm.config", "vllm.sampling_params"],
        # No lookahead: with lookahead slots and swap the unmutated code fails on FINDINGS F12
        # (can_swap_out ignores lookahead blocks), and a baseline must pass cleanly.
        # Nor frees of swapped-out sequences: they crash it (F13).
        "workload": {"window": "none", "caching": "off", "swap": True, "max_blocks": 16,
                     "max_lookahead": 0, "free_swapped": False},
    },
}

SAMPLE_SEED = 20240601
PER_TEST_LIMIT = 8  # seconds a vLLM test may take on the clean run (bench.vllm_tests)


# ---------------------------------------------------------------- orchestration


def site_packages(target: str) -> Path:
    venv = Path(python_for(target)).parent.parent
    found = glob.glob(str(venv / "lib" / "python*" / "site-packages"))
    if not found:
        raise SystemExit(f"no site-packages under {venv}")
    return Path(found[0])


def _covered(m: Mutant, cov_import: dict[str, set[int]], cov_run: dict[str, set[int]]) -> bool:
    span = set(range(m.lineno, m.end_lineno + 1))
    if span & cov_run.get(m.module, set()):
        return True
    return not m.in_function and bool(span & cov_import.get(m.module, set()))


def sample(mutants: list[Mutant], limit: int, seed: int = SAMPLE_SEED) -> list[Mutant]:
    """Deterministic stratified sample: each module gets its proportional share (largest
    remainder) taken from a fixed shuffle of its mutants; listed in source order."""
    if len(mutants) <= limit:
        return list(mutants)
    by_module: dict[str, list[Mutant]] = defaultdict(list)
    for m in mutants:
        by_module[m.module].append(m)
    quotas = {k: limit * len(v) / len(mutants) for k, v in by_module.items()}
    shares = {k: int(q) for k, q in quotas.items()}
    for k in sorted(quotas, key=lambda k: quotas[k] - shares[k], reverse=True)[
        : limit - sum(shares.values())
    ]:
        shares[k] += 1
    out = []
    for k, v in by_module.items():
        # A fixed shuffle, then its first n: a larger sample contains every smaller one.
        order = list(v)
        random.Random(f"{seed}-{k}").shuffle(order)
        out += sorted(order[: shares[k]], key=lambda m: (m.lineno, m.site, m.op, m.variant))
    return out


def _spawn_worker(target: str, task: str, params: dict[str, Any], log_path: Path,
                  stream: bool = False) -> dict[str, Any]:
    python = python_for(target)
    params_file = log_path.with_suffix(".params.json")
    params_file.write_text(json.dumps({**params, "target": target}))
    out = log_path.with_suffix(".out.json")
    # Offline: a test that needs a model download fails at once instead of retrying the hub
    # with back-off sleeps (it is then deselected as failing on the unmutated code).
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("CI", None)
    cmd = [python, "-m", "bench", "_worker", task, str(params_file), str(out)]
    with open(log_path, "w") as log:
        if stream:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=log, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                print("   ", line.rstrip(), flush=True)
            code = proc.wait()
        else:
            code = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=log).returncode
    if code != 0 or not out.exists():
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"{task} on {target} failed ({code}):\n" + "\n".join(tail))
    return json.loads(out.read_text())


def run_target(target: str, opts: MutateOptions, workdir: Path) -> dict[str, Any]:
    """Uniform sample of every generated mutant of the target's mutated modules; each one
    through the oracle (if the baseline covered it; an uncovered mutant survives by
    construction) and through vLLM's own unit tests of the release."""
    spec = TARGETS[target]
    modules = [m for m in spec["mutate"] if not opts.modules or m in opts.modules
               or m.rsplit(".", 1)[1] in opts.modules]
    site = site_packages(target)
    copies = workdir / "src"
    paths: dict[str, str] = {}
    mutants: list[Mutant] = []
    for name in spec["mutate"] + spec["served"]:  # every module is served from its copy, mutated or not
        src = site / (name.replace(".", "/") + ".py")
        dst = copies / (name.replace(".", "/") + ".py")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        paths[name] = str(dst)
        if name in modules:
            mutants += enumerate_mutants(name, src.read_text())
    print(f"{target}: {len(mutants)} mutants in {len(modules)} modules")
    if opts.list_only:
        return {"target": target, "generated": len(mutants),
                "by_module": dict(Counter(m.module for m in mutants))}
    progress = (Path(opts.results) if opts.results else RESULTS) / (
        _progress_name(target, opts.oracle))
    progress.parent.mkdir(parents=True, exist_ok=True)
    progress.write_text("")
    shape_examples = 0
    if opts.oracle == "check" and split_target(target)[0] == "v1":
        shape_examples = opts.shape_examples if opts.shape_examples is not None else opts.examples
    params = {"paths": paths, "preimport": spec["preimport"], "workload": spec["workload"],
              "examples": opts.examples, "steps": 40, "progress": str(progress),
              "focus": opts.invariants, "search": opts.search, "replay": not opts.no_replay,
              "replays_file": str(workdir / "replays.json"), "oracle": opts.oracle,
              "shape_examples": shape_examples}
    print(f"{target}: baseline (unmutated copies through the import hook, with coverage) ...")
    base = _spawn_worker(target, "mutation-baseline", params, workdir / "baseline.log")
    clean = base["clean"]
    params["reported"] = base.get("reported", [])
    for ident in params["reported"]:
        print(f"{target}: the unmutated code fails on {ident}: stepped past in every run")
    print(f"{target}: baseline {clean['status']} in {clean['seconds']:.1f}s "
          f"({clean['examples']} examples, {clean['operations']} steps)")
    result: dict[str, Any] = {"target": target, "modules": modules, "baseline": base,
                              "generated": len(mutants), "workload": spec["workload"],
                              "examples": opts.examples, "progress": str(progress)}
    if clean["status"] != "survived" or base["traced"]["status"] != "survived":
        result["error"] = ("the unmutated code does not pass the oracle with this budget: "
                           f"{clean.get('error') or base['traced'].get('error')}")
        print(f"{target}: {result['error']}")
        return result
    cov_import = {k: set(v) for k, v in base["coverage_import"].items()}
    cov_run = {k: set(v) for k, v in base["coverage_run"].items()}
    covered = {m.key for m in mutants if _covered(m, cov_import, cov_run)}
    chosen = sample(mutants, opts.max_mutants)
    if opts.keys:  # a re-run of chosen mutants (say, the survivors under another search)
        wanted = set(opts.keys)
        chosen = [m for m in mutants if m.key in wanted]
    outdir = workdir / "mutants"
    outdir.mkdir(exist_ok=True)
    tests = None
    recorded = _recorded_tests(opts.vllm_tests_from, target, chosen) if opts.vllm_tests_from else None
    if recorded is not None:
        result["vllm_tests"] = recorded["summary"]
    elif not opts.no_vllm_tests:
        tests = _vllm_tests_baseline(target, params, workdir, outdir)
        result["vllm_tests"] = tests
        if tests.get("error"):
            result["error"] = tests["error"]
            return result
    n_cov = sum(m.key in covered for m in chosen)
    print(f"{target}: uniform sample of {len(chosen)} of {len(mutants)} mutants, {n_cov} of "
          f"them covered by the baseline (timeout {opts.timeout:.0f}s, {opts.jobs} at a time)")
    identity = {"key": "identity", "module": None, "site": None, "op": None, "variant": None}
    jobs = [identity]
    not_run: dict[str, dict[str, Any]] = {}  # vLLM tests' verdicts that need no run
    verdicts = _verdicts(tests) if tests is not None else {}
    for m in chosen:
        job = {"key": m.key, "module": m.module, "site": m.site, "op": m.op,
               "variant": m.variant}
        if m.key in covered:
            jobs.append(job)
        if recorded is not None:
            not_run[m.key] = recorded["verdicts"][m.key]
        elif tests is not None:
            selected, limit = _tests_for(m, tests, workdir)
            if not selected:
                not_run[m.key] = {"status": "survived", "kind": "not covered by vLLM's tests"}
            elif m.key in verdicts:  # the tests do not depend on the oracle: run once
                not_run[m.key] = {**verdicts[m.key], "cached": True}
            else:
                jobs.append({**job, "kind": "vllm-tests", "timeout": limit, "tests": selected})
    if verdicts:
        print(f"{target}: vLLM's tests' verdicts of {sum('cached' in v for v in not_run.values())} "
              f"sampled mutants from {tests['verdicts']}")
    server = _spawn_worker(target, "mutation-server", {
        **params, "jobs": jobs, "jobs_max": opts.jobs, "timeout": opts.timeout,
        "tests": tests and tests["params"], "outdir": str(outdir),
        "verdicts": tests and tests["verdicts"]},
        workdir / "server.log", stream=True)
    kv = {r["key"]: r for r in server if r["job"] == "kvspec"}
    vt = {**{r["key"]: r for r in server if r["job"] == "vllm-tests"}, **not_run}
    if tests is not None:
        result["vllm_tests"] = {k: v for k, v in tests.items()
                                if not k.startswith("_") and k != "passing"}
    ident = kv.pop("identity", {"status": "missing"})
    result.update(
        identity=ident,
        covered=len(covered),
        covered_by_module=dict(Counter(m.module for m in mutants if m.key in covered)),
        generated_by_module=dict(Counter(m.module for m in mutants)),
        mutants=[{**_mutant_json(m), "covered": m.key in covered,
                  **(kv.get(m.key, {"status": "missing"}) if m.key in covered
                     else {"status": "not covered"}),
                  **({"vllm_tests": vt.get(m.key, {"status": "missing"})}
                     if tests or recorded is not None else {})}
                 for m in chosen],
    )
    if ident.get("status") not in ("survived", "equivalent"):
        result["error"] = f"the identity mutant (no mutation, fork server) failed: {ident}"
    return result


def _tests_for(m: Mutant, tests: dict[str, Any], workdir: Path) -> tuple[list[str], float]:
    """The vLLM tests a mutant needs (those whose baseline run executed one of its lines;
    every file for module-level code, which runs at import) and their time limit:
    3x their clean run + 60 s."""
    cov = tests.setdefault("_coverage", json.loads((workdir / "tests-coverage.json").read_text()))
    durations = tests["_durations"]
    if not m.in_function:
        return list(tests["files"]), 3 * sum(durations.values()) + 60
    span = set(range(m.lineno, m.end_lineno + 1))
    selected = [t for t, per in cov.items() if t in tests["passing"]
                and span & set(per.get(m.module, ()))]
    return selected, 3 * sum(durations.get(t, 0.0) for t in selected) + 60


def _recorded_tests(path: str, target: str, chosen: list[Mutant]) -> dict[str, Any]:
    """vLLM's tests' verdicts of ``chosen`` from an earlier run of ``target`` (its results file):
    the tests never see the oracle, so with the same release and mutants they stand.  Every
    chosen mutant must have one; each verdict says where it came from."""
    runs = [r for r in json.loads(Path(path).read_text())["results"]
            if r.get("target") == target and r.get("vllm_tests")]
    verdicts: dict[str, dict[str, Any]] = {}
    for run in runs:
        for m in run.get("mutants", []):
            if "vllm_tests" in m and m["vllm_tests"].get("status") != "missing":
                verdicts.setdefault(m["key"], {**m["vllm_tests"], "recorded": path})
    lacking = [m.key for m in chosen if m.key not in verdicts]
    if not runs or lacking:
        raise SystemExit(f"--vllm-tests-from {path}: no recorded verdict of vLLM's tests for "
                         f"{len(lacking) if runs else 'any'} sampled mutant(s) of {target} "
                         f"(first: {(lacking or ['-'])[0]})")
    summary = {k: v for k, v in runs[0]["vllm_tests"].items() if not k.startswith("_")}
    return {"summary": {**summary, "recorded": path}, "verdicts": verdicts}


def _tests_cache(root: Path, files: list[str], paths: dict[str, str]) -> Path:
    """The clean run with per-test coverage is the slow part: kept per (sources, test files)."""
    digest = hashlib.sha1(json.dumps([files, sorted(
        Path(path).read_text() for path in paths.values())]).encode()).hexdigest()[:16]
    return root / f"baseline-{digest}.json"


def _vllm_tests_baseline(target: str, params: dict[str, Any], workdir: Path,
                         outdir: Path) -> dict[str, Any]:
    """vLLM's own tests on the unmutated copies, through the fork server: the tests that fail
    there (a GPU, a model download) are deselected for every mutant, and listed."""
    from .vllm_tests import SUITES, tests_root

    version = split_target(target)[1]
    assert version is not None
    files = SUITES[version]
    root = str(tests_root(version))
    tp = {"root": root, "files": files, "deselect": [], "coverage": True,
          "per_test_limit": PER_TEST_LIMIT}
    identity = {"key": "identity", "module": None, "site": None, "op": None, "variant": None,
                "kind": "vllm-tests", "timeout": 3600}
    cached = _tests_cache(Path(root), files, params["paths"])
    if cached.exists():
        print(f"{target}: vLLM's own tests on the unmutated code: cached {cached}")
        (res,) = json.loads(cached.read_text())
    else:
        print(f"{target}: vLLM's own tests on the unmutated code ({', '.join(files)}) ...")
        results = _spawn_worker(target, "mutation-server", {
            **params, "progress": None, "jobs": [identity], "jobs_max": 1, "timeout": 3600,
            "tests": tp, "outdir": str(outdir)}, workdir / "tests-baseline.log", stream=True)
        (res,) = results
        # Kept once it ran to the end (tests failing on the unmutated code are deselected,
        # not a reason to run the whole suite again).
        if res.get("tests") and not res.get("collect_errors"):
            cached.write_text(json.dumps(results))
    tests = res.get("tests", {})
    failing = sorted(t for t, o in tests.items() if o == "failed")
    (workdir / "tests-coverage.json").write_text(json.dumps(res.pop("coverage", {})))
    durations = res.pop("durations", {})
    reasons = res.get("reasons", {})
    out = {"version": version, "files": files, "root": root, "baseline": {
        k: v for k, v in res.items() if k not in ("tests", "reasons")},
        "deselected": [{"test": t, "why": reasons.get(t, "")} for t in failing],
        "skipped": sorted(t for t, o in tests.items() if o == "skipped"),
        "passed": sum(o == "passed" for o in tests.values())}
    if not out["passed"] or res.get("collect_errors"):
        out["error"] = (f"vLLM's tests did not run on the unmutated code: {res.get('status')} "
                        f"{res.get('first_failure') or res.get('error')}")[:400]
        return out
    out["params"] = {**tp, "deselect": failing, "coverage": False}
    out["verdicts"] = str(cached.with_name(cached.name.replace("baseline-", "verdicts-")
                                           .replace(".json", ".jsonl")))
    out["passing"] = sorted(t for t, o in tests.items() if o == "passed")
    out["_durations"] = durations
    print(f"{target}: vLLM's tests: {out['passed']} passed, {len(out['skipped'])} skipped, "
          f"{len(failing)} failing on the unmutated code (deselected) in {res['seconds']:.0f}s")
    return out


def _verdicts(tests: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """vLLM's tests' verdicts of mutants from earlier runs on the same sources and test files
    (kept beside the cached clean run): the tests never see the oracle, so a mutant's verdict
    does not change with it (a timeout at 3x the clean time + 60 s is reused as the kill it is)."""
    path = Path(tests["verdicts"])
    if not path.exists():
        return {}
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {r["key"]: r for r in rows if r.get("status") in ("killed", "survived", "timeout")}


def _mutant_json(m: Mutant) -> dict[str, Any]:
    return {"key": m.key, "module": m.module, "line": m.lineno, "op": m.op,
            "original": m.original, "mutated": m.mutated, "describe": m.describe()}


def assemble(target: str, workdir: Path, opts: MutateOptions) -> dict[str, Any]:
    """A target's result rebuilt from a kept work directory (``--keep``) and the progress
    file, for a run cut short: mutants without both verdicts are *missing* and left out of
    every figure (the render says how many)."""
    spec = TARGETS[target]
    modules = [m for m in spec["mutate"] if not opts.modules or m in opts.modules]
    mutants: list[Mutant] = []
    for name in modules:
        mutants += enumerate_mutants(name, (workdir / "src" / (name.replace(".", "/") + ".py"))
                                     .read_text())
    base = json.loads((workdir / "baseline.out.json").read_text())
    cov_import = {k: set(v) for k, v in base["coverage_import"].items()}
    cov_run = {k: set(v) for k, v in base["coverage_run"].items()}
    covered = {m.key for m in mutants if _covered(m, cov_import, cov_run)}
    chosen = sample(mutants, opts.max_mutants)
    jobs = json.loads((workdir / "server.params.json").read_text())["jobs"]
    has_tests = any(j.get("kind") == "vllm-tests" for j in jobs)
    tested = {j["key"] for j in jobs if j.get("kind") == "vllm-tests"}
    progress = (Path(opts.results) if opts.results else RESULTS) / (
        _progress_name(target, opts.oracle))
    rows = [json.loads(x) for x in progress.read_text().splitlines() if x.strip()]
    kv = {r["key"]: r for r in rows if r["job"] == "kvspec"}
    vt = {r["key"]: r for r in rows if r["job"] == "vllm-tests"}
    result: dict[str, Any] = {"target": target, "modules": modules, "baseline": base,
                              "generated": len(mutants), "workload": spec["workload"],
                              "examples": opts.examples, "progress": str(progress),
                              "partial": True, "identity": kv.get("identity", {})}
    if has_tests:
        from .vllm_tests import SUITES, cache_root

        version = split_target(target)[1]
        here = workdir / "tests-baseline.out.json"
        if not here.exists():  # the run took it from the cache
            paths = {n: str(workdir / "src" / (n.replace(".", "/") + ".py"))
                     for n in spec["mutate"] + spec["served"]}
            here = _tests_cache(cache_root(str(version)), SUITES[str(version)], paths)
        (res,) = json.loads(here.read_text())
        tests = res.get("tests", {})
        reasons = res.get("reasons", {})
        failing = sorted(t for t, o in tests.items() if o == "failed")
        result["vllm_tests"] = {
            "version": version, "files": SUITES[str(version)], "root": str(cache_root(
                str(version))), "baseline": {k: v for k, v in res.items()
                                             if k not in ("tests", "reasons", "coverage",
                                                          "durations")},
            "deselected": [{"test": t, "why": reasons.get(t, "")} for t in failing],
            "skipped": sorted(t for t, o in tests.items() if o == "skipped"),
            "passed": sum(o == "passed" for o in tests.values())}

    def verdict(m: Mutant) -> dict[str, Any]:
        if not has_tests:
            return {}
        if m.key not in tested:
            return {"vllm_tests": {"status": "survived", "kind": "not covered by vLLM's tests"}}
        return {"vllm_tests": vt.get(m.key, {"status": "missing"})}

    result.update(
        covered=len(covered),
        covered_by_module=dict(Counter(m.module for m in mutants if m.key in covered)),
        generated_by_module=dict(Counter(m.module for m in mutants)),
        mutants=[{**_mutant_json(m), "covered": m.key in covered,
                  **(kv.get(m.key, {"status": "missing"}) if m.key in covered
                     else {"status": "not covered"}), **verdict(m)} for m in chosen])
    return result


def _assembled(target: str, workdir: Path) -> tuple[dict[str, Any], dict[str, str], list[Mutant]]:
    """A kept run's target table entry, its module copies and every mutant generated in them."""
    spec = TARGETS[target]
    paths = {n: str(workdir / "src" / (n.replace(".", "/") + ".py"))
             for n in spec["mutate"] + spec["served"]}
    mutants: list[Mutant] = []
    for name in spec["mutate"]:
        mutants += enumerate_mutants(name, Path(paths[name]).read_text())
    return spec, paths, mutants


def cmd_reach(opts: MutateOptions) -> dict[str, Any]:
    """``--reach --assemble WORKDIR``: the straight-line scenarios of ``bench.reach`` on every
    mutant the kept run's baseline covered (or on ``--keys``); saved as ``reach-<impl>.json``."""
    from .reach import SHAPES

    (target,) = opts.targets
    workdir = Path(opts.assemble)
    spec, paths, mutants = _assembled(target, workdir)
    base = json.loads((workdir / "baseline.out.json").read_text())
    cov_import = {k: set(v) for k, v in base["coverage_import"].items()}
    cov_run = {k: set(v) for k, v in base["coverage_run"].items()}
    chosen = ([m for m in mutants if m.key in set(opts.keys)] if opts.keys else
              [m for m in mutants if _covered(m, cov_import, cov_run)])
    identity = {"key": "identity", "module": None, "site": None, "op": None, "variant": None}
    jobs = [identity] + [{"key": m.key, "module": m.module, "site": m.site, "op": m.op,
                          "variant": m.variant} for m in chosen]
    print(f"{target}: straight-line scenarios on {len(chosen)} mutants ...")
    with Timer() as timer:
        found = _spawn_worker(target, "mutation-reach", {
            "paths": paths, "preimport": spec["preimport"], "jobs": jobs},
            workdir / "reach.log")
    if found.pop("identity"):
        raise RuntimeError("the scenarios fail on the unmutated code: nothing to conclude")
    by_key = {m.key: m for m in chosen}
    rows = [{**_mutant_json(by_key[k]), "scenarios": v} for k, v in found.items() if v]
    result = {"target": target, "command": command_line(), "machine": machine_info(),
              "seconds": timer.seconds, "mutants": len(chosen), "killed": rows,
              "shapes": [list(x) for x in SHAPES]}
    path = (Path(opts.results) if opts.results else RESULTS) / (
        f"reach-{split_target(target)[0]}.json")
    path.write_text(json.dumps(result, indent=1))
    print(f"{len(rows)} of {len(chosen)} mutants killed by a scenario; {path}")
    return result


def cmd_seeds(opts: MutateOptions) -> dict[str, Any]:
    """``--seeds N --keys ... --assemble WORKDIR``: each mutant through the oracle under N
    hypothesis seeds (random search, not derandomized) with ``--search``'s machine and the
    run's budget; saved as ``search-<search>-<impl>.json`` (the search evidence)."""
    (target,) = opts.targets
    workdir = Path(opts.assemble)
    spec, paths, mutants = _assembled(target, workdir)
    chosen = [m for m in mutants if m.key in set(opts.keys or ())]
    shape_examples = 0
    if opts.oracle == "check" and split_target(target)[0] == "v1":
        shape_examples = opts.shape_examples if opts.shape_examples is not None else opts.examples
    jobs = [{"key": f"{m.key}#{seed}", "module": m.module, "site": m.site, "op": m.op,
             "variant": m.variant, "seed": seed} for m in chosen for seed in range(opts.seeds)]
    outdir = workdir / f"seeds-{opts.search}"
    outdir.mkdir(exist_ok=True)
    print(f"{target}: {len(chosen)} mutants x {opts.seeds} seeds, search {opts.search}")
    with Timer() as timer:
        rows = _spawn_worker(target, "mutation-server", {
            "paths": paths, "preimport": spec["preimport"], "workload": spec["workload"],
            "examples": opts.examples, "steps": 40, "progress": None, "focus": opts.invariants,
            "search": opts.search, "replay": False, "oracle": opts.oracle,
            "shape_examples": shape_examples, "jobs": jobs, "jobs_max": opts.jobs,
            "timeout": opts.timeout, "tests": None, "outdir": str(outdir)},
            workdir / f"seeds-{opts.search}.log", stream=True)
    result = {"target": target, "command": command_line(), "machine": machine_info(),
              "seconds": timer.seconds, "search": opts.search, "seeds": opts.seeds,
              "examples": opts.examples, "oracle": opts.oracle, "shape_examples": shape_examples,
              "mutants": [_mutant_json(m) for m in chosen], "runs": rows}
    path = (Path(opts.results) if opts.results else RESULTS) / (
        f"search-{opts.search}-{split_target(target)[0]}.json")
    path.write_text(json.dumps(result, indent=1))
    for m in chosen:
        mine = [r for r in rows if r["key"].rsplit("#", 1)[0] == m.key]
        print(f"  {m.describe()[:90]}: killed in {sum(r['status'] in KILLED for r in mine)} of "
              f"{len(mine)} seeds")
    both = {k: path.with_name(f"search-{k}-{split_target(target)[0]}.json")
            for k in ("default", "swarm")}
    if all(p.exists() for p in both.values()):
        write_section("mutation-search", render_search(
            {k: json.loads(p.read_text()) for k, p in both.items()}),
            Path(opts.md) if opts.md else None)
    return result


def render_search(runs: dict[str, dict[str, Any]]) -> str:
    """The search evidence: per mutant, how many seeds each machine killed it in (a violation
    or a crash; a run cut at the time limit is not a kill here: the other machine ran the same
    mutant), and the median examples to the kill (load-independent, unlike seconds)."""
    import statistics

    first = runs["default"]
    parts = [header(first["command"], first["machine"], first.get("seconds")),
             "", f"Same budget for both machines: {first['examples']} hypothesis examples per "
             f"seed (random search, seeds 0-{first['seeds'] - 1}), 40 steps, no shrinking, "
             f"oracle `{first['oracle']}` without the scheduler shapes (the block-manager "
             "machine is what the search changes); the swarm runs are the same commands with "
             "`--search swarm`.", ""]
    rows = []
    for m in first["mutants"]:
        row: list[Any] = [m["describe"]]
        for name in ("default", "swarm"):
            mine = [r for r in runs[name]["runs"] if r["key"].rsplit("#", 1)[0] == m["key"]]
            kills = [r for r in mine if r["status"] == "killed"]
            cut = sum(r["status"] == "timeout" for r in mine)
            row += [f"{len(kills)}/{len(mine)}" + (f" ({cut} cut at the time limit)" if cut else ""),
                    f"{statistics.median(r['examples'] for r in kills):.0f}" if kills else "-"]
        rows.append(row)
    total = {name: sum(r["status"] == "killed" for r in runs[name]["runs"]) for name in runs}
    parts += [table(["mutant", "default: seeds killed", "median examples to the kill",
                     "swarm: seeds killed", "median examples to the kill"], rows), "",
              f"Kills over all mutant x seed runs: default {total['default']}/"
              f"{len(runs['default']['runs'])}, swarm {total['swarm']}/"
              f"{len(runs['swarm']['runs'])}."]
    return "\n".join(parts)


def cmd_mutate(opts: MutateOptions) -> dict[str, Any]:
    """Run the targets one after the other; each target's result (with its own command,
    machine and settings) is saved as soon as it is done, replacing an earlier result for
    the same target and keeping the others."""
    if opts.reach:
        return cmd_reach(opts)
    if opts.seeds:
        return cmd_seeds(opts)
    if opts.oracle == "lockstep":
        from .lockstep_mutation import measure

        (target,) = opts.targets
        flags = ("--no-verify", *(("--first-verdict",) if opts.first_verdict else ()))
        rows = measure(target, split_target(target)[1], site_packages(target),
                       Path(opts.results) if opts.results else RESULTS, opts.timeout, opts.keys, flags)
        return {"target": target, "rows": rows}
    targets = opts.targets or list(TARGETS)
    results_dir = Path(opts.results) if opts.results else None
    md = Path(opts.md) if opts.md else None
    settings = {"examples": opts.examples, "timeout": opts.timeout, "jobs": opts.jobs,
                "oracle": opts.oracle, "shape_examples": opts.shape_examples,
                "invariants": opts.invariants, "search": opts.search,
                "max_mutants": opts.max_mutants, "seed": SAMPLE_SEED}
    data: dict[str, Any] = {"results": []}
    for target in targets:
        info = machine_info()
        workdir = (Path(opts.assemble) if opts.assemble else
                   Path(tempfile.mkdtemp(prefix=f"kvspec-mut-{split_target(target)[0]}-")))
        try:
            with Timer() as timer:
                result = (assemble(target, workdir, opts) if opts.assemble
                          else run_target(target, opts, workdir))
        finally:
            if not opts.keep and not opts.assemble:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                print(f"kept {workdir}")
        if opts.list_only:
            print(result)
            continue
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        result.update(machine=info, command=command_line(), settings=settings,
                      seconds=timer.seconds)
        path = (results_dir or RESULTS) / "mutation.json"
        data = json.loads(path.read_text()) if path.exists() else {"results": []}
        # One result per target and oracle: a run under the CLI's oracle keeps the narrowed
        # oracle's figures beside it.
        data["results"] = [r for r in data["results"] if (r["target"], _oracle_of(r)) != (
            target, opts.oracle)] + [result]
        order = list(TARGETS)
        data["results"].sort(key=lambda r: (order.index(r["target"]) if r["target"] in order
                                             else len(order), _oracle_of(r) != "check"))
        save_result("mutation", data, results_dir)
        write_section("mutation", render_mutation(data), md)
    return data
