"""FINDINGS V1-S6: on 0.10.1.1 an abort of a request that already finished, whose KV send is
still pending (NixlConnector, a disaggregated prefill instance), frees its blocks while the send
still reads them.

0.10.1.1's ``Scheduler.finish_requests`` (sched/scheduler.py:976-1018) takes every request it
still holds, finished or not, sets the new status and calls ``_free_request`` again.  A request
that finished by length was kept for its send (``NixlConnector.request_finished`` answered a
delayed free, nixl_connector.py:397-417); asked again under FINISHED_ABORTED it answers no
delay (:397-398), so ``_free_blocks`` runs at once (scheduler.py:1030-1038).  0.12.0 skips a
finished request there (sched/scheduler.py:1332), the fix of vllm#25067.  The trace is the one
``kvspec fuzz --machine scheduler --vllm 0.10.1.1`` reported: ``arrive`` with max_tokens=1,
``step`` (the prefill finishes it, its send deferred), ``abort``.
"""

from __future__ import annotations

import logging

import pytest
from kvspec.spec.config import Config
from kvspec.spec.groups import Shape
from kvspec.spec.state import Status
from kvspec.testing import SpecViolation
from kvspec.testing.known import SHIPPED, label_failures, load_known
from kvspec.testing.scheduler.driver import SchedulerDriver

from .conftest import requires_vllm

bad = requires_vllm("0.10.1.1", "0.10.1.1", pin="0.10.1.1")
fixed = requires_vllm("0.12.0", pin="0.12.0")

SHAPE = Shape(
    block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=4,
    prefix_caching=False, num_spec_tokens=0, async_scheduling=False,
    max_num_batched_tokens=16, max_model_len=16, full_sequence_must_fit=False,
    max_tokens=1, kv_connector="NixlConnector",
)
PROMPT = [0, 0, 0]
# The step rule's token bytes: the last byte draws the send's delay (2 updates).
DELAY_2 = bytes([1, 2, 3, 2])


@pytest.fixture(scope="module")
def adapter():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    return VLLMV1SchedulerAdapter


def _check(driver: SchedulerDriver) -> list:
    """What the driver finds, less V1-e (0.10.1.1's pool usage counts the null block, at every
    state; FINDINGS V1-e)."""
    return [v for v in driver.check() if v.kind != "wrong-usage"]


def _finished_and_sending(adapter) -> SchedulerDriver:
    driver = SchedulerDriver(adapter(SHAPE))
    driver.arrive(0, PROMPT, 1)
    driver.step(bytes(4), DELAY_2)  # the prefill samples its one token: finished by length
    assert _check(driver) == []
    assert driver.seqs[0].status is Status.SENDING and driver.target.held_for_sending() == (0,)
    return driver


@bad
def test_v1s6_an_abort_after_the_finish_frees_blocks_the_send_still_reads(adapter):
    driver = _finished_and_sending(adapter)
    driver.abort(0)  # e.g. the client disconnects as the prefill completes
    found = _check(driver)
    assert found and {(v.invariant, v.kind) for v in found} == {("kv-readback", "freed-while-sending")}, found
    # The scheduler no longer holds the request, though its send was never reported.
    assert driver.target.held_for_sending() == ()
    # The shipped fingerprint labels it, as `kvspec check` and `kvspec fuzz` do.
    known = [k for k in load_known([SHIPPED]) if k.concerns("v1-scheduler", "0.10.1.1")]
    error = SpecViolation(found, list(driver.trace))
    labels = label_failures(known, error, Config(block_size=2, num_blocks=4), shape=SHAPE)
    assert [(fp.invariant, k.id if k else None) for fp, k in labels] == [("kv-readback", "V1-S6")]


@fixed
def test_v1s6_control_an_abort_after_the_finish_is_ignored_from_0_12_0(adapter):
    driver = _finished_and_sending(adapter)
    driver.abort(0)
    assert _check(driver) == []
    assert driver.target.held_for_sending() == (0,)  # still kept for its send
    for _ in range(3):  # the send is reported; then vLLM frees the blocks
        driver.step(bytes(4), DELAY_2)
        assert _check(driver) == []
    assert not driver.sends and driver.finish() == []
