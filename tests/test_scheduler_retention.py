"""The prefix-cache retention of the scheduler shapes (``Shape.retention_interval``): the shape
strategy draws every retention a release offers -- its engine default, dense and a periodic
interval -- only where the release has the choice and only where it matters; the scheduler
differential compares the sparse ones where the policy declares the release's sparse retention
(``sparse_retention_tails``), says so where it does not, and catches a cache that retains
densely in a sparse shape."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import find, given, settings
from hypothesis.errors import NoSuchExample
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.broken_scheduler import SPARSE_RETENTION_ONLY
from kvspec.reference.policies import REFERENCE_OWN, Choice
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.groups import DENSE_ONLY, RetentionOffer, Shape
from kvspec.testing import SpecViolation
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.scheduler import machine
from kvspec.testing.scheduler.machine import DiffCounts, PolicyDifference, SchedulerMachine, retention_offer_of, shapes

# The offer of a release whose CacheConfig has the field with 0.33.0's default (config/cache.py:275).
SPARSE_BY_DEFAULT = RetentionOffer(configurable=True, engine_default=0)
FIND = settings(database=None, derandomize=True, max_examples=2000)
_SETTINGS = settings(max_examples=40, deadline=None, database=None, derandomize=True)


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


def _run_sparse(factory, counts: DiffCounts, examples: int = 10) -> None:
    sparse = shapes(SPARSE_BY_DEFAULT).filter(lambda s: s.sparse_retention and s.sliding_window is not None)
    run_state_machine_as_test(
        lambda: SchedulerMachine(factory, sparse, differential=Mode.RENAMING, diff_counts=counts),
        settings=settings(max_examples=examples, deadline=None, database=None, derandomize=True),
    )


def test_sparse_retention_is_compared_where_declared():
    counts = DiffCounts()
    _run_sparse(ReferenceScheduler, counts, examples=30)
    assert counts.examples >= 30 and not counts.not_run, counts
    assert counts.hit_examples > 0 and counts.to_end == counts.examples, counts


def test_sparse_retention_is_not_compared_where_undeclared_and_says_so(monkeypatch):
    source = REFERENCE_OWN.sparse_window_cache.source
    undeclared = attrs.evolve(REFERENCE_OWN, sparse_retention_tails=Choice(False, source))
    monkeypatch.setattr(machine, "REFERENCE_OWN", undeclared)
    counts = DiffCounts()
    _run_sparse(ReferenceScheduler, counts)
    assert counts.examples == 0, counts
    assert counts.not_run[f"sparse prefix-cache retention (not declared for {undeclared.id})"] >= 10, counts


@pytest.mark.parametrize("name", sorted(SPARSE_RETENTION_ONLY))
def test_a_dense_cache_under_sparse_retention_only_the_differential_catches(name):
    """The variant holds every invariant in sparse shapes and is the reference in dense ones;
    the differential in a sparse shape reports a policy difference (not a violation)."""
    variant = SPARSE_RETENTION_ONLY[name]
    sparse = shapes(SPARSE_BY_DEFAULT).filter(lambda s: s.sparse_retention and s.sliding_window is not None)
    run_state_machine_as_test(lambda: SchedulerMachine(variant, sparse), settings=_SETTINGS)
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(
            variant, shapes(SPARSE_BY_DEFAULT).filter(lambda s: not s.sparse_retention), differential=Mode.RENAMING,
            diff_counts=counts,
        ),
        settings=_SETTINGS,
    )
    assert counts.examples > 0, counts
    with pytest.raises(PolicyDifference) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(variant, sparse, differential=Mode.RENAMING), settings=_SETTINGS
        )
    found = caught.value
    assert not isinstance(found, SpecViolation | AssertionError), found
    assert found.release == variant.name and found.policy == REFERENCE_OWN.id, found
    assert any(s.op == "arrive" for s in found.trace), found
