"""A warning both roles' drivers print (a training run, an inference job): more worker processes than CPU cores."""
from __future__ import annotations


def crowding(settings, device: str) -> str | None:
    """A warning when more worker processes than CPU cores start here on CPU: they take turns on the cores.
    `settings`: the job's (a TrainConfig, an InferenceSettings: what has a world_size)."""
    from pipegpt.config import usable_cores
    from pipegpt.engine.placement import local_world_size

    if device != "cpu":
        return None
    cores = usable_cores()
    workers = local_world_size(settings.world_size)
    if workers <= cores:
        return None
    return (f"pipegpt: warning: {workers} worker processes on {cores} CPU cores: they take turns, so each step "
            f"is slower than on {workers} cores (dp x pp x cp x tp = {settings.world_size})")
