"""Every distinct violation in one ``kvspec check``: rounds of the hypothesis search.

Hypothesis ends a search at its first failure and shrinks it (multi-bug mode stops looking 10 s
after the first bug, too soon for a real target).  So the search runs in rounds, each a full
``run_machine``: a round steps past (discards) every failure whose identity (the known finding
it matches, else its fingerprint: ``kvspec.testing.known``) an earlier round reported, and every
known finding; its first new
failure ends it, and while that one shrinks, failures of any other fingerprint are discarded
too, so each is shrunk on its own.  The rounds end when one runs its whole budget without a
new failure.  Then each known finding that fired is searched for once more with every other
known finding stepped past, so it is reported with its own shrunk trace and reproducer.

Behind the known findings: a known finding that fires is stepped past by discarding its
example, so a bug that needs the same configuration features (a window, prefix caching, swap,
lookahead slots) as a frequent known one is drowned by it; one that needs a rare combination
of features is met too seldom in a budget spread over every combination.  So once the
exploration rounds end, the rounds go on under *feature masks*: each mask switches off a
smallest set of features that leaves no fired known finding reachable (a minimal hitting set of
their ``requires``; findings stepped past by going on do not drown anything and are left out),
and switches every other feature on, so the whole budget of those rounds (``MASK_BUDGET`` times
the run's) goes to what lies behind them.  A known finding that has not fired and needs a
feature every such mask switches off (F1 needs the window, which every mask switches off once
F6, F7 or F8 fired: they need it too) then gets a mask that keeps its features on and switches every other one off:
it is searched beside the findings that share its features only.  What fires there makes new
masks, until none is left or ``MAX_MASKS`` ran.  A feature the user pinned is never masked.

A derandomized (or seeded) run repeats itself: each round replays the same example sequence,
with the discards earlier rounds added.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from hypothesis import settings as Settings
from hypothesis import strategies as st
from kvspec.spec.config import Config
from kvspec.testing import Features
from kvspec.testing.blockmanager.driver import Driver, SpecViolation
from kvspec.testing.blockmanager.machine import CONTINUE
from kvspec.testing.known import DIFFERS, FEATURES, Fingerprint, GoPast, KnownFinding, label_failures, shape_of
from rich.markup import escape
from rich.table import Table

from .budget import TimeBudget, budget_examples
from .common import out
from .failures import KVSPEC_ERROR
from .run import ON, Outcome, config_strategy, run_machine
from .target import Factory

RUN_FORMAT = "kvspec-run/1"
MAX_VIOLATIONS = 12  # distinct violations one run reports before it stops searching
RETRIES_PER_KNOWN = 3  # rounds spent re-finding one known finding (new bugs may come first)
MAX_MASKS = 6  # feature masks searched behind the known findings (each: rounds until nothing new)
# Examples of a masked round, in the run's budgets: what lies behind the known findings needs a
# combination of features and a narrow state (F12: 1 example in 100 with its features on).
MASK_BUDGET = 3
# "differs": the scheduler machine's target differs from its release's declared policy.
_FAILED = ("violated", "differs", "error", KVSPEC_ERROR)
TIME_SPENT = "stopped when the time budget was spent"

Mask = frozenset[str]
"""Configuration features (``kvspec.testing.known.FEATURES``) a round switches off."""
MaskedStrategy = Callable[[Mask], "st.SearchStrategy[Config]"]
"""The run's configuration strategy with the features of a mask switched off."""


# What switching a feature off, and on, pins (``--config`` overrides), and the overrides that
# pin it already (a feature the user pinned, on or off, is never masked).
MASK_OVERRIDES: dict[str, dict[str, Any]] = {
    "window": {"sliding_window": None},
    "prefix_caching": {"prefix_caching": False},
    "lookahead": {"max_lookahead": 0},
    "swap": {"num_cpu_blocks": 0},
}
UNMASKED_OVERRIDES: dict[str, dict[str, Any]] = {
    "window": {"sliding_window": ON},
    "prefix_caching": {"prefix_caching": True},
    "lookahead": {"max_lookahead": ON},
    "swap": {"swap": True},
}
PINNED_BY = {
    "window": ("sliding_window",),
    "prefix_caching": ("prefix_caching",),
    "lookahead": ("max_lookahead",),
    "swap": ("swap", "num_cpu_blocks"),
}


