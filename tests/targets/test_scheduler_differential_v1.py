"""vLLM's own V1 scheduler beside the reference scheduler (testing/scheduler/machine.py
``SchedulerLockstep``), compared in the strictest mode after every step: the same requests
scheduled and preempted, the same start and token counts, the same blocks per (request, group)
up to renaming, under the policy declared for 0.33.0 (reference/policies.py).  A broken
scheduler no invariant sees (``DIFFERENTIAL_ONLY``) beside vLLM fails as a policy difference."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.broken_scheduler import (
    DIFFERENTIAL_ONLY,
    MAMBA_CACHE_ONLY,
    PREFIX_CACHE_ONLY,
    SPARSE_RETENTION_ONLY,
)
from kvspec.reference.policies import declared_for
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.scheduler.machine import DiffCounts, PolicyDifference, SchedulerMachine, shapes

from .conftest import requires_vllm

pytestmark = requires_vllm("0.33.0", pin="0.33.0")
EXAMPLES = 40


@pytest.fixture(scope="module")
def adapter():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    return VLLMV1SchedulerAdapter


def _settings():
    return settings(settings(), max_examples=EXAMPLES, report_multiple_bugs=False, deadline=None)


def test_vllm_scheduler_agrees_with_the_reference_scheduler(adapter):
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(adapter, differential=Mode.RENAMING, diff_counts=counts),
        settings=_settings(),
    )
    assert counts.steps >= 5 * EXAMPLES and counts.states >= 10 * EXAMPLES, counts
    assert not counts.allowed, counts
    assert counts.policy == declared_for("0.33.0"), counts


def test_a_scheduler_only_the_differential_catches_fails_beside_vllm(adapter, monkeypatch):
    """The reference replaced by ``serial-admission``: vLLM batches what it serialises."""
    import kvspec.testing.scheduler.machine as machine

    variant, comparison = DIFFERENTIAL_ONLY["serial-admission"]
    monkeypatch.setattr(machine, "ReferenceScheduler", variant)
    plain = shapes().filter(lambda s: not s.prefix_caching)
    with pytest.raises(PolicyDifference) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(adapter, plain, differential=Mode.RENAMING), settings=_settings()
        )
    found = caught.value
    assert found.comparison == comparison and found.release == "0.33.0", found
    assert str(found).startswith("differs from vLLM 0.33.0's declared policy (v1-0.33.0)"), found


def _caching(shape) -> bool:
    # Beside vLLM, a Mamba "align" shape with hits inside a block ends where vLLM's Mamba prefix
    # cache may hit (the reference caches no Mamba states there); those with hits at block ends
    # run to the end in ``test_mamba_prefix_cache_shapes_are_compared_to_the_end``, with the
    # release's known findings (C5) stepped past.
    return shape.prefix_caching and not shape.mamba


def test_comparison_runs_past_prefix_hits_to_the_end(adapter):
    """With prefix caching, vLLM and the reference scheduler (with its own prefix cache) are
    compared to the end of every example, those whose admissions start at a prefix hit
    included: no comparison stops at a hit, and the hits are the same."""
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(adapter, shapes().filter(_caching), differential=Mode.RENAMING, diff_counts=counts),
        settings=_settings(),
    )
    assert counts.hit_examples > 0 and counts.hits >= counts.hit_examples, counts
    assert counts.hit_examples_to_end == counts.hit_examples, counts
    assert counts.to_end == counts.examples and not counts.ended, counts


def test_a_prefix_cache_evicting_otherwise_differs_from_vllm(adapter, monkeypatch):
    """The reference replaced by ``evicts-newest-first`` (its freed blocks, cached or not, go
    to the head of the free queue): vLLM keeps other blocks cached, and the differential,
    comparing past prefix hits, reports vLLM as differing from that policy."""
    import kvspec.testing.scheduler.machine as machine

    monkeypatch.setattr(machine, "ReferenceScheduler", PREFIX_CACHE_ONLY["evicts-newest-first"])
    with pytest.raises(PolicyDifference) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(adapter, shapes().filter(_caching), differential=Mode.RENAMING),
            settings=settings(_settings(), max_examples=4 * EXAMPLES),
        )
    found = caught.value
    assert found.release == "0.33.0", found
    assert str(found).startswith("differs from vLLM 0.33.0's declared policy (v1-0.33.0)"), found


def _mamba(shape) -> bool:
    return shape.mamba


def test_pipeline_shapes_are_compared_beside_vllm(adapter):
    """Pipeline-parallel shapes (the synchronous scheduler with one batch per stage in flight)
    run the differential: the same steps, the same passes over a preempted request whose
    output is still in flight (``waits_for_stale_output``), ending early only where every
    shape may (the Mamba prefix cache with hits inside a block)."""
    from kvspec.testing.scheduler.machine import MAMBA_PARTIAL_TAIL, MAMBA_PREFIX_CACHE

    counts = DiffCounts()
    within = shapes(adapter.retention_offer(), adapter.kv_connectors_offered()).filter(
        lambda s: s.pipeline_parallel > 1
    )
    run_state_machine_as_test(
        lambda: SchedulerMachine(adapter, within, differential=Mode.RENAMING, diff_counts=counts),
        settings=settings(_settings(), suppress_health_check=[HealthCheck.filter_too_much]),
    )
    assert counts.examples >= EXAMPLES and not counts.not_run and not counts.allowed, counts
    assert set(counts.ended) <= {MAMBA_PREFIX_CACHE, MAMBA_PARTIAL_TAIL}, counts
    assert counts.to_end > 0 and counts.steps >= 5 * EXAMPLES, counts


def test_mamba_shapes_are_compared_beside_vllm(adapter):
    """vLLM's Mamba shapes run the differential: "none" mode (no prefix caching) to the end,
    "align" mode with the block-aligned prefill split (``mamba_aligned_split``) and, where hits
    end at block ends, its Mamba prefix cache (``mamba_state_cache``); with hits inside a block
    until vLLM's prefix cache holds a key a waiting request's tokens begin with, or a partial
    tail, where the comparison ends and says why."""
    import vllm
    from kvspec.testing.known import SHIPPED, load_known, step_past_known
    from kvspec.testing.scheduler.machine import MAMBA_PARTIAL_TAIL, MAMBA_PREFIX_CACHE

    # FINDINGS C5 (a Mamba "align" sole request preempted with a batch in flight) is met by
    # these shapes too; stepped past, as kvspec check does, so the comparison is what is judged.
    past = step_past_known([k for k in load_known([SHIPPED]) if k.id == "C5"], "v1-scheduler", vllm.__version__)
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(
            adapter, shapes().filter(_mamba), differential=Mode.RENAMING, diff_counts=counts, step_past=past
        ),
        settings=_settings(),
    )
    assert counts.examples >= EXAMPLES and not counts.not_run and not counts.allowed, counts
    assert set(counts.ended) <= {MAMBA_PREFIX_CACHE, MAMBA_PARTIAL_TAIL}, counts
    assert counts.to_end > 0 and counts.steps >= 5 * EXAMPLES, counts


def test_a_split_not_at_mamba_blocks_differs_from_vllm(adapter, monkeypatch):
    """The reference replaced by ``unaligned-mamba-split`` (chunks cut by the budget alone): in
    Mamba "align" shapes vLLM's chunks end at Mamba block ends, and the differential reports
    the step counts."""
    import kvspec.testing.scheduler.machine as machine

    variant, comparison = DIFFERENTIAL_ONLY["unaligned-mamba-split"]
    monkeypatch.setattr(machine, "ReferenceScheduler", variant)
    align = shapes().filter(lambda s: s.mamba_cache_mode == "align")
    with pytest.raises(PolicyDifference) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(adapter, align, differential=Mode.RENAMING), settings=_settings()
        )
    found = caught.value
    assert found.comparison == comparison and found.release == "0.33.0", found


def _mamba_states(adapter):
    """Mamba "align" shapes whose hits end at block ends, under every retention 0.33.0 offers."""
    return shapes(retention=adapter.retention_offer()).filter(
        lambda s: s.mamba_cache_mode == "align" and not s.mamba_partial_hits
    )


def test_mamba_prefix_cache_shapes_are_compared_to_the_end(adapter):
    """Mamba "align" shapes whose hits end at block ends run the differential to the end, past
    Mamba prefix hits (``mamba_state_cache``: the states cached, dense or sparse, the last cached
    state at or below the full-attention hit, the same-step refusal, the junction stop).  What
    ``kvspec check`` does with the release's known findings (C5 at the startup minimum under a
    batch in flight) it does here: such an example is discarded."""
    import vllm
    from kvspec.testing.known import SHIPPED, load_known, step_past_known

    step_past = step_past_known(load_known([SHIPPED]), "v1-scheduler", vllm.__version__)
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(
            adapter, _mamba_states(adapter), differential=Mode.RENAMING, diff_counts=counts, step_past=step_past
        ),
        settings=settings(_settings(), max_examples=3 * EXAMPLES, suppress_health_check=list(HealthCheck)),
    )
    assert counts.examples >= EXAMPLES and not counts.not_run and not counts.allowed, counts
    assert counts.to_end == counts.examples and counts.hit_examples > 0, counts


@pytest.mark.parametrize("name", sorted(MAMBA_CACHE_ONLY))
def test_a_broken_mamba_cache_differs_from_vllm(adapter, monkeypatch, name):
    """The reference replaced by ``mamba-hit-as-a-run`` (the Mamba hit a run of cached states
    from block 0): vLLM hits the last cached state, which a chunk of several blocks leaves with
    no states before it inside the chunk, and the differential reports it."""
    _differs_beside_vllm(adapter, monkeypatch, MAMBA_CACHE_ONLY[name], _mamba_states(adapter))


def _differs_beside_vllm(adapter, monkeypatch, variant, within) -> None:
    """The reference replaced by ``variant``: over ``within``, vLLM 0.33.0 differs from it, as a
    policy difference from 0.33.0's declared policy."""
    import kvspec.testing.scheduler.machine as machine

    monkeypatch.setattr(machine, "ReferenceScheduler", variant)
    with pytest.raises(PolicyDifference) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(adapter, within, differential=Mode.RENAMING),
            settings=settings(_settings(), max_examples=4 * EXAMPLES, suppress_health_check=list(HealthCheck)),
        )
    found = caught.value
    assert found.release == "0.33.0", found
    assert str(found).startswith("differs from vLLM 0.33.0's declared policy (v1-0.33.0)"), found


