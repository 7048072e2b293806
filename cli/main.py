"""The ``kvspec`` command line.

Exit codes: 0 every applicable invariant holds and every requested example ran (or the
subcommand succeeded); 1 a violation, a crash of the target (or a hang, a memory runaway,
nondeterministic answers: cli/failures.py), or an incomplete run; 2 bad
input (unknown version or invariant, not a vLLM checkout, a vLLM that does not import,
provisioning failure, unsupported engine generation, invalid configuration).
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kvspec.spec.invariants import INVARIANTS
from kvspec.targets.lock import read_record, record_path
from kvspec.targets.registry import LEGACY_RANGE, PINNED, V1_FROM, Target, TargetError, shipped, target
from kvspec.testing.lockstep import Mode
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

import kvspec

from .budget import TIME_BUDGET_HELP
from .check import check_invariant_ids, cmd_check, cmd_replay
from .common import EXIT_FOUND, EXIT_OK, EXIT_USAGE, UsageError, err, fail_usage, first_lines, out
from .failures import add_limit_args
from .fuzz import add_parser as add_fuzz_parser
from .fuzz import campaign_seconds, cmd_fuzz
from .fuzz_scheduler import cmd_fuzz_scheduler
from .pr import cmd_bisect, cmd_diff, cmd_pr
from .run import CONFIG_HELP, PROFILES
from .search import MAX_VIOLATIONS
from .target import IN_TARGET_FLAG, ensure_provisioned, impl_names, locate_vllm, provisioned_targets, vllm_names

EPILOG = """\
The stateful machine behind `check` is a library class: kvspec.testing.KVCacheMachine takes
an implementation factory (Config -> Implementation, see kvspec.spec.interface), so another
project -- vLLM's own CI, another engine -- can run it on its block manager:

    from hypothesis.stateful import run_state_machine_as_test
    from kvspec.testing import KVCacheMachine
    run_state_machine_as_test(lambda: KVCacheMachine(MyAdapter))

