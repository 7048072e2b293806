"""Incremental checking equals the whole-world definition (testing/blockmanager/incremental.py).

The machines run in ``both`` mode: after every operation the incremental rules and
``check_world`` judge the same world, and any difference in the invariants found or their
messages raises ``IncrementalMismatch``.  They run on the references and on every deliberately
broken variant of reference/broken.py and reference/broken_scheduler.py (each reaches worlds
that violate the invariants it breaks), and a sabotaged rule -- one that stops looking -- must
make the comparison fail, so the comparison can fail.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.broken import BROKEN
from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS
from kvspec.reference.manager import ReferenceManager
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.config import Config
from kvspec.spec.groups import KV_CONNECTORS
from kvspec.spec.state import Device
from kvspec.testing import KVCacheMachine, SpecViolation
from kvspec.testing.blockmanager.driver import Driver, replay
from kvspec.testing.blockmanager.incremental import (
    CHECK_ENV,
    RULES,
    IncrementalMismatch,
    TouchedMemory,
    UnknownCheckMode,
    check_mode,
    readback_rule,
)
from kvspec.testing.blockmanager.machine import CONTINUE
from kvspec.testing.blockmanager.strategies import configs
from kvspec.testing.scheduler.machine import SchedulerMachine, shapes
from test_stateful_broken import _configs_for

# Derandomized and small: each run compares both evaluations after every operation of every
# example, so a few dozen examples of 25 steps reach hundreds of worlds per variant.
EXAMPLES = 30


def _go_on(error: BaseException, _driver) -> bool | str:
    """Go on past a violation (the worlds after it are compared too); stop on anything else."""
    return CONTINUE if isinstance(error, SpecViolation) else False


def _run(
    factory, config_strategy, checking: str = "both", examples: int = EXAMPLES, go_on: bool = False
) -> BaseException | None:
    try:
        run_state_machine_as_test(
            lambda: KVCacheMachine(
                factory, config_strategy, checking=checking, step_past=_go_on if go_on else None
            ),
            settings=settings(
                derandomize=True, database=None, max_examples=examples, stateful_step_count=25,
                report_multiple_bugs=False, deadline=None,
            ),
        )
    except Exception as error:  # a violation, a mismatch, or (going on) the target crashing
        return error
    return None


def test_reference_verdicts_agree():
    assert _run(ReferenceManager, configs(max_blocks=12)) is None


@pytest.mark.parametrize("go_on", [False, True], ids=["stop", "go-on"])
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_variant_verdicts_agree(name, go_on):
    """Every broken variant: both evaluations agree on every world, the violating one included,
    and (go-on) on the worlds after it, where a broken invariant is checked whole until it
    holds again."""
    variant = BROKEN[name]
    error = _run(variant.cls, _configs_for(variant.needs), go_on=go_on)
    assert not isinstance(error, IncrementalMismatch), error


def _blind(_checker, _world, _delta):
    return iter(())


def _readback_without_memory(checker, world, delta):
    """The kv-readback rule that forgets the sequences whose blocks were written or freed."""
    emptied = {d: frozenset() for d in delta.memory}
    return readback_rule(checker, world, attrs.evolve(delta, memory=emptied))


def _breaking(rule: str) -> str:
    return next(n for n, v in sorted(BROKEN.items()) if rule in v.catches)


# (rule, sabotage, a variant that reaches what the sabotage misses).  A fork that does not
# take a reference lets the parent's free end the lives of blocks the child still holds: the
# child's table and model stay as they were, and only the blocks whose memory changed lead the
# readback rule to it (the run goes on past the refcount violation the fork causes).
SABOTAGE = [(rule, _blind, _breaking(rule)) for rule in sorted(RULES)] + [
    ("kv-readback", _readback_without_memory, "fork-without-incref")
]


@pytest.mark.parametrize(
    ("rule", "sabotage", "name"), SABOTAGE, ids=[f"{r}-{s.__name__}" for r, s, _ in SABOTAGE]
)
def test_sabotaged_rule_disagrees(rule, sabotage, name, monkeypatch):
    """A rule that stops looking is caught by the comparison: the test above can fail."""
    variant = BROKEN[name]
    monkeypatch.setitem(RULES, rule, sabotage)
    error = _run(variant.cls, _configs_for(variant.needs), examples=300, go_on=True)
    assert isinstance(error, IncrementalMismatch), f"{rule} sabotaged, on {name}: {error!r}"


def test_incremental_mode_reports_the_definition():
    """In incremental mode a broken variant is still caught, with the definition's report."""
    variant = BROKEN["leak-on-free"]
    error = _run(variant.cls, _configs_for(variant.needs), checking="incremental")
    assert isinstance(error, SpecViolation)
    assert {v.invariant for v in error.violations} & {"no-leak", "refcount-exact"}


