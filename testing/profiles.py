"""Hypothesis profiles.

ci    derandomized, bounded: a regression gate that runs the same examples every time.
dev   the default locally: random, moderate.
deep  long exploration at realistic sizes (use with --hypothesis-seed to reproduce).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

try:  # hypothesis >= 6.131; the module is internal, so its absence is not an error
    from hypothesis.internal.conjecture import providers as _providers
except ImportError:  # pragma: no cover
    _providers = None

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


def freeze_local_constants() -> bool:
    """Keep literals of the code under test out of hypothesis' draws; whether it could.

    Hypothesis mixes the constants of every *local* module imported so far into its draws
    (``providers._get_local_constants``).  kvspec's modules are local, and which of them a
    process has imported depends on the tests that ran before in that xdist worker, so a
    derandomized run drew different examples depending on test order: a broken variant was
    caught alone and missed after ``kvspec.adapters.v1_scheduler`` had been imported.  The
    ``ci`` profile's promise (the same examples every time) and every replay need the pool
    fixed; empty is the one value every process agrees on.  The machines draw bytes and
    small integers whose interesting values they steer themselves (testing/blockmanager/strategies.py).
    """
    if _providers is None or not hasattr(_providers, "_get_local_constants"):
        return False
    _providers._get_local_constants = _providers.Constants
    cache = getattr(_providers, "CONSTANTS_CACHE", None)
    if cache is not None and hasattr(cache, "cache"):
        cache.cache.clear()  # drop pools computed before the freeze
    return True


LOCAL_CONSTANTS_FROZEN = freeze_local_constants()


def load() -> str:
    """CI (the ``CI`` variable is set) loads ``ci``; else ``KVSPEC_PROFILE`` or ``dev``."""
    name = "ci" if os.environ.get("CI") else os.environ.get("KVSPEC_PROFILE", "dev")
    settings.load_profile(name)
    return name
