"""Hypothesis profiles.

ci    derandomized, bounded: a regression gate that runs the same examples every time.
dev   the default locally: random, moderate.
deep  long exploration at realistic sizes (use with --hypothesis-seed to reproduce).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

# No explain phase: it replays the shrunk example hundreds of times to annotate lines,
# which made a found counterexample cost 30x its discovery (measured in BENCHMARKS.md).
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]

_COMMON = dict(
    deadline=None,
    phases=_PHASES,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)

settings.register_profile(
    "ci", derandomize=True, max_examples=150, stateful_step_count=40, database=None, **_COMMON
)
settings.register_profile("dev", max_examples=100, stateful_step_count=40, **_COMMON)
settings.register_profile(
    "deep",
    max_examples=3000,
    stateful_step_count=150,
    **_COMMON,
)

PROFILES = ("ci", "dev", "deep")


def load() -> str:
    """CI (the ``CI`` variable is set) loads ``ci``; else ``KVSPEC_PROFILE`` or ``dev``."""
    name = "ci" if os.environ.get("CI") else os.environ.get("KVSPEC_PROFILE", "dev")
    settings.load_profile(name)
    return name
