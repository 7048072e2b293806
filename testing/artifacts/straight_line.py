"""Straight-line reproducers: a violation as a short pytest file in the style of vLLM's own
block-manager tests.

The trace is replayed once more through the adapter with a ``Recorder``
(``kvspec.adapters.recording``), so every line of the file is a call the adapter really made
into vLLM, with the arguments it made it with: build the manager with the release's
constructor, one plain call per line, ``assert`` on each answer the scheduler branched on,
and at the operation where kvspec saw the violation, a check that names the invariant and
prints expected versus observed.  The file imports only vllm, pytest and the standard
library.  What a check needs to read from the manager comes from
``kvspec.adapters.harness`` and is copied in with ``inspect.getsource``: the same function
the adapter uses.
"""

from __future__ import annotations

import functools
import inspect
import re
import textwrap
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from kvspec.adapters.harness import legacy as legacy_harness
from kvspec.adapters.harness import v1 as v1_harness
from kvspec.adapters.recording import Line, Recorder, Unrecordable, real
from kvspec.spec.config import Config
from kvspec.spec.errors import KVSpecError, NoFreeBlocks
from kvspec.spec.invariants import INVARIANTS, USAGE_TOLERANCE, Violation
from kvspec.spec.kv_memory import OVERWRITE, SHARED_WRITE
from kvspec.spec.prefix_hash import key_of
from kvspec.spec.state import Device, Status, TableView
from kvspec.testing.artifacts.rerun import DriverSession, Rerun, Session, SessionFactory, rerun
from kvspec.testing.blockmanager.driver import TraceStep

if TYPE_CHECKING:
    from kvspec.testing.known import GoPast

CRASH = "crash"

# Invariants a straight-line file can check: the count-based ones from the manager's own
# counts and free queue (conservation: the V1 pool's queue and reported usage); immutability (an
# overwrite within one sequence, a write into a shared block) and prefix-cache-consistency (a
# block marked computed that nothing computed) from the slot mapping, the refcounts and the
# computed marks, with kvspec's shadow memory reduced to the few facts the check needs, written
# as literals; prefix-cache-consistency and -isolation also from the block hashes vLLM gave two
# requests (one hash for two chains, or for one chain in two domains: cache salt, LoRA adapter,
# multimodal item).  admission-soundness is written where the allocation raised.
STRAIGHT_CHECKS = frozenset(
    {
        "refcount-exact",
        "no-leak",
        "window-bound",
        "conservation",
        "immutability",
        "prefix-cache-consistency",
        "prefix-cache-isolation",
    }
)
WRITABLE = STRAIGHT_CHECKS | {"admission-soundness"}


@attrs.frozen
class Recording:
    """What replaying a trace under a recorder produced."""

    recorder: Recorder
    violations: tuple[Violation, ...]
    crash: BaseException | None
    failed_at: int  # 1-based operation index; len(trace) + 1 for the final free-all
    driver: Any  # the machine's driver after the replay (testing/blockmanager/driver.py, scheduler_driver.py)
    engine: str = "legacy"  # which harness module's readers the checks use: legacy or v1


class NotStraightLine(KVSpecError):
    """The trace cannot be written as a straight-line file (the reason says why)."""


class Numbered:
    """A re-run's session (testing/artifacts/rerun.py) numbering the recorder's lines by trace operation:
    the end of the run (freeing every sequence, draining) is operation ``len(trace) + 1``."""

    def __init__(self, inner: Session, recorder: Recorder, before_end: Callable[[Any], None] | None = None) -> None:
        self.inner = inner
        self.recorder = recorder
        self.before_end = before_end  # called with the driver after the trace, before the end

    @property
    def trace(self) -> list[TraceStep]:
        return self.inner.trace

    @property
    def crash(self) -> Any:
        return self.inner.crash

    @property
    def difference(self) -> Any:
        return getattr(self.inner, "difference", None)

    @property
    def driver(self) -> Any:
        return self.inner.driver

    def apply(self, step: TraceStep) -> None:
        self.recorder.op_index += 1
        self.inner.apply(step)

    def check(self) -> list[Violation]:
        return self.inner.check()

    def finish(self) -> list[Violation]:
        if self.before_end is not None:
            self.before_end(self.inner.driver)
        self.recorder.op_index += 1
        return self.inner.finish()


