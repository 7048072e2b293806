"""kvspec.proofs: z3 proofs of the spec's obligations, tied to the real code.

Every obligation is registered under ``<invariant-id>/<name>`` (``core.OBLIGATIONS``) with the
result it is expected to have: *proved*, or a *counterexample* where the obligation is about a
known-buggy vLLM formula.  ``run_all`` runs them; ``kvspec prove`` (cli/main.py) prints the
table and exits non-zero on any unexpected result.

Modules: ``window`` (blocks a window touches; vLLM's window formulas), ``admission`` (admission
soundness of the reference and of vLLM 0.6.3's managers), ``bmc`` (bounded model checking and
k-induction of the reference's transition system), ``encode`` and ``vllm_formulas`` (the z3
encodings, each conformance-tested against the Python it restates), ``coverage`` (z3-made
configurations for every branch of the window and admission arithmetic), ``tenancy`` (which
blocks' keys a multimodal feature reaches).  An obligation serves
the invariant before the slash in its ID and any it names in ``also_serves``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from . import admission, bmc, completeness, coverage, tenancy, window  # noqa: F401  (registration)
from .core import OBLIGATIONS, Obligation, Result, select
from .coverage import coverage_cases


def run_all(
    selection: Iterable[str] | None = None,
    deep: bool = False,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Run the obligations whose ID starts with one of ``selection`` (default: the default set;
    ``deep`` adds deeper bounds and the deep-only obligations)."""
    results = []
    for ob in select(selection, deep):
        result = ob.run(deep)
        if on_result is not None:
            on_result(result)
        results.append(result)
    return results


__all__ = ["OBLIGATIONS", "Obligation", "Result", "coverage_cases", "run_all"]
