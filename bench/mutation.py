"""Mutation score of the oracle on vLLM's own block-manager code.

Nothing in the installed venv is touched.  For a target release:

1. the orchestrator copies each mutated module's source from the venv's site-packages into a
   temporary directory and enumerates mutants there (``bench.mutants``: operators, and why
   not mutmut/cosmic-ray);
2. *baseline*: a worker in the target venv loads every module from those copies, unmutated,
   through the same import hook the mutants use (``_Finder``, a ``sys.meta_path`` finder),
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
"""

from __future__ import annotations

import glob
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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
from .mutants import Mutant, enumerate_mutants, mutate_tree


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


# ---------------------------------------------------------------- the import hook


class _Loader(importlib.abc.Loader):
    def __init__(self, path: str, mutation: dict[str, Any] | None) -> None:
        self.path = path
        self.mutation = mutation

    def create_module(self, spec):  # default module creation
        return None

    def exec_module(self, module) -> None:
        source = Path(self.path).read_text()
        if self.mutation is None:
            code = compile(source, self.path, "exec")
        else:
            m = self.mutation
            tree, _ = mutate_tree(source, m["module"], m["site"], m["op"], m["variant"])
            code = compile(tree, self.path, "exec")
        module.__file__ = self.path
        exec(code, module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the target modules from the temporary copies (one of them mutated)."""

    def __init__(self, paths: dict[str, str], mutation: dict[str, Any] | None = None) -> None:
        self.paths = paths
        self.mutation = mutation

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.paths:
            return None
        mutation = self.mutation if (self.mutation or {}).get("module") == fullname else None
        return importlib.machinery.ModuleSpec(
            fullname, _Loader(self.paths[fullname], mutation), origin=self.paths[fullname]
        )


def _install(paths: dict[str, str], mutation: dict[str, Any] | None = None) -> None:
    loaded = [m for m in paths if m in sys.modules]
    if loaded:
        raise RuntimeError(f"mutated modules already imported before the hook: {loaded}")
    sys.meta_path.insert(0, _Finder(paths, mutation))


def _check_loaded(paths: dict[str, str]) -> None:
    for name, path in paths.items():
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None) != path:
            raise RuntimeError(f"{name} was imported from {mod.__file__}, not the copy {path}")


# ---------------------------------------------------------------- oracle runs (worker side)


def _canon(state) -> str:
    def pool(p):
        if p is None:
            return None
        return (tuple(p.ids), tuple(sorted(p.refcounts.items())), tuple(p.free),
                tuple(p.evictable), tuple(sorted((repr(k), b) for k, b in p.cached)),
                tuple(sorted(p.computed)),
                None if p.epochs is None else tuple(sorted(p.epochs.items())))

    tables = tuple(sorted((s, t.device.value, t.slots) for s, t in state.tables.items()))
    return hashlib.sha1(repr((pool(state.gpu), pool(state.cpu), tables)).encode()).hexdigest()


def _replay_digests(make, config, trace) -> tuple[list[str], list[str], str]:
    """Replay a trace through the Driver recording every observed state; also the outcomes
    and the first violation or crash ('' if none)."""
    from kvspec.testing.driver import Driver, apply_step

    impl = make(config)
    digests: list[str] = []
    observe = impl.observe

    def recording():
        state = observe()
        digests.append(_canon(state))
        return state

    impl.observe = recording
    driver = Driver(impl)
    problem = ""
    try:
        for step in trace:
            apply_step(driver, step)
            found = driver.check()
            if found:
                problem = f"violation {found[0]}"
                break
    except Exception as err:  # a crash on the replay: say where (vLLM, adapter or driver)
        import traceback

        frame = traceback.extract_tb(err.__traceback__)[-1]
        where = frame.filename.split("site-packages/")[-1].replace(str(REPO) + "/", "")
        problem = f"crash {type(err).__name__}: {err} at {where}:{frame.lineno}"
    return digests, [s.outcome for s in driver.trace], problem[:300]


def _check_factory(make):
    """The factory as ``kvspec check`` calls it: a configuration the target declares
    unsupported (ConfigError or Unsupported) rejects the example instead of failing it."""
    from kvspec.spec.errors import ConfigError, Unsupported

    def build(config):
        try:
            return make(config)
        except Unsupported as error:
            raise ConfigError(str(error)) from error

    return build


def _known_step_past(impl: str, version: str | None, reported: list[dict[str, str]] = ()):
    """The step-past policy of ``kvspec check``'s rounds: every shipped known finding of this
    implementation and release is stepped past (the example discarded, or gone on past a
    violation the finding declares ``go_on``), and so is every failure whose identity is in
    ``reported`` (the unmutated code's own failures, found by the baseline's rounds); the
    first other failure is a kill.  None when there is nothing to step past."""
    from kvspec.cli.search import Sieve
    from kvspec.testing.known import SHIPPED, Fingerprint, load_known

    mine = [k for k in load_known([SHIPPED]) if k.concerns(impl, version)]
    if not mine and not reported:
        return None
    ids = frozenset(r["known"] if "known" in r else Fingerprint(**r) for r in reported)
    return Sieve(reported=ids, known=mine, stepped=frozenset(k.id for k in mine))


def _identity_json(sieve) -> dict[str, str] | None:
    """The identity of the failure that ended a run under ``sieve`` (JSON), if any."""
    target = getattr(sieve, "target", None)
    if target is None:
        return None
    return {"known": target} if isinstance(target, str) else target.to_json()


MAX_BASELINE_ROUNDS = 8  # distinct failures of the unmutated code a baseline steps past


def _shapes(focus: list[str] | None, examples: int, steps: int) -> dict[str, Any]:
    """The scheduler-shapes half of ``kvspec check`` on V1 (cli/shapes.py): vLLM's own
    Scheduler/AsyncScheduler in hybrid, async, spec-decode, budget and startup-minimum
    shapes, with the ci profile's derandomized search and this budget."""
    from kvspec.cli.shapes import run_shapes, scheduler_factory

    o = run_shapes(scheduler_factory(), profile="ci", examples=examples, steps=steps,
                   seed=None, focus=tuple(focus) if focus else None)
    out: dict[str, Any] = {"status": o.status, "examples": o.examples,
                           "operations": o.operations, "seconds": o.seconds,
                           "per_shape": dict(o.counts.examples)}
    if o.violations:
        out["invariants"] = sorted({v.invariant for v in o.violations})
        out["error"] = str(o.violations[0])[:300]
    elif o.difference is not None:
        out["differs"] = str(o.difference)[:300]
    elif o.error:
        out["error"] = o.error[:300]
    return out


def _oracle(target: str, workload: dict, examples: int, steps: int,
            record: bool = False, focus: list[str] | None = None,
            search: str = "default", oracle: str = "narrow",
            shape_examples: int = 0, seed: int | None = None,
            reported: list[dict[str, str]] = ()) -> dict[str, Any]:
    """One oracle run.  ``narrow``: the KVCacheMachine on the target's bench workload.
    ``check``: what ``kvspec check --vllm X`` runs by default -- the KVCacheMachine on the
    CLI's configuration strategy (every feature the target supports: extra keys, KV events),
    then, on V1, the scheduler machine's shapes with ``shape_examples`` examples.  ``seed``:
    a random search under that hypothesis seed instead of the derandomized one."""
    from hypothesis import Phase
    from hypothesis.errors import HypothesisException
    from kvspec.testing import KVCacheMachine, RunStats, SpecViolation

    from .common import factory, hypothesis_settings, machine_options, run_machine, strategy

    impl, version = split_target(target)
    make = factory(impl)
    opts: dict[str, Any] = {}
    if oracle == "check":
        from kvspec.cli.run import config_strategy

        make = _check_factory(make)
        sieve = _known_step_past(impl, version, reported)
        if sieve is not None:
            opts["step_past"] = sieve
    runs: list[tuple[Any, list]] = []

    class Recorder(RunStats):
        def add(self, driver) -> None:
            super().add(driver)
            if record:
                runs.append((driver.config, [s.to_json() for s in driver.trace]))

    stats = Recorder()
    strat = config_strategy(impl, {}) if oracle == "check" else strategy(workload)
    # No shrinking: a mutant is killed by its first failing example.
    settings = hypothesis_settings(max_examples=examples, steps=steps,
                                   phases=[Phase.explicit, Phase.generate],
                                   derandomize=seed is None)
    out: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        if oracle != "check":
            opts = machine_options(workload)
        machine = KVCacheMachine
        if search == "swarm":
            from kvspec.testing.swarm import SwarmMachine as machine
        run_machine(lambda: machine(make, strat, stats=stats, focus=focus, **opts), settings,
                    seed=seed)
        out["status"] = "survived"
        if shape_examples:
            shapes = _shapes(focus, shape_examples, steps)
            out["shapes"] = shapes
            if shapes["status"] == "violated":
                out.update(status="killed", kind="violation", invariants=shapes["invariants"],
                           error=f"scheduler shapes: {shapes['error']}")
            elif shapes["status"] == "differs":
                out.update(status="killed", kind="policy difference: scheduler shapes",
                           error=shapes.get("differs", ""))
            elif shapes["status"] == "error":
                out.update(status="killed", kind="crash: scheduler shapes",
                           error=shapes.get("error", ""))
            elif shapes["status"] == "no-examples":
                out.update(status="killed", kind="hypothesis: scheduler shapes ran nothing",
                           error=shapes.get("error", ""))
    except SpecViolation as err:
        out["status"] = "killed"
        out["kind"] = "violation"
        out["invariants"] = sorted({v.invariant for v in err.violations})
        out["error"] = str(err.violations[0])[:300]
    except HypothesisException as err:  # Unsatisfiable (every config rejected), Flaky, ...
        import traceback

        out["status"] = "killed"
        out["kind"] = f"hypothesis: {type(err).__name__}"
        out["error"] = str(err)[:300]
        inner = next(iter(getattr(err, "exceptions", ())), None)  # a Flaky failure's cause
        if inner is not None:
            out["error"] += f" -- {type(inner).__name__}: {inner}"[:300]
            out["where"] = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                            for f in traceback.extract_tb(inner.__traceback__)[-8:]]
    except Exception as err:  # vLLM (or the adapter) crashed: assertion, IndexError, ...
        import traceback

        out["status"] = "killed"
        out["kind"] = f"crash: {type(err).__name__}"
        out["error"] = f"{type(err).__name__}: {err}"[:300]
        out["where"] = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                        for f in traceback.extract_tb(err.__traceback__)[-6:]]
    out["seconds"] = time.perf_counter() - start
    if "step_past" in opts:
        out["known_fired"] = dict(opts["step_past"].fired)
        out["identity"] = _identity_json(opts["step_past"])
    out["examples"] = stats.examples
    out["operations"] = stats.operations
    out["_runs"] = runs
    out["_make"] = make
    return out


