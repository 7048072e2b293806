"""Cutting a shrunk counterexample further, by re-running it (either machine).

Hypothesis shrinks a stateful example as one byte string: the configuration is drawn before the
operations, so a pool of 24 blocks stays 24 when the operations that filled it could only go
together with a smaller pool, and a counterexample can stop at dozens of operations where one
would do (F1: 27 operations on N=24 where ``admit`` of four tokens on N=3 is the whole bug).
Here the recorded trace itself is cut, each candidate re-run on the target
(testing/artifacts/rerun.py ``rerun``, with the search's ``go_past`` policy), and kept only when
``keeps`` accepts what the re-run shows -- the caller's test that it is the same finding (its
known-finding id, else its fingerprint), judged as the search judged it while shrinking:

1. runs of operations are deleted, halves first, then quarters, down to single operations
   (the operations of the example's end, ``END``, are never candidates: the re-run's end makes
   them again);
2. the pool sizes and the lookahead (a scheduler shape: its blocks over vLLM's startup minimum)
   are lowered, smallest value first;
3. a sequence (a request) is deleted with everything forked from it, each of its operations,
   together with the GPU pool lowered one block at a time: a finding that needs a pool filled to a point (F1:
   the last admission must meet exactly the free blocks the capped check counts) keeps only
   when the sequences that filled it go together with the blocks they held.

Each kept candidate's re-run is the new counterexample: its trace is what the target did (it
ends at the operation where the finding showed), so the report, the reproducer and ``kvspec
replay`` read a trace the target really ran.  A target's crash is cut the same way
(``crashes``): a candidate whose re-run crashes is shown to ``keeps`` (the same crash: its
exception and vLLM file:line, or its known finding), and the cut's crash and exception are
the re-run's.  Bounded by re-runs and seconds; a target that
crashes (when the finding is not that crash), hangs or refuses a candidate just does not keep it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from kvspec.spec.errors import ConfigError, Unsupported
from kvspec.spec.invariants import Violation
from kvspec.testing.artifacts.rerun import Rerun, SessionFactory, rerun
from kvspec.testing.blockmanager.driver import END, TraceStep
from kvspec.testing.guard import Crash

if TYPE_CHECKING:
    from kvspec.testing.known import GoPast

MAX_RERUNS = 600  # re-runs one counterexample may cost
SECONDS = 15.0  # wall time one counterexample may cost
MAX_VALUES_TRIED = 32  # per size: a smallest value is looked for among the lowest ones


@attrs.frozen
class Sizes:
    """What the minimizer lowers in one machine's configuration: each field to as small a value
    as keeps the finding (at least its smallest), and which field is the pool a deleted
    sequence's blocks come off.  What a search draws otherwise (block sizes, windows, a shape's
    features) is left as shrunk."""

    smallest: Mapping[str, int]
    pool: str


# The block-manager machine's Config: the pools and the lookahead.
CONFIG_SIZES = Sizes({"num_blocks": 1, "num_cpu_blocks": 0, "max_lookahead": 0}, "num_blocks")
# The scheduler machine's Shape: the blocks over vLLM's startup minimum (below it vLLM refuses
# to start, so that minimum is the floor).
SHAPE_SIZES = Sizes({"extra_blocks": 0}, "extra_blocks")

Keeps = Callable[[Any, Rerun], bool]
"""Whether a candidate's re-run (on that configuration or shape) shows the same finding."""


@attrs.frozen
class Minimized:
    """A counterexample cut further: its configuration (or shape), the trace the target ran,
    the violations (or the crash and its exception) its re-run showed, and what it cost."""

    config: Any
    trace: list[TraceStep]
    violations: list[Violation]
    reruns: int
    seconds: float
    sizes: Sizes = CONFIG_SIZES
    crash: Crash | None = None
    error: BaseException | None = None

    def describe(self, before: Sequence[TraceStep], config: Any) -> str:
        changed = [
            f"{name} {getattr(config, name)} -> {getattr(self.config, name)}"
            for name in self.sizes.smallest
            if getattr(config, name) != getattr(self.config, name)
        ]
        sizes = f", {', '.join(changed)}" if changed else ""
        return (
            f"kvspec's trace minimizer cut hypothesis' {len(before)} operation(s) to {len(self.trace)}{sizes} "
            f"({self.reruns} re-runs, {self.seconds:.1f}s)"
        )


class _Spent(Exception):
    """The re-runs or the seconds are spent: keep what was kept so far."""


