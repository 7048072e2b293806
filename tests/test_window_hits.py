"""``window_hits_from_the_end`` (spec/admission.py): a V1 sliding-window lookup takes the last
run of cached blocks the window needs, even when earlier blocks were evicted, and reviving that
run's evictable blocks spends free capacity.  Without the freedom, ``admission-completeness``
raised a false alarm on vLLM 0.20.1 (``kvspec check --vllm 0.20.1 --seed 2``, 15 operations):
the state below, where vLLM refused seq 3's re-admission because its window hit revives the
only evictable block and its next position needs one more."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvspec.spec.admission import AdmissionPolicy, window_hit_blocks
from kvspec.spec.config import Config
from kvspec.spec.prefix_hash import NO_EXTRA, block_keys
from kvspec.spec.state import KVState, PoolView
from kvspec.testing.blockmanager.completeness import CompletenessObserver, window_hit

WINDOW_POLICY = AdmissionPolicy(watermark_when_idle=False, window_hits_from_the_end=True)


@pytest.mark.parametrize(
    ("cached", "window", "block_size", "drop_last", "hit"),
    [
        ([False, True], 4, 4, False, (2, 1)),  # block 0 evicted: the window hit still ends at 2
        ([True, True], 4, 4, False, (2, 1)),  # block 0 lies before the window: the null block
        ([True, False], 4, 4, False, (1, 0)),  # no run at the end: the leading run
        ([False, False], 4, 4, False, (0, 0)),
        ([False, True, False], 1, 4, False, (2, 1)),  # W=1 needs no earlier block: the last cached one
        ([True, True, False, True, True], 9, 4, False, (5, 3)),  # ceil(8/4) = 2 contiguous blocks
        ([False, True, True], 4, 4, True, (2, 1)),  # EAGLE: one block more, then the last dropped
    ],
)
def test_window_hit_blocks_searches_from_the_end(cached, window, block_size, drop_last, hit):
    assert window_hit_blocks(cached, window, block_size, drop_last) == hit


def _state(free: tuple[int, ...]) -> KVState:
    """seq 3's 8 computed tokens were freed at its preemption; block 0's key was evicted since,
    block 1 (the 8-token key) is evictable as block 5; blocks 0-3 hold the other sequences."""
    key = block_keys((0,) * 8, 4, NO_EXTRA)[1]
    ids = (0, 1, 2, 3, 4, 5, 6)[: 6 + len(free)]
    refcounts = {b: (0 if b in free or b == 5 else 1) for b in ids}
    gpu = PoolView(ids=ids, refcounts=refcounts, free=free, evictable=(5,), cached=((key, 5),),
                   computed=frozenset({5}))
    return KVState(gpu=gpu, tables={})


def _observer(policy: AdmissionPolicy) -> CompletenessObserver:
    config = Config(block_size=4, num_blocks=6, sliding_window=4, prefix_caching=True)
    impl = SimpleNamespace(admission_policy=policy)
    driver = SimpleNamespace(config=config, impl=impl, lookahead=0, admit_lookahead=0, seqs={})
    return CompletenessObserver(driver)  # type: ignore[arg-type]


def test_the_window_hit_is_the_run_before_the_end():
    assert window_hit(_state(()).gpu, (0,) * 9, NO_EXTRA, 4, 4, False) == (2, 1)


def test_vllm_0201_refusal_is_allowed_by_the_freedom_and_not_without_it():
    tokens = [0] * 9
    assert _observer(WINDOW_POLICY).admission_refused(_state(()), 3, tokens, 4, NO_EXTRA, "NotAdmitted") == []
    without = AdmissionPolicy(watermark_when_idle=False)
    found = _observer(without).admission_refused(_state(()), 3, tokens, 4, NO_EXTRA, "NotAdmitted")
    assert [v.invariant for v in found] == ["admission-completeness"]


def test_the_freedom_does_not_excuse_a_refusal_that_fits_with_the_window_hit():
    """One free block more: the window hit's revived block plus the new one fit, so refusing is
    still a violation (what the broken variant ``window-hit-hoard`` does)."""
    found = _observer(WINDOW_POLICY).admission_refused(_state((6,)), 3, [0] * 9, 4, NO_EXTRA, "NotAdmitted")
    assert [v.invariant for v in found] == ["admission-completeness"]