def record(
    build: Callable[[Any, Recorder], Any],
    config: Any,
    trace: Sequence[TraceStep],
    focus: Iterable[str] | None = None,
    engine: str = "legacy",
    *,
    session: SessionFactory = DriverSession,
    context: Callable[[Callable[[], Rerun]], Rerun] = lambda run: run(),
    before_end: Callable[[Any], None] | None = None,
    go_past: GoPast | None = None,
) -> Recording:
    """Re-run ``trace`` (testing/artifacts/rerun.py ``rerun``, in ``session``'s machine, inside
    ``context``) on the adapter ``build(config, recorder)`` makes, recording every call;
    ``before_end(driver)`` runs after the trace's last operation, before the run's end frees
    every sequence (the state a caller reads at the trace's last operation); ``go_past``: the
    violations the re-run goes past (a scheduler ``session`` is given the same policy)."""
    recorder = Recorder()
    sessions: list[Numbered] = []
    # A straight-line file writes every recorded operation and then the plain end (freeing every
    # sequence): it applies the end's recorded operations too (``run_end=False``) and runs no drain.
    if session is DriverSession:
        session = functools.partial(DriverSession, go_past=go_past, drains=False)

    def numbered(impl: Any, watched: Iterable[str] | None) -> Numbered:
        sessions.append(Numbered(session(impl, watched), recorder, before_end))
        return sessions[0]

    result = context(
        lambda: rerun(
            lambda c: build(c, recorder), config, trace, focus=focus, session=numbered, go_past=go_past, run_end=False
        )
    )
    if isinstance(result.error, Unrecordable) or (isinstance(result.error, ModuleNotFoundError) and not sessions):
        raise result.error  # a value the file cannot write, or no vLLM here
    if not sessions:
        raise NotStraightLine(f"the target could not be built again: {result.error}")
    if result.unapplied is not None:
        raise NotStraightLine(f"the re-run did not follow the trace: {result.unapplied}")
    crash = result.error if result.crash is not None else None
    return Recording(recorder, tuple(result.violations), crash, recorder.op_index, sessions[0].driver, engine)


# ---------------------------------------------------------------- writing the file


StateChecks = Callable[[Recording], tuple[list[str], list[Callable[..., Any]], list[str]]]
"""The checks at the failing operation: their lines, the reader functions they copy in, and
the invariant IDs they name."""


@attrs.frozen
class Setup:
    """What a machine's file does before the recorded lines: its test function's parameters
    (pytest fixtures), the standard-library modules it imports, and its first lines."""

    params: str = ""
    imports: tuple[str, ...] = ()
    lines: tuple[str, ...] = ()


