"""The target guard: every call into an implementation runs under a time limit, the run under a
memory cap, and what escapes a call is named (operation, exception, target file:line).

A checkout under review is broken code, and broken code hangs, allocates without bound, or
raises where no scheduler expects it.  The guard turns each of these into an outcome the
command line reports with the trace up to the operation that misbehaved:

* a call that runs longer than ``Limits.op_timeout`` raises ``TargetHung`` inside the target
  (time spent importing modules or waiting on a child process excepted, up to
  ``IMPORT_ALLOWANCE``: vLLM imports lazily and inspects models in a subprocess)
  (``SIGALRM`` from an interval timer; the handler raises between two bytecodes of whatever
  Python code the target is running);
* a run whose resident memory grows past ``Limits.memory_cap_gib`` beyond what the process held
  when the guard was armed raises ``TargetExceededMemory``: sampled by the same timer while a
  call runs and checked every few calls; a soft ``RLIMIT_AS`` above the cap stops a single
  allocation too large to sample (it fails with ``MemoryError``, turned into the same outcome),
  so a runaway target never takes the machine's memory.

Both are ``BaseException``s on purpose: hypothesis shrinks and re-runs a failing example for any
``Exception``, which for a hang costs a timeout per attempt and for a memory runaway ends in
``FlakyStrategyDefinition`` rather than the target's fault.  A ``BaseException`` that is not
``SystemExit``/``GeneratorExit`` ends the search at once (hypothesis' ``core.py``
``failure_exceptions_to_catch``), carrying the trace the driver recorded.

Signals reach only the main thread: elsewhere the time limit is off and ``Guard.notes`` says so.
A hang inside native code that never returns to the interpreter cannot be interrupted this way.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import attrs
from kvspec.spec.config import Config
from kvspec.spec.errors import Rejected, Unsupported

GIB = 1024**3
DEFAULT_OP_TIMEOUT = 60.0  # seconds; a block-manager call takes microseconds to milliseconds
# A call that is importing modules, or waiting on a child process, is not hung: vLLM imports
# lazily (the first scheduler construction imports vLLM and torch, an EAGLE shape's imports the
# speculative config's chain) and inspects a model class in a subprocess on a cold model-info
# cache, each over a minute on a loaded two-core machine.  The time limit counts from the call's
# start or its last sign of progress, and a call may go on for at most this much longer.
IMPORT_ALLOWANCE = 600.0
DEFAULT_MEMORY_CAP_GIB = 4.0
TICK = 0.05  # seconds between samples while a call runs
MEMORY_CHECK_EVERY = 8  # calls between two checks of the memory a run has added
# Address space the run may reserve beyond its memory cap before an allocation fails outright:
# thread stacks and malloc arenas reserve far more address space than they touch.
ADDRESS_SLACK = GIB
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MESSAGE_CHARS = 200  # an exception message is cut to this in a trace line


@attrs.frozen
class Limits:
    """How long one call may run and how much memory the run may add (None: unlimited)."""

    op_timeout: float | None = DEFAULT_OP_TIMEOUT
    memory_cap_gib: float | None = DEFAULT_MEMORY_CAP_GIB

    def to_json(self) -> dict[str, float | None]:
        return {"op_timeout": self.op_timeout, "memory_cap_gib": self.memory_cap_gib}


class GuardTripped(BaseException):
    """A call exceeded a limit.  Not an ``Exception``: the search must stop, not shrink it."""

    kind = "tripped"

    def __init__(self, op: str, message: str) -> None:
        super().__init__(message)
        self.op = op
        self.message = message
        # Filled in by the driver that made the call: the trace up to and including ``op``.
        self.trace: list[Any] = []
        self.config: Config | None = None


class TargetHung(GuardTripped):
    kind = "hung"

    def __init__(self, op: str, seconds: float) -> None:
        super().__init__(op, f"target hung in {op} after {seconds:.3g} s")
        self.seconds = seconds


class TargetExceededMemory(GuardTripped):
    kind = "memory"

    def __init__(self, op: str, cap_gib: float, grown: int | None) -> None:
        grew = f" (the process grew by {grown / GIB:.2f} GiB)" if grown is not None else ""
        super().__init__(op, f"target exceeded {cap_gib:g} GiB in {op}{grew}")
        self.cap_gib = cap_gib
        self.grown = grown


# ------------------------------------------------------------------------------ naming a crash


@attrs.frozen
class Crash:
    """What escaped a call into the implementation."""

    call: str  # the implementation's method (or "construct")
    type: str  # the exception's class name
    message: str
    location: str  # file:line, the innermost frame inside vllm, else the innermost frame

    def describe(self) -> str:
        if self.type in ("TargetHung", "TargetExceededMemory"):
            return f"{self.message} (at {self.location})"
        return f"crashed in {self.call}: {self.type}: {self.message} (at {self.location})"

    def to_json(self) -> dict[str, str]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Crash:
        return cls(*(str(data.get(f.name, "")) for f in attrs.fields(cls)))

    @classmethod
    def of(cls, call: str, error: BaseException) -> Crash:
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if len(message) > MESSAGE_CHARS:
            message = message[: MESSAGE_CHARS - 3] + "..."
        return cls(call, type(error).__name__, message, crash_site(error))


def crash_site(error: BaseException) -> str:
    """``vllm/.../file.py:LINE`` of the innermost traceback frame inside vLLM; without one, the
    innermost frame, named by its module (``kvspec/reference/misbehaving.py:75``)."""
    frames = list(traceback.walk_tb(error.__traceback__))
    while frames and frames[-1][0].f_globals.get("__name__") == __name__:
        frames.pop()  # the guard's own frames: a limit raised in whatever the target ran
    if not frames:
        return "?"
    named = [(_module_path(frame), line) for frame, line in frames]
    for path, line in reversed(named):
        if path.startswith("vllm/"):
            return f"{path}:{line}"
    path, line = named[-1]
    return f"{path}:{line}"


# Whose code an exception escaped from (``raised_in_kvspec``): module prefixes of kvspec's own
# code (the adapters, the machines and drivers, observation, hash learning), less kvspec's own
# implementations under test in reference/ (targets when checked; ``reference/misbehaving.py``
# raises on purpose).
KVSPEC_MODULES = ("kvspec",)
TARGET_MODULES = ("kvspec.reference",)


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def raised_in_kvspec(error: BaseException) -> bool:
    """Whether ``error`` is a bug of kvspec rather than a crash of the target: the raising
    frame (the innermost frame of its traceback outside the standard library, whose frames
    belong to their caller) is kvspec's own code (``KVSPEC_MODULES`` less ``TARGET_MODULES``).
    Any other raising frame is the target's: vLLM's, or that of an implementation defined
    outside kvspec.  A limit the guard enforces (``GuardTripped``) is the target's."""
    if isinstance(error, GuardTripped):
        return False
    for frame, _ in reversed(list(traceback.walk_tb(error.__traceback__))):
        module = str(frame.f_globals.get("__name__") or "")
        if module.partition(".")[0] in sys.stdlib_module_names:
            continue
        return _under(module, KVSPEC_MODULES) and not _under(module, TARGET_MODULES)
    return False


