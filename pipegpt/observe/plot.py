"""A run's metrics.jsonl as a picture: loss, val loss, learning rate and tokens/s against the step, one SVG;
a mixture of experts' aux loss and imbalance on a row of their own where a run has them.

Hand-written SVG like the schedule timelines (pipegpt.schedule.render), so plotting needs no library and no
torch: `pipegpt plot` starts instantly and the training loop can write plot.svg when a run closes. Several
runs overlay in one picture, a color per run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape  # as render.py: not xml.sax.saxutils (it imports urllib)
from pathlib import Path

from pipegpt.run_files import METRICS as METRICS_FILE, read_metrics
from pipegpt.schedule.render import _nice_step
from pipegpt import run_files

PLOT_FILE = run_files.PLOT
SERIES = ("loss", "val_loss", "lr", "tokens_per_s", "aux_loss", "moe_imbalance")
# (panel id, heading, [(series, how it is drawn)]). Val loss is on the loss panel, to set it beside the train
# loss, and on a panel of its own: there the early train losses do not squeeze it flat.
PANELS = [
    ("loss", "loss (line: train, dots: val)", [("loss", "line"), ("val_loss", "dots")]),
    ("val_loss", "val loss", [("val_loss", "line+dots")]),
    ("lr", "learning rate", [("lr", "line")]),
    ("tokens_per_s", "tokens/s", [("tokens_per_s", "line")]),
]
# Drawn only where some run has them (a mixture of experts: pipegpt.model.moe's figures), so a dense run's
# picture is unchanged.
MOE_PANELS = [
    ("aux_loss", "MoE aux loss", [("aux_loss", "line")]),
    ("moe_imbalance", "MoE imbalance (worst layer's max / mean tokens)", [("moe_imbalance", "line")]),
]
# Tableau 10, the palette of the timelines' colors; cycled past ten runs.
PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac"]
WIDTH, PANEL_W, PANEL_H = 1000, 500, 270
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 40  # a panel's margins around its plot area: tick labels, heading, axis


class PlotError(ValueError):
    """A run directory that cannot be plotted (no metrics.jsonl, or no rows in it)."""


@dataclass
class RunMetrics:
    """One run's figures by step: each step's last row (read_metrics), None where a value is absent or was not
    finite. val_loss holds only the evaluation steps, so its points are where evaluations were."""
    name: str
    series: dict[str, list[tuple[int, float | None]]]

    @property
    def steps(self) -> list[int]:
        return [step for step, _ in self.series["loss"]]


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def load_run(run_dir: Path, name: str | None = None) -> RunMetrics:
    """A run directory's metrics.jsonl as series; PlotError (naming the file) without one or without rows."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise PlotError(f"{path}: no such file ({run_dir} is not a `pipegpt run` directory)")
    rows = read_metrics(run_dir)  # a step run by several attempts: its last row
    if not rows:
        raise PlotError(f"{path}: no metrics rows in it")
    series: dict[str, list[tuple[int, float | None]]] = {key: [] for key in SERIES}
    for row in rows:
        for key in SERIES:
            value = _number(row.get(key))
            if key != "val_loss" or value is not None:
                series[key].append((int(row["step"]), value))
    return RunMetrics(name or run_dir.resolve().name, series)


