"""The stall watchdog: its pure logic (threshold, culprit, table), then a stuck rank in a real run.

`PIPEGPT_FAULT=stuck:1:3` keeps rank 1 alive and answering (heartbeats, where()) but stuck inside its
first compute action of step 3, so ranks 0 and 2 are the ones seen waiting: the job must still end
long before the communication timeout, print where every rank is, and name rank 1.
"""
from __future__ import annotations

import re

import pytest

from pipegpt.train.watchdog import STALL_FACTOR, STALL_FLOOR_S, WARMUP_STEPS, find_culprit, format_table, stall_threshold
from test_failures import PIPEGPT, Job, _env, _workers

TIMEOUT_S = 60  # the communication timeout the run is given: the watchdog must act far sooner
STUCK_STEP = 3


# --------------------------------------------------------------------------------------------------------------
# the threshold

def test_the_first_step_is_not_watched():
    assert stall_threshold([]) is None  # warm-up (torch.compile) of unknown length: the comm timeout bounds it


def test_fast_steps_get_the_floor():
    assert stall_threshold([0.5]) == STALL_FLOOR_S
    assert stall_threshold([3.0, 0.1, 0.1, 0.1, 0.1]) == STALL_FLOOR_S


def test_slow_steps_get_a_multiple_of_the_recent_median():
    assert stall_threshold([30.0, 4.0, 4.2, 3.8, 4.0]) == pytest.approx(STALL_FACTOR * 4.0)
    # a change of pace: only the recent steps count
    assert stall_threshold([1.0] * 50 + [8.0] * 20) == pytest.approx(STALL_FACTOR * 8.0)


def test_the_warm_up_step_counts_only_until_enough_steps_are_timed():
    first = [60.0] + [3.0] * (WARMUP_STEPS - 1)  # a long compile, then normal steps
    assert stall_threshold(first) == pytest.approx(STALL_FACTOR * 3.0)  # median: the warm-up is an outlier
    assert stall_threshold([60.0]) == pytest.approx(STALL_FACTOR * 60.0)  # it may be all we know: err high
    assert stall_threshold([60.0] + [3.0] * WARMUP_STEPS) == pytest.approx(STALL_FACTOR * 3.0)
    assert stall_threshold([100.0, 2.0, 2.0, 2.0, 2.0, 2.0]) == pytest.approx(STALL_FACTOR * 2.0)  # left out


# --------------------------------------------------------------------------------------------------------------
# the culprit

def test_a_chain_leads_to_the_rank_stuck_in_compute():
    # 0 waits for 1, 1 waits for 2, 2 waits for 3, 3 computes: 3 holds everyone up
    c = find_culprit({0: (1,), 1: (2,), 2: (3,), 3: ()}, {3: "3F0"})
    assert (c.rank, c.held_up, c.cycle) == (3, (0, 1, 2), ())
    assert c.cause == "stuck in 3F0, waiting for no other rank; ranks 0, 1, 2 wait for it"


def test_neighbours_on_both_sides_point_at_the_stuck_rank():
    c = find_culprit({0: (1,), 1: (), 2: (1,)}, {1: "1F0"})
    assert (c.rank, c.held_up) == (1, (0, 2))


def test_of_two_computing_ranks_the_one_others_wait_for_is_named():
    # 0 computes (busy, nobody waits for it); 3 computes and 1, 2 wait for it
    c = find_culprit({0: (), 1: (2,), 2: (3,), 3: ()})
    assert c.rank == 3
    assert find_culprit({0: (), 1: ()}).rank == 0  # a tie: the lowest rank


def test_a_collective_waits_for_several_ranks():
    # 0 and 2 finished their actions and wait in an all-reduce with everyone; 1 is stuck
    c = find_culprit({0: (1, 2), 1: (), 2: (0, 1)})
    assert (c.rank, c.held_up) == (1, (0, 2))


