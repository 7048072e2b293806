"""The worker side of a mutation run, inside the target venv: the baseline oracle run, the
fork server that runs one child per mutant (the oracle, or vLLM's own tests), and the
equivalence replay of survivors.  Started as ``python -m bench _worker TASK PARAMS OUT``
by the orchestrator (bench/mutation.py)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs

from .common import (
    REPO,
    split_target,
)
from .import_hook import check_loaded, install


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
    from kvspec.testing.blockmanager.driver import Driver, apply_step

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
            from kvspec.testing.blockmanager.swarm import SwarmMachine as machine
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
    install(paths)
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
    check_loaded(paths)
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
    install(p["paths"], mutation)
    if job.get("kind") == "vllm-tests":
        _run_vllm_tests(p, mutation, out_path)
        return
    res = _oracle(p["target"], p["workload"], p["examples"], p["steps"],
                  focus=p.get("focus"), search=p.get("search", "default"),
                  oracle=p.get("oracle", "narrow"),
                  shape_examples=p.get("shape_examples", 0), seed=job.get("seed"),
                  reported=p.get("reported", []))
    check_loaded(p["paths"])
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
    check_loaded(p["paths"])
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