def masking(impl: str, overrides: Mapping[str, Any]) -> tuple[MaskedStrategy, tuple[str, ...]]:
    """The masked configuration strategy of a run with these ``--config`` overrides, and the
    features it may mask (those the overrides leave unpinned).  Under a mask, every maskable
    feature it leaves is pinned on: the exploration rounds drew the combinations with it off,
    and a bug that needs several features at once gets the whole budget of the round."""
    maskable = tuple(f for f in FEATURES if not any(key in overrides for key in PINNED_BY[f]))

    def masked(mask: Mask) -> st.SearchStrategy[Config]:
        pins: dict[str, Any] = {}
        for feature in maskable:
            pins.update((MASK_OVERRIDES if feature in mask else UNMASKED_OVERRIDES)[feature])
        return config_strategy(impl, {**pins, **overrides})

    return masked, maskable


def masks_behind(known: Sequence[KnownFinding], fired: Mapping[str, int], maskable: Sequence[str]) -> list[Mask]:
    """Every smallest set of ``maskable`` features whose absence leaves none of the fired known
    findings reachable (a minimal hitting set of their ``requires``), smallest first.  Findings
    stepped past by going on drown nothing; one that needs no maskable feature cannot be masked
    (and then no mask is returned only if nothing else fired).  Then, for each known finding
    that has not fired and that every such mask leaves unreachable, the mask of every maskable
    feature it does not need (its features kept on), in the order of ``known``."""
    needs = [
        frozenset(k.requires) & frozenset(maskable)
        for k in known
        if fired.get(k.id) and not k.go_on
    ]
    needs = [n for n in needs if n]
    if not needs:
        return []
    found: list[Mask] = []
    for size in range(1, len(maskable) + 1):
        for combo in itertools.combinations(sorted(maskable), size):
            mask = frozenset(combo)
            if all(n & mask for n in needs) and not any(m <= mask for m in found):
                found.append(mask)
    # A finding that has not fired and needs a feature every mask above switches off is
    # reachable only where the fired ones drown it: a mask that keeps its features on and
    # switches every other one off gives it the round to itself and the findings that share
    # those features, and none of the findings that need the others.
    everything = frozenset(maskable)
    for k in known:
        keep = frozenset(k.requires) & everything
        if fired.get(k.id) or not keep or not all(m & keep for m in found):
            continue
        mask = everything - keep
        if mask and mask not in found:
            found.append(mask)
    return found


Identity = Fingerprint | str
"""What makes failures one bug: the id of the known finding they match, else their fingerprint."""


