"""Which device a job runs on and which GPU each worker owns.

Pure functions of the environment (passed in, so tests can fake a torchrun
launch without one): a local launch starts one worker per rank on this
machine; under torchrun each machine runs LOCAL_WORLD_SIZE of the ranks.
"""
from __future__ import annotations

import os
from typing import Mapping

from pipegpt.config import under_torchrun  # config.validate asks it too, and config sits below this module


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
