"""The worker model for scheduler-driven runs: vLLM's own scheduler plans, kvspec executes.

``Driver`` (driver.py) plays the scheduler and calls a block manager one operation at a time.
Here the target *is* the scheduler (adapters/v1_scheduler.py): it decides what runs, and this
driver plays the model runner.  For every planned step it writes the KV of each scheduled
position into the shadow memory through the request's block table in every KV-cache group,
samples tokens (accepting a drawn number of the step's draft tokens and rejecting the rest),
discards the KV writes of rejected drafts, and returns the output to the scheduler.  Every
state invariant is checked per group and over the shared pool (spec/groups.py) after every
call, and every write is checked for immutability in the group that owns the block.

The sequence model (``SeqModel``) is the worker's: ``tokens`` are the tokens it has sampled,
``num_computed`` the positions whose KV it has written or a prefix hit supplied.  Under async
scheduling the worker runs step t+1 before the scheduler has seen step t's output: a running
request's step starts where the worker's own count stands (what vLLM's GPU model runner does
with its on-device count), not at the scheduler's optimistic ``num_computed_tokens``.

Under a KV connector (``Shape.kv_connector``; the target's ``sends_kv``) the worker also sends
KV: a request finished in an output (not aborted) is ``Status.SENDING`` in the model, its
blocks legitimately held (``registry.live_tables``), and after a drawn number of updates
(``SEND_DELAYS``) the worker reports its KV sent (``update(..., sent=...)``, vLLM's
``finished_sending``).  From then on the model holds nothing of it, so ``no-leak`` requires the
target to have freed it; a table gone while the send is still in flight is ``kv-readback``'s
``freed-while-sending``.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
from hypothesis.errors import HypothesisException
from kvspec.spec.config import Config
from kvspec.spec.groups import GroupSpec, GroupState, HybridState, check_hybrid, group_state, pool_state
from kvspec.spec.invariants import Violation, admission_soundness, immutability
from kvspec.spec.kv_memory import (
    Write,
    WriteFault,
    copy_cells,
    ended_lifetimes,
    plan_state_write,
    plan_step_writes,
    state_readback_faults,
)
from kvspec.spec.prefix_hash import NO_EXTRA, ExtraKeys, HashCollision, PrefixKey, confused_domains, key_of
from kvspec.spec.state import Device, KVState, SeqModel, Status
from kvspec.testing.blockmanager.driver import END, TraceStep, _Target, record_crash, trace_args
from kvspec.testing.blockmanager.incremental import Judges, TouchedMemory, check_mode
from kvspec.testing.guard import Crash

DRAFT_ALPHABET = 4  # draft token ids, like prompt tokens: few values, so drafts can match
# Updates a finished request's KV send stays in flight before the worker reports it sent (0: in
# the very next output), drawn from the finishing step's token bytes.
SEND_DELAYS = 3
MAX_SETTLE_STEPS = SEND_DELAYS + 2  # steps ``finish`` takes to let every send be reported


class SchedulerTarget(Protocol):
    """What a scheduler-driven target offers (adapters/v1_scheduler.py)."""

    name: str
    config: Config
    group_specs: tuple[GroupSpec, ...]
    num_lookahead_tokens: int

    # A target that keys requests by domain (``extra_kinds``) also takes ``extra: ExtraKeys``.
    def add(self, seq_id: int, tokens: Sequence[int], max_tokens: int) -> None: ...
    def abort(self, seq_id: int) -> None: ...
    def live(self, seq_id: int) -> bool: ...
    def tokens(self, seq_id: int) -> tuple[int, ...]: ...
    def schedule(self) -> Any: ...
    # A target built with a KV connector says so (``sends_kv``: every request finished in an
    # output has its KV sent) and takes ``sent`` in ``update`` (the worker's finished sends).
    def update(self, plan: Any, sampled: dict, drafts: dict | None = None) -> None: ...
    def observe(self) -> HybridState: ...


@attrs.define
class ShapeCounts:
    """Operations run per production shape (a run that ran none of a shape says so)."""

    examples: Counter = attrs.Factory(Counter)
    operations: Counter = attrs.Factory(Counter)
    # What the prefix cache saw across the run (``SchedulerDriver.cache_counts``): admissions
    # per domain kind, partial tails cached / promoted / retired, KV-cache events.
    cache: Counter = attrs.Factory(Counter)

    def add(self, shapes: Sequence[str], operations: int, cache: Counter | None = None) -> None:
        for s in shapes:
            self.examples[s] += 1
            self.operations[s] += operations
        self.cache.update(cache or {})


def _domain(key: PrefixKey) -> str:
    """A key's domain as a report names it: its extra parts, ``kind=value`` ("plain": none)."""
    parts = ["=".join(map(str, part)) if isinstance(part, tuple) else str(part) for part in key.extra]
    return ",".join(parts) or "plain"


