"""Draw a Timeline: ASCII Gantt for the terminal, SVG/HTML pictures, Chrome-trace JSON (Perfetto).

All renderers take a Timeline, so a simulated plan and a measured run look
the same. Only compute actions (F, B, I, W) are drawn as blocks; the Chrome
trace keeps every event, comm included.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from html import escape  # not xml.sax.saxutils: it imports urllib (30 ms of start-up)

from .actions import Kind, ScheduleError
from .simulate import Event, Timeline

COLORS = {Kind.F: "#4e79a7", Kind.B: "#59a14f", Kind.I: "#f28e2b", Kind.W: "#b07aa1"}
# Microseconds per time unit, for the Chrome trace.
_US_PER = {"unit": 1000.0, "s": 1e6, "ms": 1000.0, "us": 1.0}


def _fmt(x) -> str:
    """A time or cost for people: 57, 52.5, 0.333."""
    x = float(x)
    return f"{x:.0f}" if x == round(x) and abs(x) < 1e15 else f"{x:.4g}"


def human_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def text_table(rows: list[list], right: set[int] = frozenset(), rule: bool = False, free_last: bool = False) -> str:
    """Rows of cells as aligned columns: `right` are the right-aligned column indices, `rule` puts a
    dashed line under the header row, and with free_last the last column is not padded."""
    rows = [[str(c) for c in row] for row in rows]
    padded = len(rows[0]) - (1 if free_last else 0)
    widths = [max(len(r[i]) for r in rows) for i in range(padded)]
    lines = []
    for k, row in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + row[padded:]).rstrip())
        if rule and k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _chunks(timeline: Timeline) -> dict[int, int]:
    """stage -> index among its rank's stages (0 for the rank's first stage, 1 for its second, ...)."""
    stages = sorted(set(range(len(timeline.stage_to_rank))) |
                    {e.action.stage for e in timeline.events})
    rank_of = dict(enumerate(timeline.stage_to_rank))
    for e in timeline.events:
        rank_of.setdefault(e.action.stage, e.rank)
    seen: dict[int, int] = {}
    out = {}
    for s in stages:
        r = rank_of.get(s, 0)
        out[s] = seen.get(r, 0)
        seen[r] = out[s] + 1
    return out


def _labeler(timeline: Timeline):
    """How a block is labelled: F3 on single-stage ranks; F3/f3 for a rank's first/second stage; 5F3 beyond."""
    chunks = _chunks(timeline)
    most = max(chunks.values(), default=0) + 1

    def label(event: Event) -> str:
        a = event.action
        if most > 2:
            return str(a)
        text = f"{a.kind.value}{a.microbatch}"
        return text.lower() if chunks.get(a.stage, 0) == 1 else text

    if most == 1:
        legend = ""
    elif most == 2:
        legend = "F B I W: a rank's first stage, f b i w: its second"
    else:
        legend = "labels are <stage><kind><microbatch>"
    return label, legend


def _rank_summaries(timeline: Timeline) -> list[str]:
    busy, span = timeline.busy_per_rank, timeline.makespan
    live = timeline.peak_live_microbatches_per_rank
    peak_bytes = timeline.peak_activation_bytes_per_rank
    out = []
    for r in range(timeline.num_ranks):
        pct = 100 * float(busy[r] / span) if span else 0.0
        text = f"busy {pct:5.1f}%  idle {_fmt(span - busy[r])}  peak live {live[r]}"
        if peak_bytes is not None:
            text += f" ({human_bytes(peak_bytes[r])})"
        out.append(text)
    return out


