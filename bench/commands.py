"""The ``python -m bench`` subcommands: run the workers, save JSON, write BENCHMARKS.md."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .common import (
    Timer,
    command_line,
    header,
    machine_info,
    run_worker,
    save_result,
    table,
    write_section,
)

# What each target runs in the throughput benchmark.  The legacy manager runs full attention
# without prefix caching: with caching or a window the 0.6.3 V2 machine stops at a known finding
# (F1, F4: FINDINGS.md), and a failing run would measure shrinking rather than checking.
THROUGHPUT_TARGETS: dict[str, dict[str, Any]] = {
    "reference": {"window": "any", "caching": "any", "swap": True, "max_blocks": 32},
    "v1@0.33.0": {"window": "any", "caching": "any", "swap": False, "max_blocks": 16},
    # No lookahead: with lookahead slots and swap the machine stops on FINDINGS F12 within a
    # few examples, and a throughput run must not stop.
    # Nor frees of swapped-out sequences (F13, a crash).
    "legacy-v2@0.6.3": {"window": "none", "caching": "off", "swap": True, "max_blocks": 32,
                        "max_lookahead": 0, "free_swapped": False},
}


def _describe_workload(w: dict[str, Any]) -> str:
    window = {"any": "any window", "none": "full attention", "only": "sliding window"}[
        w.get("window", "any")]
    caching = {"any": "caching on/off", "on": "prefix caching", "off": "no caching"}[
        w.get("caching", "any")]
    swap = "swap" if w.get("swap", True) else "no swap"
    lookahead = "" if w.get("max_lookahead", 3) else ", no lookahead"
    return f"{window}, {caching}, {swap}{lookahead}, N<={w.get('max_blocks', 32)}"


def _out(results: str | None, md: str | None) -> tuple[Path | None, Path | None]:
    return (Path(results) if results else None, Path(md) if md else None)


# ---------------------------------------------------------------- throughput


def cmd_throughput(
    *, targets: list[str] | None, examples: int, steps: int, profile_examples: int, repeats: int,
    results: str | None, md: str | None,
) -> dict[str, Any]:
    """Oracle steps/s against a raw replay of the same traces, per target (None: every one of
    THROUGHPUT_TARGETS), best of ``repeats``; a cProfile over ``profile_examples`` (0: none)."""
    info = machine_info()
    results_dir, md_file = _out(results, md)
    targets = targets or list(THROUGHPUT_TARGETS)
    rows = []
    with Timer() as timer:
        for target in targets:
            workload = THROUGHPUT_TARGETS.get(target, THROUGHPUT_TARGETS["reference"])
            rows.append(_attempt(
                target, workload, lambda t=target, w=workload: run_worker(
                    t, "throughput", {"workload": w, "examples": examples,
                                      "steps": steps, "repeats": repeats,
                                      "profile_examples": profile_examples})))
    data = {"machine": info, "command": command_line(), "results": rows}
    data["seconds"] = timer.seconds
    save_result("throughput", data, results_dir)
    write_section("throughput", render_throughput(data, timer.seconds), md_file)
    return data


def _attempt(target: str, workload: dict[str, Any], run) -> dict[str, Any]:
    """A failed worker (e.g. the machine stopped on a violation) is reported, not fatal."""
    try:
        return run()
    except RuntimeError as err:
        lines = [x for x in str(err).splitlines() if x.strip()]
        reason = next((x for x in reversed(lines) if not x.startswith((" ", "state.", "Draw"))),
                      lines[-1] if lines else "?")
        print(f"  [{target}] FAILED: {reason}")
        return {"target": target, "workload": workload, "error": reason[:300]}


def render_throughput(data: dict[str, Any], seconds: float | None = None) -> str:
    rows = []
    failed = [r for r in data["results"] if "error" in r]
    data = {**data, "results": [r for r in data["results"] if "error" not in r]}
    for r in data["results"]:
        rows.append([
            r["target"], _describe_workload(r["workload"]), r["examples"], r["operations"],
            r["oracle_steps_per_s"], r["driver_steps_per_s"], r["raw_steps_per_s"],
            r["raw_ops_only_steps_per_s"], f"{r['ratio']:.3f}", f"{r['ratio_ops_only']:.3f}",
            r["raw_mismatches"],
        ])
    parts = [
        header(data["command"], data["machine"], seconds),
        "",
        "Steps are driver operations (admit, step, fork, free, preempt, swap, reset), each "
        "followed by `observe()` and every invariant. *Oracle*: the hypothesis machine "
        "(`KVCacheMachine`, ci profile, derandomized). *Driver replay*: the same recorded "
        "traces through `kvspec.testing.blockmanager.driver.replay` (every check, no hypothesis). *Raw*: the "
        "same traces through `bench/rawreplay.py` (the implementation's own calls only, "
        "observation bookkeeping off), including building the manager per example; *raw "
        "ops-only* excludes building. Each figure is the best of `--repeats` identical "
        "(derandomized) runs. Ratio = oracle steps/s / raw steps/s (goal >= 0.5).",
        "",
        table(["target", "workload", "examples", "steps", "oracle steps/s",
               "driver replay steps/s", "raw steps/s", "raw ops-only steps/s",
               "ratio", "ratio (ops-only)", "replay mismatches"], rows),
    ]
    for r in failed:
        parts += ["", f"**{r['target']}** ({_describe_workload(r['workload'])}): the run "
                  f"failed: `{r['error']}`"]
    for r in data["results"]:
        ops = ", ".join(f"{k} {v}" for k, v in r["by_op"].items())
        parts += ["", f"**{r['target']}** operations: {ops}."]
        for key, title in (("profile_oracle", "oracle"), ("profile_raw", "raw replay")):
            prof = r.get(key)
            if not prof:
                continue
            layers = ", ".join(f"{k} {100 * v:.0f}%" for k, v in prof["layers"].items()
                               if v >= 0.01)
            parts += ["", f"cProfile of the {title} ({prof['total_seconds']:.1f} s profiled "
                      f"self time), share of self time by layer: {layers}."]
            if key == "profile_oracle":
                parts += ["", "Top functions by self time:", "",
                          table(["function", "calls", "self s", "cumulative s"],
                                [[f["func"], f["calls"], f["tottime"], f["cumtime"]]
                                 for f in prof["top_tottime"][:12]]),
                          "", "kvspec functions by cumulative time:", "",
                          table(["function", "calls", "self s", "cumulative s"],
                                [[f["func"], f["calls"], f["tottime"], f["cumtime"]]
                                 for f in prof["top_cumtime_kvspec"][:12]])]
    return "\n".join(parts)


# ---------------------------------------------------------------- time to counterexample

TTC_BROKEN_WORKLOAD = {"block_sizes": [1, 2, 3, 4], "max_blocks": 8, "swap": True}
# The findings on real releases that FINDINGS.md pins in tests/targets/test_stateful_legacy.py,
# with the same configurations (configs(max_blocks=16), window or not, caching or not) and
# the same focus.  F1 is the seed bug.
_WINDOWED = {"window": "only", "caching": "off", "max_blocks": 16}
TTC_FINDINGS: dict[str, tuple[str, str, dict[str, Any], list[str]]] = {
    "F1": ("F1 seed bug: BlockSpaceManagerV2 admits, allocate fails", "legacy-v2@0.6.3",
           _WINDOWED, ["admission-soundness"]),
    "F2": ("F2: BlockSpaceManagerV2 holds the whole prompt", "legacy-v2@0.6.3", _WINDOWED,
           ["window-bound"]),
    "F3": ("F3: BlockSpaceManagerV1 overwrites full blocks", "legacy-v1@0.6.3", _WINDOWED,
           ["immutability"]),
    "F4": ("F4: V2 chunked prefill hands out uncomputed blocks", "legacy-v2@0.6.3",
           {"window": "none", "caching": "on", "max_blocks": 16}, ["prefix-cache-consistency"]),
    "F9": ("F9: BlockSpaceManagerV1 forked-group refcounts", "legacy-v1@0.6.3",
           {"window": "none", "caching": "off", "max_blocks": 16}, ["refcount-exact"]),
    "F12": ("F12: BlockSpaceManagerV2 can_swap_out ignores lookahead blocks", "legacy-v2@0.6.3",
            {"window": "none", "caching": "off", "max_blocks": 16, "free_swapped": False},
            ["admission-soundness"]),
    # The seed-bug configurations, found past F1 (see TTC_OTHERS_STEPPED_PAST).
    "F6": ("F6: BlockSpaceManagerV2 carves the null block from the pool on a windowed append",
           "legacy-v2@0.6.3", _WINDOWED, ["admission-soundness"]),
    # Pinned by its trace; here found from scratch, every invariant watched, past F12 and F14
    # (see TTC_OTHERS_STEPPED_PAST).
    "F13": ("F13: BlockSpaceManagerV2 frees a swapped-out sequence into the wrong pool",
            "legacy-v2@0.6.3", {"window": "none", "caching": "off", "max_blocks": 16}, []),
    # Pinned by its trace; here found from scratch, windowed with swap and lookahead, past
    # C1 (the windowed livelock after F6) and the other window findings.
    "F15": ("F15: BlockSpaceManagerV2 can_swap_in counts the blocks a window drops",
            "legacy-v2@0.6.3", {**_WINDOWED, "swap": True}, ["progress"]),
    # Pinned by its trace (test_stateful_legacy.py); here found from scratch, progress watched,
    # away from F12 and F13 as the suite's full-attention V2 run steers.
    "F14": ("F14: BlockSpaceManagerV2 never finishes a chunked prompt that fills the pool",
            "legacy-v2@0.6.3", {"window": "none", "caching": "off", "max_blocks": 16,
                                "max_lookahead": 0, "free_swapped": False}, ["progress"]),
    # tests/targets/test_tenancy_targets.py: configs(swap=False, max_blocks=8, caching on).
    "F-KV1": ("F-KV1: V1 KVCacheManager with KV events crashes on a LoRA request (0.10.1.1)",
              "v1@0.10.1.1", {"window": "none", "caching": "on", "swap": False, "max_blocks": 8},
              []),
    # On 0.12.0 (F-KV1 fixed there, so LoRA stays drawn), windowed, the prefix-cache focus.
    "F-KV2": ("F-KV2: V1 KVCacheManager with KV events asserts on a window's null parent (0.12.0)",
              "v1@0.12.0", {"window": "only", "caching": "on", "swap": False, "max_blocks": 8},
              ["event-consistency", "prefix-cache-consistency", "prefix-cache-isolation"]),
    # Pinned by its shrunk trace (a random dev-profile search of prefix-cache-isolation on
    # 0.12.0 found it); here from scratch, full attention (F-KV2 stops windowed runs there).
    "F-KV3": ("F-KV3: V1 multimodal key without the item's offset in the block (0.12.0)",
              "v1@0.12.0", {"window": "none", "caching": "on", "swap": False, "max_blocks": 8},
              ["prefix-cache-isolation"]),
    # The identifier collisions across kinds that rule shared-identifiers makes reachable, in
    # F-KV3's configuration, each past the others (the three are one violation kind told
    # apart by the domains it confused).
    "F-KV9": ("F-KV9: V1 LoRA name and cache salt keyed alike (0.12.0)",
              "v1@0.12.0", {"window": "none", "caching": "on", "swap": False, "max_blocks": 8},
              ["prefix-cache-isolation"]),
    "F-KV10": ("F-KV10: V1 multimodal identifier keyed like a salt or a LoRA name (0.12.0)",
               "v1@0.12.0", {"window": "none", "caching": "on", "swap": False, "max_blocks": 8},
               ["prefix-cache-isolation"]),
}
# Findings another known finding of the same configurations shadows (F1 fires on the
# admission before F6's append; F14's livelock and F12 before F13's crash; C1 before F15; F11's
# double free before F3 on the windowed swap draws; V1-e's usage before F-KV1 and V1-S4a from
# construction on; F-KV9/F-KV10 (identifiers that coincide across kinds) before F-KV2 and F-KV3,
# and each of F-KV3/F-KV9/F-KV10 before the others):
# these cases step past every other known finding of the target, as `kvspec check`'s rounds
# do (cli/search.py ``Sieve``), and a seed counts as found only when its first other failure
# is the case's own finding.
TTC_OTHERS_STEPPED_PAST = frozenset(
    {"F3", "F6", "F13", "F15", "F-KV1", "F-KV2", "F-KV3", "F-KV9", "F-KV10", "V1-S4a"}
)
# Findings on vLLM's own V1 scheduler (testing/scheduler/machine.py), as their pinned tests in
# tests/targets/test_scheduler_v1.py draw them: label, the release whose venv runs it, the
# scheduler implementation (testing/implementations.py ``lookup_scheduler``), the shapes
# (bench/worker.py ``_scheduler_shapes``), the focus.
TTC_SCHEDULER_FINDINGS: dict[str, tuple[str, str, str, str, list[str]]] = {
    "V1-S4a": ("V1-S4a: 0.9.1 Scheduler, sliding window + prefix caching crash cache_full_blocks",
               "v1@0.9.1", "v1-scheduler", "v1-s4a", []),
    "V1-S2a": ("V1-S2a: 0.12.0 AsyncScheduler + EAGLE frees window blocks still read",
               "v1@0.12.0", "v1-scheduler", "v1-s2a", []),
    "C3": ("C3: 0.33.0 Scheduler, window + EAGLE lookahead past the admission cap: a lone request stalls",
           "v1@0.33.0", "v1-scheduler", "c3", []),
}


def _scheduler_variant_cases(names: list[str] | None) -> list[dict[str, Any]]:
    """The scheduler machine's broken variants (reference/broken_scheduler.py): each in its
    shape, watching what it is caught by; the differential-only ones under the differential
    (renaming mode), every invariant watched, as tests/test_scheduler_differential.py runs them."""
    from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS, DIFFERENTIAL_ONLY
    from kvspec.testing.implementations import BROKEN_SCHEDULER_PREFIX, lookup_scheduler

    every = sorted(BROKEN_SCHEDULERS) + sorted(DIFFERENTIAL_ONLY)
    cases = []
    for name in every if names is None else names:
        if name in BROKEN_SCHEDULERS:
            impl = lookup_scheduler(BROKEN_SCHEDULER_PREFIX + name)
            cases.append({"case": f"scheduler:{name}", "label": f"broken-scheduler:{name}",
                          "scheduler": impl.name, "shapes": f"tag:{impl.shape}",
                          "focus": sorted(BROKEN_SCHEDULERS[name].catches)})
        elif name in DIFFERENTIAL_ONLY:
            cases.append({"case": f"scheduler:{name}",
                          "label": f"broken-scheduler:{name} (differential only)",
                          "scheduler": f"differential-only:{name}", "shapes": "any",
                          "focus": [], "differential": True})
        else:
            raise SystemExit(f"unknown scheduler variant {name!r}; one of: {', '.join(every)}")
    return cases


def cmd_ttc(
    *, seeds: int, variants: list[str] | None, findings: list[str] | None,
    scheduler_variants: list[str] | None, merge: bool, max_examples: int, steps: int,
    explain: list[str], results: str | None, md: str | None,
) -> dict[str, Any]:
    """Time to the first counterexample over ``seeds`` seeds: the broken variants (None: all),
    the pinned findings (None: all) and the broken schedulers (None: all); ``merge`` keeps the
    saved rows of the cases this run does not run; ``explain`` also runs these cases with
    hypothesis' explain phase."""
    from kvspec.reference.broken import BROKEN

    info = machine_info()
    results_dir, md_file = _out(results, md)
    seed_list = list(range(seeds))
    cases: list[tuple[str, str, str, dict[str, Any], list[str] | None]] = []
    names = BROKEN if variants is None else variants
    for name in sorted(names):
        v = BROKEN[name]
        workload = dict(TTC_BROKEN_WORKLOAD)
        if v.needs.get("window"):
            workload["window"] = "only"
        if v.needs.get("prefix_caching"):
            workload["caching"] = "on"
        cases.append((name, f"broken:{name}", f"broken:{name}", workload, sorted(v.catches)))
    scheduler_cases: list[dict[str, Any]] = []
    only: dict[str, str] = {}  # case -> the one known finding it counts (others stepped past)
    findings = list(TTC_FINDINGS) + list(TTC_SCHEDULER_FINDINGS) if findings is None \
        else findings
    for key in findings:
        if key in TTC_SCHEDULER_FINDINGS:
            label, target, scheduler, shapes, focus = TTC_SCHEDULER_FINDINGS[key]
            scheduler_cases.append({"case": key, "label": label, "target": target,
                                    "scheduler": scheduler, "shapes": shapes, "focus": focus})
            continue
        if key not in TTC_FINDINGS:
            raise SystemExit(f"unknown finding {key!r}; one of: "
                             f"{', '.join([*TTC_FINDINGS, *TTC_SCHEDULER_FINDINGS])}")
        label, target, workload, focus = TTC_FINDINGS[key]
        cases.append((key, label, target, workload, focus))
        if key in TTC_OTHERS_STEPPED_PAST:
            only[key] = key
    scheduler_cases += _scheduler_variant_cases(scheduler_variants)
    if not cases and not scheduler_cases:
        raise SystemExit("nothing to run: every case list given is empty")
    rows: list[dict[str, Any]] = []
    earlier: dict[str, Any] = {}
    if merge:
        import json

        from .common import RESULTS

        saved = (results_dir or RESULTS) / "ttc.json"
        earlier = json.loads(saved.read_text()) if saved.exists() else {}
    run_no = len(earlier.get("runs") or ([{}] if earlier else []))

    def record(r: dict[str, Any], name: str, label: str) -> None:
        r["label"], r["case"], r["run"] = label, name, run_no
        rows.append(r)
        # Saved as it goes: a long run cut short keeps the cases it finished.
        save_result("ttc-progress", {"machine": info, "command": command_line(),
                                     "results": rows}, results_dir)

    with Timer() as timer:
        for name, label, target, workload, focus in cases:
            for with_explain in ([False, True] if name in explain else [False]):
                r = run_worker(target, "ttc", {
                    "workload": workload, "focus": focus or None, "seeds": seed_list,
                    "max_examples": max_examples, "steps": steps,
                    "explain": with_explain, "finding": only.get(name),
                })
                record(r, name, label + (" (with the explain phase)" if with_explain else ""))
        for case in scheduler_cases:
            r = run_worker(case.get("target", "reference"), "ttc-scheduler", {
                "scheduler": case["scheduler"], "shapes": case["shapes"],
                "focus": case["focus"] or None, "differential": case.get("differential", False),
                "seeds": seed_list, "max_examples": max_examples, "steps": steps,
                "target": case.get("target", "reference"),
                "finding": case["case"] if case["case"] in TTC_OTHERS_STEPPED_PAST else None,
            })
            r["shapes"] = case["shapes"]
            record(r, case["case"], case["label"])
    info["loadavg_end"] = [round(x, 2) for x in __import__("os").getloadavg()]
    run = {"machine": info, "command": command_line(), "seconds": timer.seconds}
    if earlier:
        runs = earlier.get("runs") or [{k: earlier.get(k) for k in ("machine", "command", "seconds")}]
        done = {r["case"] for r in rows}
        kept = [dict(r, run=r.get("run", 0)) for r in earlier["results"] if r["case"] not in done]
        data = _prune_runs({"runs": [*runs, run], "results": kept + rows})
    else:
        data = {"runs": [run], "results": rows}
    save_result("ttc", data, results_dir)
    write_section("ttc", render_ttc(data), md_file)
    return data


