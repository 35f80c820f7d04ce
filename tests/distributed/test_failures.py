"""`pipegpt run` when something goes wrong, run as a user runs it (a subprocess of the console script).

A worker that raises, exits or freezes (PIPEGPT_FAULT=KIND:RANK:STEP, see pipegpt.resilience.faults)
must bring the whole job down within seconds: exit status 1, a last stderr line
`Error: rank 1 failed: <cause>`, no traceback, and no process left behind. Killing the driver
itself must take the workers with it (they ask Linux for PR_SET_PDEATHSIG).

Orphans are looked for two ways, so a worker that escaped its process group is still caught:
every process seen in the job's process group or below the driver while it ran (pid and start
time, so a recycled pid is not mistaken for it), and whatever is in the process group afterwards.
Zombies count as gone (they hold no resources and an init that does not reap them is not our bug).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import PIPEGPT, ROOT, clean_env, proc_cmdline
from pipegpt.comm import preload

FAULT_STEP = 3  # counted from 1: steps 1 and 2 run, the third fails at its start
LIMIT_S = 60.0  # whole command, startup included
GONE_WITHIN_S = 5.0  # after the driver exits (or is killed), every process it started is gone by then


# --------------------------------------------------------------------------------------------------------------
# /proc helpers

def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgrp, starttime) of a process, None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _alive(pid: int, starttime: int | None = None) -> bool:
    """Running or stopped (not a zombie), and the same process (start time) as the one we saw."""
    st = _stat(pid)
    if st is None or st[0] in ("Z", "X", "x"):
        return False
    return starttime is None or st[3] == starttime


def _family(root: int, pgid: int) -> dict[int, int]:
    """pid -> starttime of every live process in process group pgid or descended from root (not root)."""
    stats = {pid: st for pid in _all_pids() if (st := _stat(pid)) is not None}
    found = {pid: st[3] for pid, st in stats.items() if st[2] == pgid and pid != root and st[0] not in "ZXx"}
    grew = True
    while grew:  # descendants that may have left the group
        grew = False
        for pid, st in stats.items():
            if pid not in found and pid != root and st[0] not in "ZXx" and (st[1] == root or st[1] in found):
                found[pid] = st[3]
                grew = True
    return found


class Job:
    """A command in its own session/process group, its output lines timestamped, its family watched."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.t0 = time.monotonic()
        env = dict(os.environ if env is None else env)
        env.pop(preload.SHARED_ADDRESS, None)  # its own preload server: the workers are then its family, watched
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.pgid = self.proc.pid  # start_new_session: the child leads a new process group
        self.out: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        self.seen: dict[int, int] = {}  # pid -> starttime of every process seen in the family
        self.cmdlines: dict[int, str] = {}
        self.exit_time: float | None = None
        self._readers = [threading.Thread(target=self._read, args=(s, dst), daemon=True)
                         for s, dst in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _read(self, stream, dst) -> None:
        for line in stream:
            dst.append((time.monotonic(), line.rstrip("\n")))

    def sample(self) -> None:
        for pid, start in _family(self.proc.pid, self.pgid).items():
            self.seen.setdefault(pid, start)
            cmd = proc_cmdline(pid)  # read again: a child seen between fork and exec shows its parent's
            if cmd not in ("", "?"):  # "" once it has exited (a zombie)
                self.cmdlines[pid] = cmd

    def step_line_time(self, n: int) -> float | None:
        """When `step n/N ...` (printed as step n completes) came out, None if not yet."""
        return next((t for t, line in list(self.out)
                     if line.split()[:1] == ["step"] and line.split()[1].startswith(f"{n}/")), None)

    def wait_for(self, predicate, timeout: float) -> bool:
        """Sample the family until predicate() holds or the command exits; False on timeout."""
        deadline = self.t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is None:
                self.sample()
            if predicate():
                return True
            time.sleep(0.05)
        return False

    def wait(self, timeout: float) -> int:
        if not self.wait_for(lambda: self.proc.poll() is not None, timeout):
            self.kill_all()
            pytest.fail(f"{self.proc.args} still running after {timeout:.0f}s\nstdout:\n{self.stdout}\n"
                        f"stderr:\n{self.stderr}")
        self.exit_time = self.exit_time or time.monotonic()
        for t in self._readers:
            t.join(timeout=GONE_WITHIN_S)  # EOF once every holder of the pipes is gone
        return self.proc.returncode

    def survivors(self, within: float = GONE_WITHIN_S) -> dict[int, str]:
        """Processes of this job still alive `within` seconds from now (or sooner, once none are)."""
        deadline = time.monotonic() + within
        while True:
            left = {pid: self.cmdlines.get(pid) or proc_cmdline(pid)
                    for pid, start in self.seen.items() if _alive(pid, start)}
            for pid in _family(self.proc.pid, self.pgid):  # anything in the group we never sampled
                if pid != self.proc.pid and _alive(pid):
                    left.setdefault(pid, proc_cmdline(pid))
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def kill_all(self) -> None:
        """Clean up after a failed test: SIGKILL everything we started (by pid and by our group)."""
        for pid, start in list(self.seen.items()):
            if _alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    @property
    def stdout(self) -> str:
        return "\n".join(line for _, line in self.out)

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.err)


