"""Lockstep: one drawn example on BASE and HEAD at once, and the spec judging every difference.

A PR that breaks no invariant may still change what the block manager does: which cached
blocks it evicts, how many tokens a prefix hit returns, how many blocks a request holds,
which KV events it emits.  Lockstep runs the same operations, in the same order, on two
targets -- each in a child process of its own (``serve``), because two vLLM trees cannot be
imported into one interpreter -- and after every operation compares what each side did
(``Observation``), in an explicit mode:

outcomes  every operation is accepted or refused alike, with the same prefix-cache hit, and
          the same crash (exception type, vLLM file and function);
counts    also the free, evictable and cached block counts, the prefix-cache hit rate each
          pool reports, and every sequence's held blocks;
renaming  also the block tables up to a renaming of block ids, the prefix cache's keys, the
          order in which its unreferenced blocks would be evicted (by key), and the KV events
          each operation emitted.  The default.

At the first difference the spec arbitrates on each side's own check (``Driver.check``,
every invariant of ``spec/``): HEAD violates an invariant BASE does not -> ``regression``;
BASE violates one HEAD does not -> ``fix``; otherwise -> ``behaviour change``.  Each verdict
is raised as its own exception class, so hypothesis shrinks each on its own; rounds of the
search step past the fingerprints (verdict, operation, first differing field) already found.

Each child runs the target under the target guard (``guard.Guard``: per-call time limit,
memory cap) through the same ``Driver`` the plain check uses; a child that dies, hangs or runs
away is that side's crash, and it is started afresh for the next example.  Messages are
pickled over the child's stdin and a private copy of its stdout (vLLM's own prints go to
stderr, into a log file).  Both children run with ``PYTHONHASHSEED=0`` so hashing is the same.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, BinaryIO

import attrs
from hypothesis import Phase, note, reject
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.errors import FailedHealthCheck, Flaky, Unsatisfiable
from hypothesis.reporting import with_reporter
from hypothesis.stateful import get_state_machine_test, initialize
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError, KVSpecError, Unsupported
from kvspec.spec.groups import Shape
from kvspec.spec.interface import Capability
from kvspec.spec.invariants import Violation
from kvspec.spec.state import HIT_RATE_DIGITS, SeqModel, Status
from kvspec.testing import profiles as _profiles  # noqa: F401  (registers the ci/dev/deep profiles)
from kvspec.testing.blockmanager.driver import Driver, TraceStep
from kvspec.testing.blockmanager.machine import Features, KVCacheMachine
from kvspec.testing.guard import DEFAULT_MEMORY_CAP_GIB, DEFAULT_OP_TIMEOUT, Crash, Guard, GuardTripped, Limits

CRASH = "crash"  # the verdict's invariant name for a target crash (as the plain check reports it)
CHILD_START_TIMEOUT = 600.0  # seconds: the first build in a child imports vLLM and torch


class Mode(StrEnum):
    OUTCOMES = "outcomes"
    COUNTS = "counts"
    RENAMING = "renaming"


_ORDER = [Mode.OUTCOMES, Mode.COUNTS, Mode.RENAMING]


class Kind(StrEnum):
    REGRESSION = "regression"
    FIX = "fix"
    CHANGE = "behaviour change"


class LockstepError(KVSpecError):
    """A side could not be started or answered out of protocol."""


# ------------------------------------------------------------------------------ observations


@attrs.frozen
class Observation:
    """What one side did in one operation, free of block ids (``renamed``).

    outcome        the operation's answer as the trace records it (admitted with N cached
                   tokens, refused with which error, ok), copy lists reduced to their length
    crash          (exception type, vLLM file, function) of what escaped the target, or ()
    held           (seq, blocks held) for every sequence with a block table
    free           free blocks holding no cached content, per pool
    evictable      unreferenced blocks kept for their cached content, per pool
    cached         prefix-cache map entries, per pool
    hit_rate       the prefix-cache hit rate each pool reports, to ``HIT_RATE_DIGITS`` places
                   (None: it reports none)
    tables         (seq, device, slots) with block ids renamed by first appearance
    cached_keys    the prefix cache's keys (token chain and extra keys), sorted
    eviction_order the keys of the evictable blocks, in the order the free queue holds them
    events         the KV events this operation emitted, in order
    """

    outcome: str = ""
    crash: tuple[str, ...] = ()
    held: tuple[tuple[int, int], ...] = ()
    free: tuple[int, ...] = ()
    evictable: tuple[int, ...] = ()
    cached: tuple[int, ...] = ()
    hit_rate: tuple[float | None, ...] = ()
    tables: tuple[tuple[Any, ...], ...] = ()
    cached_keys: tuple[str, ...] = ()
    eviction_order: tuple[str, ...] = ()
    events: tuple[str, ...] = ()


FIELD_MODE: dict[str, Mode] = {
    "outcome": Mode.OUTCOMES,
    "crash": Mode.OUTCOMES,
    "held": Mode.COUNTS,
    "free": Mode.COUNTS,
    "evictable": Mode.COUNTS,
    "cached": Mode.COUNTS,
    "hit_rate": Mode.COUNTS,
    "tables": Mode.RENAMING,
    "cached_keys": Mode.RENAMING,
    "eviction_order": Mode.RENAMING,
    "events": Mode.RENAMING,
}


# Each observation class's fields, in the order they are compared, with the mode that compares
# them (the scheduler's observation, testing/scheduler/lockstep.py, registers its own).
FIELD_MODES: dict[type, dict[str, Mode]] = {Observation: FIELD_MODE}


def differing(head: Any, base: Any, mode: Mode) -> list[str]:
    """The fields ``mode`` compares on which the two observations differ, in field order."""
    depth = _ORDER.index(mode)
    return [
        name
        for name, field_mode in FIELD_MODES[type(head)].items()
        if _ORDER.index(field_mode) <= depth and getattr(head, name) != getattr(base, name)
    ]


_COPIES = re.compile(r"copies=\[[^\]]*\]")


def crash_violation(crash: tuple[str, ...]) -> Violation:
    """A crash (exception type, module, function) as a violation: its kind the exception
    type, its observed value where it was raised."""
    kind, where = crash[0], ".".join(crash[1:3])
    return Violation(CRASH, f"{kind} in {where}", kind=kind, observed=where)


def _key(key: Any) -> str:
    chain = ",".join(map(str, key.chain))
    return f"[{chain}]{'+' + repr(key.extra) if key.extra else ''}"


def observe(driver: Driver, events_before: int, crash: tuple[str, ...] = ()) -> Observation:
    """The renaming-free observation of ``driver``'s target after its last operation."""
    state = driver.state
    names: dict[tuple[str, int], int] = {}

    def name(device: str, block: int) -> int:
        return names.setdefault((device, block), len(names))

    tables = tuple(
        (seq, t.device.value, tuple(None if b is None else name(t.device.value, b) for b in t.slots))
        for seq, t in sorted(state.tables.items())
    )
    pools = [p for p in (state.gpu, state.cpu) if p is not None]
    gpu = state.gpu
    key_of = gpu.cached_key_of()
    events = tuple(e.describe() + ":" + ";".join(_key(k) for k in e.keys) for e in (gpu.events or ())[events_before:])
    step = driver.trace[-1] if driver.trace else None
    outcome = "" if step is None else f"{step.op}: " + ("crashed" if step.crash else _COPIES.sub(
        lambda m: f"copies={m.group(0).count('(')}", step.outcome))
    return Observation(
        outcome=outcome,
        crash=crash,
        held=tuple((seq, len(t.held())) for seq, t in sorted(state.tables.items())),
        free=tuple(len(p.free) for p in pools),
        evictable=tuple(len(p.evictable) for p in pools),
        cached=tuple(len(p.cached) for p in pools),
        hit_rate=tuple(None if p.hit_rate is None else round(p.hit_rate, HIT_RATE_DIGITS) for p in pools),
        tables=tables,
        cached_keys=tuple(sorted(_key(k) for k, _ in gpu.cached)),
        eviction_order=tuple(_key(key_of[b]) for b in gpu.evictable if b in key_of),
        events=events,
    )