class _LineRecorder:
    """The lines of the copies that run, as (file, line) pairs.  coverage.py's C tracer when
    the release's test deps hold it (bench.vllm_tests installs it there): it adds no Python
    frame per call, so a deep recursion of the target behaves as it does untraced; else a
    ``sys.settrace`` line tracer."""

    def __init__(self, by_file: dict[str, str], target: str) -> None:
        self.by_file = by_file
        self.coverage = None
        version = split_target(target)[1]
        if version is not None:
            from .vllm_tests import cache_root

            deps = cache_root(version) / "deps"
            if (deps / "coverage").is_dir():
                sys.path.insert(0, str(deps))
                try:
                    import coverage

                    self.coverage = coverage
                except ImportError:
                    pass

    def recording(self, into: set):
        import contextlib
        import threading

        @contextlib.contextmanager
        def run():
            if self.coverage is not None:
                cov = self.coverage.Coverage(data_file=None, include=list(self.by_file))
                cov.start()
                try:
                    yield
                finally:
                    cov.stop()
                    data = cov.get_data()
                    for f in self.by_file:
                        into.update((f, line) for line in data.lines(f) or ())
                return

            def local(frame, event, arg):
                if event == "line":
                    into.add((frame.f_code.co_filename, frame.f_lineno))
                return local

            def tracer(frame, event, arg):
                if frame.f_code.co_filename in self.by_file:
                    into.add((frame.f_code.co_filename, frame.f_lineno))
                    return local
                return None

            sys.settrace(tracer)
            threading.settrace(tracer)
            try:
                yield
            finally:
                sys.settrace(None)
                threading.settrace(None)

        return run()


