"""PR mode (``kvspec check ... --baseline BASE``), ``kvspec diff A B`` and ``kvspec bisect``.

PR mode answers the two questions a pull request's reviewer asks: does HEAD break anything, and
what does it change?  Every drawn example runs on HEAD and BASE in lockstep
(``kvspec.testing.lockstep``: two guarded target processes, the same operations in the same
order, their observations compared after each); at the first difference the spec judges:
HEAD violates an invariant BASE does not -> regression (exit 1), the reverse -> fix, neither ->
behaviour change, which comes with a golden pytest file asserting BASE's value at the differing
call, kept only once it has failed on HEAD and passed on BASE (``--fail-on-change`` makes a
behaviour change fail the PR).  On the V1 engine (unless ``--no-shapes``) vLLM's own V1
scheduler runs in lockstep too (testing/scheduler/lockstep.py: the scheduler machine's
operations on both sides, what each step scheduled, preempted and finished, the blocks and
tables per KV-cache group, the prefix hits compared after each; verdicts judged alike, a
behaviour change with its golden file, ``golden.write_scheduler_golden``).  Unless
``--no-head-check``, HEAD's own check also runs (the scheduler machine against the reference
scheduler's declared policy, cli/shapes.py, seeded from the PR's seed), and each of its
scheduler verdicts is replayed on BASE: one BASE does not reproduce is a regression
(``scheduler_verdicts``).
``kvspec diff A B`` is the same comparison between two releases.
A run that compared nothing is no verdict (exit 2).

``kvspec bisect REPORT --releases A..B`` replays a report on every provisioned release in the
range and prints the first release where it reproduces and the first later one where it no
longer does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
from kvspec.targets.registry import Target, TargetError, parse, release_key
from kvspec.testing.artifacts.golden import TAG as GOLDEN_TAG
from kvspec.testing.known import DIFFERS
from kvspec.testing.lockstep import Kind, LockstepError, LockstepRun, Mode, Side, run_lockstep
from kvspec.testing.scheduler.lockstep import SchedulerLockstepMachine, shape_strategy
from rich.markup import escape
from rich.table import Table

from .check import check_invariant_ids
from .common import EXIT_FOUND, EXIT_OK, EXIT_USAGE, UsageError, err, first_lines, out
from .failures import limits_from
from .run import config_strategy, features_from, parse_overrides
from .target import (
    check_impl_name,
    ensure_provisioned,
    generations,
    provisioned_targets,
    read_source_version,
    validate_checkout,
    venv_for_source,
)

# What a `kvspec replay` printed when the trace could not be applied as recorded, or met
# another failure than the recorded one: either way nothing is claimed about the report's.
DIVERGED = ("trace diverged", "nondeterministic", "violations differ")


def target_flags(spec: str) -> list[str]:
    """``--vllm X`` for a release version, ``--vllm-source PATH`` for a checkout."""
    try:
        parse(spec)
    except TargetError:
        path = Path(spec).expanduser()
        if not path.exists():
            raise UsageError(f"--baseline {spec}: neither a vLLM release nor a folder") from None
        return ["--vllm-source", str(path.resolve())]
    return ["--vllm", spec]


def _kvspec(args: list[str], *, capture: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvspec.cli", *args], capture_output=capture, text=True, check=False
    )


def replays_on(report: Path, flags: list[str], *, unusable_ok: bool = False) -> str:
    """'reproduces', 'holds' or 'diverged' (or, with ``unusable_ok``, 'cannot run': the target
    lacks the report's manager or configuration): ``kvspec replay`` of ``report`` on a target."""
    proc = _kvspec(["replay", str(report), *flags], capture=True)
    text = proc.stdout + proc.stderr
    if proc.returncode == EXIT_OK:
        return "holds"
    if proc.returncode == EXIT_FOUND:
        return "diverged" if any(d in text for d in DIVERGED) else "reproduces"
    if unusable_ok and proc.returncode == EXIT_USAGE:
        return "cannot run"
    raise UsageError(f"kvspec replay {report} {' '.join(flags)} failed (exit {proc.returncode}):\n{text[-2000:]}")


def side_for(
    label: str, spec: str, *, checkout: bool, impl: str | None, args: argparse.Namespace, version: str | None = None
) -> Side:
    """A lockstep side: a provisioned release's venv, or a checkout in the nearest release's
    venv (``--venv`` picks another) with the checkout first on PYTHONPATH."""
    if not checkout:
        t = ensure_provisioned(spec)
        package = installed_package(t.venv)
        gens = generations(package) if package else {"legacy": False, "v1": False}
        return Side(label, f"vLLM {spec}", str(t.python), impl or default_impl(t, gens, package))
    root = validate_checkout(spec)
    version = version or read_source_version(root)
    if not version or version == "dev":
        raise UsageError(f"cannot tell which vLLM release the checkout {root} is", "pass it: --source-version 0.33.0")
    gens = generations(root / "vllm")
    t = venv_for_source(version, gens, getattr(args, "venv", None))
    description = f"the checkout {root} (vLLM {version}, run in the vLLM {t.version} venv)"
    return Side(label, description, str(t.python), impl or default_impl(t, gens, root / "vllm"),
                pythonpath=str(root))


def installed_package(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python*/site-packages/vllm"))
    return found[0] if found else None


def engine_uses_v2(package: Path) -> bool | None:
    """The default of ``EngineArgs.use_v2_block_manager`` in a vLLM package's source
    (vllm/engine/arg_utils.py; 0.6.2 has False at :110, 0.6.3 True at :110), read without
    importing vLLM; None where the package declares no such field."""
    import ast

    source = package / "engine" / "arg_utils.py"
    if not source.is_file():
        return None
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            for field in node.body:
                if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                        and field.target.id == "use_v2_block_manager" and isinstance(field.value, ast.Constant)):
                    return bool(field.value.value)
    return None


def default_impl(t: Target, gens: dict[str, bool], package: Path | None = None) -> str:
    """The manager the engine runs by default: V1's KVCacheManager where the tree has it, else
    the legacy manager the package's ``EngineArgs.use_v2_block_manager`` default picks (as
    adapters/legacy.py ``default_manager`` does inside a target), else the release's only one."""
    if gens.get("v1"):
        return "v1"
    legacy = [m for m in t.managers if m != "v1"]
    if not legacy:
        raise UsageError(f"vLLM {t.version} ships no block manager kvspec drives", "kvspec targets lists them")
    if len(legacy) == 1:
        return legacy[0]
    v2 = engine_uses_v2(package) if package is not None else None
    if v2 is None:
        raise UsageError(
            f"vLLM {t.version} ships {', '.join(legacy)} and its engine's default cannot be read "
            f"({package}/engine/arg_utils.py: no EngineArgs.use_v2_block_manager default)",
            f"name the manager: --impl {legacy[-1]}",
        )
    wanted = "legacy-v2" if v2 else "legacy-v1"
    return wanted if wanted in legacy else legacy[0]


def lockstep_sides(head: tuple[str, bool], base: tuple[str, bool], args: argparse.Namespace) -> tuple[Side, Side]:
    impl = args.impl
    check_impl_name(impl)
    head_side = side_for("HEAD", head[0], checkout=head[1], impl=impl, args=args, version=args.source_version)
    base_side = side_for("BASE", base[0], checkout=base[1], impl=impl or head_side.impl, args=args)
    if head_side.impl != base_side.impl:
        raise UsageError(
            f"HEAD runs {head_side.impl} by default, BASE {base_side.impl}: lockstep compares one manager",
            "name it: --impl v1 (or a legacy manager both ship)",
        )
    return head_side, base_side


def run_compare(
    args: argparse.Namespace, head: Side, base: Side, root: Path, *, scheduler: bool = False
) -> LockstepRun:
    """The lockstep search, printed; every behaviour change's golden test verified on both.
    ``scheduler``: the scheduler machine over vLLM's own V1 scheduler (in every production
    shape) instead of the block-manager machine over ``head.impl``."""
    overrides = parse_overrides(args.config or [])
    what = "vLLM's own V1 scheduler" if scheduler else head.impl
    err.print(f"lockstep: HEAD = {head.description}; BASE = {base.description}; {what}", markup=False)
    err.print("starting both targets (each imports vLLM) ...", markup=False)
    try:
        run = lockstep(args, head, base, overrides, scheduler=scheduler)
    except LockstepError as error:
        lines = str(error).strip().splitlines()
        shown = "\n".join([lines[0], "...", *lines[-4:]]) if len(lines) > 6 else str(error)
        raise UsageError(shown, "a side that does not start or import is no verdict") from None
    for label, imported in run.imported.items():
        err.print(f"{label} imported {imported}", markup=False)
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for n, verdict in enumerate(run.verdicts, 1):
        folder = root / f"{n:02d}-{verdict.kind.value.replace(' ', '-')}-{verdict.op}"
        folder.mkdir(parents=True, exist_ok=True)
        entry: dict[str, Any] = {**verdict.to_json(), "folder": str(folder), "differs": verdict.fingerprint()[2]}
        golden = run.goldens.get(n - 1)
        if golden is not None:
            entry["golden"] = keep_golden(golden, folder, head, base, verify=not args.no_verify)
        (folder / "verdict.json").write_text(json.dumps(entry, indent=1))
        entries.append(entry)
    print_lockstep(run, entries)
    summary = {
        "head": attrs.asdict(head),
        "base": attrs.asdict(base),
        "status": run.status,
        "mode": args.compare,
        "first_verdict": first_verdict(args),
        "examples": run.stats.examples,
        "operations": run.stats.operations,
        "by_op": run.stats.by_op,
        "stats": attrs.asdict(run.stats),
        "rounds": run.rounds,
        "imported": run.imported,
        "seconds": round(run.seconds, 1),
        "verdicts": entries,
        "rows": [
            {"verdict": e["verdict"].upper() if e["verdict"] == Kind.REGRESSION else e["verdict"],
             "violation": f"{e['differs'] or e['field']} in {e['operation']}",
             "replayed": "BASE: holds" if e["verdict"] == Kind.REGRESSION else "",
             "report": e["folder"]}
            for e in entries
        ],
        "regressions": len(run.by_kind(Kind.REGRESSION)),
        "fixes": len(run.by_kind(Kind.FIX)),
        "changes": len(run.by_kind(Kind.CHANGE)),
    }
    (root / "pr.json").write_text(json.dumps(summary, indent=1, default=str))
    out.print(f"summary: {root / 'pr.json'}", markup=False, soft_wrap=True)
    # Examples that ended in a verdict are not "compared to their end": a run whose every
    # example found one still answered.
    if run.status != "compared" or (run.stats.examples == 0 and not entries):
        raise UsageError(
            f"lockstep compared {run.stats.examples} example(s), {run.stats.operations} operation(s) ({run.status}): "
            "no verdict",
            f"the targets' logs: {', '.join(str(p) for p in lockstep_logs())}",
        )
    return run


def lockstep(
    args: argparse.Namespace, head: Side, base: Side, overrides: dict[str, Any], *, scheduler: bool = False
) -> LockstepRun:
    machine: dict[str, Any] = {"machine": SchedulerLockstepMachine} if scheduler else {}
    first = first_verdict(args)
    return run_lockstep(
        head,
        base,
        shape_strategy() if scheduler else config_strategy(head.impl, overrides),
        profile=args.profile or "ci",
        examples=args.examples,
        steps=args.steps,
        seed=pr_seed(args),
        focus=check_invariant_ids(args.invariant),
        features=features_from(overrides),
        mode=Mode(args.compare),
        max_verdicts=1 if first else min(args.max_violations or MAX_VERDICTS, MAX_VERDICTS),
        shrink=not first,
        limits=limits_from(args),
        progress=lambda line: err.print(f"  found: {line}", markup=False),
        **machine,
    )


MAX_VERDICTS = 3  # distinct verdicts one lockstep run shrinks and reports before it stops
DEFAULT_SEED = 0  # a PR run without --seed: every search of it is repeatable


def first_verdict(args: argparse.Namespace) -> bool:
    """``--first-verdict``: the question is only whether HEAD differs at all."""
    return bool(getattr(args, "first_verdict", False))


def answered(args: argparse.Namespace, runs: list[LockstepRun]) -> bool:
    """Whether a ``--first-verdict`` run has its answer, so that the halves after it are skipped."""
    return first_verdict(args) and any(r.verdicts for r in runs)


def pr_seed(args: argparse.Namespace) -> int:
    seed = getattr(args, "seed", None)
    return seed if seed is not None else DEFAULT_SEED


def lockstep_logs() -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob("kvspec-lockstep-*.log"))[-2:]