def ascii_gantt(timeline: Timeline, width: int | None = None, span=None) -> str:
    """One row per rank, time left to right, scaled to `width` columns.

    Blocks start with their label (F3, B3, I3, W3) where it fits (else just
    the kind letter) and are filled with spaces; '.' is idle. Below the chart,
    a line per rank gives its busy share, idle time and peak of live
    microbatches (and bytes when known). `span`, when longer than the
    timeline's makespan, is the time the full width stands for (to draw two
    timelines on one scale).
    """
    if width is None:
        width = min(200, max(60, shutil.get_terminal_size((100, 24)).columns))
    label, legend = _labeler(timeline)
    names = [f"r{r}" for r in range(timeline.num_ranks)]
    name_w = max(map(len, names), default=2)
    bar = max(10, width - (name_w + 3))
    t0, own = timeline.start_time, timeline.makespan
    span = own if span is None or span <= own else span
    scale = bar / float(span) if span else 0.0

    def col(t) -> int:
        return min(bar, max(0, round(float(t - t0) * scale)))

    lines = []
    title = f"{timeline.schedule or 'timeline'}: {timeline.num_ranks} ranks"
    if timeline.stage_to_rank and len(timeline.stage_to_rank) != timeline.num_ranks:
        title += f", {len(timeline.stage_to_rank)} stages"
    title += (f", {timeline.num_microbatches} microbatches; makespan {_fmt(own)}"
              f"{'' if timeline.time_unit == 'unit' else ' ' + timeline.time_unit}, "
              f"bubble {100 * float(timeline.bubble_fraction):.1f}%")
    lines.append(title)
    drawn = bar if span == own else col(t0 + own)  # the columns up to the timeline's own end; blank beyond
    for r in range(timeline.num_ranks):
        cells = ["."] * drawn + [" "] * (bar - drawn)
        for e in timeline.events_of(r):
            if not e.action.kind.is_compute:
                continue
            c0, c1 = col(e.start), col(e.end)
            if c1 <= c0:
                if e.end <= e.start or c0 >= bar or cells[c0] != ".":
                    continue  # too short to see at this width
                c1 = c0 + 1
            text = label(e)
            if len(text) > c1 - c0:  # never show a cut-off number: fall back to the kind letter
                text = text.rstrip("0123456789")[-1]
            cells[c0:c1] = list(text.ljust(c1 - c0))
        lines.append(f"{names[r]:<{name_w}} |{''.join(cells)}|")
    lines.append(" " * (name_w + 1) + "0" + _fmt(span).rjust(bar + 1))
    lines.append((legend + "; " if legend else "") + "'.' idle")
    for name, text in zip(names, _rank_summaries(timeline)):
        lines.append(f"{name:<{name_w}}  {text}")
    return "\n".join(lines) + "\n"


def _nice_step(span: float, target: int = 8) -> float:
    if span <= 0:
        return 1.0
    raw = span / target
    power = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if mult * power >= raw:
            return mult * power
    return 10 * power


def to_svg(timeline: Timeline, span=None) -> str:
    """A self-contained SVG: a row per rank, a colored block per F/B/I/W, hatched idle, a time axis.

    `span`, when longer than the makespan, is the time the plot's width stands for (one scale for two).
    """
    label, legend = _labeler(timeline)
    chunks = _chunks(timeline)
    plot_w, row_h, gap, left, top = 960, 26, 8, 56, 48
    suffixes = _rank_summaries(timeline)
    right = 14 + 6 * max(map(len, suffixes), default=0)
    height = top + timeline.num_ranks * (row_h + gap) + 56
    width = left + plot_w + right
    t0, own = timeline.start_time, float(timeline.makespan)
    span = own if span is None or span <= own else float(span)
    scale = plot_w / span if span else 0.0
    idle_w = plot_w if span == own else round(own * scale, 2)

    def x(t) -> float:
        return left + float(t - t0) * scale

    title = (f"{timeline.schedule or 'timeline'}: {timeline.num_ranks} ranks, {timeline.num_microbatches} "
             f"microbatches; makespan {_fmt(own)}{'' if timeline.time_unit == 'unit' else ' ' + timeline.time_unit}"
             f", bubble {100 * float(timeline.bubble_fraction):.1f}%")
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        "<defs><pattern id=\"idle\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
        "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#f3f3f3\"/>"
        "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#c8c8c8\" stroke-width=\"2\"/></pattern></defs>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    # legend
    lx = left
    for kind, color in COLORS.items():
        out.append(f'<rect x="{lx}" y="30" width="10" height="10" fill="{color}"/>'
                   f'<text x="{lx + 14}" y="39">{kind.value}</text>')
        lx += 36
    out.append(f'<rect x="{lx}" y="30" width="10" height="10" fill="url(#idle)" stroke="#999"/>'
               f'<text x="{lx + 14}" y="39">idle</text>')
    if legend:
        out.append(f'<text x="{lx + 50}" y="39" fill="#555">{escape(legend)} (lighter)</text>')
    for r in range(timeline.num_ranks):
        y = top + r * (row_h + gap)
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 4}" text-anchor="end">rank {r}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{idle_w}" height="{row_h}" fill="url(#idle)"/>')
        for e in timeline.events_of(r):
            kind = e.action.kind
            if not kind.is_compute:
                continue
            x0, w = x(e.start), float(e.end - e.start) * scale
            opacity = "" if chunks.get(e.action.stage, 0) % 2 == 0 else ' fill-opacity="0.55"'
            tip = f"rank {r}: {e.action} {_fmt(e.start - t0)}..{_fmt(e.end - t0)}"
            out.append(f'<rect x="{x0:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" fill="{COLORS[kind]}"'
                       f'{opacity} stroke="white" stroke-width="0.5"><title>{escape(tip)}</title></rect>')
            text = label(e)
            if w >= 6.5 * len(text) + 2:
                out.append(f'<text x="{x0 + w / 2:.2f}" y="{y + row_h / 2 + 4}" text-anchor="middle" '
                           f'fill="white">{escape(text)}</text>')
        out.append(f'<text x="{left + plot_w + 8}" y="{y + row_h / 2 + 4}">{escape(suffixes[r].strip())}</text>')
    # time axis
    axis_y = top + timeline.num_ranks * (row_h + gap) + 4
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="#333"/>')
    step = _nice_step(span)
    k = 0
    while span and k * step <= span * (1 + 1e-9):
        tx = left + k * step * scale
        out.append(f'<line x1="{tx:.2f}" y1="{axis_y}" x2="{tx:.2f}" y2="{axis_y + 5}" stroke="#333"/>'
                   f'<text x="{tx:.2f}" y="{axis_y + 18}" text-anchor="middle">{_fmt(k * step)}</text>')
        k += 1
    unit = "time (units)" if timeline.time_unit == "unit" else f"time ({timeline.time_unit})"
    out.append(f'<text x="{left + plot_w / 2}" y="{axis_y + 36}" text-anchor="middle">{unit}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_html(timeline: Timeline) -> str:
    """The SVG plus a per-rank summary table, in one page with no external files."""
    s = timeline.summary()
    peak_bytes = s["peak_activation_bytes_per_rank"]
    rows = []
    for r in range(timeline.num_ranks):
        cells = [f"{r}", _fmt(s["busy_per_rank"][r]), f"{100 * s['bubble_fraction_per_rank'][r]:.1f}%",
                 f"{s['peak_live_microbatches_per_rank'][r]}"]
        if peak_bytes is not None:
            cells.append(human_bytes(peak_bytes[r]))
        rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    head = ["rank", "busy", "bubble", "peak live microbatches"] + (["peak activations"] if peak_bytes else [])
    title = escape(f"{timeline.schedule or 'timeline'}: {timeline.num_ranks} ranks x "
                   f"{timeline.num_microbatches} microbatches")
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>{title}</title>\n<style>body{{font-family:sans-serif;margin:1.5em}}"
        "table{border-collapse:collapse;margin-top:1em}td,th{border:1px solid #ccc;padding:3px 10px;"
        "text-align:right}</style></head><body>\n"
        f"<h2>{title}</h2>\n<p>makespan {_fmt(s['makespan'])}"
        f"{'' if timeline.time_unit == 'unit' else ' ' + timeline.time_unit}, "
        f"bubble {100 * s['bubble_fraction']:.1f}%</p>\n"
        f"{to_svg(timeline)}"
        "<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>\n"
        + "\n".join(rows) + "\n</table>\n</body></html>\n"
    )


