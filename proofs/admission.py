"""The admission obligations: admission soundness -- an admission check that answers OK is followed by an
allocation that fits.

The reference (reference/manager.py ``can_admit``/``admit``): z3 reads its admission arithmetic
(``spec.admission``) and the allocation ``admit`` then performs (revive the kept prefix hits,
then ``grow_to`` the step's last slot), over every state: pool, free and evictable blocks,
prompt, prefix hit, window, block size.  Legacy vLLM 0.6.3 (``vllm_formulas``): BlockSpaceManagerV2
caps the need of a windowed prompt at ``W//B + 2`` while ``allocate`` takes every prompt block
-- z3 derives the seed's counterexample, which tests/targets/test_seed_counterexample.py replays
on the real manager; BlockSpaceManagerV1 caps at ``ceil(W/B)`` and allocates at most that many
(its ring), which is sound.
"""

from __future__ import annotations

from collections.abc import Mapping

import z3

from . import encode as E
from . import vllm_formulas as V
from .core import Decision, Verdict, lemma, obligation, refutation, witness
from .window import per_b

OK, LATER, NEVER = V.OK, V.LATER, V.NEVER

# ---------------------------------------------------------------- the reference's admission

B, N, free, ev, L, k, hit, eh, la = z3.Ints(
    "B N free evictable prompt_len num_new_tokens hit_tokens evictable_hits lookahead"
)
win = E.Win(z3.Bool("windowed"), z3.Int("W"))


def reference_admission(
    hit_tokens,
    prompt_len,
    num_new_tokens,
    w: E.Win,
    block_size,
    free_,
    evictable,
    evictable_hits,
    num_blocks,
    lookahead,
):
    """The reference's can_admit answer and the blocks its admit allocates, as z3 terms.

    Mirrors ``ReferenceManager._plan``/``can_admit``/``admit``: the first step computes up to
    ``min(hit + max(1, k), prompt_len)`` and reserves the run's ``lookahead`` slots beyond
    (``Config.max_lookahead``), so its slots end at ``end``; ``first`` is the first slot it
    keeps, the table starts as ``first`` dropped slots plus the kept hits, and ``grow_to``
    allocates the rest up to ``end``'s slot.  Returns (status, allocated, kept_hits, end).
    """
    h = hit_tokens / block_size
    end = E.zmin(hit_tokens + E.zmax(1, num_new_tokens), prompt_len) + lookahead
    first = E.zmin(E.first_needed_block(hit_tokens, w, block_size), h)
    kept = h - first
    new = E.new_blocks_for_step(hit_tokens, end, w, block_size)
    status = z3.If(
        new + kept > num_blocks,
        NEVER,
        z3.If(E.fits(new, evictable_hits, free_, evictable), OK, LATER),
    )
    allocated = (end - 1) / block_size + 1 - (first + kept)
    return status, allocated, kept, end


STATUS, GROW, KEPT, END = reference_admission(hit, L, k, win, B, free, ev, eh, N, la)
AVAILABLE = free + ev - eh  # free + evictable once the kept hits left the evictable set

STATE = [
    B >= 1,
    win.domain(),
    N >= 1,
    free >= 0,
    ev >= 0,
    free + ev <= N,
    L >= 1,
    k >= 0,
    la >= 0,
    hit >= 0,
    hit % B == 0,  # hits are whole blocks
    hit < L,  # the last prompt token is always computed
    eh >= 0,
    eh <= KEPT,
    eh <= ev,  # evictable kept hits are in the evictable set
    KEPT - eh <= N - free - ev,  # the others are in use
]
STATE_SHOW: Mapping[str, z3.ExprRef] = {
    "B": B,
    "windowed": win.on,
    "W": win.size,
    "N": N,
    "free": free,
    "evictable": ev,
    "prompt_len": L,
    "num_new_tokens": k,
    "lookahead": la,
    "hit_tokens": hit,
    "evictable_hits": eh,
    "status(0=OK,1=LATER,2=NEVER)": STATUS,
    "allocated": GROW,
}
REF_BOUNDS = (
    "unbounded: every B, W (or none), pool, free/evictable split, prompt, hit, step, lookahead"
)


