"""A small AST mutation operator set, applied at import time to a copy of a vLLM module.

Why not mutmut or cosmic-ray: both are built to mutate the files of the project under test,
in place, and to run that project's test command per mutant.  Here the code under mutation is
a third-party module inside an installed venv that must stay untouched, the "test" is the
kvspec oracle running in that venv's interpreter, and each mutant must be loaded in place of
the original in a process that already imported torch and vLLM (10 s of imports per mutant
otherwise).  mutmut (v2/v3) rewrites files in the working tree (v3 copies the project into
``mutants/`` and needs its own trampoline import hooks); cosmic-ray patches modules found on
the project's ``module-path`` and drives its own per-mutant test command.  Neither loads one
mutant into a forked interpreter.  The operators below are the classic ones (ROR, AOR, ASR,
CRP, LCR, UOI, SDL, argument swap) and fit in one file.

A mutant is (module, site index, operator): the site index is the position of the node in a
deterministic walk of the module's AST, so a worker process re-derives exactly the same
mutated tree from the unmodified source.  The mutation is applied to the AST (line numbers
stay those of the original file) and compiled from it.

Excluded by construction (they cannot change block-manager behaviour, or would only test
vLLM's own assertions): ``assert`` statements, logging calls, f-strings and other string
formatting, annotations, decorators, docstrings, ``raise`` statements, ``__repr__``/``__str__``,
``TYPE_CHECKING`` blocks, and statement deletion at module or class level (imports,
definitions).
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from typing import Any

import attrs

ROR = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
}
OP_TEXT = {
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
    ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in",
    ast.Add: "+", ast.Sub: "-", ast.FloorDiv: "//", ast.And: "and", ast.Or: "or",
}
SYMMETRIC_CALLS = {"min", "max", "print", "isinstance", "issubclass", "getattr", "setattr",
                   "hasattr", "dict", "zip", "divmod", "pow", "round"}
SKIP_FUNCS = {"__repr__", "__str__", "__rich_repr__"}
LOGGERS = {"logger", "logging", "log", "warnings", "_logger"}


@attrs.frozen
class Mutant:
    module: str
    site: int  # index of the node in ``_walk`` order
    op: str  # operator name
    variant: int  # which mutation of that operator at that node
    lineno: int
    end_lineno: int
    in_function: bool  # inside a function body (covered only if run after import)
    original: str  # source text of the node (first line)
    mutated: str  # the mutated node, unparsed

    @property
    def key(self) -> str:
        return f"{self.module}:{self.site}:{self.op}:{self.variant}"

    def describe(self) -> str:
        return f"{self.module}:{self.lineno} {self.op}: `{self.original}` -> `{self.mutated}`"


# ---------------------------------------------------------------- walking


def _is_logging_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    while isinstance(f, ast.Attribute):
        if isinstance(f.value, ast.Name) and f.value.id in LOGGERS:
            return True
        f = f.value
    return isinstance(f, ast.Name) and f.id in {"print", "warn"}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _children(node: ast.AST) -> Iterator[tuple[str, int | None, ast.AST]]:
    """Child nodes in field order, skipping the subtrees we never mutate."""
    for field, value in ast.iter_fields(node):
        if field in ("annotation", "returns", "decorator_list", "type_comment", "type_params"):
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, ast.AST):
                    yield field, i, item
        elif isinstance(value, ast.AST):
            yield field, None, value


def _skip_subtree(node: ast.AST) -> bool:
    if isinstance(node, ast.Assert | ast.Raise | ast.JoinedStr | ast.Import | ast.ImportFrom):
        return True
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in SKIP_FUNCS:
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(
        node.value.value, str
    ):
        return True  # docstring
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
        node.func.attr == "format"
    ):
        return True
    return _is_logging_call(node) or _is_type_checking(node)


def _walk(tree: ast.AST) -> Iterator[tuple[ast.AST, ast.AST | None, str | None, int | None, bool]]:
    """Deterministic pre-order walk: (node, parent, field, index, in_function)."""
    stack: list[tuple[ast.AST, ast.AST | None, str | None, int | None, bool]] = [
        (tree, None, None, None, False)
    ]
    while stack:
        node, parent, field, index, in_func = stack.pop()
        if _skip_subtree(node):
            continue
        yield node, parent, field, index, in_func
        inner = in_func or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        kids = list(_children(node))
        for f, i, child in reversed(kids):
            stack.append((child, node, f, i, inner))


# ---------------------------------------------------------------- operators


def _variants(node: ast.AST, parent: ast.AST | None, in_func: bool) -> list[tuple[str, int]]:
    """The (operator, variant) mutations that apply at ``node``."""
    out: list[tuple[str, int]] = []
    if isinstance(node, ast.Compare):
        out += [("ROR", i) for i, op in enumerate(node.ops) if type(op) in ROR]
    elif isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Add | ast.Sub):
            out.append(("AOR", 0))
        elif isinstance(node.op, ast.FloorDiv):
            out.append(("AOR", 1))  # a // b -> a // b + 1 (floor vs ceiling)
    elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add | ast.Sub):
        out.append(("ASR", 0))
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        out += [("CRP", 0), ("CRP", 1)]  # n + 1, n - 1
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        out.append(("CRP", 2))  # True <-> False
    elif isinstance(node, ast.BoolOp):
        out.append(("LCR", 0))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("UOI", 0))  # drop the `not`
    elif isinstance(node, ast.Call):
        positional = [a for a in node.args if not isinstance(a, ast.Starred)]
        name = node.func.id if isinstance(node.func, ast.Name) else (
            node.func.attr if isinstance(node.func, ast.Attribute) else "")
        if len(positional) >= 2 and len(positional) == len(node.args) and (
            name not in SYMMETRIC_CALLS
        ) and ast.dump(node.args[0]) != ast.dump(node.args[1]):
            out.append(("ARG", 0))
    if in_func and isinstance(parent, ast.AST) and _droppable(node):
        out.append(("SDL", 0))
    return out


def _droppable(node: ast.AST) -> bool:
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Call | ast.Await) and not _is_logging_call(node.value)
    if isinstance(node, ast.AnnAssign):
        return node.value is not None
    return isinstance(node, ast.Assign | ast.AugAssign | ast.Delete)


def _apply(node: ast.AST, parent: Any, field: str, index: int | None, op: str,
           variant: int) -> ast.AST:
    """Mutate ``node`` (in place, or by replacing it in ``parent``); return the new node."""
    new: ast.AST
    if op == "ROR":
        assert isinstance(node, ast.Compare)
        node.ops[variant] = ROR[type(node.ops[variant])]()
        new = node
    elif op == "AOR" and variant == 0:
        assert isinstance(node, ast.BinOp)
        node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        new = node
    elif op == "AOR":
        new = ast.BinOp(left=copy.copy(node), op=ast.Add(), right=ast.Constant(1))
    elif op == "ASR":
        assert isinstance(node, ast.AugAssign)
        node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        new = node
    elif op == "CRP":
        assert isinstance(node, ast.Constant)
        node.value = (not node.value) if variant == 2 else node.value + (1 if variant == 0 else -1)
        new = node
    elif op == "LCR":
        assert isinstance(node, ast.BoolOp)
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        new = node
    elif op == "UOI":
        assert isinstance(node, ast.UnaryOp)
        new = node.operand
    elif op == "ARG":
        assert isinstance(node, ast.Call)
        node.args[0], node.args[1] = node.args[1], node.args[0]
        new = node
    elif op == "SDL":
        new = ast.Pass()
    else:
        raise ValueError(op)
    if new is not node:
        ast.copy_location(new, node)
        if index is None:
            setattr(parent, field, new)
        else:
            getattr(parent, field)[index] = new
    return new


# ---------------------------------------------------------------- public


class _Holder:
    """A stand-in parent, to describe a mutation on a copy of the node."""

    node: Any = None


def enumerate_mutants(module: str, source: str) -> list[Mutant]:
    tree = ast.parse(source)
    lines = source.splitlines()
    out: list[Mutant] = []
    for site, (node, parent, _field, _index, in_func) in enumerate(_walk(tree)):
        for op, variant in _variants(node, parent, in_func):
            if op == "SDL":
                mutated = "pass"
            else:
                new = _apply(copy.deepcopy(node), _Holder(), "node", None, op, variant)
                mutated = ast.unparse(new)
            original = _segment(lines, node)
            out.append(Mutant(module, site, op, variant, node.lineno,
                              getattr(node, "end_lineno", None) or node.lineno, in_func,
                              _one_line(original), _one_line(mutated)))
    return out


def mutate_tree(source: str, module: str, site: int, op: str, variant: int
                ) -> tuple[ast.Module, str]:
    """The module's AST with one mutation applied, and the mutated node unparsed."""
    tree = ast.parse(source)
    for i, (node, parent, field, index, _in_func) in enumerate(_walk(tree)):
        if i == site:
            assert parent is not None and field is not None
            new = _apply(node, parent, field, index, op, variant)
            ast.fix_missing_locations(tree)
            return tree, ast.unparse(new) if not isinstance(new, ast.Pass) else "pass"
    raise IndexError(f"{module}: no site {site}")


def _segment(lines: list[str], node: ast.AST) -> str:
    """The node's source text (ast.get_source_segment re-splits the file on every call)."""
    first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
    col, end_col = node.col_offset, node.end_col_offset
    if first == last:
        return lines[first].encode()[col:end_col].decode(errors="replace")
    parts = [lines[first].encode()[col:].decode(errors="replace")]
    parts += lines[first + 1 : last]
    parts.append(lines[last].encode()[:end_col].decode(errors="replace"))
    return "\n".join(parts)


def _one_line(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
