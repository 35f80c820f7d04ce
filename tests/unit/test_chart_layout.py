"""Chart layout (pipegpt.schedule.render): labels that never merge or overlap, an SVG as wide as the schedule
is long, a look of its own for a rank's second stage, and a legend of only the kinds drawn."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from pipegpt.schedule import Action, build_plan
from pipegpt.schedule.render import COLORS, ascii_gantt, to_svg
from pipegpt.schedule.simulate import Costs, costs_for_plan, simulate

SVG = "{http://www.w3.org/2000/svg}"


def timeline(name: str, p: int, m: int, v: int | None = None):
    """Simulated with the CLI's default costs (a rank's share of the model: 1/v per stage on V schedules)."""
    plan = build_plan(name, p, m, v)
    return simulate(plan, costs_for_plan(None, plan))


def bars(text: str) -> list[str]:
    return [line[line.index("|") + 1:line.rindex("|")] for line in text.splitlines()
            if line.startswith("r") and " |" in line]


def legend_line(text: str) -> str:
    return next(line for line in text.splitlines() if "'.' idle" in line)


# 1. ASCII labels: every word in a row is one whole label, starting where its own block starts.

ASCII_CASES = [("1f1b", 4, 16, None), ("gpipe", 4, 8, None), ("zb-h1", 8, 32, None), ("zbv", 4, 16, None),
               ("zbv", 8, 32, None), ("dualpipev", 4, 16, None), ("interleaved-1f1b", 4, 16, None),
               ("interleaved-1f1b", 4, 8, 3)]


@pytest.mark.parametrize("name,p,m,v", ASCII_CASES)
def test_ascii_words_are_whole_labels_of_their_own_block(name, p, m, v):
    tl = timeline(name, p, m, v)
    chunk = {s: tl.stage_to_rank[:s].count(r) for s, r in enumerate(tl.stage_to_rank)}
    most = max(chunk.values()) + 1
    word = (re.compile(r"(?:(\d+)([FBIW])(\d+)|([FBIW]))") if most > 2 else re.compile(r"([FBIWfbiw])(\d*)"))
    span, t0 = float(tl.makespan), tl.start_time
    labelled = 0
    for width in range(40, 201, 20):
        rows = bars(ascii_gantt(tl, width=width))
        assert len(rows) == p
        for r, bar in enumerate(rows):
            # Each block's columns at the chart's scale (the makespan over the bar), before rounding.
            cols = [(float(e.start - t0) * len(bar) / span, float(e.end - t0) * len(bar) / span, e.action)
                    for e in tl.events if e.rank == r]
            for token in re.finditer(r"[^ .]+", bar):
                found = word.fullmatch(token.group())
                assert found, f"{name} width {width} rank {r}: {token.group()!r} in {bar!r} is not one label"
                if most > 2:
                    stage, kind, mb = found.groups()[:3] if found.group(1) else (None, found.group(4), None)
                    want = (None if stage is None else int(stage), kind, None if mb is None else int(mb), None)
                else:
                    letter, mb = found.groups()
                    want = (None, letter.upper(), int(mb) if mb else None, int(letter.islower()))
                # One of this rank's blocks starts at the label's column (rounded either way), holds it, and is
                # the action it names.
                owners = [a for c0, c1, a in cols
                          if abs(c0 - token.start()) <= 0.5001 and token.end() <= max(c1 + 0.5001, token.start() + 1)
                          and a.kind.value == want[1] and want[0] in (None, a.stage)
                          and want[2] in (None, a.microbatch) and want[3] in (None, chunk[a.stage])]
                assert owners, f"{name} width {width} rank {r}: {token.group()!r} at {token.start()} is no block's"
                labelled += 1
    assert labelled > 0


def test_ascii_wide_enough_labels_every_block_in_full():
    rows = bars(ascii_gantt(timeline("1f1b", 4, 8), width=200))
    assert sorted(rows[0].replace(".", " ").split()) == sorted([f"F{i}" for i in range(8)] +
                                                              [f"B{i}" for i in range(8)])
    zbv = bars(ascii_gantt(timeline("zbv", 2, 4), width=120))
    assert zbv[0].split()[:6] == ["F0", "F1", "F2", "f0", "i0", "w0"]  # lower case: rank 0's second stage


def test_ascii_says_what_a_blank_stretch_is_when_blocks_are_too_short():
    dense = ascii_gantt(timeline("zbv", 4, 16), width=80)
    assert legend_line(dense).endswith("'.' idle; blank: too short to label at this width")
    wide = ascii_gantt(timeline("1f1b", 4, 8), width=200)
    assert "blank" not in legend_line(wide)


# 2. SVG width: follows the schedule's length; texts keep apart.

def svg_root(tl, **kw) -> ET.Element:
    return ET.fromstring(to_svg(tl, **kw))


def text_extents(root: ET.Element) -> dict[str, list[tuple[float, float, str]]]:
    """(left, right, text) of every text element, by baseline y; widths estimated as 0.6 x font size a char."""
    rows: dict[str, list] = {}
    default = float(root.get("font-size"))
    for t in root.iter(SVG + "text"):
        w = 0.6 * float(t.get("font-size", default)) * len(t.text)
        x = float(t.get("x"))
        left = {"middle": x - w / 2, "end": x - w}.get(t.get("text-anchor"), x)
        rows.setdefault(t.get("y"), []).append((left, left + w, t.text))
    return rows


def test_svg_width_follows_the_schedule_length():
    widths = {(p, m): int(svg_root(timeline("1f1b", p, m)).get("width")) for p, m in [(2, 2), (4, 4), (8, 64)]}
    assert widths[(2, 2)] < widths[(4, 4)] < widths[(8, 64)]
    assert widths[(2, 2)] < 800 and widths[(8, 64)] > 5000
    # wide enough that every block of 1f1b 8x64 carries its whole label, "F63" and "B63" included
    tl = timeline("1f1b", 8, 64)
    labels = [t.text for t in svg_root(tl).iter(SVG + "text") if t.get("fill") == "white"]
    assert sorted(labels) == sorted(f"{e.action.kind.value}{e.action.microbatch}" for e in tl.events)
    # a huge schedule is clamped: a long picture, not an endless one
    assert int(svg_root(timeline("zbv", 8, 64)).get("width")) < 13000


@pytest.mark.parametrize("name,p,m", [("1f1b", 2, 2), ("1f1b", 4, 16), ("zb-h1", 4, 8), ("zbv", 4, 16),
                                      ("dualpipev", 8, 32), ("zbv", 8, 64), ("interleaved-1f1b", 8, 64)])
def test_svg_texts_do_not_overlap(name, p, m):
    root = svg_root(timeline(name, p, m))
    width = float(root.get("width"))
    for y, row in text_extents(root).items():
        row.sort()
        assert row[0][0] >= 0 and row[-1][1] <= width, (y, row[0], row[-1], width)
        for a, b in zip(row, row[1:]):
            assert a[1] <= b[0], f"row y={y}: {a[2]!r} and {b[2]!r} overlap"


def test_one_plan_measured_and_predicted_share_one_scale():
    plan = build_plan("1f1b", 4, 8)
    fast, slow = simulate(plan, Costs.uniform(4, 1, 2)), simulate(plan, Costs.uniform(4, 1.5, 2.5))
    span = max(fast.makespan, slow.makespan)
    axes = [next(svg_root(tl, span=span).iter(SVG + "line")).attrib for tl in (fast, slow)]
    assert axes[0] == axes[1]  # the time axis: same pixels for the same span


# 3. A rank's second stage: its own opaque shade, not the idle hatching.

def blocks(root: ET.Element) -> list[tuple[Action, ET.Element]]:
    return [(Action.parse(r.find(SVG + "title").text.split()[2]), r)
            for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "interleaved-1f1b"])
def test_svg_second_stage_has_its_own_opaque_shade(name):
    p = 4
    tl = timeline(name, p, 8)
    root = svg_root(tl)
    first_stage = {s: tl.stage_to_rank.index(r) == s for s, r in enumerate(tl.stage_to_rank)}
    fills: dict[tuple[bool, str], set[str]] = {}
    for action, rect in blocks(root):
        assert rect.get("fill-opacity") is None and rect.get("opacity") is None  # opaque: no hatching through
        fills.setdefault((first_stage[action.stage], action.kind.value), set()).add(rect.get("fill"))
    kinds = {k for _, k in fills}
    for kind in kinds:
        first, second = fills[(True, kind)], fills[(False, kind)]
        assert first == {COLORS[kind]} and len(second) == 1
        assert second.isdisjoint(set(COLORS.values()) | {"url(#idle)"})
        assert re.fullmatch(r"#[0-9a-f]{6}", next(iter(second)))
    # the legend shows those shades and says what they mean
    legend = root.find(f"{SVG}g[@id='legend']")
    swatches = {r.get("fill") for r in legend.iter(SVG + "rect")}
    assert {next(iter(fills[(False, k)])) for k in kinds} <= swatches
    assert any("second stage" in (t.text or "") for t in legend.iter(SVG + "text"))


def test_single_stage_ranks_have_no_second_look():
    root = svg_root(timeline("1f1b", 4, 8))
    assert {r.get("fill") for _, r in blocks(root)} == {COLORS["F"], COLORS["B"]}
    legend = root.find(f"{SVG}g[@id='legend']")
    assert {r.get("fill") for r in legend.iter(SVG + "rect")} == {COLORS["F"], COLORS["B"], "url(#idle)"}


def test_ascii_second_stage_is_lower_case_and_explained():
    text = ascii_gantt(timeline("zbv", 2, 4), width=200)
    assert legend_line(text) == "F forward, I input grad, W weight grad; f i w: a rank's second stage; '.' idle"


# 4. The legend lists only the kinds drawn.

def legend_texts(tl) -> list[str]:
    return [t.text for t in svg_root(tl).find(f"{SVG}g[@id='legend']").iter(SVG + "text")]


def test_legend_lists_only_the_kinds_present():
    assert legend_texts(timeline("1f1b", 4, 8)) == ["F forward", "B backward", "idle"]
    assert legend_line(ascii_gantt(timeline("1f1b", 4, 8), width=200)) == "F forward, B backward; '.' idle"
    assert legend_texts(timeline("zb-h1", 4, 8)) == ["F forward", "I input grad", "W weight grad", "idle"]
    assert legend_line(ascii_gantt(timeline("zb-h1", 4, 8), width=200)) == \
        "F forward, I input grad, W weight grad; '.' idle"
    assert legend_texts(timeline("dualpipev", 4, 8)) == ["F forward", "B backward", "I input grad", "W weight grad",
                                                         "idle", "darker, f b i w: a rank's second stage"]
    assert legend_texts(timeline("interleaved-1f1b", 4, 8, 3))[-1] == \
        "darker: a rank's later stages; labels are <stage><kind><microbatch>"
