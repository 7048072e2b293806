"""testing/blockmanager/swarm.py: prompt shaping decodes to what it promises; the swarm machine runs clean on
the reference and still catches a broken variant."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference import ReferenceManager
from kvspec.reference.broken import BROKEN
from kvspec.testing import RunStats, SpecViolation
from kvspec.testing.blockmanager.strategies import configs, prompt_from
from kvspec.testing.blockmanager.swarm import PROMPT_BYTES, Swarm, SwarmMachine, length_bytes, shape

MAX_LEN = 24
B = 4
header = st.binary(min_size=PROMPT_BYTES, max_size=PROMPT_BYTES)
tails = st.binary(max_size=12)
earlier = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=MAX_LEN).map(tuple),
                   min_size=1, max_size=4)


@given(st.integers(1, MAX_LEN))
def test_length_bytes_decode_to_the_length(length):
    a, b = length_bytes(length, MAX_LEN)
    assert 1 + a * b * MAX_LEN // 65536 == length


@given(header, tails, earlier)
def test_repeat_shaping_repeats_an_earlier_prompt_exactly(head, tail, prompts):
    raw = bytes([1 | head[0], 1 | head[1]]) + head[2:] + tail  # extends; odd cut code
    shaped = shape(raw, Swarm(repeat=True), prompts, B, MAX_LEN, free_blocks=0)
    assert prompt_from(shaped, prompts, B, MAX_LEN) in prompts


@given(header, tails, earlier)
def test_aligned_shaping_gives_whole_blocks(head, tail, prompts):
    shaped = shape(head + tail, Swarm(aligned=True), prompts, B, MAX_LEN, free_blocks=0)
    assert len(prompt_from(shaped, prompts, B, MAX_LEN)) % B == 0


@given(header, tails, st.integers(1, MAX_LEN // B))
def test_fill_shaping_asks_for_exactly_the_free_blocks(head, tail, free):
    raw = bytes([4 * (head[0] // 4)]) + head[1:] + tail  # a fresh prompt
    shaped = shape(raw, Swarm(fill=True), [], B, MAX_LEN, free_blocks=free)
    assert len(prompt_from(shaped, [], B, MAX_LEN)) == free * B


def test_no_shaping_leaves_the_bytes_alone():
    raw = bytes(range(10))
    assert shape(raw, Swarm(), [(0, 1)], B, MAX_LEN, free_blocks=3) == raw


QUICK = settings(max_examples=40, stateful_step_count=20, deadline=None, database=None,
                 derandomize=True, report_multiple_bugs=False,
                 suppress_health_check=list(HealthCheck))


def test_swarm_machine_holds_on_the_reference():
    stats = RunStats()
    run_state_machine_as_test(lambda: SwarmMachine(ReferenceManager, stats=stats), settings=QUICK)
    assert stats.examples >= 20 and stats.operations > 0


def test_swarm_machine_catches_a_broken_variant():
    small = configs(block_sizes=st.sampled_from([1, 2, 4]), max_blocks=8)
    with pytest.raises(SpecViolation):
        run_state_machine_as_test(
            lambda: SwarmMachine(BROKEN["leak-on-free"].cls, small),
            settings=settings(QUICK, max_examples=200))
