"""``kvspec check`` on a V1 release: vLLM's own scheduler in the shapes production runs.

After the block-manager search, ``kvspec check`` on a V1 target runs the scheduler machine
(testing/scheduler/machine.py) over vLLM's own ``Scheduler``/``AsyncScheduler``
(adapters/v1_scheduler.py): hybrid KV-cache groups, async scheduling, speculative decoding,
token-budget chunking, ``full_sequence_must_fit`` on and off, pools at vLLM's startup
minimum.  It searches as the block-manager machine does (cli/search.py ``search_rounds``):
rounds that step past the known findings of the scheduler target (``SCHEDULER_IMPL``) and what
earlier rounds found, every distinct verdict shrunk on its own, then each known finding that
fired found again.  Each verdict gets a report folder beside the block-manager ones
(``write_scheduler_reports``) that ``kvspec replay`` re-runs (testing/scheduler/replay.py).
The summary gives the examples and operations run in each shape, and names a shape no
example reached.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from hypothesis import Phase
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.errors import FailedHealthCheck, Unsatisfiable
from hypothesis.reporting import with_reporter
from hypothesis.stateful import get_state_machine_test
from kvspec.reference.policies import Comparison, declared_spans
from kvspec.spec.errors import ConfigError
from kvspec.spec.groups import KV_CONNECTORS, SHAPE_TAGS, Shape
from kvspec.spec.invariants import Violation
from kvspec.testing.artifacts.report import build_report, write_atomic, write_report
from kvspec.testing.artifacts.reproducer import NotReproducible, Reproducer
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.blockmanager.driver import SpecViolation, TraceStep
from kvspec.testing.blockmanager.machine import StepPast
from kvspec.testing.guard import GuardTripped, crash_traceback, raised_in_kvspec
from kvspec.testing.known import CRASH, Fingerprint, KnownFinding
from kvspec.testing.scheduler.driver import ShapeCounts
from kvspec.testing.scheduler.machine import (
    DiffCounts,
    PolicyDifference,
    SchedulerMachine,
    kv_connectors_of,
    multimodal_of,
    multimodal_refusal_of,
    retention_offer_of,
    shapes,
)
from kvspec.testing.scheduler.reproducer import generate as generate_reproducer
from rich.markup import escape

from .budget import BudgetSpent, Part, budget_examples
from .common import EXIT_FOUND, EXIT_KVSPEC_ERROR, err, out, write_picture
from .failures import HEADLINE, KVSPEC_ERROR, STOPPED_BY_TARGET, TRACEBACK_LINES, print_kvspec_error
from .search import (
    MAX_VIOLATIONS,
    Found,
    Identity,
    Mask,
    Search,
    Sieve,
    found_json,
    print_found,
    print_known,
    search_rounds,
    search_seed,
)

# The scheduler machine's share of a profile: each example builds vLLM's scheduler (a few
# tens of milliseconds once imported), and runs fewer, longer-lived steps than the
# block-manager machine.
EXAMPLES_SHARE = 1  # as many examples as the block-manager search

if TYPE_CHECKING:
    from kvspec.testing.artifacts.timeline import Film


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
    # The reference scheduler in lockstep (testing/scheduler/machine.py SchedulerLockstep).
    differential: DiffCounts = attrs.Factory(DiffCounts)
    # status "differs": the target differs from its release's declared scheduling policy.
    difference: PolicyDifference | None = None
    traceback: list[str] = attrs.Factory(list)  # of a crash or a kvspec error
    seed: int | None = None
    # The KV connectors the target's release builds (``kv_connectors_of``); None: not read.
    kv_connectors: tuple[str, ...] | None = None
    # Why the target's release cannot run the multimodal shape (``multimodal_refusal_of``):
    # None, it can (or it was not asked).
    multimodal_refusal: str | None = None
    # What kvspec's trace minimizer cut after hypothesis' shrinking (testing/artifacts/minimize.py).
    minimized: str | None = None


# The scheduler differential's mode in kvspec check: the strictest (testing/blockmanager/differential.py).
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
    step_past: StepPast | None = None,
    counts: ShapeCounts | None = None,
    differential: DiffCounts | None = None,
    shape_strategy: st.SearchStrategy[Shape] | None = None,
    part: Part | None = None,
    database: Any = None,
    database_key: bytes | None = None,
    replay: bool = True,
) -> ShapesOutcome:
    """One hypothesis search of the scheduler machine; ``step_past`` may discard failing
    examples (the rounds of ``run_scheduler_search``), ``counts`` and ``differential`` gather
    what every round ran; ``shape_strategy`` narrows the shapes (default: every production
    shape, testing/scheduler/machine.py ``shapes``); ``part``: the scheduler's share of a time
    budget (cli/budget.py); ``database`` (a hypothesis example database) under ``database_key``:
    a campaign's shared examples (cli/fuzz.py), replayed first and receiving the failures;
    ``replay`` False: the database receives the failures but is not replayed (hypothesis'
    ``Phase.reuse`` left out, so it neither re-runs nor deletes what it holds)."""
    base = Settings.get_profile(profile)
    requested = examples if examples is not None else max(1, base.max_examples // EXAMPLES_SHARE)
    chosen = Settings(
        base,
        max_examples=requested,
        stateful_step_count=steps if steps is not None else base.stateful_step_count,
        report_multiple_bugs=False,
        database=database,
        print_blob=False,
        deadline=None,
        phases=base.phases if replay else tuple(p for p in base.phases if p != Phase.reuse),
    )
    if seed is None and not base.derandomize:
        seed = random.SystemRandom().randrange(2**32)
    outcome = ShapesOutcome(
        "holds", counts if counts is not None else ShapeCounts(), seed=seed,
        differential=differential if differential is not None else DiffCounts(),
    )
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
                shape_strategy
                if shape_strategy is not None
                else shapes(retention_offer_of(factory), kv_connectors_of(factory), multimodal_of(factory)),
                counts=outcome.counts,
                focus=frozenset(focus) if focus else None,
                differential=DIFFERENTIAL_MODE,
                diff_counts=outcome.differential,
                step_past=step_past,
            )

        def start(self, shape: Shape) -> None:
            # The shape of the example running (a trip's setting), and no trace yet: a target
            # that crashes (or hangs) in construction ran nothing, whatever earlier examples ran.
            last.update(current=shape, shape=shape, trace=[])
            super().start(shape)

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
    if database is not None and database_key is not None:
        test._hypothesis_internal_database_key = database_key  # type: ignore[attr-defined]
        # hypothesis' ``seed`` switches the database off; a campaign seeds its rounds (so a
        # verdict names the seed that found it) and still shares what they find.
        test._hypothesis_internal_use_settings = Settings(  # type: ignore[attr-defined]
            test._hypothesis_internal_use_settings, database=database  # type: ignore[attr-defined]
        )
    start = time.perf_counter()
    if part is not None:
        part.next_round()
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
    except BudgetSpent:
        pass  # the time budget's deadline: the examples run are the run
    except KeyboardInterrupt:
        outcome.status = "interrupted"
    except GuardTripped as trip:  # hung, or out of memory: the search stops where it is
        outcome.status = trip.kind
        outcome.error = trip.message
        outcome.trace = list(trip.trace) or list(last.get("trace", []))
        outcome.shape = last.get("current")
    except (Unsatisfiable, FailedHealthCheck) as error:
        outcome.status = "no-examples"
        outcome.error = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    except Exception as error:  # the target crashed under a valid protocol, or kvspec's own code raised
        outcome.status = KVSPEC_ERROR if raised_in_kvspec(error) else "error"
        outcome.error = f"{type(error).__name__}: {error}"
        outcome.traceback = crash_traceback(error, None if outcome.status == KVSPEC_ERROR else TRACEBACK_LINES)
        outcome.trace = list(last.get("trace", []))
        outcome.shape = last.get("shape")
    outcome.seconds = time.perf_counter() - start
    if part is not None:
        part.close()
    if outcome.status == "holds" and outcome.examples == 0:
        outcome.status = "no-examples"
    return outcome


HEADLINES = {
    "holds": "[green]every invariant holds per group and over the shared pool[/]",
    "violated": "[bold red]VIOLATED[/]",
    "differs": "[green]every invariant holds[/]; [bold red]the scheduler differs from {whose}'s declared policy[/]",
    "error": "[bold red]the scheduler crashed[/]",
    "hung": f"[bold red]{HEADLINE['hung']}[/]",
    "memory": f"[bold red]{HEADLINE['memory']}[/]",
    KVSPEC_ERROR: f"[bold red]{HEADLINE[KVSPEC_ERROR]}[/]",
    "no-examples": "[yellow]nothing ran[/]",
    "interrupted": "[yellow]interrupted[/]: nothing is claimed",
}


def print_shapes(o: ShapesOutcome) -> None:
    """What the scheduler run ran (every round): examples per shape, the prefix cache, the
    differential, and its verdict in one line (the verdicts follow, ``print_verdict``)."""
    out.rule("vLLM's own V1 scheduler, production shapes")
    out.print(f"{o.examples} examples, {o.operations} operations, {o.seconds:.1f}s: " + headline(o))
    # Every run counts, the shrinker's included: after a verdict most are its simplified shapes.
    out.print("  per shape (every run of the search, shrinking runs included):", markup=False)
    for tag in SHAPE_TAGS:
        ex, ops = o.counts.examples.get(tag, 0), o.counts.operations.get(tag, 0)
        if ex:
            out.print(f"  {tag:<20} {ex:>5} examples {ops:>7} operations", markup=False)
        else:
            out.print(f"  {tag:<20} [yellow]no example ran in this shape[/]")
    print_cache_counts(o)
    print_kv_connector(o)
    print_multimodal(o)
    print_differential(o)
    if o.rejected:
        out.print(f"  shapes the target refused: {escape(o.rejected[0])}", markup=True)
    if o.status == "no-examples" and o.error:
        out.print(f"  {escape(o.error)}")


def print_verdict(o: ShapesOutcome, known: KnownFinding | None) -> None:
    """One verdict of the scheduler run: what it is, the shape, the violations or the crash
    with its traceback, and the shrunk trace (ending with the operation that crashed)."""
    if known is not None:
        out.print(f"{escape(known.cite())}: {escape(known.title)}")
    out.print(f"{headline(o)} ({verdict_kind(o)})")
    if o.shape is not None:
        out.print(f"shape: {escape(o.shape.describe())}")
    if o.error:
        out.print(f"  {escape(o.error)}")
    if o.status == KVSPEC_ERROR:
        print_kvspec_error(o.traceback)
    elif o.status == "error":
        out.print("  traceback (the target's innermost frames):", markup=False)
        for line in o.traceback:
            out.print(f"    {line}", markup=False, soft_wrap=True)
    if o.minimized is not None:
        out.print(f"  ({escape(o.minimized)})")
    for v in o.violations:
        out.print(f"  [red]{escape(str(v))}[/]")
    if o.difference is not None:
        out.print(f"  [red]{escape(str(o.difference))}[/]")
    out.print("trace (what the worker did -> what the scheduler planned):")
    for i, step in enumerate(o.trace, 1):
        out.print(f"  {i}. {escape(step.describe())}", soft_wrap=True)


def headline(o: ShapesOutcome) -> str:
    """The one-line verdict of an outcome (markup)."""
    whose = escape(o.difference.whose()) if o.difference is not None else "its release"
    return HEADLINES[o.status].format(whose=whose)


# A failing round's verdict kind, by its status: ``invariant`` (a state or per-step invariant
# violated), ``differential`` (the target differs from its release's declared policy, every
# invariant holding: testing/scheduler/machine.py ``PolicyDifference``), ``crash`` (the target
# raised), ``kvspec-error`` (kvspec's own code raised).
VERDICT_KINDS = {"violated": "invariant", "differs": "differential", "error": "crash", KVSPEC_ERROR: KVSPEC_ERROR}


def verdict_kind(o: ShapesOutcome) -> str:
    """What kind of verdict a failing round is (``VERDICT_KINDS``)."""
    return VERDICT_KINDS.get(o.status, o.status)


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


def print_kv_connector(o: ShapesOutcome) -> None:
    """The KV connector shapes: examples that drew one, the sends the scheduler deferred a free
    for and the worker reported; or why none ran."""
    drew = o.counts.examples.get("kv-connector", 0)
    c = o.counts.cache
    if drew:
        out.print(
            f"  KV connector: {drew} examples drew one ({', '.join(o.kv_connectors or ())}); "
            f"{c['sends_deferred']} finished requests kept their blocks for a send, "
            f"{c['sends_reported']} sends reported done"
        )
    elif o.kv_connectors is not None and not o.kv_connectors:
        out.print(f"  [yellow]KV connector: none drawn[/]: this release builds none of {', '.join(KV_CONNECTORS)}")
    elif o.examples:
        out.print("  [yellow]KV connector: no example drew one in this run[/]")


def print_multimodal(o: ShapesOutcome) -> None:
    """The multimodal shapes: examples that drew images, the encoder inputs their steps
    scheduled and the requests they belong to, what the differential compared of them; or why
    the release runs none."""
    drew = o.counts.examples.get("multimodal", 0)
    c, d = o.counts.cache, o.differential
    if drew:
        stops = ", ".join(f"{n} by the encoder {k}" for k, n in sorted(d.encoder_stops.items()) if n) or "none"
        if d.mm_examples:
            compared = (
                f"{d.encoder_inputs} compared with the reference in {d.mm_examples_to_end} of {d.mm_examples} "
                f"examples compared to the end; steps an image cut short: {stops}"
            )
        else:  # the differential's own line says why it did not run
            compared = "none run beside the reference scheduler"
        out.print(
            f"  multimodal: {drew} examples drew images; {c['encoder_inputs']} encoder inputs scheduled in "
            f"{c['encoder_steps']} steps for {c['encoder_requests']} requests; {compared}"
        )
    elif o.multimodal_refusal is not None:
        out.print(f"  [yellow]multimodal: none drawn[/]: {escape(o.multimodal_refusal)}")
    elif o.examples:
        out.print("  [yellow]multimodal: no example drew images in this run[/]")


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
    copies = f"; {c['block_copies']} copy-on-write copies run" if c["block_copies"] else ""
    out.print(f"  prefix cache: {domains}; {partial}{copies}; {events}")
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
            "  [yellow]multimodal placements not drawn under the scheduler[/]: only the multimodal shape "
            "draws them (a tiny BLIP-2, adapters/v1_scheduler_mm.py); the block-manager search above "
            "draws them too"
        )
    # EAGLE's dropped last hit block (the hit-completeness policy's freedom), where the
    # scheduler drops it (testing/scheduler/driver.py ``_count_hits``).
    eagle, dropped = c["eagle_admissions_with_cached_prefix"], c["eagle_dropped_blocks"]
    if eagle:
        out.print(f"  EAGLE: {dropped} of {eagle} admissions with a cached prefix lost the hit's last block")
    elif o.examples:
        out.print("  [yellow]EAGLE: no admission with a cached prefix under a block-dropping EAGLE head[/]")


def shapes_json(o: ShapesOutcome) -> dict[str, Any]:
    """What a scheduler run ran (each verdict has its own report)."""
    return {
        "status": o.status,
        "examples": o.examples,
        "operations": o.operations,
        "seconds": round(o.seconds, 2),
        "prefix_cache": dict(sorted(o.counts.cache.items())),
        "kv_connectors_offered": None if o.kv_connectors is None else list(o.kv_connectors),
        "multimodal_refusal": o.multimodal_refusal,
        "encoder": {
            "inputs_scheduled": o.counts.cache.get("encoder_inputs", 0),
            "inputs_compared": o.differential.encoder_inputs,
            "stops": dict(sorted(o.differential.encoder_stops.items())),
        },
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
        "error": o.error,
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


@attrs.define
class SchedulerRun:
    """The scheduler machine's search in one ``kvspec check``: its rounds (cli/search.py
    ``Search`` over ``ShapesOutcome``s), and what they ran together."""

    search: Search
    summary: ShapesOutcome  # every round's counts; the status of the run as a whole
    factory: Callable[[Shape], Any]  # builds the scheduler searched (the pictures replay on it)
    implementation_name: str | None = None


def run_scheduler_search(
    factory: Callable[[Shape], Any],
    *,
    known: Sequence[KnownFinding] = (),
    report_known: bool = True,
    max_violations: int = MAX_VIOLATIONS,
    part: Part | None = None,
    reported: Sequence[Identity] = (),
    hunt: Sequence[str] = (),
    on_found: Callable[[Found], None] | None = None,
    **budget: Any,
) -> SchedulerRun:
    """Rounds of ``run_shapes`` (``search_rounds``) with its ``budget`` (``profile``,
    ``examples``, ``steps``, ``seed``, ``focus``, ``database``, ``database_key``): every
    distinct verdict, each shrunk on its own, the known findings of the scheduler target stepped
    past and found again; ``part``: its share of a time budget, shared by its rounds (none
    starts after its deadline); ``reported`` and ``hunt``: what a campaign's earlier searches
    reported, and the known findings it reports on first meeting; ``on_found``: called with each
    verdict as its round ends (``search_rounds``)."""
    seed = search_seed(budget["profile"], budget.pop("seed", None))
    counts, differential = ShapeCounts(), DiffCounts()
    rejected: list[str] = []

    def one_round(sieve: Sieve, _mask: Mask, tag: str) -> ShapesOutcome:
        err.print(f"scheduler shapes {tag} ...", markup=False)
        if part is not None:
            part.watch(sieve)
        o = run_shapes(
            factory, seed=seed, step_past=sieve, counts=counts, differential=differential, part=part, **budget
        )
        rejected.extend(r for r in o.rejected if r not in rejected)
        return o

    search = search_rounds(
        one_round,
        known,
        report_known=report_known,
        max_violations=max_violations,
        spent=part.past_deadline if part is not None else None,
        reported=reported,
        hunt=hunt,
        on_found=on_found,
    )
    rounds: list[ShapesOutcome] = search.rounds
    last = rounds[-1]
    if last.status in ("error", KVSPEC_ERROR) and all(f.outcome is not last for f in search.found):
        # A failure no step-past policy saw (building the first target, before any driver):
        # a verdict of its own.
        at = last.trace[-1].op if last.trace else "construct"
        search.found.append(Found(Fingerprint(CRASH, at, (last.error or "?").split(":")[0]), last))
    if last.status in STOPPED_BY_TARGET:
        # A hang or a memory runaway ends the search (the target is abandoned): its own verdict.
        at = last.trace[-1].op if last.trace else "construct"
        search.found.append(Found(Fingerprint(last.status, at), last))
    statuses = {f.outcome.status for f in search.found}
    order = (KVSPEC_ERROR, *STOPPED_BY_TARGET, "violated", "error", "differs")
    status = next((s for s in order if s in statuses), last.status)
    summary = ShapesOutcome(
        status,
        counts,
        examples=sum(o.examples for o in rounds),
        operations=sum(o.operations for o in rounds),
        seconds=sum(o.seconds for o in rounds),
        rejected=rejected[:20],
        differential=differential,
        error=last.error,
        seed=seed,
        difference=next((f.outcome.difference for f in search.found if f.outcome.difference is not None), None),
    )
    return SchedulerRun(search, summary, factory)


def run_v1_shapes(
    args: Any,
    impl: str,
    here: Any,
    focus: tuple[str, ...] | None,
    guard: Any = None,
    known: list[KnownFinding] | None = None,
    part: Part | None = None,
) -> SchedulerRun | None:
    """The scheduler run of ``kvspec check``: on a V1 target checked as ``v1`` (the default
    there), unless ``--no-shapes``.  Prints what it ran; None when it does not apply.
    ``guard`` (``testing.guard.Guard``, armed by the caller) limits every scheduler call;
    ``known``: the known findings that concern the scheduler target (``SCHEDULER_IMPL``),
    stepped past while exploring and reported by id; ``part``: its share of a time budget."""
    if not shapes_apply(args, impl, here):
        return None
    try:
        factory = scheduler_factory()
    except ImportError as error:
        out.print(f"[yellow]scheduler shapes not run[/]: {escape(str(error))}")
        return None
    # Read off the adapter before the guard wraps it: the retentions its release offers.
    connectors = kv_connectors_of(factory)
    refusal = multimodal_refusal_of(factory)
    strategy = shapes(retention_offer_of(factory), connectors, refusal is None)
    if guard is not None:
        factory = guard.wrap(factory)
    run = run_scheduler_search(
        factory,
        shape_strategy=strategy,
        profile=args.profile,
        examples=budget_examples(None if args.examples is None else max(1, args.examples // EXAMPLES_SHARE), part),
        steps=args.steps,
        seed=args.seed,
        focus=focus,
        part=part,
        known=known or [],
        report_known=not getattr(args, "known_count_only", False),
        max_violations=getattr(args, "max_violations", None) or MAX_VIOLATIONS,
    )
    run.implementation_name = guard.implementation_name if guard is not None else None
    run.summary.kv_connectors = connectors
    run.summary.multimodal_refusal = refusal
    print_shapes(run.summary)
    if not run.search.found:
        print_known(run.search)
    return run


def shapes_apply(args: Any, impl: str, here: Any) -> bool:
    """Whether ``kvspec check`` runs the scheduler: a V1 target checked as ``v1``, without
    ``--no-shapes``."""
    return here is not None and impl == "v1" and not getattr(args, "no_shapes", False)


def status_exit(status: str) -> int:
    """The exit code a scheduler verdict of this status asks for."""
    if status == KVSPEC_ERROR:
        return EXIT_KVSPEC_ERROR
    return EXIT_FOUND if status in ("violated", "differs", "error", *STOPPED_BY_TARGET) else 0


def shapes_exit(code: int, run: SchedulerRun | None) -> int:
    """The exit code of a check whose block-manager search ended with ``code``: a verdict of
    the scheduler run, or a known finding of its target that fired, is a finding too."""
    if run is None:
        return code
    codes = [status_exit(f.outcome.status) for f in run.search.found]
    if run.search.fired:
        codes.append(EXIT_FOUND)
    return max([code, *codes])


# ------------------------------------------------------------------------------ reports


def scheduler_json(run: SchedulerRun) -> dict[str, Any]:
    """The scheduler run in the run's ``summary.json`` (docs/report-format.md)."""
    s = run.search
    return {
        **shapes_json(run.summary),
        "rounds": [{"status": o.status, "examples_run": o.examples, "operations_run": o.operations,
                    "seconds": round(o.seconds, 2)} for o in s.rounds],
        "known_findings": {k.id: {"fired": s.fired[k.id], "missed": k.id in s.missed} for k in s.known},
        "stopped": s.stopped,
        "seed": run.summary.seed,
    }


