"""Draw a Timeline: ASCII Gantt for the terminal, SVG/HTML pictures, Chrome-trace JSON (Perfetto).

All renderers take a Timeline, so a simulated plan and a measured run look
the same. Compute actions (F, B, I, W) and ZeRO-3's parameter gathers (UNSHARD,
which hold their rank up) are drawn as blocks, a pair of them run as one action (a Composite) as one outlined
block with both labels ("F3&b1"); the Chrome trace keeps every
event, messages and collectives (a measured REDUCE_GRAD's launch) included.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from html import escape  # not xml.sax.saxutils: it imports urllib (30 ms of start-up)

from .actions import Kind, ScheduleError, parts_of
from .simulate import Event, Timeline

COLORS = {Kind.F: "#4e79a7", Kind.B: "#59a14f", Kind.I: "#f28e2b", Kind.W: "#b07aa1", Kind.UNSHARD: "#e15759"}
KIND_NAMES = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input grad", Kind.W: "weight grad",
              Kind.UNSHARD: "parameter gather"}
# Microseconds per time unit, for the Chrome trace.
_US_PER = {"unit": 1000.0, "s": 1e6, "ms": 1000.0, "us": 1.0}
# SVG sizes. The plot is about _PX_PER_ACTION wide per action of the busiest rank: counting actions rather
# than time units keeps it unit-free (simulated units, measured seconds), and a plan measured and the same
# plan predicted (equal counts) come out on one scale. Clamped so a tiny plan stays legible and a huge one
# stays a picture; labels that do not fit their block are left out.
_PX_PER_ACTION, _MIN_PLOT_W, _MAX_PLOT_W = 48, 320, 12000
_FONT = 11
_CHAR_EM = 0.62  # a sans-serif character's width in font sizes, on the wide side (digits 0.56, 'W' 0.94)
_DARKEST = 0.45  # how far toward black a rank's last stage is shaded (its first is the kind's color)


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


class _Look:
    """How blocks are labelled and what the legend says, shared by the ASCII and SVG charts.

    Labels: F3 on single-stage ranks; F3/f3 for a rank's first/second stage; 5F3 (stage first) beyond.
    The legend names only the kinds the timeline has, and the later-stage look only where ranks have one.
    """

    def __init__(self, timeline: Timeline):
        self.chunks = _chunks(timeline)
        self.most = max(self.chunks.values(), default=0) + 1
        present = {p.kind for e in timeline.events for p in parts_of(e.action)}
        self.kinds = [k for k in COLORS if k in present]

    def chunk(self, event: Event) -> int:
        return self.chunks.get(event.action.stage, 0)

    def labels(self, event: Event) -> tuple[str, str]:
        """The full label and its short form (the kind letter), for a block too narrow for the full one."""
        a = event.action
        if a.kind is Kind.UNSHARD:  # no microbatch: its stage, and "U"
            return f"{a.stage}U", "U"
        if self.most > 2:
            return str(a), a.kind.value
        text = f"{a.kind.value}{a.microbatch}"
        return (text.lower(), text[0].lower()) if self.chunk(event) == 1 else (text, text[0])

    def pair_labels(self, rank: int, pair) -> tuple[str, str]:
        """A pair's labels: its halves' joined by "&" ("F3&b1"), and the short form ("F&b")."""
        halves = [self.labels(Event(rank, part, 0, 0)) for part in pair.parts]
        return "&".join(full for full, _ in halves), "&".join(short for _, short in halves)

    def kinds_text(self) -> str:
        return ", ".join(f"{k.value} {KIND_NAMES[k]}" for k in self.kinds)

    def stages_text(self) -> str:
        """What sets a rank's later stages apart in the labels, or '' where every rank has one stage."""
        if self.most == 2:
            return f"{' '.join(k.value.lower() for k in self.kinds)}: a rank's second stage"
        return "labels are <stage><kind><microbatch>" if self.most > 2 else ""

    def color(self, event: Event) -> str:
        """The kind's color, darker for each later stage of the rank: opaque, so it never shows the idle hatching."""
        shade = _DARKEST * self.chunk(event) / (self.most - 1) if self.most > 1 else 0.0
        return _darker(COLORS[event.action.kind], shade)


