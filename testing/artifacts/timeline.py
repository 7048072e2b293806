"""A picture of a counterexample: the block-table timeline, as SVG, inside a one-file HTML page.

One row per KV-cache group, sequence and block-table slot, one column per operation of the
trace (every one of them, and "free all" -- the scheduler machine's teardown -- when the
violation showed at the end of the run).  A cell shows the block the slot holds after that
operation, its refcount when shared, and whether the prefix cache maps it; a slot a sliding
window dropped is grey.  Every sequence the violation names has a row in the group it names
(every group when it names none), a table or not.  Under the tables, a pool row gives the free
and evictable blocks after each operation, and the failing column adds what the verdict rests
on: the need the spec computed and the blocks the allocation took.  The cells the violation
names in the failing column are outlined in red.

Both machines are drawn: ``film`` replays a block-manager trace through the driver (one
unnamed group, its rows labelled with the group the violation names); ``scheduler_film``
replays a scheduler trace through the scheduler machine in the recorded shape (a row per
request and per group of the shape).

Everything named comes from the violations' facts (``spec.violation.Violation``: sequences,
group, blocks, positions, pool, need, taken), never from their text.  The frames come from
replaying the trace through the driver on the implementation that failed, so the picture
shows the target's own state.  The SVG is drawn with drawsvg; every cell carries ``data-*``
attributes (op and its label, group, seq, slot, block, refcount; the pool's free, evictable,
need, taken) so that a browser test can read back what is visible.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import drawsvg as dw
from kvspec.spec.groups import HybridState, Shape
from kvspec.spec.interface import Implementation
from kvspec.spec.invariants import Violation
from kvspec.spec.state import DROPPED, Device, PoolView, TableView
from kvspec.testing.blockmanager.differential import Mode
from kvspec.testing.blockmanager.driver import Driver, TraceStep, apply_step
from kvspec.testing.scheduler.replay import SchedulerSession, in_context

CELL_W, CELL_H = 64, 22
LABEL_W, HEADER_H, FOOT_H = 132, 56, 12
COLOURS = {
    "held": "#dbeafe",
    "shared": "#fed7aa",
    "cached": "#bbf7d0",
    "dropped": "#e5e7eb",
    "cpu": "#e9d5ff",
    "empty": "#ffffff",
    "missing": "#fef2f2",
    "pool": "#f9fafb",
}
OFFENDING = "#dc2626"
CHAR_W = 6.7  # the width of one 11 px monospace character
TIMES = "\u00d7"  # the multiplication sign before a refcount
BLOCK_MANAGER = ""  # the one group of a block-manager film (its rows take the violation's group)
FREE_ALL = "free all"  # the column of what the end of the run does (every request freed)

Lane = tuple[str, int]  # (KV-cache group, sequence): one block table
Row = tuple[str, int, int]  # (group, sequence, slot)


@attrs.frozen
class Frame:
    """The observable state after one operation (index 0 is the state before any)."""

    index: int
    label: str
    tables: Mapping[Lane, tuple[str, tuple[int | None, ...]]]  # (group, seq) -> (device, slots)
    refcounts: Mapping[int, int]
    cached: Mapping[int, str]  # GPU block -> short form of the key it is cached under
    free: int = 0  # GPU blocks on the free list
    evictable: int = 0  # GPU blocks kept for their cached content
    num_blocks: int = 0
    found: tuple[str, ...] = ()  # the invariants the replay saw violated after this operation


@attrs.frozen
class Film:
    frames: tuple[Frame, ...]
    violations: tuple[Violation, ...]
    crash: str | None
    block_sizes: Mapping[str, int]  # group -> its block size (tokens per slot)
    crashed_seqs: tuple[int, ...] = ()  # the sequences the crashed operation names
    seqs: tuple[int, ...] = ()  # every sequence the trace's operations name

    @property
    def failing(self) -> int:
        """The column the verdict is drawn in: the last frame's."""
        return self.frames[-1].index


