"""The seed issue as an explicit scenario: block size 4, a 4-block pool, window 8, a 20-token
prompt (vllm-project/vllm, "Prefill for sliding window models can allocate more blocks than
sliding window size")."""

from __future__ import annotations

from kvspec.reference import ReferenceManager
from kvspec.reference.broken import WindowCappedAdmission
from kvspec.spec.config import Config
from kvspec.spec.interface import Admission
from kvspec.spec.window import window_cover
from kvspec.testing import Driver

SEED = Config(block_size=4, num_blocks=4, sliding_window=8)
PROMPT = tuple(range(20))


def _held(driver: Driver, seq_id: int) -> int:
    return len(driver.state.tables[seq_id].held())


def test_reference_admits_and_holds_only_the_window():
    driver = Driver(ReferenceManager(SEED))
    bound = window_cover(SEED.sliding_window, SEED.block_size)
    assert bound == 3
    # Block-aligned chunked prefill: the rotation never needs more than the window's blocks.
    assert driver.admit(0, PROMPT, SEED.block_size, next_token=7)
    assert driver.check() == []
    peak = _held(driver, 0)
    while driver.seqs[0].num_computed < len(PROMPT):
        assert driver.step(0, SEED.block_size)
        assert driver.check() == []
        peak = max(peak, _held(driver, 0))
    for token in range(5):  # and decoding keeps it there
        assert driver.step(0, 1, next_token=token)
        assert driver.check() == []
        peak = max(peak, _held(driver, 0))
    assert peak <= bound
    assert driver.free_all() == []


def test_reference_refuses_a_whole_prompt_step_it_cannot_hold():
    # Prefilling all 20 tokens in one step writes 20 slots: 5 blocks, more than the pool.
    ref = ReferenceManager(SEED)
    assert ref.can_admit(0, PROMPT, len(PROMPT)) is Admission.NEVER


def test_v2_like_admission_is_caught_as_admission_soundness():
    driver = Driver(WindowCappedAdmission(SEED))
    assert not driver.admit(0, PROMPT, len(PROMPT))
    found = driver.check()
    assert {v.invariant for v in found} == {"admission-soundness"}
    assert "answered OK, then the allocation failed" in found[0].message


def test_v2_like_allocation_is_caught_as_window_bound():
    roomy = Config(block_size=4, num_blocks=8, sliding_window=8)
    driver = Driver(WindowCappedAdmission(roomy))
    assert driver.admit(0, PROMPT, roomy.block_size)  # first chunk of 4, but all 5 blocks taken
    found = driver.check()
    assert {v.invariant for v in found} == {"window-bound"}
    assert "holds 5 blocks" in found[0].message
