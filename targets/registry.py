"""Which vLLM releases kvspec knows how to drive, and where their environments live.

A target is a released vLLM installed into its own virtualenv under ``$KVSPEC_HOME/venvs``
(default ``~/.cache/kvspec``), outside any checkout, and reused (``provision.py`` makes it,
``lock.py`` records what it holds).  kvspec is installed into it and its machines run there.
``SHIPPED`` says which block managers each release ships, read from the releases' code.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import attrs
from kvspec.spec.errors import KVSpecError


class TargetError(KVSpecError):
    """A target that cannot be used: unknown version, unsupported generation, not provisioned."""


@attrs.frozen
class Shipped:
    """One block manager kvspec drives, and the releases whose code ships it."""

    impl: str  # the kvspec implementation name (--impl)
    engine: str  # "legacy" (vllm/core) or "v1" (vllm/v1/core)
    module: str  # the module that defines it, imported before a venv is called ready
    first: str  # the first release kvspec drives it on
    last: str | None  # the last release that ships it (None: still shipped)

    def ships_in(self, version: str) -> bool:
        key = release_key(version)
        return release_key(self.first) <= key and (self.last is None or key <= release_key(self.last))


# Read from each release's source (vllm/core/interfaces.py,
# BlockSpaceManager.get_block_space_manager_class, and the files under vllm/core and
# vllm/v1/core): 0.4.3, 0.5.0.post1 and 0.6.3 map "v1" to block_manager_v1.BlockSpaceManagerV1
# and "v2" to block_manager_v2.BlockSpaceManagerV2; 0.6.3.post1 and 0.6.4 have only
# "selfattn" -> block_manager.SelfAttnBlockSpaceManager (interfaces.py:31-33); 0.10.2 is the
# last release with vllm/core.  vllm/v1/core/kv_cache_manager.py exists from 0.6.4 on; the V1
# adapter drives its API from 0.8.3 on.
SHIPPED = (
    Shipped("legacy-v1", "legacy", "vllm.core.block_manager_v1", "0.4.3", "0.6.3"),
    Shipped("legacy-v2", "legacy", "vllm.core.block_manager_v2", "0.4.3", "0.6.3"),
    Shipped("legacy-self-attn", "legacy", "vllm.core.block_manager", "0.6.3.post1", "0.10.2"),
    Shipped("v1", "v1", "vllm.v1.core.kv_cache_manager", "0.8.3", None),
)


@attrs.frozen
class Target:
    version: str
    engine: str  # "legacy" (vllm/core block managers) or "v1" (vllm/v1/core KVCacheManager)
    managers: tuple[str, ...]  # implementation names the adapters can build
    path: Path | None = None  # a venv named by path (--venv PATH) rather than by release

    @property
    def venv(self) -> Path:
        return self.path if self.path is not None else home() / "venvs" / f"vllm-{self.version}"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def modules(self) -> tuple[str, ...]:
        """The block-manager modules of this target's managers (what must import)."""
        by_impl = {s.impl: s.module for s in SHIPPED}
        return tuple(by_impl[m] for m in self.managers if m in by_impl)

    def is_provisioned(self) -> bool:
        if not self.python.exists():
            return False
        site = list(self.venv.glob("lib/python*/site-packages"))
        return any((s / f"vllm-{self.version}.dist-info").exists() for s in site)


# Releases CI provisions: 0.6.3 is the last legacy release that ships both of the seed
# issue's managers; 0.33.0 is the current V1-engine release.
PINNED = ("0.6.3", "0.33.0")

LEGACY_RANGE = ((0, 4, 3), (0, 10, 2))
V1_FROM = (0, 8, 3)

_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.(\d+))?(?:\.post(\d+))?")


def home() -> Path:
    return Path(os.environ.get("KVSPEC_HOME", Path.home() / ".cache" / "kvspec"))


def _match(version: str) -> re.Match[str]:
    m = _VERSION.fullmatch(version.strip())
    if not m:
        raise TargetError(
            f"{version!r} is not a vLLM release version (expected e.g. 0.6.3, 0.6.3.post1, 0.10.1.1, 0.33.0)"
        )
    return m


def parse(version: str) -> tuple[int, ...]:
    """major, minor, micro (a fourth component and .postN are dropped)."""
    return tuple(int(x) for x in _match(version).groups()[:3])


def release_key(version: str) -> tuple[int, int, int, int, int]:
    """A sort key that orders every release: 0.6.3 < 0.6.3.post1 < 0.6.4; 0.10.1 < 0.10.1.1."""
    a, b, c, d, post = _match(version).groups()
    return (int(a), int(b), int(c), int(d or 0), int(post or 0))


def shipped(version: str, engine: str) -> tuple[str, ...]:
    """The implementations of ``engine`` that release ``version`` ships (by SHIPPED)."""
    return tuple(s.impl for s in SHIPPED if s.engine == engine and s.ships_in(version))


def target(version: str, engine: str | None = None) -> Target:
    """The target for a release; legacy and V1 overlap in 0.8.3 .. 0.10.2 (``engine`` picks)."""
    legacy, v1 = shipped(version, "legacy"), shipped(version, "v1")
    if engine is None:
        engine = "v1" if v1 else "legacy"
    managers = {"legacy": legacy, "v1": v1}.get(engine, ())
    if managers:
        return Target(version, engine, managers)
    raise TargetError(
        f"vLLM {version} has no supported engine generation '{engine}': kvspec drives the legacy "
        f"block managers in 0.4.3 .. 0.10.2 and the V1 KVCacheManager from 0.8.3 on"
    )


def local_vllm_version() -> str | None:
    """The vLLM importable by this interpreter, if any (without importing it)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def describe_interpreter() -> str:
    return f"{sys.executable} (vllm {local_vllm_version() or 'not installed'})"
