"""A held-out-style self check: the default ``kvspec check`` search on vLLM 0.6.3 (every
invariant, the default configuration space, the ci profile's budget, the rounds behind the known
findings under feature masks) finds each pinned FINDINGS.md entry from scratch, with the shipped
known-findings file stepping past the others, and reports it as its own distinct violation.  A
change that blinds the search, the rounds, the masks or the fingerprints fails here."""

from __future__ import annotations

import pytest
from hypothesis import settings
from kvspec.cli.run import config_strategy
from kvspec.cli.search import Search, masking, run_search
from kvspec.cli.target import factory_for
from kvspec.testing.known import SHIPPED, load_known

from .conftest import VLLM, requires_vllm

pytestmark = requires_vllm("0.6.3", "0.6.3", pin="0.6.3")

# impl -> the pinned findings its default search must report (FINDINGS.md "Pinned" column).
# F12 needs lookahead slots and swap without a window or caching (whose known findings drown
# it): a round behind them, under a feature mask, reaches it.  F9 (legacy-v1) shows as a missed
# copy-on-write in the default search (its fingerprint covers that form).
# A pinned finding the default search stops reaching gets `reach` flags in its known-findings
# entry (the report then prints them) and a test here that runs with them.
PINNED = {"legacy-v2": ("F1", "F2", "F4", "F6", "F12"), "legacy-v1": ("F3", "F9")}
_runs: dict[str, Search] = {}


def _search(impl: str) -> Search:
    if impl not in _runs:
        known = [k for k in load_known([SHIPPED]) if k.concerns(impl, VLLM)]
        masked, maskable = masking(impl, {})
        _runs[impl] = run_search(
            factory_for(impl),
            config_strategy(impl, {}),
            profile="ci",
            examples=None,  # the profile's budget
            steps=None,
            seed=None,
            focus=None,
            label=impl,
            known=known,
            masked=masked,
            maskable=maskable,
        )
    return _runs[impl]


def _assert_reported(search: Search, ident: str) -> None:
    labelled = {f.known.id: f for f in search.found if f.known is not None}
    assert ident in labelled, (
        f"{ident} not reported; found {[f.fingerprint.describe() for f in search.found]}, "
        f"fired {dict(search.fired)}, missed {search.missed}"
    )
    found = labelled[ident]
    assert found.outcome.trace, found
    assert len(search.found) == len({f.identity for f in search.found})


@pytest.mark.parametrize(("impl", "ident"), [(i, f) for i, ids in PINNED.items() for f in ids])
def test_default_search_reports_the_pinned_finding(impl, ident):
    assert settings.get_profile("ci").max_examples == 150  # the budget this file claims
    _assert_reported(_search(impl), ident)
