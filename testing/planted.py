"""Bugs planted in a copy of vLLM 0.33.0's V1 scheduler: the ``--vllm-source`` checkouts that
tests/targets/test_scheduler_planted.py checks a verdict against and ``python -m bench
checktime`` times one on.  Each is a source edit (the release's text and its replacement),
with the invariants whose verdict reports it."""

from __future__ import annotations

import attrs

SCHEDULER = "v1/core/sched/scheduler.py"


@attrs.frozen
class PlantedBug:
    file: str  # under the package root ``vllm/``
    original: str  # the release's text, found exactly once
    planted: str
    invariants: frozenset[str]  # the invariant IDs a verdict on it may name

    def plant(self, text: str) -> str:
        """``text`` (the file's) with the bug planted; a ``ValueError`` where the release's text
        is not there exactly once (another release)."""
        if text.count(self.original) != 1:
            raise ValueError(f"the planted bug's context is not in {self.file} exactly once: another release?")
        return text.replace(self.original, self.planted)


_SHORT = """                        request,
                        num_new_tokens,
                        num_lookahead_tokens=self.num_lookahead_tokens,
"""
SHORT = PlantedBug(
    SCHEDULER,
    _SHORT,
    _SHORT.replace("num_new_tokens,", "max(num_new_tokens - 1, 1),  # planted: one slot short"),
    frozenset({"kv-readback", "admission-soundness"}),
)
"""A running request is allocated one slot fewer than the tokens it is scheduled."""

_LEAK = """            self.kv_cache_manager.free(request)
            return
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)"""
LEAK = PlantedBug(
    SCHEDULER,
    _LEAK,
    _LEAK.replace(
        "self.kv_cache_manager.free(request)",
        "if request.status != RequestStatus.FINISHED_ABORTED:  # planted: an abort leaks\n"
        "                self.kv_cache_manager.free(request)",
    ),
    frozenset({"refcount-exact", "no-leak"}),
)
"""An aborted request's blocks are never freed."""
