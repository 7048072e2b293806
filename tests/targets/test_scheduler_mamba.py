"""vLLM's own scheduler over a full-attention group and a Mamba group (``Shape.mamba``):
``MambaManager`` in "none" mode (one state block per request) and "align" mode (prefix
caching: a state block per block boundary, the older ones nulled), the worker model writing a
state per step, and the state group's rules (spec/groups.py ``state_faults``) checked on it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from kvspec.spec.errors import ConfigError
from kvspec.spec.groups import Shape
from kvspec.spec.kv_memory import STATE_SLOT
from kvspec.spec.state import Device
from kvspec.testing.scheduler.driver import SchedulerDriver

from .conftest import requires_vllm

on_033 = requires_vllm("0.33.0", pin="0.33.0")
PROMPT = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]


@pytest.fixture(scope="module")
def adapter():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    return VLLMV1SchedulerAdapter


def _shape(caching: bool, budget: int = 8) -> Shape:
    return Shape(
        block_size=4, swa_block_size=4, sliding_window=None, extra_blocks=2,
        prefix_caching=caching, num_spec_tokens=0, async_scheduling=False,
        max_num_batched_tokens=budget, max_model_len=32, full_sequence_must_fit=False,
        max_tokens=6, mamba=True,
    )


def _run(driver: SchedulerDriver, steps: int) -> None:
    for i in range(steps):
        driver.step(bytes([i, 1, 2, 3]), bytes([1, 2, 3, 0]))
        assert driver.check() == [], driver.trace[-1]


@on_033
@pytest.mark.parametrize("caching", [False, True])
def test_mamba_group_is_built_and_holds_its_state_blocks(adapter, caching):
    target = adapter(_shape(caching))
    managers = [type(m).__name__ for m in target.manager.coordinator.single_type_managers]
    assert managers == ["FullAttentionManager", "MambaManager"]
    assert target.manager.coordinator.single_type_managers[1].mamba_cache_mode == (
        "align" if caching else "none"
    )
    driver = SchedulerDriver(target)
    driver.arrive(0, PROMPT, 6)
    _run(driver, 3)
    table = driver.state.groups[1].tables[0]
    assert len(table.held()) <= (2 if caching else 1), table
    if caching:
        # A second request with the prompt's first two blocks: the hit hands it the state block
        # at the hit's boundary (MambaManager.find_longest_cache_hit), holding that state.
        driver.arrive(1, [*PROMPT[:8], 2, 2], 6)
        _run(driver, 1)
        assert driver.counts["hits"] == 1, driver.trace
    _run(driver, 4)
    assert driver.finish() == []


@on_033
def test_a_wrong_state_in_the_state_block_is_flagged(adapter):
    """The state rules bite on vLLM's own tables: a state block whose content the worker got
    wrong is a kv-readback fault."""
    driver = SchedulerDriver(adapter(_shape(False)))
    driver.arrive(0, PROMPT, 6)
    _run(driver, 2)
    (block,) = driver.state.groups[1].tables[0].held()
    driver.memory[(Device.GPU, block, STATE_SLOT)] = (1, 0)
    assert {v.invariant for v in driver.check()} == {"kv-readback"}


@on_033
def test_other_releases_refuse_mamba_shapes(adapter):
    import vllm.v1.kv_cache_interface as kci

    with pytest.raises(ConfigError):
        adapter._mamba_supported(SimpleNamespace(version="0.12.0", kci=kci))
    adapter._mamba_supported(SimpleNamespace(version="0.33.0", kci=kci))