def keep_golden(golden: dict[str, Any], folder: Path, head: Side, base: Side, *, verify: bool) -> dict[str, Any]:
    """Write the golden test; keep it as verified only if it fails on HEAD and passes on BASE."""
    if "error" in golden:
        return {"status": "not written", "why": golden["error"]}
    path = folder / golden["filename"]
    path.write_text(golden["text"])
    if not verify:
        return {"status": "unverified", "path": str(path)}
    results = {side.label: run_golden(path, side) for side in (head, base)}
    head_code, head_text = results["HEAD"]
    base_code, base_text = results["BASE"]
    named = next((ln.strip() for ln in head_text.splitlines() if f"Failed: [{GOLDEN_TAG}]" in ln), "")
    if head_code == 1 and named and base_code == 0:
        return {"status": "verified", "path": str(path), "head_failure": named.split("Failed: ", 1)[-1]}
    path.rename(path.with_suffix(".unverified"))
    return {
        "status": "not verified",
        "path": str(path.with_suffix(".unverified")),
        "why": f"pytest on HEAD exit {head_code}, on BASE exit {base_code}: "
        f"{first_lines(base_text if base_code else head_text, 4)}",
    }


def run_golden(path: Path, side: Side) -> tuple[int, str]:
    """Plain pytest on the file, in the side's interpreter with the side's vLLM."""
    cmd = [side.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(path.parent), str(path)]
    with err.status(f"running the golden test on {side.label} ...", spinner="dots"):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=path.parent,
                                  env=side.env(), check=False)
        except subprocess.TimeoutExpired:
            return -1, "timed out under pytest"
    return proc.returncode, proc.stdout + proc.stderr