def verdict_json(found: Found) -> dict[str, Any]:
    """A verdict's identity, in its report and in the run's index."""
    return {
        "machine": "scheduler",
        "kind": verdict_kind(found.outcome),
        **found_json(found),
    }


def scheduler_reproducer(
    o: ShapesOutcome, fingerprint: Fingerprint, vllm_version: str | None
) -> Reproducer | NotReproducible:
    """The straight-line pytest file of a scheduler verdict (testing/scheduler/reproducer.py),
    or why there is none.  The re-run watches the verdict's invariant alone (a crash: none), so
    that it stops where the verdict did, not at another violation the search stepped past."""
    if o.status == "differs":
        return NotReproducible(
            "a policy difference is judged against kvspec's reference scheduler, which a file "
            "importing only vllm does not carry; `kvspec replay` re-runs the report"
        )
    if o.status == KVSPEC_ERROR:
        return NotReproducible("kvspec's own code raised: the report and `kvspec replay` show it")
    if o.shape is None:
        return NotReproducible("no shape was recorded (the scheduler was never built)")
    violations = [v for v in o.violations if v.invariant == fingerprint.invariant]
    focus = [fingerprint.invariant] if violations else [CRASH]
    return generate_reproducer(o.shape, o.trace, violations, {"vllm_version": vllm_version, "focus": focus})