def _prune_runs(data: dict[str, Any]) -> dict[str, Any]:
    """Drop the runs whose every row a later run replaced; renumber the rows' runs."""
    used = sorted({r.get("run", 0) for r in data["results"]})
    number = {old: new for new, old in enumerate(used)}
    return {"runs": [data["runs"][i] for i in used],
            "results": [dict(r, run=number[r.get("run", 0)]) for r in data["results"]]}


def render_ttc(data: dict[str, Any], seconds: float | None = None) -> str:
    if data.get("runs"):
        data = _prune_runs(data)
    runs = data.get("runs") or [{"machine": data["machine"], "command": data["command"],
                                  "seconds": seconds if seconds is not None else data.get("seconds")}]
    rows = []
    for r in data["results"]:
        seeds = len(r["rows"])
        invs = sorted({i for row in r["rows"] for i in row.get("invariants", [])})
        invs += sorted({f"differs ({row['differs']})" for row in r["rows"] if "differs" in row})
        exs = [row["examples_to_discovery"] for row in r["rows"] if "examples_to_discovery" in row]
        lens = [row["shrunk_trace_len"] for row in r["rows"] if "shrunk_trace_len" in row]
        other = sorted({row["outcome"] for row in r["rows"] if row["outcome"] != "found"})
        if r.get("finding"):
            invs = [f"{r['finding']} ({', '.join(invs)})" if invs else r["finding"]]
        rows.append([
            r.get("run", 0) + 1, r["label"], ", ".join(r["focus"] or ["all"]), f"{r['found']}/{seeds}",
            _fmt(r["median_discovery"]), _span(r["min_discovery"], r["max_discovery"]),
            f"{statistics.median(exs):.0f} ({min(exs)}-{max(exs)})" if exs else "-",
            _fmt(r["median_total"]), _fmt(r["max_total"]),
            f"{statistics.median(lens):.0f}" if lens else "-",
            "; ".join(x for x in (", ".join(invs), *other) if x),
        ])
    seed_rows = [row for r in data["results"] if r.get("case") == "F1"
                 and not r.get("explain") for row in r["rows"] if row.get("trace")]
    example = []
    if seed_rows:
        best = min(seed_rows, key=lambda row: row["shrunk_trace_len"])
        example = ["", f"Shrunk counterexample for the seed bug (seed {best['seed']}, "
                   f"config {best.get('config', '?')}): {best['message']}", "", "```",
                   *[f"{i}. {line}" for i, line in enumerate(best["trace"], 1)], "```"]
    headers = []
    for i, run in enumerate(runs, 1):
        headers += [f"Run {i}: " + header(run["command"], run["machine"], run.get("seconds")), ""]
    return "\n".join([
        *headers,
        "The *run* column says which of those runs made each row; a later run replaces only the "
        "rows of the cases it ran (`--merge`).",
        "",
        "Per case, one hypothesis run per seed (`settings(derandomize=False, database=None)` "
        "under `@seed(n)`, n = 0..seeds-1), the machine watching the listed invariants "
        "(`focus`). *Discovery*: wall time from the start of the run to the first failing "
        "example (before shrinking); *total*: until hypothesis has shrunk and raised "
        "`SpecViolation` (a crash of the target counts as found: F13). Every broken variant "
        "of reference/broken.py: block sizes 1-4, N <= 8 (the suite's configuration). F1-F13: "
        "every finding FINDINGS.md pins, on the real managers of vLLM 0.6.3, with the "
        "configurations and focus of their pinned tests (tests/targets/test_stateful_legacy.py:"
        " N <= 16, window or not, caching or not). F6 and F13 are shadowed by other findings of "
        "their configurations (F1 fires on the admission before F6's windowed append; F14's "
        "livelock and F12 before F13's crash): those two cases step past every other known "
        "finding of 0.6.3 as `kvspec check`'s rounds do, watch every invariant (F6: "
        "admission-soundness), and a seed counts as found only when the failure it ends on "
        "is the case's own finding (the *reported* cell names it; a seed that ends on "
        "another, unknown failure is listed by it). F13, pinned by its trace, is searched from "
        "scratch that way. Steps per example: the dev (default) "
        f"profile's {data['results'][0].get('steps', 40) if data['results'] else 40}; "
        "examples capped at the command's --max-examples. F14 (pinned by its trace) is searched "
        "from scratch with `progress` watched, no lookahead and no frees of swapped-out "
        "sequences (F12, F13). F-KV1 and F-KV2: vLLM's V1 KVCacheManager with KV-cache events, "
        "the configurations and focus of tests/targets/test_tenancy_targets.py (N <= 8, caching "
        "on, no swap; F-KV2 windowed, on 0.12.0 where F-KV1 is fixed); F-KV3, pinned by its trace, "
        "from scratch on 0.12.0, full attention, `prefix-cache-isolation` watched; F-KV9 and "
        "F-KV10 the same way, each of the three past the other two (one kind of violation, told "
        "apart by the domains it confused). A focused case abandons an example (no verdict) "
        "where an operation that failed after its own check said yes broke the unwatched block "
        "accounting (testing/blockmanager/driver.py `accounting_broken`: F12's swap_out). V1-S4a, V1-S2a and the "
        "`broken-scheduler:` rows: the scheduler machine (testing/scheduler/machine.py "
        "`SchedulerMachine`, the implementation from testing/implementations.py "
        "`lookup_scheduler`), drawing the shapes of the pinned tests (tests/targets/"
        "test_scheduler_v1.py; a broken scheduler its own shape, as tests/test_scheduler_shapes.py;"
        " the differential-only ones every shape under the differential in renaming mode, as "
        "tests/test_scheduler_differential.py), one example = one shape and up to the steps "
        "below. *Examples to discovery* counts the machines hypothesis built, draws a filter "
        "or an unsupported shape rejected included (V1-S4a's filter keeps few shapes: one seed "
        "ended Unsatisfiable, reported as not found). A crash's *reported* cell names the "
        "exception and where it was raised; hypothesis shrinks a crash too, but the row records "
        "no trace length for it (the target's own exception carries no kvspec trace).",
        "",
        table(["run", "case", "focus", "found", "median discovery s", "discovery range s",
               "examples to discovery, median (range)", "median total s", "max total s",
               "median shrunk trace", "reported"], rows),
        *example,
    ])


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _span(lo: float | None, hi: float | None) -> str:
    return "-" if lo is None or hi is None else f"{lo:.2f}-{hi:.2f}"