def write(
    recording: Recording,
    trace: Sequence[TraceStep],
    *,
    title: str,
    config: Config | Any,
    state_checks: StateChecks | None = None,
    setup: Setup = Setup(),
) -> tuple[str, tuple[str, ...]]:
    """The file's text and the IDs its failure names.  ``config`` describes the target's
    configuration (``describe()``); ``state_checks`` writes the checks at the failing operation
    (default: the block manager's, ``_state_checks``); ``setup`` what the file does first."""
    rec = recording.recorder
    body: list[str] = list(setup.lines)
    helpers: list[Callable[..., Any]] = list(rec.helpers)  # what the recorded lines call
    checks: list[str] = []
    last_answer: Line | None = None
    for line in rec.lines:
        if line.op_index > recording.failed_at:
            break
        if line.op_index and (not body or _op_of(body) != line.op_index):
            body.append(f"# {_op_comment(line.op_index, trace)}")
        if line.raised is not None:
            invariant, message = _failure(line, last_answer, recording)
            checks.append(invariant)
            attempt = _expect_no_raise(line, invariant, message)
            if invariant == "admission-soundness" and last_answer is not None and body[-1] == _asserted(last_answer):
                # The property, not the recorded path: once the check answers "no" (a fix),
                # the scheduler never makes the call and the file passes.
                body[-1] = f"if {_condition(last_answer)}:"
                attempt = [f"    {a}" for a in attempt]
            body.extend(attempt)
            break
        if line.answer is not None:
            body.append(_asserted(line))
            last_answer = line
        else:
            body.append(line.code)
    else:
        written, needed, named = (state_checks or _state_checks)(recording)
        body.extend(written)
        helpers.extend(needed)
        checks.extend(named)
    if not checks:
        raise NotStraightLine(_why_not(recording))
    name = "test_" + re.sub(r"\W", "_", checks[0])
    doc = _docstring(title, config, recording, checks)
    # Annotations in the copied helpers stay unevaluated: the file needs no typing import.
    future = ["from __future__ import annotations", ""] if helpers else []
    imports = [*future, *(f"import {m}" for m in setup.imports), "import pytest", *_import_lines(rec)]
    source = [f'"""{doc}"""', "", *imports, ""]
    for fn in dict.fromkeys(helpers):
        source.extend(["", inspect.getsource(fn).rstrip(), ""])
    source.extend(["", f"def {name}({setup.params}):"])
    source.extend(textwrap.indent("\n".join(body), "    ").splitlines())
    return "\n".join(source) + "\n", tuple(dict.fromkeys(checks))


def _op_of(body: list[str]) -> int:
    for line in reversed(body):
        m = re.match(r"# (\d+)\. ", line)
        if m:
            return int(m.group(1))
        if line.startswith("# free every sequence"):
            return -1
    return 0


def _op_comment(index: int, trace: Sequence[TraceStep]) -> str:
    if index > len(trace):
        return "free every sequence (the scheduler's end of run)"
    step = trace[index - 1]
    return f"{index}. {step.describe()}"


def _condition(line: Line) -> str:
    """The recorded answer of an ANSWERS call, as a condition."""
    if line.answer in ("True", "False"):
        return f"{'' if line.answer == 'True' else 'not '}{line.target}"
    return f"{line.target} == {line.answer}"


def _asserted(line: Line) -> str:
    return f"assert {_condition(line)}"


def _failure(line: Line, last_answer: Line | None, recording: Recording) -> tuple[str, str]:
    err = line.raised
    assert err is not None
    if legacy_harness.is_out_of_blocks(err) or isinstance(err, NoFreeBlocks) or _v1_out_of_blocks(err):
        if last_answer is not None and last_answer.op_index == line.op_index:
            asked = last_answer.target.split("(")[0].rsplit(".", 1)[-1]
            said = f"{asked} answered {last_answer.answer}"
        else:
            said = "the scheduler was told the slots fit"
        return "admission-soundness", f"{said}, so expected {line.call} to succeed; observed it raise"
    return CRASH, f"expected {line.call} to return; observed it raise"


def _v1_out_of_blocks(err: BaseException) -> bool:
    """V1 ``BlockPool.get_new_blocks``: "Cannot get N free blocks from the pool" after
    ``allocate_slots`` decided the request fits (it returns None when it does not)."""
    return isinstance(err, ValueError) and "free blocks" in str(err)


READERS = {
    "legacy": {
        "gpu_refcounts": [legacy_harness.is_v1_manager, legacy_harness.gpu_refcounts],
        "gpu_block_ids": [legacy_harness.is_v1_manager, legacy_harness.gpu_block_ids],
        "slot_of": [legacy_harness.is_v1_manager, legacy_harness.slot_of],
        "marked_computed": [legacy_harness.is_v1_manager, legacy_harness.marked_computed],
    },
    "v1": {
        "gpu_refcounts": [v1_harness.gpu_refcounts],
        "gpu_block_ids": [v1_harness.gpu_block_ids],
        "free_queue_ids": [v1_harness.free_queue_ids],
    },
}


