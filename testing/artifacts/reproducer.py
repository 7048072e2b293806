"""Standalone reproducers: a pytest file that imports only vllm and pytest and fails, naming
the invariant with the expected and the observed values, where kvspec saw a vLLM block manager
(legacy BlockSpaceManagerV1/V2/SelfAttn or the V1 ``KVCacheManager``) break it.

The file is straight-line code (``straight_line``): the trace is replayed once more through
kvspec's adapter with a recorder, so every line is a call the adapter really made into vLLM,
requests with a cache salt, a LoRA adapter or multimodal placements included (built from the
release's own ``Request``, ``LoRARequest`` and multimodal classes, as the adapter builds them).
``kvspec check`` runs every file it writes against the target and keeps it only when it fails
there naming the invariant.

What a file can check (``straight_line.WRITABLE``): the count-based invariants read off the
manager's own data structures, admission soundness, immutability and the prefix cache's
consistency and isolation where vLLM's own state shows them.  The properties that need
kvspec's shadow KV memory (``kv-readback``, overwrites kvspec tracks by content) are not
reproduced standalone; the JSON report and ``kvspec replay`` cover them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from kvspec.adapters.recording import Recorder, Unrecordable
from kvspec.spec.config import Config
from kvspec.spec.invariants import Violation
from kvspec.testing.artifacts import straight_line
from kvspec.testing.blockmanager.driver import TraceStep
from kvspec.testing.implementations import VLLM

if TYPE_CHECKING:
    from kvspec.testing.known import GoPast

LEGACY_MANAGERS = {i.name: i.manager for i in VLLM if i.harness == "legacy"}


@attrs.frozen
class Reproducer:
    filename: str
    text: str
    checks: tuple[str, ...]


@attrs.frozen
class NotReproducible:
    reason: str


def generate(
    impl: str,
    config: Config,
    trace: Sequence[TraceStep],
    violations: Sequence[Violation],
    meta: Mapping[str, Any],
    go_past: GoPast | None = None,
) -> Reproducer | NotReproducible:
    """A standalone reproducer for a violation found on ``impl`` (a kvspec impl name); a crash
    (no violation) gets one too, failing where the target raises.  ``go_past``: the known
    findings its re-run goes past (testing/known.py ``GoPast``, the report's own left out), as
    the search went past them; the file neither checks nor names them (it has no checks before
    the failing operation, and at it checks the violation's own facts only)."""
    if go_past is not None:
        violations = go_past.others(violations, config, trace)
    if impl != "v1" and impl not in LEGACY_MANAGERS:
        return NotReproducible(f"{impl} is not a vLLM block manager: standalone reproducers target vLLM only")
    violated = list(dict.fromkeys(v.invariant for v in violations))
    if violated and not set(violated) & straight_line.WRITABLE:
        return NotReproducible(
            f"{', '.join(violated)} needs kvspec's shadow KV memory model (what the worker "
            "wrote into each slot), which a file importing only vllm cannot carry; use the "
            "JSON report with `kvspec replay`"
        )
    return _straight_line(impl, config, trace, violations, meta, go_past)


def _straight_line(
    impl: str,
    config: Config,
    trace: Sequence[TraceStep],
    violations: Sequence[Violation],
    meta: Mapping[str, Any],
    go_past: GoPast | None = None,
) -> Reproducer | NotReproducible:
    """The reproducer as the adapter's own calls, recorded (``straight_line``).

    The replay watches what the run watched (``meta["focus"]``; a crash found under a focus
    may lie behind violations of invariants the run did not watch), else the violated ones."""
    def build(config: Config, recorder: Recorder) -> Any:
        if impl == "v1":
            from kvspec.adapters.v1 import VLLMV1Adapter

            return VLLMV1Adapter(config, recorder=recorder)
        from kvspec.adapters.legacy import LegacyAdapter

        return LegacyAdapter(config, manager=LEGACY_MANAGERS[impl], recorder=recorder)

    try:
        focus = meta.get("focus")
        if focus is None and violations:
            focus = sorted({v.invariant for v in violations})
        engine = "v1" if impl == "v1" else "legacy"
        recording = straight_line.record(build, config, trace, focus, engine, go_past=go_past)
        title = f"kvspec reproducer on {straight_line.describe_target(meta, impl)}:"
        text, checks = straight_line.write(recording, trace, title=title, config=config)
    except (straight_line.NotStraightLine, Unrecordable) as why:
        return NotReproducible(str(why))
    except ModuleNotFoundError as err:
        return NotReproducible(f"writing it replays the trace on vLLM, which does not import here ({err})")
    name = f"test_kvspec_{re.sub(r'[^a-z0-9]+', '_', impl)}_{checks[0].replace('-', '_')}.py"
    return Reproducer(name, text, checks)