# ---------------------------------------------------------------- scale

SCALE_DIMENSIONS: dict[str, list[dict[str, Any]]] = {
    # Pool size only: the same small workload (4 sequences, 96-token prompts) in ever larger
    # pools, so what grows is the per-step cost of observing and checking the pool.
    "pool size": [
        {"num_blocks": n, "block_size": 16, "seqs": 4, "prompt_len": 96, "decode": 16,
         **({"profile": True} if n == 2048 else {})}
        for n in (32, 256, 2048, 8192)
    ],
    "live sequences": [
        {"num_blocks": 2048, "block_size": 16, "seqs": s, "prompt_len": 64, "decode": 8}
        for s in (1, 4, 16, 64)
    ],
    "prompt length": [
        {"num_blocks": 2048, "block_size": 16, "seqs": 2, "prompt_len": n, "decode": 16,
         "chunk": 512}
        # 6144, not 8192: the V1 adapter's max_model_len is 8192 and vLLM allocates no slot
        # at or past it (the scheduler would have finished the request by length).
        for n in (64, 512, 2048, 6144)
    ],
}
SCALE_TARGETS = ("reference", "v1@0.33.0")


def cmd_scale(*, targets: list[str] | None, quick: bool, results: str | None, md: str | None) -> dict[str, Any]:
    """Cost per step against pool size, live sequences and prompt length (``quick``: the two
    smallest points per dimension)."""
    info = machine_info()
    targets = targets or list(SCALE_TARGETS)
    dims = SCALE_DIMENSIONS
    if quick:
        dims = {k: v[:2] for k, v in dims.items()}
    points = [dict(p, dimension=d) for d, ps in dims.items() for p in ps]
    rows = []
    with Timer() as timer:
        for target in targets:
            rows.append(run_worker(target, "scale", {"points": points}))
    data = {"machine": info, "command": command_line(), "results": rows}
    results_dir, md_file = _out(results, md)
    data["seconds"] = timer.seconds
    save_result("scale", data, results_dir)
    write_section("scale", render_scale(data, timer.seconds), md_file)
    return data


