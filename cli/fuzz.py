"""``kvspec fuzz``: a campaign of several worker processes over one hypothesis example database.

Each worker runs the stateful machine (random, not derandomized) in short hypothesis runs
that all share one *campaign key*, a digest of what the campaign checks (implementation,
release, configuration pins, invariants, machine), instead of hypothesis' per-function
digest.  So every worker -- on this machine or, with a shared database, on others -- reads and
writes the same entries: a failure one worker finds is shrunk and saved by hypothesis itself,
replayed first by every later run under the key (``Phase.reuse``), by the generated plain
pytest file, and, from the JSON report the campaign writes, by ``kvspec replay``.

Databases (``--database``): a directory (default: ``<out>/db``;
``DirectoryBasedExampleDatabase``), ``redis://host:port/n`` (``RedisExampleDatabase``, from
``pip install 'hypothesis[redis]'``), or ``github:owner/repo`` (``GitHubArtifactDatabase``,
read-only: failures CI stored, multiplexed with the local directory that receives new ones).

The campaign stops at its time limit or at the first failure a worker reports; known findings
are stepped past when this kvspec has the known-findings module (``kvspec.testing.known``).
Each worker runs the target under the same guard as ``kvspec check`` (testing/guard.py:
``--op-timeout``, ``--memory-cap``): a hanging or runaway target ends the campaign with the
same report (outcome ``hung`` or ``memory``, the trace up to the call, the limits) and exit
code.
No HypoFuzz: its licence forbids use inside commercial organisations.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import multiprocessing as mp
import queue as queue_mod
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
from rich.markup import escape

import kvspec

from .budget import BudgetSpent, Part
from .common import EXIT_FOUND, EXIT_OK, EXIT_USAGE, UsageError, err, out
from .failures import HEADLINE, STOPPED_BY_TARGET, add_limit_args, limits_from

CAMPAIGN_FORMAT = "kvspec-fuzz/1"
EXAMPLES_PER_RUN = 40  # one hypothesis run; the clock and the stop flag are read between runs
POLL_SECONDS = 0.5
JOIN_SECONDS = 20.0


@attrs.frozen
class Campaign:
    """What a campaign checks; its key names its entries in the example database."""

    impl: str
    vllm_version: str | None
    overrides: Mapping[str, Any]
    focus: tuple[str, ...] | None
    search: str  # "default" (KVCacheMachine), "swarm" (SwarmMachine), "scheduler" (cli/fuzz_scheduler.py)
    steps: int
    database: str

    def key(self) -> bytes:
        what = {k: v for k, v in self.to_json().items() if k not in ("database", "format")}
        digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]
        return f"{CAMPAIGN_FORMAT}:{digest}".encode()

    def to_json(self) -> dict[str, Any]:
        return {"format": CAMPAIGN_FORMAT, "impl": self.impl, "vllm_version": self.vllm_version,
                "overrides": dict(self.overrides), "focus": list(self.focus) if self.focus else None,
                "search": self.search, "steps": self.steps, "database": self.database}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Campaign:
        if data.get("format") != CAMPAIGN_FORMAT:
            raise UsageError(f"not a {CAMPAIGN_FORMAT} campaign: {data.get('format')!r}")
        focus = tuple(data["focus"]) if data.get("focus") else None
        return cls(data["impl"], data.get("vllm_version"), dict(data.get("overrides") or {}),
                   focus, data.get("search", "default"), int(data["steps"]), data["database"])


def open_database(url: str, local: Path | None = None):
    """The hypothesis example database a ``--database`` value names."""
    from hypothesis.database import (
        DirectoryBasedExampleDatabase,
        GitHubArtifactDatabase,
        MultiplexedDatabase,
        ReadOnlyDatabase,
    )

    if url.startswith(("redis://", "rediss://")):
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError:
            raise UsageError(
                "--database redis://... needs hypothesis' redis extra",
                "pip install 'hypothesis[redis]' into the target's venv",
            ) from None
        return RedisExampleDatabase(redis.Redis.from_url(url))
    if url.startswith("github:"):
        owner, _, repo = url.removeprefix("github:").partition("/")
        if not owner or not repo:
            raise UsageError(f"--database {url}: expected github:owner/repo")
        ci = ReadOnlyDatabase(GitHubArtifactDatabase(owner, repo))
        here = DirectoryBasedExampleDatabase(str(local or Path(".hypothesis/examples")))
        return MultiplexedDatabase(here, ci)
    return DirectoryBasedExampleDatabase(url)


def machine_class(search: str):
    if search == "scheduler":  # cli/fuzz_scheduler.py runs those campaigns
        raise UsageError("a scheduler campaign's database replays through its reports",
                         "kvspec replay <out>/worker-N/NN-<fingerprint>/report.json")
    if search == "swarm":
        from kvspec.testing.blockmanager.swarm import SwarmMachine

        return SwarmMachine
    from kvspec.testing import KVCacheMachine

    return KVCacheMachine


def campaign_test(campaign: Campaign, *, max_examples: int, record: dict[str, Any] | None = None,
                  step_past=None, replay_only: bool = False, guard=None, part: Part | None = None):
    """A zero-argument hypothesis test of the campaign under its database key; ``record``
    receives the last example's driver (after a failure: hypothesis' final replay of the
    shrunk example) and the run's counts.  ``replay_only``: run only what the database holds
    under the key (hypothesis' reuse phase), nothing new.  ``guard`` (testing.guard.Guard,
    armed by the caller) limits every call into the target.  ``part`` (cli/budget.py): no
    example starts after its deadline."""
    from hypothesis import Phase, settings
    from hypothesis.stateful import get_state_machine_test
    from kvspec.testing import profiles  # noqa: F401  (registers the profiles)

    from .run import config_strategy
    from .target import factory_for

    factory = factory_for(campaign.impl)
    if guard is not None:
        factory = guard.wrap(factory)
    strategy = config_strategy(campaign.impl, campaign.overrides)
    base = machine_class(campaign.search)
    kwargs: dict[str, Any] = {"focus": campaign.focus}
    if step_past is not None:
        kwargs["step_past"] = step_past
    box = record if record is not None else {}
    box.setdefault("examples", 0)
    box.setdefault("operations", 0)

    class Recorded(base):  # type: ignore[misc, valid-type]
        def teardown(self):
            if self.driver is not None:
                box["driver"] = self.driver
                box["examples"] += 1
                box["operations"] += len(self.driver.trace)
            super().teardown()

    def make():
        if part is not None:
            part.start_example()
        return Recorded(factory, strategy, **kwargs)

    profile = settings.get_profile("dev")
    phases = [Phase.explicit, Phase.reuse] if replay_only else profile.phases
    test = get_state_machine_test(make, settings=settings(
        profile, max_examples=max_examples, stateful_step_count=campaign.steps,
        derandomize=False, print_blob=False, report_multiple_bugs=False, phases=phases,
        database=open_database(campaign.database)))
    test._hypothesis_internal_database_key = campaign.key()

    # Older hypothesis releases pass the machine factory to the test; newer ones bind it.
    takes_factory = bool(inspect.signature(test).parameters)

    def run() -> None:
        test(make) if takes_factory else test()

    return run


def _known_policy(campaign: Campaign):
    """Known findings of this target stepped past, when this kvspec ships the module."""
    try:
        from kvspec.testing.known import SHIPPED, load_known, step_past_known
    except ImportError:
        return None
    return step_past_known(load_known([SHIPPED]), campaign.impl, campaign.vllm_version)


# ------------------------------------------------------------------------------ workers


def worker(campaign_json: dict[str, Any], index: int, deadline: float, results, stop,
           limits_json: dict[str, Any] | None = None) -> None:
    """One worker: hypothesis runs under the campaign key until the deadline, the stop flag,
    or a failure (reported, with the shrunk example's trace, to the coordinator); every call
    into the target runs under the guard's limits (``limits_json``: ``Limits.to_json``)."""
    import logging

    from hypothesis.reporting import with_reporter
    from kvspec.testing.guard import Guard, GuardTripped, Limits

    logging.getLogger("vllm").setLevel(logging.ERROR)
    campaign = Campaign.from_json(campaign_json)
    record: dict[str, Any] = {}
    guard = Guard(Limits(**limits_json) if limits_json is not None else Limits())
    # The campaign's deadline as this process's monotonic clock: no example starts after it.
    part = Part(f"worker {index}", deadline - time.time(), time.monotonic() + deadline - time.time())
    try:
        with guard.armed():
            test = campaign_test(campaign, max_examples=EXAMPLES_PER_RUN, record=record,
                                 step_past=_known_policy(campaign), guard=guard, part=part)
            runs = 0
            # One run at least, however late the worker started: its first example always
            # runs (a worker that ran nothing claims nothing); the part's deadline cuts the rest.
            while (runs == 0 or time.time() < deadline) and not stop.is_set():
                try:
                    with with_reporter(lambda _text: None):  # hypothesis' "@seed" note on the stop
                        test()
                except BudgetSpent:
                    break
                runs += 1
                results.put({"worker": index, "kind": "progress", "runs": runs,
                             "examples": record["examples"], "operations": record["operations"]})
    except GuardTripped as trip:  # hung or ran away: the trace and config the trip carries
        results.put({
            "worker": index, "kind": "failure", "outcome": trip.kind,
            "error_type": type(trip).__name__, "message": trip.message, "violations": [],
            "config": attrs.asdict(trip.config) if trip.config is not None else None,
            "trace": [s.to_json() for s in trip.trace],
            "examples": record.get("examples", 0), "operations": record.get("operations", 0)})
        return
    except BaseException as error:  # a violation or a crash of the target: the finding
        driver = record.get("driver")
        results.put({
            "worker": index, "kind": "failure", "error_type": type(error).__name__,
            "message": str(error)[:4000],
            "violations": [v.to_json() for v in getattr(error, "violations", [])],
            "config": attrs.asdict(driver.config) if driver is not None else None,
            "trace": [s.to_json() for s in driver.trace] if driver is not None else [],
            "examples": record.get("examples", 0), "operations": record.get("operations", 0)})
        return
    part.close()
    results.put({"worker": index, "kind": "done", "examples": record["examples"],
                 "operations": record["operations"], "seconds": round(part.seconds, 2)})


def messages(results, procs, give_up: float) -> Iterator[dict[str, Any]]:
    """The workers' messages as they come, until every worker has exited with nothing left to
    read, or ``give_up`` (``time.time()``) has passed with none coming."""
    while True:
        try:
            yield results.get(timeout=POLL_SECONDS)
        except queue_mod.Empty:
            if time.time() > give_up or not any(p.is_alive() for p in procs):
                return


# ------------------------------------------------------------------------------ the command


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "fuzz",
        help="a campaign: N worker processes over one shared hypothesis example database",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=2, metavar="N", help="worker processes")
    p.add_argument("--database", metavar="URL",
                   help="directory, redis://host:port/n or github:owner/repo (default <out>/db)")
    p.add_argument("--minutes", type=float, default=10.0, help="time limit of the campaign")
    p.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="time limit of the campaign in seconds (instead of --minutes); each worker "
                   "starts no example after it, and the summary says what each worker got")
    p.add_argument("--steps", type=int, default=40, help="operations per example, at most")
    p.add_argument("--machine", choices=("block-manager", "scheduler"), default="block-manager",
                   help="block-manager: the block-manager machine (--search); scheduler: the "
                   "scheduler machine in the production shapes (testing/scheduler/machine.py), on "
                   "vLLM's V1 scheduler or, with --impl reference-scheduler or "
                   "broken-scheduler:<name>, on kvspec's (cli/fuzz_scheduler.py)")
    p.add_argument("--search", choices=("default", "swarm"), default="default",
                   help="the block-manager machine: KVCacheMachine or SwarmMachine "
                   "(testing/blockmanager/swarm.py)")
    p.add_argument("--until", action="append", metavar="ID",
                   help="--machine scheduler: stop once this known finding (FINDINGS.md id) is "
                   "reported (time to a finding); repeatable")
    p.add_argument("--invariant", action="append", metavar="ID", help="watch only these")
    p.add_argument("--config", action="append", metavar="KEY=VALUE",
                   help="pin a configuration field or feature (as kvspec check)")
    p.add_argument("--out", metavar="DIR", help="campaign folder (default ./kvspec-fuzz/<impl>-<time>)")
    add_limit_args(p)
    return p


