"""vLLM 0.33.0's KVCacheManager under the ``progress`` drain: the shape of the triaged
candidate (B=1, 10 blocks, 3 lookahead tokens, two requests that cannot both run to their
end).  It was the model's victim rule, not vLLM (FINDINGS.md, completeness and progress, P1):
the real manager drains clean under the loop vLLM's scheduler runs."""

from __future__ import annotations

from kvspec.spec.config import Config
from kvspec.testing.blockmanager.driver import Driver
from kvspec.testing.blockmanager.progress import drain
from kvspec.testing.implementations import factory

from .conftest import requires_vllm

pytestmark = requires_vllm("0.33.0", pin="0.33.0")


def test_v1_two_lookahead_requests_both_finish():
    driver = Driver(factory("v1")(Config(block_size=1, num_blocks=10, max_lookahead=3)), focus={"progress"})
    assert driver.admit(0, [0, 0, 0, 0], 1)
    assert driver.admit(1, [0, 0, 0], 3)
    assert drain(driver) == []
    # The shape is reached: seq 1's step is refused while seq 0 runs, and seq 1 is the victim.
    preempted = [t.args["seq"] for t in driver.trace if t.op == "preempt"]
    assert preempted and set(preempted) == {1}, preempted
    assert [t.args["seq"] for t in driver.trace if t.op == "free"] == [0, 1]
