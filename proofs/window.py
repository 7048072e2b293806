"""The window obligations: how many blocks a window touches, and vLLM's formulas for it.

The spec (``spec.window``): the token at p attends ``max(0, p-W+1) .. p``; any W consecutive
positions touch at most ``window_cover(W, B) = ceil((W-1)/B) + 1`` blocks, and some touch
exactly that many.  vLLM's formulas (``vllm_formulas``) are compared with it: sufficient or
not, and exactly when they over-reserve, with witnesses in the detail column.
"""

from __future__ import annotations

import z3

from . import encode as E
from . import vllm_formulas as V
from .core import Verdict, lemma, obligation, refutation, witness

B, W, lo = z3.Ints("B W lo")
UNBOUNDED = "unbounded: every B>=1, W>=1, position>=0"


def per_b(deep: bool) -> tuple[z3.ArithRef, int]:
    """If z3 gives up on unbounded B, prove it for each B up to this (divisions become linear)."""
    return (B, 4096 if deep else 1024)


def _positions_touched(start: z3.ArithRef, count: z3.ArithRef) -> z3.ArithRef:
    return E.blocks_touched(start, start + count - 1, B)


def _witnesses(constraints_by_label: dict[str, list[z3.BoolRef]], show) -> str:
    """Smallest example of each case, for the detail column."""
    parts = []
    for label, constraints in constraints_by_label.items():
        d = witness([B >= 1, W >= 1, *constraints], show, minimize=[W, B])
        parts.append(f"{label}: {d.numbers() if d.outcome == 'counterexample' else d.outcome}")
    return "; ".join(parts)


# ---------------------------------------------------------------- the spec's cover


@obligation("window-bound/cover")
def cover(deep: bool) -> Verdict:
    """Any W consecutive positions touch at most window_cover(W, B) = ceil((W-1)/B) + 1 blocks."""
    touched = _positions_touched(lo, W)
    bound = E.window_cover(W, B)
    return lemma(
        [B >= 1, W >= 1, lo >= 0],
        touched <= bound,
        touched <= bound - 1,
        {"B": B, "W": W, "start": lo},
        UNBOUNDED,
        per_value=per_b(deep),
    )


@obligation("window-bound/cover-attained")
def cover_attained(deep: bool) -> Verdict:
    """The bound is attained for every B and W: the W positions from a block's last slot touch
    exactly window_cover(W, B) blocks, so it is the maximum, not just an upper bound."""
    touched = _positions_touched(B - 1, W)
    bound = E.window_cover(W, B)
    return lemma(
        [B >= 1, W >= 1],
        touched == bound,
        touched == bound + 1,
        {"B": B, "W": W},
        "unbounded: every B>=1, W>=1",
        per_value=per_b(deep),
    )


@obligation("window-bound/ceil-w-over-b", expect="counterexample")
def ceil_w_over_b(deep: bool) -> Verdict:
    """The tempting ceil(W/B) (BlockSpaceManagerV1's block_sliding_window, vllm 0.6.3
    vllm/core/block_manager_v1.py:253) does not bound the blocks W consecutive positions touch."""
    touched = _positions_touched(lo, W)
    return refutation(
        [B >= 1, W >= 1, lo >= 0, B <= 64, W <= 256, lo <= 1024],
        touched <= V.z_v1_block_sliding_window(W, B),
        {
            "B": B,
            "W": W,
            "start": lo,
            "touched": touched,
            "ceil(W/B)": V.z_v1_block_sliding_window(W, B),
        },
        "search: B<=64, W<=256, start<=1024",
        minimize=[W, B, lo],
    )


@obligation("window-bound/ceil-w-over-b-short-exactly")
def ceil_w_over_b_exactly(deep: bool) -> Verdict:
    """ceil(W/B) is exactly one block short of window_cover(W, B) when B > 1 and W mod B != 1,
    and equal to it otherwise."""
    short = E.window_cover(W, B) - V.z_v1_block_sliding_window(W, B)
    exact = z3.If(z3.And(B > 1, W % B != 1), 1, 0)
    twin = z3.If(z3.And(B > 1, W % B != 0), 1, 0)
    return lemma(
        [B >= 1, W >= 1],
        short == exact,
        short == twin,
        {"B": B, "W": W},
        "unbounded: every B>=1, W>=1",
        per_value=per_b(deep),
    )


