"""A picture of a counterexample: the block-table timeline, as SVG, inside a one-file HTML page.

One row per sequence and block-table slot, one column per operation of the trace.  A cell
shows the block the slot holds after that operation, its refcount when shared, and whether the
prefix cache maps it; a slot a sliding window dropped is grey.  The cells the violation names
(its blocks, else its sequences) in the failing column are outlined in red.

The frames come from replaying the trace through the driver on the implementation that
failed, so the picture shows the target's own state, not a re-rendering of the report's text.
The SVG is drawn with drawsvg; every cell carries ``data-*`` attributes (op, seq, slot, block,
refcount) so that a browser test can read back what is visible.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import drawsvg as dw
from kvspec.spec.config import Config
from kvspec.spec.interface import Implementation
from kvspec.spec.invariants import Violation
from kvspec.spec.state import DROPPED, Device

from .driver import Driver, TraceStep, apply_step

CELL_W, CELL_H = 64, 22
LABEL_W, HEADER_H, FOOT_H = 84, 56, 12
COLOURS = {
    "held": "#dbeafe",
    "shared": "#fed7aa",
    "cached": "#bbf7d0",
    "dropped": "#e5e7eb",
    "cpu": "#e9d5ff",
    "empty": "#ffffff",
}
OFFENDING = "#dc2626"
TIMES = "\u00d7"  # the multiplication sign before a refcount


@attrs.frozen
class Frame:
    """The observable state after one operation (index 0 is the state before any)."""

    index: int
    label: str
    tables: Mapping[int, tuple[str, tuple[int | None, ...]]]  # seq -> (device, slots)
    refcounts: Mapping[int, int]
    cached: Mapping[int, str]  # GPU block -> short form of the key it is cached under


@attrs.frozen
class Film:
    frames: tuple[Frame, ...]
    violations: tuple[Violation, ...]
    crash: str | None


def film(impl: Implementation, trace: Sequence[TraceStep], focus: Sequence[str] | None = None) -> Film:
    """Replay ``trace`` on ``impl`` and keep a frame after each operation, up to the failure."""
    driver = Driver(impl, focus=focus)
    frames = [_frame(driver, 0, "start")]
    for index, step in enumerate(trace, 1):
        try:
            apply_step(driver, step)
        except Exception as err:
            frames.append(_frame(driver, index, _label(step)))
            return Film(tuple(frames), (), f"{type(err).__name__}: {err}")
        frames.append(_frame(driver, index, _label(step)))
        found = driver.check()
        if found:
            return Film(tuple(frames), tuple(found), None)
    found = driver.free_all()
    frames.append(_frame(driver, len(trace) + 1, "free all"))
    return Film(tuple(frames), tuple(found), None)


def _label(step: TraceStep) -> str:
    seq = step.args.get("seq", step.args.get("parent"))
    return f"{step.op} s{seq}" if seq is not None else step.op


def _frame(driver: Driver, index: int, label: str) -> Frame:
    state = driver.state
    tables = {
        sid: (t.device.value, tuple(t.slots)) for sid, t in sorted(state.tables.items()) if t.slots
    }
    cached = {}
    for key, block in state.gpu.cached:
        tail = list(key.chain[-3:])
        cached[block] = f"…{tail}" if len(key.chain) > 3 else str(list(key.chain))
    return Frame(index, label, tables, dict(state.gpu.refcounts), cached)


# ---------------------------------------------------------------- drawing


def offending_cells(film: Film) -> tuple[int, set[tuple[int, int]]]:
    """The failing column and the (seq, slot) cells in it that the violation names."""
    last = film.frames[-1]
    text = " ".join(v.message for v in film.violations) + " " + (film.crash or "")
    blocks = {int(b) for b in re.findall(r"block (\d+)", text)}
    seqs = {int(s) for s in re.findall(r"seqs? \[?(\d+)", text)}
    cells = {
        (sid, i)
        for sid, (device, slots) in last.tables.items()
        for i, b in enumerate(slots)
        if device == Device.GPU.value and b is not None and b in blocks
    }
    if not cells:
        cells = {(sid, i) for sid, (_, slots) in last.tables.items() if sid in seqs for i in range(len(slots))}
    return last.index, cells


def timeline_svg(film: Film, config: Config, title: str = "") -> str:
    rows = sorted(
        {(sid, i) for f in film.frames for sid, (_, slots) in f.tables.items() for i in range(len(slots))}
    )
    columns = film.frames[1:]
    failing, offending = offending_cells(film)
    width = LABEL_W + CELL_W * max(1, len(columns)) + FOOT_H
    height = HEADER_H + CELL_H * max(1, len(rows)) + FOOT_H
    d = dw.Drawing(width, height, font_family="monospace")
    d.append(dw.Title(title or f"kvspec block-table timeline ({config.describe()})"))
    for c, frame in enumerate(columns):
        x = LABEL_W + c * CELL_W
        header = dw.Group(class_="op" + (" offending" if frame.index == failing else ""), data_op=frame.index)
        colour = OFFENDING if frame.index == failing else "#111827"
        header.append(dw.Text(str(frame.index), 11, x + CELL_W / 2, 18, text_anchor="middle", fill=colour))
        header.append(dw.Text(frame.label, 9, x + CELL_W / 2, 36, text_anchor="middle", fill=colour))
        d.append(header)
    for r, (sid, slot) in enumerate(rows):
        y = HEADER_H + r * CELL_H
        d.append(dw.Text(f"s{sid}[{slot}]", 11, 6, y + CELL_H * 0.7, class_="row"))
        for c, frame in enumerate(columns):
            named = (sid, slot) in offending and frame.index == failing
            d.append(_cell(frame, sid, slot, LABEL_W + c * CELL_W, y, named))
    return d.as_svg()


def _cell(frame: Frame, sid: int, slot: int, x: float, y: float, offending: bool) -> dw.Group:
    device, slots = frame.tables.get(sid, ("", ()))
    block = slots[slot] if slot < len(slots) else None
    present = slot < len(slots)
    rc = frame.refcounts.get(block, 0) if block is not None and device == Device.GPU.value else 0
    if not present:
        kind, text = "empty", ""
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
    tip = f"after op {frame.index}: seq {sid} slot {slot}: " + (text or "empty")
    if block in frame.cached:
        tip += f" cached as {frame.cached[block]}"
    group.append(dw.Title(tip))
    return group


# ---------------------------------------------------------------- the page


def report_html(report: Mapping[str, Any], svg: str) -> str:
    """One self-contained page: what was found, the timeline, the trace, how to reproduce."""
    e = html.escape
    found = report.get("violations") or []
    items = "".join(f"<li><b>[{e(v['invariant'])}]</b> {e(v['message'])}</li>" for v in found)
    if report.get("error"):
        items += f"<li><b>crash</b> {e(str(report['error']))}</li>"
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
        ".timeline{overflow-x:auto;border:1px solid #e5e7eb;padding:.5em}</style>",
        "</head><body>",
        f"<h1>kvspec {e(str(report.get('outcome', '')))} on {e(str(where))}</h1>",
        f"<p>Configuration: <code>{e(json.dumps(report.get('config')))}</code></p>",
        f"<h2>Found</h2><ul id='found'>{items}</ul>",
        "<h2>Block-table timeline</h2>",
        "<p>Rows: sequence[slot]; columns: operations. A cell shows the block, &times;refcount when not 1, "
        "# when cached; grey: dropped by the window; red: what the violation names.</p>",
        f"<div class='timeline' id='timeline'>{svg_body}</div>",
        f"<h2>Trace</h2><ol id='trace'>{trace}</ol>",
        "<h2>Reproduce</h2>",
        f"<p>Standalone test: <code>{e(str(repro.get('path') or repro.get('reason') or 'none'))}</code></p>",
        f"<p>Command: <code>{e(' '.join(report.get('command', [])))}</code></p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