@obligation("admission-soundness/reference")
def reference_sound(deep: bool) -> Verdict:
    """When the reference's can_admit answers OK, the allocation admit performs fits: the blocks
    grow_to takes are at most the free and evictable blocks left after reviving the kept hits."""
    return lemma(
        STATE,
        z3.Implies(STATUS == OK, GROW <= AVAILABLE),
        z3.Implies(STATUS == OK, GROW <= AVAILABLE - 1),
        STATE_SHOW,
        REF_BOUNDS,
        per_value=per_b(deep),
    )


@obligation("admission-soundness/reference-exact")
def reference_exact(deep: bool) -> Verdict:
    """The reference's admission counts exactly what admit does: it allocates
    new_blocks_for_step blocks, keeps hit_blocks_held hits, holds needed_blocks(hit, end) slots,
    and answers LATER only when the allocation would not fit (no needless refusal)."""
    exact = z3.And(
        GROW == E.new_blocks_for_step(hit, END, win, B),
        KEPT == E.hit_blocks_held(hit, win, B),
        KEPT + GROW == E.needed_blocks(hit, END, win, B),
        z3.Implies(STATUS == LATER, GROW > AVAILABLE),
    )
    twin = z3.And(exact, z3.Implies(STATUS == LATER, GROW > AVAILABLE + 1))
    return lemma(STATE, exact, twin, STATE_SHOW, REF_BOUNDS, per_value=per_b(deep))


@obligation("window-bound/reference-admission")
def reference_admission_window(deep: bool) -> Verdict:
    """A sequence the reference admits with a window holds at most what the window-bound
    invariant allows for its first step (hit_tokens .. end-1)."""
    bound = E.zmin(E.window_cover(win.size + (END - hit) - 1, B), E.blocks_for_tokens(END, B))
    return lemma(
        [*STATE, win.on],
        KEPT + GROW <= bound,
        KEPT + GROW <= bound - 1,
        STATE_SHOW,
        REF_BOUNDS,
        per_value=per_b(deep),
    )


# ---------------------------------------------------------------- vLLM 0.6.3 legacy managers

vB, vW, vN, vF, vL, vLA = z3.Ints("B W N free prompt_len lookahead")
vwin = E.Win(z3.BoolVal(True), vW)
V2_STATUS = V.z_v2_can_allocate(vL, vLA, vB, vwin, vN, vF)
V2_ALLOC = V.z_v2_allocate_blocks(vL, vB)
V2_STATE = [vB >= 1, vW >= 1, vN >= 1, vF >= 0, vF <= vN, vL >= 1, vLA >= 0]
V2_SHOW = {
    "B": vB,
    "W": vW,
    "N": vN,
    "free": vF,
    "prompt_len": vL,
    "lookahead": vLA,
    "max_block_sliding_window": V.z_v2_max_block_sliding_window(vW, vB),
    "watermark_blocks": V.z_v2_watermark_blocks(vN),
    "allocate_takes": V2_ALLOC,
}
V2_CLAIM = z3.Implies(V2_STATUS == OK, V2_ALLOC <= vF)

# The seed scenario (vLLM issue #7470, README): block size 4, a 4-block pool, window 8, an empty pool.
SEED = {"B": 4, "N": 4, "W": 8}


def seed_counterexample(timeout_ms: int = 60_000) -> dict[str, int]:
    """z3's smallest prompt for the seed's pool on which V2's can_allocate says OK and allocate
    then needs more blocks than are free; every number the replay needs."""
    d = witness(
        [
            *V2_STATE,
            vB == SEED["B"],
            vN == SEED["N"],
            vW == SEED["W"],
            vF == vN,
            vLA == 0,
            z3.Not(V2_CLAIM),
            vL <= 4096,
        ],
        V2_SHOW,
        timeout_ms,
        minimize=[vL],
    )
    if d.outcome != "counterexample":
        raise AssertionError(f"z3 found no seed counterexample: {d.outcome} {d.reason}")
    return {k: int(v) for k, v in d.model.items()}


