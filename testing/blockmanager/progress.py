"""``progress``: the modelled scheduler loop with no new arrivals, run at the end of an example.

One iteration, as vLLM's schedulers order it (FCFS, recompute preemption, the newest request
is the victim: legacy ``_schedule_running`` pops ``running_queue`` from the right, V1
``schedule()`` preempts ``self.running.pop()``):

1. every running request, oldest first, steps by one chunk (a block's worth of tokens when
   the target chunks prefills, else the rest); refused, the newest running request is
   preempted and the step retried, until the victim is the refused request itself.  A request
   that already stepped in this iteration is older, so it is never the victim: V1 FCFS takes
   ``self.running.pop()`` from the part of ``running`` not yet visited (or the request
   itself), V1's priority policy takes ``max(running, key=(priority, arrival_time))``, the
   request itself included (0.33.0 ``vllm/v1/core/sched/scheduler.py:929-980``), and legacy
   ``_schedule_running`` pops ``running_queue``, from which the already scheduled are gone;
2. swapped-out requests are swapped in, oldest first, while that succeeds;
3. waiting requests are re-admitted, oldest first, until one is refused (FCFS).  A request
   refused while no sequence holds a block is dropped when it cannot fit an empty pool
   (vLLM ignores a NEVER request), and is a ``progress`` violation when it could.

A request finishes once it has computed every token it had when the drain began and sampled
one more; it is then freed.  ``spec.admission.progress_bound`` is the iteration budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvspec.spec.admission import (
    ProgressFacts,
    admission_reserve,
    blocks_held_alone,
    may_answer_never,
    progress_bound,
)
from kvspec.spec.interface import Capability
from kvspec.spec.invariants import Violation, normalized, progress
from kvspec.spec.state import Status
from kvspec.spec.window import needed_blocks
from kvspec.testing.blockmanager.completeness import policy_of

if TYPE_CHECKING:
    from kvspec.testing.blockmanager.driver import Driver


def _chunk(driver: Driver, remaining: int) -> int:
    if driver.has(Capability.CHUNKED_PREFILL):
        return max(1, min(remaining, driver.config.block_size))
    return max(1, remaining)


def _alone(driver: Driver, tokens: int, chunk: int, policy) -> int:
    """The most blocks a request of ``tokens`` tokens holds while it runs alone to its end."""
    config = driver.config
    B, W, la = config.block_size, config.sliding_window, driver.lookahead
    first = blocks_held_alone(tokens, chunk, 0, la, W, B, policy)
    last = needed_blocks(max(0, tokens - chunk), tokens + la, W, B)
    return max(first, last)


def _in_use(driver: Driver) -> bool:
    return bool(driver.state.gpu.in_use())


def drain(driver: Driver) -> list[Violation]:
    """Run the loop until every live request finished or the bound is spent; return the
    violations found (``progress``, or any other invariant an operation of the loop broke)."""
    driver.ending = True
    config = driver.config
    goal = {s: len(m.tokens) + 1 for s, m in driver.seqs.items()}
    if not goal:
        return []
    chunk = config.block_size if driver.has(Capability.CHUNKED_PREFILL) else max(goal.values())
    policy = policy_of(driver.impl)
    capacity = len(driver.state.gpu.ids) - admission_reserve(policy, others_running=False)
    for seq in sorted(goal):
        # Out of scope: a request that cannot run to its end even alone in the pool, or whose
        # length at its end (the tokens it has and the one it samples) exceeds what the pool
        # stores: vLLM refuses at startup a max_model_len above N * B (0.6.3
        # worker/worker.py:490-497 ``raise_if_cache_size_invalid``; V1
        # ``check_enough_kv_cache_memory``), so such a request would have hit the length cap.
        if (_alone(driver, goal[seq] - 1, chunk, policy) > capacity
                or goal[seq] > config.num_blocks * config.block_size):
            driver.log(f"progress: seq {seq} cannot finish even alone in the pool; not drained")
            driver.free(seq)
            del goal[seq]
    bound = progress_bound([n - 1 for n in goal.values()], chunk)
    refused_empty: list[tuple[int, int]] = []
    iterations = 0

    def finished(seq: int) -> bool:
        m = driver.seqs.get(seq)
        return m is not None and len(m.tokens) >= goal[seq] and m.num_computed == len(m.tokens) - 1

    def settle(seq: int) -> list[Violation]:
        if finished(seq):
            driver.free(seq)
            del goal[seq]
        return driver.check()

    seen: set[tuple] = set()
    repeated = False
    while goal and iterations < bound:
        # A loop back to a state it was in, with nothing finished since, never ends: stop
        # there (the trace stays short) rather than spending the whole bound.
        snapshot = (
            normalized(driver.state),
            tuple(sorted((s, m.status.value, m.num_computed, len(m.tokens)) for s, m in driver.seqs.items())),
        )
        if snapshot in seen:
            repeated = True
            break
        seen.add(snapshot)
        iterations += 1
        for seq in sorted(s for s in goal if driver.seqs[s].status is Status.RUNNING):
            if driver.seqs.get(seq) is None or driver.seqs[seq].status is not Status.RUNNING:
                continue
            while True:
                m = driver.seqs[seq]
                ok = driver.step(seq, _chunk(driver, len(m.tokens) - m.num_computed))
                found = driver.check()
                if found:
                    return found
                if ok:
                    break
                # The victim is the newest running request, ``seq`` itself when it is the
                # newest: one that already stepped this iteration is never preempted for it.
                victim = max(driver.running())
                driver.preempt(victim)
                found = driver.check()
                if found:
                    return found
                if victim == seq:
                    break
            found = settle(seq)
            if found:
                return found
        for seq in sorted(s for s in goal if driver.seqs[s].status is Status.SWAPPED):
            ok = driver.swap_in(seq)
            found = driver.check()
            if found:
                return found
            if not ok:
                break
        for seq in sorted(s for s in goal if driver.seqs[s].status is Status.WAITING):
            m = driver.seqs[seq]
            empty = not _in_use(driver)
            ok = driver.readmit(seq, _chunk(driver, len(m.tokens)))
            found = driver.check()
            if found:
                return found
            if ok:
                found = settle(seq)
                if found:
                    return found
                continue
            if empty:
                k = _chunk(driver, len(m.tokens))
                held = blocks_held_alone(
                    len(m.tokens), k, 0, driver.lookahead, config.sliding_window,
                    config.block_size, policy,
                )
                reserve = admission_reserve(policy, others_running=False)
                if not may_answer_never(held, reserve, len(driver.state.gpu.ids)):
                    refused_empty.append((seq, held))
                driver.free(seq)  # ignored, as vLLM ignores a request that can never fit
                del goal[seq]
                found = driver.check()
                if found:
                    return found
                continue
            break
    unfinished = tuple(sorted(goal))
    facts = ProgressFacts(
        iterations=iterations,
        bound=bound,
        repeated=repeated,
        num_blocks=len(driver.state.gpu.ids),
        unfinished=unfinished,
        refused_when_empty=tuple(refused_empty),
    )
    found = progress(facts)
    if driver.focus is not None:
        found = [v for v in found if v.invariant in driver.focus]
    return found
