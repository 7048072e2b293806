"""Recording the calls an adapter makes into vLLM, as straight-line Python.

An adapter built with a ``Recorder`` wraps the objects it hands vLLM in ``Recorded`` proxies.
Every method call and attribute assignment on a proxy is made on the real object and written
down as one line (``s0.status = SequenceStatus.RUNNING``, ``mgr.allocate(g0)``); constructions
go through ``Recorder.construct`` and read ``s0 = Sequence(seq_id=0, ...)``.  Queries the
adapter makes only to observe (``QUERIES``) are not written down.  vLLM always receives the
real objects, never a proxy.

The lines are what a standalone reproducer replays: they are the adapter's own calls, not a
second rendering of its protocol.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import attrs

# Calls whose answer the scheduler branches on: a reproducer asserts the recorded answer, so
# a target that answers otherwise stops there instead of silently taking another path.
ANSWERS = frozenset({"can_allocate", "can_append_slots", "can_swap_out", "can_swap_in"})

# Variable names by class: s0, g0 as vLLM's own tests name sequences and groups.
PREFIXES = {"Sequence": "s", "SequenceGroup": "g", "Request": "req"}

# Names of objects a reproducer builds once: written without a number (``mgr``, ``scheduler``).
SINGLETONS = frozenset({"mgr", "scheduler"})

# Reads the adapter makes to observe or to decide; they change nothing and are not replayed.
QUERIES = frozenset(
    {
        "get_token_ids",
        "get_len",
        "get_prompt_len",
        "get_output_len",
        "is_prefill",
        "is_finished",
        "get_seqs",
        "hash_of_block",
        "get_num_computed_tokens",
        "get_block_table",
        "take_events",
    }
)


@attrs.define
class Line:
    """One recorded statement; ``op_index`` is the trace operation it belongs to."""

    code: str
    op_index: int
    call: str = ""  # the method name, for calls
    answer: str | None = None  # the rendered answer of an ANSWERS call
    raised: BaseException | None = None
    target: str = ""  # the rendered call expression (without assignment)
    result: Any = None  # what the call returned (golden tests assert it)


class Recorder:
    """Names objects, renders values and collects lines."""

    def __init__(self) -> None:
        self.lines: list[Line] = []
        self.names: dict[int, str] = {}
        self._keep: list[Any] = []  # named objects stay alive so their ids stay unique
        self.imports: dict[str, set[str]] = {}
        self.modules: set[str] = set()  # plain ``import X``
        self.op_index = 0
        self._counters: dict[str, int] = {}
        self.helpers: list[Callable[..., Any]] = []  # functions the recorded lines call

    # ------------------------------------------------------------ naming

    def name(self, obj: Any, prefix: str) -> str:
        existing = self.names.get(id(obj))
        if existing is not None:
            return existing
        n = self._counters.get(prefix, 0)
        self._counters[prefix] = n + 1
        label = prefix if prefix in SINGLETONS else f"{prefix}{n}"
        self.names[id(obj)] = label
        self._keep.append(obj)
        return label

    def imported(self, obj: Any) -> str:
        module, qualname = obj.__module__, obj.__qualname__
        top = qualname.split(".")[0]
        self.imports.setdefault(module, set()).add(top)
        return qualname

    def render(self, value: Any) -> str:
        if isinstance(value, Recorded):
            value = value._real
        named = self.names.get(id(value))
        if named is not None:
            return named
        if isinstance(value, enum.Enum):
            return f"{self.imported(type(value))}.{value.name}"
        if value is None or isinstance(value, bool | int | float | str):
            return repr(value)
        if isinstance(value, list):
            return "[" + ", ".join(self.render(v) for v in value) + "]"
        if isinstance(value, tuple):
            inner = ", ".join(self.render(v) for v in value)
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{self.render(k)}: {self.render(v)}" for k, v in value.items()) + "}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {
                f.name: getattr(value, f.name)
                for f in dataclasses.fields(value)
                if f.init and not _is_default(f, getattr(value, f.name))
            }
            return f"{self.imported(type(value))}({self.arguments((), fields)})"
        if isinstance(value, set | frozenset):
            inner = ", ".join(sorted(self.render(v) for v in value))
            return f"{type(value).__name__}({{{inner}}})" if value else f"{type(value).__name__}()"
        if type(value).__module__.startswith("vllm") and _default_constructed(value):
            return f"{self.imported(type(value))}()"  # e.g. SamplingParams(), a msgspec Struct too
        fields = getattr(type(value), "__struct_fields__", None)
        if fields is not None:  # a msgspec Struct (e.g. LoRARequest): its fields by keyword
            return f"{self.imported(type(value))}({self.arguments((), _struct_fields(value, fields))})"
        if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
            self.modules.add("torch")
            return str(value)  # torch.float16
        if (inspect.isfunction(value) or inspect.isbuiltin(value) or inspect.isclass(value)) and (
            "<" not in getattr(value, "__qualname__", "<")
        ):
            return self.imported(value)
        if type(value).__module__.startswith("vllm") and _default_constructed(value):
            return f"{self.imported(type(value))}()"
        raise Unrecordable(f"cannot write {type(value).__qualname__} as a literal")

    def arguments(self, args: Iterable[Any], kwargs: dict[str, Any]) -> str:
        parts = [self.render(a) for a in args]
        parts.extend(f"{k}={self.render(v)}" for k, v in kwargs.items())
        return ", ".join(parts)

    # ------------------------------------------------------------ recording

    def construct(
        self,
        cls: Callable[..., Any],
        kwargs: dict[str, Any],
        prefix: str,
        args: tuple[Any, ...] = (),
        *,
        offered: tuple[Callable[..., dict[str, Any]], dict[str, Any]] | None = None,
    ) -> Recorded:
        """``prefix<n> = cls(*args, **kwargs)``, recorded; returns the new object's proxy.
        ``args``: what releases name differently but pass in one place.  ``offered``: a filter
        and the keyword arguments it picks ``kwargs`` from on this release; the line is then
        ``cls(*args, **filter(cls, **offered))`` and the file copies the filter in (``helpers``),
        so it builds on a release whose constructor takes other keywords."""
        if offered is None:
            expr = f"{self.imported(cls)}({self.arguments(args, kwargs)})"
        else:
            pick, candidates = offered
            self.helpers.append(pick)
            head = self.arguments(args, {})
            expr = f"{self.imported(cls)}({head + ', ' if head else ''}**{pick.__name__}({self.imported(cls)}, "
            expr += f"{self.arguments((), candidates)}))"
        obj = cls(*_unwrap(args), **_unwrap(kwargs))
        label = self.name(obj, prefix)
        self.lines.append(Line(f"{label} = {expr}", self.op_index, target=expr))
        return Recorded(obj, self, label)

    def call(self, owner: str, real: Any, method: str, args: tuple, kwargs: dict) -> Any:
        fn = getattr(real, method)
        expr = f"{owner}.{method}({self.arguments(_unwrap(args), _unwrap(kwargs))})"
        line = Line(expr, self.op_index, call=method, target=expr)
        self.lines.append(line)
        try:
            result = fn(*_unwrap(args), **_unwrap(kwargs))
        except BaseException as err:
            line.raised = err
            raise
        line.result = result
        if method in ANSWERS:
            line.answer = self.render(result)
        elif _is_object(result) and id(result) not in self.names:  # a known object keeps its name
            label = self.name(result, PREFIXES.get(type(result).__name__, "r"))
            line.code = f"{label} = {expr}"
        elif isinstance(result, tuple) and any(_is_object(v) for v in result) and id(result) not in self.names:
            # e.g. get_computed_blocks -> (blocks, hit): the tuple is named, its objects by index
            label = self.name(result, "r")
            for i, v in enumerate(result):
                if _is_object(v) and v is not None:
                    self.names.setdefault(id(v), f"{label}[{i}]")
                    self._keep.append(v)
            line.code = f"{label} = {expr}"
        return self.wrap(result)

    def alias(self, value: Any, label: str) -> None:
        """Write ``value`` as ``label`` wherever it is passed: a value the reproducer makes
        itself before the recorded lines (a folder it writes a model's config.json into)."""
        self.names[id(value)] = label
        self._keep.append(value)

    def expect(self, owner: str, attr: str, value: Any) -> None:
        """``assert owner.attr == value``: a plan the target made that the recorded calls
        after it depend on (a target that plans otherwise stops there)."""
        self.lines.append(Line(f"assert {owner}.{attr} == {self.render(value)}", self.op_index))

    def insert(self, code: str) -> None:
        """A line of the reproducer's own at this point (a check of what the calls so far did)."""
        self.lines.append(Line(code, self.op_index))

    def note(self, fn: Callable[..., Any], *args: Any) -> None:
        """Write ``fn(*args)`` without calling it: process-wide set-up the adapter already did
        (once per process) that a fresh reproducer process must do itself."""
        self.lines.append(Line(f"{self.imported(fn)}({self.arguments(args, {})})", self.op_index))

    def assign(self, owner: str, attr: str, value: Any) -> None:
        self.lines.append(Line(f"{owner}.{attr} = {self.render(value)}", self.op_index))

    def wrap(self, value: Any) -> Any:
        """Proxies for the named objects inside a result (lists of sequences included)."""
        label = self.names.get(id(value))
        if label is not None:
            return Recorded(value, self, label)
        if isinstance(value, list) and any(id(v) in self.names for v in value):
            return [self.wrap(v) for v in value]
        return value


class Unrecordable(TypeError):
    """A value a recorded line would need that has no literal form."""


class Recorded:
    """A proxy that records method calls and assignments made through it."""

    __slots__ = ("_label", "_real", "_rec")

    def __init__(self, real: Any, recorder: Recorder, label: str) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_rec", recorder)
        object.__setattr__(self, "_label", label)

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._real, attr)
        if callable(value) and not isinstance(value, type):
            if attr in QUERIES:

                @functools.wraps(value)
                def query(*a: Any, **k: Any) -> Any:
                    return self._rec.wrap(value(*_unwrap(a), **_unwrap(k)))

                return query

            @functools.wraps(value)
            def recorded(*a: Any, **k: Any) -> Any:
                return self._rec.call(self._label, self._real, attr, a, k)

            return recorded
        if _is_object(value) and not isinstance(value, enum.Enum):
            return Recorded(value, self._rec, f"{self._label}.{attr}")
        return value

    def __setattr__(self, attr: str, value: Any) -> None:
        self._rec.assign(self._label, attr, value)
        setattr(self._real, attr, _unwrap(value))

    # Reads through containers the adapter iterates (a request's token list): not recorded.
    def __iter__(self) -> Any:
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)

    def __getitem__(self, key: Any) -> Any:
        return self._real[key]

    def __contains__(self, item: Any) -> bool:
        return item in self._real

    def __bool__(self) -> bool:
        return bool(self._real)

    def __eq__(self, other: object) -> bool:
        return self._real == _unwrap(other)

    def __hash__(self) -> int:
        return hash(self._real)

    def __repr__(self) -> str:
        return f"Recorded({self._label})"


