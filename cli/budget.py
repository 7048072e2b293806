"""``--time-budget SECONDS``: a check's effort given as wall time, spread over its parts.

``kvspec check`` runs rounds of the block-manager search (cli/search.py) and, on a V1 target,
vLLM's scheduler in production shapes (cli/shapes.py).  Under a time budget the examples are
not counted in advance: each part gets a deadline, and an example not yet started when its
part's deadline has passed is not started.  The split:

* the scheduler shapes, when the run has them, get ``SHAPES_SHARE`` of the budget, plus
  whatever the search left;
* each search round gets ``ROUND_SHARE`` of what is left of the search's time (a round that
  finds a new failure ends early and leaves its time to the next), so exploration, the
  feature masks and the re-found known findings each get a part; on a target with no known
  findings nothing follows the exploration, so its rounds get all that is left; the search
  stops starting rounds when less than ``MIN_ROUND_SECONDS`` is left.

Two things are never cut: the first example of a part (a part that ran nothing would be a run
that claims nothing), and the shrinking of a failure already found (the counterexample is the
result), with kvspec's cut after it (testing/artifacts/minimize.py, at most ``SECONDS`` per
violation or crash, spent before the shapes' part begins).  So a run ends after its budget by at most
one example per part plus the shrinking and the cut.

How an example is not started: the machine's constructor raises ``BudgetSpent``.  Hypothesis
ends a run at once, without retrying or shrinking, only on ``KeyboardInterrupt`` (every other
exception is a failure it replays), so ``BudgetSpent`` is one; the runners catch it before
they would treat it as an interrupt.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any

import attrs

SHAPES_SHARE = 0.4  # today's default check spends about 40 % of its search time in the shapes
ROUND_SHARE = 0.5
MIN_ROUND_SECONDS = 0.5
# Examples a part may run under a time budget: more than any budget reaches, so time decides.
UNBOUNDED_EXAMPLES = 10**7


TIME_BUDGET_HELP = (
    "spend about this many seconds searching (the search rounds, then the scheduler shapes; "
    "not the start-up and vLLM's import): no example starts after its part's deadline, and the "
    "run reports what each part got. With --examples, whichever ends first"
)


class BudgetSpent(KeyboardInterrupt):
    """The part's time is up: hypothesis ends the run without replaying (module docstring)."""


@attrs.define
class Part:
    """One part of a budgeted run: a search round or the scheduler shapes."""

    name: str
    allotted: float  # seconds
    deadline: float  # time.monotonic()
    started: float = attrs.field(factory=time.monotonic)
    seconds: float = 0.0
    examples: int = 0
    failing: bool = False  # an example failed: the shrinking that follows is not cut
    cut: bool = False  # the deadline stopped it
    by_tag: Counter[str] = attrs.Factory(Counter)  # shape tag -> seconds of its examples
    examples_by_tag: Counter[str] = attrs.Factory(Counter)
    _example_start: float = 0.0

    def start_example(self) -> None:
        """Called as a machine is built: refuse the example when the deadline has passed
        (never the part's first example, never while a failure is shrinking)."""
        if self.examples and not self.failing and time.monotonic() > self.deadline:
            self.cut = True
            raise BudgetSpent(self.name)
        self.examples += 1
        self._example_start = time.monotonic()

    def past_deadline(self) -> bool:
        return time.monotonic() > self.deadline

    def watch(self, step_past: Any) -> None:
        """The step-past policy of the round about to run (cli/search.py ``Sieve``): a campaign's
        part reads the failure it is shrinking (cli/fuzz_scheduler.py ``CampaignPart``)."""

    def next_round(self) -> None:
        """A part run as several search rounds (the scheduler's): a failure shrunk by an
        earlier round no longer exempts this round's examples from the deadline."""
        self.failing = False

    def example_ended(self, tags: tuple[str, ...] = ()) -> None:
        """Called from a machine's teardown: the example's seconds go to each of its tags
        (an example of several shapes counts in each); an exception in flight that is not
        hypothesis' own control flow is a failure, whose shrinking is then never cut."""
        took = time.monotonic() - self._example_start
        for tag in tags:
            self.by_tag[tag] += took
            self.examples_by_tag[tag] += 1
        raised = sys.exc_info()[1]
        if isinstance(raised, Exception) and type(raised).__module__.split(".")[0] != "hypothesis":
            self.failing = True

    def excuses(self, requested: int) -> bool:
        """Whether running fewer than ``requested`` examples is this part's doing: its deadline
        cut it, or it had no example count (time decides; a search space hypothesis exhausted
        before the deadline ran whole)."""
        return self.cut or requested >= UNBOUNDED_EXAMPLES

    def close(self) -> None:
        self.seconds = time.monotonic() - self.started

    def to_json(self) -> dict[str, Any]:
        return {
            "part": self.name,
            "allotted_seconds": round(self.allotted, 2),
            "seconds": round(self.seconds, 2),
            "examples_started": self.examples,
            "cut_by_deadline": self.cut,
            "per_shape": {t: [self.examples_by_tag[t], round(self.by_tag[t], 2)] for t in sorted(self.by_tag)},
        }


