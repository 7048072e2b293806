"""The manager PR mode and ``kvspec diff`` compare when ``--impl`` is not given: the one the
release's engine runs by default, read from its ``EngineArgs.use_v2_block_manager`` default
(as adapters/legacy.py ``default_manager`` reads it inside a target), never a list's first."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvspec.cli.common import UsageError
from kvspec.cli.pr import default_impl, engine_uses_v2, installed_package
from kvspec.targets.registry import Target, target

LEGACY = Target("0.6.3", "legacy", ("legacy-v1", "legacy-v2"))
NO_V1 = {"legacy": True, "v1": False}


def _package(root: Path, field: str | None) -> Path:
    engine = root / "vllm" / "engine"
    engine.mkdir(parents=True)
    body = f"    {field}\n" if field else "    model: str = 'x'\n"
    (engine / "arg_utils.py").write_text(f"class EngineArgs:\n{body}    seed: int = 0\n")
    return root / "vllm"


def test_the_engine_default_picks_the_legacy_manager(tmp_path):
    v2 = _package(tmp_path / "a", "use_v2_block_manager: bool = True")
    v1 = _package(tmp_path / "b", "use_v2_block_manager: bool = False")
    assert engine_uses_v2(v2) is True and engine_uses_v2(v1) is False
    assert default_impl(LEGACY, NO_V1, v2) == "legacy-v2"
    assert default_impl(LEGACY, NO_V1, v1) == "legacy-v1"
    assert default_impl(LEGACY, {"legacy": True, "v1": True}, v1) == "v1"
    only = Target("0.6.3.post1", "legacy", ("legacy-self-attn",))
    assert default_impl(only, NO_V1, None) == "legacy-self-attn"


def test_an_unreadable_default_is_refused_by_name(tmp_path):
    with pytest.raises(UsageError, match="default cannot be read") as refused:
        default_impl(LEGACY, NO_V1, _package(tmp_path, None))
    assert "--impl legacy-v2" in refused.value.hint


@pytest.mark.target
@pytest.mark.parametrize("version,expected", [("0.6.2", "legacy-v1"), ("0.6.3", "legacy-v2")])
def test_the_releases_defaults(version, expected):
    release = target(version)
    if not release.is_provisioned():
        pytest.skip(f"vLLM {version} is not provisioned: run `kvspec provision {version}`")
    package = installed_package(release.venv)
    assert package is not None
    assert default_impl(release, NO_V1, package) == expected
