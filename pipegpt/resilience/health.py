"""Before a restart (--max-restarts) on GPUs: which of this machine's GPUs still work.

A GPU that failed may not come back: a restart that put a rank on it again would fail again, using up the
restarts. Each GPU is probed in a process of its own (a hung driver call cannot hang the restart): it must answer,
allocate, compute and run a collective in a one-rank NCCL group, within a time limit. A probe past it is killed
and waited for, with a limit too: a process stuck in the driver (a GPU fallen off the bus) outlives SIGKILL, and
its GPU counts as failed. Probes start once the old workers have exited (until then they may hold the GPU's
memory); a worker still there after EXIT_WAIT_S leaves its GPU out, unprobed. The restart then goes on
with the GPUs that passed (CUDA_VISIBLE_DEVICES lists them), in the same layout if there are enough, else in a
smaller one (--min-ranks). On CPU there is nothing to probe; the same probe runs there with gloo, for tests.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable, Mapping, Sequence

PROBE_TIMEOUT_S = 60.0  # a healthy GPU passes in seconds (context creation and NCCL's first group dominate)
KILL_WAIT_S = 10.0  # a killed process is gone in milliseconds, unless it is stuck in the kernel
EXIT_WAIT_S = 30.0  # the old workers' exit (they were killed), before their GPUs are probed

# The probe: a process that exits 0 only if the device does all of it.
PROBE = """
import os, sys, tempfile
import torch, torch.distributed as dist
device = sys.argv[1]
if device == "cuda":
    torch.cuda.set_device(0)  # the one GPU CUDA_VISIBLE_DEVICES leaves this process
x = torch.ones(1 << 22, device=device)  # 16 MiB
assert float((x * 2).sum()) == 2.0 * (1 << 22)
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
dist.all_reduce(x)
assert float(x[0]) == 1.0
dist.destroy_process_group()
"""


def visible_gpus(env: Mapping[str, str] = os.environ, count: int | None = None) -> list[str]:
    """This process's GPUs by the ids CUDA_VISIBLE_DEVICES gives them (or 0..count-1 without it)."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    if count is None:
        import torch

        count = torch.cuda.device_count()
    return [str(i) for i in range(count)]


def probe(device_id: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether one device passes the probe: a GPU by its CUDA_VISIBLE_DEVICES id, or None for the CPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": device_id} if device_id is not None else dict(os.environ)
    args = [sys.executable, "-c", PROBE, "cpu" if device_id is None else "cuda"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return proc.wait(timeout=timeout_s) == 0
    except subprocess.TimeoutExpired:
        proc.kill()  # ours, by its handle
        try:
            proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass  # unkillable (stuck in the driver): left behind, its GPU failed
        return False


def still_running(workers: Sequence, timeout_s: float = EXIT_WAIT_S) -> list[int]:
    """Wait, at most timeout_s in all, for the old workers' processes (by rank; anything with join(timeout) and
    is_alive(), as multiprocessing's) to exit; the ranks whose process is still there."""
    deadline = time.monotonic() + timeout_s
    for proc in workers:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    return [rank for rank, proc in enumerate(workers) if proc.is_alive()]


def healthy_gpus(gpus: list[str], check: Callable[[str], bool] = probe) -> list[str]:
    """The GPUs that pass `check`, all probed at once (each in its own process), in their order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(gpus))) as pool:
        passed = list(pool.map(check, gpus))
    return [g for g, ok in zip(gpus, passed) if ok]


def restart_devices(device: str, world_size: int, lost_rank: int | None,
                    check: Callable[[str], bool] = probe, env: Mapping[str, str] = os.environ,
                    count: int | None = None, workers: Sequence = (), exit_wait_s: float = EXIT_WAIT_S
                    ) -> tuple[int, dict[str, str], str]:
    """(ranks a restart can have, environment changes for it, what was found) after a failure. On CUDA: the
    GPUs that pass the probe, less a rank whose device a rehearsal (`lose`) declared gone; the restart sees
    only those GPUs. workers: the old workers' processes by rank (a local launch: rank r on the r-th visible
    GPU); the probes wait for them to exit, and a GPU whose worker is still there fails unprobed. On CPU: the
    ranks the job had, less such a rank."""
    if device != "cuda":
        return world_size - (lost_rank is not None), {}, ""
    t0 = time.perf_counter()
    visible = visible_gpus(env, count)[:world_size]
    stuck = {visible[r] for r in still_running(workers, exit_wait_s) if r < len(visible)}
    gpus = [g for r, g in enumerate(visible) if r != lost_rank]  # rehearsed `lose`: that rank's GPU counts as gone
    healthy = healthy_gpus([g for g in gpus if g not in stuck], check)
    failed = [g for g in gpus if g not in healthy]
    said = (f"GPUs {', '.join(healthy)} passed the device check ({time.perf_counter() - t0:.1f} s)"
            + (f"; {', '.join(failed)} did not" if failed else "")
            + (f" ({', '.join(sorted(stuck))}: the old worker had not exited after {exit_wait_s:.0f} s)"
               if stuck else ""))
    return len(healthy), {"CUDA_VISIBLE_DEVICES": ",".join(healthy)}, said
