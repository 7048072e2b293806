"""``kvspec check`` on a V1 release: vLLM's own scheduler in the shapes production runs.

After the block-manager search, ``kvspec check`` on a V1 target runs the scheduler machine
(testing/scheduler_machine.py) over vLLM's own ``Scheduler``/``AsyncScheduler``
(adapters/v1_scheduler.py): hybrid KV-cache groups, async scheduling, speculative decoding,
token-budget chunking, ``full_sequence_must_fit`` on and off, pools at vLLM's startup
minimum.  The summary gives the examples and operations run in each shape, and names a shape
no example reached.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import attrs
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis.errors import FailedHealthCheck, Unsatisfiable
from hypothesis.reporting import with_reporter
from hypothesis.stateful import get_state_machine_test
from kvspec.reference.policies import Comparison, declared_spans
from kvspec.spec.errors import ConfigError
from kvspec.spec.groups import SHAPE_TAGS, Shape
from kvspec.spec.invariants import Violation
from kvspec.testing.differential import Mode
from kvspec.testing.driver import SpecViolation, TraceStep
from kvspec.testing.known import Fingerprint, KnownFinding, which_known
from kvspec.testing.scheduler_driver import ShapeCounts
from kvspec.testing.scheduler_machine import DiffCounts, PolicyDifference, SchedulerMachine
from rich.markup import escape

from .budget import BudgetSpent, Part, budget_examples
from .common import out

# The scheduler machine's share of a profile: each example builds vLLM's scheduler (a few
# tens of milliseconds once imported), and runs fewer, longer-lived steps than the
# block-manager machine.
EXAMPLES_SHARE = 1  # as many examples as the block-manager search


@attrs.define
class ShapesOutcome:
    status: str  # holds | violated | differs | error | no-examples
    counts: ShapeCounts
    examples: int = 0
    operations: int = 0
    seconds: float = 0.0
    violations: list[Violation] = attrs.Factory(list)
    trace: list[TraceStep] = attrs.Factory(list)
    shape: Shape | None = None
    error: str | None = None
    rejected: list[str] = attrs.Factory(list)
    # The reference scheduler in lockstep (testing/scheduler_machine.py SchedulerLockstep).
    differential: DiffCounts = attrs.Factory(DiffCounts)
    known: KnownFinding | None = None  # the known finding (testing/known_findings.toml) it is
    # status "differs": the target differs from its release's declared scheduling policy.
    difference: PolicyDifference | None = None


# The scheduler differential's mode in kvspec check: the strictest (testing/differential.py).
DIFFERENTIAL_MODE = Mode.RENAMING


def scheduler_factory() -> Callable[[Shape], Any]:
    from kvspec.testing.implementations import lookup_scheduler

    return lookup_scheduler("v1-scheduler").factory


def run_shapes(
    factory: Callable[[Shape], Any],
    *,
    profile: str,
    examples: int | None,
    steps: int | None,
    seed: int | None,
    focus: tuple[str, ...] | None,
    part: Part | None = None,
) -> ShapesOutcome:
    """``part``: the shapes' share of a time budget (cli/budget.py)."""
    base = Settings.get_profile(profile)
    requested = examples if examples is not None else max(1, base.max_examples // EXAMPLES_SHARE)
    chosen = Settings(
        base,
        max_examples=requested,
        stateful_step_count=steps if steps is not None else base.stateful_step_count,
        report_multiple_bugs=False,
        database=None,
        print_blob=False,
        deadline=None,
    )
    if seed is None and not base.derandomize:
        seed = random.SystemRandom().randrange(2**32)
    outcome = ShapesOutcome("holds", ShapeCounts())
    last: dict[str, Any] = {}

    def build(shape: Shape) -> Any:
        try:
            return factory(shape)
        except ConfigError as error:
            if len(outcome.rejected) < 20:
                outcome.rejected.append(str(error))
            raise

    class Machine(SchedulerMachine):
        def __init__(self) -> None:
            if part is not None:
                part.start_example()
            super().__init__(
                build,
                counts=outcome.counts,
                focus=frozenset(focus) if focus else None,
                differential=DIFFERENTIAL_MODE,
                diff_counts=outcome.differential,
            )

        def teardown(self):
            if part is not None:
                part.example_ended(self.shape.tags() if self.shape is not None else ())
            if self.driver is not None:
                last["trace"] = list(self.d.trace)
                last["shape"] = self.shape
                if not outcome.violations:
                    outcome.examples += 1
                    outcome.operations += len(self.d.trace)
            super().teardown()

    test = get_state_machine_test(Machine, settings=chosen)
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    start = time.perf_counter()
    try:
        with with_reporter(lambda _text: None):
            test()
    except SpecViolation as found:
        outcome.status = "violated"
        outcome.violations = list(found.violations)
        outcome.trace = list(found.trace)
        outcome.shape = last.get("shape")
    except PolicyDifference as found:
        outcome.status = "differs"
        outcome.difference = found
        outcome.trace = list(found.trace)
        outcome.shape = last.get("shape")
    except (Unsatisfiable, FailedHealthCheck) as error:
        outcome.status = "no-examples"
        outcome.error = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    except BudgetSpent:
        pass  # the time budget's deadline: the examples run are the run
    except Exception as error:  # the target crashed under a valid protocol
        outcome.status = "error"
        outcome.error = f"{type(error).__name__}: {error}"
        outcome.trace = list(last.get("trace", []))
        outcome.shape = last.get("shape")
    outcome.seconds = time.perf_counter() - start
    if part is not None:
        part.close()
    if outcome.status == "holds" and outcome.examples == 0:
        outcome.status = "no-examples"
    return outcome


def print_shapes(o: ShapesOutcome) -> None:
    out.rule("vLLM's own V1 scheduler, production shapes")
    out.print(
        f"{o.examples} examples, {o.operations} operations, {o.seconds:.1f}s: "
        + {
            "holds": "[green]every invariant holds per group and over the shared pool[/]",
            "violated": "[bold red]VIOLATED[/]",
            "differs": "[green]every invariant holds[/]; [bold red]the scheduler differs from "
            + (escape(o.difference.whose()) if o.difference is not None else "its release")
            + "'s declared policy[/]",
            "error": "[bold red]the scheduler crashed[/]",
            "no-examples": "[yellow]nothing ran[/]",
        }[o.status]
    )
    for tag in SHAPE_TAGS:
        ex, ops = o.counts.examples.get(tag, 0), o.counts.operations.get(tag, 0)
        if ex:
            out.print(f"  {tag:<20} {ex:>5} examples {ops:>7} operations", markup=False)
        else:
            out.print(f"  {tag:<20} [yellow]no example ran in this shape[/]")
    print_cache_counts(o)
    print_differential(o)
    if o.rejected:
        out.print(f"  shapes the target refused: {escape(o.rejected[0])}", markup=True)
    if o.error:
        out.print(f"  {escape(o.error)}")
    if o.known is not None:
        out.print(f"  {escape(o.known.cite())}: {escape(o.known.title)}")
    if o.status in ("violated", "differs", "error"):
        if o.shape is not None:
            out.print(f"shape: {escape(o.shape.describe())}")
        for v in o.violations:
            out.print(f"  {escape(str(v))}")
        if o.difference is not None:
            out.print(f"  {escape(str(o.difference))}")
        out.print("trace (what the worker did -> what the scheduler planned):")
        for i, s in enumerate(o.trace, 1):
            out.print(f"  {i}. {escape(s.describe())}", soft_wrap=True)


def differential_line(d: DiffCounts) -> str:
    """What the scheduler differential compared, the divergences it allowed by ID, and why
    comparisons ended before their example did (a run that compared nothing says so)."""
    if d.undeclared is not None and not d.examples:
        return (
            f"differential not run: no declared scheduler policy for vLLM {d.undeclared} "
            f"(declared: {declared_spans()}; reference/policies.py)"
        )
    if not d.steps:
        return "differential vs the reference scheduler: [yellow]no step compared[/]"
    allowed = ", ".join(f"{k} {n}" for k, n in sorted(d.allowed.items())) or "none"
    ended = sum(d.ended.values())
    why = ", ".join(f"{k} {n}" for k, n in sorted(d.ended.items()))
    policy = "" if d.policy is None else f", policy {d.policy.id}"
    return (
        f"differential vs the reference scheduler ({DIFFERENTIAL_MODE.value}{policy}): {d.examples} "
        f"examples, {d.steps} steps and {d.states} states compared; divergences allowed: "
        f"{allowed}; compared to the end in {d.to_end} of {d.examples} examples ({d.hit_examples_to_end} of the "
        f"{d.hit_examples} with a prefix hit; {d.hits} hits compared)"
        + (f", ended early in {ended} ({why})" if ended else "")
    )


def not_compared_lines(d: DiffCounts) -> list[str]:
    """What the differential did not compare, and why: comparisons the policy leaves out,
    examples run without the differential."""
    lines = []
    if d.policy is not None:
        lines += [f"not compared: {o.comparison.value} ({o.why})" for o in d.policy.not_compared]
        compared = {c for c in Comparison if d.policy.compares(c)}
        if compared and len(compared) < len(Comparison):
            lines.append(f"compared: {', '.join(c.value for c in Comparison if c in compared)}")
    lines += [f"not run in {n} examples: {why}" for why, n in sorted(d.not_run.items())]
    return lines


def print_differential(o: ShapesOutcome) -> None:
    out.print(f"  {differential_line(o.differential)}")
    for line in not_compared_lines(o.differential):
        out.print(f"    {escape(line)}")


def print_cache_counts(o: ShapesOutcome) -> None:
    """The prefix cache as tenants and routers see it: domains drawn, partial tails, events
    (``SchedulerDriver.cache_counts``).  A kind the run never produced is named."""
    c = o.counts.cache
    domains = f"{c['cache_salt']} salted / {c['lora']} LoRA / {c['mm']} multimodal admissions"
    partial = (
        f"partial tails {c['partial_cached']} cached / {c['partial_promoted']} promoted / "
        f"{c['partial_retired']} retired"
    )
    prefix = "event_hashes_"
    formats = ", ".join(f"{n} {k.removeprefix(prefix)}" for k, n in sorted(c.items()) if k.startswith(prefix))
    events = f"{c['events']} KV events (replayed per group" + (f"; hashes: {formats})" if formats else ")")
    out.print(f"  prefix cache: {domains}; {partial}; {events}")
    missing = [
        name
        for name, n in (
            ("salts", c["cache_salt"]),
            ("LoRA", c["lora"]),
            ("partial tails", c["partial_cached"]),
            ("KV events", c["events"]),
        )
        if not n
    ]
    if missing and o.examples:
        out.print(f"  [yellow]prefix cache: none of {', '.join(missing)} in this run[/]")
    if not c["mm"] and o.examples:
        out.print(
            "  [yellow]multimodal placements not drawn under the scheduler[/]: the offline tiny model "
            "is text-only (no encoder budget, adapters/v1_scheduler_cache.py); the block-manager "
            "search above draws them"
        )
    # EAGLE's dropped last hit block (the hit-completeness policy's freedom), where the
    # scheduler drops it (testing/scheduler_driver.py ``_count_hits``).
    eagle, dropped = c["eagle_admissions_with_cached_prefix"], c["eagle_dropped_blocks"]
    if eagle:
        out.print(f"  EAGLE: {dropped} of {eagle} admissions with a cached prefix lost the hit's last block")
    elif o.examples:
        out.print("  [yellow]EAGLE: no admission with a cached prefix under a block-dropping EAGLE head[/]")


def shapes_json(o: ShapesOutcome) -> dict[str, Any]:
    return {
        "status": o.status,
        "examples": o.examples,
        "operations": o.operations,
        "seconds": round(o.seconds, 2),
        "prefix_cache": dict(sorted(o.counts.cache.items())),
        "differential": {
            "mode": DIFFERENTIAL_MODE.value,
            "examples": o.differential.examples,
            "steps_compared": o.differential.steps,
            "states_compared": o.differential.states,
            "divergences_allowed": dict(sorted(o.differential.allowed.items())),
            "ended_early": dict(sorted(o.differential.ended.items())),
            "compared_to_end": o.differential.to_end,
            "prefix_hits_compared": o.differential.hits,
            "policy": None if o.differential.policy is None else o.differential.policy.id,
            "undeclared": o.differential.undeclared,
            "not_compared": not_compared_lines(o.differential),
        },
        "policy_difference": None if o.difference is None else difference_json(o.difference),
        "per_shape": {
            t: [o.counts.examples.get(t, 0), o.counts.operations.get(t, 0)] for t in SHAPE_TAGS
        },
        "violations": [{"invariant": v.invariant, "message": v.message} for v in o.violations],
        "trace": [s.to_json() for s in o.trace],
        "shape": attrs.asdict(o.shape) if o.shape is not None else None,
        "error": o.error,
        "known": o.known.id if o.known is not None else None,
    }


def difference_json(d: PolicyDifference) -> dict[str, Any]:
    return {
        "release": d.release,
        "policy": d.policy,
        "compared": d.comparison.value,
        "mode": d.mode,
        "seq": d.seq,
        "group": d.group,
        "target": repr(d.target),
        "reference": repr(d.reference),
        "message": str(d),
    }


SCHEDULER_IMPL = "v1-scheduler"  # the scheduler target's name in known findings (``impl``)


def label_known(o: ShapesOutcome, known: list[KnownFinding]) -> KnownFinding | None:
    """The known finding a violation of the shapes run is (its fingerprint: the first
    violation's invariant after the trace's last operation), if any."""
    if o.status != "violated" or not o.violations:
        return None
    fp = Fingerprint(o.violations[0].invariant, o.trace[-1].op if o.trace else "teardown")
    message = "\n".join(str(v) for v in o.violations)
    return which_known(known, fp, message, None, {s.op for s in o.trace})


def run_v1_shapes(
    args: Any,
    impl: str,
    here: Any,
    focus: tuple[str, ...] | None,
    guard: Any = None,
    known: list[KnownFinding] | None = None,
    part: Part | None = None,
) -> ShapesOutcome | None:
    """The scheduler-shapes run of ``kvspec check``: on a V1 target checked as ``v1`` (the
    default there), unless ``--no-shapes``.  Prints its summary; None when it does not apply.
    ``guard`` (``testing.guard.Guard``, armed by the caller) limits every scheduler call;
    ``known``: the known findings that concern the scheduler target (``SCHEDULER_IMPL``), by
    which a violation is labelled."""
    if not shapes_apply(args, impl, here):
        return None
    try:
        factory = scheduler_factory()
    except ImportError as error:
        out.print(f"[yellow]scheduler shapes not run[/]: {escape(str(error))}")
        return None
    if guard is not None:
        factory = guard.wrap(factory)
    o = run_shapes(
        factory,
        profile=args.profile,
        examples=budget_examples(None if args.examples is None else max(1, args.examples // EXAMPLES_SHARE), part),
        steps=args.steps,
        seed=args.seed,
        focus=focus,
        part=part,
    )
    o.known = label_known(o, known or [])
    print_shapes(o)
    return o


def shapes_apply(args: Any, impl: str, here: Any) -> bool:
    """Whether ``kvspec check`` runs the scheduler shapes: a V1 target checked as ``v1``,
    without ``--no-shapes``."""
    return here is not None and impl == "v1" and not getattr(args, "no_shapes", False)


def shapes_exit(code: int, o: ShapesOutcome | None) -> int:
    """The exit code of a check whose block-manager search ended with ``code``."""
    if o is None or o.status in ("holds",):
        return code
    from .common import EXIT_FOUND

    return max(code, EXIT_FOUND) if o.status in ("violated", "differs", "error") else code
