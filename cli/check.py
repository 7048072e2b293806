"""``kvspec check`` and ``kvspec replay``."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError, Unsupported
from kvspec.spec.groups import Shape
from kvspec.spec.invariants import INVARIANTS, Violation
from kvspec.testing.artifacts.minimize import SHAPE_SIZES, minimize
from kvspec.testing.artifacts.report import (
    ReportError,
    build_report,
    config_from_json,
    load_report,
    trace_from_json,
    write_atomic,
    write_report,
)
from kvspec.testing.artifacts.reproducer import NotReproducible, Reproducer, generate
from kvspec.testing.artifacts.rerun import Rerun, SessionFactory, rerun
from kvspec.testing.artifacts.verify import REPRODUCES, verify
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.blockmanager.driver import SpecViolation, TraceStep
from kvspec.testing.blockmanager.machine import RunStats
from kvspec.testing.guard import Guard, GuardTripped, Limits, crash_traceback
from kvspec.testing.implementations import lookup_scheduler
from kvspec.testing.known import (
    SHIPPED,
    Fingerprint,
    GoPast,
    KnownFinding,
    KnownFindingsError,
    go_past_known,
    label_failures,
    load_known,
    own_findings,
)
from kvspec.testing.reach import Measurement
from kvspec.testing.scheduler.replay import in_context, scheduler_session
from rich.markup import escape
from rich.table import Table

import kvspec

from . import reach
from .budget import UNBOUNDED_EXAMPLES, TimeBudget
from .common import (
    EXIT_FOUND,
    EXIT_KVSPEC_ERROR,
    EXIT_OK,
    UsageError,
    captured_fds,
    err,
    out,
    write_picture,
)
from .failures import (
    HEADLINE,
    KVSPEC_ERROR,
    STOPPED_BY_TARGET,
    TRACEBACK_LINES,
    code_digest,
    failure_json,
    guard_of_outcome,
    limits_from,
    print_failure,
    replay_verdict,
    same_code,
)
from .run import ON, Outcome, config_strategy, features_from, parse_overrides
from .search import Found, Search, aggregate, found_json, masking, print_found, print_known, run_search, summary_json
from .shapes import (
    SCHEDULER_IMPL,
    SchedulerRun,
    ShapesOutcome,
    run_v1_shapes,
    scheduler_factory,
    scheduler_json,
    scheduler_reproducer,
    shapes_apply,
    shapes_exit,
    write_scheduler_reports,
)
from .target import (
    VllmHere,
    check_impl_name,
    choose_impl,
    current_engine,
    ensure_provisioned,
    factory_for,
    here_for_release,
    here_for_source,
    here_local,
    installed_version,
    is_kvspec_scheduler,
    locate_vllm,
    needs_vllm,
    probe,
    read_source_version,
    reexec,
    validate_checkout,
    venv_for_source,
)

# ------------------------------------------------------------------------------ shared

if TYPE_CHECKING:
    from kvspec.testing.artifacts.timeline import Film


def examples_line(ran: int, requested: int) -> str:
    """How many examples ran against how many were asked: a search of several rounds (each
    stepping past what earlier ones found, masked rounds larger) runs more than one round's."""
    if requested >= UNBOUNDED_EXAMPLES:
        return f"{ran} of time-budgeted examples"
    if ran > requested:
        return f"{ran} examples over all rounds ({requested} asked per round)"
    return f"{ran} of {requested} examples"


def check_invariant_ids(ids: Sequence[str] | None) -> tuple[str, ...] | None:
    if not ids:
        return None
    for inv in ids:
        if inv not in INVARIANTS:
            close = difflib.get_close_matches(inv, list(INVARIANTS), n=1)
            raise UsageError(
                f"unknown invariant ID {inv!r}" + (f" (did you mean {close[0]}?)" if close else ""),
                f"IDs: {', '.join(INVARIANTS)}",
            )
    return tuple(dict.fromkeys(ids))