def _module_path(frame: Any) -> str:
    """A path readable across installations: the frame's module as a file path."""
    module = frame.f_globals.get("__name__")
    filename = frame.f_code.co_filename
    if not module or module == "__main__":
        return filename
    stem = module.replace(".", "/")
    return f"{stem}/__init__.py" if filename.endswith("__init__.py") else f"{stem}.py"


def crash_traceback(error: BaseException, limit: int | None = 12) -> list[str]:
    """The target's frames (those below the driver's and the guard's call into it), innermost
    ``limit`` (None: every frame, the callers' too: a bug of kvspec's own is in them), and the
    exception line, as text lines; without hypothesis' notes (the trace is reported on its own)."""
    walked = list(traceback.walk_tb(error.__traceback__))
    cut = 0
    for i, (frame, _) in enumerate(walked):
        if limit is not None and frame.f_globals.get("__name__") in _CALLERS:
            cut = i + 1
    summary = traceback.extract_tb(error.__traceback__)
    kept = summary[cut:] if cut < len(summary) else summary
    frames = traceback.format_list(kept[-limit:] if limit is not None else kept)
    last = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()
    head = last[:1] if last else [type(error).__name__]
    return [ln for chunk in frames for ln in chunk.rstrip("\n").splitlines()] + head


_CALLERS = frozenset({__name__, "kvspec.testing.blockmanager.driver"})  # the frames that call into the target


