"""Encoding conformance: every z3 encoding, evaluated concretely (substitute + simplify), agrees
with the Python function it stands for on random inputs -- the spec's functions, the restated
vLLM formulas, and the reference's admission as ``ReferenceManager`` really runs it."""

from __future__ import annotations

import pytest
import z3
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from kvspec.proofs import admission as adm
from kvspec.proofs import (
    encode,
    vllm_formulas,  # noqa: F401  (registers the vLLM encodings)
)
from kvspec.reference.manager import ReferenceManager
from kvspec.spec.config import Config
from kvspec.spec.interface import Admission
from kvspec.spec.prefix_hash import PrefixKey
from kvspec.spec.window import first_needed_block

SMALL = 64


def _value(kind: str) -> st.SearchStrategy:
    big = 10**9
    if kind == "nat":
        return st.one_of(st.integers(0, SMALL), st.integers(0, big))
    if kind == "pos":
        return st.one_of(st.integers(1, SMALL), st.integers(1, big))
    if kind == "int":
        return st.one_of(st.integers(-SMALL, SMALL), st.integers(-big, big))
    assert kind == "window"
    return st.one_of(st.none(), st.integers(1, SMALL), st.integers(1, big))


@pytest.mark.parametrize("name", sorted(encode.ENCODINGS))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_encoding_matches_python(name: str, data) -> None:
    enc = encode.ENCODINGS[name]
    args = [data.draw(_value(kind), label=f"arg{i}") for i, kind in enumerate(enc.kinds)]
    assume(enc.requires(*args))
    want = enc.python(*args)
    got = encode.evaluate(enc, args)
    assert got == want, f"{name}{tuple(args)}: z3 {got} != python {want}"


def test_every_encoding_has_a_source_function() -> None:
    for enc in encode.ENCODINGS.values():
        assert callable(enc.python) and callable(enc.z3fn)
        if enc.name.startswith("vllm-"):
            assert enc.source.startswith("vllm "), f"{enc.name} cites no release file"


def test_watermark_restatement_is_the_float_expression() -> None:
    # int(0.01 * N) == N // 100 is what the z3 encoding assumes; check it where it matters.
    from kvspec.proofs.vllm_formulas import v2_watermark_blocks

    for n in range(0, 200_001):
        assert v2_watermark_blocks(n) == n // 100


# ---------------------------------------------------------------- the reference's admission


def _zeval(expr: z3.ExprRef, binding: dict) -> int:
    pairs = [
        (k, z3.BoolVal(v) if isinstance(v, bool) else z3.IntVal(v)) for k, v in binding.items()
    ]
    out = z3.simplify(z3.substitute(expr, *pairs))
    return out.as_long()


@settings(max_examples=200, deadline=None)
@given(
    B=st.integers(1, 4),
    W=st.one_of(st.none(), st.integers(1, 12)),
    N=st.one_of(st.integers(1, 6), st.integers(6, 16)),
    filler=st.integers(0, 3),
    live_hits=st.integers(0, 3),
    more_hits=st.integers(0, 3),
    free_donor=st.booleans(),
    tail=st.integers(1, 12),
    k=st.integers(1, 24),
    la=st.sampled_from([0, 0, 1, 3]),
)
def test_reference_admission_encoding_matches_reference_manager(
    B, W, N, filler, live_hits, more_hits, free_donor, tail, k, la
) -> None:
    """Build a pool with hits in use and evictable, then compare can_admit's answer and the
    blocks admit allocates with ``proofs.admission.reference_admission``."""
    config = Config(
        block_size=B, num_blocks=N, sliding_window=W, prefix_caching=True, max_lookahead=la
    )
    mgr = ReferenceManager(config)
    prompt = [i % 5 for i in range((live_hits + more_hits) * B + tail)]

    def run(seq: int, tokens: list[int]) -> bool:
        if mgr.can_admit(seq, tokens, len(tokens)) is not Admission.OK:
            return False
        hit = mgr.admit(seq, tokens, len(tokens))
        mgr.commit(seq, len(tokens) - hit)
        return True

    if filler:
        run(100, [7] * filler * B)
    if live_hits:
        run(101, [*prompt[: live_hits * B], 8])  # its full blocks stay in use
    if more_hits and run(102, [*prompt[: (live_hits + more_hits) * B], 9]) and free_donor:
        mgr.free(102)  # its own full blocks become evictable

    view = mgr.observe().gpu
    cached = {key: block for key, block in view.cached}
    hits = []
    for i in range((len(prompt) - 1) // B):
        block = cached.get(PrefixKey(tuple(prompt[: (i + 1) * B]), ()))
        if block is None:
            break
        hits.append(block)
    hit_tokens = len(hits) * B
    kept = hits[min(first_needed_block(hit_tokens, W, B), len(hits)) :]
    evictable_hits = sum(1 for b in kept if view.refcounts[b] == 0)
    free, evictable = len(view.free), len(view.evictable)
    binding = {
        adm.hit: hit_tokens,
        adm.L: len(prompt),
        adm.k: k,
        adm.B: B,
        adm.N: N,
        adm.free: free,
        adm.ev: evictable,
        adm.eh: evictable_hits,
        adm.la: la,
        adm.win.on: W is not None,
        adm.win.size: W if W is not None else 1,
    }
    status = _zeval(adm.STATUS, binding)
    answer = mgr.can_admit(1, prompt, k)
    event(f"admission {answer.value}, hits {bool(hits)}, evictable hits {evictable_hits > 0}")
    assert (
        answer
        is {adm.OK: Admission.OK, adm.LATER: Admission.LATER, adm.NEVER: Admission.NEVER}[status]
    )
    assert _zeval(adm.KEPT, binding) == len(kept)
    if answer is Admission.OK:
        assert mgr.admit(1, prompt, k) == hit_tokens
        after = mgr.observe().gpu
        allocated = free + evictable - evictable_hits - len(after.free) - len(after.evictable)
        assert allocated == _zeval(adm.GROW, binding)