def test_check_mode_from_environment(monkeypatch):
    monkeypatch.delenv(CHECK_ENV, raising=False)
    assert check_mode() == "incremental"
    monkeypatch.setenv(CHECK_ENV, "full")
    assert check_mode() == "full"
    assert Driver(ReferenceManager(Config(block_size=2, num_blocks=4))).checking == "full"
    assert check_mode("both") == "both"
    monkeypatch.setenv(CHECK_ENV, "sometimes")
    with pytest.raises(UnknownCheckMode):
        check_mode()


def test_replay_in_full_and_incremental_modes_agree(monkeypatch):
    """A recorded trace replays to the same verdict in every mode (the Driver's replay)."""
    trace = [
        {"op": "admit", "args": {"seq": 0, "tokens": [1, 2, 3, 4, 5], "num_new_tokens": 5}},
        {"op": "fork", "args": {"parent": 0, "child": 1}},
        {"op": "step", "args": {"seq": 1, "num_new_tokens": 1}},
        {"op": "free", "args": {"seq": 0}},
    ]
    config = Config(block_size=2, num_blocks=8)
    verdicts = {}
    for mode in ("full", "incremental", "both"):
        monkeypatch.setenv(CHECK_ENV, mode)
        found, _ = replay(BROKEN["leak-on-free"].cls(config), trace)
        verdicts[mode] = [str(v) for v in found]
    assert verdicts["full"] == verdicts["incremental"] == verdicts["both"]


def test_touched_memory_notes_blocks():
    memory = TouchedMemory()
    memory[(Device.GPU, 3, 0)] = (0, 7)
    memory.pop((Device.GPU, 4, 0), None)  # nothing there: nothing changed
    assert memory.take() == {(Device.GPU, 3)}
    del memory[(Device.GPU, 3, 0)]
    assert memory.take() == {(Device.GPU, 3)}
    memory.update({(Device.GPU, 5, 0): (0, 1)})
    assert memory.take() is None  # a wholesale change: the checker re-indexes


# ---------------------------------------------------------------- the scheduler machine

SCHEDULER_EXAMPLES = 20


def _run_scheduler(cls, shape_strategy, examples: int = SCHEDULER_EXAMPLES) -> BaseException | None:
    try:
        run_state_machine_as_test(
            lambda: SchedulerMachine(cls, shape_strategy),
            settings=settings(
                derandomize=True, database=None, max_examples=examples, report_multiple_bugs=False, deadline=None
            ),
        )
    except Exception as error:  # a violation or a mismatch
        return error
    return None


def _within(name: str):
    shape = BROKEN_SCHEDULERS[name].shape
    # The KV connector's variants need shapes that draw a connector (the reference models one).
    drawn = shapes(connectors=KV_CONNECTORS) if shape == "kv-connector" else shapes()
    return drawn.filter(lambda s: shape in s.tags())


# Open defect: after a reported send leaves a finished request's table held, the incremental
# and whole-world checks report the leak differently (IncrementalMismatch); not yet triaged.
@pytest.mark.parametrize(
    "name",
    [
        "reference",
        *sorted(BROKEN_SCHEDULERS),
    ],
)
def test_scheduler_verdicts_agree(name, monkeypatch):
    """The scheduler machine's hybrid checks (every group view and the shared pool) agree too,
    on the reference scheduler and on every broken scheduler in the shape that reaches its bug."""
    monkeypatch.setenv(CHECK_ENV, "both")
    if name == "reference":
        error = _run_scheduler(ReferenceScheduler, shapes())
        assert error is None, error
    else:
        error = _run_scheduler(BROKEN_SCHEDULERS[name].cls, _within(name))
        assert not isinstance(error, IncrementalMismatch), error


def test_sabotaged_rule_disagrees_on_the_shared_pool(monkeypatch):
    """A blind refcount rule misses the block two groups' tables alias in the shared pool."""
    monkeypatch.setenv(CHECK_ENV, "both")
    monkeypatch.setitem(RULES, "refcount-exact", _blind)
    error = _run_scheduler(BROKEN_SCHEDULERS["aliased-group-tables"].cls, _within("aliased-group-tables"), 300)
    assert isinstance(error, IncrementalMismatch), repr(error)