# ---------------------------------------------------------------- what the reference keeps

start, end, p, q = z3.Ints("start end p q")
win = E.Win(z3.Bool("windowed"), W)
STEP_SHOW = {"B": B, "windowed": win.on, "W": W, "start": start, "end": end, "p": p, "q": q}
STEP_HYPS = [B >= 1, win.domain(), W >= 1, start >= 0, end > start]


@obligation("kv-readback/reference-window-keeps-attended")
def reference_keeps_attended(deep: bool) -> Verdict:
    """Every key a step over positions start..end-1 attends lies in the slots the reference
    keeps, first_needed_block(start) .. (end-1)//B (with or without a window)."""
    first = E.first_needed_block(start, win, B)
    last = (end - 1) / B
    hyps = [*STEP_HYPS, start <= p, p < end, E.attends(p, q, win)]
    return lemma(
        hyps,
        z3.And(first <= q / B, q / B <= last),
        z3.And(first + 1 <= q / B, q / B <= last),
        STEP_SHOW,
        "unbounded: every B, W (or none), start < end, p in the step, q attended by p",
        per_value=per_b(deep),
    )


@obligation("kv-readback/window-drop-monotone")
def drop_monotone(deep: bool) -> Verdict:
    """first_needed_block never decreases as a sequence advances, so a slot the reference
    dropped is never needed by a later step."""
    later = z3.Int("later")
    a = E.first_needed_block(start, win, B)
    b = E.first_needed_block(later, win, B)
    return lemma(
        [B >= 1, win.domain(), start >= 0, later >= start],
        a <= b,
        a + 1 <= b,
        {"B": B, "windowed": win.on, "W": W, "start": start, "later": later},
        "unbounded: every B, W (or none), start <= later",
        per_value=per_b(deep),
    )


@obligation("window-bound/reference-held")
def reference_held(deep: bool) -> Verdict:
    """The reference holds slots first_needed_block(start) .. (end-1)//B for a step over
    start..end-1: that is needed_blocks(start, end), and never more than the window-bound
    invariant allows, min(window_cover(W + (end-start) - 1), ceil(end/B))."""
    held = (end - 1) / B - E.first_needed_block(start, win, B) + 1
    bound = E.zmin(E.window_cover(W + (end - start) - 1, B), E.blocks_for_tokens(end, B))
    hyps = [*STEP_HYPS, win.on]
    return lemma(
        hyps,
        z3.And(held == E.needed_blocks(start, end, win, B), held <= bound),
        z3.And(held == E.needed_blocks(start, end, win, B), held <= bound - 1),
        {"B": B, "W": W, "start": start, "end": end},
        "unbounded: every B, W, start < end",
        per_value=per_b(deep),
    )


# ---------------------------------------------------------------- vLLM 0.6.3 BlockSpaceManagerV2

CAP = V.z_v2_max_block_sliding_window(W, B)


@obligation("window-bound/vllm-0.6.3-v2-cap-sufficient")
def v2_cap_sufficient(deep: bool) -> Verdict:
    """Legacy BlockSpaceManagerV2's max_block_sliding_window = W//B + 2 (vllm 0.6.3
    block_manager_v2.py:79,84) is at least window_cover(W, B): enough blocks for a window."""
    return lemma(
        [B >= 1, W >= 1],
        CAP >= E.window_cover(W, B),
        CAP >= E.window_cover(W, B) + 1,
        {"B": B, "W": W},
        "unbounded: every B>=1, W>=1",
        per_value=per_b(deep),
    )


@obligation("window-bound/vllm-0.6.3-v2-cap-excess")
def v2_cap_excess(deep: bool) -> Verdict:
    """W//B + 2 over-reserves by exactly 2 blocks when B = 1, by 1 when B > 1 and W mod B is 0
    or 1, and is exact otherwise."""
    excess = CAP - E.window_cover(W, B)
    exact = z3.If(B == 1, 2, z3.If(W % B <= 1, 1, 0))
    twin = z3.If(B == 1, 2, z3.If(W % B == 0, 1, 0))
    v = lemma(
        [B >= 1, W >= 1],
        excess == exact,
        excess == twin,
        {"B": B, "W": W},
        "unbounded: every B>=1, W>=1",
        per_value=per_b(deep),
    )
    show = {"B": B, "W": W, "cap": CAP, "cover": E.window_cover(W, B)}
    cases = {
        "+2": [B == 1],
        "+1 (W%B=0)": [B > 1, W % B == 0],
        "+1 (W%B=1)": [B > 1, W % B == 1],
        "exact": [B > 1, W % B >= 2],
    }
    return _with_witnesses(v, _witnesses(cases, show))


