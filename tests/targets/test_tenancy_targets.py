"""The V1 engine's prefix cache as tenants and routers see it: requests with cache salts, LoRA
adapters and multimodal placements, and the KV-cache event stream (spec/tenancy.py)."""

from __future__ import annotations

import importlib
import inspect
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.adapters.v1 import VLLMV1Adapter
from kvspec.spec.config import Config
from kvspec.spec.interface import Capability
from kvspec.spec.prefix_hash import ExtraKeys, MMFeature
from kvspec.testing import KVCacheMachine, RunStats
from kvspec.testing.blockmanager.driver import Driver
from kvspec.testing.blockmanager.strategies import configs

from .conftest import DOMAIN_COLLISIONS, past_known, requires_vllm, without

PREFIX_CACHE = {"prefix-cache-isolation", "event-consistency", "prefix-cache-consistency"}


def _mm_key_has_offset() -> bool:
    """Whether this release's multimodal extra key carries the item's offset in the block
    (without it, F-KV3)."""
    kcu = importlib.import_module("vllm.v1.core.kv_cache_utils")
    return "offset - start_token_idx" in inspect.getsource(kcu._gen_mm_extra_hash_keys)


def _asserts_on_null_parent() -> bool:
    """Whether this release's ``cache_full_blocks`` reads the parent hash off the previous block
    (F-KV2), which a sliding window may have nulled."""
    block_pool = importlib.import_module("vllm.v1.core.block_pool")
    return "assert parent_block.block_hash" in inspect.getsource(block_pool.BlockPool)


@requires_vllm("0.11.0", pin="0.33.0")
def test_v1_domains_and_events_hold():
    """The default machine on V1 with prefix caching draws salts, adapters and multimodal
    placements, collects the events in both external hash formats, and finds no violation of
    the prefix cache's invariants."""
    adapters: list[VLLMV1Adapter] = []

    # Where a pinned finding would stop every run, the run steers around it (and says so).
    cls = VLLMV1Adapter if _mm_key_has_offset() else without(Capability.MULTIMODAL)

    def make(config: Config) -> VLLMV1Adapter:
        adapters.append(cls(config))
        return adapters[-1]

    stats = RunStats()
    strategy = configs(swap=False, max_blocks=16, prefix_caching=st.just(True))
    if _asserts_on_null_parent():
        # F-KV2 (pinned below) stops every windowed run on these releases: full attention here.
        strategy = strategy.filter(lambda c: c.sliding_window is None)
    past = past_known(*DOMAIN_COLLISIONS)
    run_state_machine_as_test(
        lambda: KVCacheMachine(make, strategy, stats=stats, focus=PREFIX_CACHE, step_past=past),
        settings=settings(settings(), report_multiple_bugs=False),
    )
    formats = sum((a.event_hash_formats for a in adapters), Counter())
    assert stats.events >= 100, stats
    assert formats["int"] and formats["bytes"], formats
    for kind in ("cache_salt", "lora", "mm") if cls is VLLMV1Adapter else ("cache_salt", "lora"):
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
    past = past_known(*DOMAIN_COLLISIONS, "V1-e")
    with pytest.raises(AttributeError, match="'LoRARequest' object has no attribute 'id'"):
        run_state_machine_as_test(
            lambda: KVCacheMachine(VLLMV1Adapter, strategy, step_past=past),
            settings=settings(settings(), report_multiple_bugs=False),
        )


@requires_vllm("0.10.1.1", "0.12.0", pin="0.12.0")
def test_kv_events_with_a_sliding_window_assert_on_a_null_parent():
    """FINDINGS F-KV2: with KV-cache events on, a sliding-window request whose previous block
    the window already released (a null block in its table) crashes ``cache_full_blocks`` on
    ``assert parent_block.block_hash is not None`` (B=1 W=1: admit one token, decode one);
    found from scratch.  Fixed upstream by vllm-project/vllm#30544 (the parent hash is read
    from ``request.block_hashes``)."""
    strategy = configs(swap=False, max_blocks=8, prefix_caching=st.just(True)).filter(
        lambda c: c.sliding_window is not None
    )

    no_lora = without(Capability.LORA)  # F-KV1 would stop 0.10.1.1 first
    past = past_known(*DOMAIN_COLLISIONS, "V1-e")
    with pytest.raises(AssertionError) as raised:
        run_state_machine_as_test(
            lambda: KVCacheMachine(no_lora, strategy, focus=PREFIX_CACHE, step_past=past),
            settings=settings(settings(), report_multiple_bugs=False),
        )
    assert raised.traceback[-1].path.name == "block_pool.py", raised.traceback[-1]


@requires_vllm("0.9.0", "0.12.0", pin="0.12.0")
def test_same_image_at_another_offset_in_a_block_replays():
    """FINDINGS F-KV3: before the multimodal extra key carried the item's offset within the
    block (0.9.1-0.12.0 key a block by the item's hash alone), the same image one position
    over in otherwise identical tokens hashes the same.  The shrunk trace (found by a random
    dev-profile search of ``prefix-cache-isolation`` on 0.12.0; the derandomized CI budget
    does not reach it), replayed; 0.33.0 keys ("mm", identifier, offset - block start)."""
    d = Driver(VLLMV1Adapter(Config(block_size=2, num_blocks=4, prefix_caching=True)))
    assert d.admit(0, [0, 0], 2, 0, ExtraKeys(mm=(MMFeature("image-x", 1, 1),)))
    assert not [v for v in d.check() if v.invariant == "prefix-cache-isolation"]
    assert d.admit(1, [0, 0], 2, 0, ExtraKeys(mm=(MMFeature("image-x", 0, 1),)))
    found = [v for v in d.check() if v.invariant == "prefix-cache-isolation"]
    assert found and "another domain" in found[0].message, found

