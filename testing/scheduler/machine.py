"""The stateful machine over a scheduler-driven target (vLLM's own V1 scheduler).

Rules: requests arrive (prompts drawn from earlier ones, so prefixes are shared), the engine
iterates (schedule, execute, output; under async scheduling the output of a step comes back
after the next step is planned), requests are aborted.  Every invariant is checked per
KV-cache group and over the shared pool after every rule.  Teardown stops the arrivals and
steps the target until every request finishes (``progress``, testing/scheduler/progress.py),
then aborts what is left, drains the outputs in flight and checks ``no-leak``.  The shape of
each example (hybrid groups, async, speculative decoding, token budget, startup-minimum pool)
is drawn by ``shapes``.

With ``differential`` set, the reference scheduler (reference/scheduler.py) runs in lockstep
(``SchedulerLockstep``): the same arrivals, aborts and worker outputs, the same pool size and
running-request cap as the target, and after every step the two are compared in a mode
(testing/blockmanager/differential.py ``Mode``):

outcomes  every step schedules the same requests and preempts the same ones, in order;
counts    also, each scheduled request starts at the same position and computes the same
          number of tokens (drafts included), and every (request, KV-cache group) holds the
          same number of blocks;
renaming  also, every group's tables have the same length, drop the same slots (sliding
          windows) and share the same slots, up to renaming block ids.  The default.

The reference follows the scheduling policy declared for the target's release
(reference/policies.py ``declared_for``), and only the comparisons that policy declares are
made.  A release with no declared policy gets no differential (``DiffCounts.undeclared`` says
so).  A difference is not an invariant violation: it is raised as ``PolicyDifference`` (the
target differs from its release's declared policy), after the invariants, which come first.

A difference a known divergence (``divergences.SCHEDULER_KNOWN``) explains is allowed and
counted; from there the two schedulers no longer plan from the same state, so the comparison
ends for the example.  With prefix caching on, the reference scheduler keeps its own prefix cache
(reference/prefix_cache.py) over the requests' domains (cache salt, LoRA adapter), so hits,
what they share and what eviction keeps are compared like any other step.  The run counts the
steps compared, the examples compared to their end, and why comparisons ended (``DiffCounts``).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from hypothesis import note, reject
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.errors import HypothesisException
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvspec.reference.policies import REFERENCE_OWN, Comparison, SchedulerPolicy, declared_for
from kvspec.reference.scheduler import ReferenceScheduler
from kvspec.spec.errors import ConfigError
from kvspec.spec.groups import DENSE_ONLY, HybridState, Plan, RetentionOffer, Shape
from kvspec.spec.invariants import Violation
from kvspec.spec.prefix_hash import MMFeature
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.blockmanager.driver import SpecViolation, TraceStep
from kvspec.testing.blockmanager.machine import CONTINUE, StepPast
from kvspec.testing.blockmanager.strategies import admission_bytes, extended_index, extra_from, prompt_from
from kvspec.testing.divergences import SCHEDULER_KNOWN, Divergence, Mismatch, explained
from kvspec.testing.generator_rules import (
    DECODE_RELATIONS,
    POOL_EDGES,
    SPARE_BLOCKS,
    block_relative,
    decode_relative_budget,
    eagle_caches,
    eagle_repeated_blocks,
    identifiers,
    lone_request,
    spare_blocks,
)
from kvspec.testing.generator_rules import token as rule_token
from kvspec.testing.scheduler.driver import SchedulerDriver, SchedulerTarget, ShapeCounts
from kvspec.testing.scheduler.progress import drain
from kvspec.testing.scheduler.swarm import Swarm, swarms

LONE_CODES = st.integers(0, 255)  # rule lone-requests' code (``lone_request``)
# Multiples of the scheduler's block size a periodic retention interval is drawn from (vLLM
# refuses any other interval, kv_cache_coordinator.py:57-62 of 0.33.0).
RETENTION_PERIODS = (1, 2, 4)
# Pipeline stages a pipeline-parallel shape is drawn with: two and three batches in flight.
PIPELINE_STAGES = (2, 3)
# Tokens per image a multimodal shape is drawn with (the tiny BLIP-2's ``num_query_tokens``):
# below, at and above the block sizes and the smaller token budgets, so that one image or two
# exhaust the encoder budget and cache (both max(token budget, tokens per image)).
MM_ITEM_TOKENS = (2, 3, 4, 6, 8, 12)
# Images beyond the shared names: enough that a step's images outgrow the encoder budget.
MORE_IMAGES = tuple(f"image{i}" for i in range(2, 8))
MM_PLACEHOLDER = 3  # the token a lengthened prompt's placeholders are (``mm_prompt``)
OPENS_WITH_IMAGE = 0x40  # the placement byte's bit that places the first image anywhere (else at 0)


def retention_offer_of(factory: Callable[..., Any]) -> RetentionOffer:
    """The retentions the scheduler ``factory`` builds offers (vLLM's adapter reads its
    release, ``VLLMV1SchedulerAdapter.retention_offer``); dense only for any other (a
    reference scheduler alone runs the engine's configuration, which it has none of)."""
    offer = getattr(factory, "retention_offer", None)
    return offer() if offer is not None else DENSE_ONLY


def kv_connectors_of(factory: Callable[..., Any]) -> tuple[str, ...]:
    """The KV connectors the scheduler ``factory`` builds (vLLM's adapter reads its release,
    ``VLLMV1SchedulerAdapter.kv_connectors_offered``); none for any other (the reference
    scheduler models no connector)."""
    offered = getattr(factory, "kv_connectors_offered", None)
    return tuple(offered()) if offered is not None else ()


def _image_sizes(shape: Shape) -> list[int]:
    """The tokens per image a multimodal shape draws from: ``MM_ITEM_TOKENS``, and two sizes
    relative to the token budget (half of it and a token more: two images outgrow the encoder
    budget; a token past it: the budget is one image), those that fit half the context."""
    budget = shape.max_num_batched_tokens
    sizes = (*MM_ITEM_TOKENS, budget // 2 + 1, budget + 1)
    return sorted({n for n in sizes if n <= shape.max_model_len // 2})


def multimodal_refusal_of(factory: Callable[..., Any]) -> str | None:
    """Why the scheduler ``factory`` builds runs no multimodal shape (None: it runs it): vLLM's
    adapter asks its release (``VLLMV1SchedulerAdapter.multimodal_refusal``), the reference
    models the encoder itself; any other says nothing of images."""
    refusal = getattr(factory, "multimodal_refusal", None)
    if refusal is None:
        return "the scheduler takes no images"
    return refusal()


def multimodal_of(factory: Callable[..., Any]) -> bool:
    """Whether the scheduler ``factory`` builds runs the multimodal shape."""
    return multimodal_refusal_of(factory) is None


def mm_placements(raw: bytes, prompt_len: int, tokens_per_image: int) -> tuple[MMFeature, ...]:
    """A multimodal request's images from an admission's bytes 7-8 (``extra_from``'s): none,
    one or two, each ``tokens_per_image`` placeholder positions inside the prompt (the first at
    its start for half the requests), the second after the first.  The identifiers are
    ``extra_from``'s few shared names (rule ``shared-identifiers``: one image in many requests,
    so the encoder cache is read as well as written) and ``MORE_IMAGES`` (so that images compete
    for the encoder), distinct within a request (releases hold an image a request repeats
    differently: 0.33.0 encoder_cache_manager.py:263-295 counts its occurrences, 0.12.0 does
    not)."""
    mm_code, pos = raw[7], raw[8]
    names = (*identifiers("mm"), *MORE_IMAGES)
    # Half the requests open with their image, as BLIP-2 inserts it (blip2.py:488-494): the
    # admissions of one step then each reach an image at once.
    offset = pos % prompt_len if prompt_len and pos & OPENS_WITH_IMAGE else 0
    images: list[MMFeature] = []
    first = (mm_code // 3) % len(names)
    for n in range(mm_code % 3):
        if offset + tokens_per_image > prompt_len:
            break
        images.append(MMFeature(names[(first + n) % len(names)], offset, tokens_per_image))
        offset += tokens_per_image + (pos >> 4) % 3
    return tuple(images)


def mm_prompt(raw: bytes, prompt: tuple[int, ...], tokens_per_image: int, longest: int) -> tuple[int, ...]:
    """A multimodal request's prompt: one that ``raw`` gives images (``mm_placements``) but that
    is shorter than an image is lengthened to hold one, with the image's placeholder tokens (the
    prompt of a BLIP-2 request holds its image's ``num_query_tokens`` placeholders,
    blip2.py:488-494), where ``longest`` allows.  Without it most short prompts would carry no
    image, and the encoder budget would be rarely reached."""
    if raw[7] % 3 == 0 or len(prompt) >= tokens_per_image or tokens_per_image > longest:
        return prompt
    return (*prompt, *([MM_PLACEHOLDER] * (tokens_per_image - len(prompt))))


@st.composite
def shapes(
    draw,
    retention: RetentionOffer = DENSE_ONLY,
    connectors: tuple[str, ...] = (),
    multimodal: bool = False,
    swarm: Swarm | None = None,
) -> Shape:
    """Production shapes, most of them hybrid, following the generator rules
    (testing/generator_rules.py).  Windows and attention chunks are drawn by their relation to
    the second group's block size (``block_relative``), the pool's spare blocks by
    ``spare_blocks``, a chunked budget of a shape with drafts by its relation to a decode step
    (``decode_relative_budget``).  A third of the
    hybrid shapes pair full attention with chunked-local layers (Llama-4); vLLM's chunked-local
    groups take the scheduler's block size (0.33.0 single_type_kv_cache_manager.py:1338-1341,
    ``ChunkedLocalAttentionManager.find_longest_cache_hit``), so those draw no other.

    ``retention``: what the target's release offers of the prefix-cache retention.  Every
    shape runs the release's engine default; where the release lets a deployment choose and
    the choice matters (prefix caching with a sliding-window or Mamba group), half the shapes
    choose instead, dense or a periodic interval (``RETENTION_PERIODS``).  A release without
    the choice draws nothing, so its shapes draw as they did before it existed.

    ``connectors``: the KV connectors the target's release builds (``kv_connectors_of``); a
    quarter of the shapes without a Mamba group take one, drawn last.  None offered: nothing is drawn, so the other
    shapes draw as they did before.

    ``multimodal``: the target runs the multimodal shape (``multimodal_of``); a quarter of the
    shapes without a Mamba group or a connector then carry images of ``MM_ITEM_TOKENS`` tokens,
    under the synchronous scheduler without drafts or pipeline (``Shape.mm_item_tokens``),
    drawn after everything else.

    ``swarm``: a swarm configuration (testing/scheduler/swarm.py): each feature it restricts
    takes only the values it keeps, in the proportions above; a feature pinned to one value
    draws nothing for it.  None: every value, drawn as above (``kvspec check``)."""
    B = draw(st.sampled_from([2, 4, 8]))
    swa_B = draw(st.sampled_from([d for d in (1, 2, 4, 8) if B % d == 0]))
    window = chunk = None
    if swarm is None:
        hybrid = draw(st.integers(0, 3)) != 0
        chunked = hybrid and draw(st.integers(0, 2)) == 0
        groups = "full" if not hybrid else "chunked-local" if chunked else "window"
    else:
        groups = draw(st.sampled_from(swarm.weighted("groups")))
        hybrid = groups != "full"
    if groups == "chunked-local":
        swa_B = B
        chunk = draw(block_relative(B))
    elif hybrid and groups != "mamba":
        window = draw(block_relative(swa_B))
    max_model_len = B * draw(st.sampled_from([8, 12, 16]))
    chunked_budget = st.integers(B, max_model_len - 1)
    budget = draw(_kept(swarm, "budget", st.one_of(st.just(max_model_len), chunked_budget),
                        {"whole": max_model_len, "chunked": chunked_budget}))
    spare = _kept(swarm, "pool", spare_blocks(), {"spare": st.sampled_from([n for n in SPARE_BLOCKS if n]),
                                                        "startup-min": 0 if POOL_EDGES.on else spare_blocks()})
    caching = _kept(swarm, "prefix-caching", st.booleans(), {"off": False, "on": True})
    scheduling = _kept(swarm, "scheduling", st.booleans(), {"sync": False, "async": True})
    if swarm is None:
        spec = st.sampled_from([0, 0, 1, 2, 3])
    else:
        drafts = draw(st.sampled_from(swarm.weighted("drafts")))
        spec = st.just(0) if drafts == "none" else st.sampled_from([1, 2, 3])
    shape = Shape(
        block_size=B,
        swa_block_size=swa_B,
        sliding_window=window,
        extra_blocks=draw(spare),
        prefix_caching=draw(caching),
        num_spec_tokens=draw(spec),
        async_scheduling=draw(scheduling),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        full_sequence_must_fit=draw(st.booleans()),
        max_tokens=draw(st.sampled_from([2, 4, 8])),
        attention_chunk_size=chunk,
        # vLLM runs no EAGLE head beside chunked-local layers (0.33.0
        # single_type_kv_cache_manager.py:1333-1335 asserts it away).
        eagle=chunk is None and (draw(st.booleans()) if swarm is None else drafts == "eagle"),
        lookahead_hashes=draw(st.booleans()),
    )
    # Rule ``eagle-prefix-hits``: an EAGLE head meets prefix hits (drawn after the others, so
    # their draws stay as they were).
    if shape.eagle and shape.num_spec_tokens and not shape.prefix_caching:
        if (swarm is None or swarm.allows("prefix-caching", "on")) and eagle_caches(draw(st.integers(0, 2))):
            shape = attrs.evolve(shape, prefix_caching=True)
    # A third of the hybrid shapes pair full attention with Mamba layers instead (drawn
    # last, so the other shapes' draws stay as they were).  Without draft tokens: the worker
    # model keeps no per-draft states (vLLM's speculative Mamba blocks).
    if groups == "mamba" or (swarm is None and hybrid and draw(st.integers(0, 2)) == 0):
        shape = attrs.evolve(
            shape,
            swa_block_size=B,
            sliding_window=None,
            attention_chunk_size=None,
            num_spec_tokens=0,
            eagle=False,
            mamba=True,
        )
        # Two "align" shapes in three hash finer than the Mamba block (vLLM's
        # prefix_match_unit): hits inside a Mamba block, partial tails and their copy-on-write.
        units = [u for u in (1, 2, 4) if u < B and B % u == 0]
        if shape.prefix_caching and units and draw(st.integers(0, 2)) != 0:
            shape = attrs.evolve(shape, prefix_match_unit=draw(st.sampled_from(units)))
    # The retention, drawn last (the other shapes' draws stay as they were).
    shape = attrs.evolve(shape, retention_interval=retention.engine_default)
    if retention.configurable and shape.prefix_caching and (shape.sliding_window is not None or shape.mamba):
        periodic = shape.scheduler_block_size * draw(st.sampled_from(RETENTION_PERIODS))
        choices = [retention.engine_default, retention.engine_default, None, periodic]
        shape = attrs.evolve(shape, retention_interval=draw(st.sampled_from(choices)))
    # Pipeline parallel: half the shapes that run the synchronous
    # scheduler without drafts keep one batch per stage in flight (``Shape.pipeline_parallel``).
    if not shape.async_scheduling and not shape.num_spec_tokens and draw(st.integers(0, 1)) == 1:
        shape = attrs.evolve(shape, pipeline_parallel=draw(st.sampled_from(PIPELINE_STAGES)))
    # Not beside a Mamba group: vLLM 0.33.0 hands a producer's Mamba boundary states to the
    # connector (single_type_kv_cache_manager.py:149-160, kv_cache_manager.py:906-927,
    # sched/scheduler.py:3360-3390), which the worker model does not play.
    # One shape in four; the last of the choices, so that shrinking takes the connector away
    # from a verdict that does not need it.
    if connectors and not shape.mamba and _one_in_four(draw, swarm, "connector"):
        shape = attrs.evolve(shape, kv_connector=draw(st.sampled_from(connectors)))
    if multimodal and not shape.mamba and shape.kv_connector is None and _one_in_four(draw, swarm, "images"):
        shape = attrs.evolve(
            shape,
            async_scheduling=False,
            num_spec_tokens=0,
            eagle=False,
            pipeline_parallel=1,
            mm_item_tokens=draw(st.sampled_from(_image_sizes(shape))),
        )
    # Rule ``decode-relative``: a chunked budget of a shape with drafts, by its relation to one
    # decode step (drawn last, when the drafts are final, so the other shapes' draws stay as
    # they were; code 0 keeps the budget drawn above).
    if shape.budget_bound and shape.num_spec_tokens:
        relation, extra = draw(st.integers(0, len(DECODE_RELATIONS) - 1)), draw(st.integers(1, 2))
        budget = decode_relative_budget(
            relation,
            extra,
            shape.max_num_batched_tokens,
            num_spec_tokens=shape.num_spec_tokens,
            lookahead=shape.num_spec_tokens if shape.eagle else 0,
            block_size=B,
            max_model_len=max_model_len,
        )
        shape = attrs.evolve(shape, max_num_batched_tokens=budget)
    return shape


def _kept(
    swarm: Swarm | None, feature: str, every: st.SearchStrategy, by_value: Mapping[str, Any]
) -> st.SearchStrategy:
    """A two-valued feature's draw: ``every`` (the draw without a swarm) where the swarm keeps
    both values or there is none, else the value it keeps (``by_value``: a value or a strategy)."""
    only = swarm.only(feature) if swarm is not None else None
    if only is None:
        return every
    kept = by_value[only]
    return kept if isinstance(kept, st.SearchStrategy) else st.just(kept)


def _one_in_four(draw: Any, swarm: Swarm | None, feature: str) -> bool:
    """Whether a shape takes an extra a quarter of shapes take (a KV connector, images): as
    drawn without a swarm, always where the swarm keeps it alone, never where it leaves it out."""
    only = swarm.only(feature) if swarm is not None else None
    if only is not None:
        return only != "none"
    return draw(st.integers(0, 3)) == 3


@st.composite
def swarm_shapes(
    draw,
    retention: RetentionOffer = DENSE_ONLY,
    connectors: tuple[str, ...] = (),
    multimodal: bool = False,
) -> Shape:
    """A production shape under a swarm configuration the example draws first
    (testing/scheduler/swarm.py ``swarms``): ``kvspec fuzz --machine scheduler``'s shapes."""
    return draw(shapes(retention, connectors, multimodal, swarm=draw(swarms())))


TargetFactory = Callable[[Shape], SchedulerTarget]


def _note(message: str) -> None:
    """A note on the example, where there is one (a lockstep also runs a fixed trace)."""
    if currently_in_test_context():
        note(message)
step_bytes = st.binary(min_size=4, max_size=4)
MAMBA_PREFIX_CACHE = "Mamba prefix cache may hit (hits inside a block: the reference caches no Mamba states there)"
MAMBA_PARTIAL_TAIL = "Mamba partial tail cached (the reference takes no copy-on-write block)"
_ORDER = (Mode.OUTCOMES, Mode.COUNTS, Mode.RENAMING)


@attrs.define(eq=False)
class PolicyDifference(Exception):
    """The target scheduled (or laid its tables out) differently from the reference scheduler
    following the policy declared for the target's release: a verdict of its own, not an
    invariant violation (every invariant may hold on both)."""

    release: str  # the target's release ("0.30.0"), or the scheduler's name beside the reference
    comparison: Comparison  # what was compared
    seq: int | None  # the request, where the comparison is per request
    group: str | None  # the KV-cache group, where it is per group
    target: object  # what the target gave
    reference: object  # what the reference scheduler gave
    policy: str  # the declared policy's ID (reference/policies.py)
    mode: str  # the differential's mode that makes the comparison
    trace: list[TraceStep] = attrs.Factory(list)

    def whose(self) -> str:
        """The scheduler whose declared policy the target differs from."""
        return f"vLLM {self.release}" if self.policy != REFERENCE_OWN.id else "the reference scheduler"

    def what(self) -> str:
        where = ("" if self.group is None else f" in group {self.group}") + (
            "" if self.seq is None else f" of seq {self.seq}"
        )
        return f"{self.comparison.value}{where}"

    def __str__(self) -> str:
        name = f"vLLM {self.release}" if self.policy != REFERENCE_OWN.id else self.release
        return (
            f"differs from {self.whose()}'s declared policy ({self.policy}): {self.what()}: "
            f"{name} gave {self.target}, the reference scheduler under that policy {self.reference}"
        )


@attrs.define
class DiffCounts:
    """What the scheduler differential compared, and what it allowed (a run's summary)."""

    examples: int = 0  # examples run in lockstep with the reference
    steps: int = 0  # scheduler steps whose plans were compared
    states: int = 0  # observed states compared (after every rule)
    allowed: Counter = attrs.Factory(Counter)  # allowed divergences by ID
    ended: Counter = attrs.Factory(Counter)  # why comparisons ended before the example did
    hits: int = 0  # admissions at a prefix hit in the steps compared
    hit_examples: int = 0  # examples with such an admission
    hit_examples_to_end: int = 0  # ... and compared to their end
    not_run: Counter = attrs.Factory(Counter)  # examples run without the differential, by why
    encoder_inputs: int = 0  # encoder inputs scheduled in the steps compared (multimodal shapes)
    mm_examples: int = 0  # examples of a multimodal shape run in lockstep
    mm_examples_to_end: int = 0  # ... and compared to their end
    # Images that stopped a request's step short in the steps compared, by what was short
    # (the encoder budget, the encoder cache).
    encoder_stops: Counter = attrs.Factory(Counter)
    policy: SchedulerPolicy | None = None  # the declared policy the reference followed
    undeclared: str | None = None  # the target's release, when no policy is declared for it

    @property
    def to_end(self) -> int:
        """Examples compared to their end."""
        return self.examples - sum(self.ended.values())

    def add(self, lockstep: SchedulerLockstep) -> None:
        self.examples += 1
        self.policy = lockstep.policy
        self.steps += lockstep.steps
        self.states += lockstep.states
        for _, why in lockstep.allowed:
            self.allowed[why.id] += 1
        hits = getattr(lockstep.reference, "hits", 0)
        self.hits += hits
        self.hit_examples += hits > 0
        self.hit_examples_to_end += hits > 0 and lockstep.ended is None
        if lockstep.ended is not None:
            self.ended[lockstep.ended] += 1
        self.encoder_inputs += lockstep.encoder_inputs
        if lockstep.reference.shape.multimodal:
            self.mm_examples += 1
            self.mm_examples_to_end += lockstep.ended is None
            self.encoder_stops.update(getattr(lockstep.reference, "encoder_stops", {}))


def _running_cap(target: Any) -> int | None:
    """The target's cap on running requests: the reference's own, or vLLM's scheduler's
    ``max_num_running_reqs`` (vllm/v1/core/sched/scheduler.py:131, from ``max_num_seqs``)."""
    cap = getattr(target, "max_num_seqs", None)
    if cap is None:
        cap = getattr(getattr(target, "scheduler", None), "max_num_running_reqs", None)
    return cap


class SchedulerLockstep:
    """Looks like a SchedulerTarget to the driver; drives the target and the reference
    scheduler on the same requests and the same worker outputs, and compares them."""

    def __init__(
        self,
        target: SchedulerTarget,
        reference: SchedulerTarget,
        mode: Mode = Mode.RENAMING,
        known: tuple[Divergence, ...] = SCHEDULER_KNOWN,
        policy: SchedulerPolicy = REFERENCE_OWN,
        release: str | None = None,
    ) -> None:
        self.target, self.reference, self.mode, self.known = target, reference, mode, known
        self.policy = policy
        self.release = release if release is not None else target.name
        self.caching = target.config.prefix_caching
        self.ended: str | None = None  # why the comparison ended, if it did
        self.steps = 0
        self.states = 0
        self.encoder_inputs = 0  # encoder inputs (request, image) the steps compared scheduled
        self.difference: PolicyDifference | None = None
        self.allowed: list[tuple[Mismatch, Divergence]] = []
        self._pairs: dict[int, Plan] = {}  # id(target plan) -> the reference's plan of that step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    @property
    def comparing(self) -> bool:
        return self.ended is None

    def _compares(self, mode: Mode) -> bool:
        return _ORDER.index(self.mode) >= _ORDER.index(mode)

    def _end(self, why: str) -> None:
        self.ended = why
        self._pairs.clear()
        _note(f"differential: comparison ends here ({why})")

    # ------------------------------------------------ the SchedulerTarget surface

    @property
    def _beside_vllm(self) -> bool:
        return not isinstance(self.target, ReferenceScheduler)

    @property
    def _mamba_cache_unmodelled(self) -> bool:
        """A Mamba "align" shape beside vLLM whose Mamba prefix cache the reference does not
        model (``ReferenceScheduler.caches_mamba_states``: hits inside a Mamba block, or a policy
        without ``mamba_state_cache``): vLLM's cache keeps Mamba states, the reference's none."""
        return (
            self.reference.shape.mamba_cache_mode == "align"
            and not self.reference.caches_mamba_states
            and not isinstance(self.target, ReferenceScheduler)
        )

    def _mamba_cache_may_hit(self, before: frozenset | None = None) -> bool:
        """In a Mamba "align" shape beside vLLM whose Mamba cache is not modelled
        (``_mamba_cache_unmodelled``), whether a lookup may find something in vLLM's
        prefix cache, which keeps Mamba states the reference does not: a hit, a full-attention
        hit the Mamba group lacks (which stops a chunk at the junction, 0.33.0
        scheduler.py:632-650), a Mamba hit on a block cached in the same step (which stops the
        admissions, single_type_kv_cache_manager.py:1704-1713).  Every lookup starts with the
        full-attention group, up to the request's tokens less one (kv_cache_coordinator.py
        :846-941, kv_cache_manager.py:301-306), so only its keys matter.  Before a step
        (``before`` None): it holds a key whose chain begins a waiting request's tokens (less
        one), in its domain (a preempted request waits with its own blocks perhaps cached).
        After it: a key it cached in the step (not in ``before``) begins the tokens of a request
        that was waiting and of another, whose step may have cached it first."""
        if not self._mamba_cache_unmodelled:
            return False
        keys = self.target.cached_keys(0)
        live = self.reference.lookup_requests()
        for key in keys if before is None else keys - before:
            n = len(key.chain)
            found = [
                waiting
                for tokens, extra, waiting in live
                if n <= len(tokens) - waiting
                and tuple(tokens[:n]) == key.chain
                and key.extra == extra.for_chain(n)
            ]
            if any(found) and (before is None or len(found) > 1):
                return True
        return False

    def _partial_tail_cached(self, before: frozenset) -> bool:
        """Whether the target cached, in the step, a key ending inside a Mamba block (hits
        inside a block): the prompt's partial tail, whose producer takes a copy-on-write block
        at its next allocation (0.33.0 single_type_kv_cache_manager.py:2123-2126, 1748-1755, 1873-1874),
        which the reference does not hold."""
        size = self.reference.shape.block_size
        return any(len(key.chain) % size for key in self.target.cached_keys(1) - before)

    def add(self, seq_id: int, tokens: Sequence[int], max_tokens: int, *extra: Any) -> None:
        # A request's domain (``extra``) keys its blocks in both prefix caches (LoRA counts
        # against max_loras only under a LoRA config, which the scheduler adapter builds none
        # of).  Its images are scheduled against the encoder budget and cache (vllm/v1/core/
        # sched/scheduler.py _try_schedule_encoder_inputs), which the reference models in a
        # multimodal shape (``Shape.mm_item_tokens``); in any other the comparison ends there.
        self.target.add(seq_id, tokens, max_tokens, *extra)
        if self.comparing and self.reference.encoder is None and any(getattr(e, "mm", ()) for e in extra):
            self._end("multimodal request")
        if self.comparing:
            self.reference.add(seq_id, tokens, max_tokens, *extra)

    def abort(self, seq_id: int) -> None:
        self.target.abort(seq_id)
        if self.comparing and self.reference.live(seq_id):
            self.reference.abort(seq_id)

    def schedule(self) -> Plan:
        watch = self.comparing and self._mamba_cache_unmodelled
        before = (self.target.cached_keys(0), self.target.cached_keys(1)) if watch else None
        if before is not None and self._mamba_cache_may_hit():
            self._end(MAMBA_PREFIX_CACHE)
        plan = self.target.schedule()
        if self.comparing and before is not None and self._mamba_cache_may_hit(before[0]):
            self._end(MAMBA_PREFIX_CACHE)
        if self.comparing and before is not None and self._partial_tail_cached(before[1]):
            self._end(MAMBA_PARTIAL_TAIL)
        if self.comparing:
            ref = self.reference.schedule()
            self._pairs[id(plan)] = ref
            self._compare_plans(plan, ref)
        return plan

    def update(
        self,
        plan: Plan,
        sampled: Mapping[int, Sequence[int]],
        drafts: Mapping | None = None,
        **worker: Any,
    ) -> None:
        """The output and the worker's connector report (``sent``) to both: the reference
        holds a finished request's blocks until its send is reported, as vLLM defers their
        free (reference/scheduler.py ``_finish``); a block holding a partial tail rejoins the
        free queue as a cached one in both (reference/policies.py ``caches_partial_tails``)."""
        self.target.update(plan, sampled, drafts, **worker)
        ref = self._pairs.pop(id(plan), None)
        if ref is not None and self.comparing:
            self.reference.update(ref, sampled, drafts, **worker)

    # ------------------------------------------------ comparing

    def _differ(
        self,
        mode: Mode,
        comparison: Comparison,
        seq: int | None,
        got: object,
        want: object,
        group: str | None = None,
    ) -> None:
        op = comparison.value + ("" if group is None else f" in group {group}")
        m = Mismatch(
            mode.value,
            op,
            seq,
            got,
            want,
            self.target.name,
            prefill=False,
            caching=self.caching,
            async_scheduling=self.reference.shape.async_scheduling,
        )
        why = explained(m, self.known)
        if why is not None:
            self.allowed.append((m, why))
            _note(f"allowed divergence {why.id}: {op} seq {seq}: target {got}, reference {want}")
            self._end(f"allowed {why.id}")
        elif self._compares(mode) and not self.policy.compares(comparison):
            # The policy does not declare this: no verdict, and the two no longer plan from the
            # same state, so what follows would not be declared either.
            self._end(f"{comparison.value} not declared")
        elif self._compares(mode):
            self.difference = PolicyDifference(
                self.release, comparison, seq, group, got, want, self.policy.id, mode.value
            )
            self._end("policy difference")

    def _compare_plans(self, plan: Plan, ref: Plan) -> None:
        self.steps += 1
        got = [s.seq_id for s in plan.scheduled]
        want = [s.seq_id for s in ref.scheduled]
        if sorted(got) != sorted(want):
            self._differ(Mode.OUTCOMES, Comparison.SCHEDULED, None, sorted(got), sorted(want))
            return
        if list(plan.preempted) != list(ref.preempted):
            self._differ(Mode.OUTCOMES, Comparison.PREEMPTED, None, list(plan.preempted), list(ref.preempted))
            return
        if plan.encoder_inputs != ref.encoder_inputs:
            got_enc, want_enc = list(plan.encoder_inputs), list(ref.encoder_inputs)
            self._differ(Mode.OUTCOMES, Comparison.ENCODER_INPUTS, None, got_enc, want_enc)
            return
        self.encoder_inputs += len(plan.encoder_inputs)
        theirs = {s.seq_id: s for s in ref.scheduled}
        for s in plan.scheduled:
            r = theirs[s.seq_id]
            mine = (s.start, s.num_tokens, s.drafts)
            other = (r.start, r.num_tokens, r.drafts)
            if mine != other:
                self._differ(Mode.COUNTS, Comparison.STEP_COUNTS, s.seq_id, mine, other)
                return

    def compare_states(self) -> PolicyDifference | None:
        """Compare the two observed states (after a rule); the difference found so far."""
        if self.comparing:
            self.states += 1
            self._compare_tables(self.target.observe(), self.reference.observe())
        return self.difference

    def _compare_tables(self, t: HybridState, r: HybridState) -> None:
        if not self._compares(Mode.COUNTS):
            return
        for tg, rg in zip(t.groups, r.groups, strict=True):
            name = tg.spec.name
            for seq in sorted(set(tg.tables) | set(rg.tables)):
                ts = tg.tables[seq].slots if seq in tg.tables else ()
                rs = rg.tables[seq].slots if seq in rg.tables else ()
                held_t = sum(b is not None for b in ts)
                held_r = sum(b is not None for b in rs)
                if held_t != held_r:
                    self._differ(Mode.COUNTS, Comparison.HELD_BLOCKS, seq, held_t, held_r, name)
                    return
                dropped_t = [i for i, b in enumerate(ts) if b is None]
                dropped_r = [i for i, b in enumerate(rs) if b is None]
                if held_t and (len(ts), dropped_t) != (len(rs), dropped_r):
                    self._differ(
                        Mode.RENAMING,
                        Comparison.TABLE_LAYOUT,
                        seq,
                        (len(ts), dropped_t),
                        (len(rs), dropped_r),
                        name,
                    )
                    return
            if _sharing(tg.tables) != _sharing(rg.tables):
                self._differ(
                    Mode.RENAMING,
                    Comparison.SHARED_SLOTS,
                    None,
                    _sharing(tg.tables),
                    _sharing(rg.tables),
                    name,
                )
                return


def _sharing(tables: Mapping) -> list[list[tuple[int, int]]]:
    """Which (seq, slot) pairs of one group share a block: the tables up to renaming ids."""
    holders: dict[int, list[tuple[int, int]]] = {}
    for s in sorted(tables):
        for i, b in enumerate(tables[s].slots):
            if b is not None:
                holders.setdefault(b, []).append((s, i))
    return sorted(h for h in holders.values() if len(h) > 1)


def release_of(target: SchedulerTarget) -> str:
    """The vLLM release a scheduler target runs (``vllm_version``), else its name."""
    return getattr(target, "vllm_version", None) or target.name


def policy_beside(target: SchedulerTarget) -> SchedulerPolicy | None:
    """The policy the reference scheduler follows beside ``target``: the reference's own beside
    a reference scheduler (or a variant of one), the one declared for a vLLM target's release,
    None where nothing is declared (no differential)."""
    if isinstance(target, ReferenceScheduler):
        return REFERENCE_OWN
    release = getattr(target, "vllm_version", None)
    return declared_for(release) if release else None


def reference_beside(target: SchedulerTarget, shape: Shape, policy: SchedulerPolicy) -> ReferenceScheduler:
    """The reference scheduler on the target's pool, running-request cap, lookahead slots,
    EAGLE hit drop (or hash lookahead) and encoder budget and cache, following ``policy``."""
    return ReferenceScheduler(
        shape,
        num_blocks=target.num_blocks,
        max_num_seqs=_running_cap(target),
        num_lookahead_tokens=target.num_lookahead_tokens,
        policy=policy,
        drop_eagle_block=getattr(target, "drops_eagle_block", None),
        hash_lookahead=getattr(getattr(target, "scheduler", None), "num_hash_lookahead_tokens", None),
        encoder_budget=getattr(target, "encoder_budget", None) if shape.multimodal else None,
        encoder_cache_size=getattr(target, "encoder_cache_size", None) if shape.multimodal else None,
    )


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(
        self,
        factory: TargetFactory,
        shape_strategy: st.SearchStrategy[Shape] | None = None,
        *,
        counts: ShapeCounts | None = None,
        focus: frozenset[str] | None = None,
        differential: Mode | None = None,
        diff_counts: DiffCounts | None = None,
        known: tuple[Divergence, ...] = SCHEDULER_KNOWN,
        step_past: StepPast | None = None,
    ) -> None:
        super().__init__()
        # Whether a failing example is discarded (True) rather than reported: cli/search.py's
        # rounds step past what earlier rounds found (testing/blockmanager/machine.py ``StepPast``).
        self.step_past = step_past
        self.differential = differential
        self.diff_counts = diff_counts if diff_counts is not None else DiffCounts()
        self.known = known
        self.lockstep: SchedulerLockstep | None = None
        self.factory = factory
        if shape_strategy is None:
            shape_strategy = shapes(retention_offer_of(factory), kv_connectors_of(factory), multimodal_of(factory))
        self.shape_strategy = shape_strategy
        self.counts = counts if counts is not None else ShapeCounts()
        self.focus = focus
        self.driver: SchedulerDriver | None = None
        self.shape: Shape | None = None
        self.failed = False
        self.next_id = 0
        self.prompts: list[tuple[int, ...]] = []
        self.domains: list[Any] = []  # each prompt's domain (ExtraKeys)
        self.checked_at = -1
        self.lone = False  # rule lone-requests: one request only, filling the context

    @initialize(data=st.data())
    def build(self, data):
        shape = data.draw(self.shape_strategy, label="shape")
        note(f"shape: {shape!r}")
        try:
            self.start(shape)
        except ConfigError as err:
            note(f"shape not supported by the target: {err}")
            reject()
        if shape.at_minimum:
            self.lone = lone_request(data.draw(LONE_CODES, label="lone"))
            if self.lone:
                note("lone-requests: one request only, filling the context")

    def start(self, shape: Shape) -> None:
        """Build the target in ``shape`` (a ConfigError: the target refuses it) and its driver,
        in lockstep with the reference scheduler when the differential is on.  ``build`` draws
        the shape; a replay (testing/scheduler/replay.py) gives the recorded one."""
        target = self.factory(shape)
        self.shape = shape
        # Against vLLM, a Mamba "align" shape needs the reference to cut prefill chunks at Mamba
        # blocks' ends as the release does (reference/policies.py ``mamba_aligned_split``).
        vllm_align = shape.mamba_cache_mode == "align" and not isinstance(target, ReferenceScheduler)
        policy = policy_beside(target) if self.differential is not None else None
        if self.differential is not None and policy is None:
            self.diff_counts.undeclared = release_of(target)
        elif vllm_align and policy is not None and not policy.mamba_aligned_split.value:
            self.diff_counts.not_run[f"Mamba align shape (no block-aligned split declared for {policy.id})"] += 1
        elif (
            shape.sparse_retention and not vllm_align and policy is not None and not policy.sparse_retention_tails.value
        ):
            # The policy declares no sparse retention of sliding-window groups, so the reference
            # would retain densely.  A Mamba "align" shape's retention is the policy's
            # ``mamba_state_cache``; where that is not modelled the comparison ends wherever
            # vLLM's prefix cache may hit (``_mamba_cache_may_hit``).
            self.diff_counts.not_run[f"sparse prefix-cache retention (not declared for {policy.id})"] += 1
        elif policy is not None:
            reference = reference_beside(target, shape, policy)
            self.lockstep = SchedulerLockstep(
                target, reference, self.differential, self.known, policy, release_of(target)
            )
            target = self.lockstep
        self.driver = SchedulerDriver.for_shape(target, shape, log=note)

    @property
    def d(self) -> SchedulerDriver:
        assert self.driver is not None
        return self.driver

    @precondition(lambda self: not (self.lone and self.next_id))
    @rule(raw=admission_bytes)
    def arrive(self, raw):
        shape = self.shape
        assert shape is not None
        B = shape.block_size
        # Room for the sampled tokens and a step's drafts within max_model_len.
        longest = shape.max_model_len - shape.max_tokens - shape.num_spec_tokens - 1
        repeat = eagle_repeated_blocks(self._drops_hit_block())
        prompt = prompt_from(
            raw, self.prompts, B, longest, budget=shape.max_num_batched_tokens, repeat_blocks=repeat
        )
        if self.lone:
            prompt = (prompt * -(-longest // len(prompt)))[:longest]  # the drawn tokens, repeated
        if shape.multimodal:
            prompt = mm_prompt(raw, prompt, shape.mm_item_tokens or 0, longest)
        max_tokens = shape.max_tokens if self.lone else 1 + raw[3] % shape.max_tokens
        # The request's domain (cache salt, LoRA, multimodal), in the kinds the target keys by;
        # under rule ``eagle-prefix-hits``, the domain of the prompt it repeats (a hit is there).
        kinds = getattr(self.d.target, "extra_kinds", frozenset())
        if shape.multimodal:
            # Images of the model's size (``mm_placements``), not the block manager's.
            kinds = kinds - {"mm"}
        extra = extra_from(raw, len(prompt), B, kinds)
        if shape.multimodal and (images := mm_placements(raw, len(prompt), shape.mm_item_tokens or 0)):
            extra = attrs.evolve(extra, mm=images)
        if repeat and self.prompts:
            # Its salt and adapter; media placements are the new prompt's own.
            base = self.domains[extended_index(raw, self.prompts, B, repeat)]
            extra = attrs.evolve(extra, cache_salt=base.cache_salt, lora=base.lora)
        self.prompts.append(prompt)
        self.domains.append(extra)
        self.d.arrive(self.next_id, [rule_token(t) for t in prompt], max_tokens, extra)
        self.next_id += 1

    def _drops_hit_block(self) -> bool:
        """Whether the target's EAGLE head drops the last block of every prefix hit: what the
        target says (the V1 scheduler adapter's ``drops_eagle_block``, read off the release; the
        reference scheduler's ``drop_eagle_block``), else the shape's (an EAGLE head with no
        lookahead hashes)."""
        shape = self.shape
        assert shape is not None
        target = self.d.target
        said = getattr(target, "drops_eagle_block", getattr(target, "drop_eagle_block", None))
        if said is None:
            said = shape.eagle and not shape.lookahead_hashes
        return bool(said and shape.num_spec_tokens and shape.prefix_caching)

    @precondition(lambda self: self.driver is not None)
    @rule(accept=step_bytes, tokens=step_bytes)
    def step(self, accept, tokens):
        self.d.step(accept, tokens)

    @precondition(lambda self: self.driver is not None and bool(self.driver.seqs) and not self.lone)
    @rule(pick=st.integers(0, 255))
    def abort(self, pick):
        live = sorted(self.d.seqs)
        self.d.abort(live[pick % len(live)])

    @invariant()
    def invariants_hold(self):
        if self.driver is None or self.d.operations == self.checked_at:
            return
        self.checked_at = self.d.operations
        self._raise(self._checks())

    def _checks(self) -> list[Violation]:
        """Every invariant on the state now; with none violated (among those watched), the
        differential's difference, if it found one, is raised (``PolicyDifference``).  With
        ``focus``, only the invariants focused on are judged: the differential is not."""
        found = self.d.check()
        if self.lockstep is None:
            return found
        difference = self.lockstep.compare_states()
        watched = found if self.focus is None else [v for v in found if v.invariant in self.focus]
        if difference is not None and not watched and self.focus is None:
            difference.trace = list(self.d.trace)
            self._failing(difference)
            raise difference
        return found

    def _raise(self, found):
        if self.focus is not None:
            found = [v for v in found if v.invariant in self.focus]
        if found:
            error = SpecViolation(found, self.d.trace)
            if not self._failing(error):
                raise error

    def _failing(self, error: BaseException) -> bool:
        """A failure: the step-past policy may discard the example instead, or (True) let it
        go on past a violation it names ``CONTINUE`` (a known finding that leaves the state
        usable, such as a wrong usage figure from the first operation on)."""
        verdict = self.step_past(error, self.d) if self.step_past is not None else False
        if verdict == CONTINUE and isinstance(error, SpecViolation):
            return True
        self.failed = True
        if verdict:
            reject()
        return False

    def teardown(self):
        if self.driver is None or self.shape is None:
            return
        self.counts.add(self.shape.tags(), len(self.d.trace), self.d.cache_counts())
        if self.lockstep is not None:
            self.diff_counts.add(self.lockstep)
        raised = sys.exc_info()[1]  # hypothesis tears down in a ``finally``: a rule that raised
        verdicts = SpecViolation | PolicyDifference | HypothesisException
        if isinstance(raised, Exception) and not isinstance(raised, verdicts):
            if not self.failed:
                self._failing(raised)  # a crash: the step-past policy sees it too
            return
        if self.failed or self.d.crashed is not None:
            return  # a violation or a crash ended the example: its state is not a finished one
        # Not when hypothesis is abandoning the example (StopTest, a rejection): no verdict,
        # and nothing run that could fail, since a failure's step-past policy may reject() the
        # example, which on hypothesis' already concluded data is an error of its own (Frozen).
        if sys.exc_info()[1] is not None:
            return
        try:
            if self.focus is None or "progress" in self.focus:
                # progress: with no new arrivals, the target's own loop finishes every request.
                self._raise(drain(self.d, self._checks))
            self._raise(self.d.finish())
        except (SpecViolation, PolicyDifference, HypothesisException):
            raise
        except Exception as error:  # a target crash in the drain: the step-past policy sees it too
            self._failing(error)
            raise