def _workers(job: Job) -> list[int]:
    """Worker processes seen (multiprocessing spawn children, titled by rank once built; not its resource
    tracker)."""
    return [pid for pid, cmd in job.cmdlines.items()
            if ("spawn_main" in cmd and "--multiprocessing-fork" in cmd) or cmd.startswith("pipegpt: rank ")]


# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, cause", [
    ("raise", "RuntimeError: fault injected by PIPEGPT_FAULT at step 3"),
    # a dead process is also named in the default run by test_restarts (rank 1 ... process exited with code 13)
    pytest.param("exit", "process exited with code 13", marks=pytest.mark.slow),
    # a stuck rank is named in the default run by test_watchdog_stall
    pytest.param("freeze", "stopped answering", marks=pytest.mark.slow),
])
def test_worker_failure_stops_the_job(kind, cause, tmp_path):
    run_dir = tmp_path / "run"
    job = Job([PIPEGPT, "run", "--stages", "2", "--microbatches", "2", "--steps", "4", "--log-every", "1",
               "--run-dir", str(run_dir)], env=clean_env(PIPEGPT_FAULT=f"{kind}:1:{FAULT_STEP}"))
    try:
        code = job.wait(LIMIT_S)
        wall = job.exit_time - job.t0
        # `step 2/4` is printed once step 2 is done: the faulty step 3 starts then.
        fault_started = job.step_line_time(FAULT_STEP - 1)
        detection = job.exit_time - fault_started if fault_started else float("nan")
        print(f"\n{kind}: detected and stopped {detection:.2f}s after the faulty step began; "
              f"{wall:.1f}s wall in all; processes seen: {len(job.seen)}")
        left = job.survivors()
        report = f"exit status {code}\nstdout:\n{job.stdout}\nstderr:\n{job.stderr}"
        assert code == 1, report
        assert wall < LIMIT_S
        assert fault_started is not None, report  # steps 1 and 2 ran before the fault
        lines = [line for line in job.stderr.splitlines() if line.strip()]
        assert lines, report
        last = lines[-1]
        assert last.startswith("Error: rank 1 failed:"), report
        assert cause in last, report
        assert sum(line.startswith("Error:") for line in lines) == 1, report
        assert "Traceback" not in job.stderr and "Traceback" not in job.stdout, report
        # The orphan check has something to check: both worker processes were seen while the job ran.
        assert len(_workers(job)) >= 2, job.cmdlines
        assert not left, f"left behind after exit: {left}"
        # Steps 1 and 2 completed and were logged; the faulty one was not.
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == FAULT_STEP - 1
    finally:
        job.kill_all()


def _training(tmp_path) -> Job:
    """A long run of two workers, its family sampled once its second step is done."""
    job = Job([PIPEGPT, "run", "--stages", "2", "--microbatches", "2", "--steps", "100000", "--log-every", "1",
               "--run-dir", str(tmp_path / "run")], env=clean_env())
    started = job.wait_for(lambda: job.step_line_time(2) is not None or job.proc.poll() is not None, LIMIT_S)
    if not (started and job.proc.poll() is None):
        job.kill_all()
        pytest.fail(f"no training steps\n{job.stdout}\n{job.stderr}")
    job.sample()
    return job


def test_killing_the_driver_takes_the_workers_with_it(tmp_path):
    job = _training(tmp_path)
    try:
        workers = _workers(job)
        assert len(workers) >= 2, job.cmdlines
        killed = time.monotonic()
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait(timeout=10)
        left = job.survivors()
        gone = time.monotonic() - killed
        print(f"\ndriver SIGKILLed: its {len(job.seen)} processes gone {gone:.2f}s later")
        assert not left, f"alive {GONE_WITHIN_S:.0f}s after the driver was killed: {left}"
    finally:
        job.kill_all()