def test_a_cycle_is_named_as_a_deadlock():
    c = find_culprit({0: (1,), 1: (2,), 2: (0,), 3: None})
    assert c.rank == 0 and c.cycle == (0, 1, 2)
    assert "deadlock" in c.cause and "0 -> 1 -> 2 -> 0" in c.cause
    # a rank waiting on the cycle is held up by it, not part of it
    c = find_culprit({0: (1,), 1: (2,), 2: (1,)})
    assert (c.rank, c.cycle, c.held_up) == (1, (1, 2), (0,))


def test_a_rank_between_steps_that_others_wait_for():
    c = find_culprit({0: (1,), 1: None, 2: None})
    assert (c.rank, c.held_up) == (1, (0,))
    assert "between steps" in c.cause


def test_everyone_between_steps_names_nobody():
    assert find_culprit({0: None, 1: None, 2: None}) is None
    assert find_culprit({}) is None


def test_the_table_has_one_line_per_rank():
    lines = format_table([
        {"rank": 2, "pp_index": 2, "now": (0, "2RECV_F3", (1,), "receive 2RECV_F3 from rank 1")},
        {"rank": 0, "pp_index": 0, "now": None},
        {"rank": 1, "pp_index": 1, "now": (1, "1F0", (), "nobody (computing)")},
        {"rank": 3},
    ])
    assert len(lines) == 5 and "waits for" in lines[0]
    assert lines[1].split()[:4] == ["0", "0", "between", "steps"]
    assert lines[2].split() == ["1", "1", "#1", "1F0", "nobody", "(computing)"]
    assert lines[3].split()[:4] == ["2", "2", "#0", "2RECV_F3"] and lines[3].endswith("receive 2RECV_F3 from rank 1")
    assert "no answer" in lines[4]


# --------------------------------------------------------------------------------------------------------------
# a real run, as a user runs it

def test_a_stuck_rank_is_named_long_before_the_timeout(tmp_path):
    job = Job([PIPEGPT, "run", "--stages", "3", "--microbatches", "3", "--steps", "8", "--log-every", "1",
               "--timeout", str(TIMEOUT_S), "--run-dir", str(tmp_path / "run")],
              env=_env(PIPEGPT_FAULT=f"stuck:1:{STUCK_STEP}"))
    try:
        code = job.wait(TIMEOUT_S)
        stuck_from = job.step_line_time(STUCK_STEP)  # `step 3/8` comes out as step index 3 begins
        ended = job.exit_time - stuck_from if stuck_from else float("nan")
        print(f"\nstuck rank named and the job ended {ended:.2f}s after the stuck step began "
              f"({job.exit_time - job.t0:.1f}s wall in all)")
        left = job.survivors()
        report = f"exit status {code}\nstdout:\n{job.stdout}\nstderr:\n{job.stderr}"
        assert code == 1, report
        assert stuck_from is not None, report
        assert ended < 20, report  # the floor (10 s) and the questions, far below the 60 s timeout
        lines = [line for line in job.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("Error: rank 1 stalled: stuck in 1F0"), report
        assert sum(line.startswith("Error:") for line in lines) == 1, report
        assert "Traceback" not in job.stderr and "Traceback" not in job.stdout, report
        # the table: every rank, its pipeline position and action; its neighbours wait for rank 1
        rows = {int(m[1]): line for line in lines if (m := re.match(r"\s+(\d+)\s+\d+\s+", line))}
        assert sorted(rows) == [0, 1, 2], report
        assert re.search(r"0RECV_B\d+\s+receive 0RECV_B\d+ from rank 1$", rows[0]), report
        assert re.search(r"#\d+ 1F0\s+nobody \(computing\)$", rows[1]), report
        assert re.search(r"2RECV_F\d+\s+receive 2RECV_F\d+ from rank 1$", rows[2]), report
        assert len(_workers(job)) >= 3, job.cmdlines
        assert not left, f"left behind after exit: {left}"
    finally:
        job.kill_all()
