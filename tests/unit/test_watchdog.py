"""The stall watchdog's pure logic: threshold, culprit, table. A stuck rank in a real run is
tests/distributed/test_watchdog_stall.py."""
from __future__ import annotations

import pytest

from pipegpt.resilience.watchdog import STALL_FACTOR, STALL_FLOOR_S, WARMUP_STEPS, find_culprit, format_table, stall_threshold


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


def test_a_gpu_behind_its_host_is_named_rather_than_a_cycle_of_hosts_in_settle():
    # CUDA: every host reached the step's settle() and waits for its neighbours (a cycle, seen from the hosts);
    # rank 1's GPU is still in 1F0, ranks 0's and 2's in receives from rank 1.
    hosts = {0: (1,), 1: (0, 2), 2: (1,)}
    assert find_culprit(hosts).cycle  # the hosts alone: a deadlock, the wrong cause
    c = find_culprit({0: (1,), 1: (), 2: (1,)}, {0: "0RECV_B0", 1: "1F0", 2: "2RECV_F0"},
                     gpu={0: "end of step", 1: "end of step", 2: "end of step"})
    assert (c.rank, c.held_up, c.cycle) == (1, (0, 2), ())
    assert c.cause == "GPU busy in 1F0 (its host is at end of step), waiting for no other rank; ranks 0, 2 wait for it"


def test_the_table_shows_where_the_gpu_is_beside_the_host():
    host = (None, "end of step", (0, 2), "this step's communication with ranks 0, 2")
    lines = format_table([{"rank": 1, "pp_index": 1, "now": host, "device": (3, "1F0", (), "nobody (computing)")},
                          {"rank": 0, "pp_index": 0, "now": host, "device": None}])
    assert lines[1].split()[2:] == ["end", "of", "step", "this", "step's", "communication", "with", "ranks", "0,", "2"]
    assert lines[2].split() == ["1", "1", "GPU", "#3", "1F0", "nobody", "(computing)", "(host:", "end", "of", "step)"]
