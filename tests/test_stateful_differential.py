"""The differential machine: implementation and reference in lockstep, compared in an
explicit mode, known divergences as narrow filters."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference import ReferenceManager
from kvspec.reference.broken import OffByOneWindow
from kvspec.testing import RunStats, SpecViolation
from kvspec.testing.blockmanager.differential import DifferentialMachine, Mode
from kvspec.testing.blockmanager.strategies import configs
from kvspec.testing.divergences import KNOWN


@pytest.mark.parametrize("mode", list(Mode))
def test_stateful_differential_reference_against_itself(mode):
    stats = RunStats()
    run_state_machine_as_test(
        lambda: DifferentialMachine(ReferenceManager, stats=stats, mode=mode),
        settings=settings(settings(), report_multiple_bugs=False),
    )
    assert stats.by_op.get("step", 0) >= 50, stats


def test_stateful_differential_counts_catch_a_window_that_holds_too_much():
    # Watching only kv-readback (which the variant keeps), the comparison alone must see it.
    strategy = configs(max_blocks=8).filter(lambda c: c.sliding_window is not None)
    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(
            lambda: DifferentialMachine(
                OffByOneWindow, strategy, mode=Mode.COUNTS, focus={"kv-readback"}
            ),
            settings=settings(settings(), report_multiple_bugs=False),
        )
    assert {v.invariant for v in caught.value.violations} <= {
        "differential/outcomes",
        "differential/counts",
    }


def test_known_divergences_are_documented():
    for d in KNOWN:
        assert d.reason and d.upstream and callable(d.applies), d.id
    assert len({d.id for d in KNOWN}) == len(KNOWN)


def test_stateful_differential_refuses_a_manager_that_admits_nothing():
    """A manager that answers LATER to everything (no reserve declared) is not an allowed
    divergence: conservative-admission covers only refusals within the declared reserve."""
    from kvspec.reference.broken import RefuseAll

    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(
            lambda: DifferentialMachine(RefuseAll, mode=Mode.OUTCOMES, focus={"kv-readback"}),
            settings=settings(settings(), report_multiple_bugs=False),
        )
    assert {v.invariant for v in caught.value.violations} == {"differential/outcomes"}


def test_the_reference_admits_with_the_lookahead_the_target_declares():
    """A target whose admission reserves no lookahead slots (``admit_lookahead`` 0, as vLLM
    0.12.0 and 0.20.1 schedule a waiting request: spec/interface.py ``admit``) is run beside a
    reference that admits the same way: with the run's lookahead the reference would refuse a
    one-token prompt in a one-block pool that the target admits."""
    from kvspec.spec.config import Config
    from kvspec.testing.blockmanager.differential import Lockstep
    from kvspec.testing.blockmanager.driver import Driver

    config = Config(block_size=1, num_blocks=1, max_lookahead=1)
    target = ReferenceManager(config, admit_lookahead=0)
    apart = Lockstep(Driver(target), Driver(ReferenceManager(config)), Mode.OUTCOMES)
    assert apart.admit(0, [0], 1) is True
    assert [v.invariant for v in apart.check()] == ["differential/outcomes"]
    stats = RunStats()
    run_state_machine_as_test(
        lambda: DifferentialMachine(
            lambda c: ReferenceManager(c, admit_lookahead=0), stats=stats, mode=Mode.RENAMING
        ),
        settings=settings(settings(), report_multiple_bugs=False),
    )
    assert stats.by_op.get("step", 0) >= 50, stats


class _RefusesForUndeclaredLookahead(ReferenceManager):
    """Declares that an admission reserves no lookahead slots (``admit_lookahead`` 0, as vLLM
    0.12.0 and 0.20.1), yet refuses a prompt whose first step fits only without them."""

    def __init__(self, config) -> None:
        super().__init__(config, admit_lookahead=0)

    def can_admit(self, seq_id, tokens, num_new_tokens, extra=()):
        self.admit_lookahead = self.config.max_lookahead
        try:
            return super().can_admit(seq_id, tokens, num_new_tokens, extra)
        finally:
            self.admit_lookahead = 0


def test_admission_completeness_judges_the_lookahead_the_target_declares():
    """The driver's admission need (and a step's extent, for window-bound) counts the lookahead
    slots the target declares its admission reserves: a target declaring none that refuses a
    one-token prompt in a free one-block pool is caught, while one that reserves them may."""
    from kvspec.spec.config import Config
    from kvspec.testing.blockmanager.driver import Driver

    config = Config(block_size=1, num_blocks=1, max_lookahead=1)
    refusing = Driver(_RefusesForUndeclaredLookahead(config))
    assert refusing.admit(0, [0], 1) is False
    assert [v.invariant for v in refusing.check()] == ["admission-completeness"]
    reserving = Driver(ReferenceManager(config))  # reserves the lookahead: 2 blocks, 1 in the pool
    assert reserving.admit(0, [0], 1) is False
    assert reserving.check() == []
    declared = Driver(ReferenceManager(config, admit_lookahead=0))
    assert declared.admit(0, [0], 1) is True and declared.check() == []
    assert declared.seqs[0].step == (0, 1)  # the step's extent leaves the undeclared slot out


@pytest.mark.parametrize(
    ("divergence", "flag", "ops"),
    [
        (
            "untracked-sequence-holds-blocks",
            "target_holds_untracked",
            ("admit", "readmit", "step", "reset_prefix_cache"),
        ),
        ("window-hits-from-the-end", "window_hit_from_the_end", ("admit", "readmit")),
    ],
)
def test_a_pre_0_25_divergence_explains_only_its_own_difference(divergence, flag, ops):
    """Each allows one direction of one outcome difference, only with its fact established:
    without the fact, in the other direction, in another mode or for another operation the
    difference stays a failure."""
    from kvspec.testing.divergences import Mismatch, explained

    refused = divergence == "untracked-sequence-holds-blocks"  # the target refuses; else it admits
    base = dict(mode="outcomes", seq=0, target=not refused, reference=refused, target_name="vllm-v1", prefill=True)
    for op in ops:
        why = explained(Mismatch(op=op, **base, **{flag: True}))
        assert why is not None and why.id == divergence
        assert explained(Mismatch(op=op, **base)) is None
        flipped = dict(base, target=refused, reference=not refused)
        assert explained(Mismatch(op=op, **flipped, **{flag: True})) is None
        assert explained(Mismatch(op=op, **dict(base, mode="counts"), **{flag: True})) is None
    assert explained(Mismatch(op="free", **base, **{flag: True})) is None
