"""The obligation registry, the one way a claim is decided, and results.

A claim is hypotheses => goal.  z3 decides it by looking for a model of hypotheses AND NOT
goal: ``unsat`` is *proved*, ``sat`` is a *counterexample* (its model in plain numbers),
anything else (timeout, incomplete arithmetic) is *unknown* with z3's reason, never proved.
A proved claim carries a *twin*: the same claim with the conclusion off by one, which z3
must refute; a twin that is not refuted means the hypotheses are (nearly) contradictory and
the proof says nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import attrs
import z3

Outcome = Literal["proved", "counterexample", "unknown"]

DEFAULT_TIMEOUT_MS = 60_000
DEEP_TIMEOUT_MS = 600_000


@attrs.frozen
class Decision:
    """z3's answer about one claim."""

    outcome: Outcome
    model: Mapping[str, int | bool | None] = attrs.field(factory=dict)
    reason: str = ""

    def numbers(self) -> str:
        return plain(self.model)


@attrs.frozen
class Verdict:
    """What an obligation function returns: its main decision plus what it checked around it."""

    outcome: Outcome
    bounds: str
    detail: str = ""
    model: Mapping[str, int | bool] = attrs.field(factory=dict)
    twin: str = ""  # how the off-by-one twin (or the mutants) fared, for the table
    twin_ok: bool = True


@attrs.frozen
class Result:
    """One row of the table."""

    obligation: str
    serves: tuple[str, ...]
    statement: str
    bounds: str
    expected: Outcome
    outcome: Outcome
    detail: str
    twin: str
    twin_ok: bool
    seconds: float
    model: Mapping[str, int | bool] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome == self.expected and self.twin_ok


@attrs.frozen
class Obligation:
    id: str
    expected: Outcome
    statement: str
    fn: Callable[[bool], Verdict]
    deep_only: bool = False
    serves: tuple[str, ...] = ()
    """The spec invariants this obligation is about (the first is the ID before the slash)."""

    def run(self, deep: bool = False) -> Result:
        start = time.perf_counter()
        try:
            verdict = self.fn(deep)
        except z3.Z3Exception as err:  # a solver crash is an unknown, never a proof
            verdict = Verdict("unknown", "", detail=f"z3 error: {err}", twin_ok=False)
        return Result(
            obligation=self.id,
            serves=self.serves,
            statement=self.statement,
            bounds=verdict.bounds,
            expected=self.expected,
            outcome=verdict.outcome,
            detail=verdict.detail,
            twin=verdict.twin,
            twin_ok=verdict.twin_ok,
            seconds=time.perf_counter() - start,
            model=dict(verdict.model),
        )


OBLIGATIONS: dict[str, Obligation] = {}


def obligation(
    id: str,
    expect: Outcome = "proved",
    *,
    deep_only: bool = False,
    also_serves: Iterable[str] = (),
):
    """Register an obligation under ``<invariant-id>/<name>``; its docstring is the statement.
    It serves the invariant before the slash and those in ``also_serves``."""

    def register(fn: Callable[[bool], Verdict]) -> Callable[[bool], Verdict]:
        assert id not in OBLIGATIONS, f"obligation {id} registered twice"
        statement = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
        serves = tuple(dict.fromkeys((id.split("/", 1)[0], *also_serves)))
        OBLIGATIONS[id] = Obligation(id, expect, statement, fn, deep_only, serves)
        return fn

    return register


# ---------------------------------------------------------------- deciding claims


def plain(model: Mapping[str, int | bool | None]) -> str:
    return " ".join(f"{k}={_show(v)}" for k, v in model.items())


def _show(v: int | bool | None) -> str:
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def _value(model: z3.ModelRef, expr: z3.ExprRef) -> int | bool:
    v = model.eval(expr, model_completion=True)
    if z3.is_true(v):
        return True
    if z3.is_false(v):
        return False
    return v.as_long()


def _tidy(model: dict[str, int | bool | None]) -> dict[str, int | bool | None]:
    """A window that is off has no size: print it as None."""
    if model.get("windowed") is False and "W" in model:
        model["W"] = None
    return model


def decide(
    hypotheses: Sequence[z3.BoolRef],
    goal: z3.BoolRef,
    show: Mapping[str, z3.ExprRef],
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
) -> Decision:
    """Prove ``hypotheses => goal`` or find a counterexample; ``show`` names what a model prints."""
    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    solver.add(*hypotheses)
    solver.add(z3.Not(goal))
    answer = solver.check()
    if answer == z3.unsat:
        return Decision("proved")
    if answer == z3.sat:
        model = solver.model()
        return Decision("counterexample", _tidy({k: _value(model, e) for k, e in show.items()}))
    return Decision("unknown", reason=solver.reason_unknown())