def _with_witnesses(v: Verdict, text: str) -> Verdict:
    detail = f"{v.detail}; {text}" if v.detail else text
    return Verdict(v.outcome, v.bounds, detail, v.model, v.twin, v.twin_ok)


c, la = z3.Ints("computed lookahead")
V2_KEPT = V.z_v2_first_kept_slot(c, B, W)
V2_HELD = (c + la) / B - V2_KEPT + 1  # slots first_kept .. last slot of position c+la


@obligation("window-bound/vllm-0.6.3-v2-decode-held", expect="counterexample")
def v2_decode_held(deep: bool) -> Verdict:
    """In decode, legacy BlockSpaceManagerV2 holds slots computed//B - (W//B + 2) .. (computed +
    lookahead)//B (block_table.py:138-146): claim it stays within the window-bound invariant's
    min(window_cover(W + lookahead), ceil((computed + 1 + lookahead)/B))."""
    bound = E.zmin(E.window_cover(W + la, B), E.blocks_for_tokens(c + 1 + la, B))
    hyps = [B >= 1, W >= 1, c >= 0, la >= 0, B <= 64, W <= 256, c <= 4096, la <= 8]
    show = {"B": B, "W": W, "computed": c, "lookahead": la, "held": V2_HELD, "bound": bound}
    seed = witness([*hyps, B == 4, W == 8, la == 0, V2_HELD > bound], show, minimize=[c])
    return refutation(
        hyps,
        V2_HELD <= bound,
        show,
        "search: B<=64, W<=256, computed<=4096, lookahead<=8",
        minimize=[W, B, c, la],
        note=f"at the seed's B=4 W=8: {seed.numbers()}; over-holding (memory waste), "
        "not a lost token",
    )


@obligation("window-bound/vllm-0.6.3-v2-decode-excess")
def v2_decode_excess(deep: bool) -> Verdict:
    """Once a decoding sequence is past W//B + 2 blocks (no lookahead), legacy BlockSpaceManagerV2
    holds W//B + 3 blocks: window_cover(W, B) plus 3 when B = 1, plus 2 when W mod B is 0 or 1,
    plus 1 otherwise."""
    excess = V2_HELD - E.window_cover(W, B)
    exact = z3.If(B == 1, 3, z3.If(W % B <= 1, 2, 1))
    twin = z3.If(B == 1, 3, z3.If(W % B <= 1, 2, 0))
    return lemma(
        [B >= 1, W >= 1, la == 0, c / B >= CAP],
        excess == exact,
        excess == twin,
        {"B": B, "W": W, "computed": c},
        "unbounded: every B, W, computed >= (W//B + 2)*B, lookahead 0",
        per_value=per_b(deep),
    )


@obligation("kv-readback/vllm-0.6.3-v2-drop-keeps-attended")
def v2_drop_keeps_attended(deep: bool) -> Verdict:
    """Legacy BlockSpaceManagerV2 never frees a slot the next token attends: its first kept
    slot is at most first_needed_block(computed)."""
    fnb = E.first_needed_block(c, E.Win(z3.BoolVal(True), W), B)
    return lemma(
        [B >= 1, W >= 1, c >= 0],
        V2_KEPT <= fnb,
        V2_KEPT <= fnb - 1,
        {"B": B, "W": W, "computed": c},
        "unbounded: every B, W, computed >= 0",
        per_value=per_b(deep),
    )


# ---------------------------------------------------------------- vLLM 0.6.3 BlockSpaceManagerV1

R = V.z_v1_block_sliding_window(W, B)


def _ring_cell_equal(x, y):
    return z3.And(V.z_v1_ring_block(x / B, W, B) == V.z_v1_ring_block(y / B, W, B), x % B == y % B)


