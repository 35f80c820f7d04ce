"""pipegpt.observe.plot and `pipegpt plot`: metrics.jsonl rows as an SVG of loss, val loss, lr and tokens/s."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from helpers import ROOT, assert_one_line_error, invoke
from pipegpt.observe.plot import PlotError, _axis, _tick, load_run, plot_runs, write_plot
from test_schedule_imports import imported_top_levels, module_graph

SVG = "{http://www.w3.org/2000/svg}"


def write_run(path, rows):
    """A run directory holding these rows as metrics.jsonl (None values are JSON null, as the run writes them)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def row(step, loss, val_loss=None, attempt=1, lr=3e-4, tokens_per_s=1000.0):
    return {"step": step, "attempt": attempt, "loss": loss, "val_loss": val_loss, "lr": lr,
            "tokens_per_s": tokens_per_s, "step_time_s": 0.5}


def drawn(svg: str, tag: str, panel: str, series: str, run: str | None = None) -> list[ET.Element]:
    """The elements (path: a line, g: a group of dots) of one series on one panel, of one run or all."""
    root = ET.fromstring(svg)
    return [e for e in root.iter(SVG + tag) if e.get("data-panel") == panel and e.get("data-series") == series
            and (run is None or e.get("data-run") == run)]


def dot_titles(group: ET.Element) -> list[str]:
    return [c.find(SVG + "title").text for c in group.iter(SVG + "circle")]


def test_two_runs_overlay_a_line_per_run_per_series_and_a_legend_naming_both(tmp_path):
    a = write_run(tmp_path / "run-a", [row(s, 5.0 - s / 10, val_loss=4.8 - s / 10 if s % 5 == 0 else None)
                                       for s in range(1, 21)])
    b = write_run(tmp_path / "run-b", [row(s, 4.0 - s / 20, lr=1e-3, tokens_per_s=2.5e5) for s in range(0, 31)])
    svg = plot_runs([a, b])
    root = ET.fromstring(svg)  # well-formed XML
    for panel, series in [("loss", "loss"), ("lr", "lr"), ("tokens_per_s", "tokens_per_s")]:
        lines = drawn(svg, "path", panel, series)
        assert sorted(e.get("data-run") for e in lines) == ["run-a", "run-b"], (panel, series)
        assert len({e.get("stroke") for e in lines}) == 2  # a color per run
    # run-b has no evaluations: only run-a has val loss, as dots on the loss panel and a line on its own panel
    assert [e.get("data-run") for e in drawn(svg, "g", "loss", "val_loss")] == ["run-a"]
    assert [e.get("data-run") for e in drawn(svg, "path", "val_loss", "val_loss")] == ["run-a"]
    texts = [t.text for t in root.iter(SVG + "text")]
    assert "run-a" in texts and "run-b" in texts
    assert "2 runs" in texts
    # the shared step axis spans both runs (0..30) with nice ticks
    assert {"0", "10", "20", "30"} <= set(texts)
    # one point per step in a line
    assert len(drawn(svg, "path", "loss", "loss", "run-b")[0].get("d").split()) == 31


def test_a_step_run_twice_keeps_its_last_row(tmp_path):
    """Attempt 1 ran steps 1..4 and checkpointed at 2; attempt 2 resumed there and wrote 3 and 4 again."""
    rows = [row(1, 5.0), row(2, 4.0, val_loss=4.5), row(3, 3.0), row(4, 2.0, val_loss=2.5),
            row(3, 3.3, attempt=2), row(4, 2.2, val_loss=2.7, attempt=2)]
    run = write_run(tmp_path / "resumed", rows)
    metrics = load_run(run)
    assert metrics.steps == [1, 2, 3, 4]
    assert metrics.series["loss"] == [(1, 5.0), (2, 4.0), (3, 3.3), (4, 2.2)]
    assert metrics.series["val_loss"] == [(2, 4.5), (4, 2.7)]
    svg = plot_runs([run])
    assert len(drawn(svg, "path", "loss", "loss")[0].get("d").split()) == 4  # not 6: no step twice
    [dots] = drawn(svg, "g", "loss", "val_loss")
    assert dot_titles(dots) == ["resumed step 2: val_loss 4.5", "resumed step 4: val_loss 2.7"]