def _darker(color: str, amount: float) -> str:
    """A #rrggbb color mixed with black: amount 0 keeps it, 1 is black."""
    return "#" + "".join(f"{round(int(color[i:i + 2], 16) * (1 - amount)):02x}" for i in (1, 3, 5))


def _rank_summaries(timeline: Timeline) -> list[str]:
    busy, span = timeline.busy_per_rank, timeline.makespan
    live = timeline.peak_live_microbatches_per_rank
    peak_bytes = timeline.peak_activation_bytes_per_rank
    backward = any(e.action.kind is not Kind.F for e in timeline.compute_events())  # else nothing stays live
    out = []
    for r in range(timeline.num_ranks):
        pct = 100 * float(busy[r] / span) if span else 0.0
        text = f"busy {pct:5.1f}%  idle {_fmt(span - busy[r])}" + (f"  peak live {live[r]}" if backward else "")
        if peak_bytes is not None and backward:
            text += f" ({human_bytes(peak_bytes[r])})"
        out.append(text)
    return out


def _columns(events: list[Event], col, bar: int) -> list[tuple[int, int, Event]]:
    """(first column, end column, event) of one rank's compute blocks, left to right, none overlapping.

    A block shorter than a column gets the column it starts in if no longer block covers it; else it is
    not drawn (too short to see at this width).
    """
    blocks, short = [], []
    for e in events:
        if e.action.kind in COLORS and e.end > e.start:
            c0, c1 = col(e.start), col(e.end)
            (blocks if c1 > c0 else short).append((c0, c1, e))
    taken = {c for c0, c1, _ in blocks for c in range(c0, c1)}
    for c0, _, e in short:
        if c0 < bar and c0 not in taken:
            taken.add(c0)
            blocks.append((c0, c0 + 1, e))
    out, end = [], 0
    for c0, c1, e in sorted(blocks, key=lambda b: b[0]):
        c0 = max(c0, end)  # a measured trace's events may overlap by a hair: the earlier block keeps the column
        if c1 > c0:
            out.append((c0, c1, e))
            end = c1
    return out


def ascii_gantt(timeline: Timeline, width: int | None = None, span=None) -> str:
    """One row per rank, time left to right, scaled to `width` columns.

    Blocks are blank, starting with their label (F3, B3, I3, W3; lower case on a rank's second stage)
    where it fits, else with just the kind letter, else with nothing: a label never touches the next
    block's, so every word in a row is one whole label. '.' is idle. Below the chart, a legend of the
    kinds drawn and a line per rank with its busy share, idle time and peak of live microbatches (and
    bytes when known). `span`, when longer than the timeline's makespan, is the time the full width
    stands for (to draw two timelines on one scale).
    """
    if width is None:
        width = min(200, max(60, shutil.get_terminal_size((100, 24)).columns))
    look = _Look(timeline)
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
    unlabelled = False
    for r in range(timeline.num_ranks):
        cells = ["."] * drawn + [" "] * (bar - drawn)
        blocks = _columns(timeline.events_of(r), col, bar)
        for i, (c0, c1, e) in enumerate(blocks):
            # Where the next block starts right at this one's end, keep a blank before it.
            room = c1 - c0 - (i + 1 < len(blocks) and blocks[i + 1][0] == c1)
            text = next((t for t in look.labels(e) if len(t) <= room), "")
            unlabelled = unlabelled or not text
            cells[c0:c1] = text.ljust(c1 - c0)
        lines.append(f"{names[r]:<{name_w}} |{''.join(cells)}|")
    lines.append(" " * (name_w + 1) + "0" + _fmt(span).rjust(bar + 1))
    # Say what a blank stretch is where there is one: a dense chart can be mostly blank.
    blank = "blank: too short to label at this width" if unlabelled else ""
    lines.append("; ".join(filter(None, [look.kinds_text(), look.stages_text(), "'.' idle", blank])))
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