Exit codes: 0 all applicable invariants hold and every requested example ran; 1 violation,
crash, hang, memory runaway, nondeterminism or incomplete run; 2 bad input.
"""


DEFAULT_IMPL = f"""\
Default --impl (the manager the release's engine runs by default, cli/target.py choose_impl):
  v1                the V1 engine's KVCacheManager, on releases kvspec drives it on ({'.'.join(map(str, V1_FROM))} on;
                    0.33.0); an older V1 engine is refused with the reason before provisioning
  legacy-self-attn  legacy releases with SelfAttnBlockSpaceManager (V2's name from 0.6.3.post1)
  legacy-v2         legacy releases whose EngineArgs.use_v2_block_manager defaults on (0.6.3)
  legacy-v1         older legacy releases (BlockSpaceManagerV1, the default before V2)
"""


def _target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target (default: the vLLM this interpreter imports)")
    g.add_argument(
        "--impl",
        metavar="NAME",
        help=f"{', '.join(vllm_names())}, reference or broken:<name> "
        "(default: the engine the target runs by default)",
    )
    g.add_argument(
        "--vllm",
        metavar="VERSION",
        help="a vLLM release, provisioned into its own venv on first use",
    )
    g.add_argument(
        "--vllm-source",
        metavar="PATH",
        help="a vLLM source checkout, run in the nearest provisioned release's venv",
    )
    g.add_argument(
        "--source-version",
        metavar="VERSION",
        help="the release a --vllm-source checkout is (when it cannot be read)",
    )
    g.add_argument(
        "--venv",
        metavar="VERSION|PATH",
        help="the venv a --vllm-source checkout runs in: a provisioned release or a venv folder "
        "(default: the nearest provisioned release)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show the target's own log output (vLLM's logger) while running",
    )
    p.add_argument(IN_TARGET_FLAG, dest="in_target", action="store_true", help=argparse.SUPPRESS)


def _compare_args(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    g.add_argument(
        "--compare",
        choices=[m.value for m in Mode],
        default=Mode.RENAMING.value,
        help="what lockstep compares after each operation: outcomes (answers, hits, crashes), counts "
        "(also free/evictable/cached blocks and blocks held), renaming (also block tables up to "
        "renaming of ids, cached keys, eviction order, KV events; the default)",
    )
    g.add_argument(
        "--fail-on-change", action="store_true", help="exit 1 on a behaviour change too, not only on a regression"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvspec",
        description="Check paged KV-cache block managers (vLLM's, or kvspec's reference) "
        "against kvspec's executable specification.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvspec {kvspec.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "check",
        help="run the stateful machine against a target",
        epilog=DEFAULT_IMPL + "\n" + EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _target_args(p)
    add_limit_args(p)
    e = p.add_argument_group("effort and focus")
    e.add_argument(
        "--profile",
        choices=PROFILES,
        default=None,
        help="hypothesis profile (default: ci when $CI is set, else $KVSPEC_PROFILE or dev)",
    )
    e.add_argument("--examples", type=int, metavar="N", help="examples (machine runs) to try")
    e.add_argument("--time-budget", type=float, metavar="SECONDS", help=TIME_BUDGET_HELP)
    e.add_argument("--steps", type=int, metavar="N", help="operations per example, at most")
    e.add_argument(
        "--seed", type=int, metavar="S", help="seed (the run is repeatable; default: the profile's)"
    )
    e.add_argument(
        "--invariant",
        action="append",
        metavar="ID",
        help=f"check only this invariant (repeatable): {', '.join(INVARIANTS)}",
    )
    e.add_argument("--config", action="append", metavar="KEY=VALUE", help=CONFIG_HELP)
    e.add_argument(
        "--no-shapes",
        action="store_true",
        help="V1 targets: skip the run of vLLM's own scheduler in production shapes (hybrid "
        "groups, async, spec decode, token budget, startup-minimum pools) after the search",
    )
    k = p.add_argument_group(
        "distinct violations and known findings",
        "The search goes on after a violation and reports every distinct one (by invariant, "
        "operation and crash site), each shrunk on its own, with its report and reproducer.",
    )
    k.add_argument(
        "--known",
        action="append",
        metavar="FILE",
        help="a known-findings file (TOML, [[finding]] entries) whose fingerprints the search "
        "steps past (repeatable; added to the shipped FINDINGS.md fingerprints)",
    )
    k.add_argument(
        "--no-known",
        action="store_true",
        help="do not step past the shipped FINDINGS.md fingerprints (every violation is new)",
    )
    k.add_argument(
        "--known-count-only",
        action="store_true",
        help="count the known findings that fire instead of re-finding and shrinking each one",
    )
    k.add_argument(
        "--max-violations",
        type=int,
        default=MAX_VIOLATIONS,
        metavar="N",
        help=f"stop after N distinct violations (default {MAX_VIOLATIONS})",
    )
    b = p.add_argument_group(
        "PR mode",
        "With --baseline, every drawn example runs on HEAD (--vllm-source PATH or --vllm X) and on "
        "BASE in lockstep, each in its own guarded target process; at the first difference of "
        "what they did, the spec judges: HEAD violates an invariant -> regression (exit 1), BASE "
        "does -> fix, neither -> behaviour change (with a golden pytest file asserting BASE's "
        "value, verified to fail on HEAD and pass on BASE).",
    )
    b.add_argument("--baseline", metavar="VERSION|PATH", help="the release or checkout HEAD is compared with")
    _compare_args(b)
    b.add_argument(
        "--no-head-check",
        action="store_true",
        help="V1: skip HEAD's own check (the block-manager search and vLLM's scheduler against the "
        "reference scheduler's declared policy, seeded from --seed, each scheduler verdict replayed on "
        "BASE), which runs by default after the two lockstep halves",
    )
    b.add_argument(
        "--first-verdict",
        action="store_true",
        help="answer only whether HEAD differs: stop at the first verdict (regression, fix or behaviour "
        "change), reported unshrunk, and skip the halves after it; a run with no verdict is the full run",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--coverage",
        action="store_true",
        help="measure which lines, branches and functions of vLLM's block-management code the run "
        "executed (coverage.py in the target process): a per-file table, the functions never "
        "entered, an HTML map and coverage.json in the report folder, the totals in summary.json; "
        "in PR mode, whether the lines HEAD changed ran",
    )
    # PR mode hands HEAD's run the BASE's vllm package folder to diff against.
    o.add_argument("--coverage-against", metavar="DIR", help=argparse.SUPPRESS)
    o.add_argument(
        "--out",
        metavar="DIR",
        help="where the report and reproducer go (default ./kvspec-reports/<impl>-<time>)",
    )
    o.add_argument(
        "--no-verify",
        action="store_true",
        help="write the standalone reproducer without running it first",
    )
    o.add_argument(
        "--no-minimize",
        action="store_true",
        help="report each violation as hypothesis shrank it, without cutting its trace further by re-runs",
    )

    p = sub.add_parser("replay", help="re-run a recorded trace (report.json) against a target")
    p.add_argument("report", metavar="REPORT.json")
    _target_args(p)
    p.add_argument("--invariant", action="append", metavar="ID", help="check only this invariant")
    p.add_argument(
        "--known",
        action="append",
        metavar="FILE",
        help="a known-findings file whose go_on findings the replay also goes past (repeatable)",
    )
    p.add_argument(
        "--no-known",
        action="store_true",
        help="stop at the first violation, even one the search went past (a go_on known finding "
        "of the target, such as V1-e; by default the replay goes past those, not the report's own)",
    )
    add_limit_args(p)

    p = sub.add_parser("explain", help="an invariant: statement, spec source, vLLM code, proofs")
    p.add_argument("id", metavar="ID", nargs="?", help=", ".join(INVARIANTS))

    p = sub.add_parser("prove", help="run the z3 proofs (kvspec.proofs)")
    p.add_argument("selection", nargs="*", metavar="ID", help="obligation IDs or ID prefixes")
    p.add_argument("--deep", action="store_true", help="larger bounds, longer timeouts")
    p.add_argument("--list", action="store_true", help="list the obligations and exit")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")

    p = sub.add_parser("bisect", help="replay a report across provisioned releases: first bad, first fixed")
    p.add_argument("report", metavar="REPORT.json")
    p.add_argument("--releases", required=True, metavar="A..B", help="the range of releases (either end may be empty)")

    _target_args(add_fuzz_parser(sub))

    p = sub.add_parser(
        "diff",
        help="what the block manager (and, on V1, vLLM's own scheduler) does differently between two releases "
        "(lockstep, judged by the spec)",
    )
    p.add_argument("a", metavar="A", help="the older release (BASE)")
    p.add_argument("b", metavar="B", help="the newer release (HEAD)")
    p.add_argument("--no-shapes", action="store_true", help="V1: leave vLLM's own scheduler out (block manager only)")
    p.add_argument("--impl", metavar="NAME", help="the manager to compare (default: the engine both run by default)")
    p.add_argument("--profile", choices=PROFILES, default="ci", help="hypothesis profile (default ci)")
    p.add_argument("--examples", type=int, metavar="N", help="examples to compare")
    p.add_argument("--steps", type=int, metavar="N", help="operations per example, at most")
    p.add_argument("--seed", type=int, metavar="S", help="seed (default 0)")
    p.add_argument("--invariant", action="append", metavar="ID", help="judge by this invariant only (repeatable)")
    p.add_argument("--config", action="append", metavar="KEY=VALUE", help=CONFIG_HELP)
    p.add_argument("--max-violations", type=int, metavar="N", help="stop after N distinct differences (default 3)")
    p.add_argument("--out", metavar="DIR", help="where the verdicts and golden tests go")
    p.add_argument("--no-verify", action="store_true", help="write golden tests without running them")
    _compare_args(p)
    add_limit_args(p)

    p = sub.add_parser("targets", help="list pinned, known and provisioned vLLM releases, and their disk")
    p.add_argument(
        "--prune",
        nargs="*",
        metavar="VERSION",
        help="remove the uv cache's entries no provisioned venv uses, after removing the venvs "
        "of the releases named (a dry run without --yes)",
    )
    p.add_argument("--yes", action="store_true", help="with --prune: remove (default: say what would go)")

    p = sub.add_parser("provision", help="create or reuse the venv of vLLM releases")
    p.add_argument("versions", nargs="+", metavar="VERSION")
    p.add_argument(
        "--full",
        action="store_true",
        help="install the release's whole dated resolution (default: lean, without the GPU "
        "kernels and tools kvspec never loads; targets/lean.py)",
    )

    p = sub.add_parser("test-targets", help="run tests/targets inside each provisioned target")
    p.add_argument(
        "versions",
        nargs="*",
        metavar="VERSION",
        help="the releases (default: every provisioned one)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0) if exit_.code in (0, None) else EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    # What the command re-executes in a target: everything after the subcommand, as given.
    try:
        if args.command == "check":
            if args.profile is None:
                # profiles.load()'s choice, without loading it into this process's settings
                args.profile = (
                    "ci" if os.environ.get("CI") else os.environ.get("KVSPEC_PROFILE", "dev")
                )
                if args.profile not in PROFILES:
                    raise UsageError(
                        f"KVSPEC_PROFILE={args.profile} is not a profile",
                        f"one of: {', '.join(PROFILES)}",
                    )
            if args.baseline:
                return cmd_pr(args, argv)
            return cmd_check(args, argv)
        if args.command == "bisect":
            return cmd_bisect(args)
        if args.command == "diff":
            return cmd_diff(args)
        if args.command == "fuzz":
            if args.machine == "scheduler":
                return cmd_fuzz_scheduler(args, argv, campaign_seconds(args))
            return cmd_fuzz(args, argv)
        if args.command == "replay":
            return cmd_replay(args, argv)
        if args.command == "explain":
            return cmd_explain(args)
        if args.command == "prove":
            return cmd_prove(args.selection, args.deep, args.list, args.json)
        if args.command == "targets":
            if args.prune is not None:
                return cmd_prune(args)
            return cmd_targets()
        if args.command == "provision":
            return cmd_provision(args)
        if args.command == "test-targets":
            return cmd_test_targets(args)
    except UsageError as error:
        return fail_usage(error)
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    parser.error(f"unknown command {args.command}")
    return EXIT_USAGE


# ------------------------------------------------------------------------------ explain


def cmd_explain(args: argparse.Namespace) -> int:
    if args.id is None:
        table = Table(title="Invariants (kvspec explain ID)", title_justify="left")
        table.add_column("ID")
        table.add_column("title")
        for inv in INVARIANTS.values():
            table.add_row(inv.id, escape(inv.title))
        out.print(table)
        return EXIT_OK
    (inv_id,) = check_invariant_ids([args.id]) or ()
    inv = INVARIANTS[inv_id]
    fn = getattr(inv.check, "__wrapped__", inv.check)
    out.rule(f"[bold]{inv.id}[/]: {escape(inv.title)}", align="left")
    out.print(f"[bold]Statement[/] ({inv.kind} invariant)")
    out.print(textwrap.indent(inspect.cleandoc(fn.__doc__ or inv.statement), "  "), markup=False)
    out.print(f"\n[bold]vLLM code it concerns[/]\n  {escape(inv.concerns)}")
    out.print(f"\n[bold]Applies[/]\n  {escape(inv.applies_when())}")
    try:
        source = inspect.getsource(fn)
        where = f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        source, where = "(source not available)", "?"
    out.print(f"\n[bold]Spec source[/] ({escape(where)})")
    out.print(Syntax(source, "python", theme="ansi_dark", line_numbers=False, word_wrap=True))
    # Imported here, not at the top: z3 is loaded only by the commands that need it.
    from kvspec.proofs import OBLIGATIONS

    out.print("[bold]z3 obligations[/]")
    backing = [ob for ob in OBLIGATIONS.values() if inv_id in ob.serves]
    if not backing:
        out.print("  none: this invariant is checked by the machines only")
    for ob in backing:
        tag = "proof" if ob.expected == "proved" else "expected counterexample"
        deep = ", deep only" if ob.deep_only else ""
        also = [i for i in ob.serves if i != inv_id]
        with_ = f"; also serves {', '.join(also)}" if also else ""
        out.print(f"  [bold]{escape(ob.id)}[/] ({tag}{deep}{with_})")
        out.print(textwrap.indent(textwrap.fill(ob.statement, 92), "    "), markup=False)
    out.print("  run them: kvspec prove", markup=False)
    return EXIT_OK


# ------------------------------------------------------------------------------ prove


def cmd_prove(selection: list[str], deep: bool, list_only: bool, json_path: Path | None) -> int:
    """Run the z3 obligations ``selection`` names (ID prefixes; none: all), or only list them;
    print their table, and write their results as JSON to ``json_path`` when given.  0 when every
    obligation came out as expected."""
    # Imported here, not at the top: z3 is loaded only by the commands that need it.
    from kvspec.proofs import run_all
    from kvspec.proofs.core import select
    from kvspec.proofs.report import console, summary, table, to_json

    show = console()
    chosen = select(selection or None, deep)
    if not chosen:
        show.print(f"no obligation matches {selection}")
        return EXIT_USAGE
    if list_only:
        for ob in chosen:
            show.print(f"{ob.id}  [{ob.expected}]  {ob.statement}")
        return EXIT_OK
    with show.status("proving...") as status:
        results = run_all(
            selection or None,
            deep,
            on_result=lambda r: status.update(f"proving... {r.obligation}: {r.outcome}"),
        )
    show.print(table(results, "kvspec prove" + (" (deep)" if deep else "")))
    show.print(summary(results))
    if json_path is not None:
        json_path.write_text(to_json(results))
    return EXIT_OK if all(r.ok for r in results) else EXIT_FOUND


# ------------------------------------------------------------------------------ targets


def cmd_targets() -> int:
    provisioned = {t.version: t for t in provisioned_targets()}
    table = Table(title="vLLM targets", title_justify="left")
    table.add_column("release")
    table.add_column("engine")
    table.add_column("implementations (--impl)")
    table.add_column("pinned")
    table.add_column("venv")
    versions = list(dict.fromkeys([*PINNED, *provisioned]))
    for version in versions:
        try:
            t = provisioned.get(version) or target(version)
        except TargetError as error:
            table.add_row(version, "?", escape(str(error)), "", "")
            continue
        venv = (
            f"[green]{escape(str(t.venv))}[/]"
            if version in provisioned
            else "[dim]not provisioned[/]"
        )
        impls = [*shipped(version, "legacy"), *shipped(version, "v1")] or list(t.managers)
        table.add_row(version, t.engine, ", ".join(impls), "yes" if version in PINNED else "", venv)
    out.print(table)
    for t in provisioned.values():
        print_installed(t)
    print_disk(list(provisioned.values()))
    lo, hi = (".".join(map(str, v)) for v in LEGACY_RANGE)
    out.print(
        f"known: legacy block managers {lo} .. {hi}; the V1 KVCacheManager from "
        f"{'.'.join(map(str, V1_FROM))} on (both in between: pick with --impl)",
        markup=False,
    )
    here = locate_vllm()
    from .target import here_local

    if here is None:
        out.print(f"this interpreter ({sys.executable}): no vLLM", markup=False)
    else:
        out.print(
            f"this interpreter ({sys.executable}): vLLM {here_local().version} at {here}",
            markup=False,
        )
    out.print(
        "provision one: kvspec provision VERSION; implementations: "
        + ", ".join(impl_names()[:5])
        + ", broken:<name>",
        markup=False,
    )
    return EXIT_OK


def print_installed(t: Target) -> None:
    """A provisioned venv's locked versions (kvspec-lock.json), summarised, with its flags."""
    record = read_record(t.venv)
    if record is None:
        out.print(
            f"vLLM {t.version}: no record of its installed versions yet "
            f"(kvspec provision {t.version} writes it without reinstalling)",
            markup=False,
        )
        return
    from kvspec.targets.provision import newer_than_release, unexpected_for_release

    how = f"uv, dependencies as of {record.cutoff}" if record.method.startswith("uv") else record.method
    how += ", lean" if record.lean else ", full"
    out.print(f"vLLM {t.version} ({how}): {record.summary()}", markup=False)
    if record.lean:
        names = ", ".join(entry.split(":", 1)[0] for entry in record.left_out)
        out.print(f"  left out (targets/lean.py): {names or 'nothing this release installs'}", markup=False)
    if record.pruned:
        files = ", ".join(entry.split(" (", 1)[0] for entry in record.pruned[:3])
        more = f" + {len(record.pruned) - 3} more" if len(record.pruned) > 3 else ""
        out.print(f"  files removed, never loaded (targets/lean.py): {files}{more}", markup=False)
    out.print(f"  installed versions and hashes: {record_path(t.venv)}", markup=False)
    if record.lockfile:
        out.print(f"  dated resolution with hashes: {record.lockfile}", markup=False)
    for f in record.flags():
        out.print(f"  [red]FLAGGED[/] {escape(str(f))}")
    unexpected = unexpected_for_release(record, t.venv)
    if unexpected:
        names = ", ".join(f"{f.name} {f.version}" for f in unexpected)
        out.print(f"  [red]FLAGGED[/] not in the release's dated resolution: {escape(names)}")
    newer = newer_than_release(record)
    if newer:
        out.print(f"  {len(newer)} installed versions differ from the dated resolution", markup=False)


def print_disk(provisioned: list[Target]) -> None:
    """What each provisioned venv and the uv cache cost on disk (targets/disk.py)."""
    from kvspec.targets.disk import cache_disk, gib, venv_disk

    for t in provisioned:
        d = venv_disk(t.venv)
        out.print(
            f"disk, vLLM {t.version}: {gib(d.own)} its own, {gib(d.shared)} shared with the uv cache "
            f"(hard links), of which {gib(d.alone)} no other venv uses "
            f"(freed by kvspec targets --prune {t.version} --yes)",
            markup=False,
        )
    c = cache_disk()
    unused = [e for e in c.entries if not e.used]
    out.print(
        f"disk, uv cache {c.path}: {gib(c.total)}; {len(unused)} of {len(c.entries)} unpacked wheels "
        f"no venv uses, {gib(c.unused)} (kvspec targets --prune --yes removes them)",
        markup=False,
    )


def cmd_prune(args: argparse.Namespace) -> int:
    from kvspec.targets.disk import gib, prune

    provisioned = {t.version: t for t in provisioned_targets()}
    missing = [v for v in args.prune if v not in provisioned]
    if missing:
        raise UsageError(
            f"--prune {' '.join(missing)}: not a provisioned release", "kvspec targets lists them"
        )
    try:
        pruned = prune(tuple(provisioned[v].venv for v in args.prune), apply=args.yes)
    except TargetError as error:
        raise UsageError(str(error), "wait for the provisioning run to end") from None
    verb = "removed" if args.yes else "would remove"
    for venv in pruned.venvs:
        out.print(f"{verb} {venv}", markup=False)
    out.print(
        f"{verb} {len(pruned.entries)} uv cache entries no venv uses ({gib(pruned.bytes)}) and "
        f"{len(pruned.pointers)} cache pointers naming them",
        markup=False,
    )
    if pruned.kept_recent:
        out.print(
            f"kept {len(pruned.kept_recent)} unused entries changed in the last hour (a provisioning "
            "run may be about to link them)",
            markup=False,
        )
    if not args.yes:
        out.print("nothing removed: add --yes", markup=False)
    return EXIT_OK


def cmd_provision(args: argparse.Namespace) -> int:
    for version in args.versions:
        t = ensure_provisioned(version, recheck=True, full=args.full)
        out.print(f"vLLM {version}: ready at {t.venv}", markup=False)
    return EXIT_OK


def cmd_test_targets(args: argparse.Namespace) -> int:
    from kvspec.targets.provision import REPO

    tests = REPO / "tests" / "targets"
    if not tests.is_dir():
        raise UsageError(f"{tests} does not exist", "tests/targets holds the in-target suite")
    provisioned = {t.version: t for t in provisioned_targets()}
    versions = args.versions or list(provisioned)
    if not versions:
        raise UsageError("no target is provisioned", "kvspec provision 0.6.3 0.33.0")
    table = Table(title="tests/targets per target", title_justify="left")
    table.add_column("release")
    table.add_column("result")
    table.add_column("summary", overflow="fold")
    failed = False
    for version in versions:
        t = provisioned.get(version)
        if t is None:
            table.add_row(version, "[red]not provisioned[/]", f"kvspec provision {escape(version)}")
            failed = True
            continue
        cmd = [
            str(t.python),
            "-m",
            "pytest",
            str(tests.relative_to(REPO)),
            "-q",
            "-p",
            "no:cacheprovider",
        ]
        with err.status(f"vLLM {version}: {' '.join(cmd[1:])}", spinner="dots"):
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        summary = lines[-1] if lines else "(no output)"
        ok = proc.returncode == 0
        failed |= not ok
        table.add_row(
            version,
            "[green]passed[/]" if ok else f"[red]failed (exit {proc.returncode})[/]",
            escape(summary),
        )
        if not ok:
            err.print(
                f"--- vLLM {version}: last lines ---\n{first_lines(chr(10).join(lines[-30:]), 30)}",
                markup=False,
            )
    out.print(table)
    return EXIT_FOUND if failed else EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["EXIT_FOUND", "EXIT_OK", "EXIT_USAGE", "Path", "build_parser", "main"]