def witness(
    constraints: Sequence[z3.BoolRef],
    show: Mapping[str, z3.ExprRef],
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    minimize: Iterable[z3.ArithRef] = (),
) -> Decision:
    """A model of ``constraints`` ("counterexample" = found), optionally lexicographically
    minimised so the numbers are small enough to read and replay."""
    goals = list(minimize)
    solver: z3.Solver | z3.Optimize = z3.Optimize() if goals else z3.Solver()
    solver.set("timeout", timeout_ms)
    solver.add(*constraints)
    for g in goals:
        solver.minimize(g)
    answer = solver.check()
    if answer == z3.sat:
        model = solver.model()
        return Decision("counterexample", _tidy({k: _value(model, e) for k, e in show.items()}))
    if answer == z3.unsat:
        return Decision("proved", reason="no model exists")
    return Decision("unknown", reason=solver.reason_unknown())


def lemma(
    hypotheses: Sequence[z3.BoolRef],
    goal: z3.BoolRef,
    twin: z3.BoolRef,
    show: Mapping[str, z3.ExprRef],
    bounds: str,
    *,
    per_value: tuple[z3.ArithRef, int] | None = None,
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    unbounded_timeout_ms: int = 10_000,
    note: str = "",
) -> Verdict:
    """Decide a lemma that should be proved, and check that its off-by-one twin is refuted.

    With ``per_value=(B, n)``, an unbounded attempt that comes back unknown (nonlinear integer
    division defeats z3 now and then) is retried for B = 1 .. n one value at a time, where
    every division by B is linear; the row then states that bound.
    """
    timeout = unbounded_timeout_ms if per_value is not None else timeout_ms
    d = decide(hypotheses, goal, show, timeout)
    prefix = ""
    twin_decision: Decision | None = None
    if d.outcome == "unknown" and per_value is not None:
        var, n = per_value
        prefix = f"unbounded attempt: unknown ({d.reason}); "
        bounds = f"{var}=1..{n} one at a time; all else as stated ({bounds})"
        d = _per_value(hypotheses, goal, show, var, n, timeout_ms)
        twin_decision = _per_value(hypotheses, twin, show, var, n, timeout_ms)
    t = twin_decision or decide(hypotheses, twin, show, timeout)
    if t.outcome == "unknown" and per_value is not None:
        t = _per_value(hypotheses, twin, show, *per_value, timeout_ms)
    if t.outcome == "counterexample":
        twin_text, twin_ok = f"refuted ({t.numbers()})", True
    elif t.outcome == "proved":
        twin_text, twin_ok = "NOT refuted: the hypotheses may be vacuous", False
    else:
        twin_text, twin_ok = f"unknown ({t.reason})", False
    if d.outcome == "proved":
        detail = prefix + note
    elif d.outcome == "counterexample":
        detail = prefix + d.numbers()
    else:
        detail = prefix + f"unknown: {d.reason}"
    return Verdict(d.outcome, bounds, detail.strip().rstrip(";"), d.model, twin_text, twin_ok)


def _per_value(
    hypotheses: Sequence[z3.BoolRef],
    goal: z3.BoolRef,
    show: Mapping[str, z3.ExprRef],
    var: z3.ArithRef,
    n: int,
    timeout_ms: int,
) -> Decision:
    """``decide`` for var = 1 .. n, substituting each value (one incremental solver)."""
    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    claim = z3.And(*hypotheses, z3.Not(goal))
    for value in range(1, n + 1):
        solver.push()
        solver.add(z3.substitute(claim, (var, z3.IntVal(value))))
        answer = solver.check()
        if answer == z3.sat:
            model = solver.model()
            shown = {
                k: _value(model, z3.substitute(e, (var, z3.IntVal(value)))) for k, e in show.items()
            }
            return Decision("counterexample", _tidy(shown))
        if answer != z3.unsat:
            return Decision("unknown", reason=f"{var}={value}: {solver.reason_unknown()}")
        solver.pop()
    return Decision("proved")


def refutation(
    hypotheses: Sequence[z3.BoolRef],
    goal: z3.BoolRef,
    show: Mapping[str, z3.ExprRef],
    bounds: str,
    *,
    minimize: Iterable[z3.ArithRef] = (),
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    note: str = "",
) -> Verdict:
    """Decide a claim that is expected to be false: z3 must find the witness."""
    d = witness([*hypotheses, z3.Not(goal)], show, timeout_ms, minimize)
    if d.outcome == "counterexample":
        detail = d.numbers() + (f"; {note}" if note else "")
        return Verdict("counterexample", bounds, detail, d.model, "-")
    if d.outcome == "proved":  # no witness: the claim holds
        return Verdict("proved", bounds, "no witness: the claim holds", twin="-")
    return Verdict("unknown", bounds, f"unknown: {d.reason}", twin="-")


# ---------------------------------------------------------------- running


def select(selection: Iterable[str] | None = None, deep: bool = False) -> list[Obligation]:
    """The obligations named by ``selection`` (all when None): an entry that is an obligation
    ID selects just it, any other entry every ID starting with it."""
    if selection is None:
        return [ob for ob in OBLIGATIONS.values() if deep or not ob.deep_only]
    wanted = list(selection)
    exact = {w for w in wanted if w in OBLIGATIONS}
    prefixes = [w for w in wanted if w not in OBLIGATIONS]
    return [
        ob
        for ob in OBLIGATIONS.values()
        if ob.id in exact or any(ob.id.startswith(p) for p in prefixes)
    ]