def baseline(p: dict[str, Any]) -> dict[str, Any]:
    """Unmutated copies through the hook: coverage, a clean pass, and the trace digests."""
    paths: dict[str, str] = p["paths"]
    by_file = {path: name for name, path in paths.items()}
    phase: dict[str, set] = {"import": set(), "run": set()}
    recorder = _LineRecorder(by_file, p["target"])

    for name in p["preimport"]:
        __import__(name)
    _install(paths)
    from kvspec.spec.config import Config

    from .common import factory

    # Import (and build once) under the recorder: module-level lines count as import coverage.
    with recorder.recording(phase["import"]):
        factory(split_target(p["target"])[0])(Config(block_size=4, num_blocks=8,
                                                     prefix_caching=True))
    # kvspec check's rounds on the unmutated code: each failure it still shows (beyond the
    # known findings) is stepped past from then on, in the baseline and in every mutant.
    reported: list[dict[str, str]] = []
    rounds: list[dict[str, Any]] = []
    while p.get("oracle") == "check" and len(rounds) < MAX_BASELINE_ROUNDS:
        r = _oracle(p["target"], p["workload"], p["examples"], p["steps"],
                    focus=p.get("focus"), search=p.get("search", "default"), oracle="check",
                    shape_examples=p.get("shape_examples", 0), reported=reported)
        rounds.append({k: v for k, v in r.items() if not k.startswith("_")})
        if r["status"] == "survived" or not r.get("identity"):
            break
        reported.append(r["identity"])
    with recorder.recording(phase["run"]):
        traced = _oracle(p["target"], p["workload"], p["examples"], p["steps"],
                         focus=p.get("focus"), search=p.get("search", "default"),
                         oracle=p.get("oracle", "narrow"),
                         shape_examples=p.get("shape_examples", 0), reported=reported)
    _check_loaded(paths)
    # The same budget again without the tracer: the clean pass the mutants are held to.
    clean = _oracle(p["target"], p["workload"], p["examples"], p["steps"], record=True,
                    focus=p.get("focus"), search=p.get("search", "default"),
                    oracle=p.get("oracle", "narrow"),
                    shape_examples=p.get("shape_examples", 0), reported=reported)
    replays = []
    for config, trace in clean["_runs"] if p.get("replay", True) else []:
        d1, o1, prob1 = _replay_digests(clean["_make"], config, trace)
        d2, _o2, _ = _replay_digests(clean["_make"], config, trace)
        replays.append({"config": _config_json(config), "trace": trace, "digests": d1,
                        "outcomes": o1, "deterministic": d1 == d2, "problem": prob1})
    Path(p["replays_file"]).write_text(json.dumps(replays))

    def lines(kind: str) -> dict[str, list[int]]:
        out: dict[str, list[int]] = defaultdict(list)
        for f, line in phase[kind]:
            out[by_file[f]].append(line)
        return {k: sorted(v) for k, v in out.items()}

    return {
        "reported": reported,
        "rounds": rounds,
        "traced": {k: v for k, v in traced.items() if not k.startswith("_")},
        "clean": {k: v for k, v in clean.items() if not k.startswith("_")},
        "coverage_import": lines("import"),
        "coverage_run": lines("run"),
        "replays": len(replays),
        "nondeterministic_replays": sum(not r["deterministic"] for r in replays),
        "replay_problems": [r["problem"] for r in replays if r["problem"]][:5],
    }


