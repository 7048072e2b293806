"""The prefix-cache retention of the scheduler shapes (``Shape.retention_interval``): the shape
strategy draws every retention a release offers -- its engine default, dense and a periodic
interval -- only where the release has the choice and only where it matters, and the scheduler
differential does not compare the sparse ones (the reference retains densely) but says so."""

from __future__ import annotations

import pytest
from hypothesis import find, given, settings
from hypothesis.errors import NoSuchExample
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.groups import DENSE_ONLY, RetentionOffer, Shape
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.scheduler.machine import DiffCounts, SchedulerMachine, retention_offer_of, shapes

# The offer of a release whose CacheConfig has the field with 0.33.0's default (config/cache.py:275).
SPARSE_BY_DEFAULT = RetentionOffer(configurable=True, engine_default=0)
FIND = settings(database=None, derandomize=True, max_examples=2000)


def _retains_locally(shape: Shape) -> bool:
    """Prefix caching with a sliding-window or Mamba group: where retention matters."""
    return shape.prefix_caching and (shape.sliding_window is not None or shape.mamba)


@pytest.mark.parametrize(
    ("name", "matches"),
    [
        ("engine default (sparse)", lambda s: s.retention_interval == 0),
        ("dense", lambda s: s.retention_interval is None),
        ("periodic, sliding window", lambda s: bool(s.retention_interval) and s.sliding_window is not None),
        ("periodic, Mamba", lambda s: bool(s.retention_interval) and s.mamba),
    ],
)
def test_strategy_draws_each_retention(name, matches):
    find(shapes(SPARSE_BY_DEFAULT), lambda s: _retains_locally(s) and matches(s), settings=FIND)


@settings(database=None, derandomize=True, max_examples=300, deadline=None)
@given(shapes(SPARSE_BY_DEFAULT))
def test_drawn_retentions_are_ones_vllm_accepts(shape):
    """A periodic interval only with a sliding-window or Mamba group, on a multiple of the
    scheduler's block size (vLLM 0.33.0 kv_cache_coordinator.py:33-62); the others run the
    engine's default."""
    if shape.retention_interval:
        assert _retains_locally(shape) and shape.retention_interval % shape.scheduler_block_size == 0, shape
    if not _retains_locally(shape):
        assert shape.retention_interval == SPARSE_BY_DEFAULT.engine_default, shape


def test_strategy_draws_no_retention_a_release_lacks():
    """A release without the field (and the reference scheduler) runs dense retention alone."""
    with pytest.raises(NoSuchExample):
        find(shapes(DENSE_ONLY), lambda s: s.retention_interval is not None, settings=FIND)
    assert retention_offer_of(ReferenceScheduler) == DENSE_ONLY


def test_sparse_retention_is_not_compared_and_says_so():
    counts = DiffCounts()
    sparse = shapes(SPARSE_BY_DEFAULT).filter(lambda s: s.sparse_retention)
    run_state_machine_as_test(
        lambda: SchedulerMachine(ReferenceScheduler, sparse, differential=Mode.RENAMING, diff_counts=counts),
        settings=settings(max_examples=10, deadline=None, database=None, derandomize=True),
    )
    assert counts.examples == 0, counts
    assert counts.not_run["sparse prefix-cache retention (the reference retains densely)"] >= 10, counts
