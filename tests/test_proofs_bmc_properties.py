"""The BMC's state properties (proofs/bmc.py ``STATE_PROPERTIES``) are the spec's invariants:
on arbitrary concrete states -- healthy or not -- each z3 property holds exactly when the spec
function of the same ID (spec/invariants.py) finds no violation in the same state."""

from __future__ import annotations

import functools

import pytest
import z3
from hypothesis import given, settings
from hypothesis import strategies as st
from kvspec.proofs import bmc
from kvspec.spec.config import Config
from kvspec.spec.invariants import INVARIANTS
from kvspec.spec.prefix_hash import PrefixKey
from kvspec.spec.state import Device, KVState, PoolView, SeqModel, TableView, World

BOUNDS = [bmc.DEFAULT_BOUNDS, bmc.Bounds(window=None), bmc.Bounds(block_size=3, window=4, max_slots=3)]
RC_MAX = 2  # enough to be one off either way for two sequences
FREE_MAX = 2  # 2 is a double free


FIELDS = ("rc", "fl", "ev", "key", "slot")


@st.composite
def states(draw, b: bmc.Bounds) -> dict:
    """A state in the BMC's value format (``bmc.initial_values``): a healthy one (refcounts
    from the tables, every block free, evictable or in use) with up to two fields perturbed,
    so that each property is seen both holding and failing.  Slots hold in-range block ids
    (an out-of-range id is the encoding's type constraint)."""
    N, T, P = b.num_blocks, b.max_slots, b.positions
    seqs = []
    for _ in range(b.num_seqs):
        live = draw(st.booleans())
        start = draw(st.integers(0, P)) if live else 0
        end = draw(st.integers(start, P)) if live else 0
        slots = draw(st.lists(st.sampled_from([bmc.NONE, *range(N)]), min_size=T, max_size=T))
        seqs.append({"live": live, "n": start, "st": start, "en": end, "tl": T, "sl": slots})
    holders = [sum(s["sl"].count(x) for s in seqs if s["live"]) for x in range(N)]
    kinds = [
        "in-use" if holders[x] else draw(st.sampled_from(["free", "evictable"])) for x in range(N)
    ]
    v = {
        "rc": holders,
        "fl": [int(k == "free") for k in kinds],
        "ev": [k == "evictable" for k in kinds],
        "key": [k == "evictable" or (k == "in-use" and draw(st.booleans())) for k in kinds],
        "wr": [[False] * b.block_size for _ in range(N)],
        "seqs": seqs,
    }
    for _ in range(draw(st.integers(0, 2))):
        field, x = draw(st.sampled_from(FIELDS)), draw(st.integers(0, N - 1))
        if field == "rc":
            v["rc"][x] = draw(st.integers(0, RC_MAX + 1))
        elif field == "fl":
            v["fl"][x] = draw(st.integers(0, FREE_MAX))
        elif field in ("ev", "key"):
            v[field][x] = not v[field][x]
        else:
            seq = draw(st.sampled_from(seqs))
            seq["sl"][draw(st.integers(0, T - 1))] = draw(st.sampled_from([bmc.NONE, *range(N)]))
    return v


def world_of(b: bmc.Bounds, v: dict) -> World:
    """The same state as the spec sees it: one GPU pool, a running sequence per live slot."""
    N = b.num_blocks
    pool = PoolView(
        ids=tuple(range(N)),
        refcounts=dict(enumerate(v["rc"])),
        free=tuple(x for x in range(N) for _ in range(v["fl"][x])),
        evictable=tuple(x for x in range(N) if v["ev"][x]),
        cached=tuple((PrefixKey((x,) * b.block_size), x) for x in range(N) if v["key"][x]),
    )
    tables, seqs = {}, {}
    for sid, s in enumerate(v["seqs"]):
        if s["live"]:
            slots = tuple(None if x == bmc.NONE else x for x in s["sl"])
            tables[sid] = TableView(sid, Device.GPU, slots)
            tokens = (0,) * max(1, s["en"])
            seqs[sid] = SeqModel(sid, tokens, num_computed=s["n"], step=(s["st"], s["en"]))
    config = Config(
        block_size=b.block_size, num_blocks=N, sliding_window=b.window, prefix_caching=b.prefix_caching
    )
    return World(config, KVState(gpu=pool, tables=tables), seqs, {})


@functools.cache
def _encoded(b: bmc.Bounds) -> tuple[bmc.State, dict[str, z3.BoolRef]]:
    state = bmc.State.fresh(b, "conf")
    return state, {name: prop(b, state) for name, prop in bmc.STATE_PROPERTIES.items()}


def bmc_holds(b: bmc.Bounds, v: dict) -> dict[str, bool]:
    """Each z3 property with the state's values substituted, simplified to true or false."""
    state, props = _encoded(b)
    pairs = [(eq.arg(0), eq.arg(1)) for eq in bmc._bind(b, state, v)]
    out = {}
    for name, prop in props.items():
        value = z3.simplify(z3.substitute(prop, *pairs))
        assert z3.is_true(value) or z3.is_false(value), (name, value)
        out[name] = z3.is_true(value)
    return out


@pytest.mark.parametrize("b", BOUNDS, ids=lambda b: b.describe())
def test_bmc_state_properties_are_the_spec_invariants(b):
    seen: dict[str, set[bool]] = {name: set() for name in bmc.STATE_PROPERTIES}

    @settings(max_examples=200, deadline=None)
    @given(states(b))
    def agree(v):
        world = world_of(b, v)
        for name, holds in bmc_holds(b, v).items():
            inv = INVARIANTS[name]
            spec_holds = not inv.applies_to(world.config) or not inv.check(world)
            assert holds == spec_holds, (name, inv.check(world) if inv.applies_to(world.config) else "n/a", v)
            seen[name].add(holds)

    agree()
    # Both verdicts occurred for every property that applies (else the agreement says little).
    for name, verdicts in seen.items():
        if name == "window-bound" and b.window is None:
            continue
        assert verdicts == {True, False}, (name, verdicts)


def test_the_bmc_proves_every_state_property_it_encodes():
    assert set(bmc.STATE_PROPERTIES) <= set(INVARIANTS)
    assert set(bmc.TRANSITION_PROPERTIES) <= set(INVARIANTS)
