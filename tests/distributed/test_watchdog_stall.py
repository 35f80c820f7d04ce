"""The stall watchdog in a real run, as a user runs it (its pure logic is tests/unit/test_watchdog.py).

`PIPEGPT_FAULT=stuck:1:4` keeps rank 1 alive and answering (heartbeats, where()) but stuck inside its
first compute action of step 4, so ranks 0 and 2 are the ones seen waiting: the job must still end
long before the communication timeout, print where every rank is, and name rank 1.
"""
from __future__ import annotations

import re

from helpers import PIPEGPT, clean_env
from test_failures import Job, _workers

TIMEOUT_S = 60  # the communication timeout the run is given: the watchdog must act far sooner
STUCK_STEP = 4  # counted from 1


def test_a_stuck_rank_is_named_long_before_the_timeout(tmp_path):
    job = Job([PIPEGPT, "run", "--stages", "3", "--microbatches", "3", "--steps", "8", "--log-every", "1",
               "--timeout", str(TIMEOUT_S), "--run-dir", str(tmp_path / "run")],
              env=clean_env(PIPEGPT_FAULT=f"stuck:1:{STUCK_STEP}"))
    try:
        code = job.wait(TIMEOUT_S)
        stuck_from = job.step_line_time(STUCK_STEP - 1)  # `step 3/8` comes out as step 4 begins
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
