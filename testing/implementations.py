"""Every implementation kvspec drives, by the name ``--impl`` takes: the one table the command
line, the benchmarks, the reproducer and the target tests read.

* ``reference``: kvspec's reference block manager;
* ``broken:<variant>``: a deliberately broken reference (``kvspec.reference.broken.BROKEN``; the
  run-breaking ``misbehaving.MISBEHAVING``; the spec-abiding but differently reporting
  ``changed.CHANGED``);
* ``legacy-v1``, ``legacy-v2``, ``legacy-self-attn``: vLLM's legacy (V0) block managers through
  ``kvspec.adapters.legacy`` (``manager`` is the adapter's name for each);
* ``v1``: vLLM's V1-engine ``KVCacheManager`` through ``kvspec.adapters.v1``.

The scheduler-driven implementations (``SCHEDULERS``) take a ``Shape``, not a ``Config``: the
scheduler machine (testing/scheduler/machine.py) builds them per drawn production shape.

* ``v1-scheduler``: vLLM's own V1 ``Scheduler`` / ``AsyncScheduler`` through
  ``kvspec.adapters.v1_scheduler``;
* ``reference-scheduler``: kvspec's reference scheduler;
* ``broken-scheduler:<variant>``: a deliberately broken reference scheduler
  (``kvspec.reference.broken_scheduler.BROKEN_SCHEDULERS``).

Which releases ship which vLLM manager is ``kvspec.targets.registry``'s business (release facts);
this table says how to build each one and what can reproduce its findings standalone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Literal

import attrs
from kvspec.adapters.legacy import make_legacy
from kvspec.adapters.v1 import make_v1
from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter
from kvspec.reference import ReferenceManager
from kvspec.reference.broken import BROKEN
from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS
from kvspec.reference.changed import CHANGED
from kvspec.reference.misbehaving import MISBEHAVING
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.config import Config
from kvspec.spec.errors import KVSpecError
from kvspec.spec.groups import Shape
from kvspec.spec.interface import Implementation
from kvspec.testing.scheduler.driver import SchedulerTarget

Factory = Callable[[Config], Implementation]
Engine = Literal["kvspec", "legacy", "v1"]
BROKEN_PREFIX = "broken:"


class UnknownImplementation(KVSpecError, KeyError):
    """A name that is not in the table (the message lists the names)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@attrs.frozen
class Impl:
    name: str
    engine: Engine  # "kvspec" (reference, broken variants), "legacy" (vllm/core), "v1" (vllm/v1/core)
    factory: Factory  # Config -> Implementation, what the machine calls per drawn configuration
    manager: str | None = None  # adapters.legacy's name of a legacy manager
    harness: Literal["legacy", "v1"] | None = None  # standalone reproducer family (None: none)
    needs: Mapping[str, object] = attrs.field(factory=dict)  # config a broken variant's bug needs

    @property
    def is_vllm(self) -> bool:
        return self.engine != "kvspec"


def _legacy(name: str, manager: str) -> Impl:
    return Impl(name, "legacy", functools.partial(make_legacy, manager=manager), manager, "legacy")


VLLM: tuple[Impl, ...] = (
    _legacy("legacy-v1", "v1"),
    _legacy("legacy-v2", "v2"),
    _legacy("legacy-self-attn", "self_attn"),
    Impl("v1", "v1", make_v1, harness="v1"),
)
REFERENCE = Impl("reference", "kvspec", ReferenceManager)


