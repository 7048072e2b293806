"""The stateful machine.  It ships in the package and takes the implementation as an
argument, so a downstream suite (vLLM's CI, another engine) can run it on its own manager::

    from hypothesis.stateful import run_state_machine_as_test
    from kvspec.testing import KVCacheMachine

    run_state_machine_as_test(lambda: KVCacheMachine(MyAdapter))

Every rule goes through the ``Driver`` (which records a replayable trace and ``note()``s each
operation); every invariant is checked after every step; teardown frees everything and
checks ``no-leak``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import attrs
from hypothesis import note, reject
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError
from kvspec.spec.interface import Capability, Implementation
from kvspec.spec.state import Status

from .driver import Driver, SpecViolation
from .strategies import ALPHABET, configs, draw_prompt, integers

ImplementationFactory = Callable[[Config], Implementation]


@attrs.define
class RunStats:
    """What the machines actually executed (a run that executed nothing must not pass)."""

    examples: int = 0
    operations: int = 0
    by_op: dict[str, int] = attrs.Factory(dict)

    def add(self, driver: Driver) -> None:
        self.examples += 1
        self.operations += len(driver.trace)
        for s in driver.trace:
            self.by_op[s.op] = self.by_op.get(s.op, 0) + 1


STATS = RunStats()

tokens = st.integers(0, ALPHABET - 1)

# One step's scheduler choices travel as bytes: (go, chunk, token) per sequence, one draw for
# the whole iteration.  Shrinking moves bytes to 0, i.e. towards "skip" / "whole remainder" /
# token 0, one byte at a time.
_STEP_BYTES = 3
MAX_ADMISSIONS_PER_ITERATION = 2


@functools.cache
def _iteration_bytes(n: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=n, max_size=n)


class KVCacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(
        self,
        factory: ImplementationFactory,
        config_strategy: st.SearchStrategy[Config] | None = None,
        *,
        focus: Iterable[str] | None = None,
        max_prompt_blocks: int = 6,
        stats: RunStats | None = None,
    ) -> None:
        super().__init__()
        self.factory = factory
        self.config_strategy = config_strategy if config_strategy is not None else configs()
        self.focus = focus
        self.max_prompt_blocks = max_prompt_blocks
        self.stats = stats if stats is not None else STATS
        self.driver: Driver | None = None
        self.failed = False
        self.next_id = 0
        self.prompts: list[tuple[int, ...]] = []
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
        except ConfigError as err:
            # The target declares this configuration unsupported (e.g. a release that
            # rejects prefix caching with a sliding window): not a finding, not a run.
            note(f"configuration not supported by the target: {err}")
            reject()
        self.driver = Driver(impl, focus=self.focus, log=note)

    @property
    def d(self) -> Driver:
        assert self.driver is not None
        return self.driver

    def _chunk(self, code: int, remaining: int) -> int:
        """Tokens this step schedules, from one drawn byte: the whole remainder, one block, or
        1 .. 2B tokens (0 -> the whole remainder, which is what shrinking moves towards)."""
        if not self.d.has(Capability.CHUNKED_PREFILL):
            return remaining  # the release prefills whole prompts only
        B = self.d.config.block_size
        kind, rest = code % 3, code // 3
        if kind == 0:
            return remaining
        if kind == 1:
            return B
        return 1 + rest % (2 * B)

    def _choices(self, data, n: int, label: str) -> bytes:
        return data.draw(_iteration_bytes(n), label=label)

    # ------------------------------------------------------------ rules

    @rule(target=seqs, data=st.data())
    def admit(self, data):
        seq_id = self._admit(data)
        return multiple() if seq_id is None else multiple(seq_id)

    def _admit(self, data) -> int | None:
        B = self.d.config.block_size
        prompt = draw_prompt(data.draw, self.prompts, B, B * self.max_prompt_blocks)
        self.prompts.append(prompt)
        seq_id = self.next_id
        self.next_id += 1
        chunk, token = self._choices(data, 2, "num_new_tokens, next_token")
        k = self._chunk(chunk, len(prompt))
        return seq_id if self.d.admit(seq_id, prompt, k, token % ALPHABET) else None

    def _pick(self, data, status: Status, label: str) -> int:
        return data.draw(st.sampled_from(sorted(self.d.with_status(status))), label=label)

    def _has_status(status: Status):
        return precondition(
            lambda self: self.driver is not None and self.driver.with_status(status)
        )

    def _step(self, seq: int, chunk: int, token: int) -> None:
        model = self.d.seqs[seq]
        remaining = len(model.tokens) - model.num_computed
        k = 1 if remaining == 1 else self._chunk(chunk, remaining)
        self.d.step(seq, k, token % ALPHABET)

    @_has_status(Status.RUNNING)
    @rule(data=st.data())
    def step(self, data):
        seq = self._pick(data, Status.RUNNING, "seq")
        self._step(seq, *self._choices(data, 2, "num_new_tokens, next_token"))

    # One scheduler iteration, the way vLLM's schedule() runs one: every running sequence
    # steps (a prefill chunk or a decode token), then new prompts are admitted.  One rule,
    # many operations, each checked as it happens: hypothesis' cost per rule, not per draw,
    # was most of the oracle's time.
    @rule(target=seqs, data=st.data())
    def schedule(self, data):
        running = sorted(self.d.with_status(Status.RUNNING))
        raw = self._choices(
            data, 1 + _STEP_BYTES * len(running), "admissions, then (go, chunk, token) per seq"
        )
        for i, seq in enumerate(running):
            go, chunk, token = raw[1 + _STEP_BYTES * i : 1 + _STEP_BYTES * (i + 1)]
            if go == 0:
                continue
            self._check()
            self._step(seq, chunk, token)
        admitted = []
        for _ in range(raw[0] % (MAX_ADMISSIONS_PER_ITERATION + 1)):
            self._check()
            seq_id = self._admit(data)
            if seq_id is not None:
                admitted.append(seq_id)
        return multiple(*admitted)

    @rule(target=seqs, seq=seqs)
    def fork(self, seq):
        model = self.d.seqs.get(seq)
        if not self.d.has(Capability.FORK) or model is None or model.status is not Status.RUNNING:
            return multiple()
        if not model.decoding():
            return multiple()  # schedulers fork after sampling (parallel sampling, beam search)
        child = self.next_id
        self.next_id += 1
        self.d.fork(seq, child)
        return multiple(child)

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.d.seqs:
            self.d.free(seq)

    @_has_status(Status.RUNNING)
    @rule(data=st.data())
    def preempt(self, data):
        self.d.preempt(self._pick(data, Status.RUNNING, "seq"))

    @_has_status(Status.WAITING)
    @rule(data=st.data())
    def readmit(self, data):
        seq = self._pick(data, Status.WAITING, "seq")
        chunk, token = self._choices(data, 2, "num_new_tokens, next_token")
        k = self._chunk(chunk, len(self.d.seqs[seq].tokens))
        self.d.readmit(seq, k, token % ALPHABET)

    @precondition(lambda self: self.driver is not None and self.driver.has(Capability.SWAP))
    @_has_status(Status.RUNNING)
    @rule(data=st.data())
    def swap_out(self, data):
        self.d.swap_out(self._pick(data, Status.RUNNING, "seq"))

    @_has_status(Status.SWAPPED)
    @rule(data=st.data())
    def swap_in(self, data):
        self.d.swap_in(self._pick(data, Status.SWAPPED, "seq"))

    @precondition(
        lambda self: (
            self.driver is not None
            and self.driver.has(Capability.RESET_PREFIX_CACHE)
            and self.driver.config.prefix_caching
        )
    )
    @rule(data=st.data())
    def reset_prefix_cache(self, data):
        # Rare on purpose: a reset empties the cache that every other rule builds up.
        if data.draw(integers(0, 7), label="reset?") == 0:
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
            self.failed = True
            raise SpecViolation(found, self.d.trace)

    def teardown(self):
        if self.driver is None:
            return
        self.stats.add(self.d)
        if self.failed:
            return  # freeing a broken state would only bury the violation under a crash
        found = self.d.free_all()
        if found:
            raise SpecViolation(found, self.d.trace)
