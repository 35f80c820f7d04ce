"""Restarts (--max-restarts): the driver starts itself again, a fresh process, resuming the run's latest
checkpoint (or snapshot), in the same layout or, when a device is gone, in the layout for the ranks that remain.

What the next attempt must know (which restart it is, when the failure happened, the completed steps it lost)
goes into the run directory's restart.json, tagged with this process's identity (pipegpt.state.owner): os.execve
keeps the pid and its start time, so the new image, and nothing else, recognises the file as its own. The run
directory's lock and the snapshots in shared memory pass to the new image the same way.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from pipegpt import run_files
from pipegpt.config import TrainConfig, option_flags
from pipegpt.dims import LAYOUT_FIELDS
from pipegpt.engine.placement import resolve_device
from pipegpt.state.owner import keep_across_exec, process_identity


def write_restart_state(run_dir: Path, count: int, failed_at: float, steps_lost: int | None) -> None:
    state = {"process": process_identity(), "count": count, "failed_at": failed_at, "steps_lost": steps_lost}
    run_files.write_whole(Path(run_dir) / run_files.RESTART, json.dumps(state))


def restart_state(run_dir: Path | None) -> tuple[int, float | None, int | None]:
    """(restarts so far, when the failure this attempt restarts after happened, the completed steps it lost),
    from the run directory's restart.json when this process wrote it before replacing itself; else (0, None, None)."""
    if run_dir is None:
        return 0, None, None
    try:
        state = json.loads((Path(run_dir) / run_files.RESTART).read_text())
    except (OSError, ValueError):
        return 0, None, None
    if not isinstance(state, dict) or state.get("process") != process_identity():
        return 0, None, None
    return int(state["count"]), float(state["failed_at"]), state.get("steps_lost")


