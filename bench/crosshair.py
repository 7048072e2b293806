"""Hypothesis' CrossHair backend (hypothesis-crosshair + crosshair-tool, MIT; symbolic
execution on z3) against the default random backend, on the same properties.

Cases, from cheapest to richest:

- ``spec:*``: pure window arithmetic of ``kvspec.spec.window`` (integers in, integers out);
- ``op:<variant>``: one short operation sequence (admit, decode steps, admit a prompt sharing
  a prefix, free) on a fresh manager built from a drawn configuration, every invariant
  checked through the ``Driver``: the reference (must hold) and each broken variant (fails
  only if this sequence can show its bug: fork, swap and preemption are not in it);
- ``machine:<variant>``: the stateful machine itself.

Each case runs in its own process with a wall-clock limit (CrossHair may spend long on one
path), under ``settings(backend=...)`` with the same example budget for both backends.
Needs ``pip install 'kvspec[crosshair]'`` in the interpreter that runs it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from typing import Any


def _settings(backend: str, examples: int):
    from hypothesis import HealthCheck, Phase, settings

    return settings(backend=backend, max_examples=examples, deadline=None, database=None,
                    derandomize=backend == "hypothesis", print_blob=False,
                    phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                    report_multiple_bugs=False)


def _spec_case(name: str):
    from hypothesis import given
    from hypothesis import strategies as st
    from kvspec.spec.window import attends, blocks_touched, window_cover

    if name == "spec:window-cover":
        @given(st.integers(1, 40), st.integers(1, 17))
        def test(window, block_size):
            brute = max(blocks_touched(s, s + window - 1, block_size)
                        for s in range(2 * block_size))
            assert window_cover(window, block_size) == brute
        return test

    @given(st.integers(0, 60), st.integers(1, 30))
    def test2(query, window):
        attended = [k for k in range(query + 1) if attends(query, k, window)]
        assert len(attended) == min(window, query + 1)
    return test2


def _op_case(variant: str):
    """admit a prompt, step it k tokens, admit a second prompt sharing a prefix, free the
    first: every invariant after each operation."""
    from hypothesis import given
    from hypothesis import strategies as st
    from kvspec.spec.config import Config
    from kvspec.testing.blockmanager.driver import Driver, SpecViolation

    if variant == "reference":
        from kvspec.reference import ReferenceManager as cls
    else:
        from kvspec.reference.broken import BROKEN

        cls = BROKEN[variant].cls

    @given(st.integers(1, 4), st.integers(1, 8), st.one_of(st.none(), st.integers(1, 9)),
           st.booleans(), st.lists(st.integers(0, 3), min_size=1, max_size=12),
           st.integers(0, 12), st.integers(1, 8), st.integers(0, 3))
    def test(block_size, num_blocks, window, caching, prompt, cut, steps, token):
        config = Config(block_size=block_size, num_blocks=num_blocks, sliding_window=window,
                        prefix_caching=caching)
        d = Driver(cls(config))

        def checked():
            found = d.check()
            if found:
                raise SpecViolation(found, d.trace)

        if not d.admit(0, tuple(prompt), len(prompt), token):
            return
        checked()
        for _ in range(steps):
            if not d.step(0, 1, token):
                break
            checked()
        if d.admit(1, (*prompt[:cut], token), len(prompt[:cut]) + 1, 0):
            checked()
        d.free(0)
        checked()
        found = d.free_all()
        if found:
            raise SpecViolation(found, d.trace)

    return test


def _machine_case(variant: str, examples: int, backend: str):
    from hypothesis import strategies as st
    from hypothesis.stateful import get_state_machine_test
    from kvspec.reference.broken import BROKEN
    from kvspec.testing import KVCacheMachine
    from kvspec.testing.blockmanager.strategies import configs

    cls = BROKEN[variant].cls
    strat = configs(block_sizes=st.sampled_from([1, 2, 3, 4]), max_blocks=8)
    settings = _settings(backend, examples)
    return get_state_machine_test(lambda: KVCacheMachine(cls, strat), settings=settings)


def _run(case: str, backend: str, examples: int, out) -> None:
    from hypothesis import settings as hsettings

    start = time.perf_counter()
    res: dict[str, Any] = {"case": case, "backend": backend, "examples": examples}
    try:
        if case.startswith("machine:"):
            test = _machine_case(case.split(":", 1)[1], examples, backend)
        else:
            inner = _spec_case(case) if case.startswith("spec:") else _op_case(
                case.split(":", 1)[1])
            test = hsettings(_settings(backend, examples))(inner)
        test()
        res["outcome"] = "passed"
    except Exception as err:  # the property failed: a counterexample (or the backend broke)
        res["outcome"] = "failed"
        res["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
    res["seconds"] = time.perf_counter() - start
    out.put(res)


def run_case(case: str, backend: str, examples: int, limit: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_run, args=(case, backend, examples, q))
    start = time.perf_counter()
    proc.start()
    proc.join(limit)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"case": case, "backend": backend, "examples": examples, "outcome": "timeout",
                "seconds": time.perf_counter() - start}
    try:
        return q.get(timeout=5)
    except Exception:
        return {"case": case, "backend": backend, "examples": examples,
                "outcome": f"crashed (exit {proc.exitcode})", "seconds": time.perf_counter() - start}


def cases() -> list[str]:
    from kvspec.reference.broken import BROKEN

    return (["spec:window-cover", "spec:attends", "op:reference"]
            + [f"op:{v}" for v in sorted(BROKEN)]
            + ["machine:off-by-one-window", "machine:stale-cache-entry"])


def main(examples: int, limit: float, only: list[str] | None = None) -> list[dict[str, Any]]:
    rows = []
    for case in only or cases():
        for backend in ("hypothesis", "crosshair"):
            r = run_case(case, backend, examples, limit)
            print(json.dumps(r), flush=True)
            rows.append(r)
    return rows


def cmd_crosshair(
    *, examples: int, limit: float, cases: list[str] | None, results: str | None, md: str | None
) -> dict[str, Any]:
    """hypothesis' CrossHair backend against random search on the same properties: ``examples``
    per case and backend, ``limit`` wall-clock seconds per case, the ``cases`` named (None: all)."""
    from pathlib import Path

    from .common import Timer, command_line, machine_info, save_result, write_section

    info = machine_info()
    with Timer() as timer:
        rows = main(examples, limit, cases)
    data = {"machine": info, "command": command_line(), "rows": rows, "seconds": timer.seconds,
            "examples": examples, "limit": limit}
    save_result("crosshair", data, Path(results) if results else None)
    write_section("crosshair", render_crosshair(data), Path(md) if md else None)
    return data


def render_crosshair(data: dict[str, Any]) -> str:
    from .common import header, table

    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for r in data["rows"]:
        by_case.setdefault(r["case"], {})[r["backend"]] = r

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        text = f"{r['outcome']} in {r['seconds']:.1f} s"
        return text + (f" ({r['error'][:90]})" if r.get("error") else "")

    rows = [[case, cell(b.get("hypothesis")), cell(b.get("crosshair"))]
            for case, b in by_case.items()]
    return "\n".join([
        header(data["command"], data["machine"], data.get("seconds")), "",
        f"Each case with {data['examples']} examples per backend, generate phase only, no "
        f"shrinking, in its own process cut at {data['limit']:.0f} s. `op:reference` must "
        "pass; every other `op:`/`machine:` case is a broken variant and must fail.", "",
        table(["case", "random (hypothesis backend)", "CrossHair backend"], rows)])
