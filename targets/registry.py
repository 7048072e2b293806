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


# The vLLM module kvspec's V1 adapter imports without a fallback that came last, and the first
# release that ships it, read from the releases' wheels: vllm-0.8.5.post1 (the last 0.8 release)
# has vllm/v1/core/{block_pool,kv_cache_manager,kv_cache_utils,specialized_manager}.py and
# vllm/v1/core/sched/scheduler.py but no single_type_kv_cache_manager.py (its per-type managers
# are specialized_manager.py); vllm-0.9.0 ships vllm/v1/core/single_type_kv_cache_manager.py
# (and every other module the V1 adapters import: tests/test_registry_ranges.py).
V1_ADAPTER_NEEDS = {"vllm.v1.core.single_type_kv_cache_manager": "0.9.0"}

# Read from each release's source (vllm/core/interfaces.py,
# BlockSpaceManager.get_block_space_manager_class, and the files under vllm/core and
# vllm/v1/core): 0.4.3, 0.5.0.post1 and 0.6.3 map "v1" to block_manager_v1.BlockSpaceManagerV1
# and "v2" to block_manager_v2.BlockSpaceManagerV2; 0.6.3.post1 and 0.6.4 have only
# "selfattn" -> block_manager.SelfAttnBlockSpaceManager (interfaces.py:31-33); 0.10.2 is the
# last release with vllm/core.  The V1 adapter runs from the release that ships every module of
# V1_ADAPTER_NEEDS.
SHIPPED = (
    Shipped("legacy-v1", "legacy", "vllm.core.block_manager_v1", "0.4.3", "0.6.3"),
    Shipped("legacy-v2", "legacy", "vllm.core.block_manager_v2", "0.4.3", "0.6.3"),
    Shipped("legacy-self-attn", "legacy", "vllm.core.block_manager", "0.6.3.post1", "0.10.2"),
    Shipped("v1", "v1", "vllm.v1.core.kv_cache_manager", "0.9.0", None),
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


# Releases CI provisions: 0.6.3 is the last legacy release that ships both
# BlockSpaceManagerV1 and V2 (vllm#7470's managers); 0.33.0 is the current V1-engine release.
PINNED = ("0.6.3", "0.33.0")

LEGACY_RANGE = ((0, 4, 3), (0, 10, 2))
V1_FROM = (0, 9, 0)

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


def v1_lacks(version: str) -> tuple[str, ...]:
    """The modules of V1_ADAPTER_NEEDS that release ``version`` does not ship yet."""
    key = release_key(version)
    return tuple(m for m, first in V1_ADAPTER_NEEDS.items() if key < release_key(first))


def unsupported_v1(version: str) -> str | None:
    """Why kvspec cannot drive a release's V1 engine (None: it can)."""
    lacking = v1_lacks(version)
    if not lacking:
        return None
    first = max((V1_ADAPTER_NEEDS[m] for m in lacking), key=release_key)
    legacy = shipped(version, "legacy")
    instead = f"; its legacy block managers run: --impl {', '.join(legacy)}" if legacy else ""
    return (
        f"vLLM {version}'s V1 engine has no {', '.join(lacking)}, which kvspec's V1 adapter "
        f"imports (first shipped in {first}): kvspec drives the V1 KVCacheManager from "
        f"{'.'.join(map(str, V1_FROM))} on{instead}"
    )


def target(version: str, engine: str | None = None) -> Target:
    """The target for a release; legacy and V1 overlap in 0.9.0 .. 0.10.2 (``engine`` picks).
    A release whose V1 engine kvspec cannot drive is refused for ``engine="v1"`` with the
    reason, before anything is provisioned; by default it is its legacy block managers."""
    legacy, v1 = shipped(version, "legacy"), shipped(version, "v1")
    if engine is None:
        engine = "v1" if v1 else "legacy"
    managers = {"legacy": legacy, "v1": v1}.get(engine, ())
    if managers:
        return Target(version, engine, managers)
    why = unsupported_v1(version) if engine == "v1" else None
    lo, hi = (".".join(map(str, v)) for v in LEGACY_RANGE)
    raise TargetError(
        why
        or f"vLLM {version} has no supported engine generation '{engine}': kvspec drives the legacy "
        f"block managers in {lo} .. {hi} and the V1 KVCacheManager from {'.'.join(map(str, V1_FROM))} on"
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