# ------------------------------------------------------------------------------ the guard


@attrs.define
class Failure:
    """The last exception that escaped a guarded call, with the call and the configuration."""

    call: str
    config: Config | None
    error: BaseException


def _children() -> frozenset[int]:
    """The live children of this process (Linux ``/proc``; elsewhere none)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return frozenset()
    pids: set[int] = set()
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(pid) for pid in f.read().split())
        except (OSError, ValueError):
            continue
    return frozenset(pids)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _started_at(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22;
    proc(5)); None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # The command name (field 2) may hold spaces and parentheses: fields 3.. follow the last ')'.
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def boot_clock() -> float | None:
    """Seconds since boot on the clock ``/proc/PID/stat`` start times count (CLOCK_BOOTTIME);
    None where there is none."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return None if clock is None else time.clock_gettime(clock)


def children_started_since(moment: float | None) -> frozenset[int]:
    """The live children of this process started at or after ``moment`` (``boot_clock()``), to
    the clock tick (``SC_CLK_TCK``, 10 ms on Linux): a child started in the same tick counts,
    the ambiguity resolved for the call (no false hang).  ``/proc`` is read only here, when a
    call has been idle for its whole time limit, so that a call costs no reads."""
    if moment is None:
        return frozenset()
    since = int(moment * _CLOCK_TICKS)
    return frozenset(pid for pid in _children() if (_started_at(pid) or -1) >= since)


def children_since(seconds_ago: float) -> frozenset[int]:
    """The live children started at most ``seconds_ago`` seconds ago (``children_started_since``)."""
    now = boot_clock()
    return children_started_since(None if now is None else now - seconds_ago)


def _rss() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _address_space() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[0]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def address_space_limit(cap_gib: float) -> int | None:
    """The ``RLIMIT_AS`` that lets this process grow by ``cap_gib`` plus slack (``ADDRESS_SLACK``
    or the cap, the larger); None where the address space cannot be read."""
    size = _address_space()
    if size is None:
        return None
    return size + int(cap_gib * GIB) + max(ADDRESS_SLACK, int(cap_gib * GIB))


