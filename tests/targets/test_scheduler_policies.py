"""The scheduling policies declared per release (reference/policies.py), on the release's own
Scheduler: the reference under the release's declared policy plans what vLLM plans, where
another release's policy would not, and the differential run under that other policy reports a
policy difference.  Beside vLLM 0.20.1: the ``scheduler_reserve_full_isl`` gate's cap counts one
batch in flight (kv_cache_interface.py:432-441), not two.  Beside vLLM 0.30.0: a request's first
step reserves the EAGLE lookahead slots (scheduler.py:1134-1137), which 0.12.0's does not."""

from __future__ import annotations

import logging

from kvspec.reference.policies import Comparison, declared_for
from kvspec.spec.groups import Shape
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.scheduler.driver import SchedulerDriver
from kvspec.testing.scheduler.machine import SchedulerLockstep, reference_beside

from .conftest import requires_vllm

# Full attention in blocks of 8 + a W=1 window group of 1-token blocks, async, a budget of 8
# of max_model_len 64, the admission gate on, the pool at vLLM's startup minimum: a 38-token
# prompt behind 15 one-token requests.  0.20.1's cap for the window group is 8 + 1 blocks, the
# 0.33.0 policy's 16 + 1 (two batches in flight under async): only the first admits it.
SHAPE = Shape(
    block_size=8, swa_block_size=1, sliding_window=1, extra_blocks=0, prefix_caching=False,
    num_spec_tokens=0, async_scheduling=True, max_num_batched_tokens=8, max_model_len=64,
    full_sequence_must_fit=True, max_tokens=2,
)
SMALL = 15
LONG = 38
STEPS = 8
# Full attention in blocks of 2, an EAGLE head proposing 2 drafts: a one-token prompt's first
# step holds 2 blocks with its lookahead slots, 1 without.
EAGLE = Shape(
    block_size=2, swa_block_size=2, sliding_window=None, extra_blocks=0, prefix_caching=False,
    num_spec_tokens=2, async_scheduling=False, max_num_batched_tokens=16, max_model_len=16,
    full_sequence_must_fit=False, max_tokens=2, eagle=True,
)


def _run(shape: Shape, policy_release: str, arrivals: list[tuple[list[int], int]]) -> SchedulerLockstep:
    """vLLM's scheduler on ``shape`` beside the reference under ``policy_release``'s policy:
    the arrivals, then steps with every draft rejected, until the first difference."""
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter

    target = VLLMV1SchedulerAdapter(shape)
    policy = declared_for(policy_release)
    assert policy is not None
    reference = reference_beside(target, shape, policy)
    lockstep = SchedulerLockstep(target, reference, Mode.RENAMING, policy=policy, release=target.vllm_version)
    driver = SchedulerDriver.for_shape(lockstep, shape)
    for seq, (tokens, max_tokens) in enumerate(arrivals):
        driver.arrive(seq, tokens, max_tokens)
    zeros = bytes(4)
    for _ in range(STEPS):
        driver.step(zeros, zeros)
        assert not driver.check(), driver.check()
        if lockstep.compare_states() is not None:
            break
    return lockstep


@requires_vllm("0.20.1", "0.20.1", pin="0.20.1")
def test_the_declared_policy_plans_as_vllm_0_20_1_does():
    arrivals = [([0], 1)] * SMALL + [([t % 4 for t in range(LONG)], 2)]
    agreed = _run(SHAPE, "0.20.1", arrivals)
    assert agreed.difference is None and agreed.steps >= 3, (agreed.difference, agreed.steps)
    found = _run(SHAPE, "0.33.0", arrivals).difference
    assert found is not None and found.comparison == Comparison.SCHEDULED, found
    assert SMALL in found.target and SMALL not in found.reference, found
    assert found.policy == "v1-0.33.0" and found.release == "0.20.1", found


@requires_vllm("0.30.0", "0.30.0", pin="0.30.0")
def test_the_declared_policy_plans_as_vllm_0_30_0_does():
    agreed = _run(EAGLE, "0.30.0", [([0], 2)])
    assert agreed.difference is None and agreed.steps >= 2, (agreed.difference, agreed.steps)
    found = _run(EAGLE, "0.12.0", [([0], 2)]).difference
    assert found is not None and found.comparison == Comparison.HELD_BLOCKS, found
    assert (found.seq, found.group, found.target, found.reference) == (0, "full", 2, 1), found


@requires_vllm("0.30.0", "0.30.0", pin="0.30.0")
def test_a_policy_difference_is_reported_in_its_folder_and_replays(monkeypatch, tmp_path, capsys):
    """``kvspec check``'s scheduler search (cli/shapes.py) on 0.30.0's scheduler with the
    reference following 0.12.0's declared policy (no lookahead slots at admission): the
    difference is a verdict of its own (kind ``differential``, exit 1), with a report folder
    whose ``policy_difference`` names both releases' answers, and the report replays to the
    same difference; under 0.30.0's own policy the same trace shows none."""
    import json

    from hypothesis import strategies as st
    from kvspec.cli.common import EXIT_FOUND, EXIT_OK
    from kvspec.cli.failures import replay_verdict
    from kvspec.cli.shapes import run_scheduler_search, scheduler_factory, shapes_exit, write_scheduler_reports
    from kvspec.testing.artifacts.report import trace_from_json
    from kvspec.testing.artifacts.rerun import rerun
    from kvspec.testing.scheduler import machine as scheduler_machine
    from kvspec.testing.scheduler.replay import in_context, scheduler_session

    logging.getLogger("vllm").setLevel(logging.ERROR)
    other = declared_for("0.12.0")
    monkeypatch.setattr(scheduler_machine, "declared_for", lambda _release: other)
    factory = scheduler_factory()
    run = run_scheduler_search(
        factory, profile="ci", examples=20, steps=None, seed=1, focus=None, shape_strategy=st.just(EAGLE)
    )
    differs = [f for f in run.search.found if f.outcome.status == "differs"]
    assert differs, [f.fingerprint for f in run.search.found]
    assert shapes_exit(0, run) == EXIT_FOUND
    entries = write_scheduler_reports(run, tmp_path, 1, lambda: {"target": {}, "command": [], "limits": {}}, "")
    printed = capsys.readouterr().out
    assert "differs from vLLM 0.30.0's declared policy" in printed and "VIOLATED" not in printed
    entry = entries[run.search.found.index(differs[0])]
    assert entry["kind"] == "differential" and entry["fingerprint"]["invariant"] == "differs"
    report = json.loads(open(entry["report"]).read())
    pd = report["policy_difference"]
    assert report["outcome"] == "differs" and report["violations"] == []
    assert (pd["release"], pd["policy"]) == ("0.30.0", other.id), pd
    assert (tmp_path / entry["report"]).parent.joinpath("trace.txt").exists()
    shape, trace = Shape(**report["shape"]), trace_from_json(report["trace"])
    session = scheduler_session(shape, Mode(report["differential_mode"]))
    again = in_context(lambda: rerun(factory, shape, trace, session=session))
    assert again.difference is not None and str(again.difference) == pd["message"], again
    assert replay_verdict(report, trace, again, True) == EXIT_FOUND
    assert "the recorded difference reproduces" in capsys.readouterr().out
    monkeypatch.undo()
    own = in_context(lambda: rerun(factory, shape, trace, session=session))
    assert own.difference is None and not own.violations, own
    assert replay_verdict(report, trace, own, False) == EXIT_OK
