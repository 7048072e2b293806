"""Benchmark bodies that run inside one interpreter (a target's venv, or the core one).

``python -m bench _worker TASK PARAMS_JSON OUT_JSON`` calls ``TASKS[TASK](params)`` and
writes the returned dict to OUT_JSON.  The orchestration (``bench.commands``) decides which
interpreter runs which task and writes BENCHMARKS.md.
"""

from __future__ import annotations

import cProfile
import io
import logging
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .common import (
    REPO,
    factory,
    hypothesis_settings,
    machine_options,
    run_machine,
    split_target,
    strategy,
)
from .rawreplay import replay_raw, strip_observation

# ---------------------------------------------------------------- recording machine runs


def _recorder_cls():
    from kvspec.testing import RunStats

    class Recorder(RunStats):
        """RunStats that also keeps every example's config and trace, for replay."""

        def __init__(self) -> None:
            super().__init__()
            self.runs: list[tuple[Any, list[dict[str, Any]]]] = []

        def add(self, driver) -> None:
            super().add(driver)
            self.runs.append((driver.config, [s.to_json() for s in driver.trace]))

    return Recorder


def _warm(make) -> None:
    """Build one implementation so that imports (vLLM, torch) are not timed."""
    from kvspec.spec.config import Config

    make(Config(block_size=4, num_blocks=8, prefix_caching=True))


def _oracle_run(target: str, workload: dict, examples: int, steps: int):
    from kvspec.testing import KVCacheMachine

    impl, _ = split_target(target)
    make = factory(impl)
    _warm(make)
    rec = _recorder_cls()()
    strat = strategy(workload)
    settings = hypothesis_settings(max_examples=examples, steps=steps)
    start = time.perf_counter()
    opts = machine_options(workload)
    run_machine(lambda: KVCacheMachine(make, strat, stats=rec, **opts), settings)
    return make, rec, time.perf_counter() - start


# ---------------------------------------------------------------- profiles


def _kvspec_rel(filename: str) -> str | None:
    """The path inside kvspec (``testing/blockmanager/driver.py``), from the checkout or an installed copy
    (a venv may hold a non-editable install while another job reinstalls it)."""
    repo = str(REPO) + "/"
    if filename.startswith(repo):
        return filename[len(repo) :]
    if "/site-packages/kvspec/" in filename:
        return filename.split("/site-packages/kvspec/", 1)[1]
    return None


def _layer(filename: str) -> str:
    rel = _kvspec_rel(filename)
    if rel is not None:
        top = rel.split("/", 1)[0]
        return {"spec": "kvspec.spec", "testing": "kvspec.testing (driver, machine)",
                "reference": "kvspec.reference", "adapters": "kvspec.adapters",
                "bench": "bench"}.get(top, f"kvspec.{top}")
    if "/hypothesis/" in filename:
        return "hypothesis"
    if "/vllm/" in filename:
        return "vllm"
    if "/torch/" in filename:
        return "torch"
    if "/attr/" in filename or "/attrs/" in filename:
        return "attrs"
    if filename.startswith("~") or filename == "":
        return "builtins (C)"
    return "stdlib/other"


