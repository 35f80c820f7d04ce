"""Renderers: ASCII Gantt, SVG/HTML, Chrome trace, and write() by extension."""
import json
import xml.etree.ElementTree as ET

import pytest

from pipegpt.schedule import Action, ScheduleError, build_plan
from pipegpt.schedule.render import ascii_gantt, to_chrome_trace, to_html, to_svg, write
from pipegpt.schedule.simulate import Costs, Event, Timeline, simulate

SVG = "{http://www.w3.org/2000/svg}"


def timeline(name="1f1b", p=4, m=8, **costs):
    plan = build_plan(name, p, m)
    return simulate(plan, Costs.uniform(plan.num_stages, 1, 2, 1, **costs))


def chart_rows(text):
    return [line for line in text.splitlines() if line.startswith("r") and " |" in line]


@pytest.mark.parametrize("name,p", [("1f1b", 4), ("gpipe", 3), ("zbv", 2), ("interleaved-1f1b", 4)])
def test_ascii_one_row_per_rank_with_idle_marks(name, p):
    text = ascii_gantt(timeline(name, p, 8), width=120)
    rows = chart_rows(text)
    assert [row.split()[0] for row in rows] == [f"r{r}" for r in range(p)]
    bars = [row[row.index("|") + 1:row.rindex("|")] for row in rows]
    assert len({len(b) for b in bars}) == 1
    assert "." in bars[-1] and "." in bars[0]  # fill and drain bubbles
    assert all(len(line) <= 120 for line in text.splitlines()[:p + 2])
    for r in range(p):  # a summary line per rank
        assert any(line.startswith(f"r{r} ") and "busy" in line and "peak live" in line for line in text.splitlines())


def test_ascii_labels_and_chunks():
    text = ascii_gantt(timeline("1f1b", 2, 3), width=200)
    assert "F0" in text and "B2" in text and "f0" not in text
    text = ascii_gantt(timeline("zbv", 2, 4), width=200)
    assert "F0" in text and "f0" in text and "i0" in text and "w0" in text  # lower case: a rank's second stage
    assert "second" in text


def test_ascii_no_idle_on_one_rank():
    rows = chart_rows(ascii_gantt(timeline("1f1b", 1, 4), width=80))
    assert len(rows) == 1 and "." not in rows[0]


def test_ascii_narrow_never_shows_a_cut_number():
    text = ascii_gantt(timeline("1f1b", 4, 16), width=60)
    for row in chart_rows(text):
        bar = row[row.index("|") + 1:row.rindex("|")]
        for token in bar.replace(".", " ").split():
            for part in token.replace("F", " F").replace("B", " B").split():
                assert part[0] in "FB" and (part[1:] == "" or 0 <= int(part[1:]) < 16)


def test_ascii_shows_bytes_when_known():
    text = ascii_gantt(timeline("1f1b", 2, 4, activation_bytes=3 * 2**20), width=100)
    assert "(6.0 MiB)" in text and "(3.0 MiB)" in text


def test_svg_is_xml_with_a_block_per_compute_event():
    tl = timeline("zb-h1", 3, 6)
    root = ET.fromstring(to_svg(tl))
    assert root.tag == SVG + "svg"
    blocks = [r for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert len(blocks) == len(tl.events)
    texts = " ".join(t.text or "" for t in root.iter(SVG + "text"))
    assert "zb-h1" in texts and "bubble" in texts and "rank 2" in texts
    assert any("url(#idle)" == r.get("fill") for r in root.iter(SVG + "rect"))


def test_html_wraps_svg_and_table():
    html = to_html(timeline("1f1b", 2, 4, activation_bytes=1000))
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html and "<table>" in html
    assert html.count("<tr>") == 1 + 2 and "peak activations" in html


def test_chrome_trace_events_and_durations():
    tl = timeline("zbv", 2, 4, comm=0.5)
    trace = json.loads(json.dumps(to_chrome_trace(tl)))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl.events)
    by_action = {(e["pid"], e["args"]["action"]): e for e in xs}
    for ev in tl.events:
        x = by_action[(ev.rank, str(ev.action))]
        assert x["dur"] == pytest.approx(1000 * (ev.end - ev.start))
        assert x["ts"] == pytest.approx(1000 * ev.start)
        assert x["name"] == f"{ev.action.kind.value}{ev.action.microbatch}"
        assert x["args"]["stage"] == ev.action.stage and x["args"]["microbatch"] == ev.action.microbatch
    assert {e["pid"] for e in xs} == {0, 1}


def test_chrome_trace_of_measured_seconds():
    tl = Timeline([Event(0, Action.parse("0F0"), 100.0, 100.25), Event(0, Action.parse("0B0"), 100.25, 100.75)],
                  1, schedule="measured", time_unit="s")
    xs = [e for e in to_chrome_trace(tl)["traceEvents"] if e["ph"] == "X"]
    assert [(x["ts"], x["dur"]) for x in xs] == [(0.0, 250000.0), (250000.0, 500000.0)]


def test_write_by_extension(tmp_path):
    tl = timeline("1f1b", 2, 2)
    for ext in ("svg", "html", "json"):
        write(tl, tmp_path / f"t.{ext}")
    ET.parse(tmp_path / "t.svg")
    assert "<svg" in (tmp_path / "t.html").read_text()
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    with pytest.raises(ScheduleError, match=r"unknown extension '.png'; use .svg, .html or .json"):
        write(tl, tmp_path / "t.png")
