"""Which device a job runs on, which GPU each worker owns and, with --bind-cores, which CPU cores.

Pure functions of the environment (passed in, so tests can fake a torchrun
launch without one): a local launch starts one worker per rank on this
machine; under torchrun each machine runs LOCAL_WORLD_SIZE of the ranks.
"""
from __future__ import annotations

import os
from typing import Mapping

# in config: its validate asks under_torchrun, and the planner's costs (below this layer) usable_cores
from pipegpt.config import ConfigError, under_torchrun, usable_cores


def local_world_size(world_size: int, env: Mapping[str, str] = os.environ) -> int:
    """Ranks that run on this machine: all of them in a local launch, LOCAL_WORLD_SIZE under torchrun
    (an inherited LOCAL_WORLD_SIZE means nothing to a local launch)."""
    if under_torchrun(env):
        return int(env.get("LOCAL_WORLD_SIZE", world_size))
    return world_size


def cuda_device_index(rank: int, env: Mapping[str, str] = os.environ) -> int:
    """The GPU a worker owns: LOCAL_RANK under torchrun; its rank in a local launch (where a
    LOCAL_RANK inherited from the launching shell would put every worker on one GPU)."""
    if under_torchrun(env):
        return int(env["LOCAL_RANK"])
    return rank


def resolve_device(requested: str, world_size: int, cuda_count: int | None = None,
                   env: Mapping[str, str] = os.environ) -> str:
    """'auto' means CUDA when this machine has a GPU for each of its ranks, else CPU."""
    if requested != "auto":
        return requested
    if cuda_count is None:
        import torch

        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "cuda" if 0 < local_world_size(world_size, env) <= cuda_count else "cpu"


def default_threads(world_size: int, env: Mapping[str, str] = os.environ) -> int:
    """Each local worker's intra-op threads when --threads-per-worker is not given: the usable cores over the
    ranks on this machine."""
    return max(1, usable_cores() // max(1, local_world_size(world_size, env)))


def worker_cores(local_rank: int, local_ranks: int, threads: int, available: list[int] | None = None
                 ) -> tuple[int, ...]:
    """--bind-cores: the cores a worker is pinned to, `threads` of them from local_rank x threads among the
    cores this process may use (sorted). ConfigError, naming what would fit, when the ranks need more."""
    if available is None:
        if not hasattr(os, "sched_setaffinity"):
            raise ConfigError("--bind-cores needs os.sched_setaffinity (Linux); leave --bind-cores out here")
        available = sorted(os.sched_getaffinity(0))
    if local_ranks * threads > len(available):
        fix = (f"lower --threads-per-worker to {len(available) // local_ranks}" if len(available) >= local_ranks
               else f"run at most {len(available)} ranks here")
        raise ConfigError(f"--bind-cores needs {local_ranks} ranks x {threads} thread{'s' * (threads > 1)} = "
                          f"{local_ranks * threads} cores on this machine, and this process may use "
                          f"{len(available)}: {fix}, or leave --bind-cores out")
    return tuple(available[local_rank * threads:(local_rank + 1) * threads])


def torchrun_cores(threads_per_worker: int | None, env: Mapping[str, str] = os.environ) -> tuple[int, ...]:
    """--bind-cores under torchrun: this process's cores, by LOCAL_RANK of LOCAL_WORLD_SIZE; threads default to
    the cores this process may use over the ranks on this machine."""
    local_ranks = int(env.get("LOCAL_WORLD_SIZE", 1))
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    threads = threads_per_worker or max(1, len(available or ()) // local_ranks)
    return worker_cores(int(env.get("LOCAL_RANK", 0)), local_ranks, threads, available)


def bind_this_process(cores: tuple[int, ...]) -> None:
    """Pin this process (threads started from now on inherit it) to `cores`, one intra-op thread per core."""
    import torch

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def name_process(title: str) -> None:
    """What ps and top show for this process ("pipegpt: rank 1 stage 1"), instead of multiprocessing's
    `python -c from multiprocessing.spawn ...` shared by every worker."""
    try:
        # Only within the command line's own bytes: /proc/PID/environ stays readable (torchrun's RANK, which
        # tools and tests read there); a worker's command line is long enough for the title.
        os.environ.setdefault("SPT_NOENV", "1")
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # the name top shows, at least (15 bytes)
        try:
            with open("/proc/self/comm", "w") as f:
                f.write(title[:15])
        except OSError:
            pass
