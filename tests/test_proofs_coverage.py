"""Solver-generated coverage (proofs/coverage.py): every branch of the window and admission
arithmetic is taken both ways by a concrete case, and each case replays on the reference with
the numbers the spec predicts."""

from __future__ import annotations

import pytest
from kvspec.proofs import coverage
from kvspec.reference.manager import ReferenceManager
from kvspec.spec.config import Config
from kvspec.spec.interface import Admission

CASES = coverage.coverage_cases()
# Provably dead: first_needed_block(hit) <= hit // B always, so new_blocks_for_step's max()
# never picks the window side (kvspec.proofs.window proves the general monotonicity).
KNOWN_DEAD = {("max() picks first_needed_block over the hit", True)}


def test_every_branch_is_taken_both_ways() -> None:
    sides = {(c["branch"], c["value"]) for c in CASES if not c.get(coverage.UNREACHABLE)}
    dead = {(c["branch"], c["value"]) for c in CASES if c.get(coverage.UNREACHABLE)}
    assert all(c.get(coverage.UNREACHABLE) in (None, "unsat") for c in CASES), (
        "z3 gave up on a branch"
    )
    assert dead == KNOWN_DEAD
    for br in coverage.BRANCHES:
        for value in (True, False):
            assert (br.name, value) in sides | dead, f"no case for {br.name}={value}"


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if not c.get(coverage.UNREACHABLE)],
    ids=lambda c: f"{c['branch']}={c['value']}",
)
def test_case_takes_its_branch_and_replays_on_the_reference(case) -> None:
    assert coverage.takes_branch(case)
    B = case["block_size"]
    mgr = ReferenceManager(
        Config(
            block_size=B,
            num_blocks=case["num_blocks"],
            sliding_window=case["window"],
            prefix_caching=True,
        )
    )
    if case["filler_blocks"]:
        filler = [7] * (case["filler_blocks"] * B)
        assert mgr.can_admit(100, filler, len(filler)) is Admission.OK
        mgr.admit(100, filler, len(filler))
        mgr.commit(100, len(filler))
    prompt = coverage.prompt_tokens(case)
    hit = case["hit_tokens"]
    if hit:
        donor = [*prompt[:hit], 7]
        assert mgr.can_admit(101, donor, len(donor)) is Admission.OK
        mgr.admit(101, donor, len(donor))
        mgr.commit(101, len(donor))
        if case["hits_evictable"]:
            mgr.free(101)
    exp = case["expected"]
    pool = mgr.observe().gpu
    assert (len(pool.free), len(pool.evictable)) == (exp["free"], exp["evictable"])
    answer = mgr.can_admit(1, prompt, case["num_new_tokens"])
    assert answer is Admission(exp["admission"])
    if answer is Admission.OK:
        assert mgr.admit(1, prompt, case["num_new_tokens"]) == hit
        after = mgr.observe()
        assert len(after.tables[1].held()) == exp["needed_blocks"]
        taken = exp["free"] + exp["evictable"] - len(after.gpu.free) - len(after.gpu.evictable)
        assert taken == exp["new_blocks"] + (exp["kept_hits"] if case["hits_evictable"] else 0)