class Guard:
    """Limits for one run.  ``wrap`` a factory, then call inside ``with guard.armed():``."""

    def __init__(self, limits: Limits, *, address_limit: bool = True) -> None:
        self.limits = limits
        # False: the memory cap is only sampled (for a run that imports vLLM and torch, whose
        # libraries reserve address space far beyond what they touch).
        self.address_limit = address_limit
        self.failure: Failure | None = None  # the last exception that escaped a call
        self.tripped: GuardTripped | None = None
        self.implementation_name: str | None = None
        self.notes: list[str] = []
        self._op: str | None = None
        self._start = 0.0
        self._start_boot: float | None = None  # boot_clock() when the running call began
        self._progress = 0.0  # when the running call last imported a module (or started)
        self._modules = 0  # len(sys.modules) then
        self._baseline = 0
        self._armed = False
        self._timer = False
        self._calls = 0

    # ------------------------------------------------------------ arming

    @contextlib.contextmanager
    def armed(self) -> Iterator[Guard]:
        """Install the timer's handler and the address-space limit; restore both on exit."""
        self._armed = True
        self._baseline = _rss()
        previous_handler = None
        self._timer = self.limits.op_timeout is not None or self.limits.memory_cap_gib is not None
        if self._timer and threading.current_thread() is not threading.main_thread():
            self._timer = False
            self.notes.append("the time limit is off: signals reach only the main thread")
        if self._timer:
            # One periodic timer for the whole run (no system call per target call): a tick
            # outside a call returns at once.
            previous_handler = signal.signal(signal.SIGALRM, self._tick)
            interval = min(TICK, self.limits.op_timeout or TICK)
            signal.setitimer(signal.ITIMER_REAL, interval, interval)
        previous_limit = self._limit_address_space()
        try:
            yield self
        finally:
            self._armed = False
            self._op = None
            if self._timer:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous_handler or signal.SIG_DFL)
            if previous_limit is not None:
                self._restore_address_space(previous_limit)

    @contextlib.contextmanager
    def contained(self) -> Iterator[list[GuardTripped]]:
        """Calls that are kvspec's own extra work on a verdict already reached (the trace
        minimizer's candidate re-runs): a hang inside is collected in the yielded list and the
        guard's state restored, so the run's report is not blamed on a candidate and the run
        goes on (each candidate builds its target afresh; the hung call was unwound by the
        trip).  A memory trip is not undone: the process that ran away is still large, so the
        target stays abandoned, as after any memory trip."""
        tripped, failure = self.tripped, self.failure
        trips: list[GuardTripped] = []
        try:
            yield trips
        finally:
            if self.tripped is not tripped and self.tripped is not None:
                trips.append(self.tripped)
                if isinstance(self.tripped, TargetHung):
                    self.tripped, self.failure = tripped, failure

    def _limit_address_space(self) -> tuple[int, int] | None:
        cap = self.limits.memory_cap_gib
        want = address_space_limit(cap) if cap is not None and self.address_limit else None
        if want is None:
            return None
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and soft <= want:
            return None  # already tighter
        if hard != resource.RLIM_INFINITY and want > hard:
            return None
        try:
            resource.setrlimit(resource.RLIMIT_AS, (want, hard))
        except (ValueError, OSError) as error:
            self.notes.append(f"no address-space limit ({error}); the memory cap is sampled only")
            return None
        return soft, hard

    def _restore_address_space(self, limit: tuple[int, int]) -> None:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, limit)

    def _release_memory_limit(self) -> None:
        """After a memory trip the report still has to be written: lift the limit at once."""
        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))

    # ------------------------------------------------------------ measuring

    def grown(self) -> int:
        return _rss() - self._baseline

    def over_cap(self) -> int | None:
        """How much the process has grown, if past the cap."""
        cap = self.limits.memory_cap_gib
        if cap is None or not self._armed:
            return None
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if peak - self._baseline <= cap * GIB:
            return None  # the high-water mark is a cheap bound on the current size
        grown = self.grown()
        return grown if grown > cap * GIB else None

    def _tick(self, _signum: int, _frame: Any) -> None:
        try:
            self._watch()
        except RecursionError:
            # The signal landed at the interpreter's recursion limit (a deep shrink, a gc callback
            # there): the tick's own frames overflowed it.  Raised, the error would surface in
            # whatever code was running and be blamed on it (a target "crash"); the next tick
            # looks again.
            return

    def _watch(self) -> None:
        """One tick's look at the running call: trip it when hung or over the memory cap."""
        op = self._op
        if op is None:
            return
        if self.tripped is not None:
            raise self.tripped  # the target swallowed it (a bare except): raised again until it lets go
        timeout = self.limits.op_timeout
        now = time.monotonic()
        if len(sys.modules) != self._modules:  # importing (module docstring: IMPORT_ALLOWANCE)
            self._modules, self._progress = len(sys.modules), now
        elif timeout is not None and now - self._progress >= timeout and children_started_since(self._start_boot):
            # Only a child the call started is the call's work: a process the host already had
            # (a test runner's helper, an earlier call's leftover) says nothing about this call.
            self._progress = now
        if timeout is not None:
            elapsed = now - self._start
            idle = now - self._progress
            if idle >= timeout or elapsed >= timeout + IMPORT_ALLOWANCE:
                self._trip(TargetHung(op, timeout if idle >= timeout else elapsed))
        cap = self.limits.memory_cap_gib
        if cap is not None:
            grown = self.grown()
            if grown > cap * GIB:
                self._trip(TargetExceededMemory(op, cap, grown))

    def _trip(self, trip: GuardTripped) -> None:
        # The timer keeps ticking: should the target swallow the trip, the next tick raises it again.
        if isinstance(trip, TargetExceededMemory):
            self._release_memory_limit()
        self.tripped = trip
        raise trip

    # ------------------------------------------------------------ calling

    def call(self, op: str, config: Config | None, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` under the limits; what escapes it is remembered as ``failure``."""
        if self.tripped is not None:
            raise self.tripped  # the target is abandoned: it is in no state to be called again
        if not self._armed:
            return fn(*args, **kw)
        self._start = self._progress = time.monotonic()
        # The call's start on the clock children's start times count (read when the call
        # begins: a timer thread delayed under load would otherwise place it too late).
        self._start_boot = boot_clock()
        self._modules = len(sys.modules)
        self._op = op
        try:
            result = fn(*args, **kw)
        except GuardTripped as trip:
            self.failure = Failure(op, config, trip)
            if trip.config is None:
                trip.config = config  # a driver that made the call may name it first
            raise
        except MemoryError as error:
            cap = self.limits.memory_cap_gib or 0.0
            trip = TargetExceededMemory(op, cap, self.grown())
            self.failure = Failure(op, config, trip)
            with contextlib.suppress(GuardTripped):
                self._trip(trip)
            raise trip from error
        except (Rejected, Unsupported):
            raise  # answers, not failures
        except BaseException as error:
            self.failure = Failure(op, config, error)
            raise
        finally:
            self._op = None
        if self.tripped is not None:
            # The limit was hit during the call and its raise swallowed (a bare ``except`` in the
            # target, or a gc callback, whose exceptions Python only prints), yet the call then
            # returned: it still overran, and this call is the one that fails.
            self.failure = Failure(op, config, self.tripped)
            raise self.tripped
        self._calls += 1
        grown = self.over_cap() if self._calls % MEMORY_CHECK_EVERY == 0 else None
        if grown is not None:
            trip = TargetExceededMemory(op, self.limits.memory_cap_gib or 0.0, grown)
            self.failure = Failure(op, config, trip)
            self._trip(trip)
        return result

    def wrap(self, factory: Callable[[Config], Any]) -> Callable[[Config], Any]:
        """The factory with the construction and every operation of what it builds guarded."""

        def build(config: Config) -> Any:
            impl = self.call("construct", config, factory, config)
            self.implementation_name = str(getattr(impl, "name", "") or "") or None
            return Guarded(impl, self)

        build.guard = self  # type: ignore[attr-defined]  # how a run finds its guard
        return build


class Guarded:
    """An implementation whose public methods run through ``Guard.call``; attributes pass."""

    def __init__(self, inner: Any, guard: Guard) -> None:
        self._inner = inner
        self._guard = guard

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name.startswith("_") or not callable(attr) or isinstance(attr, type):
            return attr
        guard, config = self._guard, getattr(self._inner, "config", None)

        def guarded(*args: Any, **kw: Any) -> Any:
            return guard.call(name, config, attr, *args, **kw)

        guarded.__name__ = name
        return guarded

    def __repr__(self) -> str:
        return f"Guarded({self._inner!r})"


__all__ = [
    "DEFAULT_MEMORY_CAP_GIB",
    "DEFAULT_OP_TIMEOUT",
    "Crash",
    "Failure",
    "Guard",
    "GuardTripped",
    "Guarded",
    "Limits",
    "TargetExceededMemory",
    "TargetHung",
    "address_space_limit",
    "boot_clock",
    "children_since",
    "children_started_since",
    "crash_site",
    "crash_traceback",
    "raised_in_kvspec",
]
