"""FINDINGS V1-d: with a sliding window of one token and prefix caching, a V1 prefix hit holds
a cached block the window no longer reads for the admission's step (memory only).

0.12.0 ``SlidingWindowManager.find_longest_cache_hit`` needs ``cdiv(W - 1, B)`` contiguous
cached blocks (single_type_kv_cache_manager.py:394-396) but adds the block it found before
comparing the count (:431-434), so at W=1 (a need of 0) the hit keeps its last block instead
of a null block; ``save_new_computed_blocks`` (:101-118) puts it in the request's table as it
is, and ``allocate_slots`` ran ``remove_skipped_blocks`` with the request's count before the
hit (kv_cache_manager.py:265-267), so the block stays held for the step that computes the
position after the hit.  0.19.1 and 0.20.1 pad the skipped hit blocks with the null block
in ``allocate_new_computed_blocks`` (0.20.1 single_type_kv_cache_manager.py:197-216); 0.30.0 on
publish no block at W=1 at all (``reachable_block_mask``, FINDINGS C2), so that hit no longer
exists.  For W >= 2 the same lookup keeps exactly the blocks the window reads (the controls
below).

Reproduces on 0.10.2 and 0.12.0 (`kvspec bisect --releases 0.10.2..0.33.0` on the first
trace: first fixed 0.19.1); outside that range the reproducing test skips, naming
``kvspec test-targets 0.12.0``, the command that runs it.
"""

from __future__ import annotations

import pytest
from kvspec.adapters.v1 import VLLMV1Adapter
from kvspec.spec.config import Config
from kvspec.testing.blockmanager.driver import Driver

from .conftest import requires_vllm

# (block size B, pool N, first prompt, whether seq 0 is preempted and re-admitted, second
# prompt): the FINDINGS V1 table's trace (preempt, re-admit), the same hit by a second request,
# and the default run's shape (`kvspec check --vllm 0.12.0 --seed 3`: B=2 N=2 W=1, a 2-token
# hit, then position 2).
TRACES = {
    "readmit-b1": (1, 2, [0], True, [0, 0]),
    "second-request-b1": (1, 2, [0], False, [0, 0]),
    "default-run-b2": (2, 2, [0, 0], False, [0, 0, 0]),
}


def _window_one_hit(trace: str) -> tuple[Driver, int, bool]:
    """Runs ``trace`` at W=1 with prefix caching; returns the driver, the sequence whose
    admission looked the prompt up (seq 0 re-admitted, or seq 1) and whether it was admitted."""
    B, N, first, readmit, second = TRACES[trace]
    d = Driver(VLLMV1Adapter(Config(block_size=B, num_blocks=N, sliding_window=1, prefix_caching=True)))
    assert d.admit(0, first, len(first))
    assert not d.check()
    if readmit:
        d.preempt(0)
        assert not d.check()
    seq = 0 if readmit else 1
    return d, seq, d.admit(seq, second, len(second))


def _window_bound(d: Driver) -> list[str]:
    return [v.message for v in d.check() if v.invariant == "window-bound"]


@pytest.mark.parametrize("trace", sorted(TRACES))
@requires_vllm("0.10.2", "0.12.0", pin="0.12.0")
def test_v1d_a_hit_at_window_one_holds_a_block_the_window_does_not_read(trace):
    d, seq, admitted = _window_one_hit(trace)
    _, _, first, _, second = TRACES[trace]
    assert admitted, d.trace[-1]
    hit = len(first)
    assert d.trace[-1].outcome.endswith(f" {hit} cached tokens"), d.trace[-1]
    found = _window_bound(d)
    # The step computes position `hit` alone (W=1): one block; the hit's block is held beside it.
    expected = f"seq {seq} holds 2 blocks but a step over positions {hit}..{len(second) - 1} with window 1"
    assert found and found[0].startswith(expected), "V1-d no longer reproduces: " + repr(found)


@pytest.mark.parametrize("trace", sorted(TRACES))
@requires_vllm("0.19.1", pin="0.33.0")
def test_v1d_control_the_same_trace_holds_from_0_19_1(trace):
    """0.19.1 and 0.20.1 hit the same block and null it (``allocate_new_computed_blocks``); 0.30.0 on
    cache nothing at W=1 (C2), so the prompt misses, and a second request that would then need a
    block more than the pool has free is refused, rightly (no completeness violation).  Either
    way the window is kept; the re-admission, alone in the pool, is admitted on every release."""
    d, _, admitted = _window_one_hit(trace)
    assert admitted or trace != "readmit-b1", d.trace[-1]
    hit = len(TRACES[trace][2])
    outcomes = {"0 cached tokens", f"{hit} cached tokens", "refused: NotAdmitted"}
    assert d.trace[-1].outcome.rsplit(", ", 1)[-1] in outcomes, d.trace[-1]
    assert d.check() == []


@pytest.mark.parametrize(("B", "W"), [(1, 2), (1, 3), (2, 2), (2, 3)])
@requires_vllm("0.10.2", pin="0.12.0")
def test_v1d_control_a_window_of_two_or_more_holds_only_its_blocks(B, W):
    """The lookup keeps exactly ``cdiv(W - 1, B)`` blocks before the position after the hit,
    which is what the window reads: a whole-prompt hit at W >= 2 keeps the window, on 0.12.0
    too, so V1-d needs W=1."""
    prompt = [0] * (3 * B)
    d = Driver(VLLMV1Adapter(Config(block_size=B, num_blocks=8, sliding_window=W, prefix_caching=True)))
    assert d.admit(0, prompt, len(prompt))
    assert d.admit(1, [*prompt, 0], len(prompt) + 1)
    assert d.trace[-1].outcome.endswith(f" {len(prompt)} cached tokens"), d.trace[-1]
    assert _window_bound(d) == []
