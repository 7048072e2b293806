"""Running the stateful machine for ``kvspec check``: settings, live progress, results.

The machine is ``kvspec.testing.KVCacheMachine`` subclassed only to report progress (each
operation through the driver's log hook, each finished example in ``teardown``); the rules,
the checks and the shrinking are the library's.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.errors import FailedHealthCheck, Flaky, HypothesisException, Unsatisfiable
from hypothesis.reporting import with_reporter
from hypothesis.stateful import initialize
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError, Unsupported
from kvspec.spec.invariants import INVARIANTS, Violation
from kvspec.testing import Features, KVCacheMachine, RunStats, SpecViolation, TraceStep
from kvspec.testing import profiles as _profiles  # registers the ci/dev/deep profiles
from kvspec.testing.artifacts.rerun import Difference
from kvspec.testing.blockmanager.machine import StepPast
from kvspec.testing.blockmanager.strategies import configs
from kvspec.testing.guard import Crash, GuardTripped, raised_in_kvspec
from kvspec.testing.implementations import BROKEN_PREFIX, lookup
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from .budget import BudgetSpent, Part
from .common import UsageError, err
from .failures import KVSPEC_ERROR, fill_failure
from .target import Factory

PROFILES = _profiles.PROFILES

# ------------------------------------------------------------------------------ configuration

_BOOL = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}
_ALIASES = {
    "window": "sliding_window",
    "caching": "prefix_caching",
    "lookahead": "max_lookahead",
    "cpu_blocks": "num_cpu_blocks",
    "blocks": "num_blocks",
    "pool": "num_blocks",
    "chunked": "chunked_prefill",
}
FIELDS = tuple(f.name for f in attrs.fields(Config))
FEATURE_FIELDS = tuple(f.name for f in attrs.fields(Features))
KEYS = FIELDS + FEATURE_FIELDS
ON = "on"  # a feature pinned on whose size is still drawn (window, lookahead)
_OFF = ("none", "off", "null", "no", "false", "")
CONFIG_HELP = (
    "pin a configuration field or scheduler feature (repeatable): block_size=N, "
    "num_blocks=N (pool), num_cpu_blocks=N, sliding_window=N|on|off (window), "
    "max_lookahead=N|on|off (lookahead), prefix_caching=on|off (caching), "
    "chunked_prefill=on|off, swap=on|off (swap preemption; the CPU pool is num_cpu_blocks), "
    "fork=on|off. Unpinned: drawn per example; features on wherever the target supports them"
)


def _boolean(key: str, value: str) -> bool:
    if value.lower() not in _BOOL:
        raise UsageError(f"--config {key}={value}: not a boolean", "use on or off")
    return _BOOL[value.lower()]


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``--config key=value`` pairs, each value validated the way Config validates it.  A
    window or lookahead pinned ``on`` is kept as ``ON`` (drawn, never absent)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = _ALIASES.get(key.strip().replace("-", "_"), key.strip().replace("-", "_"))
        value = value.strip()
        if not sep or not key:
            raise UsageError(f"--config {item!r} is not key=value", f"keys: {', '.join(KEYS)}")
        if key not in KEYS:
            raise UsageError(f"--config {key}: no such configuration field", f"keys: {', '.join(KEYS)}")
        if key == "prefix_caching" or key in FEATURE_FIELDS:
            out[key] = _boolean(key, value)
        elif key in ("sliding_window", "max_lookahead") and value.lower() in _OFF:
            out[key] = None if key == "sliding_window" else 0
        elif key in ("sliding_window", "max_lookahead") and value.lower() in ("on", "yes", "true"):
            out[key] = ON
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise UsageError(f"--config {key}={value}: not an integer", f"e.g. --config {key}=4") from None
    if out.get("swap") and out.get("num_cpu_blocks") == 0:
        raise UsageError("--config swap=on with num_cpu_blocks=0: nothing to swap into", "drop one of them")
    try:
        Config(**{"block_size": 4, "num_blocks": 8, **config_pins(out)})
    except ConfigError as error:
        raise UsageError(
            f"invalid configuration: {error}",
            "block_size, num_blocks and sliding_window must be >= 1",
        ) from None
    return out


def config_pins(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The Config fields pinned to one value."""
    return {k: v for k, v in overrides.items() if k in FIELDS and v != ON}


def features_from(overrides: Mapping[str, Any]) -> Features:
    return Features(**{k: v for k, v in overrides.items() if k in FEATURE_FIELDS})


