"""The ``progress`` drain's victim rule on the reference manager: a request that already
stepped in an iteration is never preempted for a newer one (testing/blockmanager/progress.py)."""

from __future__ import annotations

from kvspec.reference import ReferenceManager
from kvspec.reference.broken import Livelock
from kvspec.spec.config import Config
from kvspec.testing.blockmanager.driver import Driver
from kvspec.testing.blockmanager.progress import drain

# B=1, 10 blocks, 3 lookahead slots: two admitted requests that cannot both run to their end.
SHAPE = Config(block_size=1, num_blocks=10, max_lookahead=3)


def _two_requests(manager: type[ReferenceManager]) -> Driver:
    driver = Driver(manager(SHAPE), focus={"progress"})
    assert driver.admit(0, [0, 0, 0, 0], 1)
    assert driver.admit(1, [0, 0, 0], 3)
    return driver


def test_the_oldest_running_request_is_never_the_victim_of_a_newer_one():
    """Seq 1's step is refused after seq 0 stepped: seq 1 preempts itself, seq 0 runs to its
    end, then seq 1 does.  Preempting seq 0 instead made the two evict each other forever."""
    driver = _two_requests(ReferenceManager)
    assert drain(driver) == []
    preempted = [t.args["seq"] for t in driver.trace if t.op == "preempt"]
    assert preempted and set(preempted) == {1}, preempted
    freed = [t.args["seq"] for t in driver.trace if t.op == "free"]
    assert freed == [0, 1], freed


def test_the_drain_still_catches_a_livelock():
    """The broken ``livelock`` manager re-admits a preempted request that can never step."""
    driver = _two_requests(Livelock)
    found = drain(driver)
    assert [v.invariant for v in found] == ["progress"], found


def _drained_steps(num_blocks: int) -> tuple[list, list]:
    driver = Driver(ReferenceManager(Config(block_size=1, num_blocks=num_blocks)), focus={"progress"})
    assert driver.admit(0, [0, 0], 2)  # 3 tokens with the sampled one; 4 at its end
    found = drain(driver)
    return found, [t for t in driver.trace[1:] if t.op == "step"]


def test_a_request_longer_than_the_pool_stores_is_left_out_of_the_drain():
    """Its end (4 tokens) exceeds N * B = 3, a max_model_len vLLM refuses at startup: not
    drained, so no progress verdict either way; one block more and it is drained."""
    found, steps = _drained_steps(3)
    assert found == [] and steps == [], steps
    found, steps = _drained_steps(4)
    assert found == [] and steps, "within N * B the request is drained to its end"
