"""vLLM's own V1 scheduler (Scheduler / AsyncScheduler) in production shapes: hybrid
KV-cache groups (sliding window, chunked local), async scheduling, speculative decoding,
token-budget chunking, ``full_sequence_must_fit`` on and off, pools at vLLM's startup minimum.
Every invariant per group and over the shared pool (spec/groups.py), checked by the scheduler
machine.  0.33.0 runs in CI; 0.9.1 (the API generation before request-side hashing) runs with
``~/.cache/kvspec/venvs/vllm-0.9.1/bin/python -m pytest tests/targets/test_scheduler_v1.py``
and holds FINDINGS V1-S4a; 0.12.0 holds V1-S2a
(``~/.cache/kvspec/venvs/vllm-0.12.0/bin/python -m pytest tests/targets/test_scheduler_v1.py -k 012``)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.spec.groups import SHAPE_TAGS, Shape
from kvspec.testing import SpecViolation
from kvspec.testing.known import SHIPPED, load_known, step_past_known
from kvspec.testing.scheduler.driver import SchedulerDriver, ShapeCounts
from kvspec.testing.scheduler.machine import (
    SchedulerMachine,
    kv_connectors_of,
    multimodal_refusal_of,
    retention_offer_of,
    shapes,
)

from .conftest import requires_vllm

on_033 = requires_vllm("0.33.0", pin="0.33.0")
on_091 = requires_vllm("0.9.1", "0.9.1", pin="0.9.1")
on_012 = requires_vllm("0.12.0", "0.12.0", pin="0.12.0")


def _settings(n: int):
    return settings(settings(), max_examples=n, report_multiple_bugs=False, deadline=None)


def _window_crash_shape(s: Shape) -> bool:
    """FINDINGS V1-S4a: prefix caching and a sliding window no longer than its group's block."""
    return s.prefix_caching and s.sliding_window is not None and s.sliding_window <= s.swa_block_size


@pytest.fixture(scope="module")
def adapter():
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    return VLLMV1SchedulerAdapter


@requires_vllm("0.20.1", pin="0.20.1")
def test_a_coarser_groups_cached_blocks_are_keyed_as_the_release_hashes_them(adapter):
    """Full attention B=4 beside a window group of B=2 blocks, prefix caching: the full group's
    blocks are cached under the hash the release derives from two hash blocks (0.20.1
    concatenates them, 0.30.0+ takes the last one), and the adapter names the key of each
    (before, 0.20.1's concatenated hashes were 'a hash no request produced')."""
    shape = Shape(
        block_size=4, swa_block_size=2, sliding_window=4, extra_blocks=8, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=32, max_model_len=32,
        full_sequence_must_fit=False, max_tokens=2,
    )
    driver = SchedulerDriver(adapter(shape))
    driver.arrive(0, [1, 2, 3, 1, 2, 3, 1, 2, 3], 2)
    for _ in range(3):
        driver.step(bytes(4), bytes(4))
    full = driver.state.groups[0]
    assert sorted(len(key.chain) for key, _ in full.cached) == [4, 8]
    assert driver.check() == []


