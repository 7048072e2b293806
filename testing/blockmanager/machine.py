"""The stateful machine.  It ships in the package and takes the implementation as an
argument, so a downstream suite (vLLM's CI, another engine) can run it on its own manager::

    from hypothesis.stateful import run_state_machine_as_test
    from kvspec.testing import KVCacheMachine

    run_state_machine_as_test(lambda: KVCacheMachine(MyAdapter))

Every rule goes through the ``Driver`` (which records a replayable trace and ``note()``s each
operation); every invariant is checked after every operation, including each of the several
a ``schedule`` rule (one scheduler iteration) performs; teardown frees everything and checks
``no-leak``.  Rules take their choices as small byte strings decoded here, rather than as
many separate draws: hypothesis' cost per draw was most of the oracle's time (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable

import attrs
from hypothesis import note, reject
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError
from kvspec.spec.interface import Capability, Implementation
from kvspec.spec.prefix_hash import ExtraKeys
from kvspec.spec.state import Status
from kvspec.testing.blockmanager.driver import Driver, SpecViolation
from kvspec.testing.blockmanager.progress import drain
from kvspec.testing.blockmanager.strategies import (
    admission_bytes,
    configs,
    extended_from,
    extra_from,
    one_length_per_identifier,
    prompt_from,
)
from kvspec.testing.generator_rules import aborts_swapped
from kvspec.testing.generator_rules import token as rule_token

ImplementationFactory = Callable[[Config], Implementation]
CONTINUE = "continue"
StepPast = Callable[[BaseException, Driver], bool | str]
"""Asked about every failure (a SpecViolation, or an exception the target raised) before it
ends the example: True discards the example (``reject``) so the search goes on past it;
``CONTINUE`` lets the example go on as if nothing was found (a SpecViolation only: after a
target's exception there is nothing to go on with, so it is discarded); False fails it."""


@attrs.frozen
class Features:
    """Scheduler features the machine exercises.  None: wherever the target supports it (the
    default); False: never; True: always, and a target without it rejects the example.
    Lookahead, prefix caching, the window and the pool sizes are Config fields."""

    chunked_prefill: bool | None = None
    swap: bool | None = None  # swap-out/in preemption; the CPU pool size is Config's
    fork: bool | None = None

    def unsupported(self, impl: Implementation) -> str | None:
        """Why ``impl`` cannot run with these features pinned on (None: it can)."""
        needs = {
            "chunked_prefill": Capability.CHUNKED_PREFILL,
            "swap": Capability.SWAP,
            "fork": Capability.FORK,
        }
        for name, capability in needs.items():
            if getattr(self, name) and capability not in impl.capabilities:
                return f"{impl.name} does not support {name} (pinned on)"
        if self.swap and impl.config.num_cpu_blocks == 0:
            return "swap pinned on with no CPU blocks (num_cpu_blocks=0)"
        return None

    def allows(self, name: str) -> bool:
        return getattr(self, name) is not False


def _failures_stepped_past(body):
    """A rule body whose target crash is shown to the machine's step-past policy first."""

    @functools.wraps(body)
    def run(self, *args, **kwargs):
        try:
            return body(self, *args, **kwargs)
        except SpecViolation:
            raise  # _check already asked the policy
        except Exception as error:
            if not isinstance(error, HypothesisException):
                self._failing(error)
            raise

    return run


@attrs.define
class RunStats:
    """What the machines actually executed (a run that executed nothing must not pass)."""

    examples: int = 0
    operations: int = 0
    by_op: dict[str, int] = attrs.Factory(dict)
    # Admissions per kind of extra key ("cache_salt", "lora", "mm"), and KV-cache events seen.
    extras: dict[str, int] = attrs.Factory(dict)
    events: int = 0
    # Examples a focused run abandoned because a failed operation broke the target's unwatched
    # block accounting (``Driver.accounting_broken``).
    abandoned: int = 0
    # Allowed divergences a differential run used, by ID (testing/divergences.py).
    divergences: dict[str, int] = attrs.Factory(dict)

    def add(self, driver: Driver) -> None:
        self.examples += 1
        self.operations += len(driver.trace)
        for s in driver.trace:
            self.by_op[s.op] = self.by_op.get(s.op, 0) + 1
            for kind in s.args.get("extra", {}) if s.op == "admit" else ():
                if s.args["extra"][kind]:
                    self.extras[kind] = self.extras.get(kind, 0) + 1
        self.events += driver.events_seen


STATS = RunStats()

# A scheduler iteration draws (go, chunk, token) for up to this many running sequences in one
# byte string (the rest step with the defaults: the whole remainder, token 0), and its
# admissions as a short list of admission byte strings.
SCHEDULED_PER_ITERATION = 8
MAX_ADMISSIONS_PER_ITERATION = 2
iteration_bytes = st.binary(
    min_size=3 * SCHEDULED_PER_ITERATION, max_size=3 * SCHEDULED_PER_ITERATION
)
admissions = st.lists(admission_bytes, max_size=MAX_ADMISSIONS_PER_ITERATION)
three_bytes = st.binary(min_size=3, max_size=3)
pick_code = st.integers(0, 255)


def _notes_kept() -> bool:
    """Whether hypothesis keeps this example's notes: the run it reports, a verbose run, or
    observability on.  Otherwise the driver does not describe its operations (formatting
    every step of every example was a measurable part of the oracle's time)."""
    try:
        from hypothesis.control import should_note
        from hypothesis.internal.observability import observability_enabled
    except ImportError:  # another hypothesis: note everything, as before
        return True
    return should_note() or observability_enabled()


def skipped(go: int) -> bool:
    """An iteration leaves a running sequence out now and then (1 in 8); 0, what shrinking
    moves towards, schedules it."""
    return go % 8 == 7


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(
        self,
        factory: ImplementationFactory,
        config_strategy: st.SearchStrategy[Config] | None = None,
        *,
        focus: Iterable[str] | None = None,
        max_prompt_blocks: int = 6,
        stats: RunStats | None = None,
        free_swapped: bool = True,
        features: Features | None = None,
        step_past: StepPast | None = None,
        checking: str | None = None,
    ) -> None:
        """``checking``: how the driver evaluates the state invariants (``Driver``)."""
        super().__init__()
        self.factory = factory
        self.config_strategy = config_strategy if config_strategy is not None else configs()
        self.focus = focus
        self.max_prompt_blocks = max_prompt_blocks
        # False steers around FINDINGS F13 (vLLM 0.6.3 V2 corrupts its CPU block pool when a
        # swapped-out sequence is freed), for runs that must not stop on it.
        self.free_swapped = free_swapped
        self.features = features if features is not None else Features()
        self.step_past = step_past
        self.checking = checking
        self.stats = stats if stats is not None else STATS
        self.driver: Driver | None = None
        self.failed = False
        self.next_id = 0
        self.prompts: list[tuple[int, ...]] = []
        self.extras: list[ExtraKeys] = []  # each prompt's domain, as drawn (rule moved-media)
        self.checked_at = -1  # driver operation count at the last invariant check

    # ------------------------------------------------------------ setup

    @initialize(data=st.data())
    def build(self, data):
        self._build_driver(data)

    def _build_driver(self, data):
        config = data.draw(self.config_strategy, label="config")
        note(f"config: {config!r}")
        try:
            impl = self.factory(config)
            why = self.features.unsupported(impl)
            if why is not None:
                raise ConfigError(why)
        except ConfigError as err:
            # The target declares this configuration unsupported (e.g. a release that
            # rejects prefix caching with a sliding window): not a finding, not a run.
            note(f"configuration not supported by the target: {err}")
            reject()
        log = note if _notes_kept() else None
        self.driver = Driver(impl, focus=self.focus, log=log, checking=self.checking)

    @property
    def d(self) -> Driver:
        assert self.driver is not None
        return self.driver

    def _chunk(self, code: int, remaining: int) -> int:
        """Tokens this step schedules, from one drawn byte: the whole remainder, one block, or
        1 .. 2B tokens (0 -> the whole remainder, which is what shrinking moves towards)."""
        if not self.d.has(Capability.CHUNKED_PREFILL) or not self.features.allows("chunked_prefill"):
            return remaining  # the release (or the run) prefills whole prompts only
        B = self.d.config.block_size
        kind, rest = code % 3, code // 3
        if kind == 0:
            return remaining
        if kind == 1:
            return B
        return 1 + rest % (2 * B)

    # ------------------------------------------------------------ rules

    @rule(raw=admission_bytes)
    @_failures_stepped_past
    def admit(self, raw):
        self._admit(raw)

    def _admit(self, raw: bytes) -> int | None:
        B = self.d.config.block_size
        # The pool's capacity in tokens: a prompt of that length fills it exactly (pool-edges).
        capacity = B * self.d.config.num_blocks
        extended = extended_from(raw, self.prompts, B)
        prompt = prompt_from(raw, self.prompts, B, B * self.max_prompt_blocks, capacity=capacity)
        self.prompts.append(prompt)
        seq_id = self.next_id
        self.next_id += 1
        chunk, token = raw[2:4]
        k = self._chunk(chunk, len(prompt))
        extra = extra_from(raw, len(prompt), B, self.d.extra_kinds(),
                           None if extended is None else self.extras[extended])
        extra = one_length_per_identifier(extra, self.extras, len(prompt))
        self.extras.append(extra)
        return seq_id if self.d.admit(seq_id, prompt, k, rule_token(token), extra) else None

    def _pick(self, status: Status, code: int) -> int:
        candidates = sorted(self.d.with_status(status))
        return candidates[code % len(candidates)]

    def _has_status(status: Status):
        return precondition(
            lambda self: self.driver is not None and self.driver.with_status(status)
        )

    def _step(self, seq: int, chunk: int, token: int) -> None:
        model = self.d.seqs[seq]
        remaining = len(model.tokens) - model.num_computed
        k = 1 if remaining == 1 else self._chunk(chunk, remaining)
        self.d.step(seq, k, rule_token(token))

    @_has_status(Status.RUNNING)
    @rule(raw=three_bytes)
    @_failures_stepped_past
    def step(self, raw):
        pick, chunk, token = raw
        self._step(self._pick(Status.RUNNING, pick), chunk, token)

    # A scheduler iteration, the way vLLM's schedule() runs one: every running sequence steps
    # (a prefill chunk or a decode token), then new prompts are admitted.  One rule, many
    # operations, each checked as it happens: hypothesis' cost per rule and per draw, not
    # the checks, was most of the oracle's time.
    @rule(raw=iteration_bytes, new=admissions)
    @_failures_stepped_past
    def schedule(self, raw, new):
        for i, seq in enumerate(sorted(self.d.with_status(Status.RUNNING))):
            go, chunk, token = raw[3 * i : 3 * i + 3] or b"\0\0\0"
            if skipped(go):
                continue
            self._check()
            self._step(seq, chunk, token)
        for admission in new:
            self._check()
            self._admit(admission)

    # Sequences are picked among those the operation applies to (not from a bundle of every
    # sequence ever admitted, most of them gone), so forks and frees are never no-ops.
    def _decoding(self) -> list[int]:
        return sorted(
            s for s, m in self.d.seqs.items() if m.status is Status.RUNNING and m.decoding()
        )

    # Schedulers fork after sampling (parallel sampling, beam search): decoding sequences only.
    @precondition(
        lambda self: (
            self.driver is not None
            and self.driver.has(Capability.FORK)
            and self.features.allows("fork")
            and bool(self._decoding())
        )
    )
    @rule(pick=pick_code)
    @_failures_stepped_past
    def fork(self, pick):
        candidates = self._decoding()
        child = self.next_id
        self.next_id += 1
        self.d.fork(candidates[pick % len(candidates)], child)

    def _freeable(self) -> list[int]:
        return sorted(
            s for s, m in self.d.seqs.items() if self.free_swapped or m.status is not Status.SWAPPED
        )

    @precondition(lambda self: self.driver is not None and bool(self._freeable()))
    @rule(pick=pick_code)
    @_failures_stepped_past
    def free(self, pick):
        candidates = self._freeable()
        swapped = [s for s in candidates if self.d.seqs[s].status is Status.SWAPPED]
        if swapped and aborts_swapped(pick):
            candidates = swapped  # rule swapped-aborts
        self.d.free(candidates[pick % len(candidates)])

    @_has_status(Status.RUNNING)
    @rule(pick=pick_code)
    @_failures_stepped_past
    def preempt(self, pick):
        self.d.preempt(self._pick(Status.RUNNING, pick))

    @_has_status(Status.WAITING)
    @rule(raw=three_bytes)
    @_failures_stepped_past
    def readmit(self, raw):
        pick, chunk, token = raw
        seq = self._pick(Status.WAITING, pick)
        k = self._chunk(chunk, len(self.d.seqs[seq].tokens))
        self.d.readmit(seq, k, rule_token(token))

    @precondition(
        lambda self: (
            self.driver is not None
            and self.driver.has(Capability.SWAP)
            and self.features.allows("swap")
        )
    )
    @_has_status(Status.RUNNING)
    @rule(pick=pick_code)
    @_failures_stepped_past
    def swap_out(self, pick):
        self.d.swap_out(self._pick(Status.RUNNING, pick))

    @_has_status(Status.SWAPPED)
    @rule(pick=pick_code)
    @_failures_stepped_past
    def swap_in(self, pick):
        self.d.swap_in(self._pick(Status.SWAPPED, pick))

    @precondition(
        lambda self: (
            self.driver is not None
            and self.driver.has(Capability.RESET_PREFIX_CACHE)
            and self.driver.config.prefix_caching
        )
    )
    @rule(draw=st.integers(0, 7))
    @_failures_stepped_past
    def reset_prefix_cache(self, draw):
        # Rare on purpose: a reset empties the cache that every other rule builds up.
        if draw == 0:
            self.d.reset_prefix_cache()

    # ------------------------------------------------------------ checks

    @invariant()
    def invariants_hold(self):
        self._check()

    def _check(self) -> None:
        """Every invariant, once per driver operation (a rule may perform several)."""
        if self.driver is None or self.d.operations == self.checked_at:
            return
        self.checked_at = self.d.operations
        found = self.d.check()
        if found:
            error = SpecViolation(found, self.d.trace)
            if not self._failing(error):
                raise error
        if self.d.accounting_broken is not None:
            # Outside the focus, an operation that failed after its own check said yes broke
            # the target's block accounting (Driver.check): the example ends here without a
            # verdict; searching on would only meet consequences (after F12's failed swap_out,
            # a crash on a block id the GPU pool does not own).
            self.stats.abandoned += 1
            reject()

    def _failing(self, error: BaseException) -> bool:
        """A failure: the step-past policy may discard the example instead, or (True) let it
        go on past a violation."""
        verdict = self.step_past(error, self.d) if self.step_past is not None else False
        if verdict == CONTINUE and isinstance(error, SpecViolation):
            return True
        self.failed = True
        if verdict:
            reject()
        return False

    def teardown(self):
        if self.driver is None:
            return
        self.stats.add(self.d)
        if self.failed:
            return  # freeing a broken state would only bury the violation under a crash
        if sys.exc_info()[1] is not None:
            return  # hypothesis is abandoning the example (StopTest, a rejection): no verdict
        if self.focus is None or "progress" in self.focus:
            # progress: with no new arrivals, the scheduler loop finishes every request.
            try:
                found = drain(self.d)
            except SpecViolation:
                raise
            except Exception as error:  # a target crash in the drain: the policy sees it too
                self._failing(error)
                raise
            if found:
                error = SpecViolation(found, self.d.trace)
                if not self._failing(error):
                    raise error
        try:
            found = self.d.free_all()
        except SpecViolation:
            raise
        except Exception as error:
            self._failing(error)
            raise
        if found:
            error = SpecViolation(found, self.d.trace)
            if not self._failing(error):
                raise error
