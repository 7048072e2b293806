"""Which vLLM releases kvspec knows how to drive, and where their environments live.

A target is a released vLLM installed with plain ``pip install vllm==X`` into its own
virtualenv under ``$KVSPEC_HOME/venvs`` (default ``~/.cache/kvspec``), outside any checkout,
and reused.  kvspec is installed into it and its machines run there.
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
class Target:
    version: str
    engine: str  # "legacy" (vllm/core block managers) or "v1" (vllm/v1/core KVCacheManager)
    managers: tuple[str, ...]  # implementation names the adapters can build

    @property
    def venv(self) -> Path:
        return home() / "venvs" / f"vllm-{self.version}"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

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


def home() -> Path:
    return Path(os.environ.get("KVSPEC_HOME", Path.home() / ".cache" / "kvspec"))


def parse(version: str) -> tuple[int, ...]:
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.\d+)?(?:\.post\d+)?", version.strip())
    if not m:
        raise TargetError(
            f"{version!r} is not a vLLM release version (expected e.g. 0.6.3, 0.6.3.post1, 0.33.0)"
        )
    return tuple(int(x) for x in m.groups())


def target(version: str, engine: str | None = None) -> Target:
    """The target for a release; legacy and V1 overlap in 0.8.3 .. 0.10.2 (``engine`` picks)."""
    v = parse(version)
    legacy_ok = LEGACY_RANGE[0] <= v <= LEGACY_RANGE[1]
    v1_ok = v >= V1_FROM
    if engine is None:
        engine = "v1" if v1_ok else "legacy"
    if engine == "legacy" and legacy_ok:
        # BlockSpaceManagerV1 and V2 ship until 0.6.3; SelfAttnBlockSpaceManager from 0.6.3.post1.
        managers = (
            ("legacy-v1", "legacy-v2")
            if v <= (0, 6, 3) and "post" not in version
            else ("legacy-self-attn",)
        )
        return Target(version, "legacy", managers)
    if engine == "v1" and v1_ok:
        return Target(version, "v1", ("v1",))
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
