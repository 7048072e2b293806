"""Lockstep (testing/lockstep.py) on kvspec's own managers: two child processes of this
interpreter, the reference as BASE and the reference or a broken variant as HEAD.

The behaviour-change verdict on a real vLLM (a planted eviction-order change) is
tests/targets/test_lockstep_pr.py.
"""

from __future__ import annotations

import sys

from hypothesis import strategies as st
from kvspec.reference.changed import MiscountedHitRate, ReportsHitRate
from kvspec.spec.invariants import Violation
from kvspec.testing.blockmanager.strategies import configs
from kvspec.testing.implementations import BROKEN_PREFIX
from kvspec.testing.lockstep import Kind, Mode, Observation, Side, differing, judge, run_lockstep

BUDGET = dict(profile="ci", examples=15, max_verdicts=1)


def _sides(head_impl: str, base_impl: str = "reference") -> tuple[Side, Side]:
    return (Side("HEAD", head_impl, sys.executable, head_impl), Side("BASE", base_impl, sys.executable, base_impl))


def test_the_same_manager_on_both_sides_differs_nowhere_and_counts_what_it_compared():
    run = run_lockstep(*_sides("reference"), configs(), **BUDGET)
    assert run.status == "compared" and run.verdicts == []
    assert run.stats.examples == 15 and run.stats.operations > run.stats.examples


def test_a_leak_on_head_is_a_regression_shrunk_to_a_few_operations():
    run = run_lockstep(*_sides("broken:leak-on-free"), configs(), **BUDGET)
    (verdict,) = run.verdicts
    assert verdict.kind is Kind.REGRESSION
    assert {v.invariant for v in verdict.head_violations} & {"no-leak", "refcount-exact"}
    assert not verdict.base_violations
    assert len(verdict.trace) <= 3


def test_the_same_leak_on_base_is_a_fix():
    head, base = _sides("broken:leak-on-free")
    run = run_lockstep(Side("HEAD", "reference", base.python, "reference"),
                       Side("BASE", head.impl, head.python, head.impl), configs(), **BUDGET)
    (verdict,) = run.verdicts
    assert verdict.kind is Kind.FIX and verdict.base_violations and not verdict.head_violations


def test_the_spec_judges_by_which_side_violates_what_the_other_does_not():
    leak, other = Violation("no-leak", "x"), Violation("conservation", "y")
    assert judge([leak], []) is Kind.REGRESSION
    assert judge([], [leak]) is Kind.FIX
    assert judge([], []) is Kind.CHANGE
    assert judge([leak], [leak]) is Kind.CHANGE
    assert judge([leak, other], [leak]) is Kind.REGRESSION


def test_each_mode_compares_its_fields_and_those_of_the_modes_below():
    base = Observation(outcome="admit: admitted, 0 cached tokens", free=(3,), tables=((0, "gpu", (0,)),))
    tables = Observation(outcome=base.outcome, free=(3,), tables=((0, "gpu", (0, 0)),))
    counts = Observation(outcome=base.outcome, free=(2,), tables=base.tables)
    hit = Observation(outcome="admit: admitted, 4 cached tokens", free=(3,), tables=base.tables)
    assert differing(tables, base, Mode.RENAMING) == ["tables"]
    assert differing(tables, base, Mode.COUNTS) == []
    assert differing(counts, base, Mode.COUNTS) == ["free"]
    assert differing(counts, base, Mode.OUTCOMES) == []
    assert differing(hit, base, Mode.OUTCOMES) == ["outcome"]
    assert differing(base, base, Mode.RENAMING) == []


def test_a_hit_rate_reported_differently_is_compared_as_a_count():
    base = Observation(outcome="admit: admitted, 4 cached tokens", free=(3,), hit_rate=(0.5,))
    head = Observation(outcome=base.outcome, free=(3,), hit_rate=(0.25,))
    assert differing(head, base, Mode.COUNTS) == ["hit_rate"]
    assert differing(head, base, Mode.RENAMING) == ["hit_rate"]
    assert differing(head, base, Mode.OUTCOMES) == []


def test_a_miscounted_hit_rate_on_head_is_a_behaviour_change_once_a_lookup_hits():
    """No invariant bounds the hit rate: a HEAD that counts every lookup twice (0.6.3's mutant
    of block/common.py:306) differs from BASE only in the figure, once a lookup hits."""
    head, base = (BROKEN_PREFIX + MiscountedHitRate.name, BROKEN_PREFIX + ReportsHitRate.name)
    run = run_lockstep(*_sides(head, base), configs(prefix_caching=st.just(True)), **BUDGET)
    (verdict,) = run.verdicts
    assert verdict.kind is Kind.CHANGE and verdict.field == "hit_rate", verdict.describe()
    assert not verdict.head_violations and not verdict.base_violations
    (head_rate,), (base_rate,) = verdict.values()
    assert head_rate == base_rate / 2 and base_rate > 0
    assert len(verdict.trace) <= 4, verdict.describe()  # shrunk: a few admissions, then a hit


def test_without_shrinking_the_first_difference_met_is_the_verdict_unshrunk():
    shrunk = run_lockstep(*_sides("broken:leak-on-free"), configs(), **BUDGET)
    first = run_lockstep(*_sides("broken:leak-on-free"), configs(), **BUDGET, shrink=False)
    (verdict,) = first.verdicts
    assert verdict.kind is Kind.REGRESSION
    # The same search, stopped where it first met the leak: never shorter than the shrunk one,
    # and cheaper (shrinking re-runs candidates, each operation on both sides).
    assert len(verdict.trace) >= len(shrunk.verdicts[0].trace)
    assert first.stats.operations < shrunk.stats.operations, (first.stats, shrunk.stats)


def test_a_head_whose_constructor_raises_starts_and_its_build_is_the_verdict(monkeypatch):
    """``hello`` imports the target by building it once: a constructor that raises after the
    import is no failure to start (the search's ``build`` meets it, a crash in construct), and
    an import that fails still is."""
    import pytest
    from kvspec.testing import implementations
    from kvspec.testing.guard import Limits
    from kvspec.testing.lockstep import _Session

    def raising(exc):
        def factory(_config):
            raise exc
        return factory

    session = _Session(Limits(60, 4))
    monkeypatch.setattr(implementations, "factory", lambda _name: raising(NameError("block_ids")))
    assert "pid" in session.hello("reference")
    monkeypatch.setattr(implementations, "factory", lambda _name: raising(ImportError("no vllm")))
    with pytest.raises(ImportError):
        session.hello("reference")
