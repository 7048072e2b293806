"""Each freedom a target declares in its ``AdmissionPolicy`` is needed: with the field reset to
the spec's default (no reserve), the named release gives a completeness false alarm on a short
trace; with the policy the adapter declares, the same trace is clean.  A freedom no test needs
would be a blanket "may refuse"."""

from __future__ import annotations

import attrs
import pytest
from kvspec.spec.admission import AdmissionPolicy
from kvspec.spec.config import Config
from kvspec.testing.blockmanager.driver import replay

from .conftest import VLLM, requires_vllm


def _admit(seq, tokens, k=None):
    return {"op": "admit", "args": {"seq": seq, "tokens": tokens, "num_new_tokens": k or len(tokens)}}


def _step(seq, k=1):
    return {"op": "step", "args": {"seq": seq, "num_new_tokens": k}}


def _legacy(manager, config, **kw):
    from kvspec.adapters.legacy import LegacyAdapter

    return LegacyAdapter(config, manager=manager, **kw)


def _v1(config, **kw):
    from kvspec.adapters.v1 import make_v1

    return make_v1(config, **kw)


def _found(impl, trace, invariant, reset: str | None):
    if reset is not None:
        default = attrs.fields_dict(AdmissionPolicy)[reset].default
        impl.admission_policy = attrs.evolve(impl.admission_policy, **{reset: default})
    found, _ = replay(impl, trace, focus={invariant})
    return [str(v) for v in found]


LEGACY_063 = [
    # watermark_blocks: watermark 0.5 of 4 blocks keeps 2 back; a 2-block prompt with 3 free
    # blocks is answered LATER although it fits.
    (
        "v2",
        Config(block_size=2, num_blocks=4),
        {"watermark": 0.5},
        [_admit(0, [1]), _admit(1, [2, 2, 2])],
        "admission-completeness",
        "watermark_blocks",
    ),
    # whole_prompt: B's first two blocks are A's (in use, cached, computed): its exact need is
    # one block, which is free; can_allocate counts all three of B's blocks.
    (
        "v2",
        Config(block_size=2, num_blocks=4, prefix_caching=True),
        {},
        [_admit(0, [1, 2, 3, 4, 5]), _admit(1, [1, 2, 3, 4, 6])],
        "admission-completeness",
        "whole_prompt",
    ),
    # step_counts_touched: a decode token that lands in the partly filled last block needs no
    # new block; can_append_slots counts the touched block and the pool is empty.
    (
        "v2",
        Config(block_size=2, num_blocks=1),
        {},
        [_admit(0, [1]), _step(0)],
        "reserve-completeness",
        "step_counts_touched",
    ),
    # step_block_per_sequence: BlockSpaceManagerV1 wants one free block per running sequence.
    (
        "v1",
        Config(block_size=2, num_blocks=1),
        {},
        [_admit(0, [1]), _step(0)],
        "reserve-completeness",
        "step_block_per_sequence",
    ),
]


@requires_vllm("0.6.3", "0.6.3", pin="0.6.3")
@pytest.mark.parametrize(
    ("manager", "config", "kw", "trace", "invariant", "field"),
    LEGACY_063,
    ids=[f"{c[0]}-{c[5]}" for c in LEGACY_063],
)
def test_legacy_freedom_is_needed(manager, config, kw, trace, invariant, field):
    assert _found(_legacy(manager, config, **kw), trace, invariant, None) == []
    alarms = _found(_legacy(manager, config, **kw), trace, invariant, field)
    assert alarms and all(invariant in a for a in alarms), alarms


@requires_vllm("0.33.0", pin="0.33.0")
def test_v1_full_sequence_must_fit_is_needed():
    """0.33.0 admits only if the whole prompt fits (scheduler_reserve_full_isl, default True):
    a 3-token prompt scheduled one token at a time needs one block, but 3 do not fit 2."""
    config = Config(block_size=1, num_blocks=2)
    trace = [_admit(0, [1, 2, 3], 1)]
    impl = _v1(config)
    assert impl.admission_policy.full_sequence_must_fit, VLLM
    assert _found(impl, trace, "admission-completeness", None) == []
    alarms = _found(_v1(config), trace, "admission-completeness", "full_sequence_must_fit")
    assert alarms and "refused" in alarms[0], alarms


# ---------------------------------------------------------------- divergences are needed


def _lockstep_found(impl, trace, drop: str | None, monkeypatch):
    from kvspec.reference import ReferenceManager
    from kvspec.testing.blockmanager import differential
    monkeypatch.setattr(differential, "note", lambda _msg: None)  # no hypothesis test here
    from kvspec.testing.blockmanager.differential import Lockstep, Mode
    from kvspec.testing.blockmanager.driver import Driver
    from kvspec.testing.divergences import KNOWN

    known = tuple(d for d in KNOWN if d.id != drop)
    ls = Lockstep(Driver(impl), Driver(ReferenceManager(impl.config)), Mode.RENAMING, known)
    found = []
    for op in trace:
        a = op["args"]
        if op["op"] == "admit":
            ls.admit(a["seq"], a["tokens"], a["num_new_tokens"])
        else:
            ls.step(a["seq"], a["num_new_tokens"])
        found += [v for v in ls.check() if v.invariant.startswith("differential/")]
    return [str(v) for v in found], [d.id for _, d in ls.allowed]


LEGACY_DIVERGENCES = [
    # The watermark refusal of the freedom test above: the reference admits.
    (
        "conservative-admission",
        Config(block_size=2, num_blocks=4),
        {"watermark": 0.5},
        [_admit(0, [1]), _admit(1, [2, 2, 2])],
    ),
    # allocate() takes all three prompt blocks for a one-token first chunk.
    (
        "legacy-whole-prompt-allocation",
        Config(block_size=2, num_blocks=8),
        {},
        [_admit(0, [1, 2, 3, 4, 5], 1)],
    ),
]


@requires_vllm("0.6.3", "0.6.3", pin="0.6.3")
@pytest.mark.parametrize(
    ("divergence", "config", "kw", "trace"), LEGACY_DIVERGENCES, ids=[c[0] for c in LEGACY_DIVERGENCES]
)
def test_legacy_divergence_is_needed(divergence, config, kw, trace, monkeypatch):
    clean, used = _lockstep_found(_legacy("v2", config, **kw), trace, None, monkeypatch)
    assert clean == [] and divergence in used, (clean, used)
    alarms, _ = _lockstep_found(_legacy("v2", config, **kw), trace, divergence, monkeypatch)
    assert alarms, f"without {divergence} the lockstep comparison should object"


@requires_vllm("0.6.3", "0.6.3", pin="0.6.3")
def test_conservative_admission_stops_at_the_declared_reserve(monkeypatch):
    """The same refusal with the watermark left out of the declared policy is a completeness
    violation of the target, and no longer an allowed divergence."""
    impl = _legacy("v2", Config(block_size=2, num_blocks=4), watermark=0.5)
    impl.admission_policy = attrs.evolve(impl.admission_policy, watermark_blocks=0)
    alarms, used = _lockstep_found(impl, [_admit(0, [1]), _admit(1, [2, 2, 2])], None, monkeypatch)
    assert alarms and "conservative-admission" not in used, (alarms, used)
