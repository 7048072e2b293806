"""The seed counterexample, derived by z3, replayed on the real vLLM, and the vLLM formulas the
proofs restate (proofs/vllm_formulas.py) checked against the release they were read from.

z3 (``kvspec.proofs.admission``) finds a state where legacy BlockSpaceManagerV2 (vLLM 0.6.3)
answers ``can_allocate`` OK and ``allocate`` then needs more blocks than are free.  The model is
turned into a configuration and a prompt and driven through ``adapters/legacy.py`` as the 0.6.3
scheduler does (scheduler.py:911-950): ``can_admit`` says OK, ``admit`` raises ``NoFreeBlocks``
(the adapter's translation of ``BlockAllocator.NoFreeBlocksError``).  Runs inside the vLLM 0.6.3
venv (``kvspec provision 0.6.3``); the formula of the V1 engine inside 0.33.0's.
"""

from __future__ import annotations

import itertools

import pytest
from kvspec.spec.config import Config
from kvspec.spec.errors import NoFreeBlocks
from kvspec.spec.interface import Admission

from .conftest import requires_vllm

legacy_063 = requires_vllm("0.6.3", "0.6.3")
engine_0330 = requires_vllm("0.33.0", "0.33.0")


def _models() -> dict[str, dict[str, int]]:
    from kvspec.proofs import admission

    general = admission.v2_unsound(False)
    assert general.outcome == "counterexample", general.detail
    return {"seed-pool": admission.seed_counterexample(), "vllm-block-sizes": dict(general.model)}


@legacy_063
@pytest.mark.parametrize("which", ["seed-pool", "vllm-block-sizes"])
def test_z3_counterexample_replays_on_block_space_manager_v2(which: str) -> None:
    from kvspec.adapters.legacy import make_legacy

    m = _models()[which]
    assert m["free"] == m["N"], "the replay starts from an empty pool"
    impl = make_legacy(
        Config(block_size=m["B"], num_blocks=m["N"], sliding_window=m["W"]), manager="v2"
    )
    # The numbers z3 reasoned with are the release's own.
    assert impl.mgr.max_block_sliding_window == m["max_block_sliding_window"]
    assert impl.mgr.watermark_blocks == m["watermark_blocks"]
    prompt = list(range(m["prompt_len"]))
    assert impl.can_admit(0, prompt, len(prompt)) is Admission.OK
    with pytest.raises(NoFreeBlocks, match="NoFreeBlocksError"):
        impl.admit(0, prompt, len(prompt))


@legacy_063
def test_block_space_manager_v1_admits_the_same_prompt() -> None:
    """V1 caps at ceil(W/B) and allocates only that many (its ring): admission is sound there,
    which is what proofs' admission-soundness/vllm-0.6.3-v1 proves."""
    from kvspec.adapters.legacy import make_legacy

    m = _models()["seed-pool"]
    impl = make_legacy(
        Config(block_size=m["B"], num_blocks=m["N"], sliding_window=m["W"]), manager="v1"
    )
    prompt = list(range(m["prompt_len"]))
    assert impl.can_admit(0, prompt, len(prompt)) is Admission.OK
    assert impl.admit(0, prompt, len(prompt)) == 0


@legacy_063
def test_legacy_formulas_match_the_release() -> None:
    from kvspec.adapters.legacy import make_legacy
    from kvspec.proofs import vllm_formulas as F

    for B, W, N in itertools.product(
        (1, 2, 3, 4, 8, 16), (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33), (1, 3, 99, 100, 250)
    ):
        config = Config(block_size=B, num_blocks=N, sliding_window=W)
        v2 = make_legacy(config, manager="v2")
        assert v2.mgr.max_block_sliding_window == F.v2_max_block_sliding_window(W, B)
        assert v2.mgr.watermark_blocks == F.v2_watermark_blocks(N)
        v1 = make_legacy(config, manager="v1")
        assert v1.mgr.block_sliding_window == F.v1_block_sliding_window(W, B)
        assert v1.mgr.watermark_blocks == F.v2_watermark_blocks(N)