@attrs.define
class Sieve:
    """The step-past policy of one round (``KVCacheMachine(step_past=...)``)."""

    reported: frozenset[Identity]
    known: Sequence[KnownFinding]  # every known finding of the target: they name failures
    stepped: frozenset[str]  # the known findings this round steps past
    target: Identity | None = None  # the round's new failure, once seen
    last: Fingerprint | None = None  # the fingerprint of the last failure let through
    fired: Counter[str] = attrs.Factory(Counter)  # known id -> examples stepped past
    repeats: int = 0  # examples stepped past on an already reported identity

    def __call__(self, error: BaseException, driver: Driver) -> bool | str:
        """Every failure the operation shows is judged: the known findings this round steps
        past are counted and stepped past (by going on only if every one of them is ``go_on``
        and nothing else broke); any other failure ends the example, and the first one not
        reported yet is the round's target."""
        labelled = label_failures(self.known, error, driver.config, driver.trace, shape_of(driver))
        stepped = [k for _, k in labelled if k is not None and k.id in self.stepped]
        others = [(fp, k) for fp, k in labelled if k is None or k.id not in self.stepped]
        # Going on is for violations that leave the target consistent: never after a crash.
        past = CONTINUE if isinstance(error, SpecViolation) and all(k.go_on for k in stepped) else True
        if self.target is not None:
            # Shrinking the round's failure: the examples hypothesis replays meet the known
            # findings as the search did, and every other failure is discarded.
            hit = next((fp for fp, k in others if _identity(fp, k) == self.target), None)
            if hit is not None:
                self.last = hit
                return False
            return past if not others else True
        for ident in dict.fromkeys(k.id for k in stepped):
            self.fired[ident] += 1
        if not others:
            return past
        fresh = next(((fp, k) for fp, k in others if _identity(fp, k) not in self.reported), None)
        if fresh is None:
            self.repeats += 1
            return True
        self.target, self.last = _identity(*fresh), fresh[0]
        return False

    def go_past(self) -> GoPast:
        """What a re-run of this round's traces goes past (naming a nondeterministic target's
        step, cli/failures.py): the go_on findings the round steps past, and nothing else."""
        return GoPast(self.known, frozenset(k.id for k in self.known if k.id not in self.stepped))


def _identity(fp: Fingerprint, known: KnownFinding | None) -> Identity:
    return known.id if known is not None else fp


@attrs.define
class Found:
    """One distinct violation (or target crash), shrunk by its own round."""

    fingerprint: Fingerprint
    outcome: Outcome
    known: KnownFinding | None = None

    @property
    def identity(self) -> Identity:
        return self.known.id if self.known is not None else self.fingerprint


@attrs.define
class Search:
    found: list[Found]
    rounds: list[Outcome]
    fired: Counter[str]  # known id -> examples stepped past during the exploration
    known: Sequence[KnownFinding]  # the known findings that concern this target
    missed: list[str] = attrs.Factory(list)  # known ids that fired but were not re-found
    stopped: str | None = None  # why the rounds ended early (cap, interrupt, no examples)
    masks: list[Mask] = attrs.Factory(list)  # the feature masks searched, in order
    round_masks: list[Mask] = attrs.Factory(list)  # per round: the features it switched off
    fired_under: dict[str, Mask] = attrs.Factory(dict)  # known id -> the mask it first fired under

    @property
    def last(self) -> Outcome:
        return self.rounds[-1]

    @property
    def examples(self) -> int:
        return sum(o.tally.examples for o in self.rounds)

    @property
    def operations(self) -> int:
        return sum(o.tally.operations for o in self.rounds)


RoundRunner = Callable[["Sieve", Mask, str], Any]
"""One round of a machine's search under a step-past policy, a feature mask and a label; its
outcome (``Outcome``, or the scheduler machine's ``ShapesOutcome``: anything with a ``status``)."""


