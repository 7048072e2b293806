"""FINDINGS C6 on vLLM's own Scheduler: ngram speculative decoding with a token budget below
1 + ``num_speculative_tokens``.  VllmConfig accepts it: its check (0.33.0 config/vllm.py
:2371-2377) wants the budget above ``num_lookahead_tokens``, which is 0 for ngram drafts.  From
0.30.0 the waiting loop pads a request with one token left to compute -- beside scheduled
running requests, or once it has computed tokens, as after a prefix hit -- to a decode of
1 + num_speculative_tokens rows, and when the budget cannot hold that it "prefers to not
schedule" and leaves the loop (0.33.0 sched/scheduler.py:1308-1330; 0.30.0 :1042-1064).  A
budget below 1 + num_speculative_tokens never holds it: the request waits forever, and
everything behind it.  0.25.1 pads only beside scheduled running requests (scheduler.py
:812-826), so a lone request runs unpadded; 0.12.0 and 0.20.1 do not pad admissions.

The trace: a two-token prompt runs to its end and caches its first block; a three-token prompt
with that block is admitted at a two-token hit with one token left."""

from __future__ import annotations

import logging

import attrs
import pytest
from kvspec.spec.groups import Shape
from kvspec.testing.scheduler.driver import SchedulerDriver
from kvspec.testing.scheduler.progress import drain

from .conftest import requires_vllm

# B=2, prefix caching, 2 ngram drafts, budget 2 (< 1 + 2), the pool at the startup minimum.
C6 = Shape(
    block_size=2, swa_block_size=1, sliding_window=None, extra_blocks=0, prefix_caching=True,
    num_spec_tokens=2, async_scheduling=False, max_num_batched_tokens=2, max_model_len=16,
    full_sequence_must_fit=False, max_tokens=2,
)
IDLE = (bytes(4), bytes(4))


def _drain(shape: Shape) -> tuple[SchedulerDriver, list]:
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    target = VLLMV1SchedulerAdapter(shape)
    driver = SchedulerDriver.for_shape(target, shape)
    driver.arrive(0, [0, 0], 1)
    driver.step(*IDLE)
    driver.arrive(1, [0, 0, 0], 1)
    return driver, drain(driver, driver.check)


@requires_vllm("0.30.0", pin="0.33.0")
def test_c6_a_request_at_a_hit_with_one_token_left_is_never_scheduled():
    driver, found = _drain(C6)
    assert [(v.invariant, v.kind) for v in found] == [("progress", "livelock")], found
    assert driver.target.live(1)


@requires_vllm("0.30.0", pin="0.33.0")
def test_c6_is_labelled_c6_by_its_shape():
    """The shipped fingerprints tell C6 from the other lone-request stalls of 0.33.0 (C3: EAGLE
    and a window group, C5: a Mamba group) by the shape the failure ran in."""
    import vllm
    from kvspec.cli.shapes import SCHEDULER_IMPL
    from kvspec.testing.blockmanager.driver import SpecViolation
    from kvspec.testing.known import SHIPPED, label_failures, load_known, shape_of

    driver, found = _drain(C6)
    known = [k for k in load_known([SHIPPED]) if k.concerns(SCHEDULER_IMPL, vllm.__version__)]
    error = SpecViolation(found, list(driver.trace))
    ((_, finding),) = label_failures(known, error, driver.config, driver.trace, shape_of(driver))
    assert finding is not None and finding.id == "C6", finding


@requires_vllm("0.12.0", pin="0.33.0")
def test_c6_control_a_budget_that_holds_the_padded_decode_runs_it():
    _, found = _drain(attrs.evolve(C6, max_num_batched_tokens=3))
    assert found == []


@requires_vllm("0.12.0", "0.25.1", pin="0.25.1")
def test_c6_control_releases_before_0_30_run_the_same_trace_to_its_end():
    driver, found = _drain(C6)
    assert found == [] and not driver.target.live(1)


@pytest.mark.xfail(strict=True, reason="FINDINGS C6: vLLM 0.30.0+ never schedules the padded admission")
@requires_vllm("0.30.0", pin="0.33.0")
def test_c6_upstream_a_request_the_config_accepts_is_eventually_scheduled():
    """What should happen: a request of an accepted configuration finishes (scheduled unpadded,
    as vllm#53962 does where max_model_len leaves no room for the padding)."""
    driver, found = _drain(C6)
    assert found == [] and not driver.target.live(1)
