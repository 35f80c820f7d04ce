"""An elastic job on simulated nodes: two torchrun agents on this machine (`--nnodes 1:2`, a rank each, c10d
rendezvous on localhost) run `pipegpt run --resume auto --layout auto`; one agent is killed with its rank (a node
gone). torchrun restarts the surviving node's rank with the world it finds (1), --resume auto takes the run's
latest checkpoint and --layout auto chooses a layout for one rank: the job finishes with every step done."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import ROOT, clean_env
from test_torchrun import _cmdline, _descendants, _kill

LIMIT_S = 240.0
STEPS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env else None


def _rows(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_lost_node_goes_on_in_a_layout_for_the_ranks_left(tmp_path):
    run_dir, port = tmp_path / "run", _free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
             "--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120",
             "--max-restarts", "3", "--monitor-interval", "0.5",
             "-m", "pipegpt", "run", "--run-dir", str(run_dir), "--resume", "auto", "--layout", "auto",
             "--steps", str(STEPS), "--save-every", "2", "--timeout", "20",
             "--log-every", "1"]
    env = clean_env()
    procs = [subprocess.Popen(agent, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)]
    time.sleep(1.0)  # the first agent hosts the rendezvous store
    procs.append(subprocess.Popen(agent, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True))
    seen: dict[int, str] = {}
    t0, killed = time.monotonic(), None
    try:
        while procs[0].poll() is None and time.monotonic() - t0 < LIMIT_S:
            for p in procs:
                for pid in _descendants(p.pid) - seen.keys():
                    seen[pid] = _cmdline(pid)
            if killed is None and len(_rows(run_dir)) >= 3:  # the step-2 checkpoint is behind it
                # the node without rank 0 goes (rank 0 is the driver: its node is the one that reports)
                ranks = {i: {_rank_of(pid) for pid in _descendants(p.pid)} for i, p in enumerate(procs)}
                killed = next(i for i, r in ranks.items() if 0 not in r)
                victims = {pid: _cmdline(pid) for pid in _descendants(procs[killed].pid)}
                victims[procs[killed].pid] = _cmdline(procs[killed].pid)
                _kill(victims)
            time.sleep(0.2)
        hung = procs[0].poll() is None or (killed != 1 and procs[1].poll() is None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        time.sleep(2)
        _kill({**seen, **{p.pid: _cmdline(p.pid) for p in procs}})
        for p in procs:
            p.wait(timeout=10)
    survivor = procs[1 - killed] if killed is not None else procs[0]
    output = survivor.stdout.read() if survivor.stdout else ""
    report = f"killed agent {killed}; after {time.monotonic() - t0:.0f}s\n{output[-4000:]}"
    print(f"\nelastic: the agent without rank 0 killed; the job ended {time.monotonic() - t0:.0f}s after it began")
    assert killed is not None and not hung, report
    assert survivor.returncode == 0, report
    rows = {r["step"]: r for r in _rows(run_dir)}  # each step's last row
    redone = [(r, rows[r["step"]]) for r in _rows(run_dir) if r["attempt"] < rows[r["step"]]["attempt"]]
    for before, after in redone:  # a step done again in the new layout: the same loss (fp32, another split)
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-5), report
    assert sorted(rows) == list(range(1, STEPS + 1)), report
    assert rows[STEPS]["attempt"] > rows[1]["attempt"], report
    configs = sorted((run_dir / "configs").glob("attempt-*.json"))
    first, last = (json.loads(c.read_text())["parallel"] for c in (configs[0], configs[-1]))
    assert first["stages"] * first["dp"] * first["tp"] == 2 and last["stages"] * last["dp"] * last["tp"] == 1
    assert first["dp"] * first["microbatches"] * first["microbatch_size"] == \
        last["dp"] * last["microbatches"] * last["microbatch_size"]  # the global batch kept
    assert "--layout auto on 1 rank: " in output, report
