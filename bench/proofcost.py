"""Proof cost: each z3 obligation of ``kvspec.proofs`` at its default and deep bounds, and how
bounded model checking of the reference grows with the depth k, the pool N and the number of
sequences S.

Every obligation and every grid point runs in its own process with a wall-clock limit, so a
point that blows up is reported as a timeout instead of stalling the run.
"""

from __future__ import annotations

import subprocess
import time
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

# ---------------------------------------------------------------- worker side


def proof_one(p: dict[str, Any]) -> dict[str, Any]:
    from kvspec.proofs import OBLIGATIONS

    ob = OBLIGATIONS[p["id"]]
    result = ob.run(p["deep"])
    return {
        "id": result.obligation, "deep": p["deep"], "expected": result.expected,
        "outcome": result.outcome, "ok": result.ok, "seconds": result.seconds,
        "bounds": result.bounds, "detail": result.detail[:300],
    }


def proof_list(p: dict[str, Any]) -> dict[str, Any]:
    from kvspec.proofs import OBLIGATIONS, select

    default = {ob.id for ob in select(None, False)}
    return {"obligations": [
        {"id": ob.id, "deep_only": ob.deep_only, "default": ob.id in default}
        for ob in OBLIGATIONS.values()
    ]}


def bmc_point(p: dict[str, Any]) -> dict[str, Any]:
    from kvspec.proofs import bmc

    b = bmc.Bounds(**p["bounds"])
    start = time.perf_counter()
    if p["mode"] == "induction":
        verdicts = bmc.induction(b, p["timeout_ms"])
        outcome = "inductive" if all(v == "inductive" for v in verdicts.values()) else (
            "; ".join(f"{k}: {v}" for k, v in verdicts.items() if v != "inductive"))
    else:
        r = bmc.prove_runs(b, p["timeout_ms"], depth=p["depth"])
        outcome = r.outcome + (f" ({r.violated or r.reason})" if r.outcome != "proved" else "")
    return {**p, "describe": b.describe(), "seconds": time.perf_counter() - start,
            "outcome": outcome}


# ---------------------------------------------------------------- the grid

def bmc_grid(kind: str) -> list[dict[str, Any]]:
    """Points of the k / N / S sweep (the other bounds at bmc.DEFAULT_BOUNDS)."""
    if kind == "none":
        return []
    quick = kind == "quick"
    ks = (1, 2) if quick else (1, 2, 3, 4, 5, 6)
    ns = (2, 4) if quick else (2, 3, 4, 6, 8, 10, 12)
    ss = (1, 2) if quick else (1, 2, 3, 4, 5)
    # N and S are swept at depth 2: depth 3 at the default bounds is already near the
    # per-query timeout on this machine (see the k sweep).
    pts = [{"sweep": "k", "mode": "direct", "bounds": {}, "depth": k} for k in ks]
    pts += [{"sweep": "N", "mode": "direct", "bounds": {"num_blocks": n}, "depth": 2} for n in ns]
    pts += [{"sweep": "S", "mode": "direct", "bounds": {"num_seqs": s}, "depth": 2} for s in ss]
    if not quick:
        pts += [{"sweep": "induction N", "mode": "induction", "bounds": {"num_blocks": n},
                 "depth": 0} for n in (4, 6, 8)]
        pts += [{"sweep": "induction S", "mode": "induction", "bounds": {"num_seqs": s},
                 "depth": 0} for s in (2, 3, 4)]
    return pts


# ---------------------------------------------------------------- command


