"""A rank's random streams (dropout): how they are seeded and how a checkpoint keeps them.

Seeded as Megatron seeds its default generator: one stream per (pipeline rank, data-parallel replica), the same on
every tensor-parallel rank of them, so dropout in the replicated regions (embedding, residual branches after the
row-parallel all-reduce) draws one mask on all of them, as it must for the replicas to stay equal. Replicas and
pipeline stages draw different masks. Dropout in sharded regions (attention heads under tp; the sequence chunks
under sequence parallelism) draws from a per-tp-rank stream derived from this one on entering the region
(pipegpt.tensor_parallel.rng), so restoring this stream (recomputation, a checkpoint) restores those masks too.

A checkpoint keeps each rank's CPU state ("rng/<rank>") and, on a GPU, its device generator's state
("cuda_rng/<rank>"); a resume under the same grid (dp, pp, cp, tp) restores both, so it continues the same streams.
Under another grid, even of the same world size, rank r holds another position (pp 4 x tp 2 -> pp 2 x tp 4: tp
ranks meant to share a stream would get states of different pipeline ranks), so the streams are seeded afresh for
the step resumed instead (resume_streams; the driver says so).
"""
from __future__ import annotations

import zlib
from typing import Callable

import torch


def rank_seed(seed: int, pp_index: int, dp_index: int, step: int = 0) -> int:
    """The seed of the stream of pipeline rank pp_index in replica dp_index (not of the tp rank); a step > 0: the
    fresh stream of a resume after that step under another grid (not a replay of the first steps' masks)."""
    name = f"dropout/pp{pp_index}/dp{dp_index}" + (f"/step{step}" if step else "")
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def seed_rank(seed: int, pp_index: int, dp_index: int, device: torch.device, cuda=torch.cuda, step: int = 0) -> None:
    """Seed this process's CPU generator and, on a GPU, its device's generator."""
    s = rank_seed(seed, pp_index, dp_index, step)
    torch.random.default_generator.manual_seed(s)  # the CPU one only: torch.manual_seed would seed every GPU
    if device.type == "cuda":
        cuda.manual_seed(s)  # the current device, the worker's


def rng_state(rank: int, device: torch.device, cuda=torch.cuda) -> dict[str, torch.Tensor]:
    """This rank's generator states, as checkpoint tensors (`cuda` is a parameter so a test can stand one in)."""
    states = {f"rng/{rank}": torch.get_rng_state()}
    if device.type == "cuda":
        states[f"cuda_rng/{rank}"] = cuda.get_rng_state(device)
    return states


def is_rng_key(key: str) -> bool:
    return key.startswith(("rng/", "cuda_rng/"))


def restore_rng(states: dict[str, torch.Tensor], rank: int, device: torch.device, cuda=torch.cuda) -> None:
    """Set this rank's generators from a checkpoint's states (those present: a CPU run's checkpoint resumed on a
    GPU leaves the device generator as seeded)."""
    if f"rng/{rank}" in states:
        torch.set_rng_state(states[f"rng/{rank}"])
    if device.type == "cuda" and f"cuda_rng/{rank}" in states:
        cuda.set_rng_state(states[f"cuda_rng/{rank}"], device)


def saved_grid(manifest: dict) -> tuple[int, int, int, int] | None:
    """(dp, pp, cp, tp) a checkpoint was written under, from the settings its manifest records (cp 1 in one
    written before context parallelism); None if it records none (then no rank's streams are taken from it)."""
    p = (manifest.get("config") or {}).get("parallel")
    if not p:
        return None
    return int(p.get("dp", 1)), int(p["stages"]), int(p.get("cp", 1)), int(p.get("tp", 1))


def resume_streams(manifest: dict, dims, saved: Callable[[], dict[str, torch.Tensor]], rank: int, pp_index: int,
                   dp_index: int, seed: int, device: torch.device, cuda=torch.cuda) -> bool:
    """A resume's streams: the checkpoint's states of this rank (`saved()`, read only then) where it was written
    under this grid (dims: dp, pp, cp, tp), else fresh ones for the step it was taken after. Returns whether the
    saved states were restored."""
    if saved_grid(manifest) == (dims.dp, dims.pp, dims.cp, dims.tp):
        restore_rng(saved(), rank, device, cuda)
        return True
    seed_rank(seed, pp_index, dp_index, device, cuda, step=max(1, int(manifest["step"])))
    return False


def grid_change_line(manifest: dict, dims, dropout: float) -> str | None:
    """What the driver says when a resume's dropout streams start afresh (another grid), else None."""
    grid = saved_grid(manifest)
    if dropout == 0 or grid == (dims.dp, dims.pp, dims.cp, dims.tp):
        return None
    was = " x ".join(map(str, grid)) if grid else "a grid it does not record"
    return (f"pipegpt: the checkpoint was written under dp x pp x cp x tp = {was}, this run is "
            f"{dims.dp} x {dims.pp} x {dims.cp} x {dims.tp}: dropout's random streams start afresh (seeded for the "
            f"resume after step {int(manifest['step'])}), not continued")