def _short_name(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    rel = _kvspec_rel(filename)
    if rel is not None:
        filename = rel
    elif "site-packages/" in filename:
        filename = filename.split("site-packages/", 1)[1]
    elif filename.startswith("~"):
        return name
    return f"{filename}:{line} {name}"


def _profile_summary(prof: cProfile.Profile, top: int = 15) -> dict[str, Any]:
    stats = pstats.Stats(prof, stream=io.StringIO())
    total = sum(v[2] for v in stats.stats.values())  # tottime
    layers: Counter[str] = Counter()
    for func, (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        layers[_layer(func[0])] += tt
    by_tottime = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    ours = [
        kv for kv in stats.stats.items()
        if _kvspec_rel(kv[0][0]) is not None and not _kvspec_rel(kv[0][0]).startswith("bench/")
    ]
    by_cumtime = sorted(ours, key=lambda kv: kv[1][3], reverse=True)[:top]
    return {
        "total_seconds": total,
        "layers": {k: v / total for k, v in layers.most_common()},
        "top_tottime": [
            {"func": _short_name(f), "calls": v[1], "tottime": v[2], "cumtime": v[3]}
            for f, v in by_tottime
        ],
        "top_cumtime_kvspec": [
            {"func": _short_name(f), "calls": v[1], "tottime": v[2], "cumtime": v[3]}
            for f, v in by_cumtime
        ],
    }


# ---------------------------------------------------------------- tasks


def throughput(p: dict[str, Any]) -> dict[str, Any]:
    """Oracle steps/s, the same traces replayed through the Driver (no hypothesis) and raw
    (the implementation's calls only), plus cProfile breakdowns."""
    from kvspec.testing import KVCacheMachine
    from kvspec.testing.blockmanager.driver import replay

    target = p["target"]
    # Best of a few identical (derandomized) runs: the machine is shared, and interference
    # only ever adds time.
    repeats = p.get("repeats", 3)
    oracle_times = []
    for _ in range(repeats):
        make, rec, t_oracle = _oracle_run(target, p["workload"], p["examples"], p["steps"])
        oracle_times.append(t_oracle)
    t_oracle = min(oracle_times)
    ops = rec.operations
    runs = rec.runs

    # The Driver alone (all checks, no hypothesis).
    driver_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for config, trace in runs:
            found, _ = replay(make(config), trace)
            if found:
                raise RuntimeError(f"replay of a passing example found {found}")
        driver_times.append(time.perf_counter() - start)
    t_driver = min(driver_times)

    out: dict[str, Any] = {"target": target, "workload": p["workload"]}
    if p.get("profile_examples"):
        strat = strategy(p["workload"])
        settings = hypothesis_settings(max_examples=p["profile_examples"], steps=p["steps"])
        rec2 = _recorder_cls()()
        prof = cProfile.Profile()
        prof.enable()
        opts = machine_options(p["workload"])
        run_machine(lambda: KVCacheMachine(make, strat, stats=rec2, **opts), settings)
        prof.disable()
        out["profile_oracle"] = _profile_summary(prof)

    # Raw: build, then the implementation's own calls.
    best: tuple[float, float] | None = None
    mismatches = 0
    for _ in range(repeats):
        t_build = t_raw = 0.0
        mismatches = 0
        for config, trace in runs:
            t0 = time.perf_counter()
            impl = strip_observation(make(config))
            t1 = time.perf_counter()
            mismatches += replay_raw(impl, trace).mismatches
            t2 = time.perf_counter()
            t_build += t1 - t0
            t_raw += t2 - t1
        if best is None or t_build + t_raw < sum(best):
            best = (t_build, t_raw)
    assert best is not None
    t_build, t_raw = best
    if p.get("profile_examples"):
        prof = cProfile.Profile()
        prof.enable()
        for config, trace in runs:
            replay_raw(strip_observation(make(config)), trace)
        prof.disable()
        out["profile_raw"] = _profile_summary(prof)

    out.update({
        "examples": rec.examples,
        "operations": ops,
        "by_op": dict(sorted(rec.by_op.items())),
        "repeats": repeats,
        "oracle_seconds": t_oracle,
        "oracle_seconds_all": oracle_times,
        "driver_replay_seconds": t_driver,
        "raw_build_seconds": t_build,
        "raw_ops_seconds": t_raw,
        "raw_mismatches": mismatches,
        "oracle_steps_per_s": ops / t_oracle,
        "driver_steps_per_s": ops / t_driver,
        "raw_steps_per_s": ops / (t_build + t_raw),
        "raw_ops_only_steps_per_s": ops / t_raw if t_raw else float("inf"),
    })
    out["ratio"] = out["oracle_steps_per_s"] / out["raw_steps_per_s"]
    out["ratio_ops_only"] = out["oracle_steps_per_s"] / out["raw_ops_only_steps_per_s"]
    return out


def _timed_machine(make, strat, focus, mark: dict[str, Any], options: dict[str, Any]):
    """A KVCacheMachine that notes when (and after how many examples) it first fails."""
    from hypothesis.errors import HypothesisException, StopTest
    from hypothesis.stateful import invariant
    from kvspec.testing import KVCacheMachine, SpecViolation

    mark["examples"] = 0

    def failure(machine) -> None:
        mark.setdefault("t", time.perf_counter())
        mark.setdefault("at_example", mark["examples"])
        # The last failing machine is hypothesis' final replay of the shrunk example.
        mark["config"] = machine.d.config.describe()

    class Timed(KVCacheMachine):
        def __init__(self) -> None:
            super().__init__(make, strat, focus=focus, stats=None, **options)
            mark["examples"] += 1

        @invariant()
        def invariants_hold(self):
            try:
                super().invariants_hold()
            except SpecViolation:
                failure(self)
                raise

        def teardown(self):
            # In hypothesis' finally: an exception in flight is a rule that crashed the target.
            crashed = sys.exc_info()[1]
            if crashed is not None and not isinstance(crashed, HypothesisException | StopTest):
                failure(self)
            try:
                super().teardown()
            except SpecViolation:
                failure(self)
                raise

    return Timed


def ttc(p: dict[str, Any]) -> dict[str, Any]:
    """Time to the first counterexample, per seed: discovery (first failing example) and
    total (with shrinking), and the invariants reported."""
    target = p["target"]
    impl, _ = split_target(target)
    make = factory(impl)
    _warm(make)
    focus = p.get("focus")
    strat = strategy(p["workload"])
    options = machine_options(p["workload"])
    finding = p.get("finding")
    if finding is None:
        return _ttc_seeds(p, lambda mark: _timed_machine(make, strat, focus, mark, options))

    def machine_for(mark: dict[str, Any]):
        mark["sieve"] = _sieve_for(finding, target)
        return _timed_machine(make, strat, focus, mark, {**options, "step_past": mark["sieve"]})

    return _ttc_seeds(p, machine_for)


def _sieve_for(finding: str, target: str):
    """``kvspec check``'s step-past policy with every known finding of ``target`` but
    ``finding`` stepped past: the first other failure is the run's (cli/search.py ``Sieve``).
    A finding pinned by its trace alone, with no fingerprint, would have every known one stepped
    past, and the row would show the failure each seed ended on (F-KV3 had none until
    2026-12-03: its form was labelled F-KV10 and stepped past, so its row could not be found)."""
    from kvspec.cli.search import Sieve
    from kvspec.testing.known import SHIPPED, load_known

    impl, version = split_target(target)
    mine = [k for k in load_known([SHIPPED]) if k.concerns(impl, version)]
    return Sieve(reported=frozenset(), known=mine,
                 stepped=frozenset(k.id for k in mine if k.id != finding))


def _judge_identity(row: dict[str, Any], mark: dict[str, Any], finding: str) -> None:
    """With a sieve, a seed is found only when the failure it ended on is ``finding``."""
    sieve = mark["sieve"]
    row["stepped_past"] = dict(sieve.fired)
    if sieve.target is None:
        return
    identity = sieve.target if isinstance(sieve.target, str) else sieve.target.describe()
    row["identity"] = identity
    if identity != finding and finding in {k.id for k in sieve.known}:
        row["outcome"] = f"another failure first: {identity[:160]}"
        mark.pop("t", None)


def _ttc_seeds(p: dict[str, Any], machine_for) -> dict[str, Any]:
    """One hypothesis run per seed of the machine ``machine_for(mark)`` builds; the summary
    row of ``python -m bench ttc``."""
    from hypothesis.errors import Unsatisfiable
    from kvspec.testing import SpecViolation
    from kvspec.testing.scheduler.machine import PolicyDifference

    rows = []
    for seed in p["seeds"]:
        mark: dict[str, Any] = {}
        machine = machine_for(mark)
        extra: dict[str, Any] = {}
        if p.get("explain"):
            from hypothesis import Phase
            from hypothesis import settings as hyp_settings

            # The profiles leave the explain phase out; this measures what it would cost.
            extra["phases"] = [*hyp_settings.get_profile("ci").phases, Phase.explain]
        settings = hypothesis_settings(max_examples=p["max_examples"], steps=p["steps"],
                                       derandomize=False, **extra)
        start = time.perf_counter()
        row: dict[str, Any] = {"seed": seed}
        try:
            run_machine(machine, settings, seed=seed)
            row["outcome"] = "not found"
        except SpecViolation as err:
            row["outcome"] = "found"
            row["invariants"] = sorted({v.invariant for v in err.violations})
            row["shrunk_trace_len"] = len(err.trace)
            row["message"] = str(err.violations[0])[:240]
            row["config"] = mark.get("config", "")
            row["trace"] = [s.describe()[:160] for s in err.trace][:12]
        except PolicyDifference as err:  # the scheduler differential's verdict (no invariant)
            row["outcome"] = "found"
            row["invariants"] = []
            row["differs"] = f"{err.policy}: {err.comparison.value}"
            row["shrunk_trace_len"] = len(err.trace)
            row["message"] = str(err)[:240]
            row["config"] = mark.get("config", "")
            row["trace"] = [s.describe()[:160] for s in err.trace][:12]
        except Unsatisfiable:
            row["outcome"] = "not found (Unsatisfiable: the filters rejected every draw)"
        except Exception as err:  # a crash of the implementation is a finding too
            import traceback

            where = traceback.extract_tb(err.__traceback__)[-1]
            row["outcome"] = (f"crash: {type(err).__name__}: {str(err)[:200]} "
                              f"({Path(where.filename).name} {where.name})")
        end = time.perf_counter()
        if "sieve" in mark:
            _judge_identity(row, mark, p["finding"])
        row["total_seconds"] = end - start
        row["examples_run"] = mark["examples"]
        if "t" in mark:
            row["discovery_seconds"] = mark["t"] - start
            row["examples_to_discovery"] = mark["at_example"]
        rows.append(row)
    found = [r["discovery_seconds"] for r in rows if "discovery_seconds" in r]
    totals = [r["total_seconds"] for r in rows if "discovery_seconds" in r]
    return {
        "target": p["target"],
        "focus": p.get("focus"),
        "explain": bool(p.get("explain")),
        "workload": p.get("workload"),
        "steps": p["steps"],
        "max_examples": p["max_examples"],
        "finding": p.get("finding"),
        "rows": rows,
        "found": len(found),
        "median_discovery": statistics.median(found) if found else None,
        "min_discovery": min(found) if found else None,
        "max_discovery": max(found) if found else None,
        "median_total": statistics.median(totals) if totals else None,
        "max_total": max(totals) if totals else None,
    }


# ---------------------------------------------------------------- the scheduler machine


def _scheduler_shapes(key: str, make: Any = None):
    """The shapes a scheduler case draws: ``tag:<SHAPE_TAGS entry>`` (a broken scheduler's
    shape, as tests/test_scheduler_shapes.py draws it) and ``any``, both with the retention
    modes and KV connectors the scheduler ``make`` offers, as the machine's own default; or a finding's shapes as its
    pinned test in tests/targets/test_scheduler_v1.py draws them (V1-S4a: prefix caching and a
    window no longer than its group's block, in the shapes 0.9.1 has; V1-S2a: async
    scheduling with EAGLE drafts and a sliding window, no caching; C3, as
    tests/targets/test_scheduler_window_lookahead_cap.py draws it: a window of 1-token blocks
    beside B=2, EAGLE drafts past the block, the startup minimum)."""
    from hypothesis import strategies as st
    from kvspec.spec.groups import Shape
    from kvspec.testing.scheduler.machine import kv_connectors_of, retention_offer_of, shapes

    offered = shapes(retention_offer_of(make), kv_connectors_of(make)) if make is not None else shapes()
    if key == "any":
        return offered
    if key.startswith("tag:"):
        tag = key[len("tag:"):]
        return offered.filter(lambda s: tag in s.tags())
    if key == "v1-s4a":
        return shapes().filter(
            lambda s: s.prefix_caching and s.sliding_window is not None
            and s.sliding_window <= s.swa_block_size and s.swa_block_size == s.block_size
            and not s.async_scheduling and not s.full_sequence_must_fit)
    if key == "v1-s2a":
        return st.builds(
            Shape, block_size=st.just(2), swa_block_size=st.just(2),
            sliding_window=st.integers(2, 5), extra_blocks=st.sampled_from([0, 4]),
            prefix_caching=st.just(False), num_spec_tokens=st.integers(1, 3),
            async_scheduling=st.just(True), max_num_batched_tokens=st.just(16),
            max_model_len=st.just(16), full_sequence_must_fit=st.just(False),
            max_tokens=st.sampled_from([4, 8]), eagle=st.just(True))
    if key == "c3":
        return st.builds(
            Shape, block_size=st.just(2), swa_block_size=st.just(1),
            sliding_window=st.integers(1, 2), extra_blocks=st.just(0),
            prefix_caching=st.just(False), num_spec_tokens=st.sampled_from([2, 3]),
            async_scheduling=st.just(False), max_num_batched_tokens=st.sampled_from([4, 14]),
            max_model_len=st.just(16), full_sequence_must_fit=st.booleans(),
            max_tokens=st.just(8), eagle=st.just(True))
    raise SystemExit(f"unknown scheduler shape set {key!r}")


def _scheduler_factory(name: str):
    """A scheduler implementation (testing/implementations.py ``lookup_scheduler``), or
    ``differential-only:<variant>`` (reference/broken_scheduler.py ``DIFFERENTIAL_ONLY``)."""
    if name.startswith("differential-only:"):
        from kvspec.reference.broken_scheduler import DIFFERENTIAL_ONLY

        return DIFFERENTIAL_ONLY[name[len("differential-only:"):]][0]
    from kvspec.testing.implementations import lookup_scheduler

    return lookup_scheduler(name).factory


def _timed_scheduler_machine(make, shapes_strategy, focus, differential, mark: dict[str, Any],
                             step_past: Any = None):
    """A SchedulerMachine that notes when (and after how many examples) it first fails: a
    reported violation or a crash of the target, both raised through a rule or the
    invariant, both in flight when hypothesis calls teardown."""
    from hypothesis.errors import HypothesisException, StopTest
    from kvspec.testing.blockmanager.differential import Mode
    from kvspec.testing.scheduler.machine import SchedulerMachine

    mark["examples"] = 0
    mode = Mode.RENAMING if differential else None

    class Timed(SchedulerMachine):
        def __init__(self) -> None:
            super().__init__(make, shapes_strategy, focus=focus, differential=mode, step_past=step_past)
            mark["examples"] += 1

        def teardown(self):
            failed = sys.exc_info()[1]
            try:
                super().teardown()
            except Exception as err:
                failed = err
                raise
            finally:
                if failed is not None and not isinstance(failed, HypothesisException | StopTest):
                    mark.setdefault("t", time.perf_counter())
                    mark.setdefault("at_example", mark["examples"])
                    mark["config"] = repr(self.shape)

    return Timed


def ttc_scheduler(p: dict[str, Any]) -> dict[str, Any]:
    """``ttc`` for the scheduler machine (testing/scheduler/machine.py): a scheduler
    implementation, the shapes it draws, the invariants it watches, the differential or not."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    make = _scheduler_factory(p["scheduler"])
    strat = _scheduler_shapes(p["shapes"], make)
    focus = frozenset(p["focus"]) if p.get("focus") else None
    step_past = _scheduler_step_past(p["finding"], p["target"]) if p.get("finding") else None
    return _ttc_seeds(p, lambda mark: _timed_scheduler_machine(
        make, strat, focus, p.get("differential", False), mark, step_past))


def _scheduler_step_past(finding: str, target: str):
    """``kvspec check``'s step-past policy for the scheduler machine: every known finding of the
    release's scheduler but ``finding`` (which need not have a fingerprint: V1-S4a is pinned by
    its trace) stepped past, so the first failure the run ends on is ``finding`` or a new one."""
    from kvspec.cli.search import Sieve
    from kvspec.testing.known import SHIPPED, load_known

    _, version = split_target(target)
    mine = [k for k in load_known([SHIPPED]) if k.concerns("v1-scheduler", version)]
    # Sieve, not step_past_known: a finding that shows at every state (go_on: V1-e) is gone on
    # past, as `kvspec check` does, instead of discarding every example.
    return Sieve(reported=frozenset(), known=mine, stepped=frozenset(k.id for k in mine if k.id != finding))


def scale(p: dict[str, Any]) -> dict[str, Any]:
    """Cost per operation of a fixed, deterministic scheduler workload as one dimension grows
    (pool size, live sequences, prompt length): through the Driver (every check) and raw."""
    from kvspec.spec.config import Config
    from kvspec.testing import Driver

    from .workload import scheduler_workload

    target = p["target"]
    impl, _ = split_target(target)
    make = factory(impl)
    _warm(make)
    rows = []
    for point in p["points"]:
        config = Config(block_size=point["block_size"], num_blocks=point["num_blocks"],
                        prefix_caching=point.get("prefix_caching", True),
                        sliding_window=point.get("sliding_window"))
        row = dict(point)
        # Driver (the oracle without hypothesis): every invariant after every operation.
        driver = Driver(make(config))
        t0 = time.perf_counter()
        scheduler_workload(driver, point)
        found = driver.free_all()
        t_driver = time.perf_counter() - t0
        if found:
            row["violations"] = [str(v) for v in found[:3]]
        if point.get("profile"):
            # A separate, profiled run of the same point: profiling inflates the timings.
            prof = cProfile.Profile()
            profiled = Driver(make(config))
            prof.enable()
            scheduler_workload(profiled, point)
            profiled.free_all()
            prof.disable()
            row["profile"] = _profile_summary(prof, top=10)
        trace = [s.to_json() for s in driver.trace]
        t_raw = float("inf")
        for _ in range(5):  # short: best of five
            impl_obj = strip_observation(make(config))
            t0 = time.perf_counter()
            raw = replay_raw(impl_obj, trace)
            t_raw = min(t_raw, time.perf_counter() - t0)
        ops = len(trace)
        row.update(
            ops=ops,
            driver_ms_per_op=1000 * t_driver / ops,
            raw_ms_per_op=1000 * t_raw / ops,
            raw_mismatches=raw.mismatches,
        )
        rows.append(row)
    return {"target": target, "rows": rows}


def _proof_task(name: str):
    def run(p: dict[str, Any]) -> dict[str, Any]:
        from . import proofcost

        return getattr(proofcost, name)(p)

    return run


TASKS = {
    "throughput": throughput,
    "ttc": ttc,
    "ttc-scheduler": ttc_scheduler,
    "scale": scale,
    "proof": _proof_task("proof_one"),
    "proof-list": _proof_task("proof_list"),
    "bmc-point": _proof_task("bmc_point"),
}


def main(task: str, params_json: str, out: str) -> None:
    import json

    params = json.loads(params_json)
    result = TASKS[task](params)
    Path(out).write_text(json.dumps(result, default=str))
