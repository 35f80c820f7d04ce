"""`pipegpt simulate`: output, comparison table, JSON, files, one-line errors, and no torch on the way."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, assert_one_line_error, invoke
from pipegpt.schedule import SCHEDULES, build_plan, lower


def run(*args):
    return invoke("simulate", *args)


def test_1f1b_4x16_chart_and_summary():
    result = run("--schedule", "1f1b", "--stages", "4", "--microbatches", "16", "--width", "120")
    assert result.exit_code == 0, result.output
    out = result.stdout
    rows = [line for line in out.splitlines() if line.startswith("r") and " |" in line]
    assert [r.split()[0] for r in rows] == ["r0", "r1", "r2", "r3"]
    assert "makespan          57" in out and "bubble            15.8%" in out
    assert "peak live         4 3 2 1" in out


def test_no_chart_and_bytes():
    result = run("-s", "1f1b", "-p", "2", "-m", "4", "--no-chart", "--costs", "F=1,B=2,act_bytes=1048576")
    assert result.exit_code == 0, result.output
    assert " |" not in result.stdout
    assert "peak activations  2.0 MiB, 1.0 MiB" in result.stdout


def test_all_schedules_table():
    result = run("--schedule", "all", "--stages", "4", "--microbatches", "16")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for name in SCHEDULES:
        assert any(line.startswith(name + " ") and (line.rstrip().endswith("yes") or "yes (lower bound" in line)
                   for line in lines), name
    gpipe = next(line for line in lines if line.startswith("gpipe "))
    assert "57" in gpipe and "15.8%" in gpipe and "16/16" in gpipe


def test_table_shows_why_a_schedule_does_not_apply():
    result = run("--schedule", "1f1b,interleaved-1f1b,dualpipev", "-p", "4", "-m", "9")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert next(line for line in lines if line.startswith("1f1b ")).endswith("yes")
    assert "no: interleaved-1f1b runs microbatches in m // stages = 2 equal rounds" in result.stdout
    assert "no: dualpipev needs microbatches >= 2 x stages = 8" not in result.stdout


def test_json_single():
    result = run("-s", "zbv", "-p", "2", "-m", "4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("schedule", "stages", "microbatches", "makespan", "bubble_fraction", "bubble_fraction_per_rank",
                "peak_live_microbatches_per_rank", "plan"):
        assert key in data
    assert data["schedule"] == "zbv" and data["stages"] == 2 and data["microbatches"] == 4
    assert data["plan"] == build_plan("zbv", 2, 4).as_strings()
    assert len(data["bubble_fraction_per_rank"]) == 2 and data["peak_live_microbatches_per_rank"] == [4, 4]


def test_json_several_is_a_list():
    result = run("-s", "gpipe,1f1b,dualpipev", "-p", "4", "-m", "4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [d["schedule"] for d in data] == ["gpipe", "1f1b", "dualpipev"]
    assert data[1]["plan"] == build_plan("1f1b", 4, 4).as_strings()
    assert data[1]["bubble_fraction"] == pytest.approx(3 / 7)
    assert data[2]["applies"] is False and "dualpipev needs" in data[2]["reason"]


def test_costs_scale_with_stages_per_rank():
    # F=1,B=2 is one rank's share of the model: zbv's two stages per rank cost half each
    data = json.loads(run("-s", "1f1b,zbv", "-p", "2", "-m", "4", "--json").stdout)
    assert data[0]["costs"]["F"] == [1.0, 1.0] and data[1]["costs"]["F"] == [0.5] * 4
    assert sum(data[0]["busy_per_rank"]) == sum(data[1]["busy_per_rank"])


def test_costs_json_file(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"F": [1, 2], "B": [2, 4], "comm": 0.5}))
    data = json.loads(run("-s", "1f1b", "-p", "2", "-m", "2", "--costs", str(path), "--json").stdout)
    assert data["costs"]["F"] == [1.0, 2.0] and data["costs"]["comm"] == 0.5
    # rank 1: 1F0 at 1.5, 1B0 3.5..7.5, 1F1 7.5..9.5, 1B1 9.5..13.5; rank 0: 0B1 at 13.5 + 0.5 for 2
    assert data["makespan"] == 16


def test_out_files(tmp_path):
    result = run("-s", "1f1b", "-p", "2", "-m", "2", "--out", str(tmp_path / "one.svg"), "--no-chart")
    assert result.exit_code == 0 and (tmp_path / "one.svg").exists()
    result = run("-s", "1f1b,zbv", "-p", "2", "-m", "2", "--out", str(tmp_path / "t.json"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "t.1f1b.json").read_text())["traceEvents"]
    assert (tmp_path / "t.zbv.json").exists()


def test_schedule_file(tmp_path):
    plan = lower(build_plan("1f1b", 3, 4))
    path = tmp_path / "mine.txt"
    path.write_text(plan.to_text())
    result = run("--schedule-file", str(path), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schedule"] == "mine" and data["stages"] == 3 and data["microbatches"] == 4
    assert data["plan"] == build_plan("1f1b", 3, 4).as_strings()  # compute actions only
    assert data["bubble_fraction"] == pytest.approx(2 / 6)


@pytest.mark.parametrize("args,message", [
    (["-s", "nope", "-p", "4", "-m", "8"], "unknown schedule 'nope'; known schedules: gpipe, 1f1b"),
    (["-s", "1f1b", "-p", "0", "-m", "8"], "--stages"),
    (["-s", "1f1b", "-p", "four", "-m", "8"], "--stages"),
    (["-s", "1f1b", "-p", "4"], "--stages and --microbatches are required"),
    (["-s", "interleaved-1f1b", "-p", "4", "-m", "9"], "which microbatches=9 does not divide (nearest valid: 8 or 10)"),
    (["-s", "dualpipev", "-p", "4", "-m", "6"], "dualpipev needs microbatches >= 2 x stages = 8"),
    (["-s", "auto-v", "-p", "4", "-m", "8", "--max-live", "1"], "max-live=1 is below what any schedule of this "
                                                                "placement runs in"),
    (["-s", "1f1b,zbv", "-p", "4", "-m", "8", "--max-live", "4"], "1f1b, zbv are fixed: add auto or auto-v"),
    (["-s", "1f1b", "-p", "4", "-m", "8", "-v", "3"], "virtual-stages=3 only applies to interleaved-1f1b"),
    (["-s", "1f1b", "-p", "4", "-m", "8", "--costs", "F=1,Q=2"], "unknown key 'q'"),
    (["-s", "1f1b", "-p", "4", "-m", "8", "--costs", "B=1,W=2"], "W=2 > B=1"),
    (["-s", "1f1b", "-p", "4", "-m", "8", "--costs", "/nonexistent/c.json"], "cannot read /nonexistent/c.json"),
    (["-s", "1f1b", "-p", "4", "-m", "8", "--out", "x.png"], "must end in .svg, .html or .json"),
    (["--schedule-file", "/nonexistent/plan.txt"], "/nonexistent/plan.txt: cannot read schedule file"),
    (["-s", "1f1b", "-p", "4", "-m", "8", "--frobnicate"], "No such option"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    result = run(*args)
    assert_one_line_error(result, message)
    assert result.stdout == ""


def test_bad_schedule_file_names_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("0F0 0B0\n1F0 1B0 oops\n")
    result = run("--schedule-file", str(path))
    assert result.exit_code == 2
    assert result.stderr == f"Error: {path}:2: bad token 'oops' (expected <stage><kind><microbatch> such as 2F0, " \
                            f"1B3, 0W5 or 1SEND_B3)\n"


def test_simulate_path_does_not_import_torch():
    code = ("import sys; from pipegpt.cli import main; import pipegpt.schedule.simulate, pipegpt.schedule.render, "
            "pipegpt.schedule.schedule_file; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_python_dash_m_pipegpt_without_torch():
    # run the real command in a fresh interpreter and prove torch never got loaded
    code = ("import sys, runpy; sys.argv = ['pipegpt', 'simulate', '-s', 'all', '-p', '4', '-m', '8', '--no-chart']\n"
            "try:\n    runpy.run_module('pipegpt', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    assert "zbv" in done.stdout


def test_auto_prints_its_lower_bound_and_the_fixed_schedule_it_beat():
    result = run("-s", "auto", "-p", "4", "-m", "8", "--layer-costs", "embed=0.1,block=1,head=4", "--layers", "8",
                 "--json")
    assert result.exit_code == 0, result.output
    rec = json.loads(result.stdout)
    assert rec["schedule"] == "auto" and rec["lower_bound"] <= rec["makespan"] <= rec["best_fixed_makespan"]
    assert rec["best_fixed"] == "zb-h1" and rec["max_live"] == 4 and max(rec["peak_live_microbatches_per_rank"]) <= 4
    text = run("-s", "auto-v", "-p", "4", "-m", "8", "--max-live", "6", "--no-chart").stdout
    assert "lower bound" in text and "max live 6" in text


def test_auto_names_the_fixed_order_it_kept_when_none_it_wrote_was_faster():
    wrote = run("-s", "auto-v", "-p", "4", "-m", "8", "--no-chart").stdout  # 25.5 against zbv's 26
    assert "best fixed schedule that fits: zbv 26" in wrote and "order " not in wrote
    kept = run("-s", "auto", "-p", "4", "-m", "8", "--no-chart", "--json").stdout  # zb-h1 meets the bound
    assert json.loads(kept)["chosen_from"] == "zb-h1"
    assert "order             zb-h1's (no synthesized order was faster)" in run(
        "-s", "auto", "-p", "4", "-m", "8", "--no-chart").stdout


def test_a_schedule_file_with_max_live_is_refused(tmp_path):
    path = tmp_path / "plan.txt"
    path.write_text("0F0 0B0\n")
    result = run("--schedule-file", str(path), "--max-live", "2")
    assert result.exit_code == 2 and "a schedule file's order is fixed" in result.output


def test_p2p_matching_order_prices_a_late_send_that_tag_does_not(tmp_path):
    # a hand-placed plan whose first forward is sent only after the second: free under tag, not under order
    path = tmp_path / "late.txt"
    path.write_text("0F0 0F1 0SEND_F0 0SEND_F1\n1RECV_F0 1F0 1RECV_F1 1F1\n")
    makespans = {}
    for matching in ("tag", "order"):
        result = run("--schedule-file", str(path), "--costs", "F=1", "--p2p-matching", matching, "--json")
        assert result.exit_code == 0, result.output
        makespans[matching] = json.loads(result.stdout)["makespan"]
    assert makespans == {"tag": 3, "order": 4}
    # a generated plan is lowered for the costs, as a run lowers it: order costs what tag does
    result = run("-s", "zb-h1", "-p", "4", "-m", "8", "--p2p-matching", "order", "--no-chart")
    assert result.exit_code == 0, result.output
    assert "makespan          27" in result.stdout and "matched by order (NCCL)" in result.stdout
    assert_one_line_error(run("-s", "1f1b", "-p", "2", "-m", "2", "--p2p-matching", "nccl"), "--p2p-matching")


def test_p2p_matching_order_costs_what_tag_costs_where_a_rank_s_messages_crowd():
    """interleaved-1f1b at p 8, m 32, messages a fifth of a forward: 3.5% over tag on one NCCL stream a rank; on a
    communicator per direction of each pair of neighbours (the runtime's on a GPU), the same."""
    makespans = {}
    for matching in ("tag", "order"):
        result = run("-s", "interleaved-1f1b", "-p", "8", "-m", "32", "--costs", "F=1,B=2,W=1,comm=0.2",
                     "--p2p-matching", matching, "--json")
        assert result.exit_code == 0, result.output
        makespans[matching] = json.loads(result.stdout)["makespan"]
    assert makespans["order"] == pytest.approx(makespans["tag"]) == pytest.approx(112.5)