@attrs.define
class TimeBudget:
    """The seconds of one run and how its parts spent them."""

    seconds: float
    shapes: bool = False  # the run has a scheduler-shapes part after the search
    started: float = attrs.field(factory=time.monotonic)
    parts: list[Part] = attrs.Factory(list)

    def _end(self) -> float:
        return self.started + self.seconds

    def search_end(self) -> float:
        return self._end() - (self.seconds * SHAPES_SHARE if self.shapes else 0.0)

    def search_left(self) -> float:
        return max(0.0, self.search_end() - time.monotonic())

    def search_spent(self) -> bool:
        return self.search_left() < MIN_ROUND_SECONDS

    def round(self, name: str, *, more_to_come: bool) -> Part:
        """A search round: ``ROUND_SHARE`` of the search's time left, or all of it when no
        further round can follow (``more_to_come``: the target has known findings, whose
        masks and re-finding rounds follow the exploration)."""
        allotted = self.search_left() * (ROUND_SHARE if more_to_come else 1.0)
        return self._add(name, allotted)

    def rest(self, name: str) -> Part:
        """The last part (the scheduler shapes): everything left."""
        return self._add(name, max(0.0, self._end() - time.monotonic()))

    def _add(self, name: str, allotted: float) -> Part:
        now = time.monotonic()
        part = Part(name, allotted, now + allotted, started=now)
        self.parts.append(part)
        return part

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "spent": round(time.monotonic() - self.started, 2),
            "parts": [p.to_json() for p in self.parts],
        }

    def lines(self) -> list[str]:
        """One line per part: what it was given and what it got."""
        out = [f"time budget {self.seconds:g} s, spent {time.monotonic() - self.started:.1f} s:"]
        for p in self.parts:
            why = (
                "at its deadline" if p.cut
                else "after its deadline, shrinking a failure" if p.failing and p.seconds > p.allotted
                else "before its deadline"
            )
            out.append(
                f"  {p.name:<36} given {p.allotted:6.1f} s, took {p.seconds:6.1f} s, "
                f"{p.examples:>6} examples started; ended {why}"
            )
            for tag in sorted(p.by_tag, key=lambda t: -p.by_tag[t]):
                out.append(f"    {tag:<34} {p.examples_by_tag[tag]:>6} examples {p.by_tag[tag]:7.1f} s")
        return out


def budget_examples(examples: int | None, budget: TimeBudget | Part | None) -> int | None:
    """A part's example cap: ``--examples`` when given, else unbounded under a time budget."""
    if budget is None or examples is not None:
        return examples
    return UNBOUNDED_EXAMPLES