def _sparse_window(adapter):
    return shapes(retention=adapter.retention_offer()).filter(
        lambda s: s.sparse_retention and s.sliding_window is not None
    )


def test_sparse_retention_shapes_are_compared_beside_vllm(adapter):
    """Sliding-window shapes under a sparse retention (the engine's default 0, or a periodic
    interval) run the differential to the end, past prefix hits (``sparse_retention_tails``)."""
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(adapter, _sparse_window(adapter), differential=Mode.RENAMING, diff_counts=counts),
        settings=settings(_settings(), suppress_health_check=list(HealthCheck)),
    )
    assert counts.examples >= EXAMPLES and not counts.not_run and not counts.allowed, counts
    assert counts.to_end == counts.examples and counts.hit_examples > 0, counts


def test_a_dense_cache_under_sparse_retention_differs_from_vllm(adapter, monkeypatch):
    """The reference replaced by ``dense-under-sparse-retention`` (every aligned tail cached
    whatever the retention): vLLM keeps fewer sliding-window blocks, and the differential
    reports it."""
    _differs_beside_vllm(
        adapter, monkeypatch, SPARSE_RETENTION_ONLY["dense-under-sparse-retention"], _sparse_window(adapter)
    )


def _connector(adapter):
    return shapes(adapter.retention_offer(), adapter.kv_connectors_offered()).filter(lambda s: s.kv_connector)


