"""Schedule files (hand-written plans) and the golden plans of three generators.

The golden files in tests/unit/golden/ are Plan.to_text() of the compute plan and,
in *_lowered.txt, of the lowered plan. After an intended change to a generator
or to lowering, regenerate them and review the diff:

    PIPEGPT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_schedule_file.py -k golden
"""
import os
from pathlib import Path

import pytest

from pipegpt.schedule import SCHEDULES, ScheduleError, build_plan, lower
from pipegpt.schedule.schedule_file import dump_schedule_text, load_schedule_file, parse_schedule_text

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_CASES = [("1f1b", 4, 8), ("interleaved-1f1b", 4, 8), ("zbv", 2, 8)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("lowered", [False, True])
def test_round_trip_to_text(tmp_path, name, lowered):
    plan = build_plan(name, 3, 6)
    plan = lower(plan) if lowered else plan
    path = tmp_path / f"{plan.name}.txt"
    path.write_text(plan.to_text())
    assert load_schedule_file(path) == plan  # stages placed by the rank line that uses them (V shapes too)


def test_round_trip_with_headers(tmp_path):
    plan = build_plan("dualpipev", 2, 4)
    path = tmp_path / "anything.txt"
    path.write_text(dump_schedule_text(plan))
    assert load_schedule_file(path) == plan


def test_csv_comments_and_blank_lines(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("# my hand-made plan\n\n"
                    "0F0,0F1,0B0,0B1\n"
                    "   # rank 1 follows\n"
                    "1F0, 1B0, 1F1, 1B1   # 1F1B on the last stage\n\n")
    plan = load_schedule_file(path)
    assert plan.name == "mine" and plan.num_microbatches == 2 and plan.stage_to_rank == (0, 1)
    assert plan.as_strings() == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]


def test_stages_header_places_stages():
    text = "# name: tiny-v\n# stages: 0 1 1 0\n" + build_plan("zbv", 2, 2).to_text()
    plan = parse_schedule_text(text)
    assert plan.name == "tiny-v" and plan.stage_to_rank == (0, 1, 1, 0) and plan.num_stages == 4


def test_bad_token_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("# header\n0F0 0F1 0B0 0B1\n1F0 1B0 XYZ 1F1 1B1\n")
    with pytest.raises(ScheduleError, match=rf"^{path}:3: bad token 'XYZ' \(expected <stage><kind><microbatch>"):
        load_schedule_file(path)


def test_dependency_error_names_file_line_rank_and_step(tmp_path):
    path = tmp_path / "order.txt"
    path.write_text("0F0 0F1 0B0 0B1\n\n1B0 1F0 1F1 1B1\n")
    with pytest.raises(ScheduleError, match=rf"^{path}:3: rank 1 step 0 \(1B0\): needs 1F0") as info:
        load_schedule_file(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text,pattern", [
    ("0F0 0B0\n1F0 1B0\n1F1", r"^f.txt:3: 1F1 is on rank 2, but stage 1 is already on rank 1 \(line 2\)"),
    ("# stages: 0 1 1\n0F0 0B0\n1F0 1B0 2F0 2B0\n0F1",
     r"^f.txt: '# stages:' places stages on 2 ranks but the file has 3"),
    ("# stages: 0 1\n1F0 1B0\n0F0 0B0\n", r"^f.txt:2: rank 0 step 0 \(1F0\): stage 1 belongs to rank 1"),
    ("# stages: 0 x\n0F0 0B0\n1F0 1B0\n", r":1: bad '# stages:' header"),
    ("# stages: 0 1 2\n0F0 0B0\n1F0 1B0\n", r"places stages on 3 ranks but the file has 2 rank lines"),
    ("0F0 0B0\n2F0 2B0\n", r"stage 1 has no actions"),
    ("# nothing\n\n", r"no actions"),
    ("0F0 0F1 0B0\n", r"missing 0B1"),
])
def test_malformed_files(text, pattern):
    with pytest.raises(ScheduleError, match=pattern):
        parse_schedule_text(text, source="f.txt")


def test_missing_file():
    with pytest.raises(ScheduleError, match=r"^/nonexistent/plan.txt: cannot read schedule file"):
        load_schedule_file("/nonexistent/plan.txt")


@pytest.mark.parametrize("name,p,m", GOLDEN_CASES)
@pytest.mark.parametrize("lowered", [False, True])
def test_golden_plans(name, p, m, lowered):
    plan = build_plan(name, p, m)
    plan = lower(plan) if lowered else plan
    path = GOLDEN / f"{name}_{p}x{m}{'_lowered' if lowered else ''}.txt"
    if os.environ.get("PIPEGPT_UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(plan.to_text())
    assert path.exists(), f"{path} missing: run with PIPEGPT_UPDATE_GOLDEN=1 to create it"
    assert plan.to_text() == path.read_text(), (
        f"{name} {p}x{m} differs from {path}; if the change is intended, regenerate with PIPEGPT_UPDATE_GOLDEN=1 "
        f"and review the diff")
    assert load_schedule_file(path).ranks == plan.ranks
