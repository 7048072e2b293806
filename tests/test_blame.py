"""Blame: an exception raised in kvspec's own code is a kvspec error (its whole traceback, a
request to report it, exit code ``EXIT_KVSPEC_ERROR``); "the target crashed" only when the
raising frame (the innermost outside the standard library) is not kvspec's own code (vLLM's, an
implementation defined elsewhere, or kvspec's own implementations under test in reference/).

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


def planted(where: tuple[str, str], body: str = "raise RuntimeError('planted')") -> Callable[..., None]:
    """A function running ``body`` (it raises), as if defined in the module ``where`` names."""
    module, path = where
    namespace: dict = {"__name__": module}
    exec(compile(f"import json\ndef boom(*args, **_kw):\n    {body}\n", path, "exec"), namespace)
    return namespace["boom"]


def raised(boom: Callable[..., None], *args: object) -> BaseException:
    try:
        boom(*args)
    except (RuntimeError, ValueError) as error:
        return error
    raise AssertionError("nothing raised")


def test_the_raising_frame_is_blamed():
    assert raised_in_kvspec(raised(planted(KVSPEC)))
    assert not raised_in_kvspec(raised(planted(VLLM)))
    assert not raised_in_kvspec(raised(planted(REFERENCE)))  # kvspec's own implementation under test
    # vLLM calling back into kvspec's code that raises: kvspec's; kvspec calling vLLM: vLLM's.
    assert raised_in_kvspec(raised(planted(VLLM, "args[0]()"), planted(KVSPEC)))
    assert not raised_in_kvspec(raised(planted(KVSPEC, "args[0]()"), planted(VLLM)))
    # The standard library's frames belong to their caller.
    assert raised_in_kvspec(raised(planted(KVSPEC, "json.loads('{')")))
    assert not raised_in_kvspec(raised(planted(VLLM, "json.loads('{')")))
    # An implementation defined outside kvspec (this test module) is the target.
    assert not raised_in_kvspec(raised(lambda: json.loads("{")))


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
    from kvspec.cli.shapes import run_shapes, status_exit

    monkeypatch.setattr(ReferenceScheduler, "abort", lambda self, seq_id: planted(where)())
    o = run_shapes(ReferenceScheduler, profile="ci", examples=30, steps=None, seed=1, focus=None)
    assert o.status == status, o.error
    assert status_exit(o.status) == (EXIT_KVSPEC_ERROR if where is KVSPEC else EXIT_FOUND)
    assert o.traceback and "planted" in o.traceback[-1]
    # The trace ends with the operation that raised, its crash recorded.
    assert o.trace[-1].op == "abort" and o.trace[-1].crash is not None
    assert o.trace[-1].crash.call == "abort" and "planted" in o.trace[-1].outcome


def test_a_kvspec_error_building_the_scheduler_is_a_verdict_with_its_exit_code():
    """Raised before any driver exists (no step-past policy sees it): still a verdict."""
    from kvspec.cli.shapes import run_scheduler_search, shapes_exit

    run = run_scheduler_search(
        lambda _shape: planted(KVSPEC)(), profile="ci", examples=5, steps=None, seed=1, focus=None
    )
    assert [f.fingerprint.operation for f in run.search.found] == ["construct"]
    assert run.summary.status == "kvspec-error"
    assert shapes_exit(0, run) == EXIT_KVSPEC_ERROR
