"""The obligation registry: every default obligation has its expected result and every proved
lemma's off-by-one twin is refuted; the command exits non-zero on anything unexpected; an
unknown is never reported as proved."""

from __future__ import annotations

import pytest
import z3
from kvspec.cli.main import cmd_prove
from kvspec.proofs import OBLIGATIONS, run_all
from kvspec.proofs.core import Obligation, Verdict, decide, lemma
from kvspec.spec.invariants import INVARIANTS

FAST = [ob_id for ob_id in OBLIGATIONS if ob_id != "refcount-exact/reference-bmc"]


@pytest.mark.parametrize("ob_id", FAST)
def test_obligation_has_its_expected_result(ob_id: str) -> None:
    (result,) = run_all([ob_id])
    assert result.outcome == result.expected, result.detail
    assert result.twin_ok, f"twin: {result.twin}"
    if result.expected == "proved" and result.twin != "-":
        # A lemma's twin is refuted; a coverage obligation's twin (a branch one off) must
        # have a case -- both show the encoding is not vacuous.
        coverage = ob_id.endswith("/coverage")
        assert result.twin.startswith("refuted") or (
            coverage and "off-by-one twin has a case" in result.twin
        ), result.twin


def test_bmc_proves_the_reference_and_catches_every_seeded_bug() -> None:
    (result,) = run_all(["refcount-exact/reference-bmc"])
    assert result.ok, f"{result.outcome}: {result.detail} / {result.twin}"
    assert "EVERY depth" in result.detail
    assert "seeded bugs caught: 5/5" in result.twin


def test_explain_lists_every_obligation_that_serves_an_invariant(capsys) -> None:
    from kvspec.cli.main import main as kvspec

    for inv_id, inv in INVARIANTS.items():
        assert kvspec(["explain", inv_id]) == 0
        shown = capsys.readouterr().out
        assert inv.applies_when() in shown
        for ob in OBLIGATIONS.values():
            assert (ob.id in shown) == (inv_id in ob.serves), (inv_id, ob.id)
    assert "refcount-exact/reference-bmc" in OBLIGATIONS
    assert "conservation" in OBLIGATIONS["refcount-exact/reference-bmc"].serves


def test_ids_name_spec_invariants_and_state_their_obligation() -> None:
    for ob in OBLIGATIONS.values():
        assert ob.serves and set(ob.serves) <= set(INVARIANTS), f"{ob.id} serves {ob.serves}"
        assert ob.serves[0] == ob.id.split("/", 1)[0], f"{ob.id}: the ID names what it serves first"
        assert ob.statement, f"{ob.id} has no docstring"
        assert ob.expected in ("proved", "counterexample")


def test_unknown_is_never_proved() -> None:
    x, y, z = z3.Ints("x y z")
    hard = [x > 1, y > 1, z > 1]
    fermat = x**3 + y**3 != z**3  # nonlinear: z3 cannot settle it in a millisecond
    d = decide(hard, fermat, {"x": x}, timeout_ms=1)
    assert d.outcome == "unknown"
    v = lemma(hard, fermat, fermat, {"x": x}, "test", timeout_ms=1)
    assert v.outcome == "unknown" and not v.twin_ok


def test_vacuous_hypotheses_fail_the_twin_check() -> None:
    x = z3.Int("x")
    v = lemma([x > 1, x < 0], x == 5, x == 6, {"x": x}, "test")
    assert v.outcome == "proved" and not v.twin_ok  # anything follows from a contradiction


def test_command_exits_nonzero_on_an_unexpected_result(monkeypatch, capsys) -> None:
    def wrong(deep: bool) -> Verdict:
        x = z3.Int("x")
        return lemma([x >= 0], x >= 1, x >= 2, {"x": x}, "x >= 0")

    monkeypatch.setitem(
        OBLIGATIONS,
        "window-bound/zz-false",
        Obligation("window-bound/zz-false", "proved", "false", wrong),
    )
    def main(selection: list[str]) -> int:  # `kvspec prove ID...`
        return cmd_prove(selection, deep=False, list_only=False, json_path=None)

    assert main(["window-bound/zz-false"]) == 1
    out = capsys.readouterr().out
    assert "counterexample" in out and "x=0" in out
    assert main(["window-bound/cover"]) == 0
    assert main(["no-such-obligation"]) == 2
