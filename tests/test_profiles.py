"""The ci profile draws the same examples whatever the process imported before."""

from __future__ import annotations

import importlib

import pytest
from kvspec.testing import profiles


def test_local_constants_stay_out_of_the_draws():
    providers = pytest.importorskip(
        "hypothesis.internal.conjecture.providers",
        reason="this hypothesis has no constant pool to freeze (it draws no module literals)",
    )
    if not hasattr(providers, "Constants"):
        pytest.skip("this hypothesis draws no module literals (no providers.Constants)")
    assert profiles.LOCAL_CONSTANTS_FROZEN
    # A kvspec module full of literals, imported late (as one test in an xdist worker does):
    importlib.import_module("kvspec.adapters.v1_scheduler")
    assert len(providers._get_local_constants()) == 0