def _config_json(config) -> dict[str, Any]:
    return attrs.asdict(config)


def _equivalence(make, replays_file: str) -> str:
    from kvspec.spec.config import Config

    replays = json.loads(Path(replays_file).read_text())
    for i, r in enumerate(replays):
        config = Config(**r["config"])
        try:
            digests, outcomes, problem = _replay_digests(make, config, r["trace"])
        except Exception as err:  # building the manager failed
            return f"replay {i}: crash {type(err).__name__}: {err}"[:300]
        # An earlier different outcome (say, a refused admission) explains a later crash of
        # the replay (the trace then names a sequence that is not running): report it first.
        step = next((j for j, (a, b) in enumerate(zip(outcomes, r["outcomes"], strict=False))
                     if a != b), None)
        if step is not None:
            return (f"replay {i} step {step + 1}: `{r['outcomes'][step]}` became "
                    f"`{outcomes[step]}`")[:300]
        if problem:
            return f"replay {i}: {problem}"
        if len(outcomes) != len(r["outcomes"]):
            return f"replay {i}: {len(outcomes)} steps instead of {len(r['outcomes'])}"
        if digests != r["digests"]:
            j = next((j for j, (a, b) in enumerate(zip(digests, r["digests"], strict=False))
                      if a != b), min(len(digests), len(r["digests"])))
            return f"replay {i}: observed state differs at observation {j + 1}"
    return ""


