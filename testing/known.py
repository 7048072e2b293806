"""Fingerprints of failures, and the known findings a run can step past.

A failure's fingerprint is what makes two failures the same bug for a multi-bug run: the
invariant it violates (``crash`` for an exception the target raised), the driver operation
after which it showed, and, for a crash, the exception type and the target code location
(innermost frame: file and function).  Two failing examples with one fingerprint are one
bug, reported once, shrunk on its own.

A known finding is a narrow fingerprint of a FINDINGS.md entry: the fields above, the
implementations and releases it concerns, the configuration features it needs, the kinds of
violation it shows as (``Violation.kind``: a fact, never the violation's text), for a
violation between domains the kinds of extra key it confused (``Violation.domains``) and, for a
crash, a fragment of the target's exception text.  ``known_findings.toml`` next to this module ships the
project's own; a run told to step past them discards an example that meets one (counting
it) instead of ending its search there, so a release with a known crash is still searched
behind it.  The file is read with the standard library (``tomllib``).
"""

from __future__ import annotations

import inspect
import re
import tomllib
import traceback
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from types import CodeType
from typing import Any

import attrs
from kvspec.spec.config import Config
from kvspec.spec.groups import Shape
from kvspec.spec.violation import Violation
from kvspec.targets.registry import release_key
from kvspec.testing.blockmanager.driver import Driver, SpecViolation, TraceStep
from kvspec.testing.blockmanager.machine import CONTINUE
from kvspec.testing.scheduler.driver import SchedulerDriver
from kvspec.testing.scheduler.machine import PolicyDifference

SHIPPED = Path(__file__).with_name("known_findings.toml")
UPSTREAM_DOCS = Path(__file__).resolve().parents[1] / "docs" / "upstream"  # <id>.md: ready-to-file write-ups
CRASH = "crash"  # the invariant field of a target's exception
# The invariant field of a scheduler that differs from its release's declared policy
# (testing/scheduler/machine.py ``PolicyDifference``): no invariant is violated.
DIFFERS = "differs"

# Driver methods whose frames name the operation a crash happened in ("_swap" reads it from
# its ``op`` argument; ``free_all`` frees one sequence at a time through ``free``).
_OP_CODES: dict[CodeType, str] = {
    inspect.unwrap(Driver.admit).__code__: "admit",
    inspect.unwrap(Driver.step).__code__: "step",
    inspect.unwrap(Driver.fork).__code__: "fork",
    inspect.unwrap(Driver.free).__code__: "free",
    inspect.unwrap(Driver.preempt).__code__: "preempt",
    inspect.unwrap(Driver.reset_prefix_cache).__code__: "reset_prefix_cache",
    Driver._swap.__code__: "_swap",
    # The scheduler machine's driver (testing/scheduler/driver.py).
    inspect.unwrap(SchedulerDriver.arrive).__code__: "arrive",
    inspect.unwrap(SchedulerDriver.abort).__code__: "abort",
    inspect.unwrap(SchedulerDriver.step).__code__: "step",
    inspect.unwrap(SchedulerDriver.drain).__code__: "drain",
}


class KnownFindingsError(ValueError):
    """A known-findings file that cannot be read or has an entry kvspec does not understand."""


@attrs.frozen(order=True)
class Fingerprint:
    """What makes two failures the same bug."""

    invariant: str  # an invariant ID, "crash" or "differs" (``DIFFERS``)
    operation: str  # the driver operation: admit, step, fork, free, preempt, swap_out, ...
    exception: str = ""  # a crash's exception type name; what a policy difference compared
    location: str = ""  # a crash's innermost frame ("vllm/core/block/common.py:init_block"); a
    # policy difference's declared policy ID (reference/policies.py)

    def describe(self) -> str:
        if self.invariant == DIFFERS:
            return f"differs from declared policy {self.location}: {self.exception} in {self.operation}"
        where = f" {self.exception} at {self.location}" if self.exception else ""
        return f"{self.invariant} in {self.operation}{where}"

    def to_json(self) -> dict[str, str]:
        return attrs.asdict(self)

    def slug(self) -> str:
        """A folder name: invariant and operation (and exception type, or what a policy
        difference compared), in letters, digits and dashes."""
        parts = [self.invariant, self.operation, self.exception]
        return re.sub(r"[^a-z0-9.]+", "-", "-".join(p for p in parts if p).lower()).strip("-")


