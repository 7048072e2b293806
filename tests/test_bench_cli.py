"""``python -m bench``'s command line (cli/bench.py) fits the functions it runs: every
subcommand's options bind to its function's keyword parameters, so that no option is dropped
and no parameter is left without one."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
from kvspec.cli.bench import bench_parser, parse_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ is a folder of the checkout
from bench.__main__ import _command
from bench.mutation import MutateOptions

# The least each subcommand needs on its command line.
REQUIRED = {"verdicts": ["--releases", "0.33.0"], "reproducers": ["/tmp"], "_worker": ["task", "{}", "out"],
            "lean-trace": ["report", "--venv", "/tmp", "/tmp"]}


def _subcommands() -> list[str]:
    (sub,) = [a for a in bench_parser()._actions if a.dest == "command"]
    return sorted(sub.choices)


@pytest.mark.parametrize("name", _subcommands())
def test_every_subcommands_options_bind_to_its_function(name):
    parsed, options = parse_bench([name, *REQUIRED.get(name, [])])
    assert parsed == name
    if name == "mutate":
        MutateOptions(**options)
    elif name == "lean-trace":
        assert options["lean_command"] == "report"
    else:
        inspect.signature(_command(name)).bind(**options)


def test_a_missing_option_fails_the_binding():
    _, options = parse_bench(["scale"])
    del options["quick"]
    with pytest.raises(TypeError):
        inspect.signature(_command("scale")).bind(**options)


def test_checktime_renders_each_run_with_its_median():
    from bench.checktime import render_checktime

    machine = {"nproc": 2, "cpu": "x", "memory": "1 GiB", "python": "3.11", "date": "d", "commit": "c",
               "loadavg": [1.0]}
    rows = [{"run": "check", "repeat": 0, "wall": 20.0, "cpu": 15.0, "exit": 0},
            {"run": "check", "repeat": 1, "wall": 22.0, "cpu": 16.0, "exit": 0},
            {"run": "planted", "repeat": 0, "wall": 40.0, "cpu": 30.0, "exit": 1, "reproducers": ["verified"]}]
    text = render_checktime({"machine": machine, "command": "python -m bench checktime", "release": "0.33.0",
                             "seed": 1, "tests": {"files": ["a.py"], "deselected": 2}, "rows": rows})
    assert "| check | 2 | 20.0 / 22.0 | 21.0 |" in text
    assert "| planted | 1 | 40.0 | 40.0 |" in text and "verified" in text


def test_lean_trace_records_the_files_a_process_opens_and_the_programs_it_starts(tmp_path):
    """bench.lean_trace's evidence for the files a lean venv removes (targets/lean.py): beside
    imported modules and mapped shared objects, what Python opens and starts."""
    from bench.lean_trace import run

    data = tmp_path / "data.txt"
    data.write_text("x")
    code = f"open({str(data)!r}).read(); import subprocess; subprocess.run(['/bin/true'])"
    assert run(tmp_path / "trace", [sys.executable, "-c", code]) == 0
    (trace,) = (tmp_path / "trace").glob("*.txt")
    lines = trace.read_text().splitlines()
    assert str(data) in lines and "/bin/true" in lines
