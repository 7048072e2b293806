"""The scheduler adapter hashes requests as vLLM's engine core does: with EAGLE and prefix
caching, 0.33.0's block hashes also cover the token after each block
(``num_hash_lookahead_tokens``, engine/core.py:219-230), so the coordinator keeps the last hit
block instead of dropping it for the drafter."""

from __future__ import annotations

import logging

import pytest
from kvspec.spec.groups import Shape

from .conftest import requires_vllm


def _shape(lookahead: bool) -> Shape:
    return Shape(
        block_size=4, swa_block_size=4, sliding_window=None, extra_blocks=8, prefix_caching=True,
        num_spec_tokens=1, async_scheduling=False, max_num_batched_tokens=64, max_model_len=64,
        full_sequence_must_fit=False, max_tokens=4, eagle=True, lookahead_hashes=lookahead,
    )


@requires_vllm("0.33.0", pin="0.33.0")
@pytest.mark.parametrize("lookahead", [True, False])
def test_block_hashes_cover_the_next_token_exactly_when_the_engine_says(lookahead):
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter
    from kvspec.testing.scheduler.driver import SchedulerDriver

    target = VLLMV1SchedulerAdapter(_shape(lookahead))
    assert target.drops_eagle_block is not lookahead
    driver = SchedulerDriver(target)
    driver.arrive(0, [1, 2, 3, 4, 5, 6], 2)
    driver.arrive(1, [1, 2, 3, 4, 7, 6], 2)  # the same first block, another token after it
    first = [target._req[s].block_hashes[0] for s in (0, 1)]
    assert (first[0] != first[1]) is lookahead