def _run_child(p: dict[str, Any], job: dict[str, Any], out_path: str) -> None:
    mutation = None if job["site"] is None else job
    _install(p["paths"], mutation)
    if job.get("kind") == "vllm-tests":
        _run_vllm_tests(p, mutation, out_path)
        return
    res = _oracle(p["target"], p["workload"], p["examples"], p["steps"],
                  focus=p.get("focus"), search=p.get("search", "default"),
                  oracle=p.get("oracle", "narrow"),
                  shape_examples=p.get("shape_examples", 0), seed=job.get("seed"),
                  reported=p.get("reported", []))
    _check_loaded(p["paths"])
    if res["status"] == "survived" and p.get("replay", True):
        diff = _equivalence(res["_make"], p["replays_file"])
        res["replay"] = diff
        if not diff:
            res["status"] = "equivalent"
    Path(out_path).write_text(json.dumps({k: v for k, v in res.items()
                                          if not k.startswith("_")}))


def _run_vllm_tests(p: dict[str, Any], mutation: dict[str, Any] | None, out_path: str) -> None:
    """vLLM's own unit tests on this (possibly mutated) code: killed when any test fails,
    a file fails to import, or nothing ran.  The unmutated run goes to the end and records
    every test's outcome; a mutant's run stops at its first failure."""
    from . import vllm_tests

    t = p["tests"]
    if mutation is None:
        by_file = {path: name for name, path in p["paths"].items()}
        res = vllm_tests.run(t["root"], t["files"], t["deselect"], first_failure=False,
                             coverage=by_file if t.get("coverage") else None,
                             per_test_limit=t.get("per_test_limit"))
    else:
        res = vllm_tests.run(t["root"], mutation.get("tests") or t["files"], t["deselect"],
                             first_failure=True)
    _check_loaded(p["paths"])
    out = {"status": "survived" if res["exit_code"] == 0 else "killed", "kind": "tests",
           "exit_code": res["exit_code"], "seconds": res["seconds"], "counts": res["counts"],
           "first_failure": res["first_failure"] or "; ".join(res["collect_errors"])[:300]}
    if mutation is None:
        out["tests"] = res["tests"]
        out["reasons"] = res["reasons"]
        for k in ("coverage", "durations"):
            if k in res:
                out[k] = res[k]
        out["collect_errors"] = res["collect_errors"]
    Path(out_path).write_text(json.dumps(out))


def worker_main(task: str, params_file: str, out: str) -> None:
    p = json.loads(Path(params_file).read_text())
    if task == "mutation-server":
        server_main(p, out)
    elif task == "mutation-baseline":
        Path(out).write_text(json.dumps(baseline(p), default=str))
    elif task == "mutation-reach":
        from . import reach

        reach.main(params_file, out)
    else:
        raise SystemExit(f"unknown task {task}")


