"""Swarm configurations of the production shapes (swarm testing, Groce et al., ISSTA 2012).

A swarm configuration leaves some values of each shape feature out: which KV-cache groups a
shape pairs full attention with, the drafter, the pool's size class, the token budget's class,
the scheduler's mode, prefix caching, a KV connector, images.  A shape drawn under it takes
only the values it keeps (testing/scheduler/machine.py ``shapes(swarm=...)``), in the
proportions the unrestricted draw gives them.  Each value is left out with probability 1/2,
independently; a feature whose every value is left out keeps them all (the feature is then
drawn as without a swarm).

``kvspec fuzz --machine scheduler`` draws one per example, before its shape
(testing/scheduler/machine.py ``swarm_shapes``; cli/fuzz_scheduler.py), so that a stored
example replays in the same shape and the shrinker can take the swarm away.  Over a campaign
the shapes come out as under a configuration per search: a rare value (the startup minimum,
a KV connector, images, a Mamba group) is kept alone in many examples, combinations of rare
values that a draw over every value meets seldom come up more often, and a verdict's
neighbourhood (what hypothesis mutates and shrinks from it) does not take a share of every
shape.  ``kvspec check`` draws without one.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from hypothesis import strategies as st

# The features a swarm configuration restricts, and their values: the first of each is what
# an unrestricted shape takes most (or the plainest), the order of ``describe``.
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "groups": ("full", "window", "chunked-local", "mamba"),
    "drafts": ("none", "ngram", "eagle"),
    "pool": ("spare", "startup-min"),
    "budget": ("whole", "chunked"),
    "scheduling": ("sync", "async"),
    "prefix-caching": ("off", "on"),
    "connector": ("none", "connector"),
    "images": ("none", "images"),
}
# How often an unrestricted shape takes each value (``shapes``' draws, in parts of a whole):
# a restricted feature draws among the values kept in these proportions.
WEIGHTS: dict[str, dict[str, int]] = {
    # hybrid 3 in 4; of those a third chunked-local, then a third of them all Mamba instead
    "groups": {"full": 3, "window": 4, "chunked-local": 2, "mamba": 3},
    # 0 draft tokens 2 in 5; the rest half EAGLE
    "drafts": {"none": 4, "ngram": 3, "eagle": 3},
}


@attrs.frozen
class Swarm:
    """One swarm configuration: the values each feature keeps (every feature of
    ``DIMENSIONS`` is named)."""

    kept: Mapping[str, tuple[str, ...]]

    def values(self, feature: str) -> tuple[str, ...]:
        return self.kept[feature]

    def allows(self, feature: str, value: str) -> bool:
        return value in self.kept[feature]

    def only(self, feature: str) -> str | None:
        """The value a feature is pinned to, or None when it keeps several."""
        kept = self.kept[feature]
        return kept[0] if len(kept) == 1 else None

    def weighted(self, feature: str) -> list[str]:
        """The kept values of a weighted feature, each repeated by its weight (a
        ``sampled_from`` over them draws as the unrestricted shape does, among them)."""
        return [v for v in DIMENSIONS[feature] if v in self.kept[feature] for _ in range(WEIGHTS[feature][v])]

    def describe(self) -> str:
        """The features it restricts, with the values they keep ("every shape" when none)."""
        parts = [f"{f}={'|'.join(v)}" for f, v in self.kept.items() if len(v) < len(DIMENSIONS[f])]
        return " ".join(parts) or "every shape"

    def to_json(self) -> dict[str, list[str]]:
        return {f: list(v) for f, v in self.kept.items()}


@st.composite
def swarms(draw) -> Swarm:
    """A swarm configuration: each value of each feature left out with probability 1/2 (a
    boolean each, True leaves it out, so that shrinking keeps every value); a feature left
    with none keeps them all."""
    kept = {}
    for feature, values in DIMENSIONS.items():
        chosen = tuple(v for v in values if not draw(st.booleans()))
        kept[feature] = chosen or values
    return Swarm(kept)