def restart(echo: Callable, failure, job, run_dir: Path, count: int) -> None:
    """Say which rank failed, why, at which step and where the run goes on from; then replace this process with
    `pipegpt run` again, resuming the run's latest checkpoint (or starting it again, without one). The workers were
    killed on the way out (on GPUs the device check waits for them to exit); a fresh process leaves no RPC state
    behind. A rehearsed
    fault (PIPEGPT_FAULT) fires on the first attempt only (a comma list: one per attempt)."""
    from pipegpt.state import checkpoint, snapshot
    from pipegpt.resilience.elastic import layout_text
    from pipegpt.resilience.faults import FAULT_ENV, later_faults
    from pipegpt.resilience.health import restart_devices

    failed_at = time.time()
    failure = _with_lost_rank(failure, getattr(job.cluster, "procs", ()))
    saved = checkpoint.complete_checkpoints(run_dir / run_files.CHECKPOINTS)
    # in a call of several steps the driver knows only the call's first: steps_lost counts from it (at least)
    step, in_call = job.current_step, job.current_count
    at = " while starting" if step is None else f" at step {step + 1}" if in_call == 1 else \
        f" in steps {step + 1}-{step + in_call} (one call, --steps-per-call)"
    cfg = job.cfg
    device = resolve_device(cfg.runtime.device, cfg.world_size)
    ranks, device_env, checked = restart_devices(device, cfg.world_size, failure.rank if _lost(failure) else None,
                                                 workers=getattr(job.cluster, "procs", ()))  # local ones: by rank
    if checked:
        echo(f"pipegpt: {checked}", err=True)
    on_disk = int(checkpoint.read_manifest(saved[-1], verify=False)["step"]) if saved else 0
    # a snapshot outlives processes, not machines: where a device is gone, its host may be too
    same_devices = ranks == cfg.world_size
    root = snapshot.own_root(run_dir)  # this driver's: never another run's
    memory = snapshot.newest_complete(root, on_disk) if same_devices and root is not None else None
    if root is not None:
        snapshot.keep_only(root, memory)  # the others are older, or were left half-written by the failure
    if memory is not None:
        saved = [memory]  # newer than any checkpoint on disk: resumed from shared memory
    if saved:
        done = int(checkpoint.read_manifest(saved[-1], verify=False)["step"])
        lost = f", {step - done} step{'s' if step - done != 1 else ''} to do again" if step is not None else ""
        steps_lost = step - done if step is not None else 0
        kind = "the snapshot in memory " if memory is not None else ""
        source = f"from {kind}{saved[-1]} (after step {done}{lost})"
    else:
        source = "from the start (no checkpoint yet)"
        steps_lost = step or 0
    limit, layout, flags = cfg.checkpoint.max_restarts, "same layout", {}
    if not same_devices:  # a device is gone: go on without it, or stop
        shrunk = _shrink(echo, failure, cfg, ranks)
        layout, flags = f"{layout_text(cfg)} -> {layout_text(shrunk.cfg)}, predicted step x{shrunk.ratio:.2f}", \
            shrunk.flags
        zero = cfg.parallel.zero, shrunk.cfg.parallel.zero
        if zero[0] != zero[1]:
            layout += f", ZeRO {zero[0]} -> {zero[1]} (one replica left to shard over)"
    echo(f"pipegpt: rank {failure.rank} {failure.verb}{at} ({failure.cause}); restart {count} of {limit}, "
         f"{layout}, {source}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if later_faults():
        env[FAULT_ENV] = later_faults()
    write_restart_state(run_dir, count, failed_at, steps_lost)
    env.update(device_env)  # on GPUs: only those that passed the device check
    keep_across_exec(env)  # the run directory stays this process's through the exec
    resume = None if not saved else str(saved[-1]) if memory is not None else str(run_dir)
    args = restart_args(sys.argv[1:], resume, flags, run_dir=str(run_dir))
    os.execve(sys.executable, [sys.executable, "-m", "pipegpt", *args], env)


def _shrink(echo: Callable, failure, cfg: TrainConfig, remaining: int):
    """The layout for the ranks that remain when devices are gone; the run ends (exit 1) where --min-ranks does
    not allow it or no layout builds."""
    from pipegpt.resilience.elastic import shrunk_layout

    why = None
    if cfg.checkpoint.min_ranks is None:
        why = "give --min-ranks K to go on with fewer ranks"
    elif remaining < cfg.checkpoint.min_ranks:
        why = f"{remaining} ranks remain, fewer than --min-ranks {cfg.checkpoint.min_ranks}"
    shrunk = None if why else shrunk_layout(cfg, remaining)
    if why is None and shrunk is None:
        why = f"no layout of this model and batch builds on {remaining} ranks"
    if why:
        gone = (f"rank {failure.rank}'s device is gone" if _lost(failure) and remaining == cfg.world_size - 1
                else f"{cfg.world_size - remaining} of {cfg.world_size} devices are gone")
        exit_now(echo, f"Error: {gone} ({failure.cause}): {why}; all workers stopped", 1)
    return shrunk


# The layout options a shrunk restart sets (and their short forms): the old values go.
LAYOUT_FLAGS = frozenset(flag for f in LAYOUT_FIELDS if f.shrink for flag in option_flags(f.name))


def restart_args(argv: list[str], resume: str | None, layout: dict | None = None, run_dir: str | None = None
                 ) -> list[str]:
    """The command line again, resuming `resume` (None: as given, the run starting over) in `run_dir` (where its
    restart.json is, so always the same directory): --resume,
    --init-from and --config give way to the checkpoint, which holds the run's settings; --overwrite would move
    the run aside. `layout` (flag -> value) replaces the layout options given, when the run goes on with fewer
    ranks."""
    drop = {"--overwrite"} | ({"--resume", "--init-from", "--config"} if resume else set()) | \
        ({"--run-dir"} if run_dir else set())
    if layout:  # the layout's own flags, and any other it sets (--zero lowered, --unshard dropped: None)
        drop |= LAYOUT_FLAGS | {form for flag in layout for form in option_flags(flag[2:].replace("-", "_"))}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg and name != "--overwrite"
            continue
        out.append(arg)
    for flag, value in (layout or {}).items():
        out += [flag, str(value)] if value is not None else []
    return out + (["--resume", resume] if resume else []) + (["--run-dir", run_dir] if run_dir else [])



def _with_lost_rank(failure, workers):
    """The failure to restart after: a worker whose device is gone (a rehearsed `lose`) is the cause, whichever
    rank's failure arrived first, so that a lost rank is never restarted into the same layout. workers: the
    local processes by rank (none under torchrun)."""
    from pipegpt.comm.rpc import WorkerFailure
    from pipegpt.resilience.faults import LOST_DEVICE_EXIT

    lost = [rank for rank, proc in enumerate(workers) if proc.exitcode == LOST_DEVICE_EXIT]
    if _lost(failure) or not lost:
        return failure
    return WorkerFailure(lost[0], f"process exited with code {LOST_DEVICE_EXIT}", exit_code=LOST_DEVICE_EXIT)


def _lost(failure) -> bool:
    """Whether the failed rank's device is gone for good (a rehearsed `lose`): a shrink, not a restart."""
    from pipegpt.resilience.faults import LOST_DEVICE_EXIT

    return failure.exit_code == LOST_DEVICE_EXIT



def drop_snapshots(cfg: TrainConfig, run_dir: Path) -> None:
    """The run is over (done, or failed past --max-restarts): its snapshots in shared memory go (RAM)."""
    if cfg.checkpoint.snapshot_every and run_dir is not None:
        from pipegpt.state import snapshot

        root = snapshot.own_root(run_dir)
        if root is not None:
            snapshot.remove(root)



def exit_now(echo: Callable, message: str, code: int):
    """Exit without interpreter teardown: with workers killed mid-call, the RPC agent's
    destructor can abort the process, turning a clean error into a crash."""
    echo(message, err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
