"""FINDINGS F14 and F15, the legacy V2 manager's progress findings, on every provisioned
release that has it: BlockSpaceManagerV2 (0.5.4 .. 0.6.3) and SelfAttnBlockSpaceManager, its
renamed successor (0.6.3.post1 .. 0.10.2, the last release with vllm/core).  A progress verdict
comes from the drain (testing/blockmanager/progress.py), which ``kvspec replay`` and so ``kvspec bisect`` do
not run: these tests are the range measurement.  Run one release with
``kvspec test-targets X``, or in its venv:
``KVSPEC_CHECKOUT=. ~/.cache/kvspec/venvs/vllm-X/bin/python -m pytest tests/targets/test_legacy_v2_progress.py``.
"""

from __future__ import annotations

import attrs
import pytest
from kvspec.spec.config import Config
from kvspec.targets.registry import release_key
from kvspec.testing.blockmanager.driver import Driver
from kvspec.testing.implementations import factory

from .conftest import VLLM, requires_vllm

pytestmark = requires_vllm("0.5.4", "0.10.2", pin="0.6.3")

# SelfAttnBlockSpaceManager replaces BlockSpaceManagerV2 from 0.6.3.post1 on.
V2 = "legacy-v2" if VLLM is not None and release_key(VLLM) <= release_key("0.6.3") else "legacy-self-attn"
# vllm#8824 (first in 0.6.3) made _can_swap count the blocks the next append touches
# (0.6.3 block_manager_v2.py:473-492); 0.6.2's counts only the swapped blocks (:470-472).
F15_FROM = "0.6.3"

# FINDINGS F15: B=1, a window of one token, 3 GPU blocks, 2 lookahead slots.
F15 = Config(block_size=1, num_blocks=3, num_cpu_blocks=2, sliding_window=1, max_lookahead=2)


def _swapped_back(config: Config) -> tuple[bool, list]:
    from kvspec.testing.blockmanager.progress import drain

    driver = Driver(factory(V2)(config), focus={"progress"})
    assert driver.admit(0, [0], 1)
    assert driver.swap_out(0)
    return driver.swap_in(0), drain(driver)


@pytest.mark.skipif(
    VLLM is None or release_key(VLLM) < release_key(F15_FROM),
    reason=f"F15's count came with vllm#8824 in {F15_FROM}: test_before_0_6_3_the_windowed_swap_in_is_granted "
    "runs instead",
)
def test_v2_windowed_swap_in_counts_the_blocks_the_window_drops():
    """F15: a swapped-out windowed sequence of two tokens needs 3 blocks for its next step
    with 2 lookahead slots (the window frees its first block before the append allocates),
    but can_swap_in counts the swapped blocks and the append's blocks together
    (block_manager_v2.py:476-492): 4 > 3, NEVER, and vLLM fails a request that fits."""
    swapped_in, found = _swapped_back(F15)
    assert not swapped_in
    assert [v.invariant for v in found] == ["progress"], found


@pytest.mark.skipif(
    VLLM is None or release_key(VLLM) >= release_key(F15_FROM),
    reason=f"from {F15_FROM} on, test_v2_windowed_swap_in_counts_the_blocks_the_window_drops runs instead",
)
def test_before_0_6_3_the_windowed_swap_in_is_granted():
    """The lower end of F15's range: before vllm#8824 the same swap-in is answered OK."""
    driver = Driver(factory(V2)(F15), focus={"progress"})
    assert driver.admit(0, [0], 1)
    assert driver.swap_out(0)
    assert driver.swap_in(0)


@pytest.mark.skipif(
    VLLM is None or release_key(VLLM) < release_key(F15_FROM),
    reason=f"F15's controls need its count (from {F15_FROM})",
)
@pytest.mark.parametrize("change", [{"max_lookahead": 0}, {"num_blocks": 4}],
                         ids=["no-lookahead", "one-block-more"])
def test_v2_windowed_swap_in_runs_without_lookahead_or_with_one_block_more(change):
    swapped_in, found = _swapped_back(attrs.evolve(F15, **change))
    assert swapped_in
    assert found == []


def test_v2_chunked_prompt_that_fills_the_pool_never_finishes():
    """F14: a 3-token prompt fills a 2-block pool (B=2); after a 2-token chunk the last token
    lands in the partly filled block allocate already took, yet can_append_slots counts that
    touched block as needing a free one (block_manager_v2.py:202-229), so the request alone is
    refused, preempted, re-admitted and refused again: it never finishes."""
    from kvspec.testing.blockmanager.progress import drain

    driver = Driver(factory(V2)(Config(block_size=2, num_blocks=2)), focus={"progress"})
    assert driver.admit(0, [0, 0, 0], 2)
    found = drain(driver)
    assert [v.invariant for v in found] == ["progress"], found
    assert "never ends" in found[0].message
