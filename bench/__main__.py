"""``python -m bench <command>`` from the repository root (see bench/__init__.py)."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--results", help="directory for the JSON results (default bench/results)")
    common.add_argument("--md", help="markdown file to update (default BENCHMARKS.md)")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("throughput", parents=[common],
                       help="oracle steps/s vs raw replay of the same traces; cProfile")
    t.add_argument("--targets", nargs="*", help="e.g. reference v1@0.33.0 legacy-v2@0.6.3")
    t.add_argument("--examples", type=int, default=100)
    t.add_argument("--steps", type=int, default=40, help="stateful_step_count")
    t.add_argument("--profile-examples", type=int, default=30, help="0: no profile")
    t.add_argument("--repeats", type=int, default=3, help="best of this many runs")

    c = sub.add_parser("ttc", parents=[common],
                       help="time to first counterexample: broken variants and the seed bug")
    c.add_argument("--seeds", type=int, default=5)
    c.add_argument("--variants", nargs="*", help="broken variant names (default: all)")
    c.add_argument("--findings", nargs="*", help="pinned FINDINGS.md cases (default: all of "
                   "bench/commands.py TTC_FINDINGS and TTC_SCHEDULER_FINDINGS; F1 is the seed bug)")
    c.add_argument("--scheduler-variants", nargs="*", metavar="NAME",
                   help="broken schedulers of reference/broken_scheduler.py, the differential-only "
                   "ones included (default: all)")
    c.add_argument("--merge", action="store_true",
                   help="keep the saved rows of the cases this run does not run")
    c.add_argument("--max-examples", type=int, default=2000)
    c.add_argument("--steps", type=int, default=40, help="stateful_step_count (the dev profile's)")
    c.add_argument("--explain", nargs="*", default=[], metavar="CASE",
                   help="also run these cases (variant names, or F1..) with hypothesis' "
                   "explain phase, which the profiles leave out")

    pr = sub.add_parser("proofs", parents=[common],
                        help="time of each z3 obligation; BMC time against k, N, S")
    pr.add_argument("--deep", action="store_true", help="also the deep bounds of each obligation")
    pr.add_argument("--only", nargs="*", help="obligation id prefixes")
    pr.add_argument("--grid", choices=("none", "quick", "full"), default="full",
                    help="the BMC k/N/S sweep")
    pr.add_argument("--timeout", type=float, default=120.0,
                    help="z3 timeout (s) per query of a BMC grid point")
    pr.add_argument("--ob-timeout", type=float, default=600.0,
                    help="wall-clock limit (s) per obligation at default bounds")
    pr.add_argument("--ob-timeout-deep", type=float, default=1800.0,
                    help="wall-clock limit (s) per obligation at deep bounds")

    s = sub.add_parser("scale", parents=[common],
                       help="cost per step against pool size, live sequences, prompt length")
    s.add_argument("--targets", nargs="*")
    s.add_argument("--quick", action="store_true", help="the two smallest points per dimension")

    m = sub.add_parser("mutate", parents=[common],
                       help="mutation score of the oracle on vLLM's own block-manager code")
    m.add_argument("--targets", nargs="*", help="v1@0.33.0 legacy-v2@0.6.3 (default both)")
    m.add_argument("--max-mutants", type=int, default=150,
                   help="uniform sample size per target (over every generated mutant)")
    m.add_argument("--invariants", nargs="*", metavar="ID",
                   help="the oracle watches only these invariants (default: every one)")
    m.add_argument("--oracle", choices=("check", "narrow", "lockstep"), default="check",
                   help="check: what `kvspec check --vllm X` runs by default (the CLI's "
                   "configurations, every invariant, and on V1 the scheduler machine's shapes); "
                   "narrow: the KVCacheMachine on the target's bench workload; lockstep: the PR "
                   "verdict (`kvspec check --vllm-source MUTANT --baseline X`) on the mutants of "
                   "the check run in mutation.json (or --keys), one at a time, each within --timeout")
    m.add_argument("--shape-examples", type=int, default=None,
                   help="scheduler-shape examples per mutant with --oracle check (default "
                   "--examples)")
    m.add_argument("--reach", action="store_true",
                   help="with --assemble WORKDIR of a kept run: bench.reach's straight-line "
                   "scenarios on every mutant its baseline covered (or --keys)")
    m.add_argument("--seeds", type=int, metavar="N",
                   help="with --keys and --assemble WORKDIR: each mutant under N hypothesis "
                   "seeds (random search) with --search's machine; the search evidence")
    m.add_argument("--search", choices=("default", "swarm"), default="default",
                   help="the machine: KVCacheMachine, or SwarmMachine (testing/swarm.py)")
    m.add_argument("--assemble", metavar="WORKDIR",
                   help="rebuild a cut-short run's result from its kept work directory and "
                   "progress file (same --targets and --max-mutants)")
    m.add_argument("--keys", nargs="*", metavar="KEY",
                   help="run exactly these mutants (module:site:op:variant) instead of a sample")
    m.add_argument("--no-replay", action="store_true",
                   help="do not replay a survivor on the baseline's traces (the evidence for "
                   "'suspected equivalent'; it doubles a survivor's cost)")
    m.add_argument("--no-vllm-tests", action="store_true",
                   help="skip vLLM's own unit tests (from the release's sdist) on the mutants")
    m.add_argument("--examples", type=int, default=80, help="hypothesis examples per mutant")
    m.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant")
    m.add_argument("--jobs", type=int, default=2)
    m.add_argument("--modules", nargs="*", help="restrict to these module names")
    m.add_argument("--list", action="store_true", help="only generate and count mutants")
    m.add_argument("--keep", action="store_true", help="keep the temporary work directory")

    x = sub.add_parser("crosshair", parents=[common],
                       help="hypothesis' CrossHair backend against random search, same properties")
    x.add_argument("--examples", type=int, default=50, help="examples per case and backend")
    x.add_argument("--limit", type=float, default=300.0, help="wall-clock seconds per case")
    x.add_argument("--cases", nargs="*", help="e.g. spec:window-cover op:reference machine:...")

    v = sub.add_parser("verdicts", parents=[common],
                       help="the default `kvspec check --vllm X --seed S` over releases and seeds: "
                       "exit code, time and every verdict line")
    v.add_argument("--releases", nargs="+", required=True)
    v.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    v.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")

    r = sub.add_parser("render", parents=[common],
                       help="rewrite BENCHMARKS.md sections from saved bench/results/*.json")
    r.add_argument("names", nargs="*",
                   help="throughput ttc proofs scale mutation (default: all saved)")

    w = sub.add_parser("_worker", help=argparse.SUPPRESS)
    w.add_argument("task")
    w.add_argument("params")
    w.add_argument("out")
    return p


def main(argv: list[str] | None = None) -> int:
    from .common import pin_kvspec_to_checkout

    pin_kvspec_to_checkout()
    args = _parser().parse_args(argv)
    if args.command == "_worker":
        if args.task.startswith("mutation-"):
            from . import mutation

            mutation.worker_main(args.task, args.params, args.out)
        else:
            from .worker import main as worker_main

            worker_main(args.task, args.params, args.out)
        return 0
    from . import commands

    if args.command == "render":
        commands.cmd_render(args)
    elif args.command == "proofs":
        from .proofcost import cmd_proofs

        cmd_proofs(args)
    elif args.command == "crosshair":
        from .crosshair import cmd_crosshair

        cmd_crosshair(args)
    elif args.command == "verdicts":
        from .verdicts import cmd_verdicts

        cmd_verdicts(args)
    elif args.command == "mutate":
        from .mutation import cmd_mutate

        cmd_mutate(args)
    else:
        getattr(commands, f"cmd_{args.command}")(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