@legacy_063
@pytest.mark.parametrize("manager", ["v2", "v1"])
def test_legacy_admission_arithmetic_matches_the_release(manager: str) -> None:
    """can_allocate's answer and the blocks allocate takes, on an empty pool, for many prompts."""
    from kvspec.adapters.legacy import make_legacy
    from kvspec.proofs import vllm_formulas as F

    answers = {F.OK: Admission.OK, F.LATER: Admission.LATER, F.NEVER: Admission.NEVER}
    for B, W, N, L in itertools.product(
        (1, 2, 4), (None, 1, 3, 4, 8), (2, 5, 8), (1, 3, 4, 7, 9, 17, 30)
    ):
        impl = make_legacy(Config(block_size=B, num_blocks=N, sliding_window=W), manager=manager)
        prompt = list(range(L))
        if manager == "v2":
            want = F.v2_can_allocate(L, 0, B, W, N, N)
            takes = F.v2_allocate_blocks(L, B)
        else:
            want = F.v1_can_allocate(L, B, W, N, N)
            takes = F.v1_allocate_blocks(L, B, W)
        got = impl.can_admit(0, prompt, L)
        assert got is answers[want], (B, W, N, L)
        if got is not Admission.OK:
            continue
        if takes > N:
            with pytest.raises(NoFreeBlocks):
                impl.admit(0, prompt, L)
            continue
        impl.admit(0, prompt, L)
        assert len(impl.observe().gpu.in_use()) == takes, (B, W, N, L)


@engine_0330
def test_v1_engine_admission_cap_matches_the_release() -> None:
    from kvspec.adapters.v1 import make_v1
    from kvspec.proofs import vllm_formulas as F

    for B, W in itertools.product((1, 2, 4, 16), (1, 2, 3, 8, 17, 64)):
        impl = make_v1(Config(block_size=B, num_blocks=8, sliding_window=W))
        spec = impl._manager.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        extra = getattr(spec, "extra_retained_tokens", 0)
        for in_flight, max_len in itertools.product((1, 7, 512, 8192), (1, 5, 100, 4096, 10**6)):
            got = spec.max_admission_blocks_per_request(
                max_in_flight_tokens=in_flight, max_model_len=max_len
            )
            assert got == F.v1engine_max_admission_blocks(W, extra, in_flight, max_len, B)


@legacy_063
def test_v2_decode_drop_rule_matches_the_release() -> None:
    """BlockSpaceManagerV2 keeps slots first_kept_slot(computed) .. last while decoding: the
    restated drop rule, and the over-holding z3 characterises (window-bound/vllm-0.6.3-v2-*)."""
    from kvspec.adapters.legacy import make_legacy
    from kvspec.proofs import vllm_formulas as F
    from kvspec.spec.window import window_cover

    for B, W in itertools.product((1, 2, 4), (1, 3, 4, 8)):
        impl = make_legacy(Config(block_size=B, num_blocks=64, sliding_window=W), manager="v2")
        impl.admit(0, [1, 2, 3], 3)
        impl.commit(0, 3)
        impl.append_token(0, 4)
        for computed in range(3, 40):
            impl.reserve(0, 1, 0)
            slots = impl.observe().tables[0].slots
            first = F.v2_first_kept_slot(computed, B, W)
            assert all(s is None for s in slots[:first]), (B, W, computed, slots)
            assert all(s is not None for s in slots[first:]), (B, W, computed, slots)
            assert len(slots) == computed // B + 1
            if computed // B >= F.v2_max_block_sliding_window(W, B):
                held = len(slots) - first
                assert held == W // B + 3 and held > window_cover(W, B)
            impl.commit(0, 1)
            impl.append_token(0, 5)


@legacy_063
def test_v1_ring_matches_the_release() -> None:
    from kvspec.adapters.legacy import make_legacy
    from kvspec.proofs import vllm_formulas as F

    for B, W, L in itertools.product((1, 2, 4), (1, 3, 4, 8), (1, 5, 9, 17)):
        config = Config(block_size=B, num_blocks=32, sliding_window=W)
        impl = make_legacy(config, manager="v1", v1_window_slots="cyclic")
        impl.admit(0, list(range(L)), L)
        slots = impl.observe().tables[0].slots
        assert len(slots) == -(-L // B)
        for i, block in enumerate(slots):
            assert block == slots[F.v1_ring_block(i, W, B)], (B, W, L, slots)
