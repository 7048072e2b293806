"""The driver: calls an implementation the way vLLM's scheduler does, models the worker's KV
writes, and checks every invariant after every operation.

Both the hypothesis machines and ``replay`` go through here, so a recorded trace re-runs
exactly what a machine ran.  The driver is the scheduler model; the implementation under
test never sees the shadow memory or the sequences' token bookkeeping.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from kvspec.spec.config import Config
from kvspec.spec.errors import NoFreeBlocks, Rejected, Unsupported
from kvspec.spec.interface import Admission, BlockCopy, Capability, Implementation
from kvspec.spec.invariants import (
    INVARIANTS,
    Violation,
    admission_soundness,
    check_world,
    immutability,
    normalized,
)
from kvspec.spec.kv_memory import (
    WriteFault,
    copy_cells,
    copy_overwrites,
    ended_lifetimes,
    plan_step_writes,
    starts_no_life,
)
from kvspec.spec.prefix_hash import ExtraKeys, as_extra
from kvspec.spec.state import Device, KVState, SeqModel, Status, World
from kvspec.spec.window import first_needed_block
from kvspec.testing.blockmanager.completeness import CompletenessObserver
from kvspec.testing.blockmanager.incremental import IncrementalChecker, TouchedMemory, check_both, check_mode
from kvspec.testing.guard import Crash, GuardTripped

_EXTRA_CAPS = {
    "cache_salt": Capability.CACHE_SALT,
    "lora": Capability.LORA,
    "mm": Capability.MULTIMODAL,
}


# An argument marking an operation the example's end performed (a machine's progress drain and
# its freeing or aborting every request: ``Driver.ending``, testing/scheduler/driver.py's).  A
# re-run applies the recorded operations up to the first such one and then runs the end itself
# (testing/artifacts/rerun.py), since what the end judges (a request preempted alone, a loop that
# never finishes: ``progress``) is judged by the end only.
END = "end"


@attrs.frozen
class TraceStep:
    """One operation as the driver performed it: replayable, and readable in a report."""

    op: str
    args: dict[str, Any]
    outcome: str = ""
    crash: Crash | None = None  # what escaped the implementation during this operation

    def describe(self) -> str:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in self.args.items())
        return f"{self.op}({shown}) -> {self.outcome}"

    def to_json(self) -> dict[str, Any]:
        data = {"op": self.op, "args": self.args, "outcome": self.outcome}
        if self.crash is not None:
            data["crash"] = self.crash.to_json()
        return data


class SpecViolation(AssertionError):
    """Raised by the machines when an invariant is violated; carries the trace."""

    def __init__(self, violations: Sequence[Violation], trace: Sequence[TraceStep]) -> None:
        self.violations = list(violations)
        self.trace = list(trace)
        lines = [str(v) for v in self.violations]
        lines.append("trace:")
        lines.extend(f"  {i}. {s.describe()}" for i, s in enumerate(self.trace, 1))
        super().__init__("\n".join(lines))


# The invariants that say the target's own block accounting agrees with its block tables.
# A focused run reads them after a failed operation even when it does not watch them
# (``Driver.accounting_broken``).
ACCOUNTING = frozenset({"refcount-exact", "conservation"})

_TRACE_ARG = {"seq_id": "seq", "parent_id": "parent", "child_id": "child"}


def record_crash(
    trace: list[TraceStep],
    mark: int,
    op: str,
    args: dict[str, Any],
    crash: Crash,
    error: BaseException,
    config: Any,
) -> TraceStep:
    """Record in ``trace`` the operation that crashed (it began when the trace held ``mark``
    steps): the step it recorded, its answer so far kept, or a new one when it crashed before
    recording; anything recorded after is dropped.  A guard's trip carries the trace and the
    configuration (``config``) out of the search."""
    if len(trace) > mark:
        recorded = trace[mark]
        said = "" if recorded.outcome in ("", "ok") else f"{recorded.outcome}; then "
        step = attrs.evolve(recorded, outcome=f"{said}{crash.describe()}", crash=crash)
        del trace[mark:]
    else:
        step = TraceStep(op, args, crash.describe(), crash)
    trace.append(step)
    if isinstance(error, GuardTripped):
        error.trace = list(trace)
        error.config = config
    return step


def trace_args(signature: inspect.Signature, args: tuple, kw: dict[str, Any]) -> dict[str, Any]:
    """An operation's arguments as a trace step records them (JSON-ready; ids under their
    trace names, bytes in hex, an empty request domain left out)."""
    bound = signature.bind(*args, **kw)
    bound.apply_defaults()
    out: dict[str, Any] = {}
    for k, v in list(bound.arguments.items())[1:]:
        if k == "extra":
            if v:
                out["extra"] = as_extra(v).to_json()
            continue
        out[_TRACE_ARG.get(k, k)] = list(v) if k == "tokens" and not isinstance(v, bytes) else (
            v.hex() if isinstance(v, bytes) else v
        )
    return out


class _Target:
    """The implementation as the driver calls it: remembers which call an exception escaped,
    so that a crash of the target is told apart from the driver failing to apply a step."""

    def __init__(self, inner: Implementation) -> None:
        self.inner = inner
        self.escaped: tuple[str, BaseException] | None = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name.startswith("_") or not callable(attr) or isinstance(attr, type):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            try:
                return attr(*args, **kw)
            except (Rejected, Unsupported):
                raise  # answers the driver handles
            except BaseException as error:
                self.escaped = (name, error)
                raise

        return call


def _operation(method: Callable[..., Any]) -> Callable[..., Any]:
    """A driver operation whose implementation may crash: the crashing step is recorded as
    crashed (the call, the exception, the target's file:line), and nothing after it."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def run(self: Driver, *args: Any, **kw: Any) -> Any:
        mark = len(self.trace)
        self.impl.escaped = None
        try:
            return method(self, *args, **kw)
        except BaseException as error:
            escaped = self.impl.escaped
            if self.crash is None and escaped is not None and escaped[1] is error:
                step_args = trace_args(signature, (self, *args), kw)
                self._crashed(mark, method.__name__, step_args, escaped[0], error)
            raise

    return run


class Driver:
    def __init__(
        self,
        impl: Implementation,
        *,
        focus: Iterable[str] | None = None,
        log: Callable[[str], None] | None = None,
        checking: str | None = None,
    ) -> None:
        """``checking``: how the state invariants are evaluated (``incremental.MODES``; None:
        ``KVSPEC_CHECK``, else incremental, which equals the whole-world definition)."""
        self.impl = _Target(impl)
        self.config: Config = impl.config
        self.crash: Crash | None = None  # set when the implementation crashed (then abandoned)
        # The first unwatched violation of the target's block accounting (``ACCOUNTING``) that
        # an operation failing after its own check said yes left behind, if a focused check met
        # one: the machine abandons the example there (``check``).
        self.accounting_broken: Violation | None = None
        self._failed_after_yes = False  # such a failure since the last check
        self.focus = frozenset(focus) if focus is not None else None
        if self.focus is not None:
            unknown = self.focus - set(INVARIANTS)
            if unknown:
                raise ValueError(f"unknown invariant id(s): {sorted(unknown)}")
        self.log = log or (lambda _msg: None)
        self.quiet = log is None  # nobody reads the log: operations are not described
        self.seqs: dict[int, SeqModel] = {}
        self.memory: TouchedMemory = TouchedMemory()  # (device, block, offset) -> (position, token)
        self.checking = check_mode(checking)
        self.incremental = IncrementalChecker(self.config)
        self.trace: list[TraceStep] = []
        # Whether the example's end runs (the progress drain, freeing every sequence): its
        # operations are recorded as the end's (``END``).
        self.ending = False
        self.pending: list[Violation] = []
        self.state: KVState = impl.observe()
        self.before_op: KVState = self.state
        self.operations = 0
        self.checked: set[str] = set()
        self.memory_version = 0  # bumped by every change to ``memory``
        self.refusal_window_drops = 0  # refusals that released window blocks (a freedom)
        # admission-/reserve-/hit-completeness: judged against the target's declared policy.
        self.completeness = CompletenessObserver(self)
        # The last (before, after, ended_lifetimes) computed: a step's write plan asks again.
        self._lifetimes: tuple[KVState | None, KVState | None, set] = (None, None, set())
        # The last world every state invariant passed on: the checks are pure functions of
        # the world, so an operation that changed nothing (most refusals) needs none.
        self._clean: tuple[KVState, dict[int, SeqModel], int] | None = None

    # ------------------------------------------------------------ queries

    def has(self, capability: Capability) -> bool:
        return capability in self.impl.capabilities

    def extra_kinds(self) -> frozenset[str]:
        """The kinds of extra key (``strategies.EXTRA_KINDS``) the implementation keys by."""
        return frozenset(k for k, cap in _EXTRA_CAPS.items() if self.has(cap))

    @property
    def events_seen(self) -> int:
        """KV-cache events the implementation has reported so far (0 if it reports none)."""
        return sum(len(p.events or ()) for p in (self.state.gpu, self.state.cpu) if p is not None)

    def running(self) -> list[int]:
        return [s for s, m in self.seqs.items() if m.status is Status.RUNNING]

    def with_status(self, status: Status) -> list[int]:
        return [s for s, m in self.seqs.items() if m.status is status]

    # ------------------------------------------------------------ operations

    @_operation
    def admit(
        self,
        seq_id: int,
        tokens: Sequence[int],
        num_new_tokens: int,
        next_token: int = 0,
        extra: ExtraKeys | tuple = (),
    ) -> bool:
        """Admission of a new (or preempted) sequence, in domain ``extra``, and its first step."""
        tokens = tuple(tokens)
        extra = as_extra(extra)
        old = self.seqs.get(seq_id)
        if old is not None and old.status is not Status.WAITING:
            raise AssertionError(f"driver bug: seq {seq_id} admitted while live")
        args: dict[str, Any] = {
            "seq": seq_id,
            "tokens": list(tokens),
            "num_new_tokens": num_new_tokens,
            "next_token": next_token,
        }
        if extra:
            args["extra"] = extra.to_json()
        before = self.before_op = self.state
        answer: Admission | None = None
        if self.has(Capability.ADMISSION_CHECK):
            answer = self.impl.can_admit(seq_id, tokens, num_new_tokens, extra)
            if answer is not Admission.OK:
                self._refused(before, answer_ok=False, error=None, seq=seq_id)
                self.pending.extend(
                    self.completeness.admission_refused(
                        before, seq_id, tokens, num_new_tokens, extra, answer.value
                    )
                )
                self._record("admit", args, f"can_admit={answer.value}")
                return False
        try:
            hit = self.impl.admit(seq_id, tokens, num_new_tokens, extra)
        except Rejected as err:
            # Without a separate check (V1), NoFreeBlocks is the implementation's own check
            # saying yes and its allocation then failing.
            ok = answer is Admission.OK or (answer is None and isinstance(err, NoFreeBlocks))
            need = self.completeness.admission_facts(before, seq_id, tokens, num_new_tokens, extra, "").need
            self._refused(before, answer_ok=ok, error=err, seq=seq_id, need=need)
            if not ok:
                self.pending.extend(
                    self.completeness.admission_refused(
                        before, seq_id, tokens, num_new_tokens, extra, type(err).__name__
                    )
                )
            verdict = "" if answer is None else f"can_admit={answer.value}, "
            self._record("admit", args, f"{verdict}refused: {type(err).__name__}")
            return False
        self._observe()
        self.pending.extend(self.completeness.lookup_done(before, seq_id, tokens, extra, hit))
        self.completeness.admitted_as(seq_id)
        end = min(hit + max(1, num_new_tokens), len(tokens))
        # The admission reserves the lookahead slots the target declares it does.
        self.seqs[seq_id] = SeqModel(
            seq_id,
            tokens,
            num_computed=hit,
            step=(hit, end + self.admit_lookahead),
            extra=extra,
            prompt_len=len(tokens),
        )
        verdict = "" if answer is None else f"can_admit={answer.value}, "
        self._record("admit", args, f"{verdict}admitted, {hit} cached tokens")
        self._compute(seq_id, hit, end, [], next_token)
        return True

    @property
    def lookahead(self) -> int:
        """Speculative slots every step reserves (a constant of the run, as in vLLM)."""
        return self.config.max_lookahead if self.has(Capability.LOOKAHEAD) else 0

    @property
    def admit_lookahead(self) -> int:
        """Speculative slots an admission reserves past its first step: what the target declares
        (spec/interface.py ``admit_lookahead``), else every step's."""
        declared = getattr(self.impl, "admit_lookahead", None)
        return self.lookahead if declared is None else min(declared, self.lookahead)

    @_operation
    def step(self, seq_id: int, num_new_tokens: int, next_token: int = 0) -> bool:
        """One scheduler step for a running sequence: a prefill chunk or a decode token."""
        lookahead = self.lookahead
        seq = self.seqs[seq_id]
        assert seq.status is Status.RUNNING
        start = seq.num_computed
        remaining = len(seq.tokens) - start
        k = max(1, min(num_new_tokens, remaining))
        args = {"seq": seq_id, "num_new_tokens": k, "next_token": next_token}
        before = self.before_op = self.state
        try:
            copies = self.impl.reserve(seq_id, k, lookahead)
        except Rejected as err:
            # NotAdmitted is the reservation check refusing; NoFreeBlocks is the allocation
            # failing after the check (legacy can_append_slots) said yes.
            need = self.completeness.reserve_facts(before, seq_id, k, lookahead).need
            self._refused(before, answer_ok=isinstance(err, NoFreeBlocks), error=err, seq=seq_id, need=need)
            if not isinstance(err, NoFreeBlocks):
                self.pending.extend(self.completeness.reserve_refused(before, seq_id, k, lookahead))
            self._record("step", args, f"refused: {type(err).__name__}")
            return False
        self._observe()
        # Slots reserved ahead by an earlier step (lookahead) may still be held.
        reserved_end = max(start + k + lookahead, seq.step[1])
        self.seqs[seq_id] = attrs.evolve(seq, step=(start, reserved_end))
        self._record("step", args, f"ok, copies={copies}" if copies else "ok")
        self._compute(seq_id, start, start + k, copies, next_token)
        return True

    @_operation
    def fork(self, parent_id: int, child_id: int) -> None:
        self._record("fork", {"parent": parent_id, "child": child_id}, "ok")
        self.impl.fork(parent_id, child_id)
        self.completeness.forked(parent_id, child_id)
        self.seqs[child_id] = attrs.evolve(self.seqs[parent_id], seq_id=child_id)
        self._observe()

    @_operation
    def free(self, seq_id: int) -> None:
        self._record("free", {"seq": seq_id}, "ok")
        if self.seqs[seq_id].status is not Status.WAITING:
            self.impl.free(seq_id)
        del self.seqs[seq_id]
        self._observe()

    @_operation
    def preempt(self, seq_id: int) -> None:
        """Preemption by recompute: free now, re-admit with every token later."""
        self._record("preempt", {"seq": seq_id}, "ok")
        self.impl.free(seq_id)
        seq = self.seqs[seq_id]
        self.seqs[seq_id] = attrs.evolve(seq, status=Status.WAITING, num_computed=0, step=(0, 0))
        self._observe()

    def readmit(self, seq_id: int, num_new_tokens: int, next_token: int = 0) -> bool:
        seq = self.seqs[seq_id]
        assert seq.status is Status.WAITING
        return self.admit(seq_id, seq.tokens, num_new_tokens, next_token, seq.extra)

    @_operation
    def swap_out(self, seq_id: int) -> bool:
        return self._swap(seq_id, "swap_out", Device.GPU, Device.CPU, Status.SWAPPED)

    @_operation
    def swap_in(self, seq_id: int) -> bool:
        return self._swap(seq_id, "swap_in", Device.CPU, Device.GPU, Status.RUNNING)

    @_operation
    def reset_prefix_cache(self) -> bool:
        done = self.impl.reset_prefix_cache()
        self._record("reset_prefix_cache", {}, "done" if done else "refused")
        self._observe()
        return bool(done)

    # ------------------------------------------------------------ checking

    def check(self) -> list[Violation]:
        """Every invariant (or the focused ones) on the current world, plus transition ones."""
        found, self.pending = self.pending, []
        clean = (self.state, dict(self.seqs), self.memory_version)
        if clean != self._clean:
            world = World(self.config, *clean[:2], self.memory)
            touched = self.memory.take()
            if self.checking == "full":
                state_found = check_world(world)
            elif self.checking == "both":
                state_found = check_both(self.incremental, world, touched)
            else:
                state_found = self.incremental.check(world, touched)
            self._clean = None if state_found else clean
            found = found + state_found
        self.checked.update(INVARIANTS)
        failed_after_yes, self._failed_after_yes = self._failed_after_yes, False
        if self.focus is not None:
            # vLLM's schedulers do not catch an allocation that fails after their own check said
            # yes: the engine stops there.  A focused run that does not watch admission-soundness
            # goes on past it (C1 lies past F6's failed append, which leaves the accounting
            # whole), but not when the failure also broke the target's accounting (F12's
            # swap_out, not rolled back, leaves CPU block ids in a GPU table): what it meets
            # next is that failure's consequence, a crash on a block id no pool owns.
            if failed_after_yes and self.accounting_broken is None:
                self.accounting_broken = next(
                    (v for v in found if v.invariant in ACCOUNTING and v.invariant not in self.focus), None
                )
            found = [v for v in found if v.invariant in self.focus]
        return found

    def free_all(self) -> list[Violation]:
        """Free every live sequence, then check (``no-leak`` bites here).  After a crash the
        target is abandoned: freeing would only bury the crash under another."""
        if self.crash is not None:
            return []
        self.ending = True
        for seq_id in sorted(self.seqs):
            self.free(seq_id)
        return self.check()

    # ------------------------------------------------------------ internals

    def _swap(self, seq_id: int, op: str, src: Device, dst: Device, status: Status) -> bool:
        before = self.state
        try:
            copies = getattr(self.impl, op)(seq_id)
        except Rejected as err:
            # NoFreeBlocks: the swap's own check (can_swap_out/in) said yes, then it failed.
            self._refused(before, answer_ok=isinstance(err, NoFreeBlocks), error=err, seq=seq_id, device=dst)
            self._record(op, {"seq": seq_id}, f"refused: {type(err).__name__}")
            return False
        except Unsupported:
            raise
        self._record(op, {"seq": seq_id}, f"ok, copies={copies}")
        # Read the sources before the operation's frees end their lifetimes; write the
        # destinations after its allocations start theirs.
        planned = self._plan_copies(copies, src, dst)
        self._observe()
        self._apply_copies(planned)
        self.seqs[seq_id] = attrs.evolve(self.seqs[seq_id], status=status)
        return True

    def _compute(
        self, seq_id: int, start: int, end: int, copies: list[BlockCopy], next_token: int
    ) -> None:
        """The worker: copy-on-write copies, then the KV writes of positions start .. end-1."""
        self._apply_copies(self._plan_copies(copies, Device.GPU, Device.GPU))
        seq = self.seqs[seq_id]
        B = self.config.block_size
        b, a, dead = self._lifetimes
        known = dead if (b is self.before_op and a is self.state) else None
        writes, faults = plan_step_writes(
            self.state, seq, start, end, B, self.memory, before=self.before_op, dead=known
        )
        self._faults(faults)
        for w in writes:
            self.memory[w.cell] = w.kv
        self.memory_version += bool(writes)
        if end > start:
            self.impl.commit(seq_id, end - start)
        seq = attrs.evolve(seq, num_computed=end)
        if end == len(seq.tokens):
            self.impl.append_token(seq_id, next_token)
            seq = attrs.evolve(seq, tokens=(*seq.tokens, next_token))
        self.seqs[seq_id] = seq
        self._observe()
        self.pending.extend(self.completeness.computed(seq_id, start, end))

    def _plan_copies(self, copies: list[BlockCopy], src: Device, dst: Device) -> list[tuple]:
        B = self.config.block_size
        return [(src, a, dst, b, copy_cells(self.memory, (src, a), (dst, b), B)) for a, b in copies]

    def _apply_copies(self, planned: list[tuple]) -> None:
        """Called once ``self.state`` is the state after the operation that reported the copies."""
        faults: list[WriteFault] = []
        for src, a, dst, b, writes in planned:
            if starts_no_life(self.state, dst, b):
                continue  # the operation freed the copy's target again: nothing reads it
            faults += copy_overwrites(self.memory, (src, a), (dst, b), writes)
            for w in writes:
                self.memory[w.cell] = w.kv
                self.memory_version += 1
        self._faults(faults)

    def _faults(self, faults: list[WriteFault]) -> None:
        if faults:
            self.pending.extend(immutability(faults))
            self.pending.extend(admission_soundness(unmapped=faults))

    def _refused(
        self,
        before: KVState,
        *,
        answer_ok: bool,
        error: Exception | None,
        seq: int | None = None,
        need: int | None = None,
        device: Device = Device.GPU,
    ) -> None:
        """A refusal or a failed allocation of ``seq``'s operation (``need``: the blocks the
        spec computes it needs, when known; ``device``: the pool it allocates from): judged by
        ``admission-soundness``."""
        after = self.impl.observe()
        self._failed_after_yes |= answer_ok and error is not None
        first_needed = {
            sid: first_needed_block(m.num_computed, self.config.sliding_window, self.config.block_size)
            for sid, m in self.seqs.items()
            if m.status is Status.RUNNING and error is not None
        }
        self.pending.extend(
            admission_soundness(answer_ok, error, before, after, first_needed, seq=seq, need=need, device=device)
        )
        if error is not None and before != after and normalized(before) != normalized(after):
            self.refusal_window_drops += 1
        self._advance(after)

    def _observe(self) -> None:
        self._advance(self.impl.observe())

    def _advance(self, after: KVState) -> None:
        B = self.config.block_size
        dead = ended_lifetimes(self.state, after)
        self._lifetimes = (self.state, after, dead)
        for device, block in dead:
            for off in range(B):
                if self.memory.pop((device, block, off), None) is not None:
                    self.memory_version += 1
        self.state = after
        self.operations += 1

    def _crashed(
        self, mark: int, op: str, args: dict[str, Any], call: str, error: BaseException
    ) -> None:
        """Record the step that crashed: the one the operation recorded (its answer so far kept),
        or a new one when it crashed before recording; drop anything recorded after."""
        self.crash = Crash.of(call, error)
        if self.ending:
            args = {**args, END: True}
        step = record_crash(self.trace, mark, op, args, self.crash, error, self.config)
        if not self.quiet:
            self.log(step.describe())

    def _record(self, op: str, args: dict[str, Any], outcome: str) -> None:
        if self.ending:
            args = {**args, END: True}
        step = TraceStep(op, args, outcome)
        self.trace.append(step)
        if not self.quiet:
            self.log(step.describe())


# ---------------------------------------------------------------- replay

OPS = (
    "admit",
    "step",
    "fork",
    "free",
    "preempt",
    "readmit",
    "swap_out",
    "swap_in",
    "reset_prefix_cache",
)


def apply_step(driver: Driver, step: TraceStep | dict[str, Any]) -> None:
    """Perform one recorded operation (the outcome is recomputed, not trusted)."""
    op, args = (step.op, step.args) if isinstance(step, TraceStep) else (step["op"], step["args"])
    if op not in OPS:
        raise ValueError(f"unknown operation in trace: {op!r}")
    a = dict(args)
    if op == "admit":
        extra = ExtraKeys.from_json(a.get("extra"))
        driver.admit(a["seq"], a["tokens"], a["num_new_tokens"], a.get("next_token", 0), extra)
    elif op == "step":
        driver.step(a["seq"], a["num_new_tokens"], a.get("next_token", 0))
    elif op == "fork":
        driver.fork(a["parent"], a["child"])
    elif op == "readmit":
        driver.readmit(a["seq"], a["num_new_tokens"], a.get("next_token", 0))
    elif op == "reset_prefix_cache":
        driver.reset_prefix_cache()
    else:
        getattr(driver, op)(a["seq"])


def replay(
    impl: Implementation, trace: Iterable[TraceStep | dict[str, Any]], *, focus=None
) -> tuple[list[Violation], Driver]:
    """Re-run a trace, checking after every operation; stops at the first violation."""
    driver = Driver(impl, focus=focus)
    for step in trace:
        apply_step(driver, step)
        found = driver.check()
        if found:
            return found, driver
    return driver.free_all(), driver


def trace_to_json(trace: Sequence[TraceStep]) -> str:
    return json.dumps([s.to_json() for s in trace], indent=1)


def _short(value: Any) -> str:
    if isinstance(value, list | tuple) and len(value) > 16:
        return f"[{len(value)} tokens: {', '.join(map(str, value[:6]))}, ...]"
    return str(value).replace(" ", "")