def run_search(
    factory: Factory,
    strategy: st.SearchStrategy[Config],
    *,
    profile: str,
    examples: int | None,
    steps: int | None,
    seed: int | None,
    focus: tuple[str, ...] | None,
    label: str,
    features: Features | None = None,
    known: Sequence[KnownFinding] = (),
    report_known: bool = True,
    max_violations: int = MAX_VIOLATIONS,
    masked: MaskedStrategy | None = None,
    maskable: Sequence[str] = tuple(FEATURES),
    max_masks: int = MAX_MASKS,
    budget: TimeBudget | None = None,
) -> Search:
    """The block-manager machine's search: rounds of ``run_machine`` (``search_rounds``), under
    feature masks behind the known findings that fired (``masked``: the strategy with a mask's
    features off; None searches no masks); ``budget``: each round gets its share of the time
    (cli/budget.py) and none starts once the search's time is spent."""
    seed = search_seed(profile, seed)
    strategies: dict[Mask, st.SearchStrategy[Config]] = {frozenset(): strategy}

    def one_round(sieve: Sieve, mask: Mask, tag: str) -> Outcome:
        if mask not in strategies:
            assert masked is not None
            strategies[mask] = masked(mask)
        where = f" without {'+'.join(sorted(mask))}" if mask else ""
        count = examples if examples is not None else Settings.get_profile(profile).max_examples
        part = budget.round(f"{tag}{where}", more_to_come=bool(known)) if budget is not None else None
        return run_machine(
            factory,
            strategies[mask],
            profile=profile,
            examples=budget_examples(count * MASK_BUDGET if mask else examples, budget),
            steps=steps,
            seed=seed,
            focus=focus,
            label=f"{label} {tag}{where}",
            features=features,
            step_past=sieve,
            part=part,
        )

    return search_rounds(
        one_round,
        known,
        report_known=report_known,
        max_violations=max_violations,
        masks=(lambda fired: masks_behind(known, fired, maskable)) if masked is not None else None,
        max_masks=max_masks,
        spent=budget.search_spent if budget is not None else None,
    )


def search_seed(profile: str, seed: int | None) -> int | None:
    """The seed every round of a search runs with: one seed, so each round replays the same
    example sequence (and it is recorded); None only under a derandomized profile."""
    if seed is None and not Settings.get_profile(profile).derandomize:
        seed = random.SystemRandom().randrange(2**32)
    return seed


def search_rounds(
    run_round: RoundRunner,
    known: Sequence[KnownFinding],
    *,
    report_known: bool = True,
    max_violations: int = MAX_VIOLATIONS,
    masks: Callable[[Counter[str]], list[Mask]] | None = None,
    max_masks: int = MAX_MASKS,
    spent: Callable[[], bool] | None = None,
    reported: Collection[Identity] = (),
    hunt: Collection[str] = (),
    on_found: Callable[[Found], None] | None = None,
) -> Search:
    """Rounds of ``run_round`` until a round finds nothing new, then the same behind the known
    findings that fired, under the feature masks ``masks`` names for them (None: none), then
    each fired known finding once more (module docstring).  Any machine's search; ``spent``:
    whether its time budget is spent (then no further round starts; the first always runs).

    A campaign's searches (cli/fuzz.py) pass what earlier searches ``reported`` (identities:
    stepped past as repeats, never reported again; a ``go_on`` known finding by going on, as
    exploring steps past it) and the known findings to ``hunt``: ids not
    stepped past while exploring, so that a known finding ends the round that first meets it
    and is shrunk there, labelled by its id, instead of being stepped past and searched for
    again (which a rare finding would not survive); ``on_found`` is called with each verdict as
    its round ends (a campaign reports it then, not when the whole search has ended)."""
    search = Search([], [], Counter(), known)
    earlier = frozenset(reported)
    exploring = [k for k in known if k.id not in hunt]

    def one_round(stepped_past: Sequence[KnownFinding], tag: str, mask: Mask) -> tuple[Any, Sieve]:
        reported = earlier | frozenset(f.identity for f in search.found)
        # A go_on finding reported already (a hunted one, by an earlier round or search) is
        # stepped past by going on, as exploring steps past it: as a repeat it would discard
        # every example it shows in, and V1-e shows at every state of its releases.
        again = [k for k in known if k.go_on and k.id in reported]
        sieve = Sieve(reported, known, frozenset(k.id for k in [*stepped_past, *again]))
        outcome = run_round(sieve, mask, tag)
        search.rounds.append(outcome)
        search.round_masks.append(mask)
        if outcome.status in _FAILED and sieve.last is not None:
            hit = next((k for k in known if k.id == sieve.target), None)
            search.found.append(Found(sieve.last, outcome, hit))
            if on_found is not None:
                on_found(search.found[-1])
        return outcome, sieve

    def explore(mask: Mask) -> str | None:
        """Rounds under one mask until one finds nothing new; why the search must stop, if so."""
        while True:
            if len(search.found) >= max_violations:
                return f"stopped at {max_violations} distinct violations"
            if spent is not None and search.rounds and spent():
                return TIME_SPENT
            outcome, sieve = one_round(exploring, f"round {len(search.rounds) + 1}", mask)
            if outcome.status == KVSPEC_ERROR:
                return KVSPEC_ERROR  # nothing kvspec finds after its own failure is trusted
            if outcome.status not in _FAILED or sieve.target is None:
                break
        # The last round ran the whole budget: it met everything the earlier ones did.
        for ident, n in sieve.fired.items():
            search.fired[ident] += n
            search.fired_under.setdefault(ident, mask)
        if outcome.status in ("holds", "incomplete") or (mask and outcome.status == "no-examples"):
            return None  # (a mask that leaves the target no configuration it runs: the next mask)
        return outcome.status

    # Exploration: known findings stepped past, every new fingerprint reported; then behind
    # the known findings that fired, one feature mask at a time.
    search.masks.append(frozenset())
    search.stopped = explore(frozenset())
    while search.stopped is None and masks is not None:
        todo = [m for m in masks(search.fired) if m not in search.masks]
        if not todo or len(search.masks) > max_masks:
            break
        search.masks.append(todo[0])
        search.stopped = explore(todo[0])
    if search.stopped is not None or not report_known:
        return search
    # Each known finding that fired, found again and shrunk with the others stepped past,
    # under the mask where it fired first.
    # (not one this search reported already: a hunted go_on finding fires once it is reported)
    refind = [k.id for k in known if search.fired[k.id] and k.id not in earlier and not _reported(search, k.id)]
    for ident in refind:
        others = [k for k in known if k.id != ident]
        for attempt in range(RETRIES_PER_KNOWN):
            if len(search.found) >= max_violations:
                search.stopped = f"stopped at {max_violations} distinct violations"
                return search
            if spent is not None and spent():
                search.stopped = TIME_SPENT
                return search
            outcome, sieve = one_round(others, f"{ident} ({attempt + 1})", search.fired_under[ident])
            if outcome.status in ("interrupted", "no-examples"):
                search.stopped = outcome.status
                return search
            if sieve.target is None or _reported(search, ident):
                break
        if not _reported(search, ident):
            search.missed.append(ident)
    return search


