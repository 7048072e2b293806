"""No code reads a violation's text back: pictures, reproducers and known findings read the
violation's facts (``kvspec.spec.violation.Violation``), and its message is for people only.

The test walks every module of the package and follows a violation's text -- the ``.message``
or ``["message"]`` of a violation (a name bound over violations, or an expression that names
them), ``message_of(...)``, ``str(v)`` or ``f"{v}"`` of such a name -- through assignments,
loops, comprehensions and calls to the module's own functions, and fails where that text meets
a reading operation: a regular expression, a substring test (``in``), a string search or
split, ``int()``.  It is shown able to fail on the forms the package used before its
violations carried facts.

Every check in spec/ yields facts, not bare sentences, and every kind a known finding names is
one a check gives.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("spec", "reference", "adapters", "targets", "testing", "proofs", "cli", "bench", "kvspec")
REGEX_CALLS = {"match", "search", "fullmatch", "findall", "finditer", "sub", "subn"}
STRING_READS = {
    "startswith", "endswith", "split", "rsplit", "partition", "rpartition", "find", "rfind",
    "index", "rindex", "count", "removeprefix", "removesuffix",
}
NUMBER_READS = {"int", "float"}


def _mentions_violations(node: ast.AST) -> bool:
    for n in ast.walk(node):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            name = n.value  # a report's "violations" entry
        if "violation" in name.lower():
            return True
    return False


def _names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


class _Module:
    """One module's functions, and the names in each scope that hold a violation's text (or a
    violation whose ``str`` is its text)."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.params: dict[str, list[tuple[ast.AST, list[str]]]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
                if names and names[0] in ("self", "cls"):
                    names = names[1:]
                self.params.setdefault(node.name, []).append((node, names + [a.arg for a in node.args.kwonlyargs]))
        self.text: dict[ast.AST, set[str]] = {}  # scope -> names holding a violation's text
        self.violations: dict[ast.AST, set[str]] = {}  # scope -> names bound over violations
        self.scope_of: dict[ast.AST, ast.AST] = {}
        self._scopes(tree, tree)
        self._propagate()

    def _scopes(self, node: ast.AST, scope: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) else scope
            self.scope_of[child] = inner
            self._scopes(child, inner)

    def tainted(self, node: ast.AST, scope: ast.AST) -> bool:
        text, seqs = self.text.get(scope, set()), self.violations.get(scope, set())
        def a_violation(value: ast.AST) -> bool:
            return (isinstance(value, ast.Name) and value.id in seqs) or _mentions_violations(value)

        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and n.attr == "message" and a_violation(n.value):
                return True
            if (isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "message"
                    and a_violation(n.value)):
                return True
            if isinstance(n, ast.Name) and n.id in text:
                return True
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                if n.func.id == "message_of":
                    return True
                if n.func.id == "str" and any(isinstance(a, ast.Name) and a.id in seqs for a in n.args):
                    return True
            if isinstance(n, ast.FormattedValue) and isinstance(n.value, ast.Name) and n.value.id in seqs:
                return True
        return False

    def _propagate(self) -> None:
        changed = True
        while changed:
            changed = False
            for node in ast.walk(self.tree):
                scope = self.scope_of.get(node, self.tree)
                for targets, value in self._bindings(node):
                    if self.tainted(value, scope):
                        changed |= self._add(self.text, scope, targets)
                    if isinstance(node, ast.For | ast.comprehension) and _mentions_violations(value):
                        changed |= self._add(self.violations, scope, targets)
                if isinstance(node, ast.Call):
                    changed |= self._into_call(node, scope)

    @staticmethod
    def _bindings(node: ast.AST):
        if isinstance(node, ast.Assign):
            yield set().union(*(_names(t) for t in node.targets)), node.value
        elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr) and node.value is not None:
            yield _names(node.target), node.value
        elif isinstance(node, ast.For | ast.comprehension):
            yield _names(node.target), node.iter

    @staticmethod
    def _add(table: dict[ast.AST, set[str]], scope: ast.AST, names: set[str]) -> bool:
        held = table.setdefault(scope, set())
        new = names - held
        held |= new
        return bool(new)

    def _into_call(self, call: ast.Call, scope: ast.AST) -> bool:
        name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
        changed = False
        for fn, params in self.params.get(name, []):
            for i, arg in enumerate(call.args):
                if i < len(params) and self.tainted(arg, scope):
                    changed |= self._add(self.text, fn, {params[i]})
            for kw in call.keywords:
                if kw.arg in params and self.tainted(kw.value, scope):
                    changed |= self._add(self.text, fn, {kw.arg})
        return changed