def _marks_crash(method: Callable) -> Callable:
    """A driver operation whose target may crash: the operation is recorded as crashed (the
    target's call, the exception, its file:line; ``driver.record_crash``), and nothing after."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapped(self: SchedulerDriver, *args: Any, **kwargs: Any) -> Any:
        mark = len(self.trace)
        self.target.escaped = None
        try:
            return method(self, *args, **kwargs)
        except BaseException as error:
            if self.crashed is None and not isinstance(error, HypothesisException | KeyboardInterrupt):
                self.crashed = error
                escaped = self.target.escaped
                call = escaped[0] if escaped is not None and escaped[1] is error else method.__name__
                step_args = trace_args(signature, (self, *args), kwargs)
                if self.ending:
                    step_args = {**step_args, END: True}
                crash = self.crash = Crash.of(call, error)
                step = record_crash(self.trace, mark, method.__name__, step_args, crash, error, self.config)
                self.log(step.describe())
            raise

    return wrapped


class SchedulerDriver:
    def __init__(
        self,
        target: SchedulerTarget,
        *,
        async_depth: int = 0,
        log: Callable[[str], None] | None = None,
        checking: str | None = None,
        placeholders: bool | None = None,
    ) -> None:
        """``async_depth``: the batches still in flight after a step (the engine's batch queue
        less one).  ``placeholders``: whether the scheduler plans a step before the output of
        the one in flight with placeholders for its tokens (async scheduling; None: whenever a
        batch is in flight), so a step starts at the worker's position rather than the
        scheduler's; a synchronous scheduler beside a batch in flight (a pipeline) plans from
        positions it counts computed, and must start each step exactly there.  ``checking``:
        how the state invariants are evaluated (``incremental.MODES``; None: ``KVSPEC_CHECK``,
        else incremental, which equals the whole-world definition)."""
        # The target as the driver calls it: which call an exception escaped is remembered.
        self.target = _Target(target)
        self.config = target.config
        self.async_depth = async_depth  # steps whose output is still in flight after a step
        self.placeholders = async_depth > 0 if placeholders is None else placeholders
        self.log = log or (lambda _m: None)
        self.seqs: dict[int, SeqModel] = {}
        self.max_tokens: dict[int, int] = {}  # a request's sampled tokens at most (its arrival's)
        self.memory: TouchedMemory = TouchedMemory()
        self.judges = Judges(check_mode(checking))
        self.trace: list[TraceStep] = []
        # Whether the example's end runs (the progress drain, the final aborts): the operations
        # it performs are recorded as the end's (``END``), so that a re-run of the trace stops
        # applying recorded operations there and runs the end itself (testing/artifacts/rerun.py).
        self.ending = False
        self.pending: list[Violation] = []
        self.in_flight: deque = deque()
        self.recent_starts: dict[int, list[int]] = {}
        self.proposed: dict[int, tuple[int, ...]] = {}  # drafts the worker proposed last
        self.state: HybridState = target.observe()
        self.operations = 0
        self.counts: Counter = Counter()  # drafts, rejected, preempted, chunked, ...
        self.encoded_seqs: set[int] = set()  # requests an image of which a step encoded
        # The exception a target call raised (the run stops there: no teardown on a state the
        # target left half-updated, whose checks would only hide the crash).
        self.crashed: BaseException | None = None
        self.crash: Crash | None = None  # what escaped, as the crashed step records it
        self.partials: Counter = Counter()  # partial tails cached, promoted, retired
        # KV sends in flight: seq -> updates still to pass before the worker reports it sent.
        self.sends: dict[int, int] = {}
        self._send_delay = 0  # the delay a send started by the next update is given

    @classmethod
    def for_shape(cls, target: SchedulerTarget, shape: Any, **kwargs: Any) -> SchedulerDriver:
        """The driver of a target built in ``shape`` (``spec.groups.Shape``): the engine's batch
        queue as the shape keeps it."""
        return cls(
            target,
            async_depth=shape.batches_in_flight - 1,
            placeholders=shape.async_scheduling,
            **kwargs,
        )

    # ------------------------------------------------------------ operations

    @_marks_crash
    def arrive(
        self, seq_id: int, tokens: Sequence[int], max_tokens: int, extra: ExtraKeys = NO_EXTRA
    ) -> None:
        tokens = tuple(tokens)
        if extra:  # a target keys by domain only if it says so (``extra_kinds``)
            self.target.add(seq_id, tokens, max_tokens, extra)
        else:
            self.target.add(seq_id, tokens, max_tokens)
        self.seqs[seq_id] = SeqModel(
            seq_id, tokens, status=Status.WAITING, prompt_len=len(tokens), extra=extra
        )
        self.max_tokens[seq_id] = max_tokens
        args: dict[str, Any] = {"seq": seq_id, "tokens": list(tokens), "max_tokens": max_tokens}
        if extra:
            args["extra"] = extra.to_json()
        self._record("arrive", args)
        self._observe()

    @_marks_crash
    def abort(self, seq_id: int) -> None:
        self.target.abort(seq_id)
        if seq_id not in self.sends:  # an abort of a finished request changes nothing
            self.seqs.pop(seq_id, None)
        self._record("abort", {"seq": seq_id})
        self._observe()

    @_marks_crash
    def step(self, accept: bytes, tokens: bytes) -> Any:
        """One engine iteration: schedule, execute, and hand back the output that is due; the
        step's plan."""
        prior = self.state
        self._send_delay = (tokens[-1] if tokens else 0) % SEND_DELAYS
        plan = self.target.schedule()
        for seq_id in plan.preempted:
            if seq_id in self.seqs:
                self.counts["preempted"] += 1
                self.seqs[seq_id] = attrs.evolve(
                    self.seqs[seq_id], status=Status.WAITING, num_computed=0, step=(0, 0)
                )
                self.recent_starts.pop(seq_id, None)
        self._count_hits(plan, prior)
        # The images the step encodes (a multimodal shape), and the requests they belong to.
        encoded = getattr(plan, "encoder_inputs", ())
        self.counts["encoder_inputs"] += len(encoded)
        self.counts["encoder_steps"] += bool(encoded)
        self.encoded_seqs.update(seq for seq, _ in encoded)
        self._observe()
        sampled, drafts = self._execute(plan, accept, tokens)
        self.in_flight.append((plan, sampled, drafts))
        shown = {
            s.seq_id: f"{s.start}+{s.num_tokens}" + (f"(d{s.drafts})" if s.drafts else "")
            for s in plan.scheduled
        }
        self._record(
            "step",
            {"accept": accept.hex(), "tokens": tokens.hex()},
            f"scheduled {shown}, preempted {list(plan.preempted)}, sampled "
            f"{ {k: v for k, v in sampled.items() if v} }",
        )
        while len(self.in_flight) > self.async_depth:
            self._update(*self.in_flight.popleft())
        return plan

    @_marks_crash
    def drain(self) -> None:
        while self.in_flight:
            self._update(*self.in_flight.popleft())

    def _count_hits(self, plan: Any, prior: HybridState) -> None:
        """Count the prefix hits of the step's admissions, and those exactly one block short of
        the longest prefix the full-attention group had cached before the step (capped so that
        one prompt token is left to compute): with an EAGLE head that is the dropped last hit
        block (0.33.0 ``drop_eagle_block``, kv_cache_coordinator.py:590-594, 867-901), which
        the hit-completeness policy declares."""
        B = self.config.block_size
        cached = {key for key, _ in prior.groups[0].cached} if prior.groups else set()
        for s in plan.scheduled:
            seq = self.seqs.get(s.seq_id)
            if seq is None or seq.status is Status.RUNNING:
                continue
            tokens = self.target.tokens(s.seq_id)
            cap = (len(tokens) - 1) // B
            longest = 0
            while longest < cap and key_of(tokens, (longest + 1) * B, seq.extra) in cached:
                longest += 1
            self.counts["admissions_with_cached_prefix"] += bool(longest)
            self.counts["hits"] += bool(s.start)
            short = bool(longest) and s.start == (longest - 1) * B
            self.counts["hits_one_block_short"] += short
            if getattr(self.target, "drops_eagle_block", False):
                self.counts["eagle_admissions_with_cached_prefix"] += bool(longest)
                self.counts["eagle_dropped_blocks"] += short

    # ------------------------------------------------------------ the worker

    def _copy_blocks(self, plan: Any) -> None:
        """The block copies a step's plan hands the worker, run before its forward: each
        destination block becomes a copy of its source (every cell the source holds, nothing
        the destination held before), as vLLM's worker copies a shared partial tail into the
        private block a prefix hit or a producer's next step takes (0.33.0
        single_type_kv_cache_manager.py:455-475, 1883-1918).  Into an attention block of a
        request the step admits, the copy carries the positions before its hit only
        (``copy_cells``' ``below``)."""
        B = max(g.spec.block_size for g in self.state.groups)
        for src, dst in getattr(plan, "copies", ()):
            below = self._admitted_hit_holding(plan, dst)
            writes = copy_cells(self.memory, (Device.GPU, src), (Device.GPU, dst), B, below)
            for off in range(B):
                self.memory.pop((Device.GPU, dst, off), None)
            for w in writes:
                self.memory[w.cell] = w.kv
            self.counts["block_copies"] += 1

    def _admitted_hit_holding(self, plan: Any, block: int) -> int | None:
        """The prefix hit (its length) of a request the plan admits whose attention table holds
        ``block``; None: no such request (a state group's block, a running request's)."""
        for s in plan.scheduled:
            seq = self.seqs.get(s.seq_id)
            if seq is None or seq.status is Status.RUNNING:
                continue
            for g in self.state.groups:
                table = g.tables.get(s.seq_id)
                if not g.spec.state and table is not None and block in table.slots:
                    return s.start
        return None

    def _execute(self, plan: Any, accept: bytes, tokens: bytes) -> tuple[dict, dict]:
        before = self.state
        self._copy_blocks(plan)
        sampled: dict[int, list[int]] = {}
        drafts_out: dict[int, list[int]] = {}
        for i, s in enumerate(plan.scheduled):
            seq = self.seqs.get(s.seq_id)
            if seq is None:
                continue  # aborted while its step was planned
            code = accept[i % len(accept)] if accept else 0
            token = (tokens[i % len(tokens)] if tokens else 0) % DRAFT_ALPHABET
            fresh = seq.status is not Status.RUNNING
            start = s.start
            if fresh:
                # A (re)admission: the prefix hit counts as computed; the tokens are those the
                # scheduler holds for the request (a preempted one keeps what it sampled, less
                # any stale output of a step in flight at the preemption).
                seq = attrs.evolve(
                    seq,
                    status=Status.RUNNING,
                    num_computed=start,
                    tokens=self.target.tokens(s.seq_id),
                )
            elif self.placeholders:
                start = seq.num_computed
            if not fresh and not self.placeholders and self.async_depth:
                # A synchronous scheduler beside batches in flight (a pipeline) sends each
                # step's tokens with it (``use_pp``, 0.33.0 scheduler.py:1945-1956): so a token
                # that a stale output (of a step in flight at a preemption) delivered after the
                # worker resumed the request reaches the worker.  Only an extension is taken.
                theirs = tuple(self.target.tokens(s.seq_id))
                if len(theirs) > len(seq.tokens) and theirs[: len(seq.tokens)] == tuple(seq.tokens):
                    seq = attrs.evolve(seq, tokens=theirs)
            if not fresh and not self.placeholders and start != seq.num_computed:
                self.pending.append(
                    Violation(
                        "kv-readback",
                        f"seq {s.seq_id}: the scheduler starts its step at position {s.start} "
                        f"but the worker has computed {seq.num_computed} positions",
                        kind="step-start",
                        seqs=(s.seq_id,),
                        positions=(s.start,),
                        expected=seq.num_computed,
                        observed=s.start,
                    )
                )
                continue  # the worker cannot run a step that skips positions or repeats them
            plain = s.num_tokens - s.drafts
            draft_ids = tuple(
                d if d >= 0 else (self.proposed.get(s.seq_id, ()) + (0,) * s.drafts)[j]
                for j, d in enumerate(s.draft_ids)
            )
            end = start + s.num_tokens
            with_drafts = attrs.evolve(seq, tokens=(*seq.tokens[: start + plain], *draft_ids))
            if start + plain < len(seq.tokens) and s.drafts:
                self.pending.append(
                    Violation(
                        "kv-readback",
                        f"seq {s.seq_id}: draft tokens scheduled before the prompt is computed",
                        kind="drafts-in-prompt",
                        seqs=(s.seq_id,),
                        positions=(start + plain,),
                        expected=len(seq.tokens),
                        observed=start + plain,
                    )
                )
                continue
            starts = self.recent_starts.setdefault(s.seq_id, [])
            starts.append(start)
            del starts[: -(self.async_depth + 1)]  # the steps in flight and this one
            lo = starts[0] if self.async_depth else start
            # Under async scheduling the scheduler reserves up to its optimistic end (drafts
            # of the step in flight counted as accepted): the step spans both.
            reserved = max(end, s.start + s.num_tokens) + self.target.num_lookahead_tokens
            seq = attrs.evolve(seq, step=(lo, reserved))
            self.seqs[s.seq_id] = seq
            self._write(with_drafts, start, end, before)
            if s.drafts:
                self.counts["draft_steps"] += 1
            if s.num_tokens < len(seq.tokens) - start and not s.drafts:
                self.counts["chunks"] += 1
            if start + plain < len(seq.tokens):
                self.seqs[s.seq_id] = attrs.evolve(seq, num_computed=start + plain)
                sampled[s.seq_id] = []
                continue
            accepted = min(code % (s.drafts + 1), s.drafts) if s.drafts else 0
            rejected = range(start + plain + accepted, end)
            self.counts["rejected"] += len(rejected)
            self.counts["accepted"] += accepted
            self._discard(with_drafts, rejected)
            new = [*draft_ids[:accepted], token]
            sampled[s.seq_id] = new
            self.seqs[s.seq_id] = attrs.evolve(
                seq,
                tokens=(*seq.tokens[: start + plain], *new),
                num_computed=start + plain + accepted,
            )
            if self.config.max_lookahead:
                self.proposed[s.seq_id] = tuple(
                    (token + j) % DRAFT_ALPHABET for j in range(self.config.max_lookahead)
                )
                drafts_out[s.seq_id] = list(self.proposed[s.seq_id])
        return sampled, drafts_out

    def _write(self, seq: SeqModel, start: int, end: int, before: HybridState) -> None:
        """The KV of positions start .. end-1 into the request's table in every group."""
        state = self.state
        faults = []
        for gi, g in enumerate(state.groups):
            view = group_state(state, gi)
            if seq.seq_id not in view.tables:
                self.pending.append(
                    Violation(
                        "kv-readback",
                        f"group {g.spec.name}: seq {seq.seq_id} is scheduled but has no block table",
                        kind="no-table",
                        seqs=(seq.seq_id,),
                        group=g.spec.name,
                    )
                )
                continue
            if g.spec.state:
                writes, fs = self._state_step(view, seq, start, end, g, group_state(before, gi))
            else:
                writes, fs = plan_step_writes(
                    view, seq, start, end, g.spec.block_size, self.memory, before=group_state(before, gi)
                )
            faults.extend(fs)
            for w in writes:
                self.memory[w.cell] = w.kv
        # Write facts carry no invariant ID: the spec functions say which one each breaks.
        self.pending.extend(immutability(faults))
        self.pending.extend(admission_soundness(unmapped=faults))

    def _state_step(
        self, view: KVState, seq: SeqModel, start: int, end: int, g: GroupState, before: KVState
    ) -> tuple[list[Write], list[WriteFault]]:
        """A state group's step: it reads the state after ``start`` tokens, then leaves the state
        after ``end`` (spec/kv_memory.py ``plan_state_write``)."""
        table = view.tables[seq.seq_id]
        if start:
            for v in state_readback_faults(
                table, attrs.evolve(seq, num_computed=start), g.spec.block_size, self.memory
            ):
                self.pending.append(v.named("kv-readback").in_group(g.spec.name))
        return plan_state_write(view, seq, end, g.spec.block_size, self.memory, before=before)

    def _discard(self, seq: SeqModel, positions: range) -> None:
        """A rejected draft's KV is garbage: its cells count as unwritten from now on."""
        for g in self.state.groups:
            table = g.tables.get(seq.seq_id)
            if table is None or g.spec.state:
                continue
            B = g.spec.block_size
            for pos in positions:
                index = pos // B
                if index < len(table.slots) and table.slots[index] is not None:
                    cell = (Device.GPU, table.slots[index], pos % B)
                    if self.memory.get(cell) == (pos, seq.tokens[pos]):
                        del self.memory[cell]

    def _update(self, plan: Any, sampled: dict, drafts: dict) -> None:
        # The sends whose delay has passed are reported in this output (vLLM's
        # ``finished_sending``); the model then holds nothing of those requests.
        sent = sorted(s for s, left in self.sends.items() if left <= 0)
        if sent:
            self.target.update(plan, sampled, drafts, sent=sent)
        else:
            self.target.update(plan, sampled, drafts)
        for seq_id in sent:
            del self.sends[seq_id]
            self.seqs.pop(seq_id, None)
            self.counts["sends_reported"] += 1
        for seq_id in self.sends:
            self.sends[seq_id] -= 1
        # The worker's own knowledge, not the target's word: under a connector that sends every
        # finished request's KV (``sends_kv``), a request finished in an output (not aborted)
        # is sent, and its blocks must stay until the send is reported.
        sends_kv = getattr(self.target, "sends_kv", False)
        for seq_id in list(self.seqs):
            if self.seqs[seq_id].status is Status.RUNNING and not self.target.live(seq_id):
                if sends_kv:
                    # Finished, its blocks kept for the connector's send (a deferred free).
                    self.seqs[seq_id] = attrs.evolve(self.seqs[seq_id], status=Status.SENDING)
                    self.sends[seq_id] = self._send_delay
                    self.counts["sends_deferred"] += 1
                else:
                    del self.seqs[seq_id]  # finished (max_tokens): the scheduler freed it
        self._observe()

    # ------------------------------------------------------------ checking

    def check(self) -> list[Violation]:
        found, self.pending = self.pending, []
        judge = self.judges.judge(self.memory.take())
        found += check_hybrid(self.config, self.state, self.seqs, self.memory, judge)
        collisions: Sequence[HashCollision] = getattr(self.target, "hash_collisions", ())
        for c in collisions:
            a, b = c.first, c.second
            message = f"one block hash {c.hash!r} stands for two token chains: {a.chain} and {b.chain}"
            if c.seqs:
                message += f" (of seqs {', '.join(map(str, c.seqs))})"
            if c.same_tokens:
                message += f", the same tokens in two domains: {_domain(a)} and {_domain(b)}"
                found.append(
                    Violation("prefix-cache-consistency", message, kind="domain-collision", seqs=c.seqs,
                              expected=_domain(a), observed=_domain(b), domains=confused_domains(a.extra, b.extra))
                )
            else:
                found.append(
                    Violation("prefix-cache-consistency", message, kind="hash-collision", seqs=c.seqs,
                              expected=a.chain, observed=b.chain)
                )
        return found

    def finish(self) -> list[Violation]:
        """Abort every request, drain the in-flight outputs and step until the worker has
        reported every KV send; then ``no-leak`` bites."""
        self.ending = True
        for seq_id in sorted(self.seqs):
            self.abort(seq_id)
        self.drain()
        for _ in range(MAX_SETTLE_STEPS):
            if not self.sends:
                break
            found = self.check()  # a verdict on the way is the verdict (the state after it is not)
            if found:
                return found
            self.step(bytes(4), bytes(4))
            self.drain()
        # Requests finished inside update_from_output are gone from seqs already.
        return self.check()

    def cache_counts(self) -> Counter:
        """What the prefix cache saw in this example: admissions per domain kind
        ("cache_salt", "lora", "mm"), partial tails, the KV events the target reported, EAGLE's
        dropped hit blocks and the copy-on-write copies the worker ran."""
        out: Counter = Counter(self.partials)
        for step in self.trace:
            for kind, used in step.args.get("extra", {}).items() if step.op == "arrive" else ():
                if used:
                    out[kind] += 1
        out["events"] = sum(len(g.events or ()) for g in self.state.groups)
        for fmt, n in getattr(self.target, "event_hash_formats", {}).items():
            out[f"event_hashes_{fmt}"] += n  # the hash forms the events carried (int, bytes)
        for key in (
            "eagle_admissions_with_cached_prefix",
            "eagle_dropped_blocks",
            "block_copies",
            "sends_deferred",
            "sends_reported",
            "encoder_inputs",
            "encoder_steps",
        ):
            out[key] = self.counts[key]
        out["encoder_requests"] = len(self.encoded_seqs)
        return out

    def _count_partials(self, before: HybridState, after: HybridState) -> None:
        """Partial-tail entries (a key ending inside its group's block) that appeared, that
        left, and that left while their block became cached under a full key extending them
        (promotion), between two observations."""
        for b, a in zip(before.groups, after.groups, strict=True):
            B = b.spec.block_size
            old = {e for e in b.cached if len(e[0].chain) % B}
            new = {e for e in a.cached if len(e[0].chain) % B}
            self.partials["partial_cached"] += len(new - old)
            for key, block in old - new:
                self.partials["partial_retired"] += 1
                n = len(key.chain)
                if any(
                    blk == block and len(k.chain) % B == 0 and k.chain[:n] == key.chain
                    for k, blk in a.cached
                ):
                    self.partials["partial_promoted"] += 1

    def _observe(self) -> None:
        after = self.target.observe()
        self._count_partials(self.state, after)
        dead = ended_lifetimes(pool_state(self.state), pool_state(after))
        B = max(g.spec.block_size for g in after.groups)
        for device, block in dead:
            for off in range(B):
                self.memory.pop((device, block, off), None)
        self.state = after
        self.operations += 1

    def _record(self, op: str, args: dict[str, Any], outcome: str = "ok") -> None:
        if self.ending:
            args = {**args, END: True}
        step = TraceStep(op, args, outcome)
        self.trace.append(step)
        self.log(step.describe())