def _readers(recording: Recording, name: str) -> list[Callable[..., Any]] | None:
    """The harness functions a check reading ``name`` copies in (None: none on this engine)."""
    return READERS[recording.engine].get(name)


def _expect_no_raise(line: Line, invariant: str, message: str) -> list[str]:
    return [
        "try:",
        f"    {line.code}",
        "except Exception as err:",
        f'    pytest.fail(f"[{invariant}] {message}: {{type(err).__name__}}: {{err}}")',
    ]


def _ids(violations: Sequence[Violation], allowed: frozenset[str]) -> list[str]:
    return [i for i in dict.fromkeys(v.invariant for v in violations) if i in allowed]


def _live_gpu_tables(recording: Recording) -> list[TableView]:
    d = recording.driver
    return [
        t
        for sid, t in d.state.tables.items()
        if t.device is Device.GPU and d.seqs.get(sid) is not None and d.seqs[sid].status is Status.RUNNING
    ]


def _state_checks(recording: Recording) -> tuple[list[str], list[Callable[..., Any]], list[str]]:
    """Checks of the manager's own state at the failing operation, with kvspec's expectation
    written in as literals (computed by the spec, not restated here); and the IDs checked."""
    ids = _ids(recording.violations, STRAIGHT_CHECKS)
    lines: list[str] = []
    helpers: list[Callable[..., Any]] = []
    named: list[str] = []
    d = recording.driver
    if "refcount-exact" in ids:
        named.append("refcount-exact")
        holders: Counter[int] = Counter()
        for table in _live_gpu_tables(recording):
            holders.update(table.held())
        wrong = {b: holders.get(b, 0) for b, rc in d.state.gpu.refcounts.items() if rc != holders.get(b, 0)}
        helpers += _readers(recording, "gpu_refcounts") or []
        lines += [
            f"expected = {wrong!r}  # live block-table slots holding each block",
            "observed = {b: gpu_refcounts(mgr)[b] for b in expected}",
            "if observed != expected:",
            '    pytest.fail(f"[refcount-exact] refcounts: expected {expected}, observed {observed}")',
        ]
    if "window-bound" in ids:
        over = next(v for v in recording.violations if v.invariant == "window-bound")
        if over.seqs and isinstance(over.expected, int):
            named.append("window-bound")
            seq, bound = over.seqs[0], over.expected
            helpers += _readers(recording, "gpu_block_ids") or []
            lines += [
                f"held = gpu_block_ids(mgr, {seq})",
                f"if len(held) > {bound}:  # the blocks the window and this step can touch",
                f'    pytest.fail(f"[window-bound] seq {seq}: expected at most {bound} blocks, '
                f'observed {{len(held)}} ({{held}})")',
            ]
    for inv, check in (
        ("conservation", _conservation_check),
        ("immutability", _overwrite_check),
        ("immutability", _shared_write_check),
        ("prefix-cache-consistency", _uncomputed_hit_check),
        ("prefix-cache-consistency", _collision_check),
        ("prefix-cache-isolation", _collision_check),
    ):
        written = check(recording, helpers, inv) if inv in ids and inv not in named else []
        if written:
            named.append(inv)
            lines += written
    if "no-leak" in ids:
        named.append("no-leak")
        helpers += _readers(recording, "gpu_refcounts") or []
        lines += [
            "in_use = {b: rc for b, rc in gpu_refcounts(mgr).items() if rc}",
            "if in_use:  # every sequence is freed",
            '    pytest.fail(f"[no-leak] expected no block in use, observed refcounts {in_use}")',
        ]
    return lines, helpers, named