def _table() -> dict[str, Impl]:
    out = {REFERENCE.name: REFERENCE}
    out.update((i.name, i) for i in VLLM)
    for variant, v in sorted(BROKEN.items()):
        out[BROKEN_PREFIX + variant] = Impl(BROKEN_PREFIX + variant, "kvspec", v.cls, needs=v.needs)
    # Variants that hang, run away with memory, crash or answer nondeterministically: what the
    # run's own outcomes (testing.guard, the driver's crash records) must report.
    for variant, m in sorted(MISBEHAVING.items()):
        out[BROKEN_PREFIX + variant] = Impl(BROKEN_PREFIX + variant, "kvspec", m.cls)
    # Variants that break no invariant but report a figure differently: what a lockstep run
    # must call a behaviour change.
    for variant, cls in sorted(CHANGED.items()):
        out[BROKEN_PREFIX + variant] = Impl(BROKEN_PREFIX + variant, "kvspec", cls)
    return out


IMPLEMENTATIONS: dict[str, Impl] = _table()


def names() -> list[str]:
    """Every name, in the order the command line lists them."""
    return list(IMPLEMENTATIONS)


def vllm_names() -> tuple[str, ...]:
    return tuple(i.name for i in VLLM)


def lookup(name: str) -> Impl:
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        if name.startswith(BROKEN_PREFIX):
            variant = BROKEN.get(name[len(BROKEN_PREFIX) :])
            if variant is not None:  # registered after this module was imported
                return Impl(name, "kvspec", variant.cls, needs=variant.needs)
            raise UnknownImplementation(
                f"unknown broken variant {name[len(BROKEN_PREFIX) :]!r}; one of: {', '.join(sorted(BROKEN))}"
            ) from None
        listed = ", ".join([REFERENCE.name, *vllm_names()])
        raise UnknownImplementation(
            f"unknown implementation {name!r}; one of: {listed} or {BROKEN_PREFIX}<variant>"
        ) from None


def factory(name: str) -> Factory:
    return lookup(name).factory


# ---------------------------------------------------------------- scheduler-driven

SchedulerFactory = Callable[[Shape], SchedulerTarget]
BROKEN_SCHEDULER_PREFIX = "broken-scheduler:"


@attrs.frozen
class SchedulerImpl:
    name: str
    engine: Engine
    factory: SchedulerFactory  # Shape -> SchedulerTarget, what the scheduler machine calls
    shape: str | None = None  # a broken variant's SHAPE_TAGS entry: the shape that reaches it

    @property
    def is_vllm(self) -> bool:
        return self.engine != "kvspec"


V1_SCHEDULER = SchedulerImpl("v1-scheduler", "v1", VLLMV1SchedulerAdapter)
REFERENCE_SCHEDULER = SchedulerImpl("reference-scheduler", "kvspec", ReferenceScheduler)
SCHEDULERS: dict[str, SchedulerImpl] = {
    V1_SCHEDULER.name: V1_SCHEDULER,
    REFERENCE_SCHEDULER.name: REFERENCE_SCHEDULER,
    **{
        BROKEN_SCHEDULER_PREFIX + variant: SchedulerImpl(
            BROKEN_SCHEDULER_PREFIX + variant, "kvspec", b.cls, b.shape
        )
        for variant, b in sorted(BROKEN_SCHEDULERS.items())
    },
}


def lookup_scheduler(name: str) -> SchedulerImpl:
    try:
        return SCHEDULERS[name]
    except KeyError:
        raise UnknownImplementation(
            f"unknown scheduler implementation {name!r}; one of: {', '.join(SCHEDULERS)}"
        ) from None


def by_manager(manager: str) -> Impl:
    """The vLLM legacy implementation adapters.legacy calls ``manager``."""
    for impl in VLLM:
        if impl.manager == manager:
            return impl
    raise UnknownImplementation(f"no implementation drives the legacy manager {manager!r}")


__all__ = [
    "BROKEN_PREFIX",
    "BROKEN_SCHEDULER_PREFIX",
    "IMPLEMENTATIONS",
    "SCHEDULERS",
    "VLLM",
    "Factory",
    "Impl",
    "SchedulerFactory",
    "SchedulerImpl",
    "UnknownImplementation",
    "by_manager",
    "factory",
    "lookup",
    "lookup_scheduler",
    "names",
    "vllm_names",
]