def cmd_proofs(
    *, deep: bool, only: list[str] | None, grid: str, timeout: float, ob_timeout: float,
    ob_timeout_deep: float, results: str | None, md: str | None,
) -> dict[str, Any]:
    """Each z3 obligation's time (those whose id starts with one of ``only``; None: all) at its
    default bounds, with ``deep`` at its deep bounds too, each under a wall-clock limit; then the
    BMC sweep ``grid`` ("none", "quick", "full") with a z3 ``timeout`` (s) per query."""
    info = machine_info()
    obligations = run_worker("reference", "proof-list", {})["obligations"]
    wanted = [o for o in obligations
              if not only or any(o["id"].startswith(w) for w in only)]
    runs: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    with Timer() as timer:
        for at_deep in ([False, True] if deep else [False]):
            for o in wanted:
                if o["deep_only"] and not at_deep:
                    continue
                limit = ob_timeout_deep if at_deep else ob_timeout
                try:
                    runs.append(run_worker("reference", "proof", {"id": o["id"], "deep": at_deep},
                                           timeout=limit, log=lambda _m: None))
                except subprocess.TimeoutExpired:
                    runs.append({"id": o["id"], "deep": at_deep, "outcome": f"> {limit:.0f} s",
                                 "ok": False, "seconds": None, "bounds": "", "detail": "",
                                 "expected": ""})
                print(f"  {o['id']} {'deep' if at_deep else 'default'}: "
                      f"{runs[-1]['outcome']} {runs[-1]['seconds']}")
        given_up: set[str] = set()
        for point in bmc_grid(grid):
            if point["sweep"] in given_up:
                # Cost only grows along a sweep: past the first point that did not finish,
                # the larger ones would only burn CPU on the same answer.
                points.append({**point, "seconds": None, "outcome": "skipped (smaller point "
                             "did not finish)", "describe": ""})
                continue
            params = {**point, "timeout_ms": int(timeout * 1000)}
            try:
                points.append(run_worker("reference", "bmc-point", params,
                                       timeout=timeout * 3 + 30, log=lambda _m: None))
            except subprocess.TimeoutExpired:
                points.append({**params, "seconds": None, "outcome": "wall-clock timeout",
                             "describe": ""})
            if points[-1]["seconds"] is None or any(
                w in str(points[-1]["outcome"]) for w in ("unknown", "timeout", "canceled")
            ):
                given_up.add(point["sweep"])
            print(f"  bmc {point['sweep']} {point['bounds']} k={point['depth']}: "
                  f"{points[-1]['outcome']} {points[-1]['seconds']}")
    data = {"machine": info, "command": command_line(), "obligations": runs, "bmc": points,
            "timeout": timeout}
    data["seconds"] = timer.seconds
    save_result("proofs", data, Path(results) if results else None)
    write_section("proofs", render_proofs(data, timer.seconds), Path(md) if md else None)
    return data


def _verdict(r: dict[str, Any]) -> str:
    if r["seconds"] is None:
        return f"did not finish ({r['outcome']})"
    return r["outcome"] + ("" if r["ok"] else f" (UNEXPECTED: expected {r['expected']})")


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render_proofs(data: dict[str, Any], seconds: float | None = None) -> str:
    by_id: dict[str, dict[bool, dict[str, Any]]] = {}
    for r in data["obligations"]:
        by_id.setdefault(r["id"], {})[r["deep"]] = r
    rows = []
    for ob_id, runs in by_id.items():
        d, e = runs.get(False), runs.get(True)
        rows.append([
            ob_id, _verdict(d) if d else "deep only", _secs(d["seconds"]) if d else "-",
            _verdict(e) if e else "not run", _secs(e["seconds"]) if e else "-",
        ])
    total_default = sum(r["seconds"] or 0 for r in data["obligations"] if not r["deep"])
    total_deep = sum(r["seconds"] or 0 for r in data["obligations"] if r["deep"])
    parts = [
        header(data["command"], data["machine"], seconds),
        "",
        "Each obligation's `Obligation.run(deep)` time (kvspec.proofs; the solver work only, "
        "one process per obligation). Default total "
        f"{total_default:.1f} s" + (f", deep total {total_deep:.1f} s" if total_deep else "")
        + ".",
        "",
        table(["obligation", "default", "default s", "deep", "deep s"], rows),
    ]
    if data["bmc"]:
        grows = []
        for g in data["bmc"]:
            grows.append([g["sweep"], g["mode"], g.get("describe") or g["bounds"],
                          g["depth"] if g["mode"] == "direct" else "-", _secs(g["seconds"]),
                          g["outcome"]])
        parts += [
            "",
            "BMC of the reference's transition system (`bmc.prove_runs(Bounds(...), depth=k)`: "
            "direct unrolling, no invariant assumed, every property at every depth <= k; "
            "`bmc.induction`: one 1-induction step over all properties). Bounds not named are "
            f"`bmc.DEFAULT_BOUNDS`; z3 timeout {data['timeout']:.0f} s per query.",
            "",
            table(["sweep", "mode", "bounds", "k", "seconds", "outcome"], grows),
        ]
    return "\n".join(parts)