def _overwrite_check(recording: Recording, helpers: list[Callable[..., Any]], invariant: str) -> list[str]:
    """Two positions of one sequence mapped to one slot: the later write destroys the earlier."""
    for v in recording.violations:
        readers = _readers(recording, "slot_of")
        if v.invariant != "immutability" or v.kind != OVERWRITE or readers is None:
            continue
        (seq,), (new, old) = v.seqs, v.positions
        helpers += readers
        B = recording.driver.config.block_size
        return [
            f"new, old = slot_of(mgr, {seq}, {new}, {B}), slot_of(mgr, {seq}, {old}, {B})",
            "if new == old:  # the worker writes through this mapping",
            f'    pytest.fail(f"[immutability] seq {seq}: expected position {new} in a slot of its own, '
            f'observed it written over position {old} at (block, offset) {{new}}")',
        ]
    return []


def _conservation_check(recording: Recording, helpers: list[Callable[..., Any]], invariant: str) -> list[str]:
    """The V1 pool's free queue against its refcounts (a block on it twice, on it while in use,
    on it nowhere though unreferenced), or the usage it reports against the share in use."""
    queue = _readers(recording, "free_queue_ids")
    for v in recording.violations:
        if v.invariant != "conservation" or queue is None:
            continue
        if v.kind == "wrong-usage" and isinstance(v.expected, float):
            return [
                f"expected = {v.expected!r}  # the share of the pool's blocks in use",
                f"if abs(mgr.usage - expected) > {USAGE_TOLERANCE}:",
                '    pytest.fail(f"[conservation] pool usage: expected {expected}, observed {mgr.usage}")',
            ]
        wrong = {
            "double-free": ("free.count({b}) > 1", "on the free queue once, observed {{free.count({b})}} times"),
            "in-two-sets": ("{b} in free and refcounts[{b}]", "off the free queue while in use, observed it on "
                            "the queue with refcount {{refcounts[{b}]}}"),
            "lost": ("{b} not in free and not refcounts[{b}]", "on the free queue once unreferenced, observed it "
                     "on neither"),
        }.get(v.kind)
        if wrong is None or len(v.blocks) != 1:
            continue
        (b,), (condition, said) = v.blocks, wrong
        helpers += [*queue, *(_readers(recording, "gpu_refcounts") or [])]
        return [
            "free, refcounts = free_queue_ids(mgr), gpu_refcounts(mgr)",
            f"if {condition.format(b=b)}:",
            f'    pytest.fail(f"[conservation] block {b}: expected it {said.format(b=b)}")',
        ]
    return []


def _shared_write_check(recording: Recording, helpers: list[Callable[..., Any]], invariant: str) -> list[str]:
    """The operation wrote into a block other block-table slots hold (no copy-on-write)."""
    for v in recording.violations:
        readers = _readers(recording, "gpu_refcounts")
        if v.invariant != "immutability" or v.kind != SHARED_WRITE or readers is None or len(v.blocks) != 1:
            continue
        (b,), (seq,) = v.blocks, v.seqs
        helpers += readers
        return [
            f"if gpu_refcounts(mgr)[{b}] > 1:  # seq {seq} wrote into block {b} in this operation",
            f'    pytest.fail(f"[immutability] seq {seq} writes into block {b}: expected a private block, '
            f'observed it shared by {{gpu_refcounts(mgr)[{b}]}} block-table slots")',
        ]
    return []


def _collision_check(recording: Recording, helpers: list[Callable[..., Any]], invariant: str) -> list[str]:
    """Two requests whose chains differ (tokens or domain) given one block hash by vLLM."""
    d = recording.driver
    target = getattr(d, "impl", None) or d.target
    adapter = getattr(target, "inner", target)
    unit = getattr(adapter, "hash_block_size", None) or d.config.block_size
    return hash_collision(adapter, unit, recording.recorder, invariant)


