"""The reference scheduler's prefix cache beside vLLM's own Scheduler: which cached blocks
survive eviction is the release's free-queue policy (reference/policies.py
``uncached_freed_first``), and how far an EAGLE lookup reaches before its drop is the release's
``eagle_looks_past_hit_limit``; a hit shows each, and the other release's policy differs.

Full attention in blocks of 2, a pool at vLLM's startup minimum (8 blocks), every request
finishing after one step.  A computes [1, 1, 1, 1] (two full blocks, cached; freed to the queue's
tail).  C computes [5] (one block, never full, so uncached).  0.12.0 and 0.20.1 append C's
block behind A's (block_pool.py ``free_blocks``: 0.12.0 :384-398); 0.30.0 and 0.33.0 put it at
the queue's head (0.33.0 :826-847).  D's 12 tokens then take 6 blocks from the head: on the
first two releases the 5 never used and A's second block, evicting it; on the last two C's
block and the 5, evicting nothing.  E, [1, 1, 1, 1, 2], then hits 2 tokens or 4.
"""

from __future__ import annotations

import logging

import pytest
from kvspec.reference.policies import Comparison, declared_for
from kvspec.spec.groups import Shape
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.scheduler.driver import SchedulerDriver
from kvspec.testing.scheduler.machine import SchedulerLockstep, reference_beside

from .conftest import VLLM, requires_vllm

SHAPE = Shape(
    block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=0, prefix_caching=True,
    num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=16, max_model_len=16,
    full_sequence_must_fit=False, max_tokens=1,
)
ARRIVALS = ([1, 1, 1, 1], [5], [7] * 12, [1, 1, 1, 1, 2])
HIT = {"0.12.0": 2, "0.20.1": 2, "0.30.0": 4, "0.33.0": 4}  # E's hit: A's blocks left cached


def _run(policy_release: str) -> SchedulerLockstep:
    """vLLM's scheduler beside the reference under ``policy_release``'s policy: each arrival,
    then a step, until the first difference."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    target = VLLMV1SchedulerAdapter(SHAPE)
    assert target.num_blocks == 8, target.num_blocks
    policy = declared_for(policy_release)
    assert policy is not None
    lockstep = SchedulerLockstep(
        target, reference_beside(target, SHAPE, policy), Mode.RENAMING, policy=policy, release=target.vllm_version
    )
    driver = SchedulerDriver(lockstep)
    for seq, tokens in enumerate(ARRIVALS):
        driver.arrive(seq, tokens, 1)
        driver.step(bytes(4), bytes(4))
        assert not driver.check(), driver.check()
        if lockstep.compare_states() is not None:
            break
    return lockstep


@pytest.mark.parametrize("other", ["0.12.0", "0.33.0"])
@requires_vllm("0.12.0", "0.33.0", pin="0.33.0")
def test_eviction_order_is_the_releases_free_queue(other):
    """Under its own release's policy the reference hits what vLLM hits and agrees to the end;
    under a release whose free queue differs it hits otherwise and the differential says so."""
    own = VLLM if VLLM in HIT else None
    if own is None:
        pytest.skip(f"no expectation for vLLM {VLLM}; run `kvspec test-targets 0.33.0`")
    agreed = _run(own)
    assert agreed.difference is None and agreed.comparing and agreed.steps == len(ARRIVALS), agreed.difference
    assert agreed.reference.hits == 1, agreed.reference.hits
    if HIT[other] == HIT[own]:
        return
    found = _run(other).difference
    assert found is not None and found.comparison == Comparison.STEP_COUNTS and found.seq == 3, found
    assert found.target[0] == HIT[own] and found.reference[0] == HIT[other], found


# Full attention and a W=3 window in blocks of 2, an EAGLE head that drops a hit's last block:
# A computes an 11-token prompt; E's prompt is A's first 10 tokens, so its hit stops at 9 tokens
# -- 8 on whole blocks -- but its 5th full block (tokens 8-9) is cached.  0.33.0's lookups reach
# one block past the candidate up to the last full block (kv_cache_coordinator.py:869-887),
# find 10 tokens and drop a block: 8; 0.30.0's stop at the candidate (:905-921): 8, then 6.
EAGLE_SHAPE = Shape(
    block_size=2, swa_block_size=2, sliding_window=3, extra_blocks=2, prefix_caching=True,
    num_spec_tokens=2, async_scheduling=False, max_num_batched_tokens=32, max_model_len=32,
    full_sequence_must_fit=False, max_tokens=2, eagle=True, lookahead_hashes=False,
)
PROMPT = [(i * 7) % 5 for i in range(11)]
EAGLE_HIT = {"0.30.0": 6, "0.33.0": 8}


def _eagle_run(policy_release: str) -> SchedulerLockstep:
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    target = VLLMV1SchedulerAdapter(EAGLE_SHAPE)
    policy = declared_for(policy_release)
    assert policy is not None and target.drops_eagle_block
    lockstep = SchedulerLockstep(
        target, reference_beside(target, EAGLE_SHAPE, policy), Mode.RENAMING, policy=policy,
        release=target.vllm_version,
    )
    driver = SchedulerDriver(lockstep)
    driver.arrive(0, PROMPT, 2)
    for step in range(8):
        if step == 4:
            driver.arrive(1, PROMPT[:10], 2)
        driver.step(bytes(4), bytes(4))
        assert not driver.check(), driver.check()
        if lockstep.compare_states() is not None:
            break
    return lockstep


@requires_vllm("0.30.0", "0.33.0", pin="0.33.0")
def test_an_eagle_lookup_reaches_as_far_as_the_release_lets_it():
    """Under its own release's policy the reference's EAGLE hit is vLLM's; under the other
    release's (``eagle_looks_past_hit_limit``) it is a block longer or shorter, and differs."""
    if VLLM not in EAGLE_HIT:
        pytest.skip(f"no expectation for vLLM {VLLM}; run `kvspec test-targets 0.33.0`")
    agreed = _eagle_run(VLLM)
    assert agreed.difference is None and agreed.comparing and agreed.reference.hits == 1, agreed.difference
    other = next(r for r in EAGLE_HIT if r != VLLM)
    found = _eagle_run(other).difference
    assert found is not None and found.comparison == Comparison.STEP_COUNTS and found.seq == 1, found
    assert found.target[0] == EAGLE_HIT[VLLM] and found.reference[0] == EAGLE_HIT[other], found
