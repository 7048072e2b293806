"""Adding a state invariant touches three files: its function in spec/invariants.py, a broken
variant in reference/broken.py, a test.  Everything else reads the registry; this test registers
one more invariant here and watches every reader pick it up."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from kvspec.cli.main import main
from kvspec.reference import ReferenceManager
from kvspec.spec.config import Config
from kvspec.spec.invariants import INVARIANTS, check_world, invariant
from kvspec.spec.state import World
from kvspec.testing import KVCacheMachine, SpecViolation
from kvspec.testing.blockmanager.strategies import configs

TOY = "toy-third-block-idle"
TOY_BLOCK = 2


@pytest.fixture
def toy():
    @invariant(
        TOY,
        "The third block stays idle",
        "none: a registration test of kvspec itself, not a vLLM property",
        applies=lambda c: None if c.num_blocks > TOY_BLOCK else "the pool has no third block",
    )
    def third_block_idle(world: World) -> Iterator[str]:
        """Block 2 of the GPU pool is never in use: a property the reference breaks as soon as
        it hands out three blocks, which makes it a handy probe of the registry."""
        if TOY_BLOCK in world.state.gpu.in_use():
            yield f"block {TOY_BLOCK} is in use"

    try:
        yield INVARIANTS[TOY]
    finally:
        del INVARIANTS[TOY]


def test_the_spec_checks_it_where_it_applies(toy):
    assert toy.kind == "state" and toy.inapplicable(Config(block_size=1, num_blocks=2))
    manager = ReferenceManager(Config(block_size=1, num_blocks=4))
    manager.admit(0, (1, 2, 3), 3)
    world = World(manager.config, manager.observe(), {}, {})
    assert TOY in {v.invariant for v in check_world(world)}


def test_the_machine_finds_it(toy):
    strategy = configs(block_sizes=st.just(1), max_blocks=4)
    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(
            lambda: KVCacheMachine(ReferenceManager, strategy, focus={TOY}),
            settings=settings(settings(), max_examples=100, report_multiple_bugs=False),
        )
    assert {v.invariant for v in caught.value.violations} == {TOY}


def test_the_command_line_explains_checks_and_reports_it(toy, tmp_path, capsys):
    assert main(["explain", TOY]) == 0
    out = capsys.readouterr().out
    assert "The third block stays idle" in out and "spec source" in out.lower()
    code = main(
        ["check", "--impl", "reference", "--invariant", TOY, "--profile", "ci", "--config",
         "block_size=1", "--examples", "50", "--out", str(tmp_path), "--no-verify"]
    )
    out = capsys.readouterr().out
    assert code == 1 and TOY in out and "VIOLATED" in out
    reports = list(tmp_path.rglob("report.json"))  # one per distinct violation
    assert reports and all(TOY in json.dumps(json.loads(p.read_text())) for p in reports)


def test_a_second_registration_under_one_id_is_an_error():
    from kvspec.spec.registry import DuplicateInvariant

    taken = next(iter(INVARIANTS))
    before = INVARIANTS[taken]
    with pytest.raises(DuplicateInvariant, match=taken):

        @invariant(taken, "again", "none: a registration test of kvspec itself")
        def again(world: World) -> Iterator[str]:
            """A second check under a taken ID."""
            yield from ()

    assert INVARIANTS[taken] is before