def to_html_side_by_side(titled: list[tuple[str, Timeline]], text: str = "", title: str = "") -> str:
    """Several timelines (e.g. measured and predicted) in one page, on one time scale, under a <pre> text."""
    span = max((float(t.makespan) for _, t in titled), default=0.0)
    title = escape(title or " vs ".join(name for name, _ in titled))
    parts = [f"<h3>{escape(name)}</h3>\n{to_svg(t, span=span)}" for name, t in titled]
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>{title}</title>\n<style>body{{font-family:sans-serif;margin:1.5em}}</style></head><body>\n"
        f"<h2>{title}</h2>\n" + (f"<pre>{escape(text)}</pre>\n" if text else "")
        + "\n".join(parts) + "\n</body></html>\n"
    )


def to_chrome_trace(timeline: Timeline) -> dict:
    """Chrome trace events (open in Perfetto or chrome://tracing): one process per rank, "X" events in us.

    Simulated time is unitless: 1 unit is drawn as 1000 us (1 ms).
    """
    us = _US_PER.get(timeline.time_unit, 1000.0)
    t0 = timeline.start_time
    events = []
    for r in range(timeline.num_ranks):
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
    for e in sorted(timeline.events, key=lambda e: (e.rank, e.start)):
        a = e.action
        events.append({
            "name": f"{a.kind.value}{a.microbatch}", "cat": a.kind.value, "ph": "X", "pid": e.rank, "tid": 0,
            "ts": float(e.start - t0) * us, "dur": float(e.end - e.start) * us,
            "args": {"stage": a.stage, "microbatch": a.microbatch, "action": str(a)},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": timeline.schedule, "num_microbatches": timeline.num_microbatches,
                          "time_unit": timeline.time_unit}}


def write(timeline: Timeline, path) -> None:
    """Write the timeline as .svg, .html or .json (Chrome trace), chosen by the extension."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext == ".svg":
        text = to_svg(timeline)
    elif ext in (".html", ".htm"):
        text = to_html(timeline)
    elif ext == ".json":
        text = json.dumps(to_chrome_trace(timeline))
    else:
        raise ScheduleError(f"cannot write {os.fspath(path)}: unknown extension {ext or '(none)'!r}; "
                            f"use .svg, .html or .json (Chrome trace)")
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as e:
        raise ScheduleError(f"cannot write {os.fspath(path)}: {e.strerror}") from None
