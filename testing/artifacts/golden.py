"""Golden straight-line tests: a behaviour change as the pytest file a maintainer adds when the
change was not intended.

The shrunk trace of a lockstep verdict is replayed on BASE through the adapter with a
``Recorder`` (``kvspec.adapters.recording``), exactly as a reproducer is
(``testing/artifacts/straight_line.py``): one recorded vLLM call per line.  At the differing operation the
file asserts what BASE observed there -- the prefix-cache hit, whether the allocation succeeded,
the free and cached block counts, the legacy managers' prefix-cache hit rate, every request's
held blocks and the block tables up to a renaming of block ids -- read off the manager by the
harness functions the file copies in.  On HEAD at least one of them differs, so the file fails
there and passes on BASE; ``kvspec`` runs it on both before keeping it.  Runs in BASE's target
process (it imports vLLM through the adapters).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

from kvspec.adapters.harness import legacy as legacy_harness
from kvspec.adapters.harness import v1 as v1_harness
from kvspec.adapters.recording import Line, Recorder, Unrecordable, real
from kvspec.spec.config import Config
from kvspec.spec.groups import Shape
from kvspec.spec.state import HIT_RATE_DIGITS, Status
from kvspec.testing.artifacts.straight_line import _asserted, _condition, _import_lines, _op_comment
from kvspec.testing.blockmanager.driver import Driver, TraceStep, apply_step
from kvspec.testing.blockmanager.progress import drain

TAG = "behaviour-change"  # what the file's failure message starts with: [behaviour-change]


def _renamed_expr(seqs: Sequence[int]) -> str:
    ids = ", ".join(f"{s}: gpu_block_ids(mgr, {s})" for s in seqs)
    return f"renamed({{{ids}}})"


def _result_of(lines: list[Line], codes: list[str], index: int, call: str, fallback: str) -> tuple[str, Any] | None:
    """The name the result of operation ``index``'s last ``call`` goes by in the file (its line
    is rewritten to assign ``fallback`` if the recorder left the result unnamed), and the result."""
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line.op_index == index and line.call == call and line.raised is None:
            if " = " in line.code.split("(", 1)[0]:
                return line.code.split(" = ", 1)[0], line.result
            codes[i] = f"{fallback} = {line.target}"
            return fallback, line.result
    return None


def write_golden(impl: str, config: Config, trace: list[TraceStep], title: str, index: int) -> dict[str, Any]:
    """The golden file's text for the difference at operation ``index`` (1-based; past the
    trace: the teardown), or ``{"error": why}`` when it cannot be written."""
    from kvspec.adapters.legacy import LegacyAdapter
    from kvspec.adapters.v1 import VLLMV1Adapter
    from kvspec.testing.artifacts.reproducer import LEGACY_MANAGERS

    engine = "v1" if impl == "v1" else "legacy"
    if impl != "v1" and impl not in LEGACY_MANAGERS:
        return {"error": f"{impl} is not a vLLM block manager"}
    recorder = Recorder()
    try:
        if engine == "v1":
            adapter: Any = VLLMV1Adapter(config, recorder=recorder)
            mgr = real(adapter._manager)
        else:
            adapter = LegacyAdapter(config, manager=LEGACY_MANAGERS[impl], recorder=recorder)
            mgr = adapter._raw
        driver = Driver(adapter)
        for i, step in enumerate(trace[:index], 1):
            recorder.op_index = i
            apply_step(driver, step)
        if index > len(trace):
            recorder.op_index = index
            drain(driver)
            driver.free_all()
    except Unrecordable as why:
        return {"error": f"not recordable as literals: {why}"}
    except Exception as error:  # BASE itself crashed on the way: nothing golden to assert
        return {"error": f"BASE raised {type(error).__name__} while replaying: {error}"}
    lines = [ln for ln in recorder.lines if ln.op_index <= index]
    codes = [_asserted(ln) if ln.answer is not None else ln.code for ln in lines]
    live = sorted(s for s, m in driver.seqs.items() if m.status is Status.RUNNING)
    observed: dict[str, str] = {}
    expected: dict[str, Any] = {}
    helpers: list[Callable[..., Any]] = list(recorder.helpers)  # what the recorded lines call
    if engine == "v1":
        hit = _result_of(lines, codes, index, "get_computed_blocks", f"computed{index}")
        if hit is not None:
            observed["hit_tokens"], expected["hit_tokens"] = f"{hit[0]}[1]", int(hit[1][1])
        alloc = _result_of(lines, codes, index, "allocate_slots", f"allocated{index}")
        if alloc is not None:
            observed["allocated"], expected["allocated"] = f"{alloc[0]} is not None", alloc[1] is not None
        observed["free"] = "mgr.block_pool.get_num_free_blocks()"
        expected["free"] = mgr.block_pool.get_num_free_blocks()
        observed["cached"], expected["cached"] = "cached_block_count(mgr)", v1_harness.cached_block_count(mgr)
        helpers += [v1_harness.cached_block_count, v1_harness.gpu_block_ids, v1_harness.renamed]
        requests = _named(recorder, "req")
        if config.prefix_caching and hasattr(mgr.block_pool.free_block_queue, "get_all_free_blocks"):
            shown = ", ".join(f"{label!r}: {label}" for label in requests)
            observed["eviction_order"] = f"eviction_order(mgr, {{{shown}}})"
            expected["eviction_order"] = v1_harness.eviction_order(mgr, requests)
            helpers.append(v1_harness.eviction_order)
        block_ids = v1_harness.gpu_block_ids
    else:
        observed["free"], expected["free"] = "mgr.get_num_free_gpu_blocks()", mgr.get_num_free_gpu_blocks()
        helpers += [legacy_harness.is_v1_manager, legacy_harness.gpu_block_ids, v1_harness.renamed]
        hit_rate = legacy_harness.prefix_cache_hit_rate(mgr)
        if hit_rate is not None:  # to the places the lockstep compares (spec/state.py)
            observed["hit_rate"] = f"round(prefix_cache_hit_rate(mgr), {HIT_RATE_DIGITS})"
            expected["hit_rate"] = round(hit_rate, HIT_RATE_DIGITS)
            helpers.append(legacy_harness.prefix_cache_hit_rate)
        block_ids = legacy_harness.gpu_block_ids
    observed["tables"] = _renamed_expr(live)
    expected["tables"] = v1_harness.renamed({s: block_ids(mgr, s) for s in live})
    body: list[str] = []
    commented: set[int] = set()
    for line, code in zip(lines, codes, strict=True):
        if line.op_index and line.op_index not in commented:
            commented.add(line.op_index)
            body.append(f"# {_op_comment(line.op_index, trace)}")
        if line.op_index == index and line.answer is not None:
            # An admission check at the differing operation is BASE's answer to assert, not a
            # precondition: HEAD answering otherwise is the behaviour change itself.
            body += [f"if not ({_condition(line)}):",
                     f'    pytest.fail("[{TAG}] {line.call}: expected {line.answer} (BASE), observed otherwise")']
            continue
        body.append(code)
    where = _op_comment(index, trace)
    body += [
        f"# BASE's observations at operation {where}",
        "observed = {",
        *[f"    {k!r}: {v}," for k, v in observed.items()],
        "}",
        f"expected = {expected!r}",
        "for key in expected:",
        "    if observed[key] != expected[key]:",
        f'        pytest.fail(f"[{TAG}] {{key}}: expected {{expected[key]!r}} (BASE), observed {{observed[key]!r}}")',
    ]
    name = f"test_kvspec_{re.sub(r'[^a-z0-9]+', '_', impl)}_golden"
    doc = (
        f"{title}\n\nOn {config.describe()}: kvspec replayed the shrunk lockstep trace on BASE and asserts what "
        f"BASE observed at the operation where HEAD differs.  Written by kvspec.\n"
    )
    imports = ["from __future__ import annotations", "", "import pytest", *_import_lines(recorder)]
    source = [f'"""{doc}"""', "", *imports, ""]
    for fn in dict.fromkeys(helpers):
        source += ["", inspect.getsource(fn).rstrip(), ""]
    source += ["", f"def {name}():"]
    source += ["    " + ln if ln else "" for ln in body]
    return {"text": "\n".join(source) + "\n", "filename": f"{name}.py", "expected": expected}



def _named(recorder: Recorder, prefix: str) -> dict[str, Any]:
    """The objects the file names ``<prefix><n>`` (e.g. every request), by name, in order."""
    found = {}
    for obj in recorder._keep:
        label = recorder.names.get(id(obj), "")
        if re.fullmatch(rf"{prefix}\d+", label):
            found[label] = obj
    return found


PLANNED = re.compile(r"assert (\w+)\.num_scheduled_tokens == (.*)$")


def write_scheduler_golden(shape: Shape, trace: list[TraceStep], title: str, index: int) -> dict[str, Any]:
    """The golden file of a scheduler lockstep's behaviour change at operation ``index`` (1-based),
    or ``{"error": why}``: the trace replayed on BASE's own V1 scheduler through the recorder
    (testing/scheduler/reproducer.py ``record``), every ``schedule()`` before the differing
    operation asserting what it planned as the reproducer does; at the differing operation what
    BASE observed -- the tokens each step there scheduled per request, the pool's free blocks,
    the prefix-cache entries per KV-cache group, every live request's block table per KV-cache
    group up to a renaming of block ids -- each failing the file with the ``behaviour-change``
    tag where HEAD differs.  They are read right after that operation (the re-run then frees
    every request)."""
    from kvspec.adapters.harness import v1_scheduler as sched_harness
    from kvspec.testing.artifacts.straight_line import NotStraightLine
    from kvspec.testing.scheduler.reproducer import record, setup

    if index > len(trace):
        return {"error": "the difference is in the teardown's drain, which the file does not replay"}
    expected: dict[str, Any] = {}
    live: list[int] = []
    groups: list[str] = []

    def at_index(driver: Any) -> None:
        # BASE's state right after operation ``index``: the re-run goes on to free every request.
        scheduler = driver.target.inner._sched
        live.extend(sorted(driver.seqs))
        groups.extend(g.spec.name for g in driver.state.groups)
        expected["free"] = repr(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
        expected["cached"] = repr(sched_harness.cached_entries(scheduler, len(groups)))
        for gi, group in enumerate(groups):
            tables = {s: sched_harness.block_table(scheduler, gi, f"seq{s}") for s in live}
            expected[f"tables ({group})"] = repr(v1_harness.renamed(tables))

    try:
        recording = record(shape, trace[:index], None, before_end=at_index)
    except (NotStraightLine, Unrecordable) as why:
        return {"error": f"not recordable as a straight line: {why}"}
    except Exception as error:  # BASE itself crashed on the way: nothing golden to assert
        return {"error": f"BASE raised {type(error).__name__} while replaying: {error}"}
    if recording.crash is not None or recording.violations:
        return {"error": "BASE's replay did not end as the lockstep's did (a crash or a violation)"}
    if not expected:
        return {"error": "BASE's replay stopped before the differing operation"}
    recorder = recording.recorder
    name = recorder.names.get(id(recording.driver.target.inner._sched), "scheduler")
    body: list[str] = list(setup(shape).lines)
    observed: dict[str, str] = {}
    commented: set[int] = set()
    for line in (ln for ln in recorder.lines if ln.op_index <= index):
        if line.op_index and line.op_index not in commented:
            commented.add(line.op_index)
            body.append(f"# {_op_comment(line.op_index, trace)}")
        planned = PLANNED.match(line.code)
        if planned and line.op_index == index:
            # The differing step's plan, checked where it is made: the outputs recorded after it
            # answer BASE's plan, which HEAD's scheduler may refuse.
            plan, want = planned.groups()
            body += [
                f"planned = {want}  # by BASE",
                f"if dict({plan}.num_scheduled_tokens) != planned:",
                f'    pytest.fail(f"[{TAG}] scheduled: expected {{planned!r}} (BASE), observed '
                f'{{dict({plan}.num_scheduled_tokens)!r}}")',
            ]
            continue
        body.append(_asserted(line) if line.answer is not None else line.code)
    observed["free"] = f"{name}.kv_cache_manager.block_pool.get_num_free_blocks()"
    observed["cached"] = f"cached_entries({name}, {len(groups)})"
    for gi, group in enumerate(groups):
        ids = ", ".join(f"{s}: block_table({name}, {gi}, 'seq{s}')" for s in live)
        observed[f"tables ({group})"] = f"renamed({{{ids}}})"
    body += [
        f"# BASE's observations at operation {_op_comment(index, trace)}",
        "observed = {",
        *[f"    {k!r}: {v}," for k, v in observed.items()],
        "}",
        "expected = {",
        *[f"    {k!r}: {v}," for k, v in expected.items()],
        "}",
        "for key in expected:",
        "    if observed[key] != expected[key]:",
        f'        pytest.fail(f"[{TAG}] {{key}}: expected {{expected[key]!r}} (BASE), observed {{observed[key]!r}}")',
    ]
    test = "test_kvspec_v1_scheduler_golden"
    doc = (
        f"{title}\n\nOn {shape.describe()}: kvspec replayed the shrunk lockstep trace on BASE's V1 scheduler and "
        f"asserts what BASE observed at the operation where HEAD differs.  Written by kvspec.\n"
    )
    imports = ["from __future__ import annotations", "", "import json", "import pytest", *_import_lines(recorder)]
    source = [f'"""{doc}"""', "", *imports, ""]
    for fn in (sched_harness.block_table, sched_harness.cached_entries, v1_harness.renamed):
        source += ["", inspect.getsource(fn).rstrip(), ""]
    source += ["", f"def {test}(tmp_path):"]
    source += ["    " + ln if ln else "" for ln in body]
    return {"text": "\n".join(source) + "\n", "filename": f"{test}.py"}