def test_val_loss_dots_only_at_evaluation_steps(tmp_path):
    run = write_run(tmp_path / "r", [row(s, 3.0, val_loss=2.0 + s / 100 if s in (5, 10, 15) else None)
                                     for s in range(1, 16)])
    svg = plot_runs([run])
    [dots] = drawn(svg, "g", "loss", "val_loss")
    assert dot_titles(dots) == ["r step 5: val_loss 2.05", "r step 10: val_loss 2.1", "r step 15: val_loss 2.15"]
    [line] = drawn(svg, "path", "val_loss", "val_loss")
    assert len(line.get("d").split()) == 3
    # the dots sit on three distinct x positions, left to right
    xs = [float(c.get("cx")) for c in dots.iter(SVG + "circle")]
    assert xs == sorted(xs) and len(set(xs)) == 3


def test_one_step_without_val_loss_still_draws(tmp_path):
    run = write_run(tmp_path / "short", [row(0, 5.5)])
    svg = plot_runs([run], title="a <short> run")
    root = ET.fromstring(svg)
    texts = [t.text for t in root.iter(SVG + "text")]
    assert "a <short> run" in texts  # escaped in the file, the title back when parsed
    assert "no val loss in this run" in texts
    assert drawn(svg, "path", "val_loss", "val_loss") == [] and drawn(svg, "g", "loss", "val_loss") == []
    # a path of one point shows nothing: the lone value is a dot as well
    [dot] = drawn(svg, "g", "loss", "loss")
    assert dot_titles(dot) == ["short step 0: loss 5.5"]


def test_a_nonfinite_loss_is_a_gap_in_the_line(tmp_path):
    run = write_run(tmp_path / "r", [row(s, None if s == 3 else 4.0 - s / 10) for s in range(1, 7)])
    d = drawn(plot_runs([run]), "path", "loss", "loss")[0].get("d").split()
    assert [p[0] for p in d] == ["M", "L", "M", "L", "L"]  # steps 1-2, then 4-6


def test_a_long_run_draws_at_most_two_points_per_pixel_and_keeps_its_spike(tmp_path):
    rows = [row(s, 10.0 if s == 5000 else 3.0 + (s % 7) / 100) for s in range(1, 20001)]
    svg = plot_runs([write_run(tmp_path / "long", rows)])
    points = drawn(svg, "path", "loss", "loss")[0].get("d").split()
    assert len(points) <= 2 * 500
    ys = [float(p[1:].split(",")[1]) for p in points]
    frame = next(r for r in ET.fromstring(svg).iter(SVG + "rect") if r.get("stroke") == "#999")  # loss panel's
    assert min(ys) == pytest.approx(float(frame.get("y")), abs=0.1)  # the spike, 10, is the axis top (2..10)


@pytest.mark.parametrize("lo,hi,ticks,expected", [
    (1.02, 6.1, 4, (0.0, 8.0, [0.0, 2.0, 4.0, 6.0, 8.0])),
    (1, 300, 5, (0.0, 300.0, [0.0, 100.0, 200.0, 300.0])),
    (3e-4, 3e-4, 4, (2.6e-4, 3.4e-4, None)),  # one value: a band around it
])
def test_axis_ticks_are_nice_numbers(lo, hi, ticks, expected):
    a, b, t = _axis(lo, hi, ticks)
    assert (a, b) == pytest.approx(expected[:2])
    if expected[2] is not None:
        assert t == pytest.approx(expected[2])
    assert [_tick(x) for x in (0.0, 0.0003, 2.5, 1000.0, 250000.0, 1.5e6)] == \
        ["0", "0.0003", "2.5", "1000", "250k", "1.5M"]


