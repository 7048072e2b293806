"""FINDINGS V1-S4a, the trace ``kvspec fuzz --machine scheduler --vllm 0.9.1`` reported: full
attention + a sliding window W=2, both B=2, prefix caching, the pool at the startup minimum;
``arrive([0,0,0])``, ``step``, ``step``.

The first step computes the prompt and caches block 0 of both groups; the second computes
position 3, whose window starts at 2, so the window group swaps its block 0 for the null block
(``SlidingWindowManager.remove_skipped_blocks``) before ``BlockPool.cache_full_blocks`` caches
block 1 and chains its hash from block 0's ``block_hash`` (0.9.1 block_pool.py:134-139): the
assert at :138.  0.10.1.1 takes the hashes from the request (``request.block_hashes``,
block_pool.py:123-124) and reads the parent block only for KV events (F-KV2, which the scheduler
runs of these releases do not turn on), so the same trace runs to its end there and later.
"""

from __future__ import annotations

import logging

import pytest
from kvspec.spec.groups import Shape
from kvspec.testing.known import SHIPPED, label_failures, load_known
from kvspec.testing.scheduler.driver import SchedulerDriver

from .conftest import requires_vllm

bad = requires_vllm("0.9.1", "0.9.1", pin="0.9.1")
fixed = requires_vllm("0.10.1.1", pin="0.10.1.1")

SHAPE = Shape(
    block_size=2, swa_block_size=2, sliding_window=2, extra_blocks=0,
    prefix_caching=True, num_spec_tokens=0, async_scheduling=False,
    max_num_batched_tokens=16, max_model_len=16, full_sequence_must_fit=False,
    max_tokens=2,
)


@pytest.fixture(scope="module")
def adapter():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    return VLLMV1SchedulerAdapter


def _trace(driver: SchedulerDriver) -> None:
    driver.arrive(0, [0, 0, 0], 2)
    driver.step(bytes(4), bytes(4))  # the prompt; block 0 is cached in both groups
    driver.step(bytes(4), bytes(4))  # position 3: the window passes block 0, block 1 fills


@bad
def test_v1s4a_the_window_nulls_the_block_the_next_hash_chains_from(adapter):
    driver = SchedulerDriver(adapter(SHAPE))
    with pytest.raises(AssertionError) as crash:
        _trace(driver)
    where = crash.traceback[-1]
    assert where.path.name == "block_pool.py" and where.name == "cache_full_blocks", crash
    # The shipped fingerprint labels it, as `kvspec check` and `kvspec fuzz` do ...
    known = [k for k in load_known([SHIPPED]) if k.concerns("v1-scheduler", "0.9.1")]
    ((fp, found),) = label_failures(known, crash.value, driver.config, driver.trace, shape=SHAPE)
    assert (fp.operation, fp.exception, found and found.id) == ("step", "AssertionError", "V1-S4a"), fp
    # ... and no other finding of the scheduler on 0.9.1 does (F-KV2 is the block manager's,
    # V1-S2b, the same function's other assert, is 0.10.1.1-0.12.0).
    also = [k.id for k in known if label_failures([k], crash.value, driver.config, driver.trace, shape=SHAPE)[0][1]]
    assert also == ["V1-S4a"], also

@fixed
def test_v1s4a_control_the_trace_runs_to_its_end_from_0_10_1_1(adapter):
    driver = SchedulerDriver(adapter(SHAPE))
    _trace(driver)
    # Less V1-e (0.10.1.1's pool usage counts the null block at every state).
    assert [v for v in driver.check() if v.kind != "wrong-usage"] == []
    assert [v for v in driver.finish() if v.kind != "wrong-usage"] == []