def server_main(p: dict[str, Any], out: str) -> None:
    """Fork server: heavy imports once, then one forked child per mutant."""
    for name in p["preimport"]:
        __import__(name)
    if p.get("tests"):
        from .vllm_tests import CONFTEST_PREIMPORT

        for name in CONFTEST_PREIMPORT:
            __import__(name)
    import kvspec.testing  # noqa: F401  (hypothesis and the machine, shared by the children)

    from . import common  # noqa: F401

    loaded = [m for m in p["paths"] if m in sys.modules]
    if loaded:
        raise RuntimeError(f"pre-imports pulled in mutated modules: {loaded}")
    outdir = Path(p["outdir"])
    jobs = list(p["jobs"])
    running: dict[int, tuple[dict[str, Any], float, str]] = {}
    results: list[dict[str, Any]] = []
    total = len(jobs)

    def finish(pid: int, status: int | None) -> None:
        job, started, out_path = running.pop(pid)
        elapsed = time.perf_counter() - started
        if status is None:
            res = {"status": "timeout", "seconds": elapsed}
        elif os.path.exists(out_path):
            res = json.loads(Path(out_path).read_text())
        else:
            res = {"status": "killed", "kind": f"crash: child exit status {status}",
                   "error": _tail(out_path + ".log"), "seconds": elapsed}
        res["key"] = job["key"]
        res["job"] = job.get("kind", "kvspec")
        if "tests" in job:
            res["tests_selected"] = len(job["tests"])
        res["wall"] = elapsed
        results.append(res)
        if p.get("progress"):  # written as it goes: a long run leaves partial results
            with open(p["progress"], "a") as f:
                f.write(json.dumps(res) + "\n")
        if p.get("verdicts") and res["job"] == "vllm-tests" and job["site"] is not None:
            with open(p["verdicts"], "a") as f:  # vLLM's tests' verdict, kept per release
                f.write(json.dumps(res) + "\n")
        print(f"[{len(results)}/{total}] {res['job']} {job['key']}: {res['status']} "
              f"{res.get('kind', '')} {elapsed:.1f}s", flush=True)

    while jobs or running:
        while jobs and len(running) < p["jobs_max"]:
            job = jobs.pop(0)
            name = f"{job.get('kind', 'kvspec')}-{job['key']}"
            out_path = str(outdir / (name.replace(":", "_").replace("/", "_") + ".json"))
            pid = os.fork()
            if pid == 0:  # the child
                code = 0
                try:
                    log = os.open(out_path + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(log, 1)
                    os.dup2(log, 2)
                    _run_child(p, job, out_path)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            running[pid] = (job, time.perf_counter(), out_path)
        time.sleep(0.05)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                finish(pid, status)
            elif time.perf_counter() - running[pid][1] > running[pid][0].get(
                    "timeout", p["timeout"]):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                finish(pid, None)
    Path(out).write_text(json.dumps(results))


def _tail(path: str, n: int = 3) -> str:
    try:
        return " | ".join(Path(path).read_text(errors="replace").splitlines()[-n:])[:300]
    except OSError:
        return ""


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
    if not opts.no_vllm_tests:
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
        if tests is not None:
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
                  **({"vllm_tests": vt.get(m.key, {"status": "missing"})} if tests else {})}
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
        rows = measure(target, split_target(target)[1], site_packages(target),
                       Path(opts.results) if opts.results else RESULTS, opts.timeout, opts.keys)
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


# ---------------------------------------------------------------- report

KILLED = ("killed", "timeout")


def _progress_name(target: str, oracle: str) -> str:
    """The progress file of a run: one per target and oracle, so that a run under one oracle
    leaves the other's partial results alone."""
    return f"mutation-progress-{split_target(target)[0]}{'' if oracle == 'narrow' else '-check'}.jsonl"


def _oracle_of(result: dict[str, Any]) -> str:
    return result.get("settings", {}).get("oracle", "narrow")


def _notes() -> dict[str, str]:
    path = Path(__file__).with_name("mutation_notes.json")
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def _equivalents() -> dict[str, str]:
    """Mutants argued equivalent one by one (key -> the argument); only these leave the
    denominators.  A survivor whose replays matched the baseline is *suspected* equivalent,
    which is evidence for an argument, not one."""
    path = Path(__file__).with_name("mutation_equivalents.json")
    return json.loads(path.read_text()) if path.exists() else {}


def _kv_killed(m: dict[str, Any]) -> bool:
    return m["status"] in KILLED


def _vt_killed(m: dict[str, Any]) -> bool:
    return m.get("vllm_tests", {}).get("status") in KILLED


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.0f}%" if n else "-"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if not n:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _ci(k: int, n: int) -> str:
    lo, hi = wilson(k, n)
    return f"{_pct(k, n)} (95% CI {100 * lo:.0f}-{100 * hi:.0f}%)"


def _how(m: dict[str, Any]) -> str:
    if m["status"] == "timeout":
        return "timed out"
    if m.get("kind") == "violation":
        return ", ".join(m.get("invariants", []))
    return m.get("kind", "").removeprefix("crash: ") + " (crash)"