def campaign_seconds(args: argparse.Namespace) -> float:
    """The campaign's wall-clock budget (``--time-budget``, else ``--minutes``), validated."""
    seconds = args.time_budget if args.time_budget is not None else 60 * args.minutes
    if args.workers < 1 or seconds <= 0:
        raise UsageError("--workers must be >= 1 and --minutes (--time-budget) > 0",
                         "a campaign that runs nothing proves nothing")
    return seconds


def cmd_fuzz(args: argparse.Namespace, argv: list[str]) -> int:
    from kvspec.testing.artifacts.report import build_report, config_from_json, trace_from_json, write_report

    from .check import check_invariant_ids, describe_target, resolve, target_json
    from .run import parse_overrides

    seconds_given = campaign_seconds(args)
    if args.until:
        raise UsageError("--until names a known finding the scheduler campaign reports",
                         "add --machine scheduler (the block-manager campaign steps past known findings)")
    overrides = parse_overrides(args.config or [])
    focus = check_invariant_ids(args.invariant)
    limits = limits_from(args)
    resolved = resolve(args, argv, args.impl)
    if isinstance(resolved, int):
        return resolved
    here, impl = resolved
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = Path(args.out or Path.cwd() / "kvspec-fuzz" / f"{impl.replace(':', '-')}-{stamp}")
    folder = folder.expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    database = args.database or str(folder / "db")
    campaign = Campaign(impl, here.version if here is not None else None, overrides, focus,
                        args.search, args.steps, database)
    (folder / "campaign.json").write_text(json.dumps(campaign.to_json(), indent=1) + "\n")
    _write_pytest(folder, campaign)
    err.print(f"kvspec {kvspec.__version__}: fuzzing {describe_target(here, impl)} with "
              f"{args.workers} worker(s) for {seconds_given:g} s; database {database}; "
              f"key {campaign.key().decode()}", markup=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    stop = ctx.Event()
    deadline = time.time() + seconds_given
    procs = [ctx.Process(target=worker, args=(campaign.to_json(), i, deadline, results, stop,
                                              limits.to_json()), daemon=True)
             for i in range(args.workers)]
    start = time.time()
    for proc in procs:
        proc.start()
    progress: dict[int, dict[str, Any]] = {}
    failure: dict[str, Any] | None = None
    finished = 0
    for msg in messages(results, procs, deadline + JOIN_SECONDS * 3):
        progress[msg["worker"]] = msg
        if msg["kind"] == "failure":
            failure = msg
            break
        if msg["kind"] == "done":
            finished += 1
            if finished == len(procs):
                break
    stop.set()
    for proc in procs:
        proc.join(JOIN_SECONDS)
        if proc.is_alive():
            proc.terminate()
    examples = sum(m.get("examples", 0) for m in progress.values())
    operations = sum(m.get("operations", 0) for m in progress.values())
    seconds = time.time() - start
    per_worker = {i: {"examples": m.get("examples", 0), "operations": m.get("operations", 0),
                      "seconds": m.get("seconds")} for i, m in sorted(progress.items())}
    summary = {**campaign.to_json(), "key": campaign.key().decode(), "workers": args.workers,
               "seconds": round(seconds, 1), "examples": examples, "operations": operations,
               "time_budget": seconds_given, "per_worker": per_worker,
               "outcome": "failure" if failure else "no failure"}
    out.print(f"{examples} examples, {operations} operations in {seconds:.0f} s over "
              f"{args.workers} worker(s)", markup=False)
    for i, got in per_worker.items():
        took = f"{got['seconds']:.1f} s" if got["seconds"] is not None else "still running at the end"
        out.print(f"  worker {i}: {got['examples']} examples, {got['operations']} operations, {took}", markup=False)
    if failure is None:
        if not examples or not operations:
            out.print("[red]no example ran[/]: nothing is claimed" if not examples else
                      "[red]no operation ran[/]: every example ended before its first operation; nothing is claimed")
            (folder / "summary.json").write_text(json.dumps({**summary, "outcome": "nothing ran"}))
            return EXIT_FOUND
        out.print("[green]no failure[/] (stopped on time)")
        (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return EXIT_OK
    if failure["config"] is None:  # it failed before any example ran: not a finding
        out.print(f"[red]worker {failure['worker']} could not run[/]: {failure['error_type']}: "
                  f"{escape(failure['message'][:2000])}")
        (folder / "summary.json").write_text(json.dumps({**summary, "outcome": "worker error"}))
        return EXIT_USAGE
    stopped = failure.get("outcome") if failure.get("outcome") in STOPPED_BY_TARGET else None
    if stopped:
        out.print(f"[bold red]worker {failure['worker']}: {HEADLINE[stopped]}[/]", highlight=False)
    else:
        out.print(f"[bold red]worker {failure['worker']} found a failure[/] "
                  f"({failure['error_type']}):", highlight=False)
    out.print(failure["message"].splitlines()[0] if failure["message"] else "", markup=False)
    from kvspec.spec.invariants import Violation

    config = config_from_json(failure["config"])
    trace = trace_from_json(failure["trace"])
    violations = [Violation.from_json(v) for v in failure["violations"]]
    outcome = stopped or ("violated" if violations else "error")
    report = build_report(
        outcome=outcome, impl=impl, implementation_name=impl,
        target=target_json(here, impl), config=config,
        run={"profile": "fuzz", "seed": None, "derandomized": False,
             "steps_per_example": args.steps, "examples_run": examples,
             "operations_run": operations, "seconds": round(seconds, 2),
             "focus": list(focus) if focus else None, "config_overrides": dict(overrides),
             "campaign": summary},
        trace=trace, violations=violations,
        error=None if violations else failure["message"], command=["kvspec", *argv])
    report["limits"] = limits.to_json()
    if trace and trace[-1].crash is not None:
        report["crash"] = {**trace[-1].crash.to_json(), "step": len(trace), "traceback": []}
    report_path = write_report(folder / "report.json", report)
    for i, s in enumerate(trace, 1):
        out.print(f"  {i}. {s.describe()}", markup=False, soft_wrap=True)
    summary["report"] = str(report_path)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    where = f" --vllm {here.version}" if here is not None and here.kind == "release" else ""
    if stopped:
        # hypothesis stores no example that ended on a limit (the search stops at once).
        out.print("replay it (under the same limits):", markup=False)
    else:
        out.print(f"stored in the database under {campaign.key().decode()}; replay it:", markup=False)
        out.print(f"  python -m pytest -q {folder / 'test_fuzz_replay.py'}", markup=False, soft_wrap=True)
    out.print(f"  kvspec replay {report_path}{where}", markup=False, soft_wrap=True)
    return EXIT_FOUND


def _write_pytest(folder: Path, campaign: Campaign) -> Path:
    """A plain pytest file: the campaign's test under its key, running only what the
    database stores (hypothesis' reuse phase): it fails while a stored failure reproduces."""
    text = (
        f'"""Replays the failures the kvspec fuzz campaign in this folder stored in its example\n'
        f'database ({campaign.database}); run it in the target\'s venv: python -m pytest -q."""\n\n'
        "import json\n"
        "from pathlib import Path\n\n"
        "from kvspec.cli.fuzz import Campaign, campaign_test\n\n"
        "CAMPAIGN = Campaign.from_json(json.loads((Path(__file__).parent / 'campaign.json')"
        ".read_text()))\n\n\n"
        "def test_fuzz_campaign():\n"
        "    campaign_test(CAMPAIGN, max_examples=1, replay_only=True)()\n"
    )
    path = folder / "test_fuzz_replay.py"
    path.write_text(text)
    return path