def test_kv_connector_shapes_are_compared_to_the_end(adapter):
    """Under a sending KV connector the reference holds a finished request's blocks as vLLM
    does (the out-of-window ones freed first, the cut positions off a trimmed count, the output
    in flight of a preempted request dropped, the sends freed after the output's requests, in
    the order reported, a block holding a partial tail rejoining the free queue as a cached
    one): with prefix caching or without it, every example is compared to its end."""
    for caching in (False, True):
        counts = DiffCounts()
        within = _connector(adapter).filter(lambda s, c=caching: s.prefix_caching == c)
        run_state_machine_as_test(
            lambda w=within, d=counts: SchedulerMachine(adapter, w, differential=Mode.RENAMING, diff_counts=d),
            settings=settings(_settings(), suppress_health_check=list(HealthCheck)),
        )
        assert counts.examples >= EXAMPLES and not counts.not_run and not counts.allowed, counts
        assert counts.to_end == counts.examples and not counts.ended, counts


def test_a_whole_table_held_for_the_send_differs_from_vllm(adapter, monkeypatch):
    """The reference replaced by ``holds-the-whole-table-for-the-send``: vLLM frees a finished
    request's out-of-window blocks before the hand-off, and the differential reports the held
    blocks."""
    import kvspec.testing.scheduler.machine as machine

    variant, comparison = DIFFERENTIAL_ONLY["holds-the-whole-table-for-the-send"]
    monkeypatch.setattr(machine, "ReferenceScheduler", variant)
    local = _connector(adapter).filter(lambda s: s.sliding_window is not None or s.attention_chunk_size is not None)
    with pytest.raises(PolicyDifference) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(adapter, local, differential=Mode.RENAMING),
            settings=settings(_settings(), suppress_health_check=list(HealthCheck)),
        )
    found = caught.value
    assert found.comparison == comparison and found.release == "0.33.0", found