def render_mutation(data: dict[str, Any], seconds: float | None = None) -> str:
    parts = [
        "Each target: a **uniform** sample of every mutant generated in the modules under test "
        "(stratified per module in proportion, fixed seed), run through the kvspec oracle and "
        "through vLLM's own unit tests of the same release (from its sdist, fetched at bench "
        "time, never committed). A mutant the oracle's baseline run never executed is *not "
        "covered* and counts as a survivor. Killed = a violation, a crash or a timeout. Only "
        "mutants argued equivalent one by one (bench/mutation_equivalents.json) leave the "
        "denominators; nothing is assumed equivalent."]
    notes = _notes()
    eqs = _equivalents()
    for r in data["results"]:
        s = r["settings"]
        check = _oracle_of(r) == "check"
        parts += ["", f"### {r['target']}" + (" -- the oracle `kvspec check` runs" if check else
                                               " -- narrowed oracle"), "",
                  header(r["command"], r["machine"], r.get("seconds")), ""]
        vt = r.get("vllm_tests")
        machine = "SwarmMachine" if s.get("search") == "swarm" else "KVCacheMachine"
        if check:
            shapes = r.get("baseline", {}).get("clean", {}).get("shapes")
            what = (f"the configurations `kvspec check` draws (cli/run.py config_strategy: "
                    f"every feature the target supports), machine {machine}"
                    + (f", then the scheduler machine's shapes (cli/shapes.py), "
                       f"{s.get('shape_examples') or s['examples']} examples requested"
                       if shapes else ""))
        else:
            what = f"workload {json.dumps(r['workload'])}; machine {machine}"
        parts.append(
            f"Oracle budget per mutant: {s['examples']} hypothesis examples (ci profile: "
            f"derandomized, 40 steps, no shrinking), wall-clock limit {s['timeout']:.0f} s, "
            f"{s['jobs']} mutant(s) at a time; {what}; invariants "
            f"{', '.join(s['invariants']) if s.get('invariants') else 'all'}. "
            + (f"vLLM's tests per mutant: of {', '.join(vt['files'])}, the tests whose clean "
               "run executed a line of the mutant (all of them for module-level code), "
               "stopping at the first failure, limit 3x their clean time + 60 s; a mutant no "
               "test executes survives them without a run."
               if vt else "vLLM's tests: not run."))
        if "baseline" in r:
            b = r["baseline"]["clean"]
            parts += ["", f"Oracle baseline (unmutated copies through the import hook): "
                      f"**{'clean' if b['status'] == 'survived' else 'FAILED'}** in "
                      f"{b['seconds']:.1f} s ({b['examples']} examples, {b['operations']} steps); "
                      f"identity mutant through the fork server: "
                      f"{r.get('identity', {}).get('status', '-')}."]
            sh = r["baseline"]["clean"].get("shapes")
            if sh:
                reached = ", ".join(f"{k} {v}" for k, v in sorted(sh["per_shape"].items()))
                parts.append(f"Its scheduler shapes: {sh['status']}, {sh['examples']} examples, "
                             f"{sh['operations']} operations in {sh['seconds']:.1f} s "
                             f"(examples per shape: {reached or 'none'}).")
        if vt and "baseline" in vt:
            vb = vt["baseline"]
            parts.append(
                f"vLLM's tests on the unmutated code: {vt['passed']} passed, "
                f"{len(vt['skipped'])} skipped, {len(vt['deselected'])} failing and deselected "
                f"for every mutant, in {vb['seconds']:.0f} s (through the fork server, with "
                "per-test line coverage).")
            if vt["deselected"]:
                parts += ["", "Deselected (fail on the unmutated release here):", "",
                          table(["test", "why"], [[d["test"], " ".join(d["why"].split())[:140]]
                                                  for d in vt["deselected"]])]
        if r.get("error"):
            parts += ["", f"**No score: {r['error']}**"]
        if "mutants" not in r:
            continue
        if r["mutants"] and "covered" not in r["mutants"][0]:
            parts += ["", "(A result of the earlier covered-only method: re-run this target.)"]
            continue
        muts = [m for m in r["mutants"] if m["status"] != "missing"
                and m.get("vllm_tests", {}).get("status") != "missing"]
        argued = [m for m in muts if m["key"] in eqs]
        live = [m for m in muts if m["key"] not in eqs]
        n = len(live)
        kv = sum(_kv_killed(m) for m in live)
        cov = [m for m in live if m["covered"]]
        kv_cov = sum(_kv_killed(m) for m in cov)
        if r.get("partial"):
            parts += ["", f"**Partial run** (cut at the session's deadline): "
                      f"{len(r['mutants']) - len(muts)} of the {len(r['mutants'])} sampled mutants "
                      "had not been through both oracles and are left out of every figure below."]
        parts += ["", f"Sample: **{len(r['mutants'])} of {r['generated']}** generated mutants "
                  f"({len(r['mutants']) - len(muts)} missing a result), {len(argued)} argued "
                  f"equivalent, {len(cov)} of the rest covered by the oracle's baseline."]
        line = (f"**kvspec (uniform): {_ci(kv, n)}** ({kv}/{n}); covered only: "
                f"{_pct(kv_cov, len(cov))} ({kv_cov}/{len(cov)}).")
        if vt:
            vk = sum(_vt_killed(m) for m in live)
            both = sum(_kv_killed(m) and _vt_killed(m) for m in live)
            only_kv = [m for m in live if _kv_killed(m) and not _vt_killed(m)]
            only_vt = sum(_vt_killed(m) and not _kv_killed(m) for m in live)
            neither = n - both - len(only_kv) - only_vt
            line += (f" **vLLM's own tests: {_ci(vk, n)}** ({vk}/{n}). Union: "
                     f"{_pct(vk + len(only_kv), n)}. **Killed by kvspec only: {len(only_kv)}**.")
            parts += ["", line, "", table(
                ["", "kvspec kills", "kvspec misses", "total"],
                [["vLLM's tests kill", both, only_vt, both + only_vt],
                 ["vLLM's tests miss", len(only_kv), neither, len(only_kv) + neither],
                 ["total", kv, n - kv, n]])]
        else:
            parts += ["", line]
        rows = []
        for mod in r["modules"]:
            mm = [m for m in live if m["module"] == mod]
            k1 = sum(_kv_killed(m) for m in mm)
            k2 = sum(_vt_killed(m) for m in mm)
            rows.append([mod.split(".")[-1], r["generated_by_module"].get(mod, 0),
                         sum(m["module"] == mod for m in r["mutants"]),
                         sum(m["key"] in eqs for m in muts if m["module"] == mod),
                         sum(m["covered"] for m in mm), k1, _pct(k1, len(mm)),
                         k2 if vt else "-", _pct(k2, len(mm)) if vt else "-",
                         sum(_kv_killed(m) or _vt_killed(m) for m in mm)])
        parts += ["", table(["module", "generated", "sampled", "argued equivalent",
                             "covered", "kvspec kills", "kvspec score", "vLLM tests kill",
                             "vLLM tests score", "union kills"], rows)]
        invs = Counter(i for m in live if m.get("kind") == "violation"
                       for i in m.get("invariants", []))
        if invs:
            parts += ["", "Invariants that killed: " + ", ".join(
                f"{k} {v}" for k, v in invs.most_common()) + "."]
        if vt and only_kv:
            parts += ["", "Killed by kvspec only:", "", table(
                ["mutant", "kvspec", "vLLM's tests"],
                [[m["describe"], _how(m), "pass"] for m in only_kv])]
        if vt:
            missed = [m for m in live if not _kv_killed(m) and not _vt_killed(m)]
        else:
            missed = [m for m in live if not _kv_killed(m)]
        if missed:
            parts += ["", f"<details><summary>{len(missed)} killed by neither (or by "
                      "nothing, without vLLM's tests)</summary>", "", table(
                          ["mutant", "oracle", "why the oracle misses it"],
                          [[m["describe"], m["status"] if m["status"] != "equivalent" else
                            "survived; replays identical (suspected equivalent)",
                            notes.get(m["key"], "")] for m in missed]), "", "</details>"]
        if argued:
            parts += ["", "<details><summary>Argued equivalent</summary>", "", table(
                ["mutant", "argument"], [[m["describe"], eqs[m["key"]]] for m in argued]),
                "", "</details>"]
    return "\n".join(parts)