def crash_function(error: BaseException) -> tuple[str, ...]:
    """(type, file, function) of the innermost frame inside vLLM (else the innermost frame):
    line numbers left out, since BASE and HEAD number their lines differently."""
    frames = list(traceback.walk_tb(error.__traceback__))
    named = [(frame.f_globals.get("__name__", "?"), frame.f_code.co_name) for frame, _ in frames]
    inside = [n for n in named if str(n[0]).startswith("vllm")]
    module, function = (inside or named or [("?", "?")])[-1]
    return (type(error).__name__, str(module), function)


# ------------------------------------------------------------------------------ the child


@attrs.frozen
class Reply:
    """A side's answer to one operation."""

    result: Any
    observation: Observation
    violations: tuple[Violation, ...]
    step: TraceStep | None
    seqs: dict[int, SeqModel]
    operations: int
    tripped: bool = False


class _Session:
    """One child's state: the guard (armed for the child's life) and the example's driver."""

    def __init__(self, limits: Limits) -> None:
        self.guard = Guard(limits, address_limit=False)
        self.driver: Driver | None = None
        self.events_seen = 0
        self.impl = ""  # what ``hello`` imported and every ``build`` builds

    def hello(self, impl: str) -> dict[str, Any]:
        """Import the target once, unguarded (importing vLLM and torch takes far longer than any
        operation may), by building it on a small configuration; say what was imported.  A
        build that fails once imported (a constructor that raises) is no failure to start: the
        search's ``build`` meets it under the guard, a crash in construct, which beside a side
        that builds is a verdict.  What cannot be imported is."""
        from kvspec.testing import implementations
        self.impl = impl
        try:
            implementations.factory(impl)(Config(block_size=16, num_blocks=16))
        except (ImportError, SyntaxError):
            raise
        except Exception:  # reported by ``build``, where the search meets it
            pass
        vllm = sys.modules.get("vllm")
        return {"python": sys.executable, "vllm": getattr(vllm, "__file__", None), "pid": os.getpid(),
                "version": getattr(vllm, "__version__", None)}

    def build(self, config: Config, focus: tuple[str, ...] | None) -> dict[str, Any]:
        from kvspec.testing import implementations
        factory = self.guard.wrap(implementations.factory(self.impl))
        try:
            with self.guard.armed():
                target = factory(config)
        except (ConfigError, Unsupported) as error:
            self.driver = None
            return {"unsupported": str(error)}
        except GuardTripped as trip:
            self.driver = None
            return {"crash": (type(trip).__name__, "guard", "construct"), "tripped": True}
        except Exception as error:
            self.driver = None
            return {"crash": crash_function(error)}
        self.driver = Driver(target, focus=focus)
        self.events_seen = self._events()
        return {
            "capabilities": frozenset(target.capabilities),
            "extra_kinds": self.driver.extra_kinds(),
            "name": str(getattr(target, "name", self.impl)),
        }

    def _events(self) -> int:
        d = self.driver
        return len(d.state.gpu.events or ()) if d is not None else 0

    def op(self, name: str, args: tuple[Any, ...]) -> Reply:
        d = self.driver
        assert d is not None, "op before build"
        crash: tuple[str, ...] = ()
        result: Any = None
        try:
            with self.guard.armed():
                result = getattr(d, name)(*args)
        except GuardTripped as trip:
            crash = (type(trip).__name__, "guard", trip.op)
        except Exception as error:  # the target crashed (the driver recorded the step)
            crash = crash_function(error)
        return self._reply(result, crash, [] if crash else d.check())

    def finish(self, drain: bool) -> Reply:
        """The machine's teardown: the scheduler loop drains (progress), then every sequence
        is freed (no-leak)."""
        from kvspec.testing.blockmanager.progress import drain as drain_loop

        d = self.driver
        assert d is not None, "finish before build"
        found: list[Violation] = []
        crash: tuple[str, ...] = ()
        try:
            with self.guard.armed():
                if drain:
                    found += drain_loop(d)
                if not found:
                    found += d.free_all()
        except GuardTripped as trip:
            crash = (type(trip).__name__, "guard", trip.op)
        except Exception as error:
            crash = crash_function(error)
        return self._reply(None, crash, found)

    def _reply(self, result: Any, crash: tuple[str, ...], found: list[Violation]) -> Reply:
        d = self.driver
        assert d is not None
        observation = observe(d, self.events_seen, crash)
        self.events_seen = self._events()
        if crash:
            found = [*found, crash_violation(crash)]
        return Reply(
            result=result if isinstance(result, bool | int | type(None)) else bool(result),
            observation=observation,
            violations=tuple(found),
            step=d.trace[-1] if d.trace else None,
            seqs=dict(d.seqs),
            operations=d.operations,
            tripped=self.guard.tripped is not None,
        )

    def golden(
        self, impl: str, config: Config | Shape, trace: list[TraceStep], title: str, index: int
    ) -> dict[str, Any]:
        from kvspec.testing.artifacts.golden import write_golden, write_scheduler_golden

        if isinstance(config, Shape):  # a scheduler lockstep's verdict: vLLM's own scheduler
            return write_scheduler_golden(config, trace, title, index)
        return write_golden(impl, config, trace, title, index)


