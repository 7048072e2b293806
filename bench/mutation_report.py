"""The mutation section of BENCHMARKS.md: scores beside vLLM's own tests, confidence
intervals and the per-mutant table, rendered from an assembled run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from .common import (
    header,
    split_target,
    table,
)

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
