"""The invariant registry: what an invariant is, how one registers, and the views of a world
every invariant module reads (the live tables of a device, the pools of a state).

Each invariant module (spec/invariants.py, spec/tenancy.py) imports this one and registers its
checks with ``@invariant``; nothing here imports them, so the layers import one way.  An ID names
one check: a second registration under an ID already taken is an error, as a second rule of one
name is in hypothesis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal

import attrs

from .config import Config
from .errors import KVSpecError
from .state import Device, KVState, PoolView, Status, World
from .violation import Violation

__all__ = ["INVARIANTS", "DuplicateInvariant", "Invariant", "Violation", "invariant"]


class DuplicateInvariant(KVSpecError):
    """A second check registered under an invariant ID that already names one."""


Applies = Callable[[Config], "str | None"]
"""When an invariant applies: None when it does, else the reason it says nothing."""


def always(_config: Config) -> str | None:
    """under every configuration"""
    return None


def needs_window(config: Config) -> str | None:
    """only with a sliding window"""
    return None if config.sliding_window is not None else "full attention (no sliding window)"


def needs_prefix_caching(config: Config) -> str | None:
    """only with prefix caching on"""
    return None if config.prefix_caching else "prefix caching off"


@attrs.frozen
class Invariant:
    id: str
    title: str
    statement: str
    concerns: str
    kind: Literal["state", "transition"]
    check: Callable[..., list[Violation]]
    applies: Applies = always

    def inapplicable(self, config: Config) -> str | None:
        """Why this invariant says nothing under ``config`` (None: it applies)."""
        return self.applies(config)

    def applies_to(self, config: Config) -> bool:
        return self.applies(config) is None

    def applies_when(self) -> str:
        """When it applies, in words: the ``applies`` function's docstring, else its name."""
        doc = (self.applies.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else f"as {getattr(self.applies, '__qualname__', 'applies')} says"


INVARIANTS: dict[str, Invariant] = {}


def invariant(
    id: str,
    title: str,
    concerns: str,
    kind: Literal["state", "transition"] = "state",
    *,
    applies: Applies = always,
):
    """Register a check under its stable ID; its docstring is the statement.  ``applies``
    gives the reason the invariant says nothing under a configuration (None: it applies).

    The check yields violations with their facts (``spec.violation.fact``), which the registry
    names by ``id``; a check that yields a bare sentence gets a violation with no facts."""

    def register(fn: Callable[..., Iterator[Violation | str]]) -> Callable[..., list[Violation]]:
        def check(*args, **kwargs) -> list[Violation]:
            return [
                found.named(id) if isinstance(found, Violation) else Violation(id, found)
                for found in fn(*args, **kwargs)
            ]

        check.__name__ = fn.__name__
        check.__doc__ = fn.__doc__
        check.__wrapped__ = fn  # type: ignore[attr-defined]
        statement = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
        if id in INVARIANTS:
            raise DuplicateInvariant(
                f"invariant {id!r} is registered twice: {INVARIANTS[id].check.__name__} and {fn.__name__}"
            )
        INVARIANTS[id] = Invariant(id, title, statement, concerns, kind, check, applies)
        return check

    return register


# ---------------------------------------------------------------- helpers


def live_tables(world: World, device: Device):
    # A sequence whose KV a connector is sending holds its GPU blocks as a running one does.
    wanted = (Status.RUNNING, Status.SENDING) if device is Device.GPU else (Status.SWAPPED,)
    for seq_id, table in world.state.tables.items():
        seq = world.seqs.get(seq_id)
        if seq is not None and seq.status in wanted and table.device is device:
            yield table


def pools(state: KVState) -> Iterator[tuple[Device, PoolView]]:
    yield Device.GPU, state.gpu
    if state.cpu is not None:
        yield Device.CPU, state.cpu