CHILD = "kvspec.testing.lockstep"  # the module whose ``serve`` a child runs (the block manager's)


def serve(session_class: type = _Session) -> None:
    """A child's main loop: one pickled request in, one pickled answer out, until EOF; each
    request a call on ``session_class``'s instance."""
    import logging

    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the target prints goes to stderr, never into the channel
    sys.stdout = sys.stderr
    logging.getLogger("vllm").setLevel(logging.ERROR)
    requests = sys.stdin.buffer
    limits = pickle.load(requests)
    session = session_class(limits)
    while True:
        try:
            method, args = pickle.load(requests)
        except EOFError:
            return
        try:
            answer: Any = ("ok", getattr(session, method)(*args))
        except Exception as error:  # a protocol or kvspec fault: the parent reports it
            answer = ("error", "".join(traceback.format_exception(error))[-4000:])
        pickle.dump(answer, channel, protocol=4)
        channel.flush()


# ------------------------------------------------------------------------------ the parent's side


@attrs.frozen
class Side:
    """One target: the interpreter that runs it, and the folder it imports ``vllm`` from."""

    label: str  # "HEAD" or "BASE"
    description: str  # "vLLM 0.33.0", "the checkout /x (run in the vLLM 0.33.0 venv)"
    python: str
    impl: str
    pythonpath: str | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONHASHSEED="0", VLLM_LOGGING_LEVEL="ERROR")
        env.pop("PYTHONPATH", None)
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        return env