def render_scale(data: dict[str, Any], seconds: float | None = None) -> str:
    parts = [
        header(data["command"], data["machine"], seconds),
        "",
        "A fixed schedule (bench/workload.py): admit the sequences (prompts sharing their "
        "first half), prefill in chunks of 512 tokens, decode round-robin, free all; prefix "
        "caching on, full attention, B = 16. *Driver*: every invariant after every operation "
        "(the oracle without hypothesis); *raw*: the same trace through the implementation "
        "alone. Milliseconds per operation.",
    ]
    dims = []
    for r in data["results"]:
        for row in r["rows"]:
            if row["dimension"] not in dims:
                dims.append(row["dimension"])
    for dim in dims:
        rows = []
        for r in data["results"]:
            for row in r["rows"]:
                if row["dimension"] != dim:
                    continue
                bad = "; ".join(row.get("violations", [])) or ""
                label = r["target"]
                rows.append([
                    label, row["num_blocks"], row["seqs"], row["prompt_len"], row["ops"],
                    row["driver_ms_per_op"], row["raw_ms_per_op"],
                    row["driver_ms_per_op"] / row["raw_ms_per_op"] if row["raw_ms_per_op"] else "-",
                    row["raw_mismatches"], bad or "none",
                ])
        parts += ["", f"**{dim}**", "",
                  table(["target", "pool blocks", "live seqs", "prompt tokens", "ops",
                         "driver ms/op", "raw ms/op", "driver / raw", "mismatches",
                         "violations"], rows)]
    for r in data["results"]:
        for row in r["rows"]:
            prof = row.get("profile")
            if not prof:
                continue
            layers = ", ".join(f"{k} {100 * v:.0f}%" for k, v in prof["layers"].items()
                               if v >= 0.01)
            label = r["target"]
            parts += ["", f"cProfile of the driver run, {label}, {row['num_blocks']} "
                      f"blocks: self time by layer: {layers}. kvspec functions by cumulative "
                      "time:", "",
                      table(["function", "calls", "self s", "cumulative s"],
                            [[f["func"], f["calls"], f["tottime"], f["cumtime"]]
                             for f in prof["top_cumtime_kvspec"][:10]])]
    return "\n".join(parts)


# ---------------------------------------------------------------- render


def cmd_render(*, names: list[str], results: str | None, md: str | None) -> None:
    """Re-render sections from saved results (after editing notes or the renderers); no
    ``names``: every saved one."""
    import json

    from .checktime import render_checktime
    from .common import RESULTS
    from .mutation_report import render_mutation
    from .proofcost import render_proofs

    renderers = {"throughput": render_throughput, "ttc": render_ttc, "scale": render_scale,
                 "proofs": render_proofs, "mutation": render_mutation, "checktime": render_checktime}
    results_dir, md_file = _out(results, md)
    directory = results_dir or RESULTS
    for name in names or list(renderers):
        path = directory / f"{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        write_section(name, renderers[name](data, data.get("seconds")), md_file)
        print(f"rendered {name} from {path}")
