"""The scheduler differential (testing/scheduler/machine.py ``SchedulerLockstep``): the
reference scheduler agrees with itself in the strictest mode in every production shape; a
broken scheduler that every invariant accepts (reference/broken_scheduler.py
``DIFFERENTIAL_ONLY``) passes the invariants and fails the differential, with a shrunk trace,
as a policy difference and never as an invariant violation; the declared policies
(reference/policies.py) are consistent, and a release without one gets no differential."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.reference.broken_scheduler import DIFFERENTIAL_ONLY, MAMBA_CACHE_ONLY, PREFIX_CACHE_ONLY
from kvspec.reference.policies import (
    DECLARED,
    REFERENCE_OWN,
    Choice,
    Comparison,
    Omission,
    PolicyTableError,
    declared_for,
    validate,
)
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.groups import Shape
from kvspec.spec.invariants import INVARIANTS
from kvspec.testing import SpecViolation
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.scheduler.machine import DiffCounts, PolicyDifference, SchedulerMachine, shapes

EXAMPLES = 100


def _settings(n: int = EXAMPLES):
    return settings(settings(), max_examples=n, report_multiple_bugs=False, deadline=None)


def test_reference_scheduler_agrees_with_itself_in_renaming_mode():
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(ReferenceScheduler, differential=Mode.RENAMING, diff_counts=counts),
        settings=_settings(2 * EXAMPLES),
    )
    assert counts.examples >= EXAMPLES and counts.steps >= 10 * EXAMPLES, counts
    assert not counts.allowed and not counts.ended, counts
    assert counts.policy == REFERENCE_OWN and counts.undeclared is None, counts


def _caching(shape: Shape) -> bool:
    # Mamba shapes with hits inside a block cache nothing in the reference (it keeps no partial
    # tails); those with hits at block ends cache their states (``mamba_state_cache``).
    return shape.prefix_caching and not shape.mamba_partial_hits


def _mamba_states(shape: Shape) -> bool:
    return shape.mamba_cache_mode == "align" and not shape.mamba_partial_hits


def test_comparison_runs_past_prefix_hits_to_the_end():
    """With prefix caching, the reference beside itself compares every example to its end,
    the examples whose admissions start at a prefix hit included: no comparison stops at a hit."""
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(
            ReferenceScheduler, shapes().filter(_caching), differential=Mode.RENAMING, diff_counts=counts
        ),
        settings=_settings(),
    )
    assert counts.hit_examples > 0, counts
    assert counts.hit_examples_to_end == counts.hit_examples, counts
    assert counts.to_end == counts.examples and not counts.ended, counts


@pytest.mark.parametrize("name", sorted(PREFIX_CACHE_ONLY))
def test_a_prefix_cache_only_the_differential_past_hits_catches(name):
    """A broken prefix cache every invariant accepts (``evicts-newest-first``): the invariants
    hold in every caching shape; the differential, comparing past prefix hits, reports a policy
    difference (not a violation) with a short trace."""
    variant = PREFIX_CACHE_ONLY[name]
    run_state_machine_as_test(lambda: SchedulerMachine(variant, shapes().filter(_caching)), settings=_settings())
    with pytest.raises(PolicyDifference) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(variant, shapes().filter(_caching), differential=Mode.RENAMING),
            settings=_settings(),
        )
    found = caught.value
    assert not isinstance(found, SpecViolation | AssertionError), found
    assert found.release == variant.name and found.policy == REFERENCE_OWN.id, found
    assert any(s.op == "arrive" for s in found.trace) and len(found.trace) <= 24, found


@pytest.mark.parametrize("name", sorted(MAMBA_CACHE_ONLY))
def test_a_mamba_cache_only_the_differential_past_mamba_hits_catches(name):
    """A broken Mamba prefix cache every invariant accepts (``mamba-hit-as-a-run``): the
    invariants hold in every Mamba "align" shape whose hits end at block ends; the differential,
    comparing past Mamba hits, reports a policy difference (not a violation) with a short trace."""
    variant = MAMBA_CACHE_ONLY[name]
    within = shapes().filter(_mamba_states)
    run_state_machine_as_test(lambda: SchedulerMachine(variant, within), settings=_settings())
    with pytest.raises(PolicyDifference) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(variant, within, differential=Mode.RENAMING), settings=_settings()
        )
    found = caught.value
    assert not isinstance(found, SpecViolation | AssertionError), found
    assert found.release == variant.name and found.policy == REFERENCE_OWN.id, found
    assert sum(s.op == "arrive" for s in found.trace) >= 2 and len(found.trace) <= 24, found


NEEDS_A_SEND_BESIDE_OTHERS = frozenset({"holds-the-whole-table-for-the-send"})


@pytest.mark.parametrize("name", sorted(DIFFERENTIAL_ONLY))
def test_invariants_accept_what_the_differential_rejects(name):
    """Caught only as a difference from the reference's policy: a ``PolicyDifference`` (not a
    ``SpecViolation``, not an invariant ID), in what the variant breaks, with a short trace.
    The invariants accept it wherever the pool has a block to spare; at vLLM's startup minimum
    ``progress`` also catches ``over-reserve`` (a request that needs the whole pool never fits
    beside the extra block it reserves), so the invariants-only run leaves that edge out."""
    variant, comparison = DIFFERENTIAL_ONLY[name]
    spare = shapes().filter(lambda shape: shape.extra_blocks > 0)
    run_state_machine_as_test(lambda: SchedulerMachine(variant, shape_strategy=spare), settings=_settings())
    if name in NEEDS_A_SEND_BESIDE_OTHERS:
        # Twice the examples: the variant needs a finished request's send beside other requests,
        # which an example of rule lone-requests (one request only) never has.
        with pytest.raises(PolicyDifference) as sent:
            run_state_machine_as_test(
                lambda: SchedulerMachine(variant, differential=Mode.RENAMING), settings=_settings(2 * EXAMPLES)
            )
        _a_short_difference(sent.value, name, variant, comparison)
        return
    with pytest.raises(PolicyDifference) as caught:
        run_state_machine_as_test(
            lambda: SchedulerMachine(variant, differential=Mode.RENAMING), settings=_settings()
        )
    _a_short_difference(caught.value, name, variant, comparison)


def _a_short_difference(found: PolicyDifference, name: str, variant: type, comparison: Comparison) -> None:
    assert not isinstance(found, SpecViolation | AssertionError), found
    # The block over-reserve holds too many shows in the held count, or, where the pool has no
    # block to spare for it, as a request the step leaves out.
    also = {Comparison.SCHEDULED} if name == "over-reserve" else set()
    assert found.comparison in {comparison, *also} and found.policy == REFERENCE_OWN.id, found
    assert found.release == variant.name, found
    # Short: the request(s) and the step that differs, after at most a few idle steps the
    # shrinker leaves in front (their number moves with the shape draws).
    busy = [t for t in found.trace if not (t.op == "step" and t.outcome.startswith("scheduled {}, preempted []"))]
    assert 0 < len(found.trace) <= 8 and len(busy) <= 4, found
    text = str(found)
    assert text.startswith("differs from the reference scheduler's declared policy"), text
    assert "violat" not in text.lower() and not any(i in text for i in INVARIANTS), text


def test_declared_policies_cite_their_source_and_do_not_overlap():
    """Every choice names a vLLM file:line; every entry a range of releases, first <= last;
    no release is covered twice; every omission says why.  The table is validated when it is
    loaded, and each defect of a table is refused."""
    assert validate(DECLARED) == DECLARED
    assert REFERENCE_OWN.id not in {p.id for p in DECLARED}
    for p in DECLARED:
        assert all(isinstance(c.value, bool) for c in p.choices().values()), p
        assert declared_for(p.first) == p and declared_for(p.last) == p
    one = DECLARED[0]
    broken = {
        "overlap": (one, attrs.evolve(one, id="again")),
        "twice": (one, attrs.evolve(DECLARED[1], id=one.id)),
        "backwards": (attrs.evolve(one, first="0.13.0", last="0.12.0"),),
        "no source": (attrs.evolve(one, pad_admissions=Choice(False, "scheduler.py")),),
        "no reason": (attrs.evolve(one, not_compared=(Omission(Comparison.SHARED_SLOTS, ""),)),),
    }
    for name, table in broken.items():
        with pytest.raises(PolicyTableError):
            validate(table)
            pytest.fail(name)


def test_the_differential_compares_only_what_the_policy_declares(monkeypatch):
    """``over-reserve`` holds a block more than the reference (and so may schedule less in
    a small pool): under a policy that compares only shared slots, no verdict; the examples
    where an undeclared comparison differs end their comparison and say which, and the summary
    names what was not compared."""
    import kvspec.testing.scheduler.machine as machine
    from kvspec.cli.shapes import not_compared_lines

    variant, comparison = DIFFERENTIAL_ONLY["over-reserve"]
    assert comparison == Comparison.HELD_BLOCKS
    left_out = tuple(Omission(c, "not read") for c in Comparison if c != Comparison.SHARED_SLOTS)
    narrow = attrs.evolve(REFERENCE_OWN, not_compared=left_out)
    monkeypatch.setattr(machine, "policy_beside", lambda target: narrow)
    counts = DiffCounts()
    spare = shapes().filter(lambda shape: shape.extra_blocks > 0)  # at the minimum progress catches it
    run_state_machine_as_test(
        lambda: SchedulerMachine(variant, differential=Mode.RENAMING, diff_counts=counts, shape_strategy=spare),
        settings=_settings(30),
    )
    assert counts.ended[f"{Comparison.HELD_BLOCKS.value} not declared"] > 0, counts
    assert all(why.endswith("not declared") for why in counts.ended), counts
    lines = not_compared_lines(counts)
    assert f"not compared: {Comparison.HELD_BLOCKS.value} (not read)" in lines, lines


def test_a_release_without_a_declared_policy_gets_no_differential(monkeypatch):
    """A target of an undeclared release runs without the reference beside it: even a
    scheduler that differs from every policy (``serial-admission``) gets no verdict, and the
    counts say the differential did not run and for which release."""
    import kvspec.testing.scheduler.machine as machine

    variant, _ = DIFFERENTIAL_ONLY["serial-admission"]

    class Undeclared(variant):
        vllm_version = "0.0.1"

    assert declared_for("0.0.1") is None
    # Not the reference to the machine: it is looked up as the vLLM release it names.
    monkeypatch.setattr(machine, "ReferenceScheduler", type("NotTheReference", (), {}))
    counts = DiffCounts()
    run_state_machine_as_test(
        lambda: SchedulerMachine(Undeclared, differential=Mode.RENAMING, diff_counts=counts),
        settings=_settings(30),
    )
    assert counts.undeclared == "0.0.1" and counts.examples == 0 and counts.steps == 0, counts

    from kvspec.cli.shapes import differential_line

    line = differential_line(counts)
    assert line.startswith("differential not run: no declared scheduler policy for vLLM 0.0.1"), line
    assert "declared: 0.12.0" in line, line


def test_check_summary_counts_comparisons_and_reports_the_differential():
    """``kvspec check``'s shapes run compares every example with the reference scheduler and
    says how much it compared; a scheduler only the differential catches ends it as a policy
    difference (its own status, exit code and JSON field; no invariant violated)."""
    from kvspec.cli.common import EXIT_FOUND
    from kvspec.cli.shapes import differential_line, run_shapes, shapes_json, status_exit

    held = run_shapes(ReferenceScheduler, profile="ci", examples=20, steps=None, seed=None, focus=None)
    assert held.status == "holds", held
    d = held.differential
    assert d.examples >= 20 and d.steps > 0 and d.states > 0, d
    assert f"{d.steps} steps and {d.states} states compared" in differential_line(d)
    assert "divergences allowed: none" in differential_line(d)

    variant, comparison = DIFFERENTIAL_ONLY["serial-admission"]
    found = run_shapes(variant, profile="ci", examples=EXAMPLES, steps=None, seed=None, focus=None)
    assert found.status == "differs" and not found.violations, found
    assert found.difference is not None and found.difference.comparison == comparison
    assert found.trace and found.trace == found.difference.trace
    assert status_exit(found.status) == EXIT_FOUND
    j = shapes_json(found)
    assert j["policy_difference"]["compared"] == comparison.value, j
    assert j["status"] == "differs", j


def test_lookahead_slots_stop_at_max_model_len():
    """A decode step near max_model_len reserves no slot past it, lookahead included, as vLLM
    caps the tokens needing a slot: in a pool of exactly ``max_model_len`` positions, a
    10-token prompt's step of one token and three drafts, with three EAGLE lookahead slots,
    runs without preempting (vLLM 0.12.0 --seed 3 planned it; the reference once preempted)."""
    shape = Shape(
        block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=0, prefix_caching=False,
        num_spec_tokens=3, async_scheduling=False, max_num_batched_tokens=16, max_model_len=16,
        full_sequence_must_fit=False, max_tokens=2, eagle=True,
    )
    ref = ReferenceScheduler(shape, policy=declared_for("0.12.0"))
    assert ref.num_blocks == 8 and ref.num_lookahead_tokens == 3
    ref.add(0, [0] * 10, 2)
    first = ref.schedule()
    assert [(s.start, s.num_tokens) for s in first.scheduled] == [(0, 10)]
    ref.update(first, {0: [0]}, {0: [0, 0, 0]})
    second = ref.schedule()
    assert [(s.start, s.num_tokens) for s in second.scheduled] == [(10, 4)] and not second.preempted, second
    assert len(ref.reqs[0].tables[0]) == 8


def test_drafts_are_cut_at_max_model_len():
    """A decode step's drafts stop before max_model_len - 1, as vLLM cuts them: an 8-token
    prompt whose three drafts are accepted reaches position 12 of 16, where one token and two
    drafts fit (vLLM 0.12.0 --seed 3 planned (12, 3, 2); the reference once planned (12, 4, 3))."""
    shape = Shape(
        block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=0, prefix_caching=False,
        num_spec_tokens=3, async_scheduling=False, max_num_batched_tokens=16, max_model_len=16,
        full_sequence_must_fit=False, max_tokens=3, eagle=True,
    )
    ref = ReferenceScheduler(shape, policy=declared_for("0.12.0"))
    ref.add(0, [0] * 8, 8)
    plans = []
    for sampled in ([0], [0] * 4, [0]):
        plan = ref.schedule()
        plans.append([(s.start, s.num_tokens, s.drafts) for s in plan.scheduled])
        ref.update(plan, {0: sampled}, {0: [0, 0, 0]})
    assert plans == [[(0, 8, 0)], [(8, 4, 3)], [(12, 3, 2)]], plans


def _mamba_chunks(prompt: int, unit: int | None = None, policy: str = "0.33.0", budget: int = 10) -> list[int]:
    """The prefill chunks the reference cuts for one ``prompt``-token request in a Mamba
    "align" shape of blocks of 4 (hits inside a block at ``unit``)."""
    shape = Shape(
        block_size=4, swa_block_size=4, sliding_window=None, extra_blocks=2, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=budget, max_model_len=32,
        full_sequence_must_fit=False, max_tokens=1, mamba=True, prefix_match_unit=unit,
    )
    policy_of = declared_for(policy)
    assert policy_of is not None
    ref = ReferenceScheduler(shape, policy=policy_of)
    ref.add(0, list(range(prompt)), 1)
    chunks = []
    while ref.live(0):
        plan = ref.schedule()
        chunks += [s.num_tokens for s in plan.scheduled]
        done = ref.reqs[0].computed >= prompt
        ref.update(plan, {0: [0]} if done else {})
    return chunks


def test_mamba_align_chunks_end_at_block_ends():
    """0.33.0's split (``mamba_aligned_split``): a chunk cut by the budget of 10 ends at the
    block end 8; the last chunk stops at the last block end before the prompt's last token (12
    of 14), and the rest is its own chunk.  Hits inside a block (unit 2): a 15-token prompt also
    stops at its last unit boundary before its last token (14).  0.30.0 declares no such rule
    (its split differs), and a shape without prefix caching is cut by the budget alone."""
    assert _mamba_chunks(14) == [8, 4, 2]
    assert _mamba_chunks(15, unit=2) == [8, 4, 2, 1]
    assert _mamba_chunks(14, policy="0.30.0") == [10, 4]
    # A budget smaller than a block's remainder: the chunk stops at the next block end.
    assert _mamba_chunks(14, budget=6) == [4, 4, 4, 2]


def test_a_waiting_request_whose_split_fits_no_block_end_is_not_admitted():
    """A Mamba "align" split to 0 tokens (the budget's remainder holds no block end) stops the
    admissions of the step, as vLLM 0.33.0 breaks there (scheduler.py:1350-1358)."""
    shape = Shape(
        block_size=4, swa_block_size=4, sliding_window=None, extra_blocks=4, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=7, max_model_len=32,
        full_sequence_must_fit=False, max_tokens=1, mamba=True,
    )
    ref = ReferenceScheduler(shape)
    ref.add(0, list(range(4)), 1)
    ref.add(1, list(range(100, 110)), 1)
    plan = ref.schedule()
    # Request 0 takes 4 tokens; 3 are left, and request 1's chunk would end inside a block.
    assert [(s.seq_id, s.num_tokens) for s in plan.scheduled] == [(0, 4)], plan
    assert ref.waiting == [1] and ref.running == [0]


def test_mamba_align_comparison_ends_where_the_targets_cache_may_hit():
    """Beside a target that caches Mamba states (vLLM), a Mamba "align" comparison with hits
    inside a block (whose cache the reference does not model) ends before a step in which a
    waiting request's tokens begin with a key the target caches (its domain included), and
    after a step that cached a key beginning the tokens of a waiting request and of another
    (the same-step Mamba hit vLLM defers), or a partial tail.  With hits at block ends the
    reference caches Mamba states itself (``mamba_state_cache``): nothing ends there."""
    from types import SimpleNamespace

    from kvspec.spec.prefix_hash import ExtraKeys, PrefixKey
    from kvspec.testing.scheduler.machine import SchedulerLockstep

    shape = Shape(
        block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=2, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=8, max_model_len=16,
        full_sequence_must_fit=False, max_tokens=1, mamba=True, prefix_match_unit=1,
    )
    target = SimpleNamespace(name="cache-holder", config=SimpleNamespace(prefix_caching=True), keys=frozenset())
    target.cached_keys = lambda group: target.keys
    modelled = ReferenceScheduler(attrs.evolve(shape, prefix_match_unit=None))
    assert modelled.caches_mamba_states and modelled.cache is not None
    modelled.add(0, [1, 2, 3, 4], 1)
    target.keys = frozenset({PrefixKey((1, 2))})
    assert not SchedulerLockstep(target, modelled)._mamba_cache_may_hit()
    target.keys = frozenset()
    ref = ReferenceScheduler(shape)
    assert not ref.caches_mamba_states and ref.cache is None
    lockstep = SchedulerLockstep(target, ref)
    ref.add(0, [1, 2, 3, 4], 1)
    assert not lockstep._mamba_cache_may_hit()
    target.keys = frozenset({PrefixKey((1, 3))})
    assert not lockstep._mamba_cache_may_hit()
    target.keys = frozenset({PrefixKey((1, 2), ExtraKeys(lora="a").for_chain(2))})
    assert not lockstep._mamba_cache_may_hit()
    # A lookup stops before the request's last token.
    target.keys = frozenset({PrefixKey((1, 2, 3, 4))})
    assert not lockstep._mamba_cache_may_hit()
    target.keys = frozenset({PrefixKey((1, 2))})
    assert lockstep._mamba_cache_may_hit()
    # Cached in the step: only its own producer begins with it, then a second request too.
    assert not lockstep._mamba_cache_may_hit(before=frozenset())
    ref.add(1, [1, 2, 5], 1)
    assert lockstep._mamba_cache_may_hit(before=frozenset())
    assert not lockstep._mamba_cache_may_hit(before=target.keys)
    # A key cached in the step ending inside a block (of 2): a partial tail, whose producer
    # takes a copy-on-write block next.
    assert not lockstep._partial_tail_cached(before=frozenset())
    target.keys = frozenset({PrefixKey((1, 2, 3))})
    assert lockstep._partial_tail_cached(before=frozenset())
    assert not lockstep._partial_tail_cached(before=target.keys)
    # Beside the reference itself (no Mamba states kept on either side) nothing ends.
    assert not SchedulerLockstep(ReferenceScheduler(shape), ref)._mamba_cache_may_hit()


def _mamba_cache_shape(**changes) -> Shape:
    shape = Shape(
        block_size=4, swa_block_size=4, sliding_window=None, extra_blocks=8, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=8, max_model_len=64,
        full_sequence_must_fit=False, max_tokens=1, mamba=True,
    )
    return attrs.evolve(shape, **changes)


def _run(ref: ReferenceScheduler, steps: int = 20) -> list[list[tuple[int, int, int]]]:
    """Steps until every request finishes: each step's (request, start, tokens)."""
    out = []
    for _ in range(steps):
        if not ref.reqs:
            break
        plan = ref.schedule()
        out.append([(s.seq_id, s.start, s.num_tokens) for s in plan.scheduled])
        done = {s.seq_id: [0] for s in plan.scheduled if ref.reqs[s.seq_id].computed >= len(ref.reqs[s.seq_id].tokens)}
        ref.update(plan, done)
    return out


def test_a_mamba_hit_is_the_last_cached_state_at_or_below_the_full_hit():
    """0.33.0's Mamba "align" cache (``mamba_state_cache``): an 18-token prompt in chunks of 8
    leaves states at 8 and 16 (none at 4 or 12, inside a chunk).  A request sharing 12 tokens
    has a full-attention hit of 12 and a Mamba hit of 8 (the last cached state below 12), so
    it starts at 8 with the full table cut to two blocks and the Mamba table [None, state];
    its first chunk stops at the junction 12, where it leaves the state the next sibling hits.
    Searched as a run from block 0 (``mamba-hit-as-a-run``) the hit is 0: no state at 4."""
    ref = ReferenceScheduler(_mamba_cache_shape())
    ref.add(0, list(range(18)), 1)
    assert _run(ref)[:3] == [[(0, 0, 8)], [(0, 8, 8)], [(0, 16, 2)]]
    states = {key.chain[-1] + 1 for key, _ in ref.cache.entries(1)}
    assert states == {8, 16}, states
    ref.add(1, list(range(12)) + [90] * 8, 1)
    plan = ref.schedule()
    assert [(s.seq_id, s.start, s.num_tokens) for s in plan.scheduled] == [(1, 8, 4)], plan
    full, mamba = ref.reqs[1].tables
    state_at_8 = next(block for key, block in ref.cache.entries(1) if len(key.chain) == 8)
    assert len(full) == 3 and mamba[:2] == [None, state_at_8], ref.reqs[1].tables
    assert ref.reqs[1].junction == 12
    run = MAMBA_CACHE_ONLY["mamba-hit-as-a-run"](_mamba_cache_shape())
    run.add(0, list(range(18)), 1)
    _run(run)
    run.add(1, list(range(12)) + [90] * 8, 1)
    assert [(s.start, s.num_tokens) for s in run.schedule().scheduled] == [(0, 8)]


def test_a_mamba_state_cached_in_the_step_is_hit_a_step_later():
    """Two requests sharing a 16-token prefix: when the first's chunk caches the state at 8 in
    a step, the second (waiting behind it) is not admitted in that step at a hit on it (vLLM
    0.33.0 defers it, single_type_kv_cache_manager.py:1704-1712), and starts at it a step
    later."""
    ref = ReferenceScheduler(_mamba_cache_shape(max_num_batched_tokens=16))
    ref.add(0, list(range(17)), 1)
    first = ref.schedule()
    assert [(s.seq_id, s.start, s.num_tokens) for s in first.scheduled] == [(0, 0, 16)]
    ref.update(first, {})
    ref.add(1, [*range(16), 70, 71], 1)
    ref.add(2, list(range(8)) + [80] * 9, 1)
    # Request 0's last chunk caches nothing new; request 1 hits the state at 16 cached a step
    # ago; request 2 finds none (no state at 8, inside the first chunk).
    plan = ref.schedule()
    assert [(s.seq_id, s.start) for s in plan.scheduled] == [(0, 16), (1, 16), (2, 0)], plan
    ref2 = ReferenceScheduler(_mamba_cache_shape(max_num_batched_tokens=16))
    ref2.add(0, list(range(9)), 1)
    ref2.add(1, list(range(8)) + [60] * 4, 1)
    # One step: request 0 computes 8 (caching the state at 8) and its last token is cut off;
    # request 1 would hit that state in the same step: it is not admitted.
    plan = ref2.schedule()
    assert [(s.seq_id, s.start, s.num_tokens) for s in plan.scheduled] == [(0, 0, 8)], plan
    ref2.update(plan, {})
    plan = ref2.schedule()
    assert [(s.seq_id, s.start) for s in plan.scheduled] == [(0, 8), (1, 8)], plan


def test_sparse_mamba_retention_keeps_interval_and_reachable_states():
    """``sparse_state_mask`` (0.33.0 ``MambaManager.reachable_block_mask``): dense keeps every
    state; 0 only the blocks ending on the boundaries (aligned down); an interval of two
    blocks the blocks ending each multiple of 8 tokens, and the boundaries."""
    from kvspec.reference.prefix_cache import sparse_state_mask, state_hit

    assert sparse_state_mask(0, 4, 4, 4, None) == [True] * 4
    assert sparse_state_mask(0, 5, 4, 4, 0, (13,)) == [False, False, True, False, False]
    assert sparse_state_mask(1, 5, 4, 4, 8, (13,)) == [True, True, True, False]
    assert sparse_state_mask(0, 3, 4, 4, 4, ()) == [True] * 3
    cached = {1: 11, 3: 13}
    assert state_hit(cached.get, 5, 4, 4) == [None, None, None, 13]
    assert state_hit(cached.get, 3, 4, 4) == [None, 11]
    assert state_hit(cached.get, 3, 4, 8) == [None, 11]
    assert state_hit({2: 12}.get, 3, 4, 8) == []