def film(
    impl: Implementation,
    trace: Sequence[TraceStep],
    focus: Sequence[str] | None = None,
    violations: Sequence[Violation] = (),
) -> Film:
    """Replay every operation of ``trace`` on ``impl``, keeping a frame after each.

    ``violations`` are the ones the report shows (None given: those the replay finds at the
    end).  A shrunk trace ends with the operation they showed after; when the replay does not
    see them there (they showed when the run freed every sequence), a "free all" frame follows.
    Violations of other invariants met on the way are noted in their frames and replayed past."""
    driver = Driver(impl, focus=focus)
    return _replayed(
        trace, violations, {BLOCK_MANAGER: driver.config.block_size},
        apply=lambda step: apply_step(driver, step), check=driver.check, finish=driver.free_all,
        shot=lambda index, label, found: _frame(driver, index, label, found),
    )


def scheduler_film(
    target: Any,
    shape: Shape,
    trace: Sequence[TraceStep],
    focus: Sequence[str] | None = None,
    violations: Sequence[Violation] = (),
    mode: Mode | None = None,
) -> Film:
    """Replay every operation of a scheduler machine's ``trace`` on ``target`` (a scheduler
    built in ``shape``), keeping a frame after each, as ``film`` does; the scheduler machine's
    teardown (drain, then abort every request) takes the place of "free all".  ``mode``: compare
    against the reference scheduler in that mode (a policy difference's verdict), whose
    difference, once met, ends the film as a violation would."""
    session = SchedulerSession(target, shape, mode, focus)
    sizes = {g.spec.name: g.spec.block_size for g in session.machine.d.state.groups}

    def shot(index: int, label: str, found: Sequence[Violation]) -> Frame:
        return _hybrid_frame(session.machine.d.state, index, label, found)

    return in_context(
        lambda: _replayed(
            trace, violations, sizes, session.apply, session.check, session.finish, shot,
            ended=lambda: session.difference is not None,
        )
    )


def _replayed(
    trace: Sequence[TraceStep],
    violations: Sequence[Violation],
    block_sizes: Mapping[str, int],
    apply: Callable[[TraceStep], object],
    check: Callable[[], Sequence[Violation]],
    finish: Callable[[], Sequence[Violation]],
    shot: Callable[[int, str, Sequence[Violation]], Frame],
    ended: Callable[[], bool] = lambda: False,
) -> Film:
    """The replay loop both films share: ``apply`` each step and ``check`` after it, ``shot``
    taking the frame; a crash ends the film at the step that raised.  When the violations shown
    (``violations``; none given: those found at the end) were not seen after the last step,
    ``finish`` runs the end of the run as one more column, unless the replay ``ended`` on a
    verdict of another kind."""
    frames = [shot(0, "start", ())]
    found: Sequence[Violation] = []
    seqs = tuple(dict.fromkeys(s for step in trace for s in _named_seqs(step)))
    for index, step in enumerate(trace, 1):
        try:
            apply(step)
        except Exception as err:
            frames.append(shot(index, _label(step), ()))
            return Film(tuple(frames), tuple(violations), f"{type(err).__name__}: {err}", block_sizes,
                        _named_seqs(step), seqs)
        found = check()
        frames.append(shot(index, _label(step), found))
    wanted = {v.invariant for v in violations}
    seen = {v.invariant for v in found}
    if not ended() and not (wanted & seen if wanted else seen):
        try:
            found = finish()
        except Exception as err:
            frames.append(shot(len(trace) + 1, FREE_ALL, ()))
            return Film(tuple(frames), tuple(violations), f"{type(err).__name__}: {err}", block_sizes, (), seqs)
        frames.append(shot(len(trace) + 1, FREE_ALL, found))
    return Film(tuple(frames), tuple(violations) or tuple(found), None, block_sizes, (), seqs)


def _named_seqs(step: TraceStep) -> tuple[int, ...]:
    return tuple(step.args[k] for k in ("seq", "parent", "child") if isinstance(step.args.get(k), int))


def _label(step: TraceStep) -> str:
    seq = step.args.get("seq", step.args.get("parent"))
    return f"{step.op} s{seq}" if seq is not None else step.op


def _frame(driver: Driver, index: int, label: str, found: Sequence[Violation] = ()) -> Frame:
    state = driver.state
    return _pool_frame(index, label, {BLOCK_MANAGER: state.tables}, state.gpu, found)


def _hybrid_frame(state: HybridState, index: int, label: str, found: Sequence[Violation] = ()) -> Frame:
    return _pool_frame(index, label, {g.spec.name: g.tables for g in state.groups}, state.pool, found)


