"""``python -m bench``'s command line (bench/__main__.py runs what it names).

cli/ imports nothing of bench/: ``parse_bench`` turns the arguments into the subcommand's name
and its keyword arguments, which bench/__main__.py passes to the subcommand's function.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH_DESCRIPTION = (
    "Benchmarks of kvspec, run from the repository root: each subcommand saves its JSON "
    "results (bench/results) and rewrites its section of BENCHMARKS.md."
)


def bench_parser() -> argparse.ArgumentParser:
    """``python -m bench``'s command line: one subcommand per benchmark."""
    p = argparse.ArgumentParser(prog="python -m bench", description=BENCH_DESCRIPTION)
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
    c.add_argument("--variants", nargs="*", help="broken variant names (default: all; the flag with no "
                   "name: none)")
    c.add_argument("--findings", nargs="*", help="pinned FINDINGS.md cases (default: all of "
                   "bench/commands.py TTC_FINDINGS and TTC_SCHEDULER_FINDINGS; F1 is the seed bug)")
    c.add_argument("--scheduler-variants", nargs="*", metavar="NAME",
                   help="broken schedulers of reference/broken_scheduler.py, the differential-only "
                   "ones included (default: all; the flag with no name: none)")
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
                   help="the machine: KVCacheMachine, or SwarmMachine (testing/blockmanager/swarm.py)")
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
    m.add_argument("--vllm-tests-from", metavar="MUTATION_JSON",
                   help="take vLLM's own tests' verdict of each sampled mutant from an earlier "
                   "run's results (its mutation.json): the tests never see the oracle, so a "
                   "mutant's verdict stands while the release and the mutant are the same; a "
                   "sampled mutant the file has no verdict for is an error")
    m.add_argument("--first-verdict", action="store_true",
                   help="--oracle lockstep: each PR verdict stops at its first verdict, unshrunk "
                   "(`kvspec check --first-verdict`): a detection count at a fraction of the cost")
    m.add_argument("--examples", type=int, default=80, help="hypothesis examples per mutant")
    m.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant")
    m.add_argument("--jobs", type=int, default=2)
    m.add_argument("--modules", nargs="*", help="restrict to these module names")
    m.add_argument("--list", dest="list_only", action="store_true", help="only generate and count mutants")
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

    ct = sub.add_parser("checktime", parents=[common],
                        help="the wall time of the default `kvspec check --vllm X` beside vLLM's own "
                        "test files, alternating in one run")
    ct.add_argument("--release", default="0.33.0")
    ct.add_argument("--seed", type=int, default=1)
    ct.add_argument("--repeats", type=int, default=3)
    ct.add_argument("--planted", action="store_true",
                    help="also a check that finds something (a planted scheduler leak), its reproducer "
                    "verified in a forked child and in a fresh interpreter")
    ct.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")

    r = sub.add_parser("render", parents=[common],
                       help="rewrite BENCHMARKS.md sections from saved bench/results/*.json")
    r.add_argument("names", nargs="*",
                   help="throughput ttc proofs scale mutation (default: all saved)")

    rp = sub.add_parser("reproducers",
                        help="how many reported violations got a verified standalone reproducer")
    rp.add_argument("folders", nargs="+", type=Path,
                    help="`kvspec check --out` folders (or folders above several)")
    rp.add_argument("--json", dest="json_path", type=Path, help="also write the figures here")

    lt = sub.add_parser("lean-trace", formatter_class=argparse.RawDescriptionHelpFormatter,
                        help="which distributions of a target venv a kvspec run loads "
                        "(targets/lean.py's evidence)")
    lean = lt.add_subparsers(dest="lean_command", required=True)
    run = lean.add_parser("run", help="run a command with the module-recording sitecustomize")
    run.add_argument("--out", required=True, type=Path)
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    report = lean.add_parser("report", help="map the recorded files to the venv's distributions")
    report.add_argument("--venv", required=True, type=Path)
    report.add_argument("traces", nargs="+", type=Path)

    w = sub.add_parser("_worker", help=argparse.SUPPRESS)
    w.add_argument("task")
    w.add_argument("params")
    w.add_argument("out")
    return p


def parse_bench(argv: Sequence[str] | None = None) -> tuple[str, dict[str, Any]]:
    """The subcommand ``argv`` names and its options, as keyword arguments."""
    options = vars(bench_parser().parse_args(argv))
    return options.pop("command"), options