def _where(filename: str) -> str:
    """A path readable across installations: from its ``vllm/`` (or ``kvspec``) folder on."""
    parts = Path(filename).parts
    for anchor in ("vllm", "kvspec"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[i:])
    return "/".join(parts[-2:])


def crash_site(error: BaseException) -> tuple[str, str]:
    """(operation, location) of an exception raised under the driver: the innermost driver
    operation on the traceback, and the innermost frame's file and function."""
    operation, location = "?", ""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        op = _OP_CODES.get(frame.f_code)
        if op == "_swap":
            op = str(frame.f_locals.get("op", "swap"))
        if op is not None:
            operation = op
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        last = frames[-1]
        location = f"{_where(last.filename)}:{last.name}"
    return operation, location


def fingerprint(error: BaseException, trace: Sequence[TraceStep] = ()) -> Fingerprint:
    """The fingerprint of a failing example's exception: a SpecViolation is its first
    violation's invariant after the trace's last operation; a PolicyDifference is what it
    compared, after that operation, under the declared policy; anything else is a crash."""
    if isinstance(error, SpecViolation):
        steps = error.trace or list(trace)
        primary = error.violations[0].invariant if error.violations else "?"
        return Fingerprint(primary, steps[-1].op if steps else "teardown")
    if isinstance(error, PolicyDifference):
        steps = error.trace or list(trace)
        return Fingerprint(DIFFERS, steps[-1].op if steps else "teardown", error.comparison.value, error.policy)
    operation, location = crash_site(error)
    return Fingerprint(CRASH, operation, type(error).__name__, location)


def message_of(error: BaseException) -> str:
    """The failure in words, for people."""
    if isinstance(error, SpecViolation):
        return "\n".join(str(v) for v in error.violations)
    if isinstance(error, PolicyDifference):
        return str(error)
    return f"{type(error).__name__}: {error}"


@attrs.frozen
class Evidence:
    """What a known finding matches besides the fingerprint: the kinds of the failure's
    violations (``Violation.kind``), the sets of extra-key kinds they confused
    (``Violation.domains``), and a crash's exception text (the target's words, the only text
    matched)."""

    kinds: frozenset[str] = frozenset()
    crash: str = ""
    domains: frozenset[tuple[str, ...]] = frozenset()

    @classmethod
    def of(cls, violations: Iterable[Violation]) -> Evidence:
        """The kinds and confused domains ``violations`` show."""
        violations = list(violations)
        return cls(
            kinds=frozenset(v.kind for v in violations if v.kind),
            domains=frozenset(v.domains for v in violations if v.domains),
        )


def evidence_of(error: BaseException) -> Evidence:
    """The evidence of a failing example's exception: every kind its violations show, or the
    exception text of a crash (a policy difference has neither)."""
    if isinstance(error, SpecViolation):
        return Evidence.of(error.violations)
    if isinstance(error, PolicyDifference):
        return Evidence()
    return Evidence(crash=f"{type(error).__name__}: {error}")


# ------------------------------------------------------------------------ known findings

