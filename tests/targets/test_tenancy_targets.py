"""The V1 engine's prefix cache as tenants and routers see it: requests with cache salts, LoRA
adapters and multimodal placements, and the KV-cache event stream (spec/tenancy.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.adapters.v1 import VLLMV1Adapter
from kvspec.spec.config import Config
from kvspec.spec.prefix_hash import ExtraKeys, MMFeature
from kvspec.testing import KVCacheMachine, RunStats
from kvspec.testing.driver import Driver
from kvspec.testing.strategies import configs

from .conftest import requires_vllm

PREFIX_CACHE = {"prefix-cache-isolation", "event-consistency", "prefix-cache-consistency"}


@requires_vllm("0.11.0", pin="0.33.0")
def test_v1_domains_and_events_hold():
    """The default machine on V1 with prefix caching draws salts, adapters and multimodal
    placements, collects the events in both external hash formats, and finds no violation of
    the prefix cache's invariants."""
    adapters: list[VLLMV1Adapter] = []

    def make(config: Config) -> VLLMV1Adapter:
        adapters.append(VLLMV1Adapter(config))
        return adapters[-1]

    stats = RunStats()
    strategy = configs(swap=False, max_blocks=16, prefix_caching=st.just(True))
    run_state_machine_as_test(
        lambda: KVCacheMachine(make, strategy, stats=stats, focus=PREFIX_CACHE),
        settings=settings(settings(), report_multiple_bugs=False),
    )
    formats = sum((a.event_hash_formats for a in adapters), Counter())
    assert stats.events >= 100, stats
    assert formats["int"] and formats["bytes"], formats
    for kind in ("cache_salt", "lora", "mm"):
        assert stats.extras.get(kind, 0) >= 20, stats


@requires_vllm("0.11.0", pin="0.33.0")
def test_identical_prompts_in_other_domains_miss():
    """The same prompt under another salt, adapter or image misses; in its own domain it hits."""
    d = Driver(VLLMV1Adapter(Config(block_size=2, num_blocks=16, prefix_caching=True)))
    tokens = [1, 2, 3, 4, 5]
    image = (MMFeature("image-x", 0, 2),)
    domains = [ExtraKeys(), ExtraKeys("tenant-a"), ExtraKeys(lora="adapter-1"), ExtraKeys(mm=image)]
    for seq, extra in enumerate(domains):
        assert d.admit(seq, tokens, len(tokens), 0, extra)
        assert d.trace[-1].outcome.endswith(" 0 cached tokens"), d.trace[-1]
        assert not d.check()
    for seq, extra in enumerate(domains, start=len(domains)):
        assert d.admit(seq, tokens, len(tokens), 0, extra)
        assert d.trace[-1].outcome.endswith(" 4 cached tokens"), d.trace[-1]
        assert not d.check()


@requires_vllm("0.9.0", "0.10.1.1", pin="0.10.1.1")
def test_lora_request_with_kv_events_crashes_cache_full_blocks():
    """FINDINGS F-KV1: with KV-cache events on, caching the first full block of a LoRA request
    raises AttributeError ('LoRARequest' object has no attribute 'id': block_pool.py
    ``cache_full_blocks`` reads ``request.lora_request.id``); found by the machine from scratch.
    Fixed upstream by vllm-project/vllm#27728 (``adapter_id``)."""
    strategy = configs(swap=False, max_blocks=8, prefix_caching=st.just(True), sliding_window=False)
    with pytest.raises(AttributeError, match="'LoRARequest' object has no attribute 'id'"):
        run_state_machine_as_test(
            lambda: KVCacheMachine(VLLMV1Adapter, strategy),
            settings=settings(settings(), report_multiple_bugs=False),
        )
