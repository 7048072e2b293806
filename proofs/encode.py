"""z3 encodings of the spec's arithmetic, one per Python function, line for line.

Every encoding is registered in ``ENCODINGS`` with the Python function it stands for;
tests/test_proofs_conformance.py evaluates each one concretely (substitute + simplify) against
that function on random inputs, so a proof is about the code, not a paraphrase of it.

z3's integer ``/`` is Euclidean division: it equals Python's ``//`` only for a positive divisor,
so every encoding that divides states ``B >= 1`` in its domain (``domain``), and every
obligation assumes it.  A window ``None`` (full attention) is ``Win(on=False, size=_)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import z3
from kvspec.spec import admission, window

Kind = Literal["nat", "pos", "int", "window"]


@attrs.frozen
class Win:
    """A symbolic optional window: ``on`` false is full attention (``window=None``)."""

    on: z3.BoolRef
    size: z3.ArithRef

    @staticmethod
    def fresh(name: str = "W") -> Win:
        return Win(z3.Bool(f"{name}_on"), z3.Int(name))

    @staticmethod
    def fixed(size: int | None) -> Win:
        if size is None:
            return Win(z3.BoolVal(False), z3.IntVal(1))
        return Win(z3.BoolVal(True), z3.IntVal(size))

    def domain(self) -> z3.BoolRef:
        return z3.Implies(self.on, self.size >= 1)


def zmax(a, b):
    return z3.If(a >= b, a, b)


def zmin(a, b):
    return z3.If(a <= b, a, b)


# ---------------------------------------------------------------- spec.window


def ceil_div(a, b):
    return -((-a) / b)


def block_of(position, block_size):
    return position / block_size


def blocks_for_tokens(num_tokens, block_size):
    return ceil_div(num_tokens, block_size)


def blocks_touched(lo, hi, block_size):
    return z3.If(hi < lo, 0, hi / block_size - lo / block_size + 1)


def window_cover(w, block_size):
    return ceil_div(w - 1, block_size) + 1


def first_needed_position(start, win: Win):
    return z3.If(win.on, zmax(0, start - win.size + 1), 0)


def needed_blocks(start, end, win: Win, block_size):
    end = z3.If(end <= start, start + 1, end)
    return blocks_touched(first_needed_position(start, win), end - 1, block_size)


def first_needed_block(start, win: Win, block_size):
    return first_needed_position(start, win) / block_size


def attends(query_pos, key_pos, win: Win):
    return z3.And(
        key_pos <= query_pos, key_pos >= 0, z3.Or(z3.Not(win.on), query_pos - key_pos < win.size)
    )


# ---------------------------------------------------------------- spec.admission


def new_blocks_for_step(hit_tokens, end, win: Win, block_size):
    first = first_needed_block(hit_tokens, win, block_size)
    last = (end - 1) / block_size
    return last - zmax(first, hit_tokens / block_size) + 1


def hit_blocks_held(hit_tokens, win: Win, block_size):
    first = first_needed_block(hit_tokens, win, block_size)
    return zmax(0, hit_tokens / block_size - first)


def fits(new_blocks, evictable_hits, free, evictable):
    return new_blocks + evictable_hits <= free + evictable


# ---------------------------------------------------------------- registry


@attrs.frozen
class Encoding:
    """A z3 encoding and the Python function it must agree with.

    ``kinds`` gives each argument's domain: nat >= 0, pos >= 1, int any, window None | >= 1.
    ``requires`` states the remaining preconditions of the Python function (its asserts).
    """

    name: str
    python: Callable[..., object]
    z3fn: Callable[..., object]
    kinds: tuple[Kind, ...]
    requires: Callable[..., bool] = lambda *a: True
    source: str = ""


ENCODINGS: dict[str, Encoding] = {}


def register(enc: Encoding) -> Encoding:
    assert enc.name not in ENCODINGS
    ENCODINGS[enc.name] = enc
    return enc


for _enc in (
    Encoding("window.ceil_div", window.ceil_div, ceil_div, ("int", "pos")),
    Encoding("window.block_of", window.block_of, block_of, ("nat", "pos")),
    Encoding(
        "window.blocks_for_tokens", window.blocks_for_tokens, blocks_for_tokens, ("nat", "pos")
    ),
    Encoding("window.blocks_touched", window.blocks_touched, blocks_touched, ("int", "int", "pos")),
    Encoding("window.window_cover", window.window_cover, window_cover, ("pos", "pos")),
    Encoding(
        "window.first_needed_position",
        window.first_needed_position,
        first_needed_position,
        ("nat", "window"),
    ),
    Encoding(
        "window.needed_blocks", window.needed_blocks, needed_blocks, ("nat", "nat", "window", "pos")
    ),
    Encoding(
        "window.first_needed_block",
        window.first_needed_block,
        first_needed_block,
        ("nat", "window", "pos"),
    ),
    Encoding("window.attends", window.attends, attends, ("int", "int", "window")),
    Encoding(
        "admission.new_blocks_for_step",
        admission.new_blocks_for_step,
        new_blocks_for_step,
        ("nat", "pos", "window", "pos"),
        requires=lambda hit, end, w, b: end > hit,
    ),
    Encoding(
        "admission.hit_blocks_held",
        admission.hit_blocks_held,
        hit_blocks_held,
        ("nat", "window", "pos"),
    ),
    Encoding("admission.fits", admission.fits, fits, ("nat", "nat", "nat", "nat")),
):
    register(_enc)


def symbolic_args(enc: Encoding, prefix: str = "a") -> list[z3.ExprRef | Win]:
    """Fresh z3 arguments for an encoding, one per parameter."""
    out: list[z3.ExprRef | Win] = []
    for i, kind in enumerate(enc.kinds):
        out.append(Win.fresh(f"{prefix}{i}") if kind == "window" else z3.Int(f"{prefix}{i}"))
    return out


def evaluate(enc: Encoding, values: Sequence[int | None], symbols=None) -> int | bool:
    """The encoding's value at concrete arguments, by substitution and simplification."""
    symbols = symbols if symbols is not None else symbolic_args(enc)
    term = enc.z3fn(*symbols)
    pairs: list[tuple[z3.ExprRef, z3.ExprRef]] = []
    for sym, val, kind in zip(symbols, values, enc.kinds, strict=True):
        if kind == "window":
            assert isinstance(sym, Win)
            pairs.append((sym.on, z3.BoolVal(val is not None)))
            pairs.append((sym.size, z3.IntVal(1 if val is None else val)))
        else:
            pairs.append((sym, z3.IntVal(val)))
    out = z3.simplify(z3.substitute(term, *pairs))
    if z3.is_true(out):
        return True
    if z3.is_false(out):
        return False
    assert z3.is_int_value(out), f"{enc.name} did not evaluate to a number: {out}"
    return out.as_long()