# Configuration features an entry may require: name -> the test on a Config.
FEATURES = {
    "window": lambda c: c.sliding_window is not None,
    "prefix_caching": lambda c: c.prefix_caching,
    "lookahead": lambda c: c.max_lookahead > 0,
    "swap": lambda c: c.num_cpu_blocks > 0,
}
# Features of a scheduler target's production shape (spec.groups.Shape) an entry may require:
# what its Config cannot say (which second group, which drafter, the budget against a padded
# decode).  Checked where the failure's shape is known (``shape_of``); a scheduler failure is
# always labelled with its shape by ``kvspec check`` and ``kvspec fuzz``.
SHAPE_FEATURES = {
    "mamba": lambda s: s.mamba,
    "sliding_window_group": lambda s: s.sliding_window is not None,
    "eagle": lambda s: s.eagle and s.num_spec_tokens > 0,
    "ngram": lambda s: not s.eagle and s.num_spec_tokens > 0,
    # The token budget cannot hold a decode padded to 1 + num_spec_tokens (0.30.0+ scheduler.py
    # pads a one-token admission to that, and otherwise leaves it waiting).
    "budget_below_padded_decode": lambda s: 0 < s.max_num_batched_tokens < 1 + s.num_spec_tokens,
}
_KEYS = {
    "id",
    "title",
    "invariant",
    "operation",
    "exception",
    "location",
    "kind",
    "message",
    "impl",
    "releases",
    "requires",
    "reach",
    "go_on",
    "after",
    "bisect",
    "alongside",
    "domains",
}