def _pool_frame(
    index: int, label: str, groups: Mapping[str, Mapping[int, TableView]], pool: PoolView, found: Sequence[Violation]
) -> Frame:
    tables = {
        (group, sid): (t.device.value, tuple(t.slots))
        for group, by_seq in groups.items()
        for sid, t in sorted(by_seq.items())
        if t.slots
    }
    cached = {}
    for key, block in pool.cached:
        tail = list(key.chain[-3:])
        cached[block] = f"…{tail}" if len(key.chain) > 3 else str(list(key.chain))
    return Frame(
        index,
        label,
        tables,
        dict(pool.refcounts),
        cached,
        len(pool.free),
        len(pool.evictable),
        len(pool.ids),
        tuple(dict.fromkeys(v.invariant for v in found)),
    )


# ---------------------------------------------------------------- what the violation names


def named_seqs(film: Film) -> list[int]:
    """Every sequence the violations name (their ``seqs`` facts), else the crashed operation's."""
    seqs = [s for v in film.violations for s in v.seqs] or list(film.crashed_seqs)
    return list(dict.fromkeys(seqs))


def group_of(film: Film) -> dict[int, str]:
    """Sequence -> the KV-cache group a violation names it in."""
    return {s: v.group for v in film.violations if v.group for s in v.seqs}


def _groups_named(film: Film, v: Violation) -> list[str]:
    """The film's groups a violation speaks of: the one it names (a block-manager film's one
    group stands for it), else every group."""
    if v.group and v.group in film.block_sizes:
        return [v.group]
    return list(film.block_sizes)