@obligation("admission-soundness/vllm-0.6.3-v2", expect="counterexample")
def v2_unsound(deep: bool) -> Verdict:
    """Claim: legacy BlockSpaceManagerV2 (vllm 0.6.3) can_allocate answering OK means allocate
    fits (block_manager_v2.py:117-145 vs :159 and block/block_table.py:81-100).  z3 searches
    vLLM's block sizes (8, 16, 32; engine/arg_utils.py:361-364) and the default watermark."""
    return refutation(
        [*V2_STATE, z3.Or(vB == 8, vB == 16, vB == 32), vLA == 0, vN <= 100_000, vL <= 1_000_000],
        V2_CLAIM,
        V2_SHOW,
        "search: B in {8,16,32}, N<=100000, prompt<=10^6, lookahead 0",
        minimize=[vN, vL, vW],
        note="can_allocate=OK, then allocate raises NoFreeBlocksError",
    )


@obligation("admission-soundness/vllm-0.6.3-v2-seed", expect="counterexample")
def v2_seed(deep: bool) -> Verdict:
    """The seed scenario: with block size 4, an empty 4-block pool and window 8, z3 finds the
    prompts V2 admits and cannot allocate (the model the target test replays)."""
    pinned = [*V2_STATE, vB == 4, vN == 4, vW == 8, vF == vN, vLA == 0, vL <= 4096]
    v = refutation(
        pinned, V2_CLAIM, V2_SHOW, "B=4, N=4, W=8, empty pool, prompt<=4096", minimize=[vL]
    )
    twenty = witness([*pinned, vL == 20, z3.Not(V2_CLAIM)], V2_SHOW)
    story = witness(  # the GitHub report: 4 prompt blocks, 3 free, cap 3
        [
            *V2_STATE,
            vLA == 0,
            V2_ALLOC == 4,
            vF == 3,
            vF == vN,
            V.z_v2_max_block_sliding_window(vW, vB) == 3,
            z3.Not(V2_CLAIM),
            vB >= 2,
            vB <= 64,
        ],
        V2_SHOW,
        minimize=[vB, vL],
    )
    extra = (
        f"; the seed's 20-token prompt is a model: {_yes(twenty)}"
        f"; the GitHub report's need 4 / free 3 / cap 3: {story.numbers() or story.outcome}"
    )
    return Verdict(v.outcome, v.bounds, v.detail + extra, v.model, v.twin, v.twin_ok)


def _yes(d: Decision) -> str:
    return "yes" if d.outcome == "counterexample" else f"no ({d.outcome})"


@obligation("admission-soundness/vllm-0.6.3-v2-exactly")
def v2_exactly(deep: bool) -> Verdict:
    """V2's can_allocate says OK and allocate then fails exactly when
    W//B + 2 + watermark_blocks <= free < ceil(prompt_len / B) (no lookahead)."""
    bad = z3.And(V2_STATUS == OK, V2_ALLOC > vF)
    cap = V.z_v2_max_block_sliding_window(vW, vB)
    wm = V.z_v2_watermark_blocks(vN)
    return lemma(
        [*V2_STATE, vLA == 0],
        bad == z3.And(cap + wm <= vF, vF < V2_ALLOC),
        bad == z3.And(cap + wm <= vF, vF <= V2_ALLOC),
        V2_SHOW,
        "unbounded: every B, W, N, free <= N, prompt; lookahead 0",
        per_value=(vB, 4096 if deep else 1024),
    )


@obligation("admission-soundness/vllm-0.6.3-v1")
def v1_sound(deep: bool) -> Verdict:
    """Legacy BlockSpaceManagerV1 (vllm 0.6.3) is admission-sound: can_allocate caps the need at
    ceil(W/B) (block_manager_v1.py:302-314) and allocate takes at most that many physical blocks,
    reusing ring entries beyond it (:321-329) -- at the price of immutability."""
    status = V.z_v1_can_allocate(vL, vB, vwin, vN, vF)
    allocated = V.z_v1_allocate_blocks(vL, vB, vwin)
    show = {
        "B": vB,
        "W": vW,
        "N": vN,
        "free": vF,
        "prompt_len": vL,
        "block_sliding_window": V.z_v1_block_sliding_window(vW, vB),
        "allocate_takes": allocated,
    }
    return lemma(
        [*V2_STATE, vLA == 0],
        z3.Implies(status == OK, allocated <= vF),
        z3.Implies(status == OK, allocated <= vF - 1),
        show,
        "unbounded: every B, W, N, free <= N, prompt",
        per_value=(vB, 4096 if deep else 1024),
    )