NO_REPRODUCER = {
    "status": "not-available",
    "reason": "not asked for (`kvspec replay` re-runs the report)",
    "path": None,
}


def draw_scheduler_report(
    o: ShapesOutcome, factory: Callable[[Shape], Any], where: Path, report: dict[str, Any]
) -> None:
    """A scheduler verdict's timeline and report.html (cli/common.py ``write_picture``): the
    trace replayed on the scheduler ``factory`` builds again in the verdict's shape, watching the
    verdict's invariants alone (so that the replay is not stopped by a finding the search
    stepped past)."""
    if o.status in (*STOPPED_BY_TARGET, KVSPEC_ERROR) or o.shape is None:
        return
    shape = o.shape
    watched = sorted({v.invariant for v in o.violations}) or None

    def shoot() -> Film:
        from kvspec.testing.artifacts.timeline import scheduler_film

        # A policy difference is met against the reference scheduler: the replay compares again.
        mode = DIFFERENTIAL_MODE if o.difference is not None else None
        return scheduler_film(factory(shape), shape, o.trace, watched, o.violations, mode)

    write_picture(where, report, shoot, shape.describe())


def write_scheduler_reports(
    run: SchedulerRun,
    base: Path,
    first: int,
    report_base: Callable[[], dict[str, Any]],
    replay_hint: str,
    reproduce: Callable[[ShapesOutcome, Fingerprint, Path], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """For each verdict: print it, and write its folder ``NN-<fingerprint>`` under ``base``
    (numbered from ``first``): ``report.json`` (docs/report-format.md, ``machine``
    "scheduler": the shape instead of a configuration), ``trace.txt`` and, where
    ``reproduce(outcome, fingerprint, folder)`` keeps one, the straight-line reproducer (its entry goes
    into the report).  ``report_base`` gives the fields every report of the run shares for an
    outcome status (target, command, ...).  Beside the report, its timeline (timeline.svg) and
    report.html, drawn by replaying the trace on the scheduler searched, in the verdict's shape (not for
    a scheduler that hung or ran away with memory, nor for kvspec's own error).  The index
    entries of the run's summary."""
    entries = []
    total = len(run.search.found)
    for n, found in enumerate(run.search.found, first):
        o = found.outcome
        out.rule(f"scheduler verdict {n - first + 1} of {total}: {found.fingerprint.describe()}")
        print_verdict(o, found.known)
        where = base / f"{n:02d}-{found.fingerprint.slug()}"
        reproducer = reproduce(o, found.fingerprint, where) if reproduce is not None else NO_REPRODUCER
        shared = report_base()
        report = build_report(
            outcome=o.status,
            impl=SCHEDULER_IMPL,
            implementation_name=run.implementation_name or SCHEDULER_IMPL,
            target=shared.pop("target"),
            config=None,
            run={
                "seed": run.summary.seed,
                "examples_run": o.examples,
                "operations_run": o.operations,
                "seconds": round(o.seconds, 2),
                "focus": None,
                "minimized": o.minimized,
            },
            trace=o.trace,
            violations=o.violations,
            error=o.error,
            reproducer=reproducer,
            command=shared.pop("command"),
        )
        report.update(shared)
        report.update(
            machine="scheduler",
            shape=attrs.asdict(o.shape) if o.shape is not None else None,
            differential_mode=DIFFERENTIAL_MODE.value,
            verdict=verdict_json(found),
        )
        if o.difference is not None:
            report["policy_difference"] = difference_json(o.difference)
        crash = o.trace[-1].crash if o.trace else None
        if crash is not None:
            report["crash"] = {**crash.to_json(), "step": len(o.trace), "traceback": o.traceback}
        path = write_report(where / "report.json", report)
        write_atomic(where / "trace.txt", "\n".join(report["trace_text"]) + "\n")
        out.print(f"report: {path}", markup=False, soft_wrap=True)
        draw_scheduler_report(o, run.factory, where, report)
        out.print(f"replay: kvspec replay {path}{replay_hint}", markup=False, soft_wrap=True)
        entries.append({**verdict_json(found), "report": str(path)})
    print_found(run.search, setting=lambda f: f.outcome.shape.describe() if f.outcome.shape else "-",
                title="Distinct scheduler verdicts")
    print_known(run.search)
    return entries
