"""Reference variants that break no invariant but report differently: what a lockstep run must
call a behaviour change.

``broken.py``'s variants break an invariant (a lockstep regression); these stay within the spec
and differ only in a figure the spec leaves unbounded, so the lockstep comparison alone can see
them -- a comparison field that cannot fail is a defect, so each such field has a variant that
makes it differ.  ``CHANGED`` maps a name to the variant; the command line selects them as
``--impl broken:<name>``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from kvspec.spec.config import Config
from kvspec.spec.state import KVState

from .manager import ReferenceManager


class ReportsHitRate(ReferenceManager):
    """Reports a prefix-cache hit rate: the share of admissions that found a cached prefix.

    A stand-in for legacy vLLM's ``get_prefix_cache_hit_rate`` (0.6.3 block/common.py
    ``CacheMetricData``), which no invariant bounds: the figure is only ever compared."""

    name = "reports-hit-rate"
    queries_per_lookup = 1  # lookups an admission counts

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.queries = 0
        self.hits = 0

    def admit(self, seq_id: int, tokens: Sequence[int], num_new_tokens: int, extra: tuple = ()) -> int:
        hit = super().admit(seq_id, tokens, num_new_tokens, extra)
        self.queries += self.queries_per_lookup
        self.hits += hit > 0
        return hit

    def observe(self) -> KVState:
        state = super().observe()
        rate = self.hits / self.queries if self.queries else 0.0
        return attrs.evolve(state, gpu=attrs.evolve(state.gpu, hit_rate=rate))


class MiscountedHitRate(ReportsHitRate):
    """Counts every lookup twice, as the mutant ``num_incompleted_block_queries += 2`` of 0.6.3
    block/common.py:306 does: once a prefix hit happens, its hit rate is half the true one."""

    name = "miscounts-hit-rate"
    queries_per_lookup = 2


CHANGED: dict[str, type[ReferenceManager]] = {
    ReportsHitRate.name: ReportsHitRate,
    MiscountedHitRate.name: MiscountedHitRate,
}