def _names(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name in the legend; the paths as given where two names would be the same."""
    names = [Path(d).resolve().name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def _axis(lo: float, hi: float, ticks: int, integer: bool = False) -> tuple[float, float, list[float]]:
    """The range [lo, hi] widened to nice bounds, and its tick values (multiples of a 1/2/5 step)."""
    if lo == hi:  # one value (a run of one step, a constant learning rate): a band around it
        pad = 1.0 if integer or lo == 0 else abs(lo) * 0.1
        lo, hi = (0.0 if integer and lo == 0 else lo - pad), hi + pad  # no step -1
    step = _nice_step(hi - lo, ticks)
    if integer:
        step = max(1.0, step)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return first * step, last * step, [k * step for k in range(first, last + 1)]  # k * step: no drift


def _tick(x: float) -> str:
    """A tick label: 0.0003, 2.5, 120k, 1.5M."""
    if abs(x) < 1e-12:
        return "0"
    for at, scale, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if abs(x) >= at:
            return f"{x / scale:.4g}{suffix}"
    return f"{x:.4g}"


def _thin(points: list[tuple[int, float | None]], fx) -> list[tuple[int, float | None]]:
    """At most the lowest and the highest point per pixel column, in step order: a 100k-step run draws as
    small as a short one, and its spikes stay. A None (a gap in the line) is kept."""
    out, column, at = [], [], None

    def flush():
        if column:
            out.extend(sorted({min(column, key=lambda p: p[1]), max(column, key=lambda p: p[1])}))
            column.clear()

    for point in points:
        col = None if point[1] is None else int(fx(point[0]))
        if col != at:
            flush()
        if col is None:
            out.append(point)
        else:
            column.append(point)
        at = col
    flush()
    return out


def _panel(x0: float, y0: float, panel: tuple, runs: list[RunMetrics], colors: list[str],
           xlo: float, xhi: float, xticks: list[float]) -> list[str]:
    key, heading, drawn = panel
    pw, ph = PANEL_W - LEFT - RIGHT, PANEL_H - TOP - BOTTOM
    left, top = x0 + LEFT, y0 + TOP
    out = [f'<text x="{left}" y="{y0 + 18}" font-size="12" font-weight="bold">{escape(heading)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    values = [v for run in runs for series, _ in drawn for _, v in run.series[series] if v is not None]
    if not values:
        return out + [f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" fill="#777">'
                      f'no {escape(heading)} in {"these runs" if len(runs) > 1 else "this run"}</text>']
    ylo, yhi, yticks = _axis(min(values), max(values), 4)

    def fx(step):
        return left + (step - xlo) / (xhi - xlo) * pw

    def fy(value):
        return top + ph - (value - ylo) / (yhi - ylo) * ph

    for t in xticks:
        out.append(f'<line x1="{fx(t):.1f}" y1="{top + ph}" x2="{fx(t):.1f}" y2="{top + ph + 4}" stroke="#333"/>'
                   f'<text x="{fx(t):.1f}" y="{top + ph + 16}" text-anchor="middle">{_tick(t)}</text>')
    for t in yticks:
        out.append(f'<line x1="{left}" y1="{fy(t):.1f}" x2="{left + pw}" y2="{fy(t):.1f}" stroke="#e6e6e6"/>'
                   f'<text x="{left - 6}" y="{fy(t) + 4:.1f}" text-anchor="end">{_tick(t)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{top + ph + 32}" text-anchor="middle">step</text>')
    for run, color in zip(runs, colors):
        for series, how in drawn:
            points = run.series[series]
            if not any(v is not None for _, v in points):
                continue  # a run without evaluations draws nothing here
            tag = f'data-panel="{key}" data-series="{series}" data-run="{escape(run.name)}"'
            if "line" in how:
                d, pen_up = [], True
                for step, v in _thin(points, fx):
                    if v is None:
                        pen_up = True  # a step whose value was not finite: a gap, not a line across it
                        continue
                    d.append(f"{'M' if pen_up else 'L'}{fx(step):.1f},{fy(v):.1f}")
                    pen_up = False
                out.append(f'<path {tag} d="{" ".join(d)}" fill="none" stroke="{color}" stroke-width="1.5" '
                           f'stroke-linejoin="round"><title>{escape(run.name)}: {escape(heading)}</title></path>')
            # dots: what val_loss is (a few evaluations); a lone point too, as a path of one point shows nothing
            if "dots" in how or sum(v is not None for _, v in points) == 1:
                dots = [f'<circle cx="{fx(step):.1f}" cy="{fy(v):.1f}" r="3"><title>{escape(run.name)} step '
                        f'{step}: {series} {v:.6g}</title></circle>' for step, v in points if v is not None]
                # hollow, so that on the loss panel they stand out from the train line of the same color
                out.append(f'<g {tag} data-dots="1" fill="white" stroke="{color}" stroke-width="1.5">'
                           + "".join(dots) + "</g>")
    return out


def plot_runs(run_dirs: list[Path], title: str | None = None) -> str:
    """An SVG document of the runs' loss, val loss, learning rate and tokens/s against the step, 2x2 panels (a
    third row for a mixture of experts' aux loss and imbalance), every run in each (one color per run, named by its directory in the legend). PlotError (a ValueError)
    names a run directory without metrics.jsonl or with no rows in it."""
    if not run_dirs:
        raise PlotError("no run directory to plot")
    runs = [load_run(d, name) for d, name in zip(run_dirs, _names(run_dirs))]
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(runs))]
    steps = [step for run in runs for step in run.steps]
    xlo, xhi, xticks = _axis(min(steps), max(steps), 5, integer=True)

    # the legend: a swatch and a name per run, wrapped onto as many lines as it takes
    legend, lx, ly = [], 16, 46
    for run, color in zip(runs, colors):
        w = 40 + 7 * len(run.name)
        if lx + w > WIDTH and lx > 16:
            lx, ly = 16, ly + 18
        legend.append(f'<rect x="{lx}" y="{ly - 9}" width="18" height="4" fill="{color}"/>'
                      f'<text x="{lx + 24}" y="{ly}">{escape(run.name)}</text>')
        lx += w
    y0 = ly + 10
    panels = PANELS + [p for p in MOE_PANELS if any(v is not None for run in runs for _, v in run.series[p[0]])]
    height = y0 + -(-len(panels) // 2) * PANEL_H
    heading = title if title is not None else (runs[0].name if len(runs) == 1 else f"{len(runs)} runs")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="16" y="22" font-size="14" font-weight="bold">{escape(heading)}</text>', *legend]
    for i, panel in enumerate(panels):
        out += _panel((i % 2) * PANEL_W, y0 + (i // 2) * PANEL_H, panel, runs, colors, xlo, xhi, xticks)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_plot(run_dir: Path) -> Path | None:
    """run_dir/plot.svg of that one run, for the training loop to call when a run closes. A run with no rows
    yet (it failed before its first step) gets no picture and no error: None."""
    try:
        text = plot_runs([Path(run_dir)])
    except PlotError:  # only a missing or empty metrics.jsonl raises it
        return None
    path = Path(run_dir) / PLOT_FILE
    path.write_text(text)
    return path


def plot_command(run_dirs, out, title) -> Path:
    """`pipegpt plot`'s work: the runs' picture written to `out` (default: plot.svg in the one run's directory,
    ./plot.svg for several); returns where. PlotError (one line) when it cannot."""
    dirs = [Path(d) for d in run_dirs]
    out = Path(out) if out is not None else (dirs[0] / PLOT_FILE if len(dirs) == 1 else Path(PLOT_FILE))
    text = plot_runs(dirs, title)
    try:
        out.write_text(text)
    except OSError as e:
        raise PlotError(f"cannot write {out}: {e.strerror}") from None
    return out
