"""Blame: an exception raised in kvspec's own code is a kvspec error (its whole traceback, a
request to report it, exit code ``EXIT_KVSPEC_ERROR``); "the target crashed" only when the
innermost frame of either party's code is the target's (vLLM, or kvspec's own implementations
under test in reference/).

The exceptions are planted: a function compiled under a module name and file path of vLLM's
(``vllm/v1/core/planted.py``) or of kvspec's adapters, called from a method of the reference
block manager or the reference scheduler, through the real command line and the scheduler
machine's run."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from kvspec.cli.common import EXIT_FOUND, EXIT_KVSPEC_ERROR
from kvspec.cli.main import main
from kvspec.reference.manager import ReferenceManager
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.testing.guard import raised_in_kvspec

VLLM = ("vllm.v1.core.planted", "/site-packages/vllm/v1/core/planted.py")
KVSPEC = ("kvspec.adapters.planted", "/site-packages/kvspec/adapters/planted.py")
REFERENCE = ("kvspec.reference.planted", "/site-packages/kvspec/reference/planted.py")
FAST = ["--profile", "ci", "--no-known", "--examples", "20", "--max-violations", "1", "--no-shapes"]


def planted(where: tuple[str, str]) -> Callable[..., None]:
    """A function that raises, as if defined in the module ``where`` names."""
    module, path = where
    namespace: dict = {"__name__": module}
    exec(compile("def boom(*_args, **_kw):\n    raise RuntimeError('planted')\n", path, "exec"), namespace)
    return namespace["boom"]


def raised(where: tuple[str, str], through: Callable[[Callable], None] | None = None) -> BaseException:
    boom = planted(where)
    try:
        (through or (lambda f: f()))(boom)
    except RuntimeError as error:
        return error
    raise AssertionError("nothing raised")


def test_the_innermost_frame_of_either_party_is_blamed():
    assert raised_in_kvspec(raised(KVSPEC))
    assert not raised_in_kvspec(raised(VLLM))
    assert not raised_in_kvspec(raised(REFERENCE))  # kvspec's own implementation under test
    # vLLM calling back into kvspec's code that raises: kvspec's; kvspec calling vLLM: vLLM's.
    assert raised_in_kvspec(raised(KVSPEC, through=planted_caller(VLLM)))
    assert not raised_in_kvspec(raised(VLLM, through=planted_caller(KVSPEC)))
    # Frames of neither party (the standard library, this test) belong to their caller.
    assert not raised_in_kvspec(raised(VLLM, through=lambda f: sorted([1, 2], key=lambda _x: f())))


def planted_caller(where: tuple[str, str]) -> Callable[[Callable], None]:
    module, path = where
    namespace: dict = {"__name__": module}
    exec(compile("def call(f):\n    f()\n", path, "exec"), namespace)
    return namespace["call"]


@pytest.mark.parametrize(
    ("where", "code", "headline"),
    [(KVSPEC, EXIT_KVSPEC_ERROR, "kvspec failed (not the target)"), (VLLM, EXIT_FOUND, "the target crashed")],
)
def test_block_manager_check_blames_the_raising_code(where, code, headline, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ReferenceManager, "free", lambda self, seq_id: planted(where)())
    got = main(["check", "--impl", "reference", *FAST, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert got == code, out
    assert headline in out
    assert ("this is a bug in kvspec, please report it" in out) == (where is KVSPEC)
    report = json.loads(next(tmp_path.rglob("report.json")).read_text())
    assert report["outcome"] == ("kvspec-error" if where is KVSPEC else "error")
    assert report["trace"][-1]["op"] == "free" and report["trace"][-1]["crash"]


@pytest.mark.parametrize(("where", "status"), [(KVSPEC, "kvspec-error"), (VLLM, "error")])
def test_scheduler_run_blames_the_raising_code(where, status, monkeypatch):
    from kvspec.cli.shapes import run_shapes, shapes_exit

    monkeypatch.setattr(ReferenceScheduler, "abort", lambda self, seq_id: planted(where)())
    o = run_shapes(ReferenceScheduler, profile="ci", examples=30, steps=None, seed=1, focus=None)
    assert o.status == status, o.error
    assert shapes_exit(0, o) == (EXIT_KVSPEC_ERROR if where is KVSPEC else EXIT_FOUND)
    assert o.traceback and "planted" in o.traceback[-1]
