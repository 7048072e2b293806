"""FINDINGS C3 on vLLM's own Scheduler (0.25.1, 0.30.0, 0.33.0; 0.20.1 runs the request): a
sliding-window group's admission cap
(``SlidingWindowSpec.max_admission_blocks_per_request``, kv_cache_interface.py:918-944) leaves
out the EAGLE lookahead slots that ``allocate_slots`` adds (kv_cache_manager.py:549-553), so
with more lookahead tokens than the window group's block size, a pool at vLLM's startup minimum
cannot hold a sole request's first chunk: it is never scheduled.  One block more, or lookahead
within the block, and it runs."""

from __future__ import annotations

import logging

import attrs
import pytest
from kvspec.spec.groups import Shape
from kvspec.testing.scheduler.driver import SchedulerDriver

from .conftest import requires_vllm

pytestmark = requires_vllm("0.25.1", "0.33.0", pin="0.33.0")

# B=2 full attention + a W=1 window group of 1-token blocks, EAGLE with 2 drafts (lookahead 2 >
# the window group's block size), budget 14 of max_model_len 16, pool at the startup minimum.
C3 = Shape(
    block_size=2, swa_block_size=1, sliding_window=1, extra_blocks=0, prefix_caching=False,
    num_spec_tokens=2, async_scheduling=False, max_num_batched_tokens=14, max_model_len=16,
    full_sequence_must_fit=True, max_tokens=2, eagle=True,
)
PROMPT = [3] * 14
STEPS = 12  # the request needs 2 (its prompt, then its second token)


def _run(shape: Shape) -> tuple[object, SchedulerDriver]:
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    target = VLLMV1SchedulerAdapter(shape)
    driver = SchedulerDriver(target)
    driver.arrive(0, PROMPT, shape.max_tokens)
    for _ in range(STEPS):
        if not target.live(0):
            break
        driver.step(bytes([0, 1, 2, 3]), bytes([3, 3, 3, 3]))
        assert driver.check() == []
    return target, driver


@pytest.mark.xfail(
    strict=True,
    reason="FINDINGS C3 (docs/upstream/C3.md): the window group's admission cap leaves out the "
    "EAGLE lookahead slots; passes once vLLM fixes it, and then strict xfail fails CI so this "
    "marker and C3's entry are updated",
)
def test_c3_upstream_a_lone_request_at_the_startup_minimum_is_scheduled():
    """What vLLM promises (startup sizing and admission share ``max_admission_blocks_per_request``
    so that one request of ``max_model_len`` fits a pool of the startup minimum): the sole
    request is scheduled and finishes.  Fails on 0.33.0 (C3)."""
    target, driver = _run(C3)
    assert target.num_blocks == target.minimum_blocks
    assert not target.live(0), f"the sole request never finished: {[t.outcome for t in driver.trace]}"


def test_c3_sole_request_is_never_scheduled_at_the_startup_minimum():
    target, driver = _run(C3)
    assert target.num_blocks == target.minimum_blocks == 23  # 8 full-attention + cap 15
    assert target.live(0), "the sole request finished: C3 no longer reproduces"
    assert all("scheduled {}" in t.outcome for t in driver.trace if t.op == "step"), driver.trace
    # full_sequence_must_fit is not what refuses it: without it the request is refused the same.
    target, _ = _run(attrs.evolve(C3, full_sequence_must_fit=False))
    assert target.live(0)


@pytest.mark.parametrize(
    "change",
    [{"extra_blocks": 1}, {"num_spec_tokens": 1}, {"eagle": False}],
    ids=["one-block-more", "eagle-lookahead-1", "ngram-no-lookahead"],
)
def test_c3_runs_with_one_block_more_or_lookahead_within_the_block(change):
    """The same request finishes with one pool block more, or with lookahead no larger than
    the window group's block size (EAGLE with 1 draft; ngram drafts reserve no lookahead)."""
    target, _ = _run(attrs.evolve(C3, **change))
    assert not target.live(0)


def test_c3_is_found_from_scratch_by_the_scheduler_machine():
    """The scheduler machine's ``progress`` drain (testing/scheduler/progress.py) finds C3 in
    its neighbourhood (B=2 full attention + a window group of 1-token blocks, EAGLE drafts past
    the block, the startup minimum) within the CI budget, and ``kvspec check`` labels it C3."""
    from hypothesis import settings
    from hypothesis import strategies as st
    from hypothesis.stateful import run_state_machine_as_test
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter
    from kvspec.testing import SpecViolation
    from kvspec.testing.known import SHIPPED, evidence_of, fingerprint, load_known, which_known
    from kvspec.testing.scheduler.machine import SchedulerMachine

    logging.getLogger("vllm").setLevel(logging.ERROR)
    within = st.builds(
        Shape,
        block_size=st.just(2),
        swa_block_size=st.just(1),
        sliding_window=st.integers(1, 2),
        extra_blocks=st.just(0),
        prefix_caching=st.just(False),
        num_spec_tokens=st.sampled_from([2, 3]),
        async_scheduling=st.just(False),
        max_num_batched_tokens=st.sampled_from([4, 14]),
        max_model_len=st.just(16),
        full_sequence_must_fit=st.booleans(),
        max_tokens=st.just(8),
        eagle=st.just(True),
    )
    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(VLLMV1SchedulerAdapter, within),
            settings=settings(settings(), max_examples=60, report_multiple_bugs=False, deadline=None),
        )
    assert {v.invariant for v in caught.value.violations} == {"progress"}, caught.value
    import vllm

    known = [k for k in load_known([SHIPPED]) if k.concerns("v1-scheduler", vllm.__version__)]
    ops = {s.op for s in caught.value.trace}
    label = which_known(known, fingerprint(caught.value), evidence_of(caught.value), None, ops)
    assert label is not None and label.id == "C3", caught.value