def text_readers(source: str) -> list[str]:
    """Where ``source`` reads a violation's text back: ``line: code`` for each such operation."""
    tree = ast.parse(source)
    module = _Module(tree)
    found = []
    for node in ast.walk(tree):
        scope = module.scope_of.get(node, tree)
        hit = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            operands = [*node.args, *(k.value for k in node.keywords)]
            if node.func.attr in REGEX_CALLS:
                hit = any(module.tainted(a, scope) for a in operands)
            elif node.func.attr in STRING_READS:
                hit = module.tainted(node.func.value, scope)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in NUMBER_READS:
            hit = any(module.tainted(a, scope) for a in node.args)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            hit = any(module.tainted(x, scope) for x in (node.left, *node.comparators))
        if hit:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_reads_a_violations_text(path):
    assert text_readers(path.read_text(encoding="utf-8")) == [], f"{path} reads a violation's text back"


# The forms the package used before violations carried facts (timeline, straight_line,
# reproducer, known findings), each of which the test above must catch.
READ_BACK = {
    "a regular expression over the joined messages": """
        import re
        def offending(film):
            text = " ".join(v.message for v in film.violations)
            return {int(b) for b in re.findall(r"block (\\d+)", text)}
    """,
    "a compiled pattern matched on a message": """
        import re
        OVERWRITE = re.compile(r"seq (\\d+): writing position (\\d+)")
        def check(recording):
            for v in recording.violations:
                m = OVERWRITE.match(v.message) if v.invariant == "immutability" else None
    """,
    "a substring of the messages, through a list": """
        def only_cow(violations):
            msgs = [v.message for v in violations if v.invariant == "immutability"]
            return any("missed copy-on-write" in m for m in msgs)
    """,
    "a substring of str(violation), through a call": """
        class Known:
            def matches(self, fp, message):
                return any(part in message for part in self.message)
        def which(known, fp, message):
            return next(k for k in known if k.matches(fp, message))
        def label(known, error):
            lines = [str(violation) for violation in error.violations]
            return which(known, None, "\\n".join(lines))
    """,
    "a report entry's message split": """
        def first_seq(report):
            return int(report["violations"][0]["message"].split()[1])
    """,
}


@pytest.mark.parametrize("form", sorted(READ_BACK))
def test_the_check_catches_text_read_back(form):
    assert text_readers(textwrap.dedent(READ_BACK[form])), form


def test_facts_read_and_text_shown_are_not_flagged():
    source = textwrap.dedent("""
        import re
        def cells(film, out):
            blocks = {b for v in film.violations for b in v.blocks}
            out.print(" ".join(str(v) for v in film.violations))
            name = re.sub(r"\\W", "_", film.violations[0].invariant)
            return "ok-then-failed" in {v.kind for v in film.violations}, blocks, name
    """)
    assert text_readers(source) == []


# ------------------------------------------------------------------ checks yield facts


def _registered_checks(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Call) and getattr(d.func, "id", "") == "invariant" for d in node.decorator_list
        ):
            yield node


@pytest.mark.parametrize("module", ["invariants.py", "tenancy.py"])
def test_every_check_in_spec_yields_facts_not_a_sentence(module):
    """A registered check yields ``fact(...)`` or a fault's ``violation()``, never a bare string."""
    checks = list(_registered_checks(ROOT / "spec" / module))
    assert checks
    for fn in checks:
        for node in ast.walk(fn):
            if isinstance(node, ast.Yield | ast.YieldFrom) and node.value is not None:
                assert not isinstance(node.value, ast.JoinedStr | ast.Constant), (
                    f"{module}:{node.lineno}: {fn.name} yields a sentence without facts"
                )


def _kinds_given() -> set[str]:
    """Every kind a check gives: ``fact(KIND, ...)``, ``kind=KIND``, ``detail=KIND`` and the
    write faults' kinds (spec/kv_memory.py)."""
    from kvspec.spec import kv_memory

    kinds = {kv_memory.UNMAPPED, kv_memory.OVERWRITE, kv_memory.SHARED_WRITE, kv_memory.CACHED_WRITE,
             kv_memory.COPY_OVERWRITE}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            if getattr(node.func, "id", "") == "fact" and node.args and isinstance(node.args[0], ast.Constant):
                kinds.add(node.args[0].value)
            for kw in node.keywords:
                if kw.arg in ("kind", "detail") and isinstance(kw.value, ast.Constant):
                    kinds.add(kw.value.value)
    return kinds


def test_every_kind_a_known_finding_names_is_one_a_check_gives():
    from kvspec.testing.known import SHIPPED, load_known

    given = _kinds_given()
    named = {k: f.id for f in load_known([SHIPPED]) for k in f.kind}
    assert named, "no known finding names a kind"
    assert set(named) <= given, {k: named[k] for k in set(named) - given}


def test_the_walk_covers_the_scheduler_verdicts():
    """The modules that make, fingerprint, report and reproduce a scheduler verdict are among
    those walked."""
    walked = {str(p.relative_to(ROOT)) for p in _modules()}
    assert {
        "testing/scheduler/machine.py", "testing/scheduler/driver.py", "testing/scheduler/reproducer.py",
        "testing/known.py", "testing/artifacts/timeline.py", "cli/shapes.py", "cli/search.py",
    } <= walked