def _reported(search: Search, ident: str) -> bool:
    return any(f.known is not None and f.known.id == ident for f in search.found)


# ------------------------------------------------------------------------------ reporting


def aggregate(search: Search) -> Outcome:
    """One Outcome summing the rounds: the invariants table's input."""
    last = search.last
    tally = attrs.evolve(
        last.tally,
        examples=search.examples,
        operations=search.operations,
        shrink_runs=sum(o.tally.shrink_runs for o in search.rounds),
        per_invariant={
            inv: [sum(o.tally.per_invariant.get(inv, [0, 0])[i] for o in search.rounds) for i in (0, 1)]
            for inv in last.tally.per_invariant
        },
    )
    violations = [v for f in search.found for v in f.outcome.violations]
    status = "violated" if search.found else last.status
    return attrs.evolve(
        last,
        status=status,
        tally=tally,
        violations=violations,
        seconds=sum(o.seconds for o in search.rounds),
    )


def found_json(found: Found) -> dict[str, Any]:
    return {
        "fingerprint": found.fingerprint.to_json(),
        "known_finding": found.known.id if found.known is not None else None,
    }


def print_found(
    search: Search,
    setting: Callable[[Found], str] | None = None,
    title: str = "Distinct violations",
) -> None:
    """The distinct violations of a search, one row each; ``setting``: the configuration (or
    the scheduler's shape) a violation was found in (default: the outcome's configuration)."""
    table = Table(title=title, title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("invariant", no_wrap=True)
    table.add_column("operation", no_wrap=True)
    table.add_column("crash site / compared", overflow="fold")
    table.add_column("known", no_wrap=True)
    table.add_column("trace", justify="right")
    table.add_column("configuration", overflow="fold")
    for n, f in enumerate(search.found, 1):
        fp = f.fingerprint
        site = f"{fp.exception} at {fp.location}" if fp.exception else "-"
        if fp.invariant == DIFFERS:  # what a policy difference compared, and under which policy
            site = f"{fp.exception} (policy {fp.location})"
        if setting is not None:
            config = setting(f)
        else:
            config = f.outcome.config.describe() if f.outcome.config is not None else "-"
        known = f.known.id if f.known is not None else "[bold]new[/]"
        table.add_row(
            str(n), fp.invariant, fp.operation, escape(site), known, str(len(f.outcome.trace)), config
        )
    out.print(table)
    rounds = len(search.rounds)
    out.print(
        f"{len(search.found)} distinct violation(s) in {rounds} search round(s); each round repeats "
        "the search, stepping past what earlier rounds found"
        + (f"; {search.stopped}" if search.stopped else ""),
        markup=False,
    )


def print_known(search: Search) -> None:
    """How often each known finding of this target fired, and whether it was reported."""
    if not search.known:
        return
    table = Table(title="Known findings of this target (stepped past while exploring)", title_justify="left")
    table.add_column("id", no_wrap=True)
    table.add_column("fired", justify="right")
    table.add_column("reported", overflow="fold", max_width=40)
    table.add_column("finding", overflow="fold", max_width=70)
    for k in search.known:
        n = next((i for i, f in enumerate(search.found, 1) if f.known is not None and f.known.id == k.id), None)
        if n is not None:
            shown = f"#{n}"
        elif k.id in search.missed:
            shown = "[yellow]not re-found[/]"
        elif search.fired[k.id]:
            shown = "counted only"
        elif k.reach:
            shown = f"[dim]not reached[/] (reached with {escape(k.reach)})"
        else:
            shown = "[dim]not reached[/]"
        table.add_row(k.id, str(search.fired[k.id]), shown, escape(k.title))
    out.print(table)
    out.print(
        "fired: examples of the last exploration round under each feature mask that met the finding "
        "and were discarded (--no-known reports them as new; --known FILE adds fingerprints)",
        markup=False,
    )
    if len(search.masks) > 1:
        behind = ", ".join("without " + "+".join(sorted(m)) for m in search.masks if m)
        out.print(f"searched behind the known findings that fired: {behind}", markup=False)
    for k in search.known:
        if not search.fired[k.id] and k.reach:
            out.print(f"not met in this run: {k.id}; its budget: kvspec check {k.reach}", markup=False, soft_wrap=True)


def summary_json(search: Search, entries: list[dict[str, Any]], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The run's index (docs/report-format.md, ``kvspec-run/1``): one entry per violation."""
    last = search.last
    return {
        "format": RUN_FORMAT,
        "violations": entries,
        "rounds": [
            {"status": o.status, "examples_run": o.tally.examples, "operations_run": o.tally.operations,
             "seconds": round(o.seconds, 2), "without": sorted(m)}
            for o, m in zip(search.rounds, search.round_masks, strict=True)
        ],
        "known_findings": {
            k.id: {"fired": search.fired[k.id], "missed": k.id in search.missed, "reach": k.reach or None}
            for k in search.known
        },
        "masks": [sorted(m) for m in search.masks],
        "stopped": search.stopped,
        "run": last.run_json(overrides),
    }


def run_index(out_dir: Path) -> list[dict[str, Any]]:
    """The violations a run wrote into ``out_dir`` (its ``summary.json``), in the order found;
    a run that wrote a single report (no distinct violation) gives that one."""
    summary = out_dir / "summary.json"
    if summary.exists():
        return list(json.loads(summary.read_text(encoding="utf-8"))["violations"])
    single = out_dir / "report.json"
    return [{"report": str(single), "fingerprint": None, "known_finding": None}] if single.exists() else []