def resolve(
    args: argparse.Namespace,
    argv: list[str],
    impl: str | None,
    on_target: Callable[[VllmHere], None] | None = None,
) -> int | tuple[VllmHere | None, str]:
    """Either run elsewhere (an exit code) or say what runs here: (the vLLM, the impl).
    ``on_target`` is called with the vLLM that runs here before anything imports it."""
    if not needs_vllm(impl):
        assert impl is not None
        if args.vllm or args.vllm_source:
            raise UsageError(
                f"--impl {impl} runs without vLLM; --vllm/--vllm-source do not apply",
                "drop --vllm/--vllm-source, or pick a vLLM --impl",
            )
        return None, impl
    if args.vllm and args.vllm_source:
        raise UsageError(
            "--vllm and --vllm-source exclude each other",
            "a checkout runs in the venv of the nearest provisioned release",
        )
    if getattr(args, "venv", None) and not args.vllm_source:
        raise UsageError(
            "--venv names the venv a --vllm-source checkout runs in",
            "add --vllm-source PATH, or use --vllm VERSION for a release in its own venv",
        )
    if args.in_target:
        if args.vllm_source:
            here = here_for_source(args.vllm_source, args.source_version)
        elif args.vllm:
            here = here_for_release(args.vllm)
        else:
            here = here_local()
    elif args.vllm:
        path = locate_vllm()
        if (
            path is not None
            and installed_version(path) == args.vllm
            and not os.environ.get("PYTHONPATH")
        ):
            here = here_for_release(args.vllm)  # this interpreter is that release's
        else:
            t = ensure_provisioned(args.vllm, engine=current_engine(impl) if impl else None)
            return reexec(t.python, argv)
    elif args.vllm_source:
        root = validate_checkout(args.vllm_source)
        version = args.source_version or read_source_version(root)
        if not version or version == "dev":
            raise UsageError(
                f"cannot tell which vLLM release the checkout {root} is (no vllm/_version.py, "
                "dist-info, static version or git tag)",
                "pass it: --source-version 0.6.3",
            )
        from .target import generations

        t = venv_for_source(version, generations(root / "vllm"), getattr(args, "venv", None))
        err.print(
            f"running the checkout {root} (vLLM {version}) in the venv of vLLM "
            f"{t.version}: {t.venv}",
            markup=False,
        )
        extra = [] if args.source_version else ["--source-version", version]
        return reexec(t.python, [*argv, *extra], pythonpath=root)
    else:
        here = here_local()
    if on_target is not None:
        on_target(here)
    chosen = choose_impl(here, impl)
    probe(here, chosen)
    if not getattr(args, "verbose", False):
        # vLLM logs warnings (e.g. "Failed to reset prefix cache") through its own logger;
        # they would tear the progress display.  --verbose keeps them.
        logging.getLogger("vllm").setLevel(logging.ERROR)
    return here, chosen


def target_json(here: VllmHere | None, impl: str) -> dict[str, Any]:
    if here is None:
        return {
            "kind": "none",
            "vllm_version": None,
            "vllm_path": None,
            "source_path": None,
            "venv_release": None,
            "python": sys.executable,
            "engine": None,
            "code_digest": code_digest(None, impl),
        }
    return {**here.to_json(), "engine": current_engine(impl), "code_digest": code_digest(here.path, impl)}


def describe_target(here: VllmHere | None, impl: str) -> str:
    if here is None:
        return f"{impl} (kvspec's own, no vLLM)"
    if here.kind == "source":
        return (
            f"{impl} on the vLLM checkout {here.source} (version {here.version}, run in the "
            f"vLLM {here.venv_release} venv)"
        )
    return f"{impl} on vLLM {here.version} ({here.path})"


# ------------------------------------------------------------------------------ check


