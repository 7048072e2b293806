"""A held-out-style self check: the default ``kvspec check`` search on vLLM 0.6.3 (every
invariant, the default configuration space, the ci profile's budget, the rounds behind the known
findings under feature masks) finds each pinned FINDINGS.md entry from scratch, with the shipped
known-findings file stepping past the others, and reports it as its own distinct violation.  A
change that blinds the search, the rounds, the masks or the fingerprints fails here."""

from __future__ import annotations

import pytest
from hypothesis import settings
from kvspec.cli.run import config_strategy, parse_overrides
from kvspec.cli.search import Search, masking, run_search
from kvspec.cli.target import factory_for
from kvspec.testing.known import SHIPPED, load_known

from .conftest import VLLM, requires_vllm

pytestmark = requires_vllm("0.6.3", "0.6.3", pin="0.6.3")

# impl -> the pinned findings its default search must report (FINDINGS.md "Pinned" column).
# F12 needs lookahead slots and swap without a window or caching (whose known findings drown
# it): a round behind them, under a feature mask, reaches it.
# A pinned finding the default search does not reach within the ci budget gets `reach` flags in
# its known-findings entry (the report prints them when it did not fire) and runs with them
# here: F9 (legacy-v1), which the default search meets only on some draws, behind F3.
PINNED = {"legacy-v2": ("F1", "F2", "F4", "F6", "F12"), "legacy-v1": ("F3",)}
NEEDS = {
    ("legacy-v1", "F9"): (("window=off", "caching=off"), "refcount-exact", 600),
}
_runs: dict[tuple, Search] = {}


def _search(
    impl: str,
    pins: tuple[str, ...] = (),
    focus: str | None = None,
    examples: int | None = None,
    report_known: bool = True,
) -> Search:
    key = (impl, pins, focus, examples, report_known)
    if key not in _runs:
        known = [k for k in load_known([SHIPPED]) if k.concerns(impl, VLLM)]
        overrides = parse_overrides(pins)
        masked, maskable = masking(impl, overrides)
        _runs[key] = run_search(
            factory_for(impl),
            config_strategy(impl, overrides),
            profile="ci",
            examples=examples,  # None: the profile's budget
            steps=None,
            seed=None,
            focus=(focus,) if focus else None,
            label=impl,
            known=known,
            masked=masked,
            maskable=maskable,
            report_known=report_known,
        )
    return _runs[key]


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


@pytest.mark.parametrize(("impl", "ident"), sorted(NEEDS))
def test_pinned_finding_is_reached_with_the_flags_its_entry_names(impl, ident):
    pins, focus, examples = NEEDS[impl, ident]
    (entry,) = [k for k in load_known([SHIPPED]) if k.id == ident]
    flags = " ".join(f"--config {p}" for p in pins) + f" --invariant {focus}"
    flags += f" --examples {examples}" if examples else ""
    assert entry.reach == f"--impl {impl} {flags}", entry.reach  # what the report tells a user
    _assert_reported(_search(impl, pins, focus, examples), ident)


def test_default_search_keeps_the_window_on_until_f1_fires():
    """F1 needs the window, and so do the known findings that fire beside it (F6, F7, F8): the
    hitting-set masks behind them are all window-free rounds, where F1 cannot happen.  At this
    budget (20 examples a round) the exploration meets F1 in none of its examples, and F1 fires
    in a round that keeps the window on while it has not fired (``masks_behind``).  The counting
    part of the search only (``report_known=False``); the test above pins that the full default
    search reports F1."""
    search = _search("legacy-v2", examples=20, report_known=False)
    summary = f"masks {search.masks}, fired {dict(search.fired)}, first under {search.fired_under}"
    assert search.fired["F1"], summary
    assert "window" not in search.fired_under["F1"] and search.fired_under["F1"], summary
    kept = [m for m in search.masks[1:] if "window" not in m]
    assert kept and all("window" in m for m in search.masks[1 : search.masks.index(kept[0])]), summary