@obligation("kv-readback/vllm-0.6.3-v1-ring-slots")
def v1_ring_slots(deep: bool) -> Verdict:
    """BlockSpaceManagerV1's ring of ceil(W/B) blocks (block_manager_v1.py:253,326-329) never
    puts two positions less than W apart in one cell: as a ring of slots it holds the window."""
    return lemma(
        [B >= 1, W >= 1, q >= 0, p > q],
        z3.Implies(p - q < W, z3.Not(_ring_cell_equal(p, q))),
        z3.Implies(p - q < R * B + 1, z3.Not(_ring_cell_equal(p, q))),
        {"B": B, "W": W, "p": p, "q": q},
        "unbounded: every B, W, positions 0 <= q < p < q + W",
        per_value=per_b(deep),
    )


@obligation("immutability/vllm-0.6.3-v1-ring-overwrite", expect="counterexample")
def v1_ring_overwrite(deep: bool) -> Verdict:
    """Claim: a BlockSpaceManagerV1 prefill never writes a position into a cell an earlier
    position of the same prompt already filled.  The ring reuses a full block in place."""
    L = z3.Int("prompt_len")
    return refutation(
        [B >= 1, W >= 1, L >= 1, q >= 0, q < p, p < L, B <= 64, W <= 256, L <= 4096],
        z3.Not(_ring_cell_equal(p, q)),
        {"B": B, "W": W, "prompt_len": L, "p": p, "overwrites q": q, "ring blocks": R},
        "search: B<=64, W<=256, prompt<=4096",
        minimize=[L, W, B],
        note="q's block is full and is overwritten in place",
    )


# ---------------------------------------------------------------- vLLM 0.33.0 V1 engine

Ex, T, M = z3.Ints("extra_retained in_flight max_model_len")
V1E = V.z_v1engine_max_admission_blocks(W, Ex, T, M, B)
N_POS = W + Ex + T - 1  # positions a request may hold: the (extended) window and in-flight tokens
V1E_SPEC = E.zmin(E.window_cover(N_POS, B), E.blocks_for_tokens(M, B))
V1E_HYPS = [B >= 1, W >= 1, Ex >= 0, T >= 1, M >= 1]
V1E_SHOW = {
    "B": B,
    "W": W,
    "extra": Ex,
    "in_flight": T,
    "max_len": M,
    "vllm": V1E,
    "spec": V1E_SPEC,
}


@obligation("window-bound/vllm-0.33.0-v1-admission-cap-sufficient")
def v1engine_sufficient(deep: bool) -> Verdict:
    """V1's SlidingWindowSpec.max_admission_blocks_per_request (vllm 0.33.0
    kv_cache_interface.py:937-944) is at least the most blocks the window-bound invariant lets a
    request hold: min(window_cover(W + extra + in_flight - 1), ceil(max_model_len / B))."""
    return lemma(
        V1E_HYPS,
        V1E >= V1E_SPEC,
        V1E >= V1E_SPEC + 1,
        V1E_SHOW,
        "unbounded: every B, W, extra >= 0, in_flight >= 1, max_model_len >= 1",
        per_value=per_b(deep),
    )


@obligation("window-bound/vllm-0.33.0-v1-admission-cap-excess")
def v1engine_excess(deep: bool) -> Verdict:
    """It over-reserves by exactly one block when (W - 1 + extra + in_flight) - 1 is a multiple
    of B or ceil(max_model_len / B) <= ceil((W - 1 + extra + in_flight) / B), and is exact
    otherwise."""
    n = W - 1 + Ex + T
    one = z3.Or((n - 1) % B == 0, E.ceil_div(M, B) <= E.ceil_div(n, B))
    v = lemma(
        V1E_HYPS,
        V1E - V1E_SPEC == z3.If(one, 1, 0),
        V1E - V1E_SPEC == z3.If((n - 1) % B == 0, 1, 0),
        V1E_SHOW,
        "unbounded: every B, W, extra >= 0, in_flight >= 1, max_model_len >= 1",
        per_value=per_b(deep),
    )
    cases = {
        "+1 (aligned)": [Ex == 0, M >= 4096, (n - 1) % B == 0, B > 1],
        "+1 (max_len caps)": [Ex == 0, M < n],
        "exact": [Ex == 0, M >= 4096, (n - 1) % B != 0],
    }
    parts = []
    for label, cons in cases.items():
        d = witness([*V1E_HYPS, *cons], V1E_SHOW, minimize=[M, W, T, B])
        parts.append(f"{label}: {d.numbers() if d.outcome == 'counterexample' else d.outcome}")
    return _with_witnesses(v, "; ".join(parts))
