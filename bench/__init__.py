"""Measurements of the kvspec oracle: throughput, time to first counterexample,
proof cost, scale and mutation score.  Run from the repository root::

    python -m bench --help

Every figure lands in BENCHMARKS.md (between ``<!-- bench:NAME -->`` markers) together with
the command, the machine and the date, and in ``bench/results/NAME.json``.  Figures are never
asserted in tests: tests/test_bench_smoke.py only checks that the commands run.

Benchmarks that drive a vLLM release run in that release's provisioned venv: the command
re-executes ``python -m bench _worker ...`` with the venv's interpreter (see ``common``).
"""