def config_strategy(impl: str, overrides: Mapping[str, Any]) -> st.SearchStrategy[Config]:
    """The library's configuration strategy, with the overridden fields pinned."""
    kw: dict[str, Any] = {}
    needs: dict = {}
    if impl.startswith(BROKEN_PREFIX):
        # Small pools and blocks: a deliberately broken variant shows within a few blocks.
        needs = dict(lookup(impl).needs)
        kw.update(block_sizes=st.sampled_from([1, 2, 3, 4]), max_blocks=8)
    if "block_size" in overrides:
        kw["block_sizes"] = st.just(overrides["block_size"])
    if "prefix_caching" in overrides:
        kw["prefix_caching"] = st.just(overrides["prefix_caching"])
    elif needs.get("prefix_caching"):
        kw["prefix_caching"] = st.just(True)
    if "sliding_window" in overrides and overrides["sliding_window"] is None:
        kw["sliding_window"] = False
    if overrides.get("sliding_window") == ON:
        kw["require_window"] = True
    if "num_cpu_blocks" in overrides:
        kw["swap"] = overrides["num_cpu_blocks"] > 0
    elif overrides.get("swap"):
        kw["min_cpu_blocks"] = 1
    if overrides.get("max_lookahead") == ON:
        kw["min_lookahead"] = 1
    elif "max_lookahead" in overrides:
        kw["max_lookahead"] = overrides["max_lookahead"]
    if "num_blocks" in overrides:
        kw["max_blocks"] = overrides["num_blocks"]
    strategy = configs(**kw)
    if needs.get("window") and "sliding_window" not in overrides:
        strategy = strategy.filter(lambda c: c.sliding_window is not None)
    pinned = config_pins(overrides)
    if pinned:
        strategy = strategy.map(lambda c: attrs.evolve(c, **pinned))
    return strategy


# ------------------------------------------------------------------------------ the run


@attrs.define
class Tally:
    """What ran, per invariant, during the search (shrinking runs are counted apart)."""

    examples: int = 0
    operations: int = 0
    shrink_runs: int = 0
    failing_runs: int = 0
    per_invariant: dict[str, list[int]] = attrs.Factory(dict)  # id -> [examples, operations]
    rejected: list[str] = attrs.Factory(list)
    inapplicable: dict[str, str] = attrs.Factory(dict)  # id -> why it said nothing (last seen)
    last_config: Config | None = None
    last_trace: list[TraceStep] = attrs.Factory(list)


@attrs.define
class Outcome:
    status: str  # holds | violated | error | kvspec-error | no-examples | incomplete | interrupted
    tally: Tally
    stats: RunStats
    requested: int
    steps: int
    seed: int | None
    profile: str
    focus: tuple[str, ...] | None
    seconds: float
    violations: list[Violation] = attrs.Factory(list)
    trace: list[TraceStep] = attrs.Factory(list)
    config: Config | None = None
    error: str | None = None
    # A crash, hang, memory runaway or nondeterminism (cli/failures.py fills these in).
    exception: BaseException | None = None
    crash: Crash | None = None
    traceback: list[str] = attrs.Factory(list)
    difference: Difference | None = None
    implementation_name: str | None = None
    # What kvspec's trace minimizer cut after hypothesis' shrinking (testing/artifacts/minimize.py).
    minimized: str | None = None

    def run_json(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "seed": self.seed,
            "derandomized": self.seed is None,
            "max_examples": self.requested,
            "steps_per_example": self.steps,
            "examples_run": self.tally.examples,
            "operations_run": self.tally.operations,
            "shrink_runs": self.tally.shrink_runs,
            "minimized": self.minimized,
            "seconds": round(self.seconds, 2),
            "focus": list(self.focus) if self.focus else None,
            "config_overrides": dict(overrides),
        }


