"""FINDINGS C4 on vLLM 0.19.1's own Scheduler: the full-sequence admission gate
(``scheduler_reserve_full_isl``, on by default, config/scheduler.py:139; scheduler.py:731-743)
asks ``can_fit_full_sequence`` (kv_cache_manager.py:218-255) for the blocks of the whole prompt
in every group, and ``SingleTypeKVCacheManager.get_num_blocks_to_allocate``
(single_type_kv_cache_manager.py:105-127) counts a sliding-window group's blocks for every token
of it, although ``remove_skipped_blocks`` recycles the blocks behind the window chunk by chunk.
The startup check sizes that group by the window plus one budget
(``SlidingWindowSpec.max_memory_usage_bytes``, kv_cache_interface.py:251-270), so on a pool at
vLLM's startup minimum a prompt that fits chunk by chunk is refused forever, and, first in the
queue, holds up every request behind it (vllm#39734).  0.20.1 caps the gate's count of a window
group by the same bound (``max_admission_blocks_per_request``, vllm#40946): the request runs.
"""

from __future__ import annotations

import logging

import attrs
from kvspec.spec.groups import Shape
from kvspec.testing.scheduler.driver import SchedulerDriver

from .conftest import requires_vllm

# B=4 full attention + a W=4 window group of 4-token blocks, budget 4 of max_model_len 32, the
# gate on, the pool at the startup minimum: 8 full-attention blocks + cdiv(3 + 4, 4) + 1 = 3.
C4 = Shape(
    block_size=4, swa_block_size=4, sliding_window=4, extra_blocks=0, prefix_caching=False,
    num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=4, max_model_len=32,
    full_sequence_must_fit=True, max_tokens=1,
)
PROMPT = [0] * 24  # the gate counts 6 + 6 blocks; the pool holds 11
STEPS = 10  # the request needs 6 chunks and its sampled token
MINIMUM = 11


def _run(shape: Shape) -> tuple[object, SchedulerDriver]:
    """The prompt alone, stepped (every draft and token 0) until it finishes or STEPS ran."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    driver = SchedulerDriver(VLLMV1SchedulerAdapter(shape))
    driver.arrive(0, PROMPT, shape.max_tokens)
    steps = 0
    while driver.target.live(0) and steps < STEPS:
        driver.step(bytes(4), bytes(4))
        steps += 1
        assert not driver.check()
    return driver.target, driver


@requires_vllm("0.19.1", "0.19.1", pin="0.19.1")
def test_c4_a_prompt_that_fits_chunk_by_chunk_is_never_scheduled_at_the_startup_minimum():
    target, driver = _run(C4)
    assert target.num_blocks == target.minimum_blocks == MINIMUM
    assert target.live(0), "the request finished: C4 no longer reproduces"
    assert all("scheduled {}" in t.outcome for t in driver.trace if t.op == "step"), driver.trace
    # The gate is what refuses it: without it the same request runs chunk by chunk to its end.
    target, _ = _run(attrs.evolve(C4, full_sequence_must_fit=False))
    assert not target.live(0)


@requires_vllm("0.19.1", "0.19.1", pin="0.19.1")
def test_c4_the_drain_reports_progress_and_kvspec_labels_it_c4():
    """The scheduler machine's ``progress`` drain says the loop repeats with the request
    unfinished, and the shipped fingerprints label that C4 on 0.19.1 (and not on 0.20.1)."""
    from kvspec.testing import SpecViolation
    from kvspec.testing.known import SHIPPED, evidence_of, fingerprint, load_known, which_known
    from kvspec.testing.scheduler.progress import drain

    _, driver = _run(C4)
    found = drain(driver, driver.check)
    assert [(v.invariant, v.kind) for v in found] == [("progress", "livelock")], found
    error = SpecViolation(found, driver.trace)
    ops = {s.op for s in driver.trace}
    labels = {
        release: which_known(
            [k for k in load_known([SHIPPED]) if k.concerns("v1-scheduler", release)],
            fingerprint(error), evidence_of(error), None, ops,
        )
        for release in ("0.19.1", "0.20.1")
    }
    assert labels["0.19.1"] is not None and labels["0.19.1"].id == "C4", labels
    assert labels["0.20.1"] is None, labels


@requires_vllm("0.20.1", pin="0.20.1")
def test_c4_control_the_capped_gate_schedules_it():
    target, _ = _run(C4)
    assert target.num_blocks == target.minimum_blocks == MINIMUM
    assert not target.live(0), "the request never finished on a release with the capped gate"