def minimize(
    factory: Callable[[Any], Any],
    config: Any,
    trace: Sequence[TraceStep],
    keeps: Keeps,
    *,
    focus: Iterable[str] | None = None,
    go_past: GoPast | None = None,
    max_reruns: int = MAX_RERUNS,
    seconds: float = SECONDS,
    floors: Mapping[str, int] | None = None,
    sizes: Sizes = CONFIG_SIZES,
    session: Callable[[Any, GoPast | None], SessionFactory] | None = None,
    around: Callable[[Callable[[], Rerun]], Rerun] | None = None,
    crashes: bool = False,
) -> Minimized | None:
    """``trace`` on ``config`` cut as far as ``keeps`` lets it (module docstring); None when
    nothing could be cut, or when the recorded trace itself does not keep the finding on a
    re-run (the minimizer then claims nothing).  ``floors``: a size is never lowered below its
    floor, as the search that found it never drew below it (the user's ``--config swap=on``: at
    least one CPU block).  The scheduler machine's verdicts: ``sizes`` ``SHAPE_SIZES``,
    ``session(shape, go_past)`` its re-run session in a shape (testing/scheduler/replay.py
    ``scheduler_session``), and ``around`` what each re-run runs in (``in_context``).
    ``crashes``: the finding is a crash of the target, and only a re-run that crashes is shown
    to ``keeps``; otherwise only one that shows violations is."""
    smallest = {**sizes.smallest, **(floors or {})}
    focus = list(focus) if focus is not None else None
    start = time.monotonic()
    reruns = 0

    def one(c: Any, steps: Sequence[TraceStep]) -> Rerun:
        if session is None:
            return rerun(factory, c, steps, focus=focus, go_past=go_past)
        return rerun(factory, c, steps, focus=focus, go_past=go_past, session=session(c, go_past))

    def attempt(c: Any, steps: Sequence[TraceStep]) -> Rerun | None:
        nonlocal reruns
        if reruns >= max_reruns or time.monotonic() - start > seconds:
            raise _Spent
        reruns += 1
        try:
            result = around(lambda: one(c, steps)) if around is not None else one(c, steps)
        except (ConfigError, Unsupported):
            return None
        if result.unapplied is not None:
            return None
        if (result.crash is not None) != crashes or not (crashes or result.violations):
            return None
        return result if keeps(c, result) else None

    def body(steps: Sequence[TraceStep]) -> list[TraceStep]:
        return [s for s in steps if not s.args.get(END)]

    try:
        best = attempt(config, body(trace))
    except _Spent:
        return None
    if best is None:
        return None
    kept_config, steps = config, body(best.trace)

    def candidates(c: Any, now: list[TraceStep]) -> Iterator[tuple[Any, list[TraceStep]]]:
        """The moves of the module docstring, in its order: the cheapest cut first."""
        yield from ((c, cut) for cut in _deletions(now))
        yield from ((lowered, now) for lowered in _lowered(c, smallest))
        yield from _sequences_deleted(c, now, sizes.pool, smallest[sizes.pool])

    try:
        changed = True
        while changed:
            changed = False
            for candidate_config, candidate in candidates(kept_config, steps):
                found = attempt(candidate_config, candidate)
                if found is not None:
                    best, kept_config, steps, changed = found, candidate_config, body(found.trace), True
                    break
    except _Spent:
        pass
    if len(best.trace) >= len(trace) and kept_config == config:
        return None
    return Minimized(
        kept_config, list(best.trace), list(best.violations), reruns, time.monotonic() - start, sizes,
        best.crash, best.error,
    )


def _deletions(steps: Sequence[TraceStep]) -> Iterator[list[TraceStep]]:
    """``steps`` with one run of operations deleted: the longest runs first (half the trace),
    then shorter, down to single operations; the last operation (where the finding shows) is
    deleted last of all."""
    n = len(steps)
    size = max(n // 2, 1)
    while size >= 1:
        for i in range(0, n, size):
            if i + size >= n and size < n:
                continue  # the run holding the last operation: tried as a single one below
            yield [*steps[:i], *steps[i + size :]]
        size //= 2
    if n > 1:
        yield list(steps[:-1])


def _sequences_deleted(
    config: Any, steps: Sequence[TraceStep], pool: str, fewest_blocks: int
) -> Iterator[tuple[Any, list[TraceStep]]]:
    """``steps`` without one sequence (and every sequence forked from it, which its fork made),
    each on ``config`` and on its GPU pool (the field ``pool``) lowered by 1, 2, ... blocks; the sequence the last
    operation names is never deleted (the finding shows there).  Later-admitted sequences first:
    they are the likeliest fillers."""
    if not steps:
        return
    last = _named(steps[-1])
    for seq in sorted({s for step in steps for s in _named(step)} - last, reverse=True):
        gone = {seq}
        for step in steps:  # forks are recorded in order, so one pass closes over descendants
            if step.op == "fork" and step.args.get("parent") in gone:
                gone.add(step.args["child"])
        if gone & last:
            continue
        kept = [step for step in steps if not _named(step) & gone]
        blocks = getattr(config, pool)
        for lower in range(max(min(blocks - fewest_blocks, MAX_VALUES_TRIED) + 1, 1)):
            try:
                yield attrs.evolve(config, **{pool: blocks - lower}), kept
            except (ConfigError, ValueError):
                continue


def _named(step: TraceStep) -> set[int]:
    """The sequences ``step`` names."""
    return {step.args[key] for key in ("seq", "parent", "child") if key in step.args}


def _lowered(config: Any, smallest: Mapping[str, int]) -> Iterator[Any]:
    """``config`` with one of its sizes (``smallest``'s fields) lowered, smallest values first."""
    for name in smallest:
        now = getattr(config, name)
        low = smallest[name]
        for value in range(low, min(now, low + MAX_VALUES_TRIED)):
            try:
                yield attrs.evolve(config, **{name: value})
            except (ConfigError, ValueError):
                continue


__all__ = ["CONFIG_SIZES", "MAX_RERUNS", "SECONDS", "SHAPE_SIZES", "Keeps", "Minimized", "Sizes", "minimize"]
