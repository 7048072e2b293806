"""The prefix cache as tenants and routers see it, under vLLM 0.33.0's own scheduler: request
domains (cache salt, LoRA, multimodal), partial-tail entries of the hybrid shapes, and the
per-group KV event stream (adapters/v1_scheduler_cache.py, spec/tenancy.py)."""

from __future__ import annotations

import logging

import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.spec.events import EventKind, replay
from kvspec.spec.groups import Shape, check_hybrid
from kvspec.spec.prefix_hash import ExtraKeys, key_of
from kvspec.testing.scheduler.driver import SchedulerDriver, ShapeCounts
from kvspec.testing.scheduler.machine import SchedulerMachine, shapes

from .conftest import requires_vllm

pytestmark = requires_vllm("0.33.0", pin="0.33.0")

PROMPT = (1, 2, 3, 0, 1, 2, 3)  # 7 tokens: its last hash boundary (6) lies inside block 1 of 4


def _shape(**kw) -> Shape:
    """A hybrid model whose sliding-window group has blocks of 2 under full-attention blocks of
    4: the scheduler hashes every 2 tokens (``hash_block_size`` 2 < 4)."""
    base = dict(
        block_size=4, swa_block_size=2, sliding_window=5, extra_blocks=0, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=32, max_model_len=32,
        full_sequence_must_fit=False, max_tokens=4,
    )
    return Shape(**{**base, **kw})


@pytest.fixture(scope="module")
def adapter():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    return VLLMV1SchedulerAdapter


def _run(driver: SchedulerDriver, steps: int) -> None:
    for i in range(steps):
        driver.step(bytes([i, 1, 2, 3]), bytes([1, 2, 3, 0]))
        assert driver.check() == []


def _full_group_keys(driver: SchedulerDriver) -> dict[int, list[int]]:
    """Block -> the lengths of the keys it is cached under, in the full-attention group."""
    out: dict[int, list[int]] = {}
    for key, block in driver.state.groups[0].cached:
        out.setdefault(block, []).append(len(key.chain))
    return out


def test_partial_tail_is_registered_beside_the_full_key_once_its_block_is_full(adapter):
    """Without fine-grained hits (no Mamba "align" group) the hybrid coordinator rounds what it
    caches down to the scheduler block (``_align_cacheable``): the prompt's 6-token tail entry
    appears only when its block holds 8 tokens, on that block, after the 8-token key's
    ``BlockStored`` -- never promoted, since it is never alone."""
    target = adapter(_shape())
    assert target.hash_block_size == 2 and target.cache_view.emits_events
    driver = SchedulerDriver(target)
    driver.arrive(0, PROMPT, 4)
    _run(driver, 1)  # the prompt's 7 tokens: block 0 full, block 1 holds 3
    assert sorted(n for ns in _full_group_keys(driver).values() for n in ns) == [4]
    _run(driver, 1)  # the first sampled token fills block 1
    keys = _full_group_keys(driver)
    tail_block = next(b for b, ns in keys.items() if 6 in ns)
    assert sorted(keys[tail_block]) == [6, 8]
    stored = [e for e in driver.state.groups[0].events if e.kind is EventKind.STORED]
    lengths = [len(k.chain) for e in stored for k in e.keys]
    assert lengths == [4, 8, 6]
    assert driver.partials["partial_cached"] == 1 and driver.partials["partial_promoted"] == 0
    assert driver.finish() == []


def _evicted(adapter) -> SchedulerDriver:
    """PROMPT's request finishes; a longer one then needs its cached blocks back."""
    target = adapter(_shape())
    driver = SchedulerDriver(target)
    driver.arrive(0, PROMPT, 2)
    _run(driver, 3)
    assert not target.live(0)
    other = tuple([3] * 28)  # more blocks than the startup-minimum pool (25) has free
    driver.arrive(1, other, 1)
    _run(driver, 2)
    return driver


def test_eviction_retires_the_partial_entry_with_its_own_removal(adapter):
    """A block evicted for another request loses every key it is cached under, the partial one
    too, each with a ``BlockRemoved`` in its group; the replayed stream is the map again."""
    driver = _evicted(adapter)
    full = driver.state.groups[0]
    removed = [len(k.chain) for e in full.events if e.kind is EventKind.REMOVED for k in e.keys]
    assert 6 in removed and 8 in removed, removed
    assert driver.partials["partial_retired"] >= 1
    for g in driver.state.groups:
        live, faults = replay(g.events)
        assert faults == [] and sum(live.values()) == len(g.cached)
    assert driver.finish() == []


def test_a_dropped_removal_is_caught_in_its_group(adapter):
    """The per-group event check can fail on the scheduler run: the same state with the full
    group's ``BlockRemoved`` events left out (an event dropped on eviction) is reported there,
    and only there."""
    driver = _evicted(adapter)
    state = driver.state
    full = state.groups[0]
    kept = tuple(e for e in full.events if e.kind is not EventKind.REMOVED)
    broken = attrs.evolve(state, groups=(attrs.evolve(full, events=kept), *state.groups[1:]))
    found = check_hybrid(driver.config, broken, driver.seqs, driver.memory)
    found = [v for v in found if v.invariant == "event-consistency"]
    assert found and all(v.message.startswith("group full:") for v in found), found
    assert driver.finish() == []


def test_identical_prompts_in_other_domains_share_no_block(adapter):
    """The same prompt under another cache salt or LoRA adapter misses in every group."""
    target = adapter(_shape(extra_blocks=8))
    driver = SchedulerDriver(target)
    domains = [ExtraKeys(), ExtraKeys(cache_salt="tenant-a"), ExtraKeys(lora="adapter-1")]
    for seq, extra in enumerate(domains):
        driver.arrive(seq, (*PROMPT, 1), 4, extra)
        _run(driver, 2)
    for g in driver.state.groups:
        held = [set(t.held()) for t in g.tables.values()]
        assert all(not (a & b) for i, a in enumerate(held) for b in held[i + 1 :]), g.spec.name
        extras = {k.extra for k, _ in g.cached}
        assert extras == {key_of(PROMPT, 4, d).extra for d in domains}
    assert driver.finish() == []


def test_scheduler_run_draws_domains_partial_tails_and_events(adapter):
    """The scheduler machine's own draws reach salts, adapters, partial tails and KV events,
    with every invariant holding per group; no multimodal placement reaches the text-only
    tiny model's scheduler (no encoder budget: adapters/v1_scheduler_cache.py)."""
    counts = ShapeCounts()
    within = shapes().filter(lambda s: s.prefix_caching and s.hybrid and s.swa_block_size < s.block_size)
    run_state_machine_as_test(
        lambda: SchedulerMachine(adapter, within, counts=counts),
        settings=settings(settings(), max_examples=40, report_multiple_bugs=False, deadline=None),
    )
    c = counts.cache
    assert c["mm"] == 0, c
    for kind in ("cache_salt", "lora", "partial_cached", "events"):
        assert c[kind] > 0, (kind, c)