def _strings(entry: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = entry.get(key, [])
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise KnownFindingsError(f"{entry.get('id', '?')}: {key} must be a string or a list of them")
    return tuple(value)


def _domain_sets(entry: Mapping[str, Any]) -> tuple[tuple[str, ...], ...]:
    """An entry's ``domains``: one set of extra-key kinds (``["cache_salt", "lora"]``) or a list
    of such sets, each sorted as ``Violation.domains`` is."""
    value = entry.get("domains", [])
    sets = value if value and all(isinstance(v, list) for v in value) else [value]
    return tuple(tuple(sorted(_strings({"id": entry.get("id"), "domains": v}, "domains"))) for v in sets if v)


@attrs.frozen
class KnownFinding:
    """A narrow fingerprint of one FINDINGS.md entry.  Empty fields match anything; every
    entry names its invariant(s) and operation(s)."""

    id: str
    title: str
    invariant: tuple[str, ...]
    operation: tuple[str, ...]
    exception: tuple[str, ...] = ()
    location: tuple[str, ...] = ()  # substrings of the fingerprint's location
    kind: tuple[str, ...] = ()  # violation kinds (``Violation.kind``), one of which the failure shows
    # The extra-key kinds a violation between domains confused (``Violation.domains``, sorted),
    # one of which the failure shows: which keys collided, e.g. a LoRA name against a cache salt.
    domains: tuple[tuple[str, ...], ...] = ()
    message: tuple[str, ...] = ()  # a crash only: substrings, one of which its exception text contains
    impl: tuple[str, ...] = ()  # kvspec implementation names: legacy-v2, v1, ...
    releases: tuple[str, str] | None = None  # first and last release, inclusive
    requires: tuple[str, ...] = ()  # FEATURES the configuration, SHAPE_FEATURES the shape must have
    go_on: bool = False  # stepped past by going on with the example (state violations only)
    after: tuple[str, ...] = ()  # driver operations the trace must hold (up to the failing one)
    reach: str = ""  # kvspec check flags under which the ci budget reaches it, when the default does not
    # Invariants its own operation breaks with it (its consequences there, e.g. a failed
    # allocation not rolled back): part of this finding only beside one of its own invariants.
    alongside: tuple[str, ...] = ()
    # How ``releases`` was measured: the ``kvspec bisect`` run (the releases replayed, first bad,
    # first fixed), or why the range is where the finding was seen and not bisected.
    bisect: str = ""

    @classmethod
    def from_toml(cls, entry: Mapping[str, Any]) -> KnownFinding:
        unknown = set(entry) - _KEYS
        ident = entry.get("id")
        if not isinstance(ident, str) or not ident:
            raise KnownFindingsError(f"an entry has no id: {dict(entry)}")
        if unknown:
            raise KnownFindingsError(f"{ident}: unknown field(s) {sorted(unknown)}")
        invariant, operation = _strings(entry, "invariant"), _strings(entry, "operation")
        if not invariant or not operation:
            raise KnownFindingsError(f"{ident}: a known finding names its invariant and operation")
        releases = entry.get("releases")
        if releases is not None:
            if not (isinstance(releases, list) and len(releases) == 2):
                raise KnownFindingsError(f"{ident}: releases is [first, last]")
            try:
                release_key(releases[0]), release_key(releases[1])
            except (TypeError, ValueError, AttributeError) as err:
                raise KnownFindingsError(f"{ident}: releases {releases}: {err}") from None
        message = _strings(entry, "message")
        if message and set(invariant) != {CRASH}:
            raise KnownFindingsError(
                f"{ident}: message matches a crash's exception text; a violation is matched by its "
                f"kind (kind = [...], the Violation.kind its check gives)"
            )
        requires = _strings(entry, "requires")
        bad = set(requires) - set(FEATURES) - set(SHAPE_FEATURES)
        if bad:
            raise KnownFindingsError(
                f"{ident}: requires {sorted(bad)}; features: {sorted(FEATURES)}, shape features: "
                f"{sorted(SHAPE_FEATURES)}"
            )
        return cls(
            id=ident,
            title=str(entry.get("title", "")),
            invariant=invariant,
            operation=operation,
            exception=_strings(entry, "exception"),
            location=_strings(entry, "location"),
            kind=_strings(entry, "kind"),
            domains=_domain_sets(entry),
            message=message,
            impl=_strings(entry, "impl"),
            releases=tuple(releases) if releases is not None else None,  # type: ignore[arg-type]
            requires=requires,
            reach=str(entry.get("reach", "")),
            go_on=bool(entry.get("go_on", False)),
            after=_strings(entry, "after"),
            bisect=str(entry.get("bisect", "")),
            alongside=_strings(entry, "alongside"),
        )

    def cite(self) -> str:
        """How a report names this finding: its FINDINGS.md id, and its upstream write-up when
        docs/upstream/<id>.md exists."""
        doc = UPSTREAM_DOCS / f"{self.id}.md"
        where = f"FINDINGS.md; write-up: {doc}" if doc.is_file() else "FINDINGS.md"
        return f"known finding {self.id} ({where})"

    def concerns(self, impl: str, version: str | None) -> bool:
        """Whether this finding can occur on that implementation and release."""
        if self.impl and impl not in self.impl:
            return False
        if self.releases is None:
            return True
        if version is None:
            return False
        try:
            key = release_key(version)
        except (ValueError, AttributeError):
            return False
        return release_key(self.releases[0]) <= key <= release_key(self.releases[1])

    def matches(
        self,
        fp: Fingerprint,
        evidence: Evidence,
        config: Config | None,
        ops: Collection[str] | None = None,
        shape: Shape | None = None,
    ) -> bool:
        """Whether a failure is this finding; ``ops``: the operations of its trace (None: not
        known, ``after`` is not checked); ``shape``: the scheduler shape it ran in (None: not a
        scheduler failure, or not known: shape features are not checked)."""
        if fp.invariant not in self.invariant or fp.operation not in self.operation:
            return False
        if self.exception and fp.exception not in self.exception:
            return False
        if self.location and not any(part in fp.location for part in self.location):
            return False
        if self.kind and not any(k in evidence.kinds for k in self.kind):
            return False
        if self.domains and not any(d in evidence.domains for d in self.domains):
            return False
        if self.message and not any(part in evidence.crash for part in self.message):
            return False
        if config is not None and not all(FEATURES[f](config) for f in self.requires if f in FEATURES):
            return False
        if shape is not None and not all(SHAPE_FEATURES[f](shape) for f in self.requires if f in SHAPE_FEATURES):
            return False
        if ops is not None and not all(op in ops for op in self.after):
            return False
        return True


def load_known(paths: Iterable[Path]) -> list[KnownFinding]:
    """Every entry (``[[finding]]`` tables) of the files, in order; ids must be unique."""
    found: list[KnownFinding] = []
    for path in paths:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise KnownFindingsError(f"no such known-findings file: {path}") from None
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            raise KnownFindingsError(f"{path}: {err}") from None
        unknown = set(data) - {"finding"}
        if unknown:
            raise KnownFindingsError(f"{path}: unknown table(s) {sorted(unknown)}")
        entries = data.get("finding", [])
        if not isinstance(entries, list):
            raise KnownFindingsError(f"{path}: [[finding]] entries expected")
        found.extend(KnownFinding.from_toml(e) for e in entries)
    ids = [k.id for k in found]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise KnownFindingsError(f"known finding id(s) given twice: {', '.join(dupes)}")
    return found


def which_known(
    known: Iterable[KnownFinding],
    fp: Fingerprint,
    evidence: Evidence,
    config: Config | None,
    ops: Collection[str] | None = None,
    shape: Shape | None = None,
) -> KnownFinding | None:
    return next((k for k in known if k.matches(fp, evidence, config, ops, shape)), None)


def shape_of(driver: Any) -> Shape | None:
    """The production shape a driver's scheduler target runs (None: a block-manager driver)."""
    shape = getattr(getattr(driver, "target", None), "shape", None)
    return shape if isinstance(shape, Shape) else None


Labelled = tuple[Fingerprint, KnownFinding | None]
"""One failure of an example: its fingerprint, and the known finding it is (None: unknown)."""


def label_failures(
    known: Iterable[KnownFinding],
    error: BaseException,
    config: Config | None,
    trace: Sequence[TraceStep] = (),
    shape: Shape | None = None,
) -> list[Labelled]:
    """Every distinct failure ``error`` carries, each with the known finding it matches.

    A SpecViolation carries every invariant the operation violated: one fingerprint per
    invariant (in the order checked), each matched on the facts of that invariant's own violations, so a known
    finding met in an operation does not name (and hide) another invariant the same operation
    broke; a ``go_on`` finding with kinds names only its kinds' violations, and the rest of that
    invariant's violations are a second failure of the same fingerprint.  A target's exception
    is one failure."""
    known = list(known)
    if not isinstance(error, SpecViolation):
        steps = list(trace)
        fp = fingerprint(error, steps)
        return [(fp, which_known(known, fp, evidence_of(error), config, {s.op for s in steps}, shape))]
    steps = error.trace or list(trace)
    operation = steps[-1].op if steps else "teardown"
    ops = {s.op for s in steps}
    shown: dict[str, list[Violation]] = {}
    for violation in error.violations:
        shown.setdefault(violation.invariant, []).append(violation)
    labelled: list[Labelled] = []
    for invariant, violations in shown.items():
        fp = Fingerprint(invariant, operation)
        found = which_known(known, fp, Evidence.of(violations), config, ops, shape)
        labelled.append((fp, found))
        # A go_on finding that names its kinds is gone on past, so it names only the violations
        # of those kinds: the invariant's other violations (a double free beside V1-e's usage
        # figure) are a failure of their own, labelled on their own facts, never gone past as it.
        going_on = found is not None and found.go_on and found.kind
        strays = [v for v in violations if going_on and v.kind not in found.kind]  # type: ignore[union-attr]
        if strays:
            labelled.append((fp, which_known(known, fp, Evidence.of(strays), config, ops, shape)))
    # What a finding met in this operation declares it breaks alongside is that finding.
    met = [k for _, k in labelled if k is not None]
    labelled = [
        (fp, k if k is not None else next((m for m in met if fp.invariant in m.alongside), None))
        for fp, k in labelled
    ]
    return labelled or [(fingerprint(error, steps), None)]


def step_past_known(known: Iterable[KnownFinding], impl: str, version: str | None):
    """A machine's step-past policy over the known findings of ``impl`` on ``version``: an
    example whose every failure is one of them is gone on past when each of them is ``go_on``
    (a violation that leaves the target consistent) and discarded otherwise (what ``kvspec
    fuzz`` and the in-target tests do); None when no finding concerns that target."""
    mine = [k for k in known if k.concerns(impl, version)]
    if not mine:
        return None

    def policy(error: BaseException, driver: Any) -> bool | str:
        labelled = label_failures(mine, error, driver.config, driver.trace, shape_of(driver))
        found = [k for _, k in labelled]
        if any(k is None for k in found):
            return False
        # A finding that leaves the target consistent (go_on, e.g. V1-e, which shows at every
        # state of its releases) is gone on past, as ``kvspec check``'s Sieve does: discarding
        # the example would discard every example of those releases.  Never after a crash.
        if isinstance(error, SpecViolation) and all(k.go_on for k in found):
            return CONTINUE
        return True

    return policy


@attrs.define
class GoPast:
    """A re-run's step-past policy (``StepPast``: ``kvspec replay``, the straight-line
    reproducers): an operation whose every failure is a ``go_on`` known finding of the target
    other than the re-run's ``own`` (the finding its report is about) is gone past, as ``kvspec
    check`` and ``kvspec fuzz`` went past it, and counted in ``gone``; anything else ends the
    re-run.  Stricter than the search's Sieve, since a re-run must never claim a finding it
    did not meet: only a SpecViolation (never a crash), and each violation of an invariant a
    finding names shows one of the finding's kinds (a conservation violation of another kind
    beside V1-e's wrong usage is not V1-e)."""

    known: Sequence[KnownFinding]  # the target's known findings: they name the failures
    own: frozenset[str] = frozenset()  # never gone past
    gone: Counter[str] = attrs.Factory(Counter)  # known id -> checks gone past

    def judge(
        self, error: BaseException, config: Config | None, trace: Sequence[TraceStep], shape: Shape | None = None
    ) -> list[KnownFinding] | None:
        """The known findings ``error`` would be gone past as, or None when it ends the re-run."""
        if not isinstance(error, SpecViolation) or not error.violations:
            return None
        met: list[KnownFinding] = []
        for fp, k in label_failures(self.known, error, config, trace, shape):
            if k is None or not k.go_on or k.id in self.own:
                return None
            shown = [v for v in error.violations if v.invariant == fp.invariant]
            if k.kind and fp.invariant in k.invariant and any(v.kind not in k.kind for v in shown):
                return None
            met.append(k)
        return met

    def __call__(self, error: BaseException, driver: Any) -> bool | str:
        met = self.judge(error, driver.config, driver.trace, shape_of(driver))
        if met is None:
            return False
        for ident in dict.fromkeys(k.id for k in met):
            self.gone[ident] += 1
        return CONTINUE

    def others(
        self,
        violations: Sequence[Violation],
        config: Config | None,
        trace: Sequence[TraceStep],
        shape: Shape | None = None,
    ) -> list[Violation]:
        """``violations`` less those that, alone, would be gone past (what a reproducer checks)."""
        return [v for v in violations if self.judge(SpecViolation([v], list(trace)), config, trace, shape) is None]

    def describe(self) -> str:
        """The findings gone past, and how often: ``V1-e (3 checks)``."""
        return ", ".join(f"{ident} ({n} check{'s' if n != 1 else ''})" for ident, n in self.gone.items())


def own_findings(
    known: Iterable[KnownFinding],
    fp: Fingerprint | None,
    violations: Sequence[Violation],
    config: Config | None,
    trace: Sequence[TraceStep],
    shape: Shape | None = None,
    recorded: Iterable[str | None] = (),
) -> frozenset[str]:
    """The known findings a recorded failure is: the ids its run labelled it with (``recorded``),
    and those that each of its own violations (of the fingerprint's invariant) matches alone now,
    so that a report made with ``--no-known`` is its finding too."""
    own = {r for r in recorded if r}
    if fp is None or fp.invariant == CRASH:
        return frozenset(own)  # a crash is never gone past: its recorded label is enough
    known = list(known)
    ops = {s.op for s in trace}
    for v in violations:
        if v.invariant == fp.invariant:
            k = which_known(known, Fingerprint(v.invariant, fp.operation), Evidence.of([v]), config, ops, shape)
            if k is not None:
                own.add(k.id)
    return frozenset(own)


def go_past_known(
    known: Iterable[KnownFinding], impl: str, version: str | None, own: Iterable[str] = ()
) -> GoPast | None:
    """The re-run policy over the known findings of ``impl`` on ``version`` (``GoPast``); None
    when none of them is a ``go_on`` one other than ``own``."""
    mine = [k for k in known if k.concerns(impl, version)]
    own = frozenset(own)
    if not any(k.go_on and k.id not in own for k in mine):
        return None
    return GoPast(mine, own)