def cmd_check(args: argparse.Namespace, argv: list[str]) -> int:
    check_impl_name(args.impl)
    overrides = parse_overrides(args.config or [])
    focus = check_invariant_ids(args.invariant)
    for name in ("examples", "steps", "max_violations", "time_budget"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(
                f"--{name.replace('_', '-')} must be >= 1, got {value}",
                "a run that runs nothing proves nothing",
            )
    measured: list[Measurement] = []
    on_target = None
    if getattr(args, "coverage", False):
        if not needs_vllm(args.impl):
            raise UsageError(
                f"--coverage measures vLLM's block-management code; --impl {args.impl} has none",
                "drop --coverage, or check a vLLM target (--vllm X, --vllm-source PATH)",
            )

        def on_target(here: VllmHere) -> None:
            measured.append(reach.start(here, Path(tempfile.mkdtemp(prefix="kvspec-reach-"))))

    try:
        resolved = resolve(args, argv, args.impl, on_target)
    except BaseException:
        for m in measured:
            m.discard()
        raise
    if isinstance(resolved, int):
        return resolved
    here, impl = resolved
    guard = Guard(limits_from(args))
    factory = guard.wrap(factory_for(impl))
    strategy = config_strategy(impl, overrides)
    known = known_for(args, impl, here)
    masked, maskable = masking(impl, overrides)
    profile = args.profile
    err.print(f"kvspec {kvspec.__version__}: checking {describe_target(here, impl)}", markup=False)
    budget = time_budget(args, impl, here)
    with guard.armed():
        search = run_search(
            factory,
            strategy,
            profile=profile,
            examples=args.examples,
            steps=args.steps,
            seed=args.seed,
            focus=focus,
            label=impl,
            features=features_from(overrides),
            known=known,
            report_known=not args.known_count_only,
            max_violations=args.max_violations,
            masked=masked,
            maskable=maskable,
            budget=budget,
        )
        if not args.no_minimize:
            minimize_found(search, factory, known, impl, here, guard, size_floors(overrides))
    for note in guard.notes:
        err.print(f"note: {note}", markup=False)
    summary = aggregate(search)
    print_table(summary)
    # vLLM's own V1 scheduler in production shapes (cli/shapes.py): hybrid groups, async,
    # spec decode, token budget, startup-minimum pools.
    shaped = _guarded_shapes(args, impl, here, focus, guard, budget)
    if budget is not None:
        for line in budget.lines():
            out.print(line, markup=False, soft_wrap=True)
    base = output_dir(args, impl)
    coverage = None
    if measured and here is not None:
        coverage = reach.report(measured[0], here, impl, base, args).to_json()
    entries: list[dict[str, Any]] = []
    single: list[dict[str, Any]] = []  # the block-manager search's one report in ``base``, if any
    if not search.found:
        if search.fired and search.last.status == "holds":
            out.print("[yellow]no new violation[/]; known findings fired (stepped past):")
            print_known(search)
            code = EXIT_FOUND  # a known bug of this target is still a violation
        else:
            code = report_outcome(args, argv, search.last, here, impl, overrides, out_dir=base)
            print_known(search)
            if (base / "report.json").exists():
                single.append({"machine": "block-manager", "report": str(base / "report.json"),
                               "fingerprint": None, "known_finding": None})
            code = code if guard.tripped is None else max(code, EXIT_FOUND)
    else:
        code = EXIT_FOUND
        for n, found in enumerate(search.found, 1):
            out.rule(f"violation {n} of {len(search.found)}: {found.fingerprint.describe()}")
            if found.known is not None:
                out.print(f"{escape(found.known.cite())}: {escape(found.known.title)}")
            where = base / f"{n:02d}-{found.fingerprint.slug()}"
            code = max(code, report_outcome(args, argv, found.outcome, here, impl, overrides, out_dir=where,
                                            annotate=found_json(found)))
            entries.append({"machine": "block-manager", **found_json(found), "report": str(where / "report.json")})
        last = search.last
        if last.status in STOPPED_BY_TARGET and all(f.outcome is not last for f in search.found):
            # The search ended on a hang, a memory runaway or nondeterminism after these.
            out.rule(f"then: {HEADLINE[last.status]}")
            where = base / f"{len(search.found) + 1:02d}-{last.status}"
            report_outcome(args, argv, last, here, impl, overrides, out_dir=where)
            entries.append({"outcome": last.status, "report": str(where / "report.json")})
        out.rule()
        print_found(search)
        print_known(search)
    if shaped is not None and shaped.search.found:

        def shared() -> dict[str, Any]:
            return {
                "target": target_json(here, impl),
                "command": ["kvspec", *[a for a in argv if a != "--_in-target"]],
                "limits": limits_from(args).to_json(),
            }

        def reproduce(o: ShapesOutcome, fingerprint: Fingerprint, where: Path) -> dict[str, Any]:
            return keep_reproducer(args, scheduler_reproducer(o, fingerprint, here.version if here else None), where)

        entries += write_scheduler_reports(shaped, base, len(entries) + 1, shared, replay_flags(here), reproduce)
    if entries or coverage is not None:
        # An index of the report folders; with --coverage, written whatever the verdict.
        index = summary_json(search, [*single, *entries], overrides)
        if shaped is not None:
            index["scheduler"] = scheduler_json(shaped)
        if coverage is not None:
            index["coverage"] = coverage
        path = write_report(base / "summary.json", index)
        out.print(f"summary: {path}", markup=False, soft_wrap=True)
    return shapes_exit(code, shaped)


def size_floors(overrides: dict[str, Any]) -> dict[str, int]:
    """The least pool sizes the search drew under the user's ``--config`` (cli/run.py
    ``config_strategy``), below which the minimizer does not lower a configuration: swap on
    means a CPU block, ``max_lookahead=on`` a lookahead slot.  Upper bounds (``num_blocks``,
    a ``max_lookahead`` number) need no floor: lowering stays within them."""
    floors: dict[str, int] = {}
    if overrides.get("swap") or overrides.get("num_cpu_blocks", 0):
        floors["num_cpu_blocks"] = 1
    if overrides.get("max_lookahead") == ON:
        floors["max_lookahead"] = 1
    return floors


def minimize_found(
    search: Search,
    factory: Callable[[Config], Any],
    known: Sequence[KnownFinding],
    impl: str,
    here: VllmHere | None,
    guard: Guard,
    floors: dict[str, int],
) -> None:
    """Cut each violation and each target crash the block-manager search shrank further
    (testing/artifacts/minimize.py).  Hangs, memory runaways and nondeterminism are left as
    shrunk: a re-run of theirs costs the guard's limit, or does not repeat."""
    for found in search.found:
        o = found.outcome
        if o.config is None:
            continue
        options = {"focus": o.focus, "floors": floors}
        if o.status == "violated":
            _cut_one(found, known, impl, here, guard, factory, "config", options)
        elif cuttable_crash(o):
            _cut_one(found, known, impl, here, guard, factory, "config", {**options, "crashes": True})


def cuttable_crash(o: Any) -> bool:
    """A crash of the target at one of the trace's operations (not while it was built or first
    observed, not a guard's trip): what the minimizer can re-run to the same crash."""
    return (
        o.status == "error"
        and o.exception is not None
        and not isinstance(o.exception, GuardTripped)
        and bool(o.trace)
        and o.trace[-1].crash is not None
    )


def minimize_verdicts(
    run: SchedulerRun,
    known: Sequence[KnownFinding],
    here: VllmHere | None,
    guard: Guard,
    focus: tuple[str, ...] | None,
) -> None:
    """Cut each invariant verdict of the scheduler machine further, in its shape (its blocks over
    the startup minimum lowered, never the shape's features), re-run without the reference
    scheduler beside it as `kvspec replay` re-runs it.  Crashes and policy differences are left
    as shrunk."""
    for found in run.search.found:
        o = found.outcome
        if o.status == "violated" and o.shape is not None and o.difference is None:
            options = {"focus": focus, "sizes": SHAPE_SIZES, "around": in_context, "session": _scheduler_rerun}
            _cut_one(found, known, SCHEDULER_IMPL, here, guard, run.factory, "shape", options)


def _scheduler_rerun(shape: Shape, go_past: GoPast | None) -> SessionFactory:
    """A scheduler verdict's re-run session: no reference scheduler beside it, going past what
    the re-run goes past (testing/scheduler/replay.py), as `kvspec replay` re-runs it."""
    return scheduler_session(shape, None, go_past)


def _cut_one(
    found: Found,
    known: Sequence[KnownFinding],
    impl: str,
    here: VllmHere | None,
    guard: Guard,
    factory: Callable[[Any], Any],
    field: str,
    options: dict[str, Any],
) -> None:
    """One verdict cut (``minimize`` with ``options``; ``field``: the outcome's "config" or
    "shape"): a candidate is kept when its re-run shows the same finding (its known-finding id,
    else its fingerprint), going past what the search went past; the verdict then becomes the
    cut one.  A candidate that trips the guard is contained (a note says so); nothing is cut
    once the target is abandoned."""
    if guard.tripped is not None:
        return
    o = found.outcome
    where = getattr(o, field)
    shape = where if field == "shape" else None
    config = where if field == "config" else None
    mine = found.known.id if found.known is not None else None
    own = own_findings(known, found.fingerprint, o.violations, config, o.trace, shape, (mine,))
    go_past = go_past_known(known, impl, here.version if here is not None else None, own)
    kept: list[Fingerprint] = []

    def keeps(candidate: Any, result: Rerun) -> bool:
        error = result.error if result.crash is not None else SpecViolation(result.violations, result.trace)
        assert error is not None  # a re-run that crashed carries its exception
        labelled = (
            label_failures(known, error, None, result.trace, candidate)
            if shape is not None
            else label_failures(known, error, candidate, result.trace)
        )
        hit = next((fp for fp, k in labelled if (k.id if k is not None else fp) == found.identity), None)
        if hit is not None:
            kept.append(hit)
        return hit is not None

    with guard.contained() as trips:
        made = minimize(factory, where, o.trace, keeps, go_past=go_past, **options)
    for trip in trips:
        guard.notes.append(
            f"the trace minimizer's candidate re-run of the {found.fingerprint.describe()} verdict "
            f"tripped the guard ({trip.message}); "
            + ("it stopped there" if guard.tripped is None else "the target is abandoned")
        )
    if made is None or guard.tripped is not None:
        return
    crashed: dict[str, Any] = {}
    if made.crash is not None and made.error is not None:
        # The cut crash is the re-run's: its exception, vLLM frames and the step it crashed at.
        crashed = {
            "crash": made.crash,
            "exception": made.error,
            "error": f"{type(made.error).__name__}: {made.error}",
            "traceback": crash_traceback(made.error, TRACEBACK_LINES),
        }
    found.outcome = attrs.evolve(
        o,
        **{field: made.config},
        **crashed,
        trace=made.trace,
        violations=made.violations,
        minimized=made.describe(o.trace, where),
    )
    found.fingerprint = kept[-1]


def _guarded_shapes(
    args: argparse.Namespace,
    impl: str,
    here: VllmHere | None,
    focus: tuple[str, ...] | None,
    guard: Guard,
    budget: TimeBudget | None = None,
) -> SchedulerRun | None:
    """The scheduler run under the run's limits; a hang or runaway there is reported."""
    if guard.tripped is not None:
        return None  # the target already hung or ran away: its scheduler is not run again
    try:
        with guard.armed():
            known = known_for(args, SCHEDULER_IMPL, here)
            part = budget.rest("scheduler shapes") if budget is not None and shapes_apply(args, impl, here) else None
            run = run_v1_shapes(args, impl, here, focus, guard=guard, known=known, part=part)
            if run is not None and not args.no_minimize:
                minimize_verdicts(run, known, here, guard, focus)
            return run
    except GuardTripped as trip:
        out.print(f"[bold red]scheduler shapes: {escape(trip.message)}[/]", soft_wrap=True)
        return None


def time_budget(args: argparse.Namespace, impl: str, here: VllmHere | None) -> TimeBudget | None:
    """The run's ``--time-budget`` (cli/budget.py), with a share for the shapes when they run."""
    seconds = getattr(args, "time_budget", None)
    return None if seconds is None else TimeBudget(seconds, shapes=shapes_apply(args, impl, here))


def known_for(args: argparse.Namespace, impl: str, here: VllmHere | None) -> list[KnownFinding]:
    """The known findings this run steps past: the shipped file unless --no-known, plus
    every --known FILE; only those that concern this implementation and release."""
    paths = [] if args.no_known else [SHIPPED]
    paths += [Path(p) for p in args.known or []]
    try:
        entries = load_known(paths)
    except KnownFindingsError as error:
        raise UsageError(str(error), "fix the file, or run with --no-known") from None
    version = here.version if here is not None else None
    return [k for k in entries if k.concerns(impl, version)]


def domains_line(stats: RunStats) -> str:
    """What the run drew of the prefix cache's domains and events (spec/tenancy.py)."""
    x = stats.extras
    return (
        f"domains: {x.get('cache_salt', 0)} salted, {x.get('lora', 0)} LoRA, "
        f"{x.get('mm', 0)} multimodal admissions; {stats.events} KV-cache events"
        + ("" if stats.events else " (none: prefix caching off, or the target emits none)")
    )


def print_table(o: Outcome) -> None:
    table = Table(title="Invariants", title_justify="left", expand=False)
    table.add_column("invariant", no_wrap=True, min_width=24)
    table.add_column("verdict", no_wrap=True)
    table.add_column("examples", justify="right")
    table.add_column("operations", justify="right")
    table.add_column("statement", max_width=58, overflow="fold")
    violated = {v.invariant for v in o.violations}
    for inv_id, inv in INVARIANTS.items():
        if o.focus is not None and inv_id not in o.focus:
            table.add_row(inv_id, "[dim]not selected[/]", "-", "-", f"[dim]{inv.title}[/]")
            continue
        ex, ops = o.tally.per_invariant.get(inv_id, [0, 0])
        if inv_id in violated:
            verdict = "[bold red]VIOLATED[/]"
        elif ex == 0:
            verdict = "[dim]not applicable[/]"
        elif o.status == "holds":
            verdict = "[green]holds[/]"
        elif o.status in ("violated", "error", KVSPEC_ERROR, "interrupted", *STOPPED_BY_TARGET):
            verdict = "[yellow]no violation seen[/]"  # the search stopped early
        else:
            verdict = "[yellow]holds (incomplete run)[/]"
        table.add_row(inv_id, verdict, str(ex), str(ops), escape(inv.title))
    out.print(table)
    seed = f"seed {o.seed}" if o.seed is not None else "derandomized"
    shrink = f", {o.tally.shrink_runs} shrinking runs" if o.tally.shrink_runs else ""
    out.print(
        f"{examples_line(o.tally.examples, o.requested)}, {o.tally.operations} operations, "
        f"<= {o.steps} steps each, profile {o.profile}, {seed}{shrink}, {o.seconds:.1f}s",
        markup=False,
    )
    out.print(domains_line(o.stats), markup=False)
    na = [i for i, (ex, _) in o.tally.per_invariant.items() if ex == 0 and i not in violated]
    for i in na:
        why = o.tally.inapplicable.get(i)
        reason = f"{why} in every configuration run" if why else "no example exercised it"
        out.print(f"  not applicable: {i}: {reason}", markup=False)


def report_outcome(
    args: argparse.Namespace,
    argv: list[str],
    o: Outcome,
    here: VllmHere | None,
    impl: str,
    overrides: dict[str, Any],
    *,
    out_dir: Path | None = None,
    annotate: dict[str, Any] | None = None,
) -> int:
    """Print one outcome; for a violation or crash, write its report and reproducer into
    ``out_dir`` (default: a new folder per run), with ``annotate``'s fields added."""
    if o.status == "holds":
        out.print(
            f"[green]every applicable invariant holds[/] over {o.tally.examples} examples",
        )
        return EXIT_OK
    if o.status == "no-examples":
        reason = o.error or "no example ran"
        if o.tally.rejected:
            reason = f"the target rejected every configuration drawn: {o.tally.rejected[0]}"
        raise UsageError(
            f"no example ran: {reason}", "relax --config (the target must accept the configuration)"
        )
    if o.status == "interrupted":
        out.print("[yellow]interrupted[/]: nothing is claimed")
        return 130
    if o.status == "incomplete":
        out.print(
            f"[yellow]only {o.tally.examples} of the {o.requested} requested examples ran[/]"
            + (f" ({o.error})" if o.error else "")
            + "; not a pass. A small configuration space can run out of distinct examples: "
            "lower --examples or widen --config."
        )
        return EXIT_FOUND
    if o.status == "violated":
        assert o.config is not None
        out.print(
            f"\n[bold red]violation[/] found and shrunk to {len(o.trace)} operation(s) "
            f"on {escape(o.config.describe())}:"
        )
        if o.minimized is not None:
            out.print(f"  ({escape(o.minimized)})")
        for v in o.violations:
            out.print(f"  [red]{escape(str(v))}[/]")
    else:  # error, hung, memory, nondeterministic
        print_failure(o)
        if o.config is None:
            out.print("[yellow]no configuration was recorded[/]: no report is written")
            return EXIT_FOUND
    out.print("trace (what the scheduler did -> what the target answered):")
    for i, s in enumerate(o.trace, 1):
        out.print(f"  {i}. {s.describe()}", markup=False, soft_wrap=True)
    out_dir = out_dir or output_dir(args, impl)
    if o.status == KVSPEC_ERROR:
        reason = "kvspec's own code raised: the report and `kvspec replay` show it"
        repro_info: dict[str, Any] = {"status": "not-available", "reason": reason, "path": None}
    elif o.status in STOPPED_BY_TARGET:
        # A standalone file re-runs the trace: on a hang or a runaway it would do it again, and
        # a nondeterministic target may not fail again.
        reason = f"the outcome is {o.status}; the JSON report and `kvspec replay` (under the same limits) reproduce it"
        out.print(f"[yellow]no standalone reproducer[/]: {escape(reason)}")
        repro_info = {"status": "not-available", "reason": reason, "path": None}
    else:
        repro_info = write_reproducer(args, o, here, impl, out_dir, annotate)
    report = build_report(
        outcome=o.status,
        impl=impl,
        implementation_name=_impl_name(impl, o, guard_of_outcome(o)),
        target=target_json(here, impl),
        config=o.config,
        run=o.run_json(overrides),
        trace=o.trace,
        violations=o.violations,
        error=o.error,
        reproducer=repro_info,
        command=["kvspec", *[a for a in argv if a != "--_in-target"]],
    )
    report.update(failure_json(o, limits_from(args)) if o.status != "violated" else {})
    report.update(annotate or {})
    path = write_report(out_dir / "report.json", report)
    out.print(f"report: {path}", markup=False, soft_wrap=True)
    draw_report(o, impl, out_dir, report)
    out.print(f"replay: kvspec replay {path}{replay_flags(here)}", markup=False, soft_wrap=True)
    return EXIT_KVSPEC_ERROR if o.status == KVSPEC_ERROR else EXIT_FOUND


def replay_flags(here: VllmHere | None) -> str:
    """The flags by which ``kvspec replay`` runs a report on the target it came from."""
    if here is not None and here.kind == "release":
        return f" --vllm {here.version}"
    if here is not None and here.kind == "source":
        return f" --vllm-source {here.source} --source-version {here.version}"
    return ""


def draw_report(o: Outcome, impl: str, out_dir: Path, report: dict[str, Any]) -> None:
    """The timeline and report.html of a block-manager report, drawn by replaying the trace on
    the target once more; not for a target that hung or ran away with memory (replaying would
    do it again)."""
    if o.status in (*STOPPED_BY_TARGET, KVSPEC_ERROR) or o.config is None:
        return
    config = o.config

    def shoot() -> Film:
        from kvspec.testing.artifacts.timeline import film

        return film(factory_for(impl)(config), o.trace, o.focus, o.violations)

    write_picture(out_dir, report, shoot, config.describe())


def _impl_name(impl: str, o: Outcome, name: str | None = None) -> str:
    if name is not None or o.status in STOPPED_BY_TARGET:
        return name or impl  # building the target again could hang or run away again
    try:
        with captured_fds():
            return str(factory_for(impl)(o.config).name)  # type: ignore[arg-type]
    except Exception:
        return impl


def output_dir(args: argparse.Namespace, impl: str) -> Path:
    if args.out:
        return Path(args.out).expanduser().resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path.cwd() / "kvspec-reports" / f"{impl.replace(':', '-')}-{stamp}"


def write_reproducer(
    args: argparse.Namespace,
    o: Outcome,
    here: VllmHere | None,
    impl: str,
    out_dir: Path,
    found: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the standalone reproducer if one can be made *and* it fails on this target.  Its
    re-run goes past the target's go_on known findings other than ``found``'s (``found_json``:
    the violation's fingerprint and known finding), as the search did, and the file checks the
    violation's own facts, not theirs."""
    assert o.config is not None
    meta = {
        "kvspec_version": kvspec.__version__,
        "vllm_version": here.version if here else None,
        "focus": list(o.focus) if o.focus is not None else None,
    }
    fp = (found or {}).get("fingerprint")
    known = known_for(args, impl, here)
    own = own_findings(
        known,
        Fingerprint(**fp) if fp else None,
        o.violations,
        o.config,
        o.trace,
        recorded=((found or {}).get("known_finding"),),
    )
    go_past = go_past_known(known, impl, here.version if here else None, own)
    return keep_reproducer(args, generate(impl, o.config, o.trace, o.violations, meta, go_past), out_dir)


def keep_reproducer(args: argparse.Namespace, made: Reproducer | NotReproducible, out_dir: Path) -> dict[str, Any]:
    """Keep a generated reproducer in ``out_dir`` if it fails on this target naming its
    invariant (unless ``--no-verify``); the report's ``reproducer`` entry either way."""
    if isinstance(made, NotReproducible):
        out.print(f"[yellow]no standalone reproducer[/]: {escape(made.reason)}")
        return {"status": "not-available", "reason": made.reason, "path": None}
    assert isinstance(made, Reproducer)
    if args.no_verify:
        path = write_atomic(out_dir / made.filename, made.text)
        out.print(f"reproducer (not verified): {path}", markup=False, soft_wrap=True)
        return {"status": "unverified", "path": str(path), "checks": list(made.checks)}
    verdict, detail, how = verify_reproducer(made, out_dir, limits_from(args))
    if verdict != "reproduces":
        out.print(
            f"[yellow]no standalone reproducer[/]: the generated file {detail}; "
            "the JSON report and `kvspec replay` reproduce it"
        )
        return {"status": "not-reproducible", "reason": detail, "path": None}
    path = out_dir / made.filename
    out.print(f"reproducer: {path}", markup=False, soft_wrap=True)
    out.print(
        f"  verified: plain pytest fails on this target with: {detail}",
        markup=False,
        soft_wrap=True,
    )
    out.print(f"  run it:   python -m pytest -q {path}", markup=False, soft_wrap=True)
    return {"status": "verified", "path": str(path), "checks": list(made.checks), "failure": detail,
            "verified_in": how}


def verify_reproducer(made: Reproducer, out_dir: Path, limits: Limits | None = None) -> tuple[str, str, str]:
    """Run the file with plain pytest (testing/artifacts/verify.py): in a child forked from this
    process, which has vLLM imported, under the run's ``limits``, and in a fresh interpreter
    (same environment) unless the fork reproduced; keep it only if it fails naming one of its
    invariants.  Written under a temporary folder, renamed when kept.  The verdict, its
    detail, and where the deciding run ran ("fork" or "subprocess")."""
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".verify-", dir=out_dir))
    try:
        candidate = write_atomic(scratch / made.filename, made.text)
        # The fork is made before the spinner's thread starts (a fork copies no other thread).
        verdict, detail, runs = verify(
            candidate,
            made.checks,
            rootdir=scratch,
            limits=limits if limits is not None else Limits(),
            fork=os.environ.get(NO_FORK_ENV) is None,
        )
        if verdict == REPRODUCES:
            os.replace(candidate, out_dir / made.filename)
        return verdict, detail, runs[-1].how
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# Set (to anything): verify reproducers only in a fresh interpreter, never in a forked child.
NO_FORK_ENV = "KVSPEC_VERIFY_NO_FORK"


# ------------------------------------------------------------------------------ replay


def cmd_replay(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        report = load_report(Path(args.report))
    except ReportError as error:
        raise UsageError(str(error), "pass a report.json written by kvspec check") from None
    # A verdict of the scheduler machine (cli/shapes.py) records vLLM's scheduler in a shape;
    # it replays on the V1 target of the release (``--impl v1``, whose scheduler it is).
    scheduler = report.get("machine") == "scheduler"
    try:
        config: Any = Shape(**report["shape"]) if scheduler else config_from_json(report["config"])
        trace = trace_from_json(report["trace"])
    except (ConfigError, KeyError, TypeError) as error:
        raise UsageError(f"{args.report}: {error}", "the report is damaged") from None
    # A verdict of one of kvspec's own schedulers (``kvspec fuzz --machine scheduler --impl
    # reference-scheduler``, ``broken-scheduler:<name>``) replays on that scheduler, without vLLM.
    own = report.get("implementation_name") if scheduler else None
    own_scheduler = own if own is not None and is_kvspec_scheduler(own) else None
    impl = args.impl or ("v1" if scheduler else report["impl"])
    if own_scheduler is not None and args.impl is None:
        impl = "reference"  # what resolves the target: kvspec's own code, no vLLM
    check_impl_name(impl)
    if scheduler and impl != "v1" and own_scheduler is None:
        raise UsageError(f"{args.report} is a scheduler verdict: it replays on vLLM's V1 scheduler", "drop --impl")
    if own_scheduler is not None and args.impl is not None:
        raise UsageError(f"{args.report} is a verdict of {own_scheduler}: it replays on it", "drop --impl")
    # By default, watch what the recorded run watched (its --invariant focus).
    focus = check_invariant_ids(args.invariant or (report.get("run") or {}).get("focus"))
    recorded = report.get("target") or {}
    if (
        needs_vllm(impl)
        and not (args.vllm or args.vllm_source or args.in_target)
        and recorded.get("kind") == "release"
        and recorded.get("vllm_version")
        and args.impl is None
    ):
        args.vllm = recorded["vllm_version"]  # by default, the release the report came from
        argv = [*argv, "--vllm", args.vllm]
    resolved = resolve(args, argv, impl)
    if isinstance(resolved, int):
        return resolved
    here, impl = resolved
    guard = Guard(limits_from(args, report.get("limits")))
    known_impl = own_scheduler or (SCHEDULER_IMPL if scheduler else impl)
    go_past = replay_go_past(args, report, trace, config if not scheduler else None,
                             config if scheduler else None, known_impl, here)
    if own_scheduler is not None:
        impl = own_scheduler
        guarded = guard.wrap(lookup_scheduler(own_scheduler).factory)
        mode = report.get("differential_mode")
        session = scheduler_session(config, Mode(mode) if mode else None, go_past)
    elif scheduler:
        guarded = guard.wrap(scheduler_factory())
        mode = report.get("differential_mode")
        session = scheduler_session(config, Mode(mode) if mode else None, go_past)
    else:
        guarded = guard.wrap(factory_for(impl))

    def quiet(config: Any) -> Any:
        with captured_fds():  # vLLM's import-time logging
            return guarded(config)

    what = own_scheduler or ("vLLM's V1 scheduler" if scheduler else describe_target(here, impl))
    err.print(f"replaying {len(trace)} operation(s) on {what}", markup=False)
    try:
        with guard.armed():
            result = (
                # The scheduler machine notes what it does through hypothesis: in a test's context.
                in_context(lambda: rerun(quiet, config, trace, focus=focus, session=session, go_past=go_past))
                if scheduler
                else rerun(quiet, config, trace, focus=focus, go_past=go_past)
            )
    except (ConfigError, Unsupported) as error:
        raise UsageError(
            f"{describe_target(here, impl)} cannot run the report's configuration "
            f"({config.describe()}): {error}",
            "replay it on another target",
        ) from None
    table = Table(title=f"Replay of {args.report}", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("operation", overflow="fold")
    table.add_column("recorded answer", overflow="fold")
    table.add_column("this target's answer", overflow="fold")
    for i, (old, new) in enumerate(zip(trace, result.trace, strict=False), 1):
        same = old.outcome == new.outcome
        shown = escape(new.outcome) if same else f"[yellow]{escape(new.outcome)}[/]"
        table.add_row(str(i), escape(_op_text(new)), escape(old.outcome), shown)
    out.print(table)
    return replay_verdict(report, trace, result, same_code(recorded, target_json(here, impl)))


def replay_go_past(
    args: argparse.Namespace,
    report: dict[str, Any],
    trace: list[TraceStep],
    config: Config | None,
    shape: Shape | None,
    impl: str,
    here: VllmHere | None,
) -> GoPast | None:
    """What a replay goes past, as the search that made the report did: the ``go_on`` known
    findings of the target (``--no-known``: none; ``--known FILE``: more) other than the report's
    own finding (what its run labelled it, and what its own violations match now)."""
    mine = known_for(args, impl, here)
    verdict = report.get("verdict") or {}
    recorded_fp = report.get("fingerprint") or verdict.get("fingerprint")
    try:
        violations = [Violation.from_json(v) for v in report.get("violations") or []]
        fp = Fingerprint(**recorded_fp) if isinstance(recorded_fp, dict) else None
    except TypeError as error:
        raise UsageError(f"{args.report}: {error}", "the report is damaged") from None
    if fp is None and violations:
        fp = Fingerprint(violations[0].invariant, trace[-1].op if trace else "teardown")
    own = own_findings(mine, fp, violations, config, trace, shape,
                       (report.get("known_finding"), verdict.get("known_finding")))
    return go_past_known(mine, impl, here.version if here is not None else None, own)


def _op_text(step: TraceStep) -> str:
    return step.describe().rsplit(" -> ", 1)[0]


__all__ = ["cmd_check", "cmd_replay"]
