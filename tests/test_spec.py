"""The spec's own arithmetic and checks, on hand-built inputs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError
from kvspec.spec.invariants import (
    INVARIANTS,
    Violation,
    admission_soundness,
    check_world,
    immutability,
)
from kvspec.spec.kv_memory import OVERWRITE, UNMAPPED, WriteFault
from kvspec.spec.prefix_hash import PrefixKey, block_keys
from kvspec.spec.state import Device, KVState, PoolView, SeqModel, Status, TableView, World
from kvspec.spec.window import attends, blocks_touched, needed_blocks, window_cover


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0, "num_blocks": 4},
        {"block_size": 4, "num_blocks": 0},
        {"block_size": 4, "num_blocks": 4, "sliding_window": 0},
        {"block_size": 4, "num_blocks": 4, "sliding_window": -3},
        {"block_size": 4, "num_blocks": 4, "num_cpu_blocks": -1},
    ],
)
def test_bad_configuration_is_a_config_error(kwargs):
    with pytest.raises(ConfigError):
        Config(**kwargs)


@given(st.integers(1, 40), st.integers(1, 17))
def test_window_cover_is_the_most_blocks_any_window_touches(window, block_size):
    brute = max(blocks_touched(s, s + window - 1, block_size) for s in range(2 * block_size))
    assert window_cover(window, block_size) == brute


@given(st.integers(0, 60), st.integers(1, 30), st.integers(1, 9))
def test_attends_matches_the_needed_range(query, window, block_size):
    attended = [k for k in range(query + 1) if attends(query, k, window)]
    assert len(attended) == min(window, query + 1)
    assert needed_blocks(query, query + 1, window, block_size) == blocks_touched(
        attended[0], query, block_size
    )


def test_block_keys_chain():
    keys = block_keys([1, 2, 3, 4, 5], 2)
    assert [k.chain for k in keys] == [(1, 2), (1, 2, 3, 4)]
    assert keys[1].parent(2) == keys[0] and keys[1].block_tokens(2) == (3, 4)
    assert PrefixKey((1, 2), ("lora-a",)) != keys[0]


def _world(
    refcounts, free, tables, seqs, memory=None, cached=(), evictable=(), window=None, caching=False
):
    config = Config(
        block_size=2, num_blocks=len(refcounts), sliding_window=window, prefix_caching=caching
    )
    pool = PoolView(
        tuple(range(len(refcounts))),
        dict(enumerate(refcounts)),
        tuple(free),
        tuple(evictable),
        tuple(cached),
        frozenset(b for _, b in cached),
    )
    state = KVState(gpu=pool, tables={t.seq_id: t for t in tables})
    return World(config, state, {s.seq_id: s for s in seqs}, memory or {})


def _healthy():
    seq = SeqModel(0, (5, 6, 7), num_computed=3, step=(2, 3))
    table = TableView(0, Device.GPU, (0, 1))
    memory = {(Device.GPU, 0, 0): (0, 5), (Device.GPU, 0, 1): (1, 6), (Device.GPU, 1, 0): (2, 7)}
    return dict(refcounts=[1, 1, 0], free=[2], tables=[table], seqs=[seq], memory=memory)


def test_a_healthy_world_has_no_violation():
    assert check_world(_world(**_healthy())) == []


@pytest.mark.parametrize(
    ("invariant", "change"),
    [
        ("refcount-exact", dict(refcounts=[2, 1, 0])),
        ("conservation", dict(free=[2, 2])),
        ("conservation", dict(refcounts=[1, 1, 0], free=[])),
        ("no-leak", dict(seqs=[SeqModel(0, (5,), status=Status.WAITING)])),
        ("kv-readback", dict(memory={})),
        ("window-bound", dict(window=1)),
        (
            "prefix-cache-consistency",
            dict(cached=[(PrefixKey((5, 9)), 0)], caching=True),
        ),
    ],
)
def test_each_state_invariant_reports_its_violation(invariant, change):
    world = _world(**{**_healthy(), **change})
    found = {v.invariant for v in check_world(world)}
    assert invariant in found


def test_an_invariant_says_when_it_does_not_apply():
    plain = Config(block_size=2, num_blocks=4)
    assert INVARIANTS["window-bound"].inapplicable(plain) == "full attention (no sliding window)"
    assert INVARIANTS["prefix-cache-consistency"].inapplicable(plain) == "prefix caching off"
    assert INVARIANTS["conservation"].applies_to(plain)
    both = Config(block_size=2, num_blocks=4, sliding_window=3, prefix_caching=True)
    assert INVARIANTS["window-bound"].applies_to(both)
    assert INVARIANTS["prefix-cache-consistency"].applies_to(both)


def test_transition_invariants_make_their_own_violations():
    """Write facts carry no invariant ID: the spec functions decide which ID a fact breaks."""
    unmapped = WriteFault(UNMAPPED, "seq 0: position 4 has no slot")
    overwrite = WriteFault(OVERWRITE, "seq 0: position 4 overwrites position 2")
    assert immutability([unmapped, overwrite]) == [Violation("immutability", overwrite.message, kind=OVERWRITE)]
    assert admission_soundness(unmapped=[unmapped, overwrite]) == [
        Violation("admission-soundness", unmapped.message, kind=UNMAPPED)
    ]
    before = _world(**_healthy()).state
    after = _world(**{**_healthy(), "refcounts": [1, 1, 1], "free": []}).state
    refused = admission_soundness(False, None, before, after)
    assert [v.invariant for v in refused] == ["admission-soundness"]
    assert "refused changed the state" in refused[0].message
    assert admission_soundness(False, None, before, before) == []
    assert admission_soundness(True, None, before, after) == []  # accepted: a state change


def test_every_invariant_states_itself_and_names_vllm_code():
    for inv in INVARIANTS.values():
        assert len(inv.statement) > 40, inv.id
        assert "vllm" in inv.concerns.lower() or "V1" in inv.concerns or "legacy" in inv.concerns


def test_a_violation_round_trips_through_json_and_stays_hashable():
    from kvspec.spec.violation import PoolFacts

    v = Violation(
        "admission-soundness", "the admission check answered OK, then the allocation failed",
        kind="ok-then-failed", seqs=[1], device="gpu", expected=[[2, 5]], observed={"b": [1]},
        pool=PoolFacts(free=2, evictable=1, num_blocks=8), need=3, taken=[4, 5],
    )
    data = v.to_json()
    assert data["pool"] == {"free": 2, "evictable": 1, "num_blocks": 8} and data["taken"] == [4, 5]
    assert "group" not in data and "positions" not in data  # unset facts are left out
    assert Violation.from_json(data) == v and hash(v) == hash(Violation.from_json(data))
    assert str(v) == "[admission-soundness] the admission check answered OK, then the allocation failed"
