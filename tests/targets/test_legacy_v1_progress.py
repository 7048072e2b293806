"""FINDINGS F17 and F18: BlockSpaceManagerV1's one-free-block-per-sequence heuristics leave a
lone request that fits stuck when it holds the whole pool.  Found by the default
``kvspec check --vllm 0.6.2 --seed 1`` (the V1 manager is 0.6.2's default); the manager code is
the same in 0.6.3, where CI runs these replays.

F17: ``can_append_slots`` wants one free block per running sequence of the group
(block_manager_v1.py:370-380), even when the step needs no new block: a prompt chunked over a
pool it fills (B=3 N=3, 8 tokens) is refused its next chunk, preempted by recompute, re-admitted
and refused again, forever.

F18: ``can_swap_in`` adds one block per swapped sequence to the blocks it swaps in
(block_manager_v1.py:526-546): a request holding the whole pool (B=3 N=1, one block) is answered
NEVER and failed, though it fits.
"""

from __future__ import annotations

import logging

from kvspec.spec.config import Config

from .conftest import requires_vllm

pytestmark = requires_vllm("0.5.4", "0.6.3", pin="0.6.3")


def _admit(tokens: int, k: int) -> dict:
    return {"op": "admit", "args": {"seq": 0, "tokens": [0] * tokens, "num_new_tokens": k, "next_token": 0}}


STEP = {"op": "step", "args": {"seq": 0, "num_new_tokens": 1, "next_token": 0}}
F17_TRACE = [_admit(5, 5), STEP, STEP, STEP]  # the third step (position 7) is refused; the drain loops
F18_TRACE = [_admit(1, 1), {"op": "swap_out", "args": {"seq": 0}}, {"op": "swap_in", "args": {"seq": 0}}]


def _progress(config: Config, trace: list[dict]) -> list[str]:
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.legacy import make_legacy
    from kvspec.testing.blockmanager.driver import Driver, apply_step
    from kvspec.testing.blockmanager.progress import drain

    driver = Driver(make_legacy(config, "v1"))
    for step in trace:
        apply_step(driver, step)
        assert driver.check() == []
    return [v.message for v in drain(driver) if v.invariant == "progress"]


def test_f17_a_chunked_prompt_that_fills_the_pool_never_finishes_on_the_v1_manager():
    assert _progress(Config(block_size=3, num_blocks=3), F17_TRACE)


def test_f17_control_one_block_more_finishes():
    assert _progress(Config(block_size=3, num_blocks=4), F17_TRACE) == []


def test_f18_a_swapped_request_that_holds_the_pool_is_never_swapped_in():
    assert _progress(Config(block_size=3, num_blocks=1, num_cpu_blocks=1), F18_TRACE)


def test_f18_control_one_block_more_swaps_in():
    assert _progress(Config(block_size=3, num_blocks=2, num_cpu_blocks=1), F18_TRACE) == []
