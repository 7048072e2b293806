"""``kvspec fuzz --machine scheduler``: a campaign of the scheduler machine over one database.

The workers run the scheduler machine (testing/scheduler/machine.py) in the production shapes
(cli/shapes.py ``run_scheduler_search``) on vLLM's V1 scheduler (a V1 target) or on one of
kvspec's (``--impl reference-scheduler``, ``--impl broken-scheduler:<name>``), every
hypothesis run under the campaign's key in the shared example database (cli/fuzz.py
``Campaign``; ``search`` "scheduler").  Each worker runs searches of ``EXAMPLES_PER_SEARCH``
examples until the campaign's deadline or its stop; a search's rounds step past what the
worker reported before, and report a known finding of the target the first time they meet it
(shrunk there, labelled by its id: ``search_rounds``' ``hunt``), not by searching for it again
afterwards, which a finding met once in thousands of examples would not survive.

Each example draws its shape under a swarm configuration of its own (testing/scheduler/swarm.py,
``swarm_shapes``).  A search ends at its first verdict (the next draws a fresh seed); once the
worker has reported, its searches leave the database unreplayed (what it holds is what was
reported); the known findings the coordinator reported (``REPORTED_FILE``) are stepped past by
every worker from its next search on, and a worker shrinking one of them stops
(``CampaignPart``): a reported finding's neighbourhood does not take the campaign over.

Each verdict a worker meets is written by that worker, at once, into
``<out>/worker-N/NN-<fingerprint>/`` (``write_scheduler_reports``: report.json, trace.txt,
the timeline); the coordinator deduplicates verdicts across workers by identity (the known
finding's id, else the fingerprint), keeps the first report of each and lists the others.
The campaign stops at its deadline, at the first verdict no known finding names (a new bug,
as the block-manager campaign), at a hang, a memory runaway or kvspec's own error, or once
every ``--until`` finding is reported.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
from rich.markup import escape

import kvspec

from .budget import BudgetSpent, Part
from .common import EXIT_FOUND, EXIT_OK, EXIT_USAGE, UsageError, err, out
from .failures import KVSPEC_ERROR, STOPPED_BY_TARGET, limits_from
from .target import is_kvspec_scheduler

SCHEDULER_SEARCH = "scheduler"  # ``Campaign.search`` of a scheduler campaign
EXAMPLES_PER_SEARCH = 100  # per round of one search; the clock and the stop flag cut it sooner
JOIN_SECONDS = 30.0  # a worker may be shrinking, or drawing a report, when the campaign stops
ENDS_CAMPAIGN = (*STOPPED_BY_TARGET, KVSPEC_ERROR)
NO_OPERATION = "every example ended before its first operation (discarded, or failed at its first check)"


@attrs.define
class CampaignPart(Part):
    """A worker's share of the campaign (cli/budget.py ``Part``): no example starts after the
    deadline, nor once the coordinator has set the stop flag (its first example always runs)."""

    stop: Any = None  # multiprocessing.Event
    folder: Path | None = None  # the campaign's folder (``REPORTED_FILE``)
    sieve: Any = None  # the step-past policy of the round running (cli/search.py ``Sieve``)

    def watch(self, step_past: Any) -> None:
        self.sieve = step_past

    def start_example(self) -> None:
        if self.examples and not self.failing and self.stop is not None and self.stop.is_set():
            self.cut = True
            raise BudgetSpent(self.name)
        if self.shrinking_what_was_reported():
            # Another worker reported the known finding this round is shrinking: the round ends
            # (no verdict of its own), and the next search steps past the finding.
            raise BudgetSpent(self.name)
        super().start_example()

    def shrinking_what_was_reported(self) -> bool:
        target = self.sieve.target if self.sieve is not None else None
        return isinstance(target, str) and self.folder is not None and target in reported_by_campaign(self.folder)


REPORTED_FILE = "reported.txt"  # the known findings the campaign reported, one id a line


def reported_by_campaign(folder: Path) -> list[str]:
    """The known findings the coordinator has reported so far (``REPORTED_FILE``)."""
    try:
        return (folder / REPORTED_FILE).read_text().split()
    except FileNotFoundError:
        return []


def identity_text(found: Any) -> str:
    """A verdict's identity as the coordinator compares it: the known finding's id, else the
    fingerprint."""
    return found.known.id if found.known is not None else found.fingerprint.describe()


# ------------------------------------------------------------------------------ workers


def scheduler_worker(campaign_json: dict[str, Any], index: int, deadline: float, results, stop,
                     limits_json: dict[str, Any], folder: str, target: dict[str, Any],
                     command: list[str], replay_hint: str) -> None:
    """One worker: scheduler searches under the campaign key until the deadline or the stop;
    each verdict not reported before is written (its report folder under ``folder/worker-N``)
    and sent to the coordinator.  What it prints goes to ``folder/worker-N.log``."""
    import logging

    from kvspec.testing.guard import Guard, GuardTripped, Limits
    from kvspec.testing.implementations import lookup_scheduler
    from kvspec.testing.known import SHIPPED, load_known
    from kvspec.testing.scheduler.machine import kv_connectors_of, multimodal_of, retention_offer_of, swarm_shapes

    from . import common
    from .fuzz import Campaign, open_database
    from .search import Search
    from .shapes import SCHEDULER_IMPL, SchedulerRun, ShapesOutcome, run_scheduler_search, write_scheduler_reports

    logging.getLogger("vllm").setLevel(logging.ERROR)
    campaign = Campaign.from_json(campaign_json)
    base = Path(folder)
    log = (base / f"worker-{index}.log").open("a", buffering=1)  # line by line: readable while it runs
    common.out.file = log  # the verdicts as kvspec check prints them, per worker
    common.err.file = log
    part = CampaignPart(f"worker {index}", deadline - time.time(),
                        time.monotonic() + deadline - time.time(), stop=stop, folder=base)
    guard = Guard(Limits(**limits_json))
    examples = operations = searches = 0
    shape_examples: Counter[str] = Counter()
    shape_operations: Counter[str] = Counter()
    reported: list[Any] = []
    written = 0

    def progress(kind: str) -> dict[str, Any]:
        return {"worker": index, "kind": kind, "searches": searches, "examples": examples,
                "started": part.examples,
                "operations": operations, "per_shape": {t: [shape_examples[t], shape_operations[t]]
                                                        for t in sorted(shape_examples)}}

    try:
        with guard.armed():
            impl = lookup_scheduler(campaign.impl)
            factory = impl.factory
            # read before the guard wraps it; every production shape ``kvspec check`` draws, each
            # example under a swarm configuration of its own (testing/scheduler/swarm.py)
            strategy = swarm_shapes(retention_offer_of(factory), kv_connectors_of(factory), multimodal_of(factory))
            guarded = guard.wrap(factory)
            known = ([k for k in load_known([SHIPPED]) if k.concerns(SCHEDULER_IMPL, campaign.vllm_version)]
                     if impl.is_vllm else [])
            database = open_database(campaign.database)

            def report(found: Any) -> None:
                """Write a verdict's report folder at once, and send it to the coordinator."""
                nonlocal written
                if found.identity in reported:
                    return
                reported.append(found.identity)
                written += 1
                summary = ShapesOutcome(found.outcome.status, found.outcome.counts, seed=found.outcome.seed)
                only = SchedulerRun(Search([found], [found.outcome], Counter(), known), summary, guarded,
                                    campaign.impl)
                entry = write_scheduler_reports(
                    only, base / f"worker-{index}", written,
                    lambda: {"target": target, "command": command, "limits": limits_json}, replay_hint)[0]
                o = found.outcome
                results.put({**progress("verdict"), "identity": identity_text(found),
                             "fingerprint": found.fingerprint.describe(),
                             "known": found.known.id if found.known is not None else None,
                             "status": o.status, "verdict_kind": entry["kind"], "report": entry["report"],
                             "at": time.time(), "shape": o.shape.describe() if o.shape is not None else None,
                             "message": (o.error or "; ".join(str(v) for v in o.violations[:2]))[:400]})

            while (searches == 0 or time.time() < deadline) and not stop.is_set():
                # What another worker reported is a repeat here too (not shrunk again).
                elsewhere = [i for i in reported_by_campaign(base) if i not in reported]
                # One verdict a search: the next search draws a fresh seed instead of replaying
                # this one's examples up to the verdict.  Once this worker has reported, its
                # searches leave the database unreplayed: what it holds is what the campaign
                # reported (replayed, it is stepped past, re-run in every search and deleted).
                run = run_scheduler_search(
                    guarded, shape_strategy=strategy, profile="dev", examples=EXAMPLES_PER_SEARCH,
                    steps=campaign.steps, seed=None, focus=campaign.focus, part=part, known=known,
                    reported=[*reported, *elsewhere], hunt=[k.id for k in known], on_found=report,
                    database=database, database_key=campaign.key(), max_violations=1,
                    replay=not (reported or elsewhere))
                searches += 1
                examples += run.summary.examples
                operations += run.summary.operations
                shape_examples.update(run.summary.counts.examples)
                shape_operations.update(run.summary.counts.operations)
                for found in run.search.found:  # a verdict no round announced (a crash before any driver)
                    report(found)
                results.put(progress("progress"))
                if run.summary.status in ENDS_CAMPAIGN or run.search.stopped == "interrupted":
                    break
                if part.past_deadline() or part.cut:
                    break
    except GuardTripped as trip:  # outside a search's rounds (building the first scheduler)
        results.put({**progress("failure"), "error_type": type(trip).__name__, "message": trip.message})
        return
    except BaseException as error:  # the worker could not run: the coordinator says so
        results.put({**progress("failure"), "error_type": type(error).__name__, "message": str(error)[:4000]})
        return
    finally:
        log.flush()
    part.close()
    results.put({**progress("done"), "seconds": round(part.seconds, 2), "budget": part.to_json()})


