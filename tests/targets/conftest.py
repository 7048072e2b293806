"""Tests that drive a real vLLM release.  They run inside that release's venv:

    kvspec provision 0.6.3 0.33.0     # once; cached under ~/.cache/kvspec
    kvspec test-targets               # runs tests/targets in every provisioned venv

Anywhere else they skip, loudly, naming those commands.
"""

from __future__ import annotations

import pytest
from kvspec.targets.registry import local_vllm_version, parse

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
