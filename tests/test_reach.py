"""The coverage plumbing of ``kvspec check --coverage`` (testing/reach.py) over a small stand-in
package laid out like vLLM's block-management code: lines run in this process and in a Python
child process are both measured, the never-entered functions are named, the HTML map and
coverage.json are written, and a changed line is reported as run or not."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
from kvspec.testing.reach import (
    HTML_FOLDER,
    JSON_NAME,
    V1_FILES,
    Measurement,
    analyse,
    block_management_files,
    changed_lines,
    functions,
    measured_patterns,
)

pytest.importorskip("coverage", reason="coverage.py is a kvspec requirement: pip install -e .")

POOL = textwrap.dedent(
    '''\
    from typing import overload


    class Pool:
        def take(self, n):
            if n > 0:
                return n
            return 0

        def give(self, n):
            return -n

        @overload
        def typed(self, n: int) -> int: ...

        def typed(self, n):
            return n

        def never(self):
            def inner():
                return 1

            return inner()


    def helper(x):
        """Docstring."""
        return x + 1
    '''
)


@pytest.fixture
def stand_in(tmp_path):
    """A package folder ``vllm_stand_in`` with the V1 file layout; only block_pool.py has code."""
    root = tmp_path / "vllm_stand_in"
    for rel in V1_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("VALUE = 1\n")
    (root / "v1/core/block_pool.py").write_text(POOL)
    return root


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_functions_are_qualified_and_overload_stubs_left_out():
    names = [f.name for f in functions(POOL)]
    assert names == ["Pool.take", "Pool.give", "Pool.typed", "Pool.never", "Pool.never.inner", "helper"]
    take = functions(POOL)[0]
    assert take.entered({7}) and not take.entered({5})  # 5 is the def line, run at import


def test_changed_lines_are_the_replaced_and_inserted_lines_of_the_new_text():
    old = "a\nb\nc\n"
    assert changed_lines("a\nB\nc\n", old) == {2}
    assert changed_lines("a\nb\nx\ny\nc\n", old) == {3, 4}
    assert changed_lines("a\nc\n", old) == set()  # a deletion changes no line of the new text


def test_reach_measures_this_process_and_its_python_children(stand_in, tmp_path):
    pool_file = stand_in / "v1/core/block_pool.py"
    m = Measurement(measured_patterns(stand_in), tmp_path / "data").start()
    try:
        pool = _import(pool_file, "reach_stand_in_pool")
        pool.Pool().take(1)
        child = (
            f"import importlib.util as u; s = u.spec_from_file_location('p', {str(pool_file)!r}); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); m.Pool().give(2)"
        )
        subprocess.run([sys.executable, "-c", child], check=True)
    finally:
        m.stop()
    old = tmp_path / "old"
    (old / "v1/core").mkdir(parents=True)
    # The compared version lacks `return n` of take (line 7) and `return -n` of give (line 11)
    # differs; `return 0` (line 8) is unchanged.
    (old / "v1/core/block_pool.py").write_text(POOL.replace("return n\n", "pass\n", 1).replace("return -n", "return n"))
    out = tmp_path / "report"
    reach = analyse(m.finish(), block_management_files(stand_in, "v1"), stand_in, out, compared=old)
    by_name = {f.name: f for f in reach.files}
    assert sorted(by_name) == sorted(V1_FILES)
    f = by_name["v1/core/block_pool.py"]
    assert f.imported and f.executed < f.statements
    assert f.branches == 2 and f.branches_taken == 1  # take's `if`: only the true side
    never = {n.split(":")[0] for n in f.never_entered}
    assert "Pool.give" not in never, "the child process's call was not measured"
    assert never == {"Pool.typed", "Pool.never", "Pool.never.inner", "helper"}
    assert f.changed == (7, 11) and f.changed_executed == (7, 11)
    other = by_name["v1/core/kv_cache_utils.py"]
    assert not other.imported and other.executed == 0 and other.statements == 1
    assert (out / HTML_FOLDER / "index.html").is_file()
    data = json.loads((out / JSON_NAME).read_text())
    assert str(pool_file.resolve()) in data["files"]
    assert reach.to_json()["lines_executed"] == f.executed


def test_a_failing_hypothesis_case_does_not_end_the_measurement(stand_in, tmp_path):
    """After a failure hypothesis traces later cases for its explain phase; on Python < 3.12
    with ``sys.settrace``, which would replace coverage's tracer for the rest of the run."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    pool_file = stand_in / "v1/core/block_pool.py"

    @settings(database=None, derandomize=True, max_examples=20)
    @given(st.integers(0, 10))
    def fails(n):
        assert n < 3

    m = Measurement(measured_patterns(stand_in), tmp_path / "data").start()
    try:
        with pytest.raises(AssertionError):
            fails()
        pool = _import(pool_file, "reach_stand_in_pool_after_failure")
        pool.helper(1)
    finally:
        m.stop()
    reach = analyse(m.finish(), [pool_file], stand_in, tmp_path / "report")
    assert "helper" not in {n.split(":")[0] for n in reach.files[0].never_entered}


def test_legacy_reach_is_the_whole_core_folder(tmp_path):
    for rel in ("core/block_manager.py", "core/block/block_table.py", "core/__init__.py", "v1/core/block_pool.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    names = [p.relative_to(tmp_path).as_posix() for p in block_management_files(tmp_path, "legacy")]
    assert names == ["core/block/block_table.py", "core/block_manager.py"]
    assert [p.relative_to(tmp_path).as_posix() for p in block_management_files(tmp_path, "v1")] == [
        "v1/core/block_pool.py"
    ]


def test_pr_mode_reads_the_changed_lines_that_ran(tmp_path):
    from kvspec.cli.pr import base_package, changed_lines_run

    files = [
        {"name": "core/block_manager_v2.py", "changed": [445, 446, 452], "changed_executed": [445, 446]},
        {"name": "core/scheduler.py", "changed": [], "changed_executed": []},
    ]
    (tmp_path / "summary.json").write_text(json.dumps({"coverage": {"files": files}}))
    want = {"core/block_manager_v2.py": {"changed": [445, 446, 452], "executed": [445, 446]}}
    assert changed_lines_run(tmp_path) == want
    assert changed_lines_run(tmp_path / "absent") is None
    assert base_package(str(tmp_path), ["--vllm-source", str(tmp_path)]) == tmp_path / "vllm"
