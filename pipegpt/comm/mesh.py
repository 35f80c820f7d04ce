"""The dp x pp x tp grid of ranks and its process groups: the only place that creates them.

Rank layout (tp fastest, so tensor-parallel peers sit on one machine):
    rank = (dp_index * pp + pp_index) * tp + tp_index
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Grid:
    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_index, pp_index, tp_index) of a global rank."""
        rest, t = divmod(rank, self.tp)
        d, p = divmod(rest, self.pp)
        return d, p, t

    def rank_of(self, dp_index: int, pp_index: int, tp_index: int) -> int:
        return (dp_index * self.pp + pp_index) * self.tp + tp_index

    def pipeline_ranks(self, rank: int) -> list[int]:
        """Global ranks of the pipeline this rank belongs to, by pipeline position."""
        d, _, t = self.coords(rank)
        return [self.rank_of(d, p, t) for p in range(self.pp)]


@dataclass
class Mesh:
    """This process's place in the grid, with the groups it communicates over."""

    grid: Grid
    rank: int
    groups: dict = field(default_factory=dict)

    @property
    def dp_index(self) -> int:
        return self.grid.coords(self.rank)[0]

    @property
    def pp_index(self) -> int:
        return self.grid.coords(self.rank)[1]

    @property
    def tp_index(self) -> int:
        return self.grid.coords(self.rank)[2]

    def pipeline_peer(self, pp_index: int) -> int:
        """Global rank holding pipeline position pp_index in this rank's pipeline."""
        return self.grid.pipeline_ranks(self.rank)[pp_index]

    def group(self, name: str):
        return self.groups.get(name)


# NCCL's watchdog, on a timeout or an error, by default (3, SkipCleanUp) kills the process: the driver then only
# hears that a rank died. 2 (CleanUpOnly) aborts the communicators and leaves the error on the Work, so the wait
# that meets it raises and pipegpt reports the rank with NCCL's message. Blocking waits stay off: on CUDA a wait
# only orders streams (pipegpt.comm.p2p), and settle() bounds the host's own waits by the timeout.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def nccl_environment(env=os.environ) -> None:
    """Set NCCL_ENV where the user has not (read when a NCCL process group is created)."""
    for name, value in NCCL_ENV.items():
        if name not in env and name.removeprefix("TORCH_") not in env:
            env[name] = value


def init_mesh(grid: Grid, rank: int, device: torch.device, init_method: str, timeout_s: float,
              embedding_pp_indices: tuple[int, ...] = ()) -> Mesh:
    """Join the default process group (NCCL on CUDA, gloo on CPU) and create every subgroup.

    new_group must be called by every rank for every group in the same order,
    so each rank builds all of them and keeps the ones it belongs to.
    embedding_pp_indices: pipeline positions that hold a copy of the tied
    embedding (first and last stage) and must sum its gradient.
    """
    cuda = device.type == "cuda"
    if cuda:
        nccl_environment()
    rendezvous: dict = {"init_method": init_method}
    if init_method.startswith("tcp://"):  # the driver holds the store (LocalCluster): join it as a client
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        rendezvous = {"store": dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))}
    # device_id binds the group to this rank's GPU: communicators are created now (not at the first
    # collective, on whatever device is current then) and subgroups are split from them.
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=grid.world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None, **rendezvous)
    mesh = Mesh(grid, rank)
    g = grid
    families = {
        "dp": [[g.rank_of(d, p, t) for d in range(g.dp)] for p in range(g.pp) for t in range(g.tp)],
        "tp": [[g.rank_of(d, p, t) for t in range(g.tp)] for d in range(g.dp) for p in range(g.pp)],
        "pp": [[g.rank_of(d, p, t) for p in range(g.pp)] for d in range(g.dp) for t in range(g.tp)],
        # One model replica (pp x tp): what a gradient norm sums over.
        "model": [[g.rank_of(d, p, t) for p in range(g.pp) for t in range(g.tp)] for d in range(g.dp)],
    }
    if len(set(embedding_pp_indices)) > 1:
        families["embedding"] = [[g.rank_of(d, p, t) for p in sorted(set(embedding_pp_indices))]
                                 for d in range(g.dp) for t in range(g.tp)]
    for name, member_lists in families.items():
        for members in member_lists:
            group = dist.new_group(members) if len(members) > 1 else None
            if rank in members:
                mesh.groups[name] = group
    return mesh