def hash_collision(adapter: Any, unit: int, rec: Recorder, invariant: str) -> list[str]:
    """The check that two requests the file built, whose block chains (tokens, in their domains)
    differ, get different block hashes: from the first of ``adapter.hash_collisions`` (one hash
    learned for two keys) that two of ``adapter.requests()`` named in ``rec`` carry.  Blocks of
    ``unit`` tokens."""
    held = [(real(r), extra) for r, extra in getattr(adapter, "requests", list)()]
    for collision in getattr(adapter, "hash_collisions", ()):
        h, a, b = collision.hash, collision.first, collision.second
        where: dict[Any, tuple[str, int]] = {}
        for request, extra in held:
            label = rec.names.get(id(request))
            tokens = tuple(request.all_token_ids)
            for i, mine in enumerate(getattr(request, "block_hashes", ())):
                if mine == h and label is not None and (i + 1) * unit <= len(tokens):
                    where.setdefault(key_of(tokens, (i + 1) * unit, extra), (label, i))
        if a in where and b in where:
            (ra, ia), (rb, ib) = where[a], where[b]
            return [
                f"# {ra} block {ia}: chain {list(a.chain)} (domain {list(a.extra)}); "
                f"{rb} block {ib}: chain {list(b.chain)} (domain {list(b.extra)})",
                f"if {ra}.block_hashes[{ia}] == {rb}.block_hashes[{ib}]:",
                f'    pytest.fail("[{invariant}] expected different block hashes for different token chains or '
                f'domains, observed {ra}.block_hashes[{ia}] == {rb}.block_hashes[{ib}]: a lookup hands one the '
                'other\'s KV")',
            ]
    return []


def _uncomputed_hit_check(recording: Recording, helpers: list[Callable[..., Any]], invariant: str) -> list[str]:
    """A block the allocator marks computed although no sequence has computed its positions."""
    d = recording.driver
    for v in recording.violations:
        readers = _readers(recording, "marked_computed")
        if v.invariant != "prefix-cache-consistency" or v.kind != "uncomputed-hit" or readers is None:
            continue
        if v.device != Device.GPU.value or not isinstance(v.expected, tuple):
            continue
        (block,), tokens = v.blocks, list(v.expected)
        computed = ", ".join(f"seq {s} {d.seqs[s].num_computed}" for s in sorted(d.seqs))
        helpers += readers
        return [
            f"# tokens computed by the worker so far: {computed}; none wrote block {block}",
            f"if marked_computed(mgr, {block}):",
            f'    pytest.fail("[prefix-cache-consistency] block {block} (tokens {tokens}): expected not '
            f'computed, observed marked computed, so a prefix lookup can hand out KV nothing wrote")',
        ]
    return []


def _why_not(recording: Recording) -> str:
    found = sorted({v.invariant for v in recording.violations})
    if not found:
        return "replaying the trace under the recorder found no violation (the target behaved otherwise)"
    return (
        f"{', '.join(found)} needs kvspec's shadow KV memory model (what the worker wrote into "
        "each slot), which a straight-line file does not carry; the JSON report and "
        "`kvspec replay` reproduce it"
    )


def _import_lines(rec: Recorder) -> list[str]:
    plain = [f"import {module}" for module in sorted(rec.modules)]
    return plain + [f"from {module} import {', '.join(sorted(names))}" for module, names in sorted(rec.imports.items())]


def _docstring(title: str, config: Config, recording: Recording, checks: Sequence[str]) -> str:
    lines = [*textwrap.wrap(f"{title} {config.describe()}; written by kvspec from its shrunk trace.", 92), ""]
    for v in recording.violations:
        if v.invariant in checks:
            lines.extend(textwrap.wrap(str(v), 92))
    if recording.crash is not None:
        lines.extend(textwrap.wrap(f"The target raised {type(recording.crash).__name__}: {recording.crash}", 92))
    for inv_id in dict.fromkeys(checks):
        inv = INVARIANTS.get(inv_id)
        if inv is not None:
            lines.extend(["", *textwrap.wrap(f"{inv.id}: {inv.statement}", 92)])
    text = "\n".join(lines)
    return text.replace('"""', "'''").replace("\\", "\\\\") + "\n"


def describe_target(meta: Mapping[str, Any], impl: str) -> str:
    return f"vLLM {meta.get('vllm_version') or '?'} ({impl})"
