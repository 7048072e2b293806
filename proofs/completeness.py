"""Completeness obligations: what fits is admitted, what a running request needs is granted,
and V1's per-request admission cap covers what a request can hold.

* ``admission-completeness/reference``: the reference answers OK whenever ``must_admit`` holds
  (no reserve) and NEVER only when ``may_answer_never`` does.
* ``admission-completeness/vllm-0.6.3-v2-can-allocate``: legacy ``can_allocate`` under the
  policy the legacy adapter declares (whole prompt, watermark) is complete the same way.
* ``reserve-completeness/vllm-0.6.3-v2-touched-within-one``: legacy V2's worst-case count of
  blocks an append touches exceeds the exact need by at most the partly filled block.
* ``progress/vllm-0.33.0-v1-admission-cap-*``: whether ``max_admission_blocks_per_request``
  (the startup sizing and admission cap) covers the blocks a sliding-window request holds at
  its peak, for every schedule within bounds: chunk ``k``, tokens in flight ``I`` (``I + k <=
  max_in_flight_tokens``), lookahead slots ``L``.  Without lookahead it does; with
  speculative lookahead slots it does not (FINDINGS.md).
"""

from __future__ import annotations

import z3
from kvspec.spec import admission

from . import encode as E
from . import vllm_formulas as V
from .admission import END, GROW, KEPT, STATE, STATE_SHOW, STATUS, B, N, ev, free, win
from .admission import L as PROMPT
from .admission import eh as EVICTABLE_HITS
from .admission import hit as HIT
from .core import Verdict, lemma, obligation, refutation, witness
from .window import per_b

OK, LATER, NEVER = V.OK, V.LATER, V.NEVER

# ---------------------------------------------------------------- encodings of spec.admission


def must_admit(need, evictable_hits, reserve, free_, evictable):
    return need + evictable_hits + reserve <= free_ + evictable


def may_answer_never(held_alone, reserve, num_blocks):
    return held_alone + reserve > num_blocks


def step_need(table_len, start, num_new_tokens, lookahead, block_size, copies):
    end = start + num_new_tokens + lookahead
    return E.zmax(0, E.blocks_for_tokens(end, block_size) - table_len) + copies


for _enc in (
    E.Encoding(
        "admission.must_admit", admission.must_admit, must_admit, ("nat", "nat", "nat", "nat", "nat")
    ),
    E.Encoding(
        "admission.may_answer_never",
        admission.may_answer_never,
        may_answer_never,
        ("nat", "nat", "pos"),
    ),
    E.Encoding(
        "admission.step_need",
        admission.step_need,
        step_need,
        ("nat", "nat", "pos", "nat", "pos", "nat"),
    ),
):
    E.register(_enc)


# ---------------------------------------------------------------- the reference


@obligation("admission-completeness/reference")
def reference_complete(deep: bool) -> Verdict:
    """The reference's can_admit answers OK whenever must_admit holds for the exact need of the
    first step (new_blocks_for_step) with no reserve, and NEVER only when the blocks it would
    hold (new plus kept hits) exceed the pool."""
    need = E.new_blocks_for_step(HIT, END, win, B)
    held = KEPT + GROW
    goal = z3.And(
        z3.Implies(must_admit(need, EVICTABLE_HITS, 0, free, ev), STATUS == OK),
        z3.Implies(STATUS == NEVER, may_answer_never(held, 0, N)),
    )
    twin = z3.And(
        z3.Implies(must_admit(need, EVICTABLE_HITS, 0, free + 1, ev), STATUS == OK),
        z3.Implies(STATUS == NEVER, may_answer_never(held, 0, N)),
    )
    return lemma(
        STATE,
        goal,
        twin,
        STATE_SHOW,
        "unbounded: every B, W (or none), pool, free/evictable split, prompt, hit, step, lookahead",
        per_value=per_b(deep),
    )


# ---------------------------------------------------------------- legacy 0.6.3


@obligation("admission-completeness/vllm-0.6.3-v2-can-allocate")
def v2_can_allocate_complete(deep: bool) -> Verdict:
    """BlockSpaceManagerV2.can_allocate (0.6.3 block_manager_v2.py:117-145) is complete under the
    policy the legacy adapter declares: whole prompt counted (no hit discount), the default
    watermark kept back.  It answers OK whenever must_admit(ceil(L/B), 0, watermark, free,
    evictable) holds and NEVER only when may_answer_never(ceil(L/B), watermark, N) does."""
    avail = z3.Int("free_plus_evictable")
    status = V.z_v2_can_allocate(PROMPT, 0, B, win, N, avail)
    need = E.blocks_for_tokens(PROMPT, B)
    wm = V.z_v2_watermark_blocks(N)
    hyps = [B >= 1, win.domain(), N >= 1, avail >= 0, avail <= N, PROMPT >= 1]
    goal = z3.And(
        z3.Implies(must_admit(need, 0, wm, avail, 0), status == OK),
        z3.Implies(status == NEVER, may_answer_never(need, wm, N)),
    )
    twin = z3.And(
        z3.Implies(must_admit(need, 0, wm, avail + 1, 0), status == OK),
        z3.Implies(status == NEVER, may_answer_never(need, wm, N)),
    )
    show = {"B": B, "windowed": win.on, "W": win.size, "N": N, "free+evictable": avail,
            "prompt_len": PROMPT, "status(0=OK,1=LATER,2=NEVER)": status}
    return lemma(hyps, goal, twin, show, "unbounded: every B, W (or none), N, free, prompt",
                 per_value=per_b(deep))


