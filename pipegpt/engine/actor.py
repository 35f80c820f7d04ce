"""What makes a role's method part of the RPC surface: it runs on the rank's one actor thread, inside the rank's
device, and any exception reaches the driver as a Failed (pipegpt.comm.rpc). Every role (training, inference)
marks its methods with it."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from pipegpt.comm.rpc import on_actor_thread, reports_failures
from pipegpt.engine.engine import Engine


def actor_method(method=None, *, concurrent: bool = False):
    """An actor method, called over RPC. It runs on the worker's one actor thread (pipegpt.comm.rpc.
    ActorThread), after the calls before it, and enters the worker's device first (the current CUDA device is
    per thread); a concurrent one (where(), asked while step() runs) runs at once on the RPC pool thread that
    received it. Any exception reaches the driver as a Failed (reports_failures)."""
    if method is None:
        return functools.partial(actor_method, concurrent=concurrent)

    @functools.wraps(method)
    def on_device(self, *args, **kwargs):
        def call():
            device = getattr(self, "device", None)
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            return method(self, *args, **kwargs)

        return call() if concurrent else on_actor_thread(call)

    wrapped = reports_failures(on_device)
    wrapped.is_actor_method = True
    return wrapped


class Role:
    """What every role on a rank's engine (training: pipegpt.train.worker; inference: pipegpt.infer.worker) is: an
    actor holding its settings and the rank's Engine, answering where() and shutdown()."""

    def __init__(self, rank: int, cfg, init_method: str):
        # Nothing here can fail: the work is in start(), whose failure the driver hears about.
        self.rank, self.cfg = rank, cfg
        self.engine = Engine(rank, init_method)
        self.running_step: int | None = None

    @property
    def device(self) -> torch.device | None:
        return self.engine.device

    @actor_method(concurrent=True)
    def where(self) -> dict:
        """Which action this rank is on and which ranks it waits for (now: None between steps); answered
        on an RPC thread while a call runs on the actor thread, for the driver's stall watchdog. step: the
        training step (from 0) this rank runs or ran last, which a call of several steps needs."""
        return {**self.engine.where(), "step": self.running_step}

    @actor_method
    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