STYLE = {Kind.REGRESSION: "bold red", Kind.FIX: "green", Kind.CHANGE: "yellow"}


def print_lockstep(run: LockstepRun, entries: list[dict[str, Any]]) -> None:
    for n, (verdict, entry) in enumerate(zip(run.verdicts, entries, strict=True), 1):
        out.rule(f"{n} of {len(run.verdicts)}: {verdict.kind.value}")
        lines = verdict.describe()
        out.print(f"[{STYLE[verdict.kind]}]{escape(lines[0])}[/]")
        for line in lines[1:]:
            out.print(line, markup=False, soft_wrap=True)
        golden = entry.get("golden")
        if golden is not None:
            out.print(f"golden test ({golden['status']}): {golden.get('path', '')}", markup=False, soft_wrap=True)
            if "head_failure" in golden:
                shown = f"  fails on HEAD with: {golden['head_failure']}; passes on BASE"
                out.print(shown, markup=False, soft_wrap=True)
            if "why" in golden:
                out.print(f"  {golden['why']}", markup=False, soft_wrap=True)
        out.print(f"verdict: {entry['folder']}/verdict.json", markup=False, soft_wrap=True)
    out.rule()
    s = run.stats
    out.print(
        f"compared {s.examples} examples, {s.operations} operations ({run.status}, <= {run.steps} steps each, "
        f"{run.rounds} round(s), {run.seconds:.0f} s): {len(run.by_kind(Kind.REGRESSION))} regression(s), "
        f"{len(run.by_kind(Kind.FIX))} fix(es), {len(run.by_kind(Kind.CHANGE))} behaviour change(s)",
        markup=False,
    )
    if s.shared_violations or s.shared_crashes:
        out.print(
            f"on both sides alike (not a difference): {s.shared_violations} violating operation(s), "
            f"{s.shared_crashes} crash(es)",
            markup=False,
        )


