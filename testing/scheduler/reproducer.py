"""Straight-line reproducers for the scheduler machine: a verdict on vLLM's own V1 scheduler as
a short pytest file that imports only vllm, pytest and the standard library.

The trace is re-run once more (testing/artifacts/rerun.py, through the scheduler machine's session of
testing/scheduler/replay.py) on ``VLLMV1SchedulerAdapter`` built with a ``Recorder``
(adapters/recording.py): every line of the file is a construction or a call the adapter
really made, with its arguments -- the release's own config classes (``ModelConfig`` over a
two-layer config.json the test writes into ``tmp_path``, ``SchedulerConfig``,
``CacheConfig``, ``VllmConfig``, the KV-cache groups), the release's ``Scheduler``, then
``add_request`` / ``schedule`` / ``update_from_output`` / ``finish_requests`` in the order the
driver made them, each ``schedule`` followed by an ``assert`` on what it planned (the outputs
after it answer that plan).  At the operation where kvspec saw the violation the file checks
the violated fact, with kvspec's expected value written in as a literal, and fails naming the
invariant with expected and observed values (``scheduler_checks``):

refcount-exact   the pool's ``ref_cnt`` of each wrong block against the live block-table slots
                 holding it over every KV-cache group;
no-leak          after every request is finished: no block of the pool is still referenced;
kv-readback,     a position the request reads (or the step writes) lies in a block of the
admission-       request's table in that group (the table is long enough and the slot is not
soundness        vLLM's null block);
prefix-cache-    two requests whose token chains (in their domains) differ get different block
consistency      hashes.

A verdict whose fact needs kvspec's shadow KV memory (which token a slot holds), a policy
difference (the reference scheduler is kvspec's) or ``progress`` is not written: the report
and ``kvspec replay`` reproduce it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvspec.adapters.harness import v1_scheduler as harness
from kvspec.adapters.recording import Recorder, Unrecordable
from kvspec.adapters.v1_scheduler import VLLMV1SchedulerAdapter, model_files
from kvspec.spec.groups import Shape, pool_state
from kvspec.spec.invariants import Violation
from kvspec.spec.kv_memory import cell_of
from kvspec.spec.registry import live_tables
from kvspec.spec.state import Device, Status, World
from kvspec.testing.artifacts import straight_line
from kvspec.testing.artifacts.reproducer import NotReproducible, Reproducer
from kvspec.testing.blockmanager.driver import TraceStep
from kvspec.testing.scheduler.replay import in_context, scheduler_session

ENGINE = "v1-scheduler"
# What a request is named by in vLLM: kvspec's adapter names seq N's request "seqN".
REQUEST_ID = "seq{}"


def record(
    shape: Shape,
    trace: Sequence[TraceStep],
    focus: Iterable[str] | None,
    before_end: Callable[[Any], None] | None = None,
) -> straight_line.Recording:
    """Re-run ``trace`` on vLLM's scheduler in ``shape``, recording every call the adapter makes
    (``before_end``: straight_line.record's)."""
    watched = set(focus or ()) & SLOT_CHECKS

    def build(s: Shape, recorder: Recorder) -> VLLMV1SchedulerAdapter:
        adapter = VLLMV1SchedulerAdapter(s, recorder=recorder)
        if watched:
            _check_slots_after_schedule(adapter, recorder, sorted(watched)[0])
        return adapter

    # The invariants alone: no reference scheduler.
    session = scheduler_session(shape, None)
    return straight_line.record(
        build, shape, trace, focus, ENGINE, session=session, context=in_context, before_end=before_end
    )


# Invariants whose fact is checked right after the ``schedule()`` that broke it (a request that
# finishes in the same step frees its table before the step's end).
SLOT_CHECKS = frozenset({"kv-readback", "admission-soundness"})
SLOT_MARK = "# every position a step schedules lies in a block of its request's table"


def _check_slots_after_schedule(adapter: VLLMV1SchedulerAdapter, recorder: Recorder, invariant: str) -> None:
    """After each ``schedule()``: the first position the plan schedules that lies in no block of
    its request's table (in a KV-cache group of one block per position) is written into the
    file as a check at that point, once."""
    schedule = adapter.schedule

    def checked() -> Any:
        plan = schedule()
        if not any(line.code.startswith(SLOT_MARK) for line in recorder.lines):
            lines = _missing_slot(adapter.observe(), plan, invariant)
            if lines:
                recorder.insert("\n".join([SLOT_MARK, *lines]))
        return plan

    adapter.schedule = checked  # type: ignore[method-assign]


def _missing_slot(state: Any, plan: Any, invariant: str) -> list[str]:
    for s in plan.scheduled:
        for gi, group in enumerate(state.groups):
            spec = group.spec
            table = group.tables.get(s.seq_id)
            if spec.state or spec.attention_chunk_size is not None or table is None:
                continue  # a state block or a chunk: not one block per position
            for pos in range(s.start, s.start + s.num_tokens):
                if cell_of(table, pos, spec.block_size) is not None:
                    continue
                index = pos // spec.block_size
                name = REQUEST_ID.format(s.seq_id)
                return [
                    f"table = block_table(scheduler, {gi}, {name!r})  # group {spec.name}, blocks of {spec.block_size}",
                    f"if len(table) <= {index} or table[{index}] is None:",
                    f'    pytest.fail(f"[{invariant}] seq {s.seq_id}, group {spec.name}: the step schedules position '
                    f'{pos}: expected it in a block of the table (slot {index}), observed the table {{table}}")',
                ]
    return []


def generate(
    shape: Shape,
    trace: Sequence[TraceStep],
    violations: Sequence[Violation],
    meta: Mapping[str, Any],
) -> Reproducer | NotReproducible:
    """A straight-line reproducer of a scheduler verdict (``violations`` found on ``trace`` in
    ``shape``), or why there is none.  ``meta``: ``vllm_version``, ``focus``."""
    focus = meta.get("focus") or sorted({v.invariant for v in violations}) or None
    try:
        recording = record(shape, trace, focus)
        if recording.crash is None and not recording.violations:
            return NotReproducible("re-running the trace under the recorder found no violation")
        title = f"kvspec reproducer on vLLM {meta.get('vllm_version') or '?'}'s V1 scheduler:"
        text, checks = straight_line.write(
            recording, trace, title=title, config=shape, state_checks=scheduler_checks, setup=setup(shape)
        )
    except (straight_line.NotStraightLine, Unrecordable) as why:
        return NotReproducible(str(why))
    except ModuleNotFoundError as err:
        return NotReproducible(f"writing it replays the trace on vLLM, which does not import here ({err})")
    name = f"test_kvspec_scheduler_{re.sub(r'[^a-z0-9]+', '_', checks[0])}.py"
    return Reproducer(name, text, checks)


def setup(shape: Shape) -> straight_line.Setup:
    """The model folder vLLM's ``ModelConfig`` reads in ``shape``: the files the adapter gives
    it (adapters/v1_scheduler.py ``model_files``: a config.json, a tokenizer, and for a
    multimodal shape the image processor's configs), written by the test into ``tmp_path`` (no
    weights, nothing downloaded)."""
    lines = ["# the model folder vLLM's ModelConfig reads: configs and a tokenizer (no weights, nothing downloaded)"]
    for name, text in model_files(shape).items():
        lines.append(f"(tmp_path / {name!r}).write_text(json.dumps({json.loads(text)!r}))")
    lines.append("model_dir = str(tmp_path)")
    return straight_line.Setup(params="tmp_path", imports=("json",), lines=tuple(lines))


# ---------------------------------------------------------------- the violated facts


def scheduler_checks(recording: straight_line.Recording) -> tuple[list[str], list[Callable[..., Any]], list[str]]:
    """The checks at the failing operation (``straight_line.StateChecks``), each written from
    the driver's observation of the target there, with kvspec's expectation as literals."""
    violated = list(dict.fromkeys(v.invariant for v in recording.violations))
    lines: list[str] = []
    helpers: list[Callable[..., Any]] = []
    named: list[str] = []
    for invariant in violated:
        writer = WRITERS.get(invariant)
        written = writer(recording, invariant) if writer is not None else []
        if written:
            named.append(invariant)
            lines += written
    # The readers the file's checks call, those written into the recorded lines included.
    text = "\n".join([*lines, *(line.code for line in recording.recorder.lines)])
    helpers += [fn for fn in (harness.refcounts, harness.block_table) if f"{fn.__name__}(" in text]
    return lines, helpers, named


def _refcounts(recording: straight_line.Recording, invariant: str) -> list[str]:
    d = recording.driver
    world = World(d.config, pool_state(d.state), d.seqs, d.memory)
    holders: Counter[int] = Counter()
    for table in live_tables(world, Device.GPU):
        holders.update(table.held())
    wrong = {b: holders.get(b, 0) for b, rc in d.state.pool.refcounts.items() if rc != holders.get(b, 0)}
    if not wrong:
        return []
    return [
        f"expected = {wrong!r}  # the live block-table slots holding each block, over every KV-cache group",
        "observed = {b: refcounts(scheduler)[b] for b in expected}",
        "if observed != expected:",
        f'    pytest.fail(f"[{invariant}] refcounts: expected {{expected}}, observed {{observed}}")',
    ]


def _leak(recording: straight_line.Recording, invariant: str) -> list[str]:
    if recording.driver.seqs:
        return []  # judged while requests live: the end of the run was not reached
    return [
        "in_use = {b: rc for b, rc in refcounts(scheduler).items() if rc}",
        "if in_use:  # every request is finished or aborted",
        f'    pytest.fail(f"[{invariant}] expected no block in use, observed refcounts {{in_use}}")',
    ]


def _unmapped(recording: straight_line.Recording, invariant: str) -> list[str]:
    """The first position a live request reads or writes whose block is missing from its table:
    the check written after the step's ``schedule()`` (``_check_slots_after_schedule``), else
    one at the end of the failing operation."""
    if any(line.code.startswith(SLOT_MARK) for line in recording.recorder.lines):
        return ["# the slot check after the failing step's schedule() above is where it fails"]
    d = recording.driver
    for gi, group in enumerate(d.state.groups):
        spec = group.spec
        if spec.state or spec.attention_chunk_size is not None:
            continue  # a state block or a chunk: not one block per position read
        for seq_id, table in sorted(group.tables.items()):
            seq = d.seqs.get(seq_id)
            if seq is None or seq.status is not Status.RUNNING:
                continue
            # kv-readback: the positions computed so far; admission-soundness: also the ones the
            # step wrote (its reservation less the lookahead slots, which nothing writes).
            written = seq.step[1] - d.target.num_lookahead_tokens
            end = max(seq.num_computed, written if invariant == "admission-soundness" else 0)
            for pos in range(spec.first_attended(seq.num_computed), end):
                if cell_of(table, pos, spec.block_size) is not None:
                    continue
                index = pos // spec.block_size
                name = REQUEST_ID.format(seq_id)
                return [
                    f"table = block_table(scheduler, {gi}, {name!r})  # group {spec.name}, blocks of {spec.block_size}",
                    f"if len(table) <= {index} or table[{index}] is None:",
                    f'    pytest.fail(f"[{invariant}] seq {seq_id}, group {spec.name}: expected position {pos} in a '
                    f'block of its table (slot {index}), observed the table {{table}}")',
                ]
    return []


def _hash_collision(recording: straight_line.Recording, invariant: str) -> list[str]:
    """Two requests whose block chains differ (tokens or domain) under one block hash."""
    adapter = recording.driver.target.inner
    return straight_line.hash_collision(adapter, adapter.hash_block_size, recording.recorder, invariant)


WRITERS: dict[str, Callable[[straight_line.Recording, str], list[str]]] = {
    "refcount-exact": _refcounts,
    "no-leak": _leak,
    "kv-readback": _unmapped,
    "admission-soundness": _unmapped,
    "prefix-cache-consistency": _hash_collision,
}


__all__ = ["generate", "record", "scheduler_checks"]
