"""Coverage: z3-generated configurations that make each branch of the window and admission
arithmetic true and false, as concrete cases a stateful machine replays.

Each case is a dict (``coverage_cases()``) describing one admission on the reference's
interface, to be replayed in this order:

1. ``Config(block_size, num_blocks, sliding_window=window, prefix_caching=True,
   max_lookahead=0)``;
2. a filler sequence admits ``filler_blocks * block_size`` tokens of its own (token 7) in one
   step and stays live: it only takes blocks off the free list;
3. if ``hit_tokens > 0``: a donor sequence admits ``prompt[:hit_tokens] + [7]`` in one step and
   commits it, publishing its ``hit_tokens // block_size`` full blocks; then it is freed
   (``hits_evictable``: the hits sit in the evictable set) or stays live;
4. the sequence under test: ``can_admit``/``admit(prompt, num_new_tokens)`` where ``prompt`` is
   ``prompt_len`` tokens from ``prompt_tokens(case)``.

``expected`` gives the spec's numbers for step 4: the admission answer, the hit, the blocks
to allocate, the hits kept, the slots held.  A side of a branch with no case within the bounds
is reported as ``{"unreachable": "unsat"}`` (z3 refuted it for every block size) instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import z3
from kvspec.spec import admission, window

from . import encode as E
from .core import Verdict, obligation

B, W, N, L, hit, k, F = z3.Ints(
    "block_size window num_blocks prompt_len hit_tokens num_new_tokens filler"
)
windowed = z3.Bool("windowed")
evictable = z3.Bool("hits_evictable")
WIN = E.Win(windowed, W)

h = hit / B
END = E.zmin(hit + k, L)
FIRST = E.first_needed_block(hit, WIN, B)
NEW = E.new_blocks_for_step(hit, END, WIN, B)
KEPT = E.hit_blocks_held(hit, WIN, B)
NEEDED = E.needed_blocks(hit, END, WIN, B)
FREE = z3.If(evictable, N - F - h, N - F - h - z3.If(hit > 0, 1, 0))
EVICTABLE = z3.If(evictable, h, 0)
EVICTABLE_HITS = z3.If(evictable, KEPT, 0)
FITS = E.fits(NEW, EVICTABLE_HITS, FREE, EVICTABLE)

SCENARIO = [
    B >= 1,
    B <= 8,
    z3.Implies(windowed, z3.And(W >= 1, W <= 32)),
    z3.Implies(z3.Not(windowed), W == 0),
    N >= 1,
    N <= 16,
    L >= 1,
    L <= 48,
    k >= 1,
    k <= 48,
    F >= 0,
    hit >= 0,
    hit % B == 0,
    hit < L,
    z3.Implies(hit == 0, z3.Not(evictable)),
    F + h + z3.If(hit > 0, 1, 0) <= N,  # filler and donor fit without evicting anything
]


@attrs.frozen
class Branch:
    """A branch condition, in z3 and in Python over a case; both sides are generated under
    ``given`` (e.g. "a prefix hit exists" for the branches about hits)."""

    name: str
    where: str  # the spec function the branch is in
    z: z3.BoolRef
    py: Callable[[dict[str, Any]], bool]
    given: z3.BoolRef = attrs.Factory(lambda: z3.BoolVal(True))
    given_py: Callable[[dict[str, Any]], bool] = lambda c: True
    twin: z3.BoolRef | None = (
        None  # an off-by-one of ``z``, which must have a case when ``z`` has none
    )


def _fnb(c):
    return window.first_needed_block(c["hit_tokens"], c["window"], c["block_size"])


def _end(c):
    return min(c["hit_tokens"] + c["num_new_tokens"], c["prompt_len"])


def _kept(c):
    return admission.hit_blocks_held(c["hit_tokens"], c["window"], c["block_size"])


def _windowed(c):
    return c["window"] is not None


def _hit_windowed(c):
    return c["window"] is not None and c["hit_tokens"] > 0


HIT_WINDOWED = z3.And(windowed, hit > 0)

BRANCHES: tuple[Branch, ...] = (
    Branch(
        "full attention",
        "window.first_needed_position",
        z3.Not(windowed),
        lambda c: not _windowed(c),
    ),
    Branch(
        "W < B",
        "window.window_cover",
        W < B,
        lambda c: c["window"] < c["block_size"],
        windowed,
        _windowed,
    ),
    Branch(
        "W aligned (W mod B == 0)",
        "window.window_cover",
        W % B == 0,
        lambda c: c["window"] % c["block_size"] == 0,
        windowed,
        _windowed,
    ),
    Branch(
        "W mod B == 1",
        "window.window_cover",
        W % B == 1,
        lambda c: c["window"] % c["block_size"] == 1,
        windowed,
        _windowed,
    ),
    Branch(
        "window start clamps at 0",
        "window.first_needed_position",
        hit - W + 1 <= 0,
        lambda c: c["hit_tokens"] - c["window"] + 1 <= 0,
        windowed,
        _windowed,
    ),
    Branch("prefix hit", "admission.new_blocks_for_step", hit > 0, lambda c: c["hit_tokens"] > 0),
    Branch(
        "hit ends inside the window (a hit is kept)",
        "admission.hit_blocks_held",
        KEPT > 0,
        lambda c: _kept(c) > 0,
        HIT_WINDOWED,
        _hit_windowed,
    ),
    Branch(
        "window drops hit blocks",
        "admission.hit_blocks_held",
        FIRST > 0,
        lambda c: _fnb(c) > 0,
        HIT_WINDOWED,
        _hit_windowed,
    ),
    Branch(
        "max() picks first_needed_block over the hit",
        "admission.new_blocks_for_step",
        FIRST > h,
        lambda c: _fnb(c) > c["hit_tokens"] // c["block_size"],
        HIT_WINDOWED,
        _hit_windowed,
        twin=FIRST >= h,
    ),
    Branch(
        "chunked first step (end < prompt_len)",
        "admission.new_blocks_for_step",
        hit + k < L,
        lambda c: c["hit_tokens"] + c["num_new_tokens"] < c["prompt_len"],
    ),
    Branch(
        "step ends on a block boundary",
        "window.needed_blocks",
        END % B == 0,
        lambda c: _end(c) % c["block_size"] == 0,
    ),
    Branch(
        "evictable hits revived",
        "admission.fits",
        EVICTABLE_HITS > 0,
        lambda c: c["hits_evictable"] and _kept(c) > 0,
        hit > 0,
        lambda c: c["hit_tokens"] > 0,
    ),
    Branch("fits", "admission.fits", FITS, lambda c: c["expected"]["fits"]),
)

UNREACHABLE = "unreachable"
_SIZES = (2, 3, 4, 1, 5, 6, 7, 8)  # block sizes tried in order: the first that has a model


def _solve(constraints: list[z3.BoolRef]) -> dict[str, Any] | str:
    """A small model: for each block size in turn (divisions become linear), minimise the rest.
    Without one: "unsat" when z3 refutes every block size, else "unknown"."""
    unknown = False
    for size in _SIZES:
        opt = z3.Optimize()
        opt.set("timeout", 20_000)
        opt.add(*SCENARIO, *constraints, B == size)
        opt.maximize(z3.If(FITS, 1, 0))  # prefer admissions that go ahead: they replay further
        opt.minimize(L + k + N + W + F + hit)
        answer = opt.check()
        if answer == z3.sat:
            return _case(opt.model())
        unknown = unknown or answer != z3.unsat
    return "unknown" if unknown else "unsat"


def _case(m: z3.ModelRef) -> dict[str, Any]:
    def val(e):
        v = m.eval(e, model_completion=True)
        return z3.is_true(v) if z3.is_bool(v) else v.as_long()

    case = {
        "block_size": val(B),
        "window": val(W) if val(windowed) else None,
        "num_blocks": val(N),
        "prompt_len": val(L),
        "hit_tokens": val(hit),
        "num_new_tokens": val(k),
        "filler_blocks": val(F),
        "hits_evictable": val(evictable),
        "max_lookahead": 0,  # the spec numbers below reserve no lookahead at admission
    }
    case["expected"] = expected(case)
    return case


def expected(case: dict[str, Any]) -> dict[str, Any]:
    """The spec's numbers for the admission under test, from the spec's Python functions."""
    b, w, n = case["block_size"], case["window"], case["num_blocks"]
    hit_, end = case["hit_tokens"], _end(case)
    new = admission.new_blocks_for_step(hit_, end, w, b)
    kept = admission.hit_blocks_held(hit_, w, b)
    hits = hit_ // b
    donor_live = hit_ > 0 and not case["hits_evictable"]
    free = n - case["filler_blocks"] - hits - (1 if donor_live else 0)
    ev = 0 if donor_live else hits
    ev_hits = kept if case["hits_evictable"] else 0
    fits = admission.fits(new, ev_hits, free, ev)
    answer = "never" if new + kept > n else "ok" if fits else "later"
    return {
        "admission": answer,
        "fits": fits,
        "new_blocks": new,
        "kept_hits": kept,
        "needed_blocks": window.needed_blocks(hit_, end, w, b),
        "end": end,
        "free": free,
        "evictable": ev,
    }


def prompt_tokens(case: dict[str, Any]) -> list[int]:
    """The prompt of the sequence under test: tokens 0, 1, 2, ... (the filler uses 7)."""
    return [i % 5 for i in range(case["prompt_len"])]


def coverage_cases() -> list[dict[str, Any]]:
    """Concrete cases, two per branch (true and false) unless z3 proves one side unreachable."""
    cases: list[dict[str, Any]] = []
    for br in BRANCHES:
        for value in (True, False):
            cond = br.z if value else z3.Not(br.z)
            found = _solve([cond, br.given])
            base = {"branch": br.name, "where": br.where, "value": value}
            if isinstance(found, str):
                cases.append({**base, UNREACHABLE: found})  # "unsat" proved, "unknown" not
            else:
                cases.append({**base, **found})
    return cases


@obligation("admission-soundness/coverage")
def coverage(deep: bool) -> Verdict:
    """z3 finds a concrete admission making each branch of the window and admission arithmetic
    true and false; a side it cannot reach is proved unreachable."""
    cases = coverage_cases()
    dead = [f"{c['branch']}={c['value']}" for c in cases if c.get(UNREACHABLE) == "unsat"]
    twins, twin_ok = [], True
    for c in cases:  # a side with no case must have a twin one off that does (not vacuous)
        if c.get(UNREACHABLE) != "unsat":
            continue
        br = _branch(c["branch"])
        cond = br.twin if c["value"] else (z3.Not(br.twin) if br.twin is not None else None)
        found = _solve([cond, br.given]) if cond is not None else "no twin"
        twin_ok = twin_ok and not isinstance(found, str)
        shown = found if isinstance(found, str) else _brief(found)
        twins.append(f"{c['branch']}: its off-by-one twin has a case ({shown})")
    unknown = [f"{c['branch']}={c['value']}" for c in cases if c.get(UNREACHABLE) == "unknown"]
    if unknown:
        return Verdict(
            "unknown",
            "B<=8, W<=32, N<=16, prompt<=48",
            f"z3 gave up on: {', '.join(unknown)}",
            twin_ok=False,
        )
    bad = [c for c in cases if not c.get(UNREACHABLE) and not takes_branch(c)]
    made = len(cases) - len(dead)
    detail = f"{made} cases for {len(BRANCHES)} branches"
    if dead:
        detail += f"; no case exists (z3: unsat for every B<=8): {', '.join(dead)}"
    if bad:
        return Verdict(
            "unknown",
            "B<=8, W<=32, N<=16, prompt<=48",
            f"{len(bad)} cases do not take their branch in Python: {bad[0]}",
            twin_ok=False,
        )
    return Verdict(
        "proved",
        "B<=8, W<=32, N<=16, prompt<=48",
        detail,
        twin="; ".join(twins) or "-",
        twin_ok=twin_ok,
    )


def _branch(name: str) -> Branch:
    return next(b for b in BRANCHES if b.name == name)


def _brief(case: dict[str, Any]) -> str:
    keys = ("block_size", "window", "prompt_len", "hit_tokens", "num_new_tokens")
    return " ".join(f"{k}={case[k]}" for k in keys)


def takes_branch(case: dict[str, Any]) -> bool:
    """Whether a case, evaluated in plain Python, meets its branch's precondition and takes the
    side it claims."""
    br = _branch(case["branch"])
    return br.given_py(case) and br.py(case) == case["value"]
