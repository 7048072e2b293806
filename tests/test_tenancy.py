"""The prefix cache as tenants and routers see it: extra keys (domains), isolation, KV-cache
events.  The broken variants that break these are in tests/test_stateful_broken.py."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference import ReferenceManager
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError
from kvspec.spec.events import CacheEvent, EventKind, replay
from kvspec.spec.invariants import INVARIANTS
from kvspec.spec.prefix_hash import NO_EXTRA, ExtraKeys, MMFeature, block_keys, key_of
from kvspec.spec.state import Device, KVState, PoolView, SeqModel, TableView, World
from kvspec.testing import KVCacheMachine, RunStats
from kvspec.testing.blockmanager.strategies import configs, extra_from, one_length_per_identifier

IMG = MMFeature("image-x", 3, 2)


def test_extra_keys_for_chain_follows_vllm_dependencies():
    extra = ExtraKeys("tenant-a", "adapter-1", (IMG,))
    # Salt and adapter reach every block; a feature only the chains it starts inside.
    assert extra.for_chain(3) == (("cache_salt", "tenant-a"), ("lora", "adapter-1"))
    assert extra.for_chain(4)[-1] == ("mm", "image-x", 3)
    assert not NO_EXTRA and extra and NO_EXTRA.for_chain(8) == ()
    assert ExtraKeys("") == NO_EXTRA or not ExtraKeys("")  # an empty salt is no salt
    keys = block_keys([1, 2, 3, 4, 5, 6], 2, ExtraKeys(mm=(IMG,)))
    assert keys[0].extra == () and keys[1].extra == keys[2].extra == (("mm", "image-x", 3),)
    assert keys[2].parent(2) == keys[1] and keys[1].parent(2) == keys[0]
    assert ExtraKeys.from_json(extra.to_json()) == extra


def test_overlapping_features_are_rejected():
    with pytest.raises(ConfigError):
        ExtraKeys(mm=(MMFeature("a", 0, 3), MMFeature("b", 2, 1)))


def test_extra_from_draws_only_allowed_kinds():
    raw = bytes([0] * 6 + [4, 4, 1, 0x21])
    both = extra_from(raw, 8, 2)
    assert both.cache_salt and both.lora and both.mm
    assert extra_from(raw, 8, 2, frozenset({"mm"})) == ExtraKeys(mm=both.mm)
    assert extra_from(bytes(10), 8, 2) is NO_EXTRA


def test_an_identifier_keeps_the_length_it_was_first_drawn_with():
    """An identifier is a content hash: drawn again at another length, an item takes its first
    length, and is dropped where that leaves the prompt or runs into the item before it."""
    first = ExtraKeys("s", mm=(MMFeature("a", 0, 2),))
    again = ExtraKeys("s", mm=(MMFeature("a", 1, 1), MMFeature("b", 3, 1)))
    assert one_length_per_identifier(again, [first], 4) == ExtraKeys(
        "s", mm=(MMFeature("a", 1, 2), MMFeature("b", 3, 1))
    )
    assert one_length_per_identifier(again, [first], 2) == ExtraKeys("s")
    within = ExtraKeys(mm=(MMFeature("a", 0, 1), MMFeature("a", 1, 3)))
    assert one_length_per_identifier(within, [], 2) == ExtraKeys(
        mm=(MMFeature("a", 0, 1), MMFeature("a", 1, 1))
    )
    assert one_length_per_identifier(ExtraKeys(mm=(MMFeature("a", 0, 1),)), [first], 1) is NO_EXTRA


def _world(tables, seqs, cached, events=None):
    config = Config(block_size=2, num_blocks=4, prefix_caching=True)
    refcounts = {b: sum(t.slots.count(b) for t in tables) for b in range(4)}
    gpu = PoolView(
        ids=(0, 1, 2, 3),
        refcounts=refcounts,
        free=tuple(b for b in range(4) if not refcounts[b]),
        cached=tuple(cached),
        events=events,
    )
    state = KVState(gpu=gpu, tables={t.seq_id: t for t in tables})
    return World(config, state, {s.seq_id: s for s in seqs}, {})


def test_isolation_flags_a_hit_across_salts():
    tokens = (1, 2, 3)
    a, b = ExtraKeys("tenant-a"), ExtraKeys("tenant-b")
    seqs = [SeqModel(0, tokens, extra=a), SeqModel(1, tokens, extra=b)]
    tables = [TableView(0, Device.GPU, (0, 1)), TableView(1, Device.GPU, (0, 2))]
    check = INVARIANTS["prefix-cache-isolation"].check
    found = check(_world(tables, seqs, [(key_of(tokens, 2, a), 0)]))
    assert any("another domain" in v.message for v in found), found
    assert any("shared across domains" in v.message for v in found), found
    # The same two sequences in one domain share block 0 legitimately.
    same = [SeqModel(0, tokens, extra=a), SeqModel(1, tokens, extra=a)]
    assert check(_world(tables, same, [(key_of(tokens, 2, a), 0)])) == []


def test_isolation_lets_a_feature_after_the_block_share_it():
    tokens = (1, 2, 3, 4)
    with_image = ExtraKeys(mm=(MMFeature("image-x", 2, 2),))
    seqs = [SeqModel(0, tokens), SeqModel(1, tokens, extra=with_image)]
    tables = [TableView(0, Device.GPU, (0, 1)), TableView(1, Device.GPU, (0, 2))]
    check = INVARIANTS["prefix-cache-isolation"].check
    assert check(_world(tables, seqs, [(key_of(tokens, 2), 0)])) == []
    shared_second = [TableView(0, Device.GPU, (0, 1)), TableView(1, Device.GPU, (0, 1))]
    assert check(_world(shared_second, seqs, [(key_of(tokens, 2), 0)]))


def test_event_replay_counts_duplicates_and_flags_unstored_removals():
    k = key_of((1, 2), 2)
    live, faults = replay(
        [
            CacheEvent(EventKind.STORED, (k,)),
            CacheEvent(EventKind.STORED, (k,)),
            CacheEvent(EventKind.REMOVED, (k,)),
        ]
    )
    assert live[k] == 1 and not faults
    live, faults = replay([CacheEvent(EventKind.CLEARED), CacheEvent(EventKind.REMOVED, (k,))])
    assert not live and len(faults) == 1


def test_event_consistency_compares_the_replayed_multiset():
    k = key_of((1, 2), 2)
    check = INVARIANTS["event-consistency"].check
    stored = (CacheEvent(EventKind.STORED, (k,)),)
    assert check(_world([], [], [(k, 0)], stored)) == []
    assert check(_world([], [], [(k, 0), (k, 1)], stored))  # a duplicate never announced
    assert check(_world([], [], [], stored))  # a removal never announced
    assert check(_world([], [], [(k, 0)], None)) == []  # no events reported: nothing to say


def test_reference_machine_draws_domains_and_events():
    """The machine's default run on the reference exercises every kind of extra key and the
    event stream, and the reference passes."""
    stats = RunStats()
    run_state_machine_as_test(
        lambda: KVCacheMachine(ReferenceManager, configs(prefix_caching=st.just(True), max_blocks=12), stats=stats),
        settings=settings(settings(), max_examples=max(settings().max_examples // 2, 50)),
    )
    assert stats.events >= 50, stats
    for kind in ("cache_salt", "lora", "mm"):
        assert stats.extras.get(kind, 0) >= 20, stats


def test_partial_tail_is_published_promoted_and_retired():
    """A prompt ending inside a block publishes the block under its partial chain; when the
    block fills, the partial key is retired (BlockRemoved) and the full key stored."""
    from kvspec.reference.manager import PartialTailReference
    from kvspec.testing.blockmanager.driver import Driver

    d = Driver(PartialTailReference(Config(block_size=4, num_blocks=4, prefix_caching=True)))
    assert d.admit(0, [1, 2, 3, 4, 5, 6], 6, next_token=7)
    assert not d.check()
    cached = {len(k.chain): b for k, b in d.state.gpu.cached}
    assert set(cached) == {4, 6}, cached  # the full block and the partial tail
    for token in (8, 9):
        assert d.step(0, 1, next_token=token)
        assert not d.check(), d.check()
    cached = {len(k.chain): b for k, b in d.state.gpu.cached}
    assert set(cached) == {4, 8}, cached  # promoted: the 6-token key is gone
    kinds = [(e.kind.value, len(e.keys[0].chain)) for e in d.state.gpu.events]
    assert kinds == [("stored", 4), ("stored", 6), ("removed", 6), ("stored", 8)], kinds


def test_partial_tail_reference_machine_holds():
    from kvspec.reference.manager import PartialTailReference

    stats = RunStats()
    run_state_machine_as_test(
        lambda: KVCacheMachine(
            PartialTailReference, configs(prefix_caching=st.just(True), max_blocks=12), stats=stats
        ),
        settings=settings(settings(), max_examples=max(settings().max_examples // 2, 50)),
    )
    assert stats.events >= 50, stats


def test_events_are_replayed_per_kv_cache_group():
    """Under a hybrid scheduler each group's stream is replayed against that group's own map
    (``GroupState.events``): a store in the wrong group is reported in both, naming each."""
    from kvspec.spec.groups import GroupSpec, GroupState, HybridState, check_hybrid

    full, swa = GroupSpec("full", 4), GroupSpec("swa", 2, sliding_window=3)
    k4, k2 = key_of((1, 2, 3, 0), 4), key_of((1, 2), 2)
    pool = PoolView(
        ids=(0, 1), refcounts={0: 0, 1: 0}, free=(), evictable=(0, 1),
        cached=((k4, 0), (k2, 1)), computed=frozenset({0, 1}),
    )
    memory = {(Device.GPU, 0, i): (i, t) for i, t in enumerate((1, 2, 3, 0))}
    memory |= {(Device.GPU, 1, i): (i, t) for i, t in enumerate((1, 2))}
    config = Config(block_size=4, num_blocks=2, prefix_caching=True)

    def state(full_events, swa_events):
        return HybridState(
            pool,
            (
                GroupState(full, {}, ((k4, 0),), full_events),
                GroupState(swa, {}, ((k2, 1),), swa_events),
            ),
        )

    right = state((CacheEvent(EventKind.STORED, (k4,)),), (CacheEvent(EventKind.STORED, (k2,)),))
    assert [v for v in check_hybrid(config, right, {}, memory) if v.invariant == "event-consistency"] == []
    crossed = state((CacheEvent(EventKind.STORED, (k2,)),), (CacheEvent(EventKind.STORED, (k4,)),))
    found = [v.message for v in check_hybrid(config, crossed, {}, memory) if v.invariant == "event-consistency"]
    assert any(m.startswith("group full:") for m in found) and any(m.startswith("group swa:") for m in found)
    silent = state(None, None)  # a target that reports no per-group stream: nothing to say
    assert [v for v in check_hybrid(config, silent, {}, memory) if v.invariant == "event-consistency"] == []
