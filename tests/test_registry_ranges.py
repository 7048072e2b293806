"""Every release inside the ranges the registry advertises either runs or is refused, before
anything is provisioned, with the reason.  No download: the vLLM modules kvspec's V1 adapters
import are checked against a table of the releases that ship them, read from the wheels."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from kvspec.cli.common import UsageError
from kvspec.cli.main import DEFAULT_IMPL, main
from kvspec.cli.target import VllmHere, choose_impl, import_failure
from kvspec.targets import provision as prov
from kvspec.targets.registry import (
    SHIPPED,
    V1_ADAPTER_NEEDS,
    V1_FROM,
    TargetError,
    release_key,
    shipped,
    target,
)

ROOT = Path(__file__).resolve().parent.parent
V1_ADAPTERS = ("adapters/v1.py", "adapters/v1_scheduler.py", "adapters/v1_scheduler_cache.py")

# Every vLLM module the V1 adapters import: (the newest release read that lacks it, or None;
# the oldest release read that ships it).  Read from the files of the wheels
# (`pip download --no-deps vllm==X`, `unzip -l`):
#   vllm-0.8.5.post1: vllm/v1/core/{block_pool,kv_cache_manager,kv_cache_utils,
#     specialized_manager}.py, vllm/v1/core/sched/scheduler.py, vllm/v1/{kv_cache_interface,
#     request,outputs}.py, vllm/v1/structured_output/, vllm/{config,sampling_params,utils}.py,
#     vllm/lora/request.py, vllm/multimodal/inputs.py, vllm/engine/arg_utils.py; no
#     vllm/v1/core/single_type_kv_cache_manager.py, no vllm/distributed/kv_events.py, no
#     vllm/v1/core/sched/async_scheduler.py.
#   vllm-0.9.0: all of the above, plus vllm/v1/core/single_type_kv_cache_manager.py and
#     vllm/distributed/kv_events.py; still no vllm/v1/core/sched/async_scheduler.py.
WHEELS: dict[str, tuple[str | None, str]] = {
    "vllm": (None, "0.8.5.post1"),
    "vllm.config": (None, "0.8.5.post1"),
    "vllm.sampling_params": (None, "0.8.5.post1"),
    "vllm.utils": (None, "0.8.5.post1"),
    "vllm.engine.arg_utils": (None, "0.8.5.post1"),
    "vllm.lora.request": (None, "0.8.5.post1"),
    "vllm.multimodal.inputs": (None, "0.8.5.post1"),
    "vllm.v1.core.kv_cache_manager": (None, "0.8.5.post1"),
    "vllm.v1.core.kv_cache_utils": (None, "0.8.5.post1"),
    "vllm.v1.core.block_pool": (None, "0.8.5.post1"),
    "vllm.v1.core.sched.scheduler": (None, "0.8.5.post1"),
    "vllm.v1.kv_cache_interface": (None, "0.8.5.post1"),
    "vllm.v1.request": (None, "0.8.5.post1"),
    "vllm.v1.outputs": (None, "0.8.5.post1"),
    "vllm.v1.structured_output": (None, "0.8.5.post1"),
    "vllm.v1.core.single_type_kv_cache_manager": ("0.8.5.post1", "0.9.0"),
    "vllm.distributed.kv_events": ("0.8.5.post1", "0.9.0"),
}
# Imported only under ``except ImportError`` (a release without them runs without the
# feature): newer than every release read.
# Imported only under ``except ImportError``, on the releases that have them (the coordinator:
# the retention check, adapters/v1_scheduler.py ``_retention_valid``; in the 0.10.1.1 wheel and
# later, not in 0.6.3.post1's).
# The KV connector factory and base: the connectors a release registers and whether one
# supports the hybrid KV cache manager (adapters/v1_scheduler.py ``kv_connectors_offered``,
# ``_hybrid_connector_built``); a release without them offers no connector shape.
GUARDED_ELSEWHERE = {
    "vllm.utils.hashing",
    "vllm.v1.core.sched.async_scheduler",
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
}


def _catches_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception"}
    for handler in node.handlers:
        caught = handler.type
        elts = caught.elts if isinstance(caught, ast.Tuple) else [caught]
        if caught is None or any(isinstance(e, ast.Name) and e.id in names for e in elts):
            return True
    return False


def adapter_imports() -> tuple[set[str], set[str]]:
    """(modules imported unguarded, modules imported under ``except ImportError``): the
    string literals the V1 adapters pass to ``importlib.import_module`` / ``find_spec``, or
    loop over and import."""
    bare: set[str] = set()
    guarded: set[str] = set()

    def visit(node: ast.AST, inside: bool) -> None:
        if isinstance(node, ast.Try) and _catches_import_error(node):
            for child in node.body:
                visit(child, True)
            for rest in (*node.handlers, *node.orelse, *node.finalbody):
                visit(rest, inside)
            return
        if isinstance(node, ast.For) and any(
            isinstance(n, ast.Try) and _catches_import_error(n) for n in node.body
        ):
            visit(node.iter, True)  # candidates tried one by one, each under except ImportError
            for child in (*node.body, *node.orelse):
                visit(child, inside)
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if value == "vllm" or (value.startswith("vllm.") and " " not in value and "/" not in value):
                (guarded if inside else bare).add(value)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    for path in V1_ADAPTERS:
        visit(ast.parse((ROOT / path).read_text(encoding="utf-8")), False)
    return bare - guarded, guarded


def test_every_module_the_v1_adapters_import_is_in_the_wheel_table():
    bare, guarded = adapter_imports()
    # Modules tried one by one in a loop under ``except ImportError`` count as guarded; every
    # other one must have file evidence above.
    assert bare, "the scan found no vllm import in the V1 adapters"
    assert bare - set(WHEELS) == set(), "add the module's first release (from its wheel) to WHEELS"
    assert guarded <= set(WHEELS) | GUARDED_ELSEWHERE


def test_the_v1_range_starts_where_every_adapter_module_ships():
    first = next(s.first for s in SHIPPED if s.impl == "v1")
    assert release_key(first) == release_key(".".join(map(str, V1_FROM)))
    bare, _ = adapter_imports()
    for module in bare:
        lacking, ships = WHEELS[module]
        assert release_key(ships) <= release_key(first), module
        if lacking is not None:  # the range must not reach a release read without it
            assert release_key(lacking) < release_key(first), module
    # The registry's refusal reason is the newest module's first release.
    for module, release in V1_ADAPTER_NEEDS.items():
        assert WHEELS[module][1] == release and release_key(WHEELS[module][0]) < release_key(release)
    assert max(V1_ADAPTER_NEEDS.values(), key=release_key) == first


# Releases from both advertised ranges and the V1 engines before kvspec's range; 0.8.5.post1
# provisioned "ready" and then failed on every run before its V1 engine was refused.
RELEASES = ["0.4.3", "0.5.4", "0.6.3", "0.6.3.post1", "0.7.3", "0.8.3", "0.8.4", "0.8.5",
            "0.8.5.post1", "0.9.0", "0.9.1", "0.10.1.1", "0.10.2", "0.11.0", "0.12.0", "0.33.0"]


@pytest.mark.parametrize("version", RELEASES)
def test_every_release_in_the_ranges_runs_or_is_refused_with_the_reason(version):
    key = release_key(version)
    for engine in ("legacy", "v1"):
        try:
            t = target(version, engine)
        except TargetError as error:
            assert not shipped(version, engine)
            if engine == "v1" and key < release_key(".".join(map(str, V1_FROM))):
                lacking = [m for m, (_, ships) in WHEELS.items() if key < release_key(ships)]
                assert any(m in str(error) for m in lacking) or not lacking, str(error)
                assert "single_type_kv_cache_manager" in str(error)
            continue
        assert t.managers == shipped(version, engine)
        if engine == "v1":
            assert all(release_key(ships) <= key for module, (_, ships) in WHEELS.items()), version
    # The default is a target that runs: the V1 engine where kvspec drives it, else legacy.
    default = target(version)
    assert default.engine == ("v1" if shipped(version, "v1") else "legacy")


def test_a_v1_engine_kvspec_cannot_drive_is_refused_before_provisioning(monkeypatch, capsys):
    def no_provisioning(*_args, **_kw):
        raise AssertionError("provisioned a release that is refused")

    monkeypatch.setattr(prov, "provision", no_provisioning)
    code = main(["check", "--vllm", "0.8.5.post1", "--impl", "v1"])
    said = capsys.readouterr().err
    assert code == 2
    assert "no vllm.v1.core.single_type_kv_cache_manager" in said and "first shipped in 0.9.0" in said
    assert "--impl legacy-self-attn" in " ".join(said.split())


def _tree(tmp_path: Path) -> Path:
    vllm = tmp_path / "vllm"
    for file in ("core/interfaces.py", "v1/core/kv_cache_manager.py"):
        (vllm / file).parent.mkdir(parents=True, exist_ok=True)
        (vllm / file).write_text("")
    return vllm


def test_inside_the_venv_an_older_v1_engine_is_refused_with_the_reason(tmp_path):
    here = VllmHere(_tree(tmp_path), "0.8.5.post1", "release")
    with pytest.raises(UsageError, match="single_type_kv_cache_manager") as caught:
        choose_impl(here, "v1")
    assert "0.9.0" in str(caught.value)
    assert choose_impl(VllmHere(_tree(tmp_path), "0.9.0", "release"), None) == "v1"


def test_a_module_the_adapter_needs_is_named_in_the_hint(tmp_path):
    here = VllmHere(_tree(tmp_path), "0.8.5.post1", "release")
    try:
        raise ModuleNotFoundError("No module named 'vllm.v1.core.x'", name="vllm.v1.core.x")
    except ModuleNotFoundError as error:
        usage = import_failure(here, error, [])
    assert "--vllm VERSION" not in usage.hint  # the command that was run
    assert "vllm.v1.core.x" in usage.hint


def test_check_help_states_the_v1_range():
    assert f"{'.'.join(map(str, V1_FROM))} on" in " ".join(DEFAULT_IMPL.split())


def test_bisect_replays_the_releases_of_its_range_in_release_order(monkeypatch):
    """0.6.3 comes before 0.6.3.post1, so "first bad" is the first release that reproduces."""
    from kvspec.cli import pr
    from kvspec.targets.registry import Target

    versions = ["0.10.2", "0.6.3.post1", "0.33.0", "0.6.3"]
    monkeypatch.setattr(pr, "provisioned_targets", lambda: [Target(v, "legacy", ()) for v in versions])
    assert pr.releases_between("0.6.3..0.10.2") == ["0.6.3", "0.6.3.post1", "0.10.2"]
    assert pr.releases_between("0.6.3..0.6.3") == ["0.6.3"]
    assert pr.releases_between("..0.6.3.post1") == ["0.6.3", "0.6.3.post1"]


def test_a_pr_whose_head_check_did_not_run_has_no_scheduler_verdict(monkeypatch, tmp_path):
    """HEAD's own check that did not run fails the PR verdict; it is never read as "no
    scheduler verdict on HEAD"."""
    import argparse
    import subprocess

    import pytest
    from kvspec.cli import pr

    args = argparse.Namespace(vllm_source=str(tmp_path), vllm=None, source_version="0.33.0", venv=None)
    for code in (2, 3, 1):  # usage error, kvspec's own error, "found" without a summary
        monkeypatch.setattr(pr, "_kvspec", lambda a, capture=False, c=code: subprocess.CompletedProcess(a, c, "", ""))
        with pytest.raises(UsageError, match="did not run"):
            pr.scheduler_verdicts(args, [], ["--vllm", "0.33.0"], tmp_path)
    # A check that finds nothing writes no summary: no scheduler verdict, and no error.
    monkeypatch.setattr(pr, "_kvspec", lambda a, capture=False: subprocess.CompletedProcess(a, 0, "", ""))
    assert pr.scheduler_verdicts(args, [], ["--vllm", "0.33.0"], tmp_path) == []


def test_heads_own_check_runs_with_the_pr_runs_seed(monkeypatch, tmp_path):
    """HEAD's own check in a PR verdict repeats: it gets the PR's --seed (0 when none is given),
    never a seed of its own profile's choosing."""
    import argparse
    import subprocess

    from kvspec.cli import pr

    calls: list[list[str]] = []

    def fake(a, capture=False):
        calls.append(list(a))
        return subprocess.CompletedProcess(a, 0, "", "")

    monkeypatch.setattr(pr, "_kvspec", fake)
    for given, want in ((None, "0"), (7, "7")):
        args = argparse.Namespace(vllm_source=str(tmp_path), vllm=None, source_version="0.33.0", venv=None, seed=given)
        argv = ["check", "--vllm-source", str(tmp_path), "--baseline", "0.33.0"] + (["--seed", "7"] if given else [])
        pr.scheduler_verdicts(args, argv, ["--vllm", "0.33.0"], tmp_path)
        seeds = [calls[-1][i + 1] for i, a in enumerate(calls[-1]) if a == "--seed"]
        assert seeds == [want], calls[-1]