@obligation("reserve-completeness/vllm-0.6.3-v2-touched-within-one")
def v2_touched_within_one(deep: bool) -> Verdict:
    """BlockSpaceManagerV2.can_append_slots counts the blocks an append touches
    (block_table.py:349-354: ``1 + ceil((unseen + lookahead - first_chunk) / B)``, the first
    chunk being what the partly filled last block still holds), so the declared freedom
    ``step_counts_touched`` refuses at most one block earlier than the exact need: touched <=
    step_need(table, full slots, unseen, lookahead) + 1."""
    s, u, la = z3.Ints("full_slots unseen lookahead")
    table = E.blocks_for_tokens(s, B)
    first_chunk = B - s % B
    touched = 1 + E.ceil_div(u + la - first_chunk, B)
    exact = step_need(table, s, u, la, B, 0)
    hyps = [B >= 1, s >= 0, u >= 1, la >= 0]
    show = {"B": B, "full_slots": s, "unseen": u, "lookahead": la, "touched": touched,
            "exact": exact}
    return lemma(hyps, touched <= exact + 1, touched <= exact, show,
                 "unbounded: every B, table fill, unseen tokens >= 1, lookahead",
                 per_value=per_b(deep))


# ---------------------------------------------------------------- V1 0.33.0: the admission cap

W, Ex, F, M = z3.Ints("W extra_retained max_in_flight max_model_len")
p, inflight, k, la = z3.Ints("processed in_flight chunk lookahead")
CAP = V.z_v1engine_max_admission_blocks(W, Ex, F, M, B)
_skipped = E.zmax(0, p - W + 1 - Ex)  # SlidingWindowManager.get_num_skipped_tokens(processed)
PEAK = E.blocks_for_tokens(E.zmin(p + inflight + k + la, M), B) - _skipped / B
PEAK_HYPS = [
    B >= 1,
    W >= 1,
    Ex >= 0,
    F >= 1,
    M >= 1,
    p >= 0,
    inflight >= 0,
    k >= 1,
    inflight + k <= F,  # everything scheduled but not yet settled fits max_in_flight_tokens
    p + inflight + k <= M,
    la >= 0,
]
PEAK_SHOW = {"B": B, "W": W, "extra": Ex, "max_in_flight": F, "max_len": M, "processed": p,
             "in_flight": inflight, "chunk": k, "lookahead": la, "peak": PEAK, "cap": CAP}
# vllm 0.33.0: the cap is kv_cache_interface.py:937-944; after allocate_slots a request holds
# the slots up to num_computed + new + lookahead (kv_cache_manager.py:551-553) less the blocks
# remove_skipped_blocks(processed) nulled (kv_cache_manager.py:564-567,
# single_type_kv_cache_manager.py:1180-1183).


@obligation("progress/vllm-0.33.0-v1-admission-cap-covers-peak")
def v1_cap_covers_peak(deep: bool) -> Verdict:
    """Without lookahead slots, a sliding-window request never holds more blocks than vLLM
    0.33.0's max_admission_blocks_per_request, for every chunk and every number of tokens in
    flight within max_in_flight_tokens: the startup sizing and the admission gate cover its
    peak, so a pool that passes startup can always run it."""
    return lemma(
        [*PEAK_HYPS, la == 0],
        PEAK <= CAP,
        PEAK <= CAP - 1,
        PEAK_SHOW,
        "unbounded: every B, W, extra, max_in_flight, chunk, in-flight split; lookahead 0",
        per_value=per_b(deep),
    )


@obligation("progress/vllm-0.33.0-v1-admission-cap-with-lookahead", expect="counterexample")
def v1_cap_with_lookahead(deep: bool) -> Verdict:
    """Claim: with speculative lookahead slots (num_lookahead_tokens > 0) a sliding-window
    request still never holds more blocks than max_admission_blocks_per_request.  The cap
    counts the window, the extra retained tokens and the in-flight tokens, not the lookahead
    slots allocate_slots adds past them."""
    # A deployment-sized witness too: B=16, a 4096-token window, max_num_batched_tokens 8192,
    # three EAGLE lookahead slots.
    sized = witness(
        [*PEAK_HYPS, B == 16, W == 4096, Ex == 0, F == 8192, la == 3, M == 1 << 17, p == 4110,
         inflight == 0, k == 8192, PEAK > CAP],
        {"processed": p, "in_flight": inflight, "chunk": k, "peak": PEAK, "cap": CAP},
    )
    return refutation(
        [*PEAK_HYPS, la >= 1, la <= 8, B == 1, W <= 64, F <= 64, M <= 1024],
        PEAK <= CAP,
        PEAK_SHOW,
        "search: B=1 (divisions linear), lookahead 1..8, W <= 64, max_in_flight <= 64; plus a B=16 witness",
        minimize=[la, W, F],
        note="the request holds more blocks than startup sized per request; at B=16 W=4096 "
        f"max_in_flight=8192 lookahead=3: {sized.numbers() or sized.outcome}",
    )
