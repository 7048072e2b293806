"""Cutting a shrunk block-manager counterexample further, by re-running it.

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
2. the pool sizes and the lookahead are lowered, smallest value first;
3. a sequence is deleted with everything forked from it, each of its operations, together with
   the GPU pool lowered one block at a time: a finding that needs a pool filled to a point (F1:
   the last admission must meet exactly the free blocks the capped check counts) keeps only
   when the sequences that filled it go together with the blocks they held.

Each kept candidate's re-run is the new counterexample: its trace is what the target did (it
ends at the operation where the finding showed), so the report, the reproducer and ``kvspec
replay`` read a trace the target really ran.  Bounded by re-runs and seconds; a target that
crashes, hangs or refuses a candidate just does not keep it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError, Unsupported
from kvspec.spec.invariants import Violation
from kvspec.testing.artifacts.rerun import Rerun, rerun
from kvspec.testing.blockmanager.driver import END, TraceStep

if TYPE_CHECKING:
    from kvspec.testing.known import GoPast

MAX_RERUNS = 600  # re-runs one counterexample may cost
SECONDS = 15.0  # wall time one counterexample may cost
# The configuration's sizes the minimizer lowers (pool sizes and the lookahead), each to as
# small a value as keeps the finding; the block size and the window are left as shrunk.
LOWERED = ("num_blocks", "num_cpu_blocks", "max_lookahead")
SMALLEST = {"num_blocks": 1, "num_cpu_blocks": 0, "max_lookahead": 0}
MAX_VALUES_TRIED = 32  # per size: a smallest value is looked for among the lowest ones

Keeps = Callable[[Config, Rerun], bool]
"""Whether a candidate's re-run (on that configuration) shows the same finding."""


@attrs.frozen
class Minimized:
    """A counterexample cut further: its configuration, the trace the target ran, the
    violations its re-run showed, and what it cost."""

    config: Config
    trace: list[TraceStep]
    violations: list[Violation]
    reruns: int
    seconds: float

    def describe(self, before: Sequence[TraceStep], config: Config) -> str:
        changed = [
            f"{name} {getattr(config, name)} -> {getattr(self.config, name)}"
            for name in LOWERED
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
    factory: Callable[[Config], Any],
    config: Config,
    trace: Sequence[TraceStep],
    keeps: Keeps,
    *,
    focus: Iterable[str] | None = None,
    go_past: GoPast | None = None,
    max_reruns: int = MAX_RERUNS,
    seconds: float = SECONDS,
    floors: Mapping[str, int] | None = None,
) -> Minimized | None:
    """``trace`` on ``config`` cut as far as ``keeps`` lets it (module docstring); None when
    nothing could be cut, or when the recorded trace itself does not keep the finding on a
    re-run (the minimizer then claims nothing).  ``floors``: a size (of ``LOWERED``) is never
    lowered below its floor, as the search that found it never drew below it (the user's
    ``--config swap=on``: at least one CPU block)."""
    smallest = {**SMALLEST, **(floors or {})}
    focus = list(focus) if focus is not None else None
    start = time.monotonic()
    reruns = 0

    def attempt(c: Config, steps: Sequence[TraceStep]) -> Rerun | None:
        nonlocal reruns
        if reruns >= max_reruns or time.monotonic() - start > seconds:
            raise _Spent
        reruns += 1
        try:
            result = rerun(factory, c, steps, focus=focus, go_past=go_past)
        except (ConfigError, Unsupported):
            return None
        if result.unapplied is not None or result.crash is not None or not result.violations:
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

    def candidates(c: Config, now: list[TraceStep]) -> Iterator[tuple[Config, list[TraceStep]]]:
        """The moves of the module docstring, in its order: the cheapest cut first."""
        yield from ((c, cut) for cut in _deletions(now))
        yield from ((lowered, now) for lowered in _lowered(c, smallest))
        yield from _sequences_deleted(c, now, smallest["num_blocks"])

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
    return Minimized(kept_config, list(best.trace), list(best.violations), reruns, time.monotonic() - start)


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
    config: Config, steps: Sequence[TraceStep], fewest_blocks: int
) -> Iterator[tuple[Config, list[TraceStep]]]:
    """``steps`` without one sequence (and every sequence forked from it, which its fork made),
    each on ``config`` and on its GPU pool lowered by 1, 2, ... blocks; the sequence the last
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
        for lower in range(max(min(config.num_blocks - fewest_blocks, MAX_VALUES_TRIED) + 1, 1)):
            try:
                yield attrs.evolve(config, num_blocks=config.num_blocks - lower), kept
            except ConfigError:
                continue


def _named(step: TraceStep) -> set[int]:
    """The sequences ``step`` names."""
    return {step.args[key] for key in ("seq", "parent", "child") if key in step.args}


def _lowered(config: Config, smallest: Mapping[str, int]) -> Iterator[Config]:
    """``config`` with one of its sizes (``LOWERED``) lowered, smallest values first."""
    for name in LOWERED:
        now = getattr(config, name)
        low = smallest[name]
        for value in range(low, min(now, low + MAX_VALUES_TRIED)):
            try:
                yield attrs.evolve(config, **{name: value})
            except ConfigError:
                continue


__all__ = ["LOWERED", "MAX_RERUNS", "SECONDS", "Keeps", "Minimized", "minimize"]