def real(value: Any) -> Any:
    """The object behind a proxy (the value itself otherwise)."""
    return value._real if isinstance(value, Recorded) else value


def _unwrap(value: Any) -> Any:
    if isinstance(value, Recorded):
        return value._real
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_unwrap(v) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


def _is_object(value: Any) -> bool:
    return value is not None and not isinstance(
        value, bool | int | float | str | bytes | list | tuple | dict | set | frozenset
    )


def _is_default(field: dataclasses.Field, value: Any) -> bool:
    try:
        if field.default is not dataclasses.MISSING:
            return bool(value == field.default)
        if field.default_factory is not dataclasses.MISSING:
            return bool(value == field.default_factory())
    except Exception:
        return False
    return False


def _struct_fields(value: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """A msgspec Struct's fields other than those at their plain default value (the defaults
    belong to the last fields, ``__struct_defaults__``)."""
    defaults = getattr(type(value), "__struct_defaults__", ())
    first_default = len(fields) - len(defaults)
    out = {}
    for i, name in enumerate(fields):
        current = getattr(value, name)
        default = defaults[i - first_default] if i >= first_default else None
        plain = default is None or isinstance(default, bool | int | float | str)
        if i < first_default or not plain or current != default:
            out[name] = current
    return out


def _default_constructed(value: Any) -> bool:
    """Whether ``type(value)()`` rebuilds ``value`` (e.g. a default ``SamplingParams``)."""
    try:
        fresh = type(value)()
    except Exception:
        return False
    try:
        return bool(fresh == value) or repr(fresh) == repr(value)
    except Exception:
        return False
