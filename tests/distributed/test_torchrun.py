"""`torchrun ... -m pipegpt run`: every process a worker, rank 0 also the driver (TorchrunCluster).

Launched as `python -m torch.distributed.run` (the module behind the `torchrun` script) with
`-m pipegpt` (pipegpt/__main__.py). torchrun starts each rank in its own session, so cleanup walks
the process tree rather than one process group.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, clean_env

LIMIT_S = 60.0  # a healthy run takes ~10-25 s here (2 cores, shared)
STEPS = 3


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0]


def _descendants(root: int) -> set[int]:
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _ppid_and_state(int(name))) and st[1] not in "ZXx":
            parent[int(name)] = st[0]
    found, grew = set(), True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if pid not in found and (ppid == root or ppid in found):
                found.add(pid)
                grew = True
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill(seen: dict[int, str]) -> None:
    """SIGKILL what is left of the processes we saw (each still running the command we saw it run)."""
    for pid, cmdline in seen.items():
        if _cmdline(pid) != cmdline:
            continue  # gone (or the pid now belongs to someone else)
        for kill in (os.killpg, os.kill):  # torchrun puts each rank in a session of its own
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


_HANG = ("under torchrun, TorchrunCluster.__init__ (pipegpt/comm/rpc.py) rendezvouses RPC over "
         "tcp://MASTER_ADDR:MASTER_PORT+1, but torchrun sets TORCHELASTIC_USE_AGENT_STORE=True, so "
         "torch.distributed.rendezvous makes every rank, rank 0 included, a TCPStore *client* of that port; "
         "no one serves it and all ranks wait in rpc.init_rpc (default_pg_timeout, 30 min; --timeout is not "
         "applied). init_method='env://' (the agent's store) makes the run pass.")


class TorchrunHang(AssertionError):
    """The job neither finished nor failed within LIMIT_S (the known bug; any other failure is a new one)."""


def _torchrun(tmp_path, ranks: int, *args: str) -> str:
    """`torchrun --nproc-per-node ranks -m pipegpt run ARGS` for STEPS steps, watched: a hang is stopped and named
    (TorchrunHang), a failure shows its output. Returns stdout."""
    run_dir = tmp_path / "run"
    env = clean_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "pipegpt", "run", *args, "--steps", str(STEPS), "--run-dir", str(run_dir)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen: dict[int, str] = {}
    try:
        while proc.poll() is None and time.monotonic() - t0 < LIMIT_S:
            for pid in _descendants(proc.pid) - seen.keys():
                seen[pid] = _cmdline(pid)
            time.sleep(0.2)
        hung = proc.poll() is None
        seconds = time.monotonic() - t0
        if hung:
            proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its workers
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
    finally:
        _kill({**seen, proc.pid: " ".join(cmd) + " "} if proc.poll() is None else seen)
        proc.wait(timeout=10)
    stdout, stderr = proc.communicate(timeout=10)  # every holder of the pipes is gone now
    print(f"\ntorchrun {ranks} ranks, {STEPS} steps: {'hung, stopped after' if hung else 'exited in'} {seconds:.1f}s")
    report = f"stdout:\n{stdout}\nstderr (tail):\n{stderr[-3000:]}"
    if hung:
        raise TorchrunHang(f"no exit within {LIMIT_S:.0f}s\n{report}")
    assert proc.returncode == 0, report
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS, report
    assert "done: loss" in stdout, report
    assert (run_dir / "trace.json").is_file()
    return stdout


def test_torchrun_two_ranks(tmp_path):
    _torchrun(tmp_path, 2, "--stages", "2", "--microbatches", "2")


@pytest.mark.slow  # 4 ranks, ~25 s on 2 cores; tests/unit/test_stages_from_world.py checks the arithmetic
def test_torchrun_without_stages_counts_cp_among_a_stages_ranks(tmp_path):
    """4 processes, --cp 2, no --stages: 4 / (dp x cp x tp) = 2 stages (it asked for 4 when cp was left out)."""
    _torchrun(tmp_path, 4, "--cp", "2", "--microbatches", "2")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["parallel"]["stages"], config["parallel"]["cp"]) == (2, 2)
