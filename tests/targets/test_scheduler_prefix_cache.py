"""The reference scheduler's prefix cache beside vLLM's own Scheduler: which cached blocks
survive eviction is the release's free-queue policy (reference/policies.py
``uncached_freed_first``), and how far an EAGLE lookup reaches before its drop is the release's
``eagle_looks_past_hit_limit``; a hit shows each, and the other release's policy differs.  Whether
a step's output caches the blocks its sampled token completes is the release's
``caches_at_output``; a preempted request's hit on its own blocks shows it.

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
from typing import Any

import attrs
import pytest
from kvspec.reference.policies import Choice, Comparison, SchedulerPolicy, declared_for
from kvspec.spec.groups import Shape
from kvspec.spec.prefix_hash import ExtraKeys
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


def _beside(shape: Shape, policy: SchedulerPolicy) -> tuple[SchedulerLockstep, SchedulerDriver]:
    """vLLM's scheduler in ``shape`` beside the reference under ``policy``, and their driver."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    target = VLLMV1SchedulerAdapter(shape)
    lockstep = SchedulerLockstep(
        target, reference_beside(target, shape, policy), Mode.RENAMING, policy=policy, release=target.vllm_version
    )
    return lockstep, SchedulerDriver.for_shape(lockstep, shape)


def _steps(
    lockstep: SchedulerLockstep, driver: SchedulerDriver, steps: int, arrivals: dict[int, tuple[Any, ...]]
) -> SchedulerLockstep:
    """Up to ``steps`` steps, ``arrivals[i]`` arriving before step i, until the first difference."""
    for step in range(steps):
        if step in arrivals:
            driver.arrive(*arrivals[step])
        driver.step(bytes(4), bytes(4))
        assert not driver.check(), driver.check()
        if lockstep.compare_states() is not None:
            break
    return lockstep


def _run(policy_release: str) -> SchedulerLockstep:
    """vLLM's scheduler beside the reference under ``policy_release``'s policy: each arrival,
    then a step, until the first difference."""
    policy = declared_for(policy_release)
    assert policy is not None
    lockstep, driver = _beside(SHAPE, policy)
    assert lockstep.target.num_blocks == 8, lockstep.target.num_blocks
    return _steps(lockstep, driver, len(ARRIVALS), {seq: (seq, tokens, 1) for seq, tokens in enumerate(ARRIVALS)})


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
    policy = declared_for(policy_release)
    assert policy is not None
    lockstep, driver = _beside(EAGLE_SHAPE, policy)
    assert lockstep.target.drops_eagle_block
    return _steps(lockstep, driver, 8, {0: (0, PROMPT, 2), 4: (1, PROMPT[:10], 2)})


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


# Full attention in blocks of 2, an EAGLE head whose block hashes cover the token after each
# block, async scheduling, a pool at vLLM's minimum.  B ([0], 4 tokens to sample) runs beside A
# (salted: no block of it is B's) until the pool is full and B is preempted, holding [0, 0, 0, 0].
# Its first block's key covers its third token, sampled by the step after the one that computed
# the block: no step's allocation knows it.  0.33.0 caches the block when that output comes back
# (scheduler.py:2401-2415), so B, re-admitted, hits 2 tokens and computes 2; a release caching
# only at allocation has nothing cached and recomputes 4.
OUTPUT_SHAPE = Shape(
    block_size=2, swa_block_size=1, sliding_window=None, extra_blocks=0, prefix_caching=True,
    num_spec_tokens=1, async_scheduling=True, max_num_batched_tokens=16, max_model_len=16,
    full_sequence_must_fit=False, max_tokens=4, eagle=True, lookahead_hashes=True,
)


def _output_run(policy: SchedulerPolicy) -> SchedulerLockstep:
    lockstep, driver = _beside(OUTPUT_SHAPE, policy)
    driver.arrive(0, [0] * 4, 3, ExtraKeys(cache_salt="seq0"))
    return _steps(lockstep, driver, 6, {0: (1, [0], 4)})


@requires_vllm("0.33.0", "0.33.0", pin="0.33.0")
def test_a_step_output_caches_the_block_its_token_completes():
    """Under 0.33.0's policy the reference's re-admission hits B's own block as vLLM's does and
    agrees to the end; with ``caches_at_output`` turned off it recomputes B, and differs."""
    own = declared_for(VLLM)
    assert own is not None and own.caches_at_output.value, own
    agreed = _output_run(own)
    assert agreed.difference is None and agreed.comparing and agreed.reference.hits == 1, agreed.difference
    allocation_only = attrs.evolve(own, caches_at_output=Choice(False, own.caches_at_output.source))
    found = _output_run(allocation_only).difference
    assert found is not None and found.comparison == Comparison.STEP_COUNTS and found.seq == 1, found
    assert found.target == (2, 2, 0) and found.reference == (0, 4, 0), found
