"""The stateful machine over a scheduler-driven target (vLLM's own V1 scheduler).

Rules: requests arrive (prompts drawn from earlier ones, so prefixes are shared), the engine
iterates (schedule, execute, output; under async scheduling the output of a step comes back
after the next step is planned), requests are aborted.  Every invariant is checked per
KV-cache group and over the shared pool after every rule; teardown aborts everything, drains
the outputs in flight and checks ``no-leak``.  The shape of each example (hybrid groups,
async, speculative decoding, token budget, startup-minimum pool) is drawn by ``shapes``.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import note, reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvspec.spec.errors import ConfigError
from kvspec.spec.groups import Shape

from .driver import SpecViolation
from .scheduler_driver import SchedulerDriver, SchedulerTarget, ShapeCounts
from .strategies import ALPHABET, admission_bytes, extra_from, prompt_from


@st.composite
def shapes(draw) -> Shape:
    """Production shapes, most of them hybrid.  Windows are drawn by their relation to the
    sliding-window group's block size, as in strategies.windows."""
    B = draw(st.sampled_from([2, 4, 8]))
    swa_B = draw(st.sampled_from([d for d in (1, 2, 4, 8) if B % d == 0]))
    hybrid = draw(st.integers(0, 3)) != 0
    window = None
    if hybrid:
        window = draw(
            st.one_of(
                st.just(swa_B),
                st.integers(1, 4).map(lambda m: m * swa_B),
                st.integers(1, 4).map(lambda m: m * swa_B + 1),
                st.integers(1, 4 * swa_B + 3),
            )
        )
    max_model_len = B * draw(st.sampled_from([8, 12, 16]))
    budget = draw(st.one_of(st.just(max_model_len), st.integers(B, max_model_len - 1)))
    return Shape(
        block_size=B,
        swa_block_size=swa_B,
        sliding_window=window,
        extra_blocks=draw(st.sampled_from([0, 0, 1, 2, 4, 8])),
        prefix_caching=draw(st.booleans()),
        num_spec_tokens=draw(st.sampled_from([0, 0, 1, 2, 3])),
        async_scheduling=draw(st.booleans()),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        full_sequence_must_fit=draw(st.booleans()),
        max_tokens=draw(st.sampled_from([2, 4, 8])),
    )


TargetFactory = Callable[[Shape], SchedulerTarget]
step_bytes = st.binary(min_size=4, max_size=4)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(
        self,
        factory: TargetFactory,
        shape_strategy: st.SearchStrategy[Shape] | None = None,
        *,
        counts: ShapeCounts | None = None,
        focus: frozenset[str] | None = None,
    ) -> None:
        super().__init__()
        self.factory = factory
        self.shape_strategy = shape_strategy if shape_strategy is not None else shapes()
        self.counts = counts if counts is not None else ShapeCounts()
        self.focus = focus
        self.driver: SchedulerDriver | None = None
        self.shape: Shape | None = None
        self.failed = False
        self.next_id = 0
        self.prompts: list[tuple[int, ...]] = []
        self.checked_at = -1

    @initialize(data=st.data())
    def build(self, data):
        shape = data.draw(self.shape_strategy, label="shape")
        note(f"shape: {shape!r}")
        try:
            target = self.factory(shape)
        except ConfigError as err:
            note(f"shape not supported by the target: {err}")
            reject()
        self.shape = shape
        depth = 1 if shape.async_scheduling else 0
        self.driver = SchedulerDriver(target, async_depth=depth, log=note)

    @property
    def d(self) -> SchedulerDriver:
        assert self.driver is not None
        return self.driver

    @rule(raw=admission_bytes)
    def arrive(self, raw):
        shape = self.shape
        assert shape is not None
        B = shape.block_size
        # Room for the sampled tokens and a step's drafts within max_model_len.
        longest = shape.max_model_len - shape.max_tokens - shape.num_spec_tokens - 1
        prompt = prompt_from(raw, self.prompts, B, longest)
        self.prompts.append(prompt)
        max_tokens = 1 + raw[3] % shape.max_tokens
        # The request's domain (cache salt, LoRA, multimodal), in the kinds the target keys by.
        extra = extra_from(raw, len(prompt), B, getattr(self.d.target, "extra_kinds", frozenset()))
        self.d.arrive(self.next_id, [t % ALPHABET for t in prompt], max_tokens, extra)
        self.next_id += 1

    @precondition(lambda self: self.driver is not None)
    @rule(accept=step_bytes, tokens=step_bytes)
    def step(self, accept, tokens):
        self.d.step(accept, tokens)

    @precondition(lambda self: self.driver is not None and bool(self.driver.seqs))
    @rule(pick=st.integers(0, 255))
    def abort(self, pick):
        live = sorted(self.d.seqs)
        self.d.abort(live[pick % len(live)])

    @invariant()
    def invariants_hold(self):
        if self.driver is None or self.d.operations == self.checked_at:
            return
        self.checked_at = self.d.operations
        self._raise(self.d.check())

    def _raise(self, found):
        if self.focus is not None:
            found = [v for v in found if v.invariant in self.focus]
        if found:
            self.failed = True
            raise SpecViolation(found, self.d.trace)

    def teardown(self):
        if self.driver is None or self.shape is None:
            return
        self.counts.add(self.shape.tags(), len(self.d.trace), self.d.cache_counts())
        if self.failed:
            return
        self._raise(self.d.finish())
