"""vLLM's own scheduler with a KV connector (``Shape.kv_connector``): NixlConnector's scheduler
side as a disaggregated prefill instance, kvspec playing the worker that sends each finished
request's KV and reports it sent (``finished_sending``) after a delay.

vLLM keeps a finished request's blocks until the report (``request_finished`` answers
delay_free_blocks, 0.33.0 nixl/pull_scheduler.py:235-270, sched/scheduler.py:3040-3060,
3579-3582).  Two broken targets, each a thin wrapper over the real adapter, show what the shape
catches and no other shape can: one frees at finish without waiting for the send
(``kv-readback``'s freed-while-sending), one never frees after it (``no-leak``).  Without a
connector both wrappers do nothing, and the same run holds.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import attrs
import pytest
from kvspec.spec.groups import Shape
from kvspec.spec.state import Status
from kvspec.testing.scheduler.driver import SchedulerDriver

from .conftest import requires_vllm

on_033 = requires_vllm("0.33.0", pin="0.33.0")
PROMPT = [1, 2, 3, 0, 1, 2, 3, 0, 1]
SHAPE = Shape(
    block_size=4, swa_block_size=4, sliding_window=None, extra_blocks=4,
    prefix_caching=True, num_spec_tokens=0, async_scheduling=False,
    max_num_batched_tokens=32, max_model_len=32, full_sequence_must_fit=False,
    max_tokens=2, kv_connector="NixlConnector",
)
PLAIN = attrs.evolve(SHAPE, kv_connector=None)
# The step rule's token bytes: the last byte draws the send's delay (0, 1 or 2 updates).
DELAY_2 = bytes([1, 2, 3, 2])


@pytest.fixture(scope="module")
def adapter():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    return VLLMV1SchedulerAdapter


@pytest.fixture(scope="module")
def broken(adapter):
    class FreesAtFinish(adapter):
        """Frees a finished request's blocks as soon as it finishes, not after its send."""

        def update(self, plan: Any, sampled: Any, drafts: Any = None, sent: Collection[int] = ()) -> None:
            super().update(plan, sampled, drafts, sent=[s for s in sent if self.sending(s)])
            for seq in self.held_for_sending():
                self._sched._free_blocks(self._req[seq])

    class NeverFreesAfterSend(adapter):
        """Drops the worker's report of a finished send: the blocks stay held for good."""

        def update(self, plan: Any, sampled: Any, drafts: Any = None, sent: Collection[int] = ()) -> None:
            super().update(plan, sampled, drafts)

    return {"frees-at-finish": FreesAtFinish, "never-frees": NeverFreesAfterSend}


def _run(driver: SchedulerDriver, steps: int) -> list:
    found: list = []
    for _ in range(steps):
        driver.step(bytes(4), DELAY_2)
        found += driver.check()
    return found


@on_033
def test_the_connector_is_built_and_offered(adapter):
    assert "NixlConnector" in adapter.kv_connectors_offered()
    target = adapter(SHAPE)
    assert type(target._sched.connector).__name__.startswith("Nixl")
    assert target.sends_kv


@on_033
def test_no_connector_beside_a_mamba_group(adapter):
    from kvspec.spec.errors import ConfigError

    with pytest.raises(ConfigError, match="Mamba"):
        adapter(attrs.evolve(SHAPE, mamba=True))


@on_033
def test_a_finished_request_keeps_its_blocks_until_its_send_is_reported(adapter):
    driver = SchedulerDriver(adapter(SHAPE))
    driver.arrive(0, PROMPT, 2)
    assert _run(driver, 2) == []  # the prefill, then the decode step that finishes it
    assert driver.seqs[0].status is Status.SENDING
    held = driver.state.groups[0].tables[0].held()
    assert held and driver.target.held_for_sending() == (0,)
    assert _run(driver, 2) == []  # the send in flight: two updates pass
    assert driver.state.groups[0].tables[0].held() == held
    assert _run(driver, 1) == []  # reported in this output: vLLM frees the blocks
    assert 0 not in driver.seqs and 0 not in driver.state.groups[0].tables
    assert driver.counts["sends_deferred"] == driver.counts["sends_reported"] == 1
    assert driver.finish() == []


@on_033
def test_an_aborted_request_frees_at_once(adapter):
    driver = SchedulerDriver(adapter(SHAPE))
    driver.arrive(0, PROMPT, 2)
    assert _run(driver, 1) == []
    driver.abort(0)
    assert driver.check() == [] and not driver.sends
    assert driver.finish() == []


@on_033
@pytest.mark.parametrize(
    ("variant", "invariants"),
    [("frees-at-finish", {"kv-readback"}), ("never-frees", {"no-leak", "refcount-exact"})],
)
def test_the_connector_shape_catches_a_broken_deferred_free(broken, variant, invariants):
    driver = SchedulerDriver(broken[variant](SHAPE))
    driver.arrive(0, PROMPT, 2)
    found = _run(driver, 5) or driver.finish()
    assert found and {v.invariant for v in found} <= invariants, found
    if variant == "frees-at-finish":
        assert {v.kind for v in found} == {"freed-while-sending"}, found


@on_033
@pytest.mark.parametrize("variant", ["frees-at-finish", "never-frees"])
def test_without_a_connector_the_broken_variants_hold(broken, variant):
    driver = SchedulerDriver(broken[variant](PLAIN))
    driver.arrive(0, PROMPT, 2)
    assert _run(driver, 5) == []
    assert driver.finish() == []