class Remote:
    """A child process serving one side."""

    def __init__(self, side: Side, limits: Limits, child: str = CHILD) -> None:
        self.side = side
        self.limits = limits
        self.child = child  # the module whose ``serve`` the child process runs
        self.proc: subprocess.Popen[bytes] | None = None
        handle, name = tempfile.mkstemp(prefix=f"kvspec-lockstep-{side.label.lower()}-", suffix=".log")
        os.close(handle)  # ``start`` opens the file by name for each child it starts
        self.log = Path(name)
        self.starts = 0

    def start(self) -> None:
        self.close()
        self.starts += 1
        log = self.log.open("ab")
        self.proc = subprocess.Popen(
            [self.side.python, "-c", f"from {self.child} import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=self.side.env(),
        )
        log.close()
        self._send(self.limits)

    def _send(self, message: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        pickle.dump(message, self.proc.stdin, protocol=4)
        self.proc.stdin.flush()

    def send(self, method: str, *args: Any) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
            self._send(("hello", (self.side.impl,)))
            self.receive()
        try:
            self._send((method, args))
        except (BrokenPipeError, OSError):
            self.proc = None

    def receive(self) -> Any:
        if self.proc is None:
            raise ChildDied(self._died())
        stream: BinaryIO | None = self.proc.stdout
        assert stream is not None
        try:
            status, value = pickle.load(stream)
        except (EOFError, pickle.UnpicklingError, OSError):
            raise ChildDied(self._died()) from None
        if status != "ok":
            raise LockstepError(f"{self.side.label} ({self.side.description}) failed:\n{value}")
        return value

    def call(self, method: str, *args: Any) -> Any:
        self.send(method, *args)
        return self.receive()

    def _died(self) -> str:
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
        self.proc = None
        tail = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
        return f"{self.side.label} process ended (exit {code}); its log ends:\n{tail}"

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


class ChildDied(LockstepError):
    """A side's process ended in the middle of an example (its crash)."""


def both(remotes: Sequence[Remote], method: str, *args: Any) -> list[Any]:
    """The same request to every side at once (they run in parallel), then their answers; a
    side whose process died answers with the ``ChildDied`` error instead."""
    for remote in remotes:
        remote.send(method, *args)
    answers: list[Any] = []
    for remote in remotes:
        try:
            answers.append(remote.receive())
        except ChildDied as died:
            answers.append(died)
    return answers


# ------------------------------------------------------------------------------ verdicts


@attrs.frozen
class Verdict:
    """The first difference of one example, judged by the spec."""

    kind: Kind
    index: int  # 1-based: the differing operation's place in the trace (len + 1: teardown)
    op: str
    field: str  # the first observation field that differs ("violations" if only those do)
    head: Observation
    base: Observation
    head_violations: tuple[Violation, ...]
    base_violations: tuple[Violation, ...]
    trace: tuple[TraceStep, ...]  # HEAD's record of the operations, the differing one last
    base_step: TraceStep | None  # BASE's record of the differing operation
    config: Config | Shape  # the block manager's configuration, or the scheduler's shape
    mode: Mode

    def fingerprint(self) -> tuple[str, str, str]:
        """What makes two verdicts the same: a regression or a fix by the invariants only one
        side violates, a behaviour change by the field that differs; and the operation."""
        head = {v.invariant for v in self.head_violations}
        base = {v.invariant for v in self.base_violations}
        what = {Kind.REGRESSION: head - base, Kind.FIX: base - head}.get(self.kind, {self.field})
        return (self.kind.value, self.op, ",".join(sorted(what)))

    def values(self) -> tuple[Any, Any]:
        if self.field == "violations":
            return ([str(v) for v in self.head_violations], [str(v) for v in self.base_violations])
        return (getattr(self.head, self.field), getattr(self.base, self.field))

    def headline(self) -> str:
        return f"{self.kind.value}: {self.field} differs at {self.op} (operation {self.index})"

    def describe(self) -> list[str]:
        """The verdict as text lines: headline, both sides at the differing call, the trace."""
        head, base = self.values()
        lines = [self.headline(), f"  on {self.config.describe()}"]
        if self.base_step is not None and self.trace:
            lines.append(f"  HEAD: {self.trace[-1].describe()}")
            lines.append(f"  BASE: {self.base_step.describe()}")
        lines += [f"  HEAD {self.field}: {head}", f"  BASE {self.field}: {base}"]
        for side, found in (("HEAD", self.head_violations), ("BASE", self.base_violations)):
            lines += [f"  {side} violates {v}" for v in found]
        lines.append("  operations:")
        lines += [f"    {i}. {s.describe()}" for i, s in enumerate(self.trace, 1)]
        return lines

    def to_json(self) -> dict[str, Any]:
        head, base = self.values()
        return {
            "verdict": self.kind.value,
            "operation": self.op,
            "index": self.index,
            "field": self.field,
            "mode": self.mode.value,
            "head_value": repr(head),
            "base_value": repr(base),
            "head_observation": {k: repr(v) for k, v in attrs.asdict(self.head).items()},
            "base_observation": {k: repr(v) for k, v in attrs.asdict(self.base).items()},
            "head_violations": [str(v) for v in self.head_violations],
            "base_violations": [str(v) for v in self.base_violations],
            "config": attrs.asdict(self.config),
            "trace": [s.to_json() for s in self.trace],
            "base_step": self.base_step.to_json() if self.base_step else None,
        }


class Difference(AssertionError):
    """Raised at the first difference; one subclass per verdict, so each shrinks on its own."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__("\n".join(verdict.describe()))
        self.verdict = verdict


class Regression(Difference):
    pass


class Fix(Difference):
    pass


class BehaviourChange(Difference):
    pass


RAISED: dict[Kind, type[Difference]] = {Kind.REGRESSION: Regression, Kind.FIX: Fix, Kind.CHANGE: BehaviourChange}


def judge(head: Sequence[Violation], base: Sequence[Violation]) -> Kind:
    """The spec's verdict on a difference: which side violates an invariant the other does not."""
    head_ids = {v.invariant for v in head}
    base_ids = {v.invariant for v in base}
    if head_ids - base_ids:
        return Kind.REGRESSION
    if base_ids - head_ids:
        return Kind.FIX
    return Kind.CHANGE


# ------------------------------------------------------------------------------ the machine


@attrs.define
class LockstepStats:
    """What lockstep compared (a run that compared nothing must not pass)."""

    examples: int = 0
    operations: int = 0
    by_op: dict[str, int] = attrs.Factory(dict)
    shared_violations: int = 0  # operations where both sides violated alike (not a difference)
    shared_crashes: int = 0  # examples ended by the same crash on both sides
    unsupported: int = 0  # drawn configurations a side declared unsupported
    restarts: int = 0


class _Ended(Exception):
    """Both sides crashed alike: the example ends without a verdict."""


class LockstepDriver:
    """Looks like a ``Driver`` to the machine; every operation goes to both sides."""

    observation: type = Observation  # what a side that died observed is built as

    def __init__(
        self,
        remotes: tuple[Remote, Remote],
        config: Config | Shape,
        capabilities: frozenset[Capability],
        extra_kinds: frozenset[str],
        mode: Mode,
        skip: frozenset[tuple[str, str, str]],
        stats: LockstepStats,
        log: Callable[[str], None],
    ) -> None:
        self.remotes = remotes
        self.config = config
        self.capabilities = capabilities
        self._extra_kinds = extra_kinds
        self.mode = mode
        self.skip = skip
        self.stats = stats
        self.log = log
        self.seqs: dict[int, SeqModel] = {}
        self.trace: list[TraceStep] = []
        self.operations = 0
        self.compared = 0

    # the Driver surface the machine reads
    def has(self, capability: Capability) -> bool:
        return capability in self.capabilities

    def extra_kinds(self) -> frozenset[str]:
        return self._extra_kinds

    def with_status(self, status: Status) -> list[int]:
        return [s for s, m in self.seqs.items() if m.status is status]

    def running(self) -> list[int]:
        return self.with_status(Status.RUNNING)

    def check(self) -> list[Violation]:
        return []  # each operation is judged as it happens (_judge)

    # operations
    def _ask(self, method: str, *args: Any) -> list[Any]:
        """One request to both children's sessions."""
        return both(self.remotes, method, *args)

    def _both(self, op: str, *args: Any) -> Any:
        head, base = self._ask("op", op, args)
        try:
            return self._judge(op, head, base)
        except _Ended as ended:
            note(str(ended))
            reject()

    def admit(self, seq_id, tokens, num_new_tokens, next_token=0, extra=()):
        return self._both("admit", seq_id, tuple(tokens), num_new_tokens, next_token, extra)

    def readmit(self, seq_id, num_new_tokens, next_token=0):
        return self._both("readmit", seq_id, num_new_tokens, next_token)

    def step(self, seq_id, num_new_tokens, next_token=0):
        return self._both("step", seq_id, num_new_tokens, next_token)

    def fork(self, parent_id, child_id):
        return self._both("fork", parent_id, child_id)

    def free(self, seq_id):
        return self._both("free", seq_id)

    def preempt(self, seq_id):
        return self._both("preempt", seq_id)

    def swap_out(self, seq_id):
        return self._both("swap_out", seq_id)

    def swap_in(self, seq_id):
        return self._both("swap_in", seq_id)

    def reset_prefix_cache(self):
        return self._both("reset_prefix_cache")

    def finish(self, drain: bool) -> None:
        head, base = self._ask("finish", drain)
        try:
            self._judge("teardown", head, base)
        except _Ended:
            return

    # judging
    def _died(self, answer: Any, op: str) -> Reply:
        if not isinstance(answer, ChildDied):
            return answer
        self.stats.restarts += 1
        crash = ("ChildDied", "process", op)
        step = TraceStep(op, {}, "the process ended", Crash(op, "ChildDied", str(answer)[:200], "?"))
        died = Violation(CRASH, str(answer)[:300], kind="ChildDied", observed=op)
        return Reply(None, self.observation(outcome=f"{op}: crashed", crash=crash), (died,),
                     step, dict(self.seqs), self.operations, tripped=True)

    def _judge(self, op: str, head_answer: Any, base_answer: Any) -> Any:
        head, base = self._died(head_answer, op), self._died(base_answer, op)
        for remote, answer in zip(self.remotes, (head, base), strict=True):
            if answer.tripped:
                remote.close()  # a tripped guard or a dead process: a fresh child next example
        self.compared += 1
        self.stats.operations += 1
        self.stats.by_op[op] = self.stats.by_op.get(op, 0) + 1
        trace = [*self.trace, head.step] if head.step is not None and op != "teardown" else list(self.trace)
        fields = differing(head.observation, base.observation, self.mode)
        head_ids = sorted({v.invariant for v in head.violations})
        base_ids = sorted({v.invariant for v in base.violations})
        if head_ids != base_ids and not fields:
            fields = ["violations"]
        if fields:
            kind = judge(head.violations, base.violations)
            verdict = Verdict(
                kind, len(trace) + (op == "teardown"), op, fields[0], head.observation, base.observation,
                head.violations, base.violations, tuple(trace), base.step if op != "teardown" else None,
                self.config, self.mode,
            )
            if verdict.fingerprint() in self.skip:
                note(f"already found: {verdict.headline()}")
                reject()
            raise RAISED[kind](verdict)
        if head.step is not None and op != "teardown":
            self.trace.append(head.step)
            self.log(head.step.describe())
        self.seqs = head.seqs
        self.operations = head.operations
        if head.violations:
            self.stats.shared_violations += 1
        if head.observation.crash:
            self.stats.shared_crashes += 1
            raise _Ended(f"both sides crashed alike: {head.observation.crash}")
        return head.result


def settle_build(
    remotes: tuple[Remote, Remote], answers: list[Any], config: Config | Shape, stats: LockstepStats,
    observation: type,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both sides' answers to building the target: a crash on one side only is judged (raised
    as its verdict), alike on both is no verdict (rejected), and so is a configuration a side
    does not support; else the two answers."""
    answers = [{"crash": ("ChildDied", "process", "construct"), "tripped": True} if isinstance(a, ChildDied)
               else a for a in answers]
    for remote, answer in zip(remotes, answers, strict=True):
        if answer.get("tripped"):
            remote.close()
    head_crash, base_crash = (a.get("crash", ()) for a in answers)
    if head_crash or base_crash:
        if head_crash == base_crash:
            stats.shared_crashes += 1
            reject()
        found = [(crash_violation(c),) if c else () for c in (head_crash, base_crash)]
        verdict = Verdict(
            judge(*found), 1, "construct", "crash", observation(outcome="construct", crash=head_crash),
            observation(outcome="construct", crash=base_crash), *found, (), None, config, Mode.OUTCOMES,
        )
        raise RAISED[verdict.kind](verdict)
    unsupported = [a["unsupported"] for a in answers if "unsupported" in a]
    if unsupported:
        stats.unsupported += 1
        note(f"configuration not supported: {unsupported[0]}")
        reject()
    return answers[0], answers[1]


class LockstepMachine(KVCacheMachine):
    """The machine's rules, each operation run on HEAD and BASE and compared."""

    def __init__(
        self,
        remotes: tuple[Remote, Remote],
        config_strategy: st.SearchStrategy[Config],
        *,
        mode: Mode = Mode.RENAMING,
        skip: frozenset[tuple[str, str, str]] = frozenset(),
        stats: LockstepStats,
        focus: Iterable[str] | None = None,
        features: Features | None = None,
        log: Callable[[str], None] = note,
    ) -> None:
        super().__init__(lambda c: None, config_strategy, focus=focus, features=features)  # type: ignore[arg-type,return-value]
        self.remotes = remotes
        self.mode = mode
        self.skip = skip
        self.lockstep_stats = stats
        self.log = log
        self.lockstep: LockstepDriver | None = None

    @property
    def d(self):  # type: ignore[override]
        assert self.lockstep is not None
        return self.lockstep

    @initialize(data=st.data())
    def build(self, data):
        config = data.draw(self.config_strategy, label="config")
        note(f"config: {config!r}")
        focus = tuple(self.focus) if self.focus is not None else None
        head, base = settle_build(self.remotes, both(self.remotes, "build", config, focus), config,
                                  self.lockstep_stats, Observation)
        capabilities = head["capabilities"] & base["capabilities"]
        pinned = {"swap": Capability.SWAP, "fork": Capability.FORK, "chunked_prefill": Capability.CHUNKED_PREFILL}
        if any(getattr(self.features, name) and cap not in capabilities for name, cap in pinned.items()):
            self.lockstep_stats.unsupported += 1
            reject()  # a feature pinned on that a side lacks
        self.lockstep = LockstepDriver(
            self.remotes, config, capabilities, head["extra_kinds"] & base["extra_kinds"], self.mode,
            self.skip, self.lockstep_stats, self.log,
        )
        self.driver = self.lockstep  # type: ignore[assignment]  # the rules' precondition reads it

    def _check(self) -> None:
        return  # every operation is compared and judged as it happens

    def teardown(self):
        if self.lockstep is None:
            return
        if self.failed or sys.exc_info()[1] is not None:
            return
        self.lockstep.finish(self.focus is None or "progress" in self.focus)
        self.lockstep_stats.examples += 1  # compared to its end


# ------------------------------------------------------------------------------ the search


@attrs.define
class LockstepRun:
    """One lockstep search: its verdicts (each shrunk), what it compared, how long it took."""

    head: Side
    base: Side
    verdicts: list[Verdict]
    stats: LockstepStats
    examples_requested: int
    steps: int
    rounds: int = 0
    seconds: float = 0.0
    status: str = "compared"  # or "no-examples" / "incomplete: ..."
    # verdict index -> the golden file BASE wrote for it ({"text", "filename"} or {"error"})
    goldens: dict[int, dict[str, Any]] = attrs.Factory(dict)
    imported: dict[str, str] = attrs.Factory(dict)  # side label -> the vLLM its process imported

    def by_kind(self, kind: Kind) -> list[Verdict]:
        return [v for v in self.verdicts if v.kind is kind]


def run_lockstep(
    head: Side,
    base: Side,
    strategy: st.SearchStrategy[Any],
    *,
    profile: str = "ci",
    examples: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    focus: tuple[str, ...] | None = None,
    features: Features | None = None,
    mode: Mode = Mode.RENAMING,
    max_verdicts: int = 3,
    limits: Limits | None = None,
    progress: Callable[[str], None] | None = None,
    golden: bool = True,
    machine: type = LockstepMachine,
    shrink: bool = True,
) -> LockstepRun:
    """Search for differences between HEAD and BASE: rounds of the same search, each stepping
    past the verdicts found before, until a round finds nothing new or ``max_verdicts``.
    ``machine``: the lockstep machine whose rules draw the operations (the block manager's, or
    the scheduler's: testing/scheduler/lockstep.py), built with the arguments
    ``LockstepMachine`` takes, whose ``child`` names the module the target processes serve
    from; ``strategy`` draws what it builds its targets in.  ``shrink=False``: a verdict is
    reported as first met (what a yes/no answer needs, at a fraction of the cost)."""
    limits = limits or Limits(DEFAULT_OP_TIMEOUT, DEFAULT_MEMORY_CAP_GIB)
    child = getattr(machine, "child", CHILD)
    remotes = (Remote(head, limits, child), Remote(base, limits, child))
    base_settings = Settings.get_profile(profile)
    requested = examples if examples is not None else base_settings.max_examples
    step_count = steps if steps is not None else base_settings.stateful_step_count
    chosen = Settings(
        base_settings, max_examples=requested, stateful_step_count=step_count, report_multiple_bugs=False,
        database=None, print_blob=False, deadline=None,
        **({} if shrink else {"phases": [p for p in base_settings.phases if p is not Phase.shrink]}),
    )
    stats = LockstepStats()
    run = LockstepRun(head, base, [], stats, requested, step_count)
    start = time.perf_counter()
    try:
        for remote in remotes:
            remote.start()
            hello = remote.call("hello", remote.side.impl)
            run.imported[remote.side.label] = f"vLLM {hello['version']} from {hello['vllm']}"
        while len(run.verdicts) < max_verdicts:
            run.rounds += 1
            skip = frozenset(v.fingerprint() for v in run.verdicts)
            found = _one_round(machine, remotes, strategy, chosen, seed, focus, features, mode, skip, stats)
            if found is None:
                break
            run.verdicts.append(found)
            if progress is not None:
                progress(found.headline())
        if golden:
            for i, verdict in enumerate(run.verdicts):
                if verdict.kind is Kind.CHANGE:
                    title = f"kvspec golden test: {verdict.headline()}, {base.description} against {head.description}"
                    run.goldens[i] = remotes[1].call("golden", base.impl, verdict.config, list(verdict.trace),
                                                     title, verdict.index)
    except (Unsatisfiable, FailedHealthCheck) as error:
        run.status = f"incomplete: {type(error).__name__}"
    except Flaky as error:  # a difference that did not come back: a side is nondeterministic
        run.status = f"nondeterministic: {type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
    finally:
        for remote in remotes:
            remote.close()
            if run.status == "compared" and not stats.restarts:
                remote.log.unlink(missing_ok=True)  # kept only when a side died or the run failed
    run.seconds = time.perf_counter() - start
    if stats.operations == 0 and not run.verdicts:  # a crash in construct is a verdict
        run.status = "no-examples"
    return run


def _one_round(
    machine: type,
    remotes: tuple[Remote, Remote],
    strategy: st.SearchStrategy[Any],
    chosen: Settings,
    seed: int | None,
    focus: tuple[str, ...] | None,
    features: Features | None,
    mode: Mode,
    skip: frozenset[tuple[str, str, str]],
    stats: LockstepStats,
) -> Verdict | None:
    class Round(machine):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            super().__init__(remotes, strategy, mode=mode, skip=skip, stats=stats, focus=focus, features=features)

    test = get_state_machine_test(Round, settings=chosen)
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    try:
        with with_reporter(lambda _text: None):
            test()
    except Difference as found:
        return found.verdict
    return None


__all__ = [
    "BehaviourChange",
    "Difference",
    "Fix",
    "Kind",
    "LockstepRun",
    "LockstepStats",
    "Mode",
    "Observation",
    "Regression",
    "Side",
    "Verdict",
    "differing",
    "judge",
    "observe",
    "run_lockstep",
    "serve",
    "settle_build",
]
