"""FINDINGS V1-e: vLLM 0.10.1.1's V1 block pool reports a KV-cache usage that counts the null
block as a block of the pool (metrics only).

0.10.1.1 ``BlockPool.get_usage`` returns ``1 - free / num_gpu_blocks`` (block_pool.py:295-301),
and the null block, taken at construction, is never free: an idle pool of N usable blocks
reports 1/(N+1) in use.  0.10.2 (:315-318) and 0.12.0 (:451-454) divide by
``num_gpu_blocks - 1``, the usable blocks, so an idle pool reports 0.  ``conservation`` checks
the figure against the blocks the pool's tables hold (spec/invariants.py ``usage_fault``).

Reproduces on 0.10.1.1 only; elsewhere the reproducing test skips, naming
``kvspec test-targets 0.10.1.1``, the command that runs it.
"""

from __future__ import annotations

import pytest
from kvspec.adapters.v1 import VLLMV1Adapter
from kvspec.spec.config import Config
from kvspec.testing.blockmanager.driver import Driver

from .conftest import requires_vllm


def _usage_faults(d: Driver) -> list:
    return [v for v in d.check() if v.invariant == "conservation" and v.kind == "wrong-usage"]


@pytest.mark.parametrize("num_blocks", [1, 4])
@requires_vllm("0.10.1.1", "0.10.1.1", pin="0.10.1.1")
def test_v1e_an_idle_pool_reports_the_null_block_in_use(num_blocks):
    d = Driver(VLLMV1Adapter(Config(block_size=2, num_blocks=num_blocks)))
    found = _usage_faults(d)
    assert found, "V1-e no longer reproduces: the idle pool's usage matches its blocks"
    assert found[0].expected == 0.0
    assert found[0].observed == pytest.approx(1 / (num_blocks + 1))


@pytest.mark.parametrize("num_blocks", [1, 4])
@requires_vllm("0.10.2", pin="0.33.0")
def test_v1e_control_from_0_10_2_the_usage_leaves_the_null_block_out(num_blocks):
    d = Driver(VLLMV1Adapter(Config(block_size=2, num_blocks=num_blocks)))
    assert _usage_faults(d) == []
    assert d.admit(0, [0], 1)  # one block of the pool in use
    assert _usage_faults(d) == []