def test_steps_of_one_run_are_whole_numbers_from_zero():
    assert _axis(0, 0, 5, integer=True) == (0.0, 1.0, [0.0, 1.0])
    assert _axis(1, 1, 5, integer=True) == (0.0, 2.0, [0.0, 1.0, 2.0])


def test_missing_or_empty_metrics_raise_a_value_error_naming_the_file(tmp_path):
    (tmp_path / "bare").mkdir()
    with pytest.raises(ValueError, match="bare/metrics.jsonl: no such file"):
        plot_runs([tmp_path / "bare"])
    (tmp_path / "bare" / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match="bare/metrics.jsonl: no metrics rows"):
        plot_runs([tmp_path / "bare"])
    with pytest.raises(PlotError, match="nowhere: no such run directory"):
        plot_runs([write_run(tmp_path / "ok", [row(1, 3.0)]), tmp_path / "nowhere"])


def test_write_plot_writes_plot_svg_and_nothing_for_a_run_without_rows(tmp_path):
    run = write_run(tmp_path / "r", [row(1, 3.0), row(2, 2.5)])
    path = write_plot(run)
    assert path == run / "plot.svg"
    ET.fromstring(path.read_text())
    (tmp_path / "none").mkdir()
    assert write_plot(tmp_path / "none") is None  # failed before its first step: no metrics.jsonl
    (tmp_path / "none" / "metrics.jsonl").write_text("")
    assert write_plot(tmp_path / "none") is None
    assert not (tmp_path / "none" / "plot.svg").exists()


def test_cli_one_run_writes_plot_svg_in_its_directory(tmp_path):
    run = write_run(tmp_path / "r", [row(s, 4.0 - s / 10) for s in range(1, 6)])
    result = invoke("plot", run)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"wrote {run / 'plot.svg'}"
    assert len(drawn((run / "plot.svg").read_text(), "path", "loss", "loss")) == 1


def test_cli_several_runs_write_plot_svg_here_or_to_out(tmp_path, monkeypatch):
    a = write_run(tmp_path / "a", [row(1, 4.0), row(2, 3.0)])
    b = write_run(tmp_path / "b", [row(1, 4.5), row(2, 3.5)])
    monkeypatch.chdir(tmp_path)
    result = invoke("plot", a, b)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "wrote plot.svg"
    assert len(drawn((tmp_path / "plot.svg").read_text(), "path", "lr", "lr")) == 2
    result = invoke("plot", a, b, "--out", tmp_path / "ab.svg", "--title", "a vs b")
    assert result.exit_code == 0, result.output
    assert "a vs b" in (tmp_path / "ab.svg").read_text()


def test_cli_a_directory_without_metrics_is_one_error_line(tmp_path):
    good = write_run(tmp_path / "good", [row(1, 4.0)])
    (tmp_path / "empty").mkdir()
    assert_one_line_error(invoke("plot", good, tmp_path / "empty"), f"{tmp_path / 'empty' / 'metrics.jsonl'}")
    assert not (tmp_path / "good" / "plot.svg").exists() and not (tmp_path / "empty" / "plot.svg").exists()
    assert_one_line_error(invoke("plot", tmp_path / "missing"), f"{tmp_path / 'missing'}: no such run directory")


def test_plot_imports_no_torch():
    """Plotting is for after a run, and for the end of one: pipegpt.observe.plot and all it imports are torch-free."""
    graph, seen, todo = module_graph(ROOT, "pipegpt"), set(), ["pipegpt.observe.plot"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, ())
    files = {path: names for path, names in imported_top_levels(ROOT, "pipegpt").items()
             if path[:-3].replace("/", ".").removesuffix(".__init__") in seen}
    assert "pipegpt/observe/plot.py" in files
    assert not [path for path, names in files.items() if "torch" in names]
