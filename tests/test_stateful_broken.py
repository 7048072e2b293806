"""Every invariant can fail: each deliberately broken reference variant is caught by the
machine, with a shrunk counterexample, and reported under the invariant it breaks."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.broken import BROKEN
from kvspec.spec.invariants import INVARIANTS
from kvspec.testing import KVCacheMachine, SpecViolation
from kvspec.testing.blockmanager.strategies import configs


def _configs_for(needs: dict):
    window = needs.get("window", False)
    # Small pools and blocks: every bug here shows within a few blocks, and small
    # counterexamples shrink fast.
    strategy = configs(
        block_sizes=st.sampled_from([1, 2, 3, 4]),
        max_blocks=8,
        prefix_caching=st.just(True) if needs.get("prefix_caching") else st.booleans(),
        sliding_window=True,
    )
    if window:
        strategy = strategy.filter(lambda c: c.sliding_window is not None)
    return strategy


CASES = [(name, inv) for name, v in sorted(BROKEN.items()) for inv in sorted(v.catches)]


@pytest.mark.parametrize(("name", "invariant"), CASES)
def test_stateful_broken_variant_is_caught(name, invariant):
    """The machine, watching only ``invariant``, finds the variant's bug from scratch."""
    variant = BROKEN[name]
    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(
            lambda: KVCacheMachine(variant.cls, _configs_for(variant.needs), focus={invariant}),
            settings=settings(
                settings(),
                max_examples=max(settings().max_examples, 300),
                stateful_step_count=25,
                report_multiple_bugs=False,
            ),
        )
    found = {v.invariant for v in caught.value.violations}
    assert found == {invariant}, f"{name}: expected {invariant}, got {sorted(found)}"
    # Each carries its facts: the kind of failure, and at least one fact of what it is about.
    for v in caught.value.violations:
        assert v.kind and set(v.facts()) - {"kind"}, v.to_json()
    # The shrunk trace is short enough to read and cite.
    assert 1 <= len(caught.value.trace) <= 25, caught.value


def test_every_invariant_has_a_broken_variant():
    covered = set().union(*(v.catches for v in BROKEN.values()))
    assert covered >= set(INVARIANTS), f"no broken variant for {set(INVARIANTS) - covered}"