def offending_cells(film: Film) -> tuple[int, set[Row]]:
    """The failing column and the (group, seq, slot) cells in it that the violations name: the
    slots holding the GPU blocks they name, the slots of the positions they name, else every
    slot of the sequences they name; each in the group the violation names (every group when it
    names none)."""
    last = film.frames[-1]
    gpu = Device.GPU.value
    cells: set[Row] = set()
    for v in film.violations:
        groups = _groups_named(film, v)
        blocks = set(v.blocks) if v.device in ("", gpu) else set()
        cells |= {
            (group, sid, i)
            for (group, sid), (device, slots) in last.tables.items()
            for i, b in enumerate(slots)
            if group in groups and device == gpu and b is not None and b in blocks
        }
        cells |= {(g, s, p // film.block_sizes[g]) for g in groups for s in v.seqs for p in v.positions}
    if not cells:
        seqs = set(named_seqs(film))
        named_groups = {g for v in film.violations for g in _groups_named(film, v)} or set(film.block_sizes)
        cells = {
            (group, sid, i)
            for (group, sid), (_, slots) in last.tables.items()
            if sid in seqs and group in named_groups
            for i in range(len(slots))
        }
        cells |= {(g, sid, 0) for g in named_groups for sid in seqs if (g, sid) not in last.tables}
    return last.index, cells


def verdict_facts(film: Film) -> dict[str, Any]:
    """The pool, need and taken facts of the first violation that carries any of them."""
    for v in film.violations:
        facts = {"pool": v.pool, "need": v.need, "taken": v.taken}
        facts = {k: value for k, value in facts.items() if value not in (None, ())}
        if facts:
            return facts
    return {}


# ---------------------------------------------------------------- drawing


def rows_of(film: Film) -> list[Row]:
    """(group, seq, slot) rows: every slot any frame shows, every cell the violations name, a
    row for each named sequence that holds no table in a group the violations name, and one in
    every group for each sequence of the trace that never held a table there (a request that
    arrived and got no block is drawn too)."""
    rows = {
        (group, sid, i)
        for f in film.frames
        for (group, sid), (_, slots) in f.tables.items()
        for i in range(len(slots))
    }
    rows |= offending_cells(film)[1]
    shown = {(group, sid) for group, sid, _ in rows}
    groups = {g for v in film.violations for g in _groups_named(film, v)} or set(film.block_sizes)
    rows |= {(g, sid, 0) for g in groups for sid in named_seqs(film) if (g, sid) not in shown}
    rows |= {(g, sid, 0) for g in film.block_sizes for sid in film.seqs if (g, sid) not in shown}
    return sorted(rows)


def timeline_svg(film: Film, setting: str) -> str:
    """The timeline of ``film``; ``setting`` (a configuration's or a shape's ``describe()``)
    goes into its title."""
    rows = rows_of(film)
    columns = film.frames[1:]
    failing, offending = offending_cells(film)
    groups = group_of(film)
    facts = verdict_facts(film)
    extra_rows = 1 + bool(facts)  # the pool row, and the verdict's facts
    width = LABEL_W + CELL_W * max(1, len(columns)) + FOOT_H
    height = HEADER_H + CELL_H * (max(1, len(rows)) + extra_rows) + FOOT_H
    d = dw.Drawing(width, height, font_family="monospace")
    d.append(dw.Title(f"kvspec block-table timeline ({setting})"))
    for c, frame in enumerate(columns):
        x = LABEL_W + c * CELL_W
        header = dw.Group(
            class_="op" + (" offending" if frame.index == failing else ""),
            data_op=frame.index,
            data_label=frame.label,
            data_found=",".join(frame.found),
        )
        colour = OFFENDING if frame.index == failing else "#111827"
        mark = "*" if frame.found and frame.index != failing else ""
        header.append(dw.Text(f"{frame.index}{mark}", 11, x + CELL_W / 2, 18, text_anchor="middle", fill=colour))
        header.append(dw.Text(frame.label, 9, x + CELL_W / 2, 36, text_anchor="middle", fill=colour))
        if frame.found:
            header.append(dw.Title(f"after op {frame.index} the replay saw: {', '.join(frame.found)}"))
        d.append(header)
    for r, (lane_group, sid, slot) in enumerate(rows):
        y = HEADER_H + r * CELL_H
        group = lane_group or groups.get(sid, "")
        label = f"{group} s{sid}[{slot}]" if group else f"s{sid}[{slot}]"
        d.append(dw.Text(label, 11, 6, y + CELL_H * 0.7, class_="row", data_seq=sid, data_slot=slot, data_group=group))
        for c, frame in enumerate(columns):
            named = (lane_group, sid, slot) in offending and frame.index == failing
            d.append(_cell(frame, (lane_group, sid), slot, group, LABEL_W + c * CELL_W, y, named))
    y = HEADER_H + len(rows) * CELL_H
    d.append(dw.Text("pool free", 11, 6, y + CELL_H * 0.7, class_="row pool-row"))
    for c, frame in enumerate(columns):
        d.append(_pool_cell(frame, LABEL_W + c * CELL_W, y))
    if facts:
        y += CELL_H
        d.append(dw.Text("verdict", 11, 6, y + CELL_H * 0.7, class_="row verdict-row"))
        d.append(_verdict_cell(facts, LABEL_W + (len(columns) - 1) * CELL_W, y, failing))
    return d.as_svg()


def _cell(frame: Frame, lane: Lane, slot: int, group_label: str, x: float, y: float, offending: bool) -> dw.Group:
    sid = lane[1]
    device, slots = frame.tables.get(lane, ("", ()))
    block = slots[slot] if slot < len(slots) else None
    present = slot < len(slots)
    rc = frame.refcounts.get(block, 0) if block is not None and device == Device.GPU.value else 0
    if not present:
        kind, text = ("missing" if offending else "empty"), ""
    elif block is DROPPED:
        kind, text = "dropped", "·"
    elif device == Device.CPU.value:
        kind, text = "cpu", f"c{block}"
    else:
        kind = "shared" if rc > 1 else "cached" if block in frame.cached else "held"
        text = f"{block}" + (f" {TIMES}{rc}" if rc != 1 else "") + (" #" if block in frame.cached else "")
    group = dw.Group(
        class_="cell" + (" offending" if offending else ""),
        data_op=frame.index,
        data_seq=sid,
        data_slot=slot,
        data_group=group_label,
        data_block="" if block is None or not present else block,
        data_refcount=rc,
        data_kind=kind,
    )
    group.append(
        dw.Rectangle(
            x + 1,
            y + 1,
            CELL_W - 2,
            CELL_H - 2,
            fill=COLOURS[kind],
            stroke=OFFENDING if offending else "#9ca3af",
            stroke_width=3 if offending else 1,
        )
    )
    if text:
        group.append(dw.Text(text, 11, x + CELL_W / 2, y + CELL_H * 0.7, text_anchor="middle"))
    where = f"group {group_label} " if group_label else ""
    tip = f"after op {frame.index}: {where}seq {sid} slot {slot}: " + (text or "no block")
    if block in frame.cached:
        tip += f" cached as {frame.cached[block]}"
    group.append(dw.Title(tip))
    return group


def _pool_cell(frame: Frame, x: float, y: float) -> dw.Group:
    group = dw.Group(
        class_="pool",
        data_op=frame.index,
        data_free=frame.free,
        data_evictable=frame.evictable,
        data_num_blocks=frame.num_blocks,
    )
    group.append(dw.Rectangle(x + 1, y + 1, CELL_W - 2, CELL_H - 2, fill=COLOURS["pool"], stroke="#9ca3af"))
    text = f"{frame.free}" + (f"+{frame.evictable}e" if frame.evictable else "") + f"/{frame.num_blocks}"
    group.append(dw.Text(text, 11, x + CELL_W / 2, y + CELL_H * 0.7, text_anchor="middle"))
    group.append(
        dw.Title(f"after op {frame.index}: {frame.free} free, {frame.evictable} evictable of {frame.num_blocks} blocks")
    )
    return group


def _verdict_cell(facts: Mapping[str, Any], x: float, y: float, failing: int) -> dw.Group:
    """The verdict's facts in the failing column's row, written out leftwards from its right
    edge: the pool the operation met, the need, the blocks the allocation took."""
    pool, need, taken = facts.get("pool"), facts.get("need"), facts.get("taken", ())
    group = dw.Group(
        class_="verdict",
        data_op=failing,
        data_need="" if need is None else need,
        data_taken=",".join(map(str, taken)),
        data_pool_free="" if pool is None else pool.free,
        data_pool_evictable="" if pool is None else pool.evictable,
    )
    said = []
    if pool is not None:
        evictable = f" + {pool.evictable} evictable" if pool.evictable else ""
        said.append(f"met {pool.free} free{evictable} of {pool.num_blocks}")
    if need is not None:
        said.append(f"need {need}")
    if taken:
        said.append(f"took {list(taken)}")
    text = " · ".join(said)
    right = x + CELL_W - 1
    left = max(LABEL_W + 1.0, min(x + 1, right - CHAR_W * len(text) - 8))
    group.append(dw.Rectangle(left, y + 1, right - left, CELL_H - 2, fill="#fee2e2", stroke=OFFENDING))
    group.append(dw.Text(text, 11, right - 4, y + CELL_H * 0.7, text_anchor="end"))
    group.append(
        dw.Title(
            f"after op {failing}: the pool it met, the need the spec's admission arithmetic computes under "
            f"the target's declared policy, and the blocks the allocation took: {text}"
        )
    )
    return group


# ---------------------------------------------------------------- the page


FACT_WORDS = {
    "kind": "kind",
    "seqs": "sequences",
    "group": "KV-cache group",
    "device": "device",
    "blocks": "blocks",
    "positions": "positions",
    "expected": "expected",
    "observed": "observed",
    "pool": "the pool it met",
    "need": "need (the spec's admission arithmetic, under the target's declared policy)",
    "taken": "what the allocation took (blocks out of the free and evictable sets)",
}


def _fact_text(name: str, value: Any) -> str:
    if name == "pool" and isinstance(value, Mapping):
        return f"{value.get('free')} free, {value.get('evictable')} evictable of {value.get('num_blocks')} blocks"
    return json.dumps(value) if not isinstance(value, str) else value


def facts_table(found: Sequence[Mapping[str, Any]]) -> str:
    """The facts of every violation (a report's ``violations`` entries), one row each, with
    ``data-violation`` (its index) and ``data-fact`` (the fact's name) for a browser to read."""
    e = html.escape
    rows = []
    for i, v in enumerate(found):
        for name, words in FACT_WORDS.items():
            if name not in v:
                continue
            value = v[name]
            raw = json.dumps(value, sort_keys=True)
            rows.append(
                f"<tr data-violation='{i}' data-fact='{name}' data-value='{e(raw, quote=True)}'>"
                f"<td>{e(v.get('invariant', ''))}</td><th>{e(words)}</th><td>{e(_fact_text(name, value))}</td></tr>"
            )
    if not rows:
        return "<p id='facts'>The violations carry no facts beyond their text.</p>"
    return "<table id='facts'><tr><th>invariant</th><th>fact</th><th>value</th></tr>" + "".join(rows) + "</table>"


DIFFERENCE_WORDS = {
    "compared": "what was compared",
    "target": "what the target gave",
    "reference": "what the reference scheduler gave under the policy",
    "policy": "the declared policy",
    "release": "the release (or target) whose policy it is",
    "seq": "sequence",
    "group": "KV-cache group",
    "mode": "the differential's mode",
}


def difference_table(difference: Mapping[str, Any] | None) -> str:
    """A policy difference's facts (a scheduler verdict's ``policy_difference``), one row each,
    with ``data-difference`` (the fact's name) and its value for a browser to read."""
    if not difference:
        return ""
    e = html.escape
    rows = "".join(
        f"<tr data-difference='{name}' data-value='{e(json.dumps(difference[name]), quote=True)}'>"
        f"<th>{e(words)}</th><td>{e(str(difference[name]))}</td></tr>"
        for name, words in DIFFERENCE_WORDS.items()
        if difference.get(name) is not None
    )
    return f"<table id='difference'>{rows}</table>"


def report_html(report: Mapping[str, Any], svg: str) -> str:
    """One self-contained page: what was found and the facts behind it, the timeline, the
    trace, how to reproduce."""
    e = html.escape
    found = report.get("violations") or []
    items = "".join(
        f"<li data-invariant='{e(v['invariant'], quote=True)}' data-kind='{e(v.get('kind', ''), quote=True)}'>"
        f"<b>[{e(v['invariant'])}]</b> {e(v['message'])}</li>"
        for v in found
    )
    if report.get("error"):
        items += f"<li><b>crash</b> {e(str(report['error']))}</li>"
    difference = report.get("policy_difference")
    if difference:
        compared = e(difference["compared"], quote=True)
        items += f"<li data-difference='{compared}'><b>differs</b> {e(difference['message'])}</li>"
    trace = "".join(f"<li>{e(line.split('. ', 1)[-1])}</li>" for line in report.get("trace_text", []))
    repro = report.get("reproducer") or {}
    target = report.get("target") or {}
    svg_body = svg.split("?>", 1)[-1]
    where = target.get("description", report.get("impl", ""))
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>kvspec: {e(report.get('impl', ''))} {e(str(report.get('outcome', '')))}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:80em}"
        "li{margin:.2em 0}code,pre{background:#f3f4f6;padding:.2em}"
        "td,th{text-align:left;padding:.1em .6em;vertical-align:top}"
        ".timeline{overflow-x:auto;border:1px solid #e5e7eb;padding:.5em}</style>",
        "</head><body>",
        f"<h1>kvspec {e(str(report.get('outcome', '')))} on {e(str(where))}</h1>",
        f"<p>Configuration: <code>{e(json.dumps(report.get('config')))}</code></p>",
        f"<h2>Found</h2><ul id='found'>{items}</ul>",
        "<h2>The facts behind the verdict</h2>",
        facts_table(found),
        difference_table(difference),
        "<h2>Block-table timeline</h2>",
        "<p>Rows: group sequence[slot] (a scheduler's KV-cache groups each have their rows; a block "
        "manager's take the group the violation names; a red-tinted cell: a slot the violation names that "
        "the table does not have); columns: every operation of the trace, and the end of the run when the "
        "violation showed there (* : the replay saw another invariant violated there). A cell shows the "
        "block, &times;refcount when not 1, # when cached; grey: dropped by the window; red: what the "
        "violation names. The pool row gives free(+evictable)/all blocks after each operation; the verdict "
        "row, in the failing column, the pool the operation met, the need the spec computed and the blocks "
        "the allocation took.</p>",
        f"<div class='timeline' id='timeline'>{svg_body}</div>",
        f"<h2>Trace</h2><ol id='trace'>{trace}</ol>",
        "<h2>Reproduce</h2>",
        f"<p>Standalone test: <code>{e(str(repro.get('path') or repro.get('reason') or 'none'))}</code></p>",
        f"<p>Command: <code>{e(' '.join(report.get('command', [])))}</code></p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