def test_sigterm_to_the_driver_stops_every_worker_in_one_line(tmp_path):
    """A scheduler's SIGTERM (it exited 143 with no word before). And ps names each worker by its rank and stage
    (each was `python -c from multiprocessing.spawn ...`)."""
    job = _training(tmp_path)
    try:
        titles = sorted(cmd for cmd in job.cmdlines.values() if cmd.startswith("pipegpt: rank"))
        assert titles == ["pipegpt: rank 0 stage 0", "pipegpt: rank 1 stage 1"], job.cmdlines
        os.kill(job.proc.pid, signal.SIGTERM)
        code = job.wait(LIMIT_S)
        assert code == 143, job.stderr
        assert job.stderr.splitlines()[-1] == "Terminated (SIGTERM): all workers stopped", job.stderr
        assert "Traceback" not in job.stderr
        assert not job.survivors(), job.cmdlines
    finally:
        job.kill_all()


# The driver as `pipegpt` runs it, on a disk that fills as metrics.jsonl is written (half of a row goes down,
# then ENOSPC); the workers (spawned: a fresh interpreter each) write as usual.
FULL_DISK_DRIVER = """
import builtins, errno, os
real = builtins.open

class Filling:
    def __init__(self, f):
        self.f = f
    def write(self, data):
        self.f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    def __getattr__(self, name):
        return getattr(self.f, name)

def filling(file, mode="r", *args, **kwargs):
    f = real(file, mode, *args, **kwargs)
    return Filling(f) if str(file).endswith("metrics.jsonl") and "a" in mode else f

builtins.open = filling
from pipegpt.cli import main
main(prog_name="pipegpt")
"""


def test_a_full_disk_under_the_metrics_is_one_line(tmp_path):
    """A run file the driver cannot write (here the first metrics row) ends the run with one line naming the
    file and the cause, exit 1, no traceback, every worker stopped; the attempt's config is whole."""
    run_dir = tmp_path / "run"
    job = Job([sys.executable, "-c", FULL_DISK_DRIVER, "run", "--stages", "2", "--microbatches", "2", "--steps", "4",
               "--run-dir", str(run_dir)], env=clean_env())
    try:
        code = job.wait(LIMIT_S)
        report = f"exit status {code}\nstdout:\n{job.stdout}\nstderr:\n{job.stderr}"
        assert code == 1, report
        assert job.stderr.splitlines() == [f"Error: disk full writing {run_dir / 'metrics.jsonl'}: No space left "
                                           f"on device; all workers stopped"], report
        assert "Traceback" not in job.stdout, report
        assert len(_workers(job)) >= 2, job.cmdlines
        assert not job.survivors(), job.cmdlines
        assert json.loads((run_dir / "configs" / "attempt-1.json").read_text())["runtime"]["steps"] == 4
    finally:
        job.kill_all()


@pytest.mark.slow
def test_a_driver_stopped_for_longer_than_the_timeout_blames_no_worker(tmp_path):
    """SIGSTOP of the driver inside a step for 15 s, past --timeout 10, the heartbeat's 10 s and the stall floor:
    once it goes on (SIGCONT) it says it was paused, and the run finishes (a worker was blamed)."""
    job = Job([PIPEGPT, "run", "--stages", "2", "--microbatches", "2", "--steps", "6", "--log-every", "1",
               "--n-embd", "384", "--n-head", "4", "--seq-len", "256", "--timeout", "10",
               "--run-dir", str(tmp_path / "run")], env=clean_env(PYTHONUNBUFFERED="1"))
    try:
        assert job.wait_for(lambda: job.step_line_time(3) is not None or job.proc.poll() is not None, LIMIT_S)
        time.sleep(0.2)  # inside step 4's call (a step takes ~1 s here)
        os.kill(job.proc.pid, signal.SIGSTOP)
        time.sleep(15)
        os.kill(job.proc.pid, signal.SIGCONT)
        code = job.wait(LIMIT_S + 15)
        report = f"exit status {code}\nstdout:\n{job.stdout}\nstderr:\n{job.stderr}"
        assert code == 0, report
        assert job.step_line_time(6) is not None, report
        assert any(line.startswith("pipegpt: the driver was paused for 1") for line in job.stderr.splitlines()), report
        assert "Error" not in job.stderr, report
    finally:
        job.kill_all()


def test_the_orphan_check_can_fail():
    """The checker above must see a process that outlives the command that started it."""
    job = Job(["/bin/sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"], env=clean_env())
    try:
        assert job.wait(10) == 0
        orphan = int(job.stdout.split()[0])
        left = job.survivors(within=0.5)
        assert orphan in left and "sleep" in left[orphan], left
    finally:
        job.kill_all()