def run_machine(
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
    step_past: StepPast | None = None,
    part: Part | None = None,
) -> Outcome:
    """One hypothesis search; ``step_past`` may discard failing examples (cli/search.py runs
    rounds of these to report every distinct violation); ``part``: its share of a time budget
    (cli/budget.py), after whose deadline no new example starts."""
    features = features if features is not None else Features()
    base = Settings.get_profile(profile)
    requested = examples if examples is not None else base.max_examples
    step_count = steps if steps is not None else base.stateful_step_count
    if seed is None and not base.derandomize:
        seed = random.SystemRandom().randrange(2**32)  # recorded, so the run can be repeated
    chosen = Settings(
        base,
        max_examples=requested,
        stateful_step_count=step_count,
        report_multiple_bugs=False,
        database=None,  # nothing written into the working directory
        print_blob=False,
        deadline=None,
    )
    tally = Tally(per_invariant={i: [0, 0] for i in (focus or INVARIANTS)})
    stats = RunStats()
    watched = tuple(focus or INVARIANTS)

    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TextColumn("examples  {task.fields[ops]} operations  {task.fields[found]}"),
        TimeElapsedColumn(),
        console=err,
        transient=False,
        refresh_per_second=4,
    )
    task = progress.add_task(label, total=requested, ops=0, found="no violation")

    def rejected_config(config: Config) -> Any:
        try:
            impl = factory(config)
            why = features.unsupported(impl)
            if why is not None:
                raise ConfigError(why)
            return impl
        except (ConfigError, Unsupported) as error:
            # The target declares this configuration unsupported: not a run (the machine
            # rejects the example); remembered to explain a run where nothing ran.
            if len(tally.rejected) < 50:
                tally.rejected.append(str(error))
            raise ConfigError(str(error)) from error

    class ProgressMachine(KVCacheMachine):
        def __init__(self) -> None:
            if part is not None:
                part.start_example()
            super().__init__(
                rejected_config,
                strategy,
                focus=focus,
                stats=stats,
                features=features,
                step_past=step_past,
            )

        @initialize(data=st.data())
        def build(self, data):
            super().build(data)
            driver = self.d
            log = driver.log

            def counting(message: str) -> None:
                log(message)
                progress.update(task, ops=tally.operations + len(driver.trace))

            driver.log = counting

        def teardown(self):
            # Hypothesis calls teardown in a ``finally``: an exception in flight is either its
            # own control flow (an example it discards: StopTest, a rejection) or a rule that
            # crashed, i.e. a failing run.
            raised = sys.exc_info()[1]
            discarded = raised is not None and (
                isinstance(raised, HypothesisException) or not isinstance(raised, Exception)
            )
            failed = raised is not None and not discarded
            try:
                super().teardown()
            except HypothesisException:
                discarded = True  # the step-past policy discarded the example at teardown
                raise
            except BaseException:
                failed = True
                raise
            finally:
                if self.driver is not None and not discarded:
                    self._tally(failed or self.failed)

        def _tally(self, failed: bool) -> None:
            tally.last_config = self.d.config
            tally.last_trace = list(self.d.trace)
            if tally.failing_runs:
                tally.shrink_runs += 1
            else:
                tally.examples += 1
                tally.operations += len(self.d.trace)
                for inv in watched:
                    why = INVARIANTS[inv].inapplicable(self.d.config)
                    if why is None:
                        tally.per_invariant[inv][0] += 1
                        tally.per_invariant[inv][1] += len(self.d.trace)
                    else:
                        tally.inapplicable[inv] = why
            if failed:
                tally.failing_runs += 1
                if part is not None:
                    part.failing = True
            found = (
                f"[red]{tally.failing_runs} failing run(s), shrinking[/]"
                if tally.failing_runs
                else "no violation"
            )
            progress.update(
                task,
                completed=min(tally.examples, requested),
                ops=tally.operations,
                found=found,
                description="shrinking" if tally.failing_runs else label,
            )

    from hypothesis.stateful import get_state_machine_test

    test = get_state_machine_test(ProgressMachine, settings=chosen)
    if seed is not None:
        test = hypothesis_seed(seed)(test)

    outcome = Outcome("holds", tally, stats, requested, step_count, seed, profile, focus, 0.0)
    start = time.perf_counter()
    try:
        with progress, with_reporter(lambda _text: None):
            test()
    except SpecViolation as found:
        outcome.status = "violated"
        outcome.violations = list(found.violations)
        outcome.trace = list(found.trace)
        outcome.config = tally.last_config
    except (Unsatisfiable, FailedHealthCheck) as error:
        outcome.status = "no-examples" if tally.examples == 0 else "incomplete"
        outcome.error = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    except BudgetSpent:
        pass  # the time budget's deadline: the examples run are the run
    except KeyboardInterrupt:
        outcome.status = "interrupted"
    except GuardTripped as trip:  # hung, or out of memory: the search stops where it is
        outcome.status = trip.kind
        fill_failure(outcome, trip, factory)
    except Flaky as error:  # a failure that did not fail again: the target is nondeterministic
        outcome.status = "nondeterministic"
        outcome.config = tally.last_config
        go_past = getattr(step_past, "go_past", None)  # a search round's Sieve: what it went past
        fill_failure(outcome, error, factory, go_past() if go_past is not None else None)
    except Exception as error:  # the target crashed under a valid protocol, or kvspec's own code raised
        outcome.status = KVSPEC_ERROR if raised_in_kvspec(error) else "error"
        outcome.trace = list(tally.last_trace)
        outcome.config = tally.last_config
        fill_failure(outcome, error, factory)
    outcome.seconds = time.perf_counter() - start
    if part is not None:
        part.close()
    if outcome.status == "holds":
        if tally.examples == 0:
            outcome.status = "no-examples"
        elif tally.examples < requested and not (part is not None and part.excuses(requested)):
            outcome.status = "incomplete"
    return outcome
