"""The legacy managers' prefix-cache hit rate in what the lockstep compares.

vLLM's legacy engine exports ``get_prefix_cache_hit_rate(device)`` in its stats every step
(0.6.3 llm_engine.py:1594-1598); the figure comes from ``CacheMetricData`` (0.6.3
block/common.py:287-332), which no invariant bounds.  The adapter reports it per pool
(``PoolView.hit_rate``) and the lockstep compares it (``Observation.hit_rate``): here a manager
whose metric counts every lookup twice (the mutant of common.py:306) differs from the release's
in that field and no other.  Run with ``kvspec test-targets 0.6.3``, or in its venv:
``KVSPEC_CHECKOUT=. ~/.cache/kvspec/venvs/vllm-0.6.3/bin/python -m pytest tests/targets/test_legacy_hit_rate.py``.
"""

from __future__ import annotations

import pytest
from kvspec.spec.config import Config
from kvspec.targets.registry import release_key
from kvspec.testing.blockmanager.driver import Driver
from kvspec.testing.implementations import factory
from kvspec.testing.lockstep import Mode, differing, observe

from .conftest import VLLM, requires_vllm

# get_prefix_cache_hit_rate is in 0.6.2's managers (block_manager_v2.py:447), not in 0.5.4's.
pytestmark = requires_vllm("0.6.2", "0.10.2", pin="0.6.3")

V2 = "legacy-v2" if VLLM is not None and release_key(VLLM) <= release_key("0.6.3") else "legacy-self-attn"
B = 4
PROMPT = list(range(2 * B))  # two full blocks: two lookups per admission


def _two_admissions(config: Config, *, double_count: bool = False) -> Driver:
    """Seq 0 admits PROMPT (two misses), seq 1 the same prompt (two hits)."""
    adapter = factory(V2)(config)
    driver = Driver(adapter)
    if double_count:
        from vllm.utils import Device

        metric = adapter._raw.block_allocator._allocators[Device.GPU].metric_data
        counted = metric.query

        def twice(hit: bool) -> None:  # the mutant ``num_incompleted_block_queries += 2``
            counted(hit)
            metric.num_incompleted_block_queries += 1

        metric.query = twice
    assert driver.admit(0, PROMPT, len(PROMPT))
    assert driver.admit(1, PROMPT, len(PROMPT))
    return driver


def test_the_observed_hit_rate_is_the_managers():
    driver = _two_admissions(Config(block_size=B, num_blocks=8, prefix_caching=True))
    from vllm.utils import Device

    reported = driver.impl.inner._raw.get_prefix_cache_hit_rate(Device.GPU)
    assert reported == 0.5  # two hits of four lookups
    assert driver.state.gpu.hit_rate == reported
    assert observe(driver, 0).hit_rate[0] == reported


def test_without_prefix_caching_the_manager_reports_no_rate():
    driver = _two_admissions(Config(block_size=B, num_blocks=8, prefix_caching=False))
    assert driver.state.gpu.hit_rate == -1  # NaiveBlockAllocator: "not supported or disabled"


def test_a_miscounted_hit_rate_differs_in_that_field_alone():
    config = Config(block_size=B, num_blocks=8, prefix_caching=True)
    base, head = _two_admissions(config), _two_admissions(config, double_count=True)
    assert head.state.gpu.hit_rate == pytest.approx(0.25) and base.state.gpu.hit_rate == 0.5
    assert differing(observe(head, 0), observe(base, 0), Mode.RENAMING) == ["hit_rate"]
    assert differing(observe(head, 0), observe(base, 0), Mode.OUTCOMES) == []


def test_the_same_rate_rounded_differently_is_the_same_observation():
    """With a block of one lookup (what the mutant ``!= self.block_size`` of common.py:311
    amounts to) the metric averages per-lookup rates: 8 misses then a hit give 1/9 rounded
    otherwise than the release's ratio over its unfinished block, the same rate."""
    from vllm.utils import Device

    config = Config(block_size=B, num_blocks=12, prefix_caching=True)
    rates = []
    for block in (None, 1):
        adapter = factory(V2)(config)
        driver = Driver(adapter)
        if block is not None:
            adapter._raw.block_allocator._allocators[Device.GPU].metric_data.block_size = block
        for seq in range(4):  # four distinct two-block prompts: 8 misses
            assert driver.admit(seq, [seq * 100 + t for t in range(2 * B)], 2 * B)
        assert driver.admit(4, list(range(B)), B)  # seq 0's first block: a hit
        rates.append((driver.state.gpu.hit_rate, observe(driver, 0)))
    (base_rate, base), (head_rate, head) = rates
    assert base_rate != head_rate and base_rate == pytest.approx(1 / 9) == head_rate
    assert differing(head, base, Mode.RENAMING) == []
