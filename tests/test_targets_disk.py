"""What venvs and the uv cache cost on disk, and pruning: on a fake $KVSPEC_HOME whose venv
hard-links files from its cache as uv does (no download, no uv)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from kvspec.cli.main import main
from kvspec.targets import disk
from kvspec.targets.registry import TargetError

OLD = time.time() - 2 * disk.GRACE_S


def _entry(cache: Path, entry_id: str, name: str, size: int, *, old: bool = True) -> Path:
    """An unpacked wheel in the cache, and the pointer that names it."""
    folder = cache / disk.ARCHIVE / entry_id / name
    folder.mkdir(parents=True)
    f = folder / "__init__.py"
    f.write_bytes(b"x" * size)
    pointer = cache / disk.POINTERS / "pypi" / name / "1.0-py3-none-any.msgpack"
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.write_bytes(b"\x92" + name.encode() + b"\xa8" + entry_id.encode())
    if old:
        for p in (f, folder, folder.parent):
            os.utime(p, (OLD, OLD))
    return f


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A release venv linking entry ``used`` of its cache; ``stale`` is unused and old,
    ``fresh`` unused and just unpacked."""
    monkeypatch.setenv("KVSPEC_HOME", str(tmp_path))
    cache = tmp_path / "uv-cache"
    used = _entry(cache, "AAAAusedAAAA", "used", 1000)
    _entry(cache, "BBBBstaleBBBB", "stale", 3000)
    _entry(cache, "CCCCfreshCCCC", "fresh", 500, old=False)
    site = tmp_path / "venvs" / "vllm-0.6.3" / "lib" / "python3.11" / "site-packages"
    (site / "used").mkdir(parents=True)
    os.link(used, site / "used" / "__init__.py")
    (site / "vllm-0.6.3.dist-info").mkdir()
    (site / "vllm-0.6.3.dist-info" / "RECORD").write_bytes(b"r" * 10)  # the venv's own file
    (tmp_path / "venvs" / "vllm-0.6.3" / "bin").mkdir()
    (tmp_path / "venvs" / "vllm-0.6.3" / "bin" / "python").write_text("")
    return tmp_path


def _ids(entries) -> set[str]:
    return {e.path.name for e in entries}


def test_a_venv_is_its_own_files_and_those_it_shares_with_the_cache(home):
    d = disk.venv_disk(home / "venvs" / "vllm-0.6.3")
    assert (d.own, d.shared, d.alone) == (10 + 0, 1000, 1000)  # bin/python is empty
    c = disk.cache_disk()
    pointers = sum(p.stat().st_size for p in (home / "uv-cache" / disk.POINTERS).rglob("*.msgpack"))
    assert c.total == 1000 + 3000 + 500 + pointers
    used = {e.path.name: e.used for e in c.entries}
    assert used == {"AAAAusedAAAA": True, "BBBBstaleBBBB": False, "CCCCfreshCCCC": False}
    assert c.unused == 3500


def test_a_dry_run_removes_nothing(home):
    pruned = disk.prune(apply=False)
    assert _ids(pruned.entries) == {"BBBBstaleBBBB"} and _ids(pruned.kept_recent) == {"CCCCfreshCCCC"}
    assert (home / "uv-cache" / disk.ARCHIVE / "BBBBstaleBBBB").is_dir()
    named = disk.prune((home / "venvs" / "vllm-0.6.3",), apply=False)
    assert _ids(named.entries) == {"AAAAusedAAAA", "BBBBstaleBBBB"}  # what the venv's removal would free
    assert (home / "venvs" / "vllm-0.6.3").is_dir()


def test_prune_removes_unused_old_entries_and_their_pointers_only(home):
    pruned = disk.prune(apply=True)
    archive = home / "uv-cache" / disk.ARCHIVE
    assert sorted(p.name for p in archive.iterdir()) == ["AAAAusedAAAA", "CCCCfreshCCCC"]
    assert [p.parent.name for p in pruned.pointers] == ["stale"]
    assert not (home / "uv-cache" / disk.POINTERS / "pypi" / "stale" / "1.0-py3-none-any.msgpack").exists()
    assert (home / "uv-cache" / disk.POINTERS / "pypi" / "used" / "1.0-py3-none-any.msgpack").exists()
    assert (home / "venvs" / "vllm-0.6.3" / "lib" / "python3.11" / "site-packages" / "used" / "__init__.py").exists()


def test_pruning_a_release_removes_its_venv_then_what_only_it_used(home):
    disk.prune((home / "venvs" / "vllm-0.6.3",), apply=True)
    assert not (home / "venvs" / "vllm-0.6.3").exists()
    assert [p.name for p in (home / "uv-cache" / disk.ARCHIVE).iterdir()] == ["CCCCfreshCCCC"]


def test_prune_refuses_while_a_venv_is_being_made(home):
    with disk.provision_lock(exclusive=False), pytest.raises(TargetError, match="provisioning run"):
        disk.prune(apply=True)
    assert (home / "uv-cache" / disk.ARCHIVE / "BBBBstaleBBBB").is_dir()


def test_targets_prune_cli_is_a_dry_run_without_yes(home, capsys):
    assert main(["targets", "--prune"]) == 0
    said = capsys.readouterr().out
    assert "would remove 1 uv cache entries" in said and "add --yes" in said
    assert (home / "uv-cache" / disk.ARCHIVE / "BBBBstaleBBBB").is_dir()
    assert main(["targets", "--prune", "0.9.9"]) == 2  # not a provisioned release


def test_targets_prints_the_disk_of_each_release_and_the_cache(home, capsys):
    assert main(["targets"]) == 0
    said = capsys.readouterr().out
    assert "disk, vLLM 0.6.3:" in said and "disk, uv cache" in said