# ------------------------------------------------------------------------------ the command


def cmd_fuzz_scheduler(args: argparse.Namespace, argv: list[str], seconds_given: float) -> int:
    """The scheduler campaign (module docstring); ``seconds_given``: its time limit."""
    from kvspec.testing.artifacts.report import write_atomic
    from kvspec.testing.implementations import SCHEDULERS, lookup_scheduler
    from kvspec.testing.known import SHIPPED, load_known

    from .check import check_invariant_ids, describe_target, replay_flags, resolve, target_json
    from .fuzz import Campaign, messages
    from .shapes import SCHEDULER_IMPL

    if args.search != "default" or args.config:
        raise UsageError("--search and --config choose the block-manager machine's search",
                         "drop them with --machine scheduler (it draws production shapes)")
    focus = check_invariant_ids(args.invariant)
    limits = limits_from(args)
    if is_kvspec_scheduler(args.impl):
        if args.vllm or args.vllm_source:
            raise UsageError(f"--impl {args.impl} runs without vLLM; --vllm/--vllm-source do not apply",
                             "drop --vllm/--vllm-source, or drop --impl for vLLM's V1 scheduler")
        here, scheduler, target = None, args.impl, target_json(None, args.impl)
        what = f"{args.impl} (kvspec's own scheduler, no vLLM)"
    else:
        if args.impl not in (None, "v1"):
            kvspec_ones = ", ".join(n for n, s in SCHEDULERS.items() if not s.is_vllm)
            raise UsageError(f"--machine scheduler drives a scheduler: --impl {args.impl} is not one",
                             f"drop --impl (vLLM's V1 scheduler) or pick one of {kvspec_ones}")
        resolved = resolve(args, argv, args.impl)
        if isinstance(resolved, int):
            return resolved
        here, impl = resolved
        if here is None or impl != "v1":
            raise UsageError(f"--machine scheduler drives vLLM's V1 scheduler; the target runs {impl}",
                             "pick a V1 release (--vllm 0.33.0), or --impl reference-scheduler")
        scheduler, target = SCHEDULER_IMPL, target_json(here, impl)
        what = f"vLLM's V1 scheduler ({describe_target(here, impl)})"
        lookup_scheduler(SCHEDULER_IMPL)
    version = here.version if here is not None else None
    known_ids = [k.id for k in load_known([SHIPPED]) if k.concerns(scheduler, version)]
    until = list(dict.fromkeys(args.until or []))
    missing = [u for u in until if u not in known_ids]
    if missing:
        raise UsageError(f"--until {', '.join(missing)}: not a known finding of {scheduler} on {version}",
                         f"known here: {', '.join(known_ids) or 'none'}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = Path(args.out or Path.cwd() / "kvspec-fuzz" / f"{scheduler.replace(':', '-')}-{stamp}")
    folder = folder.expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    database = args.database or str(folder / "db")
    campaign = Campaign(scheduler, version, {}, focus, SCHEDULER_SEARCH, args.steps, database)
    (folder / "campaign.json").write_text(json.dumps(campaign.to_json(), indent=1) + "\n")
    err.print(f"kvspec {kvspec.__version__}: fuzzing {what} in the production shapes with "
              f"{args.workers} worker(s) for {seconds_given:g} s; database {database}; "
              f"key {campaign.key().decode()}", markup=False)
    command = ["kvspec", *[a for a in argv if a != "--_in-target"]]
    hint = replay_flags(here)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    stop = ctx.Event()
    start = time.time()
    deadline = start + seconds_given
    procs = [ctx.Process(target=scheduler_worker, daemon=True, args=(
        campaign.to_json(), i, deadline, results, stop, limits.to_json(), str(folder), target, command, hint))
        for i in range(args.workers)]
    for proc in procs:
        proc.start()
    latest: dict[int, dict[str, Any]] = {}
    verdicts: dict[str, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    finished = 0
    why = "the time limit"
    for msg in messages(results, procs, deadline + JOIN_SECONDS * 3):
        latest[msg["worker"]] = msg
        if msg["kind"] == "failure":
            failures.append(msg)
        if msg["kind"] in ("done", "failure"):
            finished += 1
            if finished == len(procs):
                break
        if msg["kind"] != "verdict":
            continue
        seconds = msg["at"] - start
        first = verdicts.get(msg["identity"])
        if first is not None:  # another worker met it too: one verdict, its reports listed
            first["also"].append({"worker": msg["worker"], "seconds": round(seconds, 1), "report": msg["report"]})
            continue
        verdicts[msg["identity"]] = {
            "identity": msg["identity"], "fingerprint": msg["fingerprint"], "known_finding": msg["known"],
            "status": msg["status"],
            "kind": msg["verdict_kind"], "worker": msg["worker"], "seconds": round(seconds, 1),
            # Examples the workers had started by then (each worker's count at its last message).
            "campaign_examples_then": sum(m.get("started", 0) for m in latest.values()),
            "shape": msg["shape"], "message": msg["message"], "report": msg["report"], "also": []}
        if msg["known"]:  # the workers step past it from their next search on
            write_atomic(folder / REPORTED_FILE, "".join(f"{v['known_finding']}\n" for v in verdicts.values()
                                                         if v["known_finding"]))
        label = f"known finding {msg['known']}" if msg["known"] else "[bold red]new[/]"
        out.print(f"{seconds:7.1f} s  worker {msg['worker']}: {label}: {escape(msg['fingerprint'])} "
                  f"({msg['verdict_kind']})", soft_wrap=True)
        if not stop.is_set():
            if msg["status"] in ENDS_CAMPAIGN:
                why = f"a verdict that ends the campaign ({msg['status']})"
                stop.set()
            elif msg["known"] is None:
                why = "the first new verdict"
                stop.set()
            elif until and all(u in verdicts for u in until):
                why = f"--until {' '.join(until)}: reported"
                stop.set()
    stop.set()
    for proc in procs:
        proc.join(JOIN_SECONDS)
        if proc.is_alive():
            proc.terminate()
    seconds = time.time() - start
    unmet = [u for u in until if u not in verdicts]
    if unmet:
        out.print(f"[yellow]--until {' '.join(unmet)}: not met[/] within the campaign")
    return _summarise(args, campaign, folder, latest, verdicts, failures, seconds, seconds_given, why, hint,
                      unmet)


def _summarise(args: argparse.Namespace, campaign: Any, folder: Path, latest: dict[int, dict[str, Any]],
               verdicts: dict[str, dict[str, Any]], failures: list[dict[str, Any]], seconds: float,
               seconds_given: float, why: str, hint: str, unmet: list[str] | None = None) -> int:
    """Print and write (summary.json) what the campaign ran and met; its exit code.  ``unmet``:
    the ``--until`` findings not reported (``until_unmet``)."""
    from kvspec.spec.groups import SHAPE_TAGS

    examples = sum(m.get("examples", 0) for m in latest.values())
    operations = sum(m.get("operations", 0) for m in latest.values())
    per_shape: dict[str, list[int]] = {}
    for m in latest.values():
        for tag, (ex, ops) in (m.get("per_shape") or {}).items():
            got = per_shape.setdefault(tag, [0, 0])
            got[0] += ex
            got[1] += ops
    per_worker = {i: {"searches": m.get("searches", 0), "examples": m.get("examples", 0),
                      "operations": m.get("operations", 0), "seconds": m.get("seconds"),
                      "budget": m.get("budget")} for i, m in sorted(latest.items())}
    out.print(f"{examples} examples, {operations} operations in {seconds:.0f} s over {args.workers} "
              f"worker(s) (time limit {seconds_given:g} s); stopped at {why}", markup=False)
    for i, got in per_worker.items():
        took = f"{got['seconds']:.1f} s" if got["seconds"] is not None else "still running at the end"
        out.print(f"  worker {i}: {got['searches']} searches, {got['examples']} examples, "
                  f"{got['operations']} operations, {took}", markup=False)
    # The seconds each shape's examples took, from the workers' parts (an example of several
    # shapes counts in each).
    shape_seconds: Counter[str] = Counter()
    for got in per_worker.values():
        for tag, (_n, secs) in ((got["budget"] or {}).get("per_shape") or {}).items():
            shape_seconds[tag] += secs
    for tag in SHAPE_TAGS:
        ex, ops = per_shape.get(tag, (0, 0))
        if ex:
            took = f" {shape_seconds[tag]:7.1f} s" if tag in shape_seconds else ""
            out.print(f"  {tag:<20} {ex:>6} examples {ops:>8} operations{took}", markup=False)
        else:
            out.print(f"  {tag:<20} [yellow]no example ran in this shape[/]")
    summary = {**campaign.to_json(), "key": campaign.key().decode(), "machine": "scheduler",
               "workers": args.workers, "seconds": round(seconds, 1), "time_budget": seconds_given,
               "stopped_at": why, "examples": examples, "operations": operations,
               "per_worker": per_worker, "per_shape": per_shape, "verdicts": list(verdicts.values()),
               "until_unmet": unmet or [],
               "worker_errors": [{k: f.get(k) for k in ("worker", "error_type", "message")} for f in failures]}
    for f in failures:
        out.print(f"[red]worker {f['worker']} could not run[/]: {escape(f['error_type'])}: "
                  f"{escape(f['message'][:2000])}")
    if verdicts:
        out.rule(f"{len(verdicts)} distinct verdict(s)")
        for v in verdicts.values():
            label = f"known finding {v['known_finding']}" if v["known_finding"] else "new"
            also = f"; also met by worker(s) {', '.join(str(a['worker']) for a in v['also'])}" if v["also"] else ""
            out.print(f"{label}: {escape(v['fingerprint'])}, {v['kind']}, worker {v['worker']} at {v['seconds']:.1f} s "
                      f"(campaign examples by then: about {v['campaign_examples_then']}){also}", soft_wrap=True)
            if v["shape"]:
                out.print(f"  shape: {escape(v['shape'])}", soft_wrap=True)
            out.print(f"  report: {v['report']}", markup=False, soft_wrap=True)
            out.print(f"  replay: kvspec replay {v['report']}{hint}", markup=False, soft_wrap=True)
        outcome, code = "found", EXIT_FOUND
        if not operations:  # the verdicts above are all it met: it searched nothing behind them
            out.print(f"[red]no operation ran[/]: {NO_OPERATION}; nothing is claimed beyond the verdicts above")
    elif not examples:
        out.print("[red]no example ran[/]: nothing is claimed")
        outcome, code = ("worker error", EXIT_USAGE) if failures else ("nothing ran", EXIT_FOUND)
    elif not operations:
        out.print(f"[red]no operation ran[/]: {NO_OPERATION}; nothing is claimed")
        outcome, code = "nothing ran", EXIT_FOUND
    elif failures:
        outcome, code = "worker error", EXIT_FOUND  # part of the campaign did not run
    else:
        out.print("[green]no verdict[/] (stopped on time)")
        outcome, code = "no failure", EXIT_OK
    summary["nothing_ran"] = not operations  # no operation ran, whatever the outcome
    (folder / "summary.json").write_text(json.dumps({**summary, "outcome": outcome}, indent=1) + "\n")
    out.print(f"summary: {folder / 'summary.json'}; worker logs: {folder}/worker-N.log", markup=False,
              soft_wrap=True)
    return code
