"""Tests that drive a real vLLM release.  They run inside that release's venv:

    kvspec provision 0.6.3 0.33.0     # once; cached under ~/.cache/kvspec
    kvspec test-targets               # runs tests/targets in every provisioned venv

Anywhere else they skip, loudly, naming those commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from kvspec.spec.config import Config
from kvspec.spec.interface import Capability
from kvspec.targets.registry import local_vllm_version, parse

if TYPE_CHECKING:
    from kvspec.adapters.v1 import VLLMV1Adapter

VLLM = local_vllm_version()


def requires_vllm(lo: str, hi: str | None = None, *, pin: str | None = None):
    """Skip unless this interpreter's vLLM release is within [lo, hi]; ``pin`` is the
    release CI runs them on."""
    pin = pin or lo
    if VLLM is None:
        return pytest.mark.skip(
            reason=f"vLLM is not importable here; run `kvspec provision {pin}` then "
            f"`kvspec test-targets {pin}` (or plain `pytest`, which runs them in the venv)"
        )
    v = parse(VLLM)
    ok = parse(lo) <= v and (hi is None or v <= parse(hi))
    span = f"{lo}..{hi}" if hi else f">= {lo}"
    return pytest.mark.skipif(
        not ok,
        reason=f"needs vLLM {span}, this venv has {VLLM}; run `kvspec test-targets {pin}`",
    )


DOMAIN_COLLISIONS = ("F-KV3", "F-KV9", "F-KV10")  # one block hash for two domains (FINDINGS)


def past_known(*ids: str):
    """The release's known findings ``ids`` of the V1 manager stepped past, as ``kvspec check``
    does (V1-e, whose wrong usage figure shows at every state of 0.9-0.10, by going on); None
    when none of them concerns this release.  The machine draws salts, adapter names and image
    identifiers from one pool, so on releases with a domain collision a run meets one within a
    few examples, before what these tests look for."""
    import vllm
    from kvspec.testing.known import SHIPPED, load_known, step_past_known

    return step_past_known([k for k in load_known([SHIPPED]) if k.id in ids], "v1", vllm.__version__)


def without(*kinds: Capability) -> type[VLLMV1Adapter]:
    """The V1 adapter with some kinds of extra key left undrawn, so that a run steers around a
    finding pinned by another test."""
    from kvspec.adapters.v1 import VLLMV1Adapter

    class Without(VLLMV1Adapter):
        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.capabilities = self.capabilities - set(kinds)

    return Without
