"""The process groups of a layout: the only place that creates them, each from pipegpt.dims.GROUP_AXES (which
axes it spans, carved ones too).

Where a rank sits (rank order, coordinates, the members of a group) is pipegpt.dims.ParallelDims's: tp fastest,
so tensor-parallel peers sit on one machine.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pipegpt.dims import GROUP_AXES, Coords, ParallelDims

@dataclass
class Mesh:
    """This process's place in the layout, with the groups it communicates over and their members."""

    dims: ParallelDims
    rank: int
    groups: dict = field(default_factory=dict)  # name -> process group (None: a group of one)
    members: dict = field(default_factory=dict)  # name -> the global ranks of this rank's group, in rank order
    # pipeline neighbour's rank -> (the group this rank's messages to it go on, the one its messages come on);
    # None: not made (pair_groups())
    pairs: dict | None = None
    batch_loops: bool = False  # gloo's loop threads go under SCHED_BATCH (batch_gloo_loops) as groups are made

    @property
    def coords(self) -> Coords:
        return self.dims.coords(self.rank)

    def index(self, axis: str) -> int:
        """This rank's position along any axis of the layout (a carved one too)."""
        return self.dims.index(self.rank, axis)

    def __getattr__(self, name: str) -> int:
        """dp_index, pp_index, cp_index, tp_index, and ep_index where the layout carves ep: index(axis)."""
        dims, axis = self.__dict__.get("dims"), name.removesuffix("_index")
        if dims is not None and axis != name and axis in dims.axis_names:
            return dims.index(self.rank, axis)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def group(self, name: str):
        return self.groups.get(name)

    def pair_groups(self) -> dict:
        """This rank's pipeline neighbours, each with two process groups of the two ranks alone: the one this
        rank's messages to it go on and the one its messages to this rank come on. Messages matched by order
        (NCCL) run one after another on their communicator's stream, so with one a direction of each pair no
        message waits behind one in the other direction or with another neighbour (simulate_order's lanes).
        Made on the first call, which every rank makes at the same point (a collective, as new_group is)."""
        if self.pairs is None:
            self.pairs = {}
            for low, high in pipeline_pairs(self.dims):
                upward, downward = dist.new_group([low, high]), dist.new_group([low, high])
                if self.rank == low:
                    self.pairs[high] = (upward, downward)
                elif self.rank == high:
                    self.pairs[low] = (downward, upward)
            if self.batch_loops:
                batch_gloo_loops(_gloo_groups(self))
        return self.pairs


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


def init_mesh(dims: ParallelDims, rank: int, device: torch.device, init_method: str, timeout_s: float,
              embedding_pp_indices: tuple[int, ...] = (), batch_loops: bool = True) -> Mesh:
    """Join the default process group (NCCL on CUDA, gloo on CPU) and create every subgroup.

    new_group must be called by every rank for every group in the same order,
    so each rank builds all of them and keeps the ones it belongs to.
    embedding_pp_indices: pipeline positions that hold a copy of the tied
    embedding (first and last stage) and must sum its gradient.
    batch_loops: on gloo, put its loop threads under SCHED_BATCH (runtime.gloo_loops).
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
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=dims.world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None, **rendezvous)
    mesh = Mesh(dims, rank, batch_loops=batch_loops and not cuda)
    # On gloo, axes whose groups hold the same ranks share one process group, and a group of every rank is the
    # default one: each gloo group brings threads of its own, and idle ones still slowed the pipeline's messages
    # on the default group (benchmarks/README.md, bench_host). Every rank issues a group's collectives from its
    # one stepping thread in plan order, so the axes sharing a group keep their order. NCCL keeps a communicator
    # per axis: each has a stream, and collectives on two run side by side.
    made: dict[tuple[int, ...], object] = {} if cuda else {tuple(range(dims.world_size)): dist.group.WORLD}
    for name, groups in group_members(dims, embedding_pp_indices).items():
        for members in groups:
            if len(members) == 1:
                group = None
            elif tuple(members) in made:
                group = made[tuple(members)]
            else:
                group = dist.new_group(members)
                if not cuda:
                    made[tuple(members)] = group
            if rank in members:
                mesh.groups[name], mesh.members[name] = group, members
    if mesh.batch_loops:
        batch_gloo_loops(_gloo_groups(mesh))
    return mesh


LOOP_NAME_WAIT_S = 1.0  # a new loop thread names itself once it first runs; on a loaded machine, not at once


def batch_gloo_loops(expected: int = 0, wait_s: float = LOOP_NAME_WAIT_S) -> int:
    """Put this process's gloo event-loop threads under SCHED_BATCH (woken, they wait for the tick or for a thread
    to block instead of preempting it); the number of threads changed. Gloo's loop takes a pair's lock with a
    try-lock and retries at once: woken by a peer's message while this rank's stepping thread held the lock in the
    middle of its own write, it preempted that thread and spun until the scheduler's tick, about 4 ms, at every
    exchange where both neighbours posted at once (benchmarks/README.md, bench_host). Call after creating groups:
    each gloo group brings a loop of its own. expected: how many gloo groups the process holds; a loop thread
    is found by the name it gives itself when it first runs, which under load can come after its group was
    made, so this waits up to wait_s for that many (then changes those there are)."""
    if not hasattr(os, "sched_setscheduler"):
        return 0
    deadline = time.monotonic() + wait_s
    loops = _gloo_loop_threads()
    while len(loops) < expected and time.monotonic() < deadline:
        time.sleep(0.001)
        loops = _gloo_loop_threads()
    changed = 0
    for task in loops:
        try:
            if os.sched_getscheduler(task) != os.SCHED_BATCH:
                os.sched_setscheduler(task, os.SCHED_BATCH, os.sched_param(0))
                changed += 1
        except OSError:  # the thread ended, or the system refuses: the loop runs as it did
            continue
    return changed


def _gloo_loop_threads() -> list[int]:
    """The ids of this process's threads named gloo_tcp_loop."""
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    found.append(int(task))
        except OSError:  # the thread ended
            continue
    return found


def _gloo_groups(mesh: Mesh) -> int:
    """How many gloo process groups this rank holds: the default one, its axes' (shared ones once), its pairs'."""
    held = [dist.group.WORLD, *mesh.groups.values(), *(g for pair in (mesh.pairs or {}).values() for g in pair)]
    return len({id(g) for g in held if g is not None})


def group_members(dims: ParallelDims, embedding_pp_indices: tuple[int, ...] = ()) -> dict[str, list[list[int]]]:
    """Every process group's ranks, by name, in the order every rank creates them: GROUP_AXES over the layout;
    a carved axis's groups only where the layout carves it; the embedding's only where two pipeline positions hold
    a copy."""
    out = {}
    for name, axes in GROUP_AXES.items():
        at = {"pp": embedding_pp_indices} if name == "embedding" else None
        if set(axes) <= set(dims.axis_names) and (at is None or len(set(embedding_pp_indices)) > 1):
            out[name] = dims.groups(axes, at)
    return out


def pipeline_pairs(dims: ParallelDims) -> list[tuple[int, int]]:
    """Every pair of pipeline neighbours, sorted, each once, in the order every rank creates their groups: pipeline
    positions i and i + 1, and the last with the first (an interleaved schedule's round hands its last stage's
    output to rank 0), in each pipeline group."""
    return list(dict.fromkeys(tuple(sorted((members[i], members[(i + 1) % len(members)])))
                              for members in dims.groups(("pp",))
                              for i in range(len(members) if len(members) > 2 else len(members) - 1)))
