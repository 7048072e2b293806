"""``progress`` for a scheduler-driven target: its own loop with no new arrivals, at the end of
an example.

The target is the scheduler (testing/scheduler/driver.py), so the drain does not play one
(testing/blockmanager/progress.py does, for a block manager): it stops the arrivals and aborts, and steps
the engine with the worker's default outputs (every draft rejected, the smallest progress a
decode step makes) until every request has finished or the bound is spent.  In scope is every
live request that could run alone in the pool under some schedule
(``spec.admission.least_blocks_alone``); one that could not is aborted first, as vLLM's startup
check would refuse a pool too small for it (and it might otherwise hold blocks another needs).

The bound, ``bound_of``: with FCFS and recompute preemption of the newest running request
(0.33.0 vllm/v1/core/sched/scheduler.py:929-980, ``self.running.pop()`` from the part of
``running`` not yet visited), the request at the head of ``running`` is never preempted but by
itself, which it is only when it cannot fit alone; when ``running`` is empty the head of
``waiting`` is admitted, if it fits an empty pool.  So every step either computes at least one
position of the head request (a prefill chunk is at least one token, a decode step samples one
token even with every draft rejected), or admits it.  A request computes at most
``prompt + max_tokens - 1`` positions from the step it becomes the head (from scratch if it was
preempted before: preemptions ahead of that cost nothing), plus one step for its admission and,
under async scheduling, ``async_depth`` steps whose output is still in flight (its last token
already planned, vLLM gives it no step; 0.33.0 scheduler.py:802-816).  Summed over the requests,
with ``async_depth + 1`` more for the outputs in flight when the drain starts.  A synchronous
scheduler beside batches in flight (a pipeline, ``Shape.pipeline_parallel``) plans no step for a
request whose output is in flight (0.33.0 scheduler.py:891-896), so each of its steps may come
``async_depth`` steps after the last: the request's share is multiplied by ``async_depth + 1``.

The bound rests on the head never being preempted while it fits alone: a step that preempts a
request no other request held a block beside (before the step, or by being scheduled in it) is
reported there (``ProgressFacts.preempted_alone``;
it may still finish, recomputing from scratch each time, but no bound on the target's own loop
holds).  A step that plans nothing, preempts nothing, delivers no output (one in flight from
an earlier step carries tokens the observed state need not show), leaves no output in flight
and leaves the observed state as it was, leaves the scheduler where it was: every later step
does the same, so the drain stops there (``ProgressFacts.repeated``) rather than spending the
bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvspec.spec.admission import ProgressFacts, least_blocks_alone
from kvspec.spec.invariants import Violation, progress
from kvspec.testing.scheduler.driver import SEND_DELAYS

if TYPE_CHECKING:
    from kvspec.spec.groups import HybridState
    from kvspec.testing.scheduler.driver import SchedulerDriver

DEFAULT_OUTPUT = bytes(4)  # the step rule's accept and token bytes: no draft accepted, token 0


def least_blocks_of(driver: SchedulerDriver, seq: int) -> int:
    """``least_blocks_alone`` of one live request of the driver's target (one token per step,
    so ``async_depth`` tokens in flight)."""
    length = driver.seqs[seq].prompt_len + driver.max_tokens[seq]
    target = driver.target
    return least_blocks_alone(target.group_specs, length, target.num_lookahead_tokens, driver.async_depth)


def bound_of(driver: SchedulerDriver) -> int:
    """Steps within which every live request finishes (the module's docstring says why).  Under
    a KV connector a finished request's blocks stay held until the worker reports its send
    (at most ``SEND_DELAYS`` updates later): the head may wait that long for the blocks of each
    request finishing before it, and for those of the sends in flight now."""
    depth = driver.async_depth
    # A synchronous scheduler beside batches in flight (a pipeline) gives a request no step
    # while its output is in flight: each of its steps may wait ``depth`` more.
    wait = 1 if driver.placeholders else depth + 1
    steps = sum(
        (driver.seqs[s].prompt_len + driver.max_tokens[s] + 1 + depth) * wait for s in live(driver)
    ) + depth + 1
    if getattr(driver.target, "sends_kv", False):
        steps += (SEND_DELAYS + 1) * (len(live(driver)) + len(driver.sends))
    return steps


def live(driver: SchedulerDriver) -> list[int]:
    """The requests the target has not finished.  The driver's own list may keep one a stale
    output finished after its preemption (async scheduling delivers the tokens of a step
    planned before it, 0.33.0 scheduler.py:1824-1835): the worker saw it preempted, not done."""
    return sorted(s for s in driver.seqs if driver.target.live(s))


def drain(driver: SchedulerDriver, check: Callable[[], list[Violation]]) -> list[Violation]:
    """Step the target with no new arrivals until every request finished or the bound is spent;
    the violations found: those ``check`` (every invariant, after every step) reports, else
    ``progress``'s."""
    driver.ending = True
    num_blocks = len(driver.state.pool.ids)
    for seq in live(driver):
        need = least_blocks_of(driver, seq)
        if need > num_blocks:
            driver.log(f"progress: seq {seq} needs {need} of {num_blocks} blocks even alone; aborted")
            driver.abort(seq)
    found = check()
    if found or not live(driver):
        return found
    bound = bound_of(driver)
    steps = 0
    repeated = False
    alone: list[tuple[int, int]] = []
    while live(driver) and steps < bound and not alone:
        before = driver.state
        holders = _holders(before)
        # An output in flight before the step is delivered by it (async scheduling): tokens the
        # observed state may not show (a token landing in a block already held), so not a repeat.
        delivers = any(p.scheduled for p, _, _ in driver.in_flight)
        plan = driver.step(DEFAULT_OUTPUT, DEFAULT_OUTPUT)
        steps += 1
        found = check()
        if found:
            return found
        # A request scheduled in this step holds blocks during it, though it may have held none
        # before (admitted with nothing to compute yet) and none after (finished in it).
        holders |= {s.seq_id for s in plan.scheduled}
        # (A request the step both preempted and finished is not waiting for anything.)
        alone = [(s, least_blocks_of(driver, s)) for s in plan.preempted if holders <= {s} and s in driver.seqs]
        idle = not plan.scheduled and not plan.preempted
        # A send in flight is reported by a later output, which frees blocks: not a repeat.
        quiet = not delivers and not driver.sends and all(not p.scheduled for p, _, _ in driver.in_flight)
        if idle and driver.state == before and quiet:
            repeated = True
            break
    facts = ProgressFacts(
        iterations=steps,
        bound=bound,
        num_blocks=num_blocks,
        repeated=repeated,
        unfinished=() if alone else tuple(live(driver)),  # stopped at the broken premise
        preempted_alone=tuple(alone),
    )
    return progress(facts)


def _holders(state: HybridState) -> set[int]:
    """The requests holding a block in some group."""
    return {s for g in state.groups for s, t in g.tables.items() if any(b is not None for b in t.slots)}