def base_package(spec: str, flags: list[str]) -> Path:
    """The ``vllm`` package folder of BASE: the release's installed one, or the checkout's."""
    if flags[0] == "--vllm-source":
        return Path(flags[1]) / "vllm"
    from kvspec.targets.registry import target

    t = target(spec)
    found = sorted(t.venv.glob("lib/python*/site-packages/vllm"))
    if not found:
        raise UsageError(f"--coverage: vLLM {spec} is not provisioned, so HEAD's changes cannot be found",
                         f"kvspec provision {spec}")
    return found[0]


def changed_lines_run(head_out: Path) -> dict[str, Any] | None:
    """From HEAD's summary.json: per file, the executable lines HEAD changed and those that ran."""
    summary = head_out / "summary.json"
    if not summary.is_file():
        return None
    files = (json.loads(summary.read_text()).get("coverage") or {}).get("files", [])
    return {f["name"]: {"changed": f["changed"], "executed": f["changed_executed"]} for f in files if f["changed"]}


def without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` less each of ``flags`` and its value (``--flag V`` or ``--flag=V``)."""
    kept: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        kept.append(a)
    return kept


def coverage_of_changes(args: argparse.Namespace, argv: list[str], base_flags: list[str], root: Path) -> None:
    """With ``--coverage``: HEAD's own check under coverage, against BASE's vllm folder, says
    which of the lines HEAD changed its search executed (the lockstep's two sides are not
    measured); the figures go into pr.json."""
    head_flags = ["--vllm-source", args.vllm_source] if args.vllm_source else ["--vllm", args.vllm]
    common = without(argv, "--baseline", "--vllm", "--vllm-source", "--out", "--source-version", "--venv")
    extra = ["--source-version", args.source_version] if args.source_version else []
    extra += ["--venv", args.venv] if args.venv else []
    head_out = root / "head-coverage"
    against = ["--coverage-against", str(base_package(args.baseline, base_flags))]
    out.rule(f"HEAD's search under coverage: {' '.join(head_flags)}")
    _kvspec([*common, *head_flags, *extra, *against, "--out", str(head_out)])
    summary_path = root / "pr.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary["changed_lines"] = changed_lines_run(head_out)
    summary_path.write_text(json.dumps(summary, indent=1, default=str))


def scheduler_verdicts(args: argparse.Namespace, argv: list[str], base_flags: list[str], root: Path) -> list[dict]:
    """PR mode on vLLM's own V1 scheduler: HEAD's own ``kvspec check`` runs the scheduler
    machine (cli/shapes.py, with its report folders and reproducers under ``root``/head); each
    scheduler verdict is then replayed on BASE (``kvspec replay``).  One that does not reproduce
    there (BASE holds, or takes another path before the violation) is a regression; one that
    does is on both sides alike.  The verdicts, each with ``base`` (what its replay on BASE
    gave) and ``regression``."""
    head_flags = ["--vllm-source", args.vllm_source] if args.vllm_source else ["--vllm", args.vllm]
    common = without(
        argv, "--baseline", "--vllm", "--vllm-source", "--out", "--source-version", "--venv", "--compare", "--seed"
    )
    common = [a for a in common if a not in ("--fail-on-change", "--coverage", "--no-head-check", "--first-verdict")]
    if first_verdict(args):
        common = [*without(common, "--max-violations"), "--max-violations", "1"]
    # The PR run's seed (the lockstep's): HEAD's own check repeats, whatever its profile.
    common += ["--seed", str(pr_seed(args))]
    # Each verdict is replayed on BASE as HEAD's search shrank it: a trace cut on HEAD alone
    # (testing/artifacts/minimize.py) would be judged on a side it was never cut against.
    common = [*common, "--no-minimize"] if "--no-minimize" not in common else common
    extra = ["--source-version", args.source_version] if args.source_version else []
    extra += ["--venv", args.venv] if args.venv else []
    head_out = root / "head"
    out.rule(f"vLLM's own V1 scheduler on HEAD: {' '.join(head_flags)}")
    ran = _kvspec([*common, *head_flags, *extra, "--out", str(head_out)])
    summary = head_out / "summary.json"
    # A check that finds nothing writes no summary; one that exits otherwise did not run, and a
    # HEAD the scheduler machine could not run is no verdict on it, never "no verdict found".
    if ran.returncode not in (EXIT_OK, EXIT_FOUND) or (ran.returncode == EXIT_FOUND and not summary.is_file()):
        raise UsageError(
            f"HEAD's own check (vLLM's scheduler) did not run (exit {ran.returncode}, out {head_out}): "
            "the PR has no scheduler verdict",
            f"run it alone: kvspec check {' '.join(head_flags + extra)}, or leave the scheduler out: --no-shapes",
        )
    entries = json.loads(summary.read_text()).get("violations", []) if summary.is_file() else []
    verdicts = []
    for entry in entries:
        if entry.get("machine") != "scheduler":
            continue  # the block manager's verdicts are the lockstep's business
        base = replays_on(Path(entry["report"]), base_flags)
        # A policy difference breaks no invariant: where BASE does not show it, it is a
        # behaviour change (spec/: the declared policies are release facts), never a regression.
        differs = entry.get("fingerprint", {}).get("invariant") == DIFFERS
        new = base != "reproduces"
        verdicts.append({**entry, "base": base, "regression": new and not differs, "change": new and differs})
    out.rule("scheduler verdicts of HEAD, replayed on BASE")
    for v in verdicts:
        kind = (
            "[bold red]REGRESSION[/]" if v["regression"]
            else "[yellow]behaviour change[/]" if v["change"]
            else "on both sides alike"
        )
        shown = f"{v['fingerprint']['invariant']} in {v['fingerprint']['operation']}"
        out.print(f"{kind}: {escape(shown)} (BASE: {v['base']}): {escape(v['report'])}", soft_wrap=True)
    if not verdicts:
        out.print("no scheduler verdict on HEAD", markup=False)
    return verdicts


def add_scheduler_lockstep(summary_path: Path, run: LockstepRun, own: Path) -> None:
    """The scheduler lockstep's verdicts into the PR's summary: listed (``scheduler_lockstep``,
    its own summary beside), and counted with the block manager's."""
    summary = json.loads(summary_path.read_text())
    mine = json.loads(own.read_text())
    summary["scheduler_lockstep"] = {
        k: mine[k] for k in ("status", "examples", "operations", "by_op", "stats", "rounds", "seconds", "verdicts")
    }
    summary["scheduler_lockstep"]["summary"] = str(own)
    summary["rows"] = [*summary.get("rows", []), *mine["rows"]]
    for kind in ("regressions", "fixes", "changes"):
        summary[f"scheduler_lockstep_{kind}"] = mine[kind]
        summary[kind] = summary.get(kind, 0) + mine[kind]
    summary_path.write_text(json.dumps(summary, indent=1, default=str))


def cmd_pr(args: argparse.Namespace, argv: list[str]) -> int:
    """``kvspec check <HEAD target> --baseline BASE [flags]``: HEAD and BASE in lockstep."""
    if not (args.vllm or args.vllm_source):
        raise UsageError("--baseline compares two targets", "name HEAD with --vllm-source PATH (or --vllm X)")
    base_flags = target_flags(args.baseline)
    head = (args.vllm_source, True) if args.vllm_source else (args.vllm, False)
    base = (base_flags[1], base_flags[0] == "--vllm-source")
    head_side, base_side = lockstep_sides(head, base, args)
    root = Path(args.out).expanduser().resolve() if args.out else Path(tempfile.mkdtemp(prefix="kvspec-pr-"))
    run = run_compare(args, head_side, base_side, root)
    if args.coverage:
        coverage_of_changes(args, argv, base_flags, root)
    scheduler: list[dict] = []
    runs = [run]
    if head_side.impl == "v1" and not args.no_shapes and not answered(args, runs):
        out.rule("vLLM's own V1 scheduler in lockstep")
        runs.append(run_compare(args, head_side, base_side, root / "scheduler", scheduler=True))
        add_scheduler_lockstep(root / "pr.json", runs[-1], root / "scheduler" / "pr.json")
    head_check = not getattr(args, "no_head_check", False) and not answered(args, runs)
    if answered(args, runs):
        out.print("--first-verdict: HEAD differs; the halves after this verdict are skipped", markup=False)
    if head_side.impl == "v1" and not args.no_shapes and head_check:
        scheduler = scheduler_verdicts(args, argv, base_flags, root)
        summary_path = root / "pr.json"
        summary = json.loads(summary_path.read_text())
        summary["scheduler"] = scheduler
        summary["scheduler_regressions"] = sum(v["regression"] for v in scheduler)
        summary["regressions"] += summary["scheduler_regressions"]
        summary["scheduler_changes"] = sum(v["change"] for v in scheduler)
        summary["changes"] = summary.get("changes", 0) + summary["scheduler_changes"]
        summary_path.write_text(json.dumps(summary, indent=1, default=str))
    regressions = [v for r in runs for v in r.by_kind(Kind.REGRESSION)]
    changes = [*(v for r in runs for v in r.by_kind(Kind.CHANGE)), *(v for v in scheduler if v["change"])]
    scheduler_regressions = sum(v["regression"] for v in scheduler)
    if regressions or scheduler_regressions:
        n = len(regressions) + scheduler_regressions
        out.print(f"[bold red]HEAD regressed[/]: {n} difference(s) where HEAD violates what BASE does not")
        return EXIT_FOUND
    if changes and args.fail_on_change:
        out.print(f"[yellow]HEAD changes behaviour[/] ({len(changes)}), and --fail-on-change is given")
        return EXIT_FOUND
    out.print("[green]no regression[/]: wherever HEAD behaves otherwise than BASE, the spec allows it")
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    """``kvspec diff A B``: what the block manager does differently between two releases and, on
    V1 (unless ``--no-shapes``), what vLLM's own scheduler does differently (its lockstep half,
    written under ``scheduler/``)."""
    for version in (args.a, args.b):
        try:
            parse(version)
        except TargetError as error:
            raise UsageError(str(error), "kvspec targets lists the releases") from None
    args.venv = None
    base_side, head_side = (side_for(label, v, checkout=False, impl=args.impl, args=args)
                            for label, v in (("BASE", args.a), ("HEAD", args.b)))
    if head_side.impl != base_side.impl:
        raise UsageError(f"{args.a} runs {base_side.impl}, {args.b} {head_side.impl}", "name one: --impl v1")
    root = Path(args.out).expanduser().resolve() if args.out else Path(tempfile.mkdtemp(prefix="kvspec-diff-"))
    runs = [run_compare(args, head_side, base_side, root)]
    if head_side.impl == "v1" and not args.no_shapes:
        out.rule("vLLM's own V1 scheduler in lockstep")
        runs.append(run_compare(args, head_side, base_side, root / "scheduler", scheduler=True))
        add_scheduler_lockstep(root / "pr.json", runs[-1], root / "scheduler" / "pr.json")
    return EXIT_FOUND if any(r.verdicts for r in runs) else EXIT_OK


# ---------------------------------------------------------------- bisect


def releases_between(span: str) -> list[str]:
    lo, sep, hi = span.partition("..")
    if not sep:
        raise UsageError(f"--releases {span!r} is not A..B", "e.g. --releases 0.6.0..0.33.0")
    # release_key orders every release (0.6.3 < 0.6.3.post1 < 0.6.4): first bad is the first
    # release in that order that reproduces.
    first = release_key(lo) if lo else (0,)
    last = release_key(hi) if hi else (10**6,)
    chosen = sorted(
        {t.version for t in provisioned_targets() if first <= release_key(t.version) <= last}, key=release_key
    )
    if not chosen:
        raise UsageError(f"no provisioned release in {span}", "kvspec provision VERSION ... first")
    return chosen


def cmd_bisect(args: argparse.Namespace) -> int:
    report = Path(args.report)
    if not report.is_file():
        raise UsageError(f"{report}: no such report", "pass a report.json written by kvspec check")
    verdicts: list[tuple[str, str]] = []
    for version in releases_between(args.releases):
        out.print(f"replaying on vLLM {version} ...", markup=False)
        verdict = replays_on(report, ["--vllm", version], unusable_ok=True)
        if verdict == "cannot run" and json.loads(report.read_text()).get("impl") == "legacy-v2":
            # SelfAttnBlockSpaceManager is BlockSpaceManagerV2 renamed (0.6.3.post1 on).
            verdict = replays_on(report, ["--vllm", version, "--impl", "legacy-self-attn"], unusable_ok=True)
        verdicts.append((version, verdict))
    table = Table(title=f"{report} across releases", title_justify="left")
    table.add_column("release")
    table.add_column("verdict")
    for version, verdict in verdicts:
        table.add_row(version, verdict)
    out.print(table)
    first_bad = next((v for v, verdict in verdicts if verdict == "reproduces"), None)
    first_fixed = None
    if first_bad is not None:
        after = verdicts[[v for v, _ in verdicts].index(first_bad) + 1 :]
        first_fixed = next((v for v, verdict in after if verdict == "holds"), None)
    out.print(f"first bad: {first_bad or 'none of these'}", markup=False)
    out.print(f"first fixed: {first_fixed or 'none of these'}", markup=False)
    result: dict[str, Any] = {"verdicts": dict(verdicts), "first_bad": first_bad, "first_fixed": first_fixed}
    out.print(json.dumps(result), markup=False, soft_wrap=True)
    return EXIT_OK
