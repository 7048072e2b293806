"""A violation: the invariant it breaks, the typed facts behind it, and a sentence for people.

Every reader that acts on a violation reads its facts: the report's picture draws the sequences,
group and blocks it names; a reproducer asserts on its expected and observed values; a known
finding matches its ``kind``.  The ``message`` is made for a person from the same facts and
nothing reads it back (tests/test_no_text_parsing.py).

Facts are optional: a check fills those it knows.  ``kind`` names which of an invariant's ways
of failing this is (``refcount-exact`` has ``wrong-refcount`` and ``not-in-pool``); ``expected``
and ``observed`` hold JSON values (lists become tuples, so a violation stays hashable).  For an
admission or an allocation, ``pool`` is the pool it met, ``need`` the blocks kvspec's admission
arithmetic computes for it under the target's declared policy (``spec.admission``), and
``taken`` the blocks the allocation took before it failed.  For a block or a hash that stands for
content of two domains, ``domains`` names the kinds of extra key that tell them apart
(``spec.prefix_hash.confused_domains``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

UNNAMED = ""
"""The invariant field of a violation a check yields: the registry names it by the check's ID."""


def _frozen(value: Any) -> Any:
    """A JSON value with its lists as tuples (and mappings as sorted item tuples): hashable."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    return value


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _json(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    return value


@attrs.frozen
class PoolFacts:
    """The pool an admission or an allocation met: free and evictable blocks, and its size."""

    free: int
    evictable: int
    num_blocks: int

    def to_json(self) -> dict[str, int]:
        return attrs.asdict(self)


@attrs.frozen
class Violation:
    """One way an invariant failed, with the facts that show it."""

    invariant: str
    message: str
    kind: str = ""
    seqs: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    group: str = ""  # the KV-cache group (hybrid targets); "" for the whole pool or one group
    device: str = ""  # "gpu" or "cpu": where ``blocks`` live
    blocks: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    positions: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    expected: Any = attrs.field(default=None, converter=_frozen)
    observed: Any = attrs.field(default=None, converter=_frozen)
    pool: PoolFacts | None = None
    need: int | None = None
    taken: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    domains: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.message}"

    def named(self, invariant: str) -> Violation:
        """This violation under ``invariant`` (a check's yield, named by the registry)."""
        return self if self.invariant == invariant else attrs.evolve(self, invariant=invariant)

    def in_group(self, group: str) -> Violation:
        """This violation as found in one KV-cache group's view of a hybrid state."""
        return attrs.evolve(self, group=group, message=f"group {group}: {self.message}")

    def facts(self) -> dict[str, Any]:
        """The facts that are set, JSON-ready (the invariant and message left out)."""
        out: dict[str, Any] = {}
        for field in attrs.fields(Violation)[2:]:
            value = getattr(self, field.name)
            if value != field.default:
                out[field.name] = value.to_json() if isinstance(value, PoolFacts) else _json(value)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "message": self.message, **self.facts()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Violation:
        """A violation as ``to_json`` wrote it (a report's ``violations`` entry); fields a
        newer kvspec wrote and this one does not know are left out."""
        names = {f.name for f in attrs.fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        if isinstance(kw.get("pool"), Mapping):
            kw["pool"] = PoolFacts(**kw["pool"])
        return cls(**kw)


def fact(kind: str, message: str, **facts: Any) -> Violation:
    """A violation as a check yields it: its kind, its sentence and its facts; the registry
    names it by the check's invariant ID."""
    return Violation(UNNAMED, message, kind=kind, **facts)