@on_033
def test_hybrid_scheduler_is_built_as_production_builds_it(adapter):
    shape = Shape(
        block_size=4, swa_block_size=2, sliding_window=5, extra_blocks=0, prefix_caching=True,
        num_spec_tokens=2, async_scheduling=False, max_num_batched_tokens=8, max_model_len=32,
        full_sequence_must_fit=True, max_tokens=6,
    )
    target = adapter(shape)
    assert type(target.manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert target.num_blocks == target.minimum_blocks  # vLLM's startup minimum
    driver = SchedulerDriver(target)
    driver.arrive(0, [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3], 6)
    for i in range(6):
        driver.step(bytes([i, 1, 2, 3]), bytes([1, 2, 3, 0]))
        assert driver.check() == []
    assert driver.counts["chunks"] >= 1 and driver.counts["draft_steps"] >= 1, driver.counts
    assert driver.finish() == []


@on_033
@pytest.mark.parametrize("tag", SHAPE_TAGS)
def test_scheduler_holds_every_invariant_in_shape(adapter, tag):
    import vllm

    counts = ShapeCounts()
    # The release's own offers: a shape tag (the KV connector, a sparse retention, images) can only be
    # drawn where the strategy is told the target builds it.
    offers = (retention_offer_of(adapter), kv_connectors_of(adapter), multimodal_refusal_of(adapter) is None)
    within = shapes(*offers).filter(lambda s: tag in s.tags())
    # What ``kvspec check`` does with the release's known findings (FINDINGS.md, e.g. C5 in a
    # Mamba shape at the startup minimum): an example whose every failure is one is discarded.
    step_past = step_past_known(load_known([SHIPPED]), "v1-scheduler", vllm.__version__)
    run_state_machine_as_test(
        lambda: SchedulerMachine(adapter, within, counts=counts, step_past=step_past),
        settings=settings(settings(), max_examples=40, report_multiple_bugs=False, deadline=None),
    )
    assert counts.operations[tag] >= 200, counts


def _mamba_hashing_every_token(block_size: int, max_model_len: int) -> Shape:
    """A Mamba "align" shape with prefix caching whose hashes cover every token (unit 1)."""
    return Shape(
        block_size=block_size, swa_block_size=block_size, sliding_window=None, extra_blocks=0,
        prefix_caching=True, num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=max_model_len,
        max_model_len=max_model_len, full_sequence_must_fit=False, max_tokens=2, mamba=True, prefix_match_unit=1,
    )


def _partial_tail_trace(adapter, copies: bool) -> tuple[SchedulerDriver, list]:
    """A two-token prompt in a Mamba "align" shape hashing every token (unit 1, blocks of 2):
    its first chunk stops at the prompt's last hash boundary and caches the state there as a
    partial tail; its next step moves that cache entry to a fresh block the worker fills by
    copy (0.33.0 single_type_kv_cache_manager.py:1883-1912).  ``copies`` False: a worker that
    skips the plan's copies."""
    driver = SchedulerDriver(adapter(_mamba_hashing_every_token(2, 16)))
    if not copies:
        driver._copy_blocks = lambda _plan: None
    driver.arrive(1, [0, 0], 1)
    found = []
    for _ in range(2):
        driver.step(bytes(4), bytes(4))
        found += driver.check()
    return driver, found


@on_033
def test_a_mamba_partial_tail_is_copied_on_write(adapter):
    driver, found = _partial_tail_trace(adapter, copies=True)
    assert found == [] and driver.counts["block_copies"] >= 1, (found, driver.counts)
    assert driver.finish() == []


@on_033
def test_a_worker_that_skips_the_copy_leaves_a_cached_state_block_empty(adapter):
    """The copy-on-write the scheduler output hands the worker is what fills the block the
    partial tail is cached in: skipped, ``prefix-cache-consistency`` sees an empty cached state."""
    _, found = _partial_tail_trace(adapter, copies=False)
    assert {(v.invariant, v.kind) for v in found} >= {("prefix-cache-consistency", "uncomputed-hit")}, found


def _partial_hit_trace(adapter, below_hit: bool) -> tuple[SchedulerDriver, list]:
    """Blocks of 4 hashed at every token (unit 1): ``[0, 1]`` caches its first token as a
    partial tail in full-attention block 1 (whose slot 1 then holds position 1, token 1) and
    finishes; ``[0, 0, 0]`` hits that one token, takes a private copy of block 1 (0.33.0
    single_type_kv_cache_manager.py:320-324, 388-398) and writes its own position 1 there;
    ``[0, 1, 1]`` then hits the same tail, not the copy.  ``below_hit`` False: a copy that
    carries none of the cells (the hit's positions missing too)."""
    driver = SchedulerDriver(adapter(_mamba_hashing_every_token(4, 64)))
    if not below_hit:
        copy = driver._admitted_hit_holding
        driver._admitted_hit_holding = lambda plan, block: None if copy(plan, block) is None else 0
    found = []
    for seq, tokens in enumerate(([0, 1], [0, 0, 0], [0, 1, 1])):
        driver.arrive(seq, tokens, 1)
        for _ in range(2 if seq == 0 else 1):
            driver.step(bytes(4), bytes(4))
            found += driver.check()
    return driver, found + driver.finish()


@on_033
def test_a_partial_hit_writes_past_its_hit_into_its_private_copy(adapter):
    """The worker copies the whole tail block, but the slots past the hit are no content of the
    copy's life: the hit request's write there is its first (spec/kv_memory.py ``copy_cells``);
    the tail keeps its content, so the third request's hit of it reads back its own tokens."""
    driver, found = _partial_hit_trace(adapter, below_hit=True)
    assert found == [] and driver.counts["block_copies"] >= 4, (found, driver.counts)
    assert driver.counts["hits"] == 2, driver.counts


@on_033
def test_a_partial_hit_copy_without_the_hit_positions_fails_readback(adapter):
    """Leaving out the slots past the hit is narrow: a copy that leaves out the hit's own
    positions fails ``kv-readback``."""
    _, found = _partial_hit_trace(adapter, below_hit=False)
    assert "kv-readback" in {v.invariant for v in found}, found


# The shapes 0.9.1 has: no AsyncScheduler, no scheduler_reserve_full_isl, no chunked-local
# attention, one block size for every group (the adapter refuses the rest, as the release does).
SHAPES_091 = ("hybrid", "spec-decode", "budget-chunked", "full-isl-off", "startup-min")


@on_091
def test_091_scheduler_holds_every_invariant_in_its_shapes(adapter):
    counts = ShapeCounts()
    within = shapes().filter(
        lambda s: not s.async_scheduling
        and not s.full_sequence_must_fit
        and s.attention_chunk_size is None
        and s.swa_block_size == s.block_size
        and not _window_crash_shape(s)
    )
    run_state_machine_as_test(
        lambda: SchedulerMachine(adapter, within, counts=counts), settings=_settings(60)
    )
    for tag in SHAPES_091:
        assert counts.operations[tag] >= 100, counts


@on_091
def test_091_v1_s4a_window_crash_is_found_from_scratch(adapter):
    """FINDINGS V1-S4a: 0.9.1's ``BlockPool.cache_full_blocks`` chains the next block's hash
    from the previous block's ``block_hash`` (block_pool.py:136-139), which the sliding-window
    group has already swapped for the null block once the window passed it."""
    within = shapes().filter(
        lambda s: _window_crash_shape(s) and s.swa_block_size == s.block_size
        and not s.async_scheduling and not s.full_sequence_must_fit
    )
    with pytest.raises(AssertionError) as crash:
        run_state_machine_as_test(lambda: SchedulerMachine(adapter, within), settings=_settings(60))
    where = crash.traceback[-1]
    assert where.path.name == "block_pool.py" and "cache_full_blocks" in str(where.name), crash


# FINDINGS V1-S2a's neighbourhood: full attention + a sliding window, both B=2, async
# scheduling with EAGLE drafts, no prefix caching.
V1_S2A_NEIGHBOURHOOD = st.builds(
    Shape,
    block_size=st.just(2),
    swa_block_size=st.just(2),
    sliding_window=st.integers(2, 5),
    extra_blocks=st.sampled_from([0, 4]),
    prefix_caching=st.just(False),
    num_spec_tokens=st.integers(1, 3),
    async_scheduling=st.just(True),
    max_num_batched_tokens=st.just(16),
    max_model_len=st.just(16),
    full_sequence_must_fit=st.just(False),
    max_tokens=st.sampled_from([4, 8]),
    eagle=st.just(True),
)


@on_012
def test_012_v1_s2a_async_drafts_free_window_blocks_still_read(adapter):
    """FINDINGS V1-S2a: under async scheduling with EAGLE drafts, 0.12.0 frees a sliding
    window's blocks by the scheduler's optimistic count (drafts in flight counted as accepted,
    kv_cache_manager.py:265); when the drafts are rejected the next token's window reaches back
    into a freed block.  Fixed upstream by vllm#47728 (frees on the processed-token basis)."""
    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(lambda: SchedulerMachine(adapter, V1_S2A_NEIGHBOURHOOD), settings=_settings(60))
    found = {v.invariant for v in caught.value.violations}
    assert "kv-readback" in found, caught.value


@on_012
def test_012_v1_s2a_is_reported_by_its_known_finding_and_replays(adapter, tmp_path, capsys):
    """``kvspec check``'s scheduler search (cli/shapes.py) in V1-S2a's neighbourhood on 0.12.0:
    the shipped fingerprint steps it past, then reports it as V1-S2a with its own shrunk trace
    and a report that ``kvspec replay``'s loop reproduces on 0.12.0's scheduler."""
    import json

    from kvspec.cli.shapes import SCHEDULER_IMPL, run_scheduler_search, write_scheduler_reports
    from kvspec.testing.artifacts.report import trace_from_json
    from kvspec.testing.artifacts.rerun import rerun
    from kvspec.testing.blockmanager.differential import Mode
    from kvspec.testing.known import SHIPPED, load_known
    from kvspec.testing.scheduler.replay import in_context, scheduler_session

    known = [k for k in load_known([SHIPPED]) if k.concerns(SCHEDULER_IMPL, "0.12.0")]
    run = run_scheduler_search(
        adapter, known=known, profile="ci", examples=60, steps=None, seed=1, focus=None,
        shape_strategy=V1_S2A_NEIGHBOURHOOD,
    )
    assert run.search.fired["V1-S2a"] > 0
    s2a = [f for f in run.search.found if f.known is not None and f.known.id == "V1-S2a"]
    assert s2a, [f.fingerprint for f in run.search.found]
    entries = write_scheduler_reports(run, tmp_path, 1, lambda: {"target": {}, "command": [], "limits": {}}, "")
    report = json.loads(open(entries[run.search.found.index(s2a[0])]["report"]).read())
    assert report["verdict"]["known_finding"] == "V1-S2a"
    shape, trace = Shape(**report["shape"]), trace_from_json(report["trace"])
    session = scheduler_session(shape, Mode(report["differential_mode"]))
    again = in_context(lambda: rerun(adapter, shape, trace, session=session))
    assert "kv-readback" in {v.invariant for v in again.violations}, again


# FINDINGS V1-S2a's trace: full attention + a W=3 window, both B=2, EAGLE with 2 drafts, async
# scheduling, no prefix caching; one request, every draft rejected.
V1_S2A = Shape(
    block_size=2, swa_block_size=2, sliding_window=3, extra_blocks=0, prefix_caching=False,
    num_spec_tokens=2, async_scheduling=True, max_num_batched_tokens=16, max_model_len=16,
    full_sequence_must_fit=False, max_tokens=3, eagle=True,
)


def _rejected_drafts(adapter) -> tuple[SchedulerDriver, list]:
    """``arrive([0], max_tokens=3)``, then steps whose drafts the worker all rejects; returns
    the driver and the first violations (none: the request ran to its end)."""
    driver = SchedulerDriver(adapter(V1_S2A), async_depth=1)
    driver.arrive(0, [0], 3)
    for _ in range(6):
        driver.step(bytes(4), bytes(4))  # accept code 0: no draft accepted
        found = driver.check()
        if found:
            return driver, found
    return driver, []


@requires_vllm("0.12.0", "0.25.1", pin="0.12.0")
def test_v1_s2a_rejected_drafts_read_a_window_block_freed_by_the_optimistic_count(adapter):
    """FINDINGS V1-S2a as a straight line: the third step frees the window group's block 0 by
    the count that takes the two drafts in flight as accepted; both are rejected, so position 2
    attends position 1 in the freed block.  Reproduces on 0.12.0, 0.19.1, 0.20.1, 0.23.0 and 0.25.1
    (0.10.2 refuses async scheduling with drafts); 0.30.0 frees by the processed count."""
    _, found = _rejected_drafts(adapter)
    assert [v.message for v in found if v.invariant == "kv-readback"] == [
        "group swa: seq 0: attended position 1 has no slot (dropped or missing)"
    ], found


@requires_vllm("0.30.0", pin="0.33.0")
def test_v1_s2a_control_the_rejected_drafts_run_to_the_end_from_0_30_0(adapter):
    """vllm#47728: 0.30.0 on free a window's blocks by the processed-token count, so the same
    trace keeps position 1 while it is attended and the request finishes."""
    driver, found = _rejected_drafts(adapter)
    assert found == [] and not driver.seqs, (found, driver.seqs)


# FINDINGS V1-S2b: full attention + chunked-local C=2, both B=2, prefix caching, async
# scheduling, the pool at the startup minimum; budget 8 of max_model_len 16.
V1_S2B = Shape(
    block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=0, prefix_caching=True,
    num_spec_tokens=0, async_scheduling=True, max_num_batched_tokens=8, max_model_len=16,
    full_sequence_must_fit=False, attention_chunk_size=2,
)


def _two_identical_requests(adapter, shape: Shape) -> SchedulerDriver:
    driver = SchedulerDriver.for_shape(adapter(shape), shape)
    for seq in range(2):
        driver.arrive(seq, [0], 3)
    for _ in range(4):
        driver.step(bytes(4), bytes(4))
        assert driver.check() == []
    return driver


@requires_vllm("0.10.2", "0.12.0", pin="0.12.0")
def test_012_v1_s2b_async_chunked_local_caches_the_null_block(adapter):
    """FINDINGS V1-S2b: under async scheduling a block's hash waits for the token in flight,
    but the chunked-local group nulls the block once the optimistic count leaves its chunk
    (``remove_skipped_blocks`` before ``cache_blocks`` in ``allocate_slots``); 0.12.0 then
    caches the null block under the block's hash, and the second request with the same
    prefix trips ``assert blk.block_hash is None`` (block_pool.py:257; :136 in 0.10.2)."""
    with pytest.raises(AssertionError) as crash:
        _two_identical_requests(adapter, V1_S2B)
    where = crash.traceback[-1]
    assert where.path.name == "block_pool.py" and "cache_full_blocks" in str(where.name), crash


@on_012
@pytest.mark.parametrize("change", [{"async_scheduling": False}, {"prefix_caching": False}],
                         ids=["sync", "no-caching"])
def test_012_v1_s2b_controls_run(adapter, change):
    import attrs

    driver = _two_identical_requests(adapter, attrs.evolve(V1_S2B, **change))
    assert not driver.seqs, "both requests finish"


@on_012
def test_012_v1_s2b_is_found_from_scratch(adapter):
    within = st.builds(
        Shape,
        block_size=st.just(2), swa_block_size=st.just(2), sliding_window=st.none(),
        extra_blocks=st.sampled_from([0, 2]), prefix_caching=st.just(True),
        num_spec_tokens=st.just(0), async_scheduling=st.just(True),
        max_num_batched_tokens=st.sampled_from([8, 16]), max_model_len=st.just(16),
        full_sequence_must_fit=st.just(False), attention_chunk_size=st.just(2),
        max_tokens=st.sampled_from([2, 4]),
    )
    # With one request the null block is cached silently, which prefix-cache-consistency
    # reports; with two identical prefixes vLLM's own assert fires first.
    with pytest.raises((AssertionError, SpecViolation)) as caught:
        run_state_machine_as_test(lambda: SchedulerMachine(adapter, within), settings=_settings(200))
    if isinstance(caught.value, SpecViolation):
        assert "not a block of the pool" in str(caught.value), caught.value
    else:
        assert caught.traceback[-1].path.name == "block_pool.py", caught


@requires_vllm("0.10.2", "0.12.0", pin="0.12.0")
def test_012_v1_s2b_one_request_caches_the_null_block_silently(adapter):
    """The same trace with one request: no assert, but the chunked-local group's cache map
    names the null block, which ``prefix-cache-consistency`` reports."""
    driver = SchedulerDriver(adapter(V1_S2B), async_depth=1)
    driver.arrive(0, [0], 3)
    found = []
    for _ in range(4):
        driver.step(bytes(4), bytes(4))
        found += driver.check()
    assert found and all(v.invariant == "prefix-cache-consistency" for v in found), found
    assert "not a block of the pool" in found[0].message, found


@requires_vllm("0.19.1", pin="0.33.0")
def test_v1_s2b_control_the_async_trace_runs_from_0_19_1(adapter):
    """From 0.19.1 ``BlockPool.cache_full_blocks`` skips null blocks (0.19.1 block_pool.py:258-262),
    so the chunked-local group's nulled block 0 is not cached: both requests of V1-S2b's trace
    finish, every invariant holding (0.19.1-0.25.1 still null it by the optimistic count, the
    cause of V1-S2a)."""
    driver = _two_identical_requests(adapter, V1_S2B)
    assert not driver.seqs, "both requests finish"