def _text_w(text: str, size: float = _FONT) -> float:
    """Roughly how wide text is drawn, in px (SVG cannot measure it for us)."""
    return _CHAR_EM * size * len(text)


def _plot_width(timeline: Timeline) -> float:
    """The plot's px: _PX_PER_ACTION per compute action of the busiest rank, clamped."""
    counts = [0] * timeline.num_ranks
    for e in timeline.compute_events():
        counts[e.rank] += 1
    return min(_MAX_PLOT_W, max(_MIN_PLOT_W, _PX_PER_ACTION * max(counts, default=0)))


def to_svg(timeline: Timeline, span=None) -> str:
    """A self-contained SVG: a row per rank, a colored block per F/B/I/W, hatched idle, a time axis.

    As wide as the schedule is long (about 48 px per action of the busiest rank, within 320..12000 px);
    a rank's later stages are darker shades of the kind's color. `span`, when longer than the makespan,
    is the time the plot's width stands for (one scale for two).
    """
    return _svg(timeline, span, _plot_width(timeline))


def _svg(timeline: Timeline, span, plot_w: float) -> str:
    look = _Look(timeline)
    row_h, gap, top = 26, 8, 48
    names = [f"rank {r}" for r in range(timeline.num_ranks)]
    suffixes = [s.strip() for s in _rank_summaries(timeline)]
    left = math.ceil(16 + max(map(_text_w, names), default=0))
    height = top + timeline.num_ranks * (row_h + gap) + 56
    t0, own = timeline.start_time, float(timeline.makespan)
    span = own if span is None or span <= own else float(span)
    scale = plot_w / span if span else 0.0
    idle_w = plot_w if span == own else round(own * scale, 2)

    def x(t) -> float:
        return left + float(t - t0) * scale

    title = (f"{timeline.schedule or 'timeline'}: {timeline.num_ranks} ranks, {timeline.num_microbatches} "
             f"microbatches; makespan {_fmt(own)}{'' if timeline.time_unit == 'unit' else ' ' + timeline.time_unit}"
             f", bubble {100 * float(timeline.bubble_fraction):.1f}%")
    # The legend, left to right: a swatch per kind drawn, idle, and the later stages' darker look if any.
    legend, lx = [], left
    for kind in look.kinds:
        text = f"{kind.value} {KIND_NAMES[kind]}"
        legend.append(f'<rect x="{lx:.1f}" y="30" width="10" height="10" fill="{COLORS[kind]}"/>'
                      f'<text x="{lx + 14:.1f}" y="39">{text}</text>')
        lx += 14 + _text_w(text) + 14
    legend.append(f'<rect x="{lx:.1f}" y="30" width="10" height="10" fill="url(#idle)" stroke="#999"/>'
                  f'<text x="{lx + 14:.1f}" y="39">idle</text>')
    lx += 14 + _text_w("idle") + 14
    if look.most > 1:
        for kind in look.kinds:
            legend.append(f'<rect x="{lx:.1f}" y="30" width="10" height="10" '
                          f'fill="{_darker(COLORS[kind], _DARKEST)}"/>')
            lx += 11
        text = ("darker, " if look.most == 2 else "darker: a rank's later stages; ") + look.stages_text()
        legend.append(f'<text x="{lx + 3:.1f}" y="39">{escape(text)}</text>')
        lx += 3 + _text_w(text)
    width = math.ceil(max(left + plot_w + 8 + max(map(_text_w, suffixes), default=0) + 12,
                          left + _text_w(title, 14) + 12, lx + 12))
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="{_FONT}">',
        "<defs><pattern id=\"idle\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
        "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#f3f3f3\"/>"
        "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#c8c8c8\" stroke-width=\"2\"/></pattern></defs>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14" font-weight="bold">{escape(title)}</text>',
        '<g id="legend">', *legend, "</g>",
    ]
    for r in range(timeline.num_ranks):
        y = top + r * (row_h + gap)
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 4}" text-anchor="end">{names[r]}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{idle_w}" height="{row_h}" fill="url(#idle)"/>')
        pair_start = None
        for e in timeline.events_of(r):
            if e.action.kind is Kind.OVERLAP:  # a measured pair: one event, its halves drawn side by side
                half = (e.end - e.start) / 2
                for i, part in enumerate(e.action.parts):
                    out.append(_block(look, Event(r, part, e.start + i * half, e.start + (i + 1) * half), x, scale,
                                      y, row_h, f"rank {r}: {part} of {e.action}", t0))
                out.extend(_pair_outline(look, r, e.action, x(e.start), float(e.end - e.start) * scale, y, row_h))
                continue
            if e.action.kind not in COLORS:
                continue
            pair = getattr(e, "pair", None)
            out.append(_block(look, e, x, scale, y, row_h, f"rank {r}: {e.action}" + (f" of {pair}" if pair else ""),
                              t0))
            if pair is not None:  # a simulated pair's halves: one block, outlined and labelled once
                pair_start = e.start if e.action == pair.parts[0] or pair_start is None else pair_start
                if e.action == pair.parts[-1]:
                    out.extend(_pair_outline(look, r, pair, x(pair_start), float(e.end - pair_start) * scale, y,
                                             row_h))
                    pair_start = None
                continue
            # Centered in its block with 2 px to spare each side, or left out: blocks do not overlap, so
            # neither do their labels.
            w = float(e.end - e.start) * scale
            text = next((t for t in look.labels(e) if _text_w(t) + 4 <= w), "")
            if text:
                out.append(f'<text x="{x(e.start) + w / 2:.2f}" y="{y + row_h / 2 + 4}" text-anchor="middle" '
                           f'fill="white">{escape(text)}</text>')
        out.append(f'<text x="{left + plot_w + 8}" y="{y + row_h / 2 + 4}">{escape(suffixes[r])}</text>')
    # time axis: about one tick per 90 px, so the numbers keep apart
    axis_y = top + timeline.num_ranks * (row_h + gap) + 4
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="#333"/>')
    step = _nice_step(span, max(2, int(plot_w // 90)))
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


def _block(look: _Look, e: Event, x, scale: float, y: float, row_h: float, tip: str, t0) -> str:
    x0, w = x(e.start), float(e.end - e.start) * scale
    tip = f"{tip} {_fmt(e.start - t0)}..{_fmt(e.end - t0)}"
    return (f'<rect x="{x0:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" fill="{look.color(e)}" '
            f'stroke="white" stroke-width="0.5"><title>{escape(tip)}</title></rect>')


def _pair_outline(look: _Look, rank: int, pair, x0: float, w: float, y: float, row_h: float) -> list[str]:
    """A pair's one block: an outline around its halves and both labels, where they fit."""
    out = [f'<rect class="pair" x="{x0 + 0.75:.2f}" y="{y + 0.75}" width="{max(0.0, w - 1.5):.2f}" '
           f'height="{row_h - 1.5}" fill="none" stroke="#222" stroke-width="1.5"/>']
    text = next((t for t in look.pair_labels(rank, pair) if _text_w(t) + 4 <= w), "")
    if text:
        out.append(f'<text x="{x0 + w / 2:.2f}" y="{y + row_h / 2 + 4}" text-anchor="middle" '
                   f'fill="white">{escape(text)}</text>')
    return out


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
    plot_w = max((_plot_width(t) for _, t in titled), default=_MIN_PLOT_W)  # one width, so one scale
    parts = [f"<h3>{escape(name)}</h3>\n{_svg(t, span, plot_w)}" for name, t in titled]
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
        whole_stage = a.kind.is_collective  # no microbatch to name
        events.append({
            "name": a.kind.value if whole_stage else f"{a.kind.value}{a.microbatch}", "cat": a.kind.value,
            "ph": "X", "pid": e.rank, "tid": 0, "ts": float(e.start - t0) * us, "dur": float(e.end - e.start) * us,
            "args": {"stage": a.stage, "action": str(a)} if whole_stage else
                    {"stage": a.stage, "microbatch": a.microbatch, "action": str(a)},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": timeline.schedule, "num_microbatches": timeline.num_microbatches,
                          "time_unit": timeline.time_unit,
                          **({"recorded": True} if timeline.meta.get("recorded") else {})}}


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
