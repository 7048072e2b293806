"""FINDINGS V1-S5 on vLLM 0.20.1's own Scheduler: a hybrid model (full attention + a sliding
window of 1-token blocks) with an EAGLE head and prefix caching, the pool at the startup
minimum.  Two requests with one prompt; at their second decode step ``allocate_slots`` finds
the slots fit the window group's capped admission count, then ``get_new_blocks`` raises
``ValueError: Cannot get 1 free blocks from the pool`` (the admission/allocation mismatch of the
capped sliding-window count that vllm#40027 describes).  0.25.1 and later run the same trace to
its end (``kvspec replay`` of the default run's report)."""

from __future__ import annotations

import logging

import pytest
from kvspec.spec.groups import Shape
from kvspec.testing.scheduler.driver import SchedulerDriver

from .conftest import requires_vllm

# Default `kvspec check --vllm 0.20.1 --seed 3` (2026-12-02), shrunk.
V1_S5 = Shape(
    block_size=2, swa_block_size=1, sliding_window=1, extra_blocks=0, prefix_caching=True,
    num_spec_tokens=1, async_scheduling=False, max_num_batched_tokens=4, max_model_len=16,
    full_sequence_must_fit=False, max_tokens=4, eagle=True,
)
IDLE = (bytes(4), bytes(4))


def _run() -> SchedulerDriver:
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    driver = SchedulerDriver.for_shape(VLLMV1SchedulerAdapter(V1_S5), V1_S5)
    driver.step(*IDLE)
    driver.arrive(0, [0] * 8, 1)
    driver.abort(0)
    driver.step(*IDLE)
    driver.arrive(1, [0] * 5, 3)
    driver.arrive(2, [0] * 5, 3)
    for _ in range(4):
        driver.step(*IDLE)
        assert driver.check() == []
    return driver


@requires_vllm("0.20.1", "0.20.1", pin="0.20.1")
def test_v1_s5_a_decode_the_capped_count_admits_cannot_get_its_block():
    with pytest.raises(ValueError, match="Cannot get 1 free blocks from the pool"):
        _run()


@requires_vllm("0.25.1", pin="0.33.0")
def test_v1_s5_control_the_trace_runs_from_0_25_1():
    driver = _run()
    driver.drain()
    assert driver.check() == []
