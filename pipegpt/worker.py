"""The actor on one rank: its model stages, optimizer, runtime, loader and device.

The driver calls its methods over RPC (they are the control plane's whole surface: start, build,
step, describe, named_grads, named_parameters, shutdown). Activations never pass through here:
the runtime sends them worker to worker.
"""
from __future__ import annotations

import functools
import resource
import time

import torch
import torch.distributed as dist

from pipegpt.comm.data_parallel import GradientAverager
from pipegpt.comm.mesh import Grid, init_mesh
from pipegpt.comm.p2p import PointToPoint
from pipegpt.comm.rpc import reports_failures
from pipegpt.config import TrainConfig
from pipegpt.data import RankLoader, builtin_tokens, get_tokenizer, load_token_file
from pipegpt.devices import cuda_device_index, resolve_device
from pipegpt.faults import fail_now, planned_fault
from pipegpt.model import GPT
from pipegpt.optim import clip_grad_norm_, make_optimizer
from pipegpt.runtime import PipelineRuntime, last_gradient_actions
from pipegpt.schedule import Plan
from pipegpt.stages import Stage, partition_layers
from pipegpt.tensor_parallel import REPLICATED, tp_shard_spec
from pipegpt.tensor_parallel.layers import sequence_parallel_grad_params, shard_for_tp


def actor_method(method):
    """An actor method, called over RPC: it runs on one of the RPC agent's pool threads, where the
    current CUDA device is per thread, so it enters the worker's device first; and any exception
    reaches the driver as a Failed (reports_failures)."""

    @functools.wraps(method)
    def on_device(self, *args, **kwargs):
        device = getattr(self, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        return method(self, *args, **kwargs)

    wrapped = reports_failures(on_device)
    wrapped.is_actor_method = True
    return wrapped


class Worker:
    def __init__(self, rank: int, cfg: TrainConfig, init_method: str):
        # Nothing here can fail: the work is in start(), whose failure the driver hears about.
        self.rank, self.cfg, self.init_method = rank, cfg, init_method

    @actor_method
    def start(self, plan: Plan) -> dict:
        """Take this rank's device, join the process groups, then build for the plan."""
        cfg, rank = self.cfg, self.rank
        self.device = torch.device(resolve_device(cfg.runtime.device, cfg.world_size))
        if self.device.type == "cuda":
            self.device = torch.device("cuda", cuda_device_index(rank))
            torch.cuda.set_device(self.device)
        p = cfg.parallel
        # Every schedule puts the first stage on pipeline rank 0 and the last on rank 0 or pp-1,
        # so this group serves any plan a later build() brings.
        self.mesh = init_mesh(Grid(p.dp, p.stages, p.tp), rank, self.device, self.init_method, cfg.runtime.timeout_s,
                              embedding_pp_indices=(0, p.stages - 1))
        self.p2p = PointToPoint(rank, cfg.runtime.timeout_s, self.device.type)
        self.fault = planned_fault(rank)
        return self.build.__wrapped__(self, cfg, plan)

    @actor_method
    def build(self, cfg: TrainConfig, plan: Plan) -> dict:
        """(Re)build model stages, optimizer, runtime and loader for cfg and the driver's plan, on the
        existing process groups (the grid must not change)."""
        self.cfg, self.plan = cfg, plan
        p, last = cfg.parallel, plan.num_stages - 1
        ranges = partition_layers(cfg.model.n_layer, plan.num_stages, p.layers_per_stage)
        dtype = getattr(torch, cfg.runtime.dtype)
        self.stages: dict[int, Stage] = {}
        for s in plan.stages_of(self.mesh.pp_index):
            module = GPT(cfg.model, layers=ranges[s], embed=s == 0, head=s == last,
                         recompute=p.recompute, init_seed=cfg.runtime.seed)
            if p.tp > 1:  # built whole from the per-name seeds, then cut to this rank's shard
                shard_for_tp(module, self.mesh.tp_index, p.tp, self.mesh.group("tp"), p.sequence_parallel)
            self.stages[s] = Stage(s, plan.num_stages, module.to(self.device, dtype), plan.num_microbatches)
        if self.stages.keys() >= {0, last} and last != 0 and cfg.model.tie_embeddings:
            # Both ends of a V live here: share one tensor, so the gradient sums by itself.
            self.stages[last].module.lm_head.weight = self.stages[0].module.wte.weight
        self.named_params = self._unique_named_params()
        dp_group = self.mesh.group("dp")
        self.optimizer = make_optimizer(self.named_params, cfg.optim, dp_group if p.zero else None)
        self.averager = None
        if dp_group is not None:
            self.averager = GradientAverager(self._params_by_stage(plan), dp_group, self.rank, cfg.runtime.timeout_s)
        seq = cfg.model.seq_len // p.tp if p.sequence_parallel else cfg.model.seq_len
        self.runtime = PipelineRuntime(
            plan, self.rank, self.stages, self.p2p, self.mesh.grid.pipeline_ranks(self.rank),
            (p.microbatch_size, seq, cfg.model.n_embd), dtype, self.device,
            on_gradients_ready=self.averager.start if self.averager else lambda stage: None)
        self.loader = None
        if 0 in self.stages or last in self.stages:
            tokens = load_token_file(cfg.data.data) if cfg.data.data else builtin_tokens(get_tokenizer(cfg.data.tokenizer))
            self.loader = RankLoader(tokens, cfg.model.seq_len, plan.num_microbatches, p.microbatch_size, p.dp,
                                     self.mesh.dp_index, cfg.runtime.seed, inputs=0 in self.stages,
                                     targets=last in self.stages)
        return self.describe.__wrapped__(self)

    def _unique_named_params(self) -> list[tuple[str, torch.Tensor]]:
        seen, named = set(), []
        for stage in self.stages.values():
            for name, p in stage.module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    named.append((name, p))
        return named

    def _params_by_stage(self, plan: Plan) -> dict[int, list[torch.Tensor]]:
        """Each parameter under the stage whose gradients complete last among those using it
        (a tensor shared by two stages here, the V-shape's tied embedding, waits for both)."""
        done_at = last_gradient_actions(plan.ranks[self.mesh.pp_index])
        owner: dict[int, tuple[int, torch.Tensor]] = {}
        for s in sorted(self.stages, key=lambda s: done_at[s]):
            for p in self.stages[s].module.parameters():
                owner[id(p)] = (s, p)
        by_stage: dict[int, list[torch.Tensor]] = {s: [] for s in self.stages}
        for s, p in owner.values():
            by_stage[s].append(p)
        return by_stage

    def _tied_copies(self) -> list[torch.Tensor]:
        """This rank's copy of the tied embedding, if the other copy lives on another rank."""
        if self.plan.stage_to_rank[0] == self.plan.stage_to_rank[-1]:
            return []  # both copies on one rank are one shared tensor (see build)
        return [stage.module.get_parameter(local) for stage in self.stages.values()
                for local in stage.module.tied_parameter_names()]

    @actor_method
    def step(self, step: int) -> dict:
        """One training step: loader -> runtime -> finish gradients -> clip -> optimizer."""
        if self.fault and self.fault[1] == step:
            fail_now(*self.fault)
        t0 = time.perf_counter()
        for _, p in self.named_params:
            p.grad = None
        inputs, targets = self._batch(step)
        result = self.runtime.step(inputs, targets)
        self._finish_gradients()
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step is done when its kernels are, not launched
        return {"rank": self.rank, "losses": result.losses, "events": result.events,
                "grad_norm": grad_norm, "compute_s": time.perf_counter() - t0, "peak_memory": self._peak_memory()}

    def _batch(self, step: int):
        if self.loader is None:
            return None, None
        self.loader.step = step + 1
        inputs, targets = self.loader.batch(step)
        return ([self._to_device(x) for x in inputs] if inputs else None,
                [self._to_device(y) for y in targets] if targets else None)

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned, so the copy overlaps with the host's next steps
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch

    def _finish_gradients(self) -> None:
        """Sum what other ranks contributed: data-parallel replicas (started during the step), the
        sequence-parallel partial gradients, the tied embedding's other copy."""
        if self.averager:
            self.averager.finish()
        for stage in self.stages.values():  # replicated weights saw only this rank's part of the sequence
            for p in sequence_parallel_grad_params(stage.module):
                dist.all_reduce(p.grad, group=self.mesh.group("tp"))
        for copy in self._tied_copies():
            dist.all_reduce(copy.grad, group=self.mesh.group("embedding"))

    def _clip_gradients(self) -> float:
        """Clip by the global norm over one model replica, each value counted once: not the last stage's
        copy of a tied embedding (rank 0 counts it), nor replicated weights on tp ranks other than 0."""
        skip = {id(p) for p in self._tied_copies()} if 0 not in self.stages else set()
        if self.mesh.tp_index > 0:
            skip |= {id(p) for n, p in self.named_params if tp_shard_spec(n) == REPLICATED}
        params = [p for _, p in self.named_params]
        return clip_grad_norm_([p for p in params if id(p) not in skip], params, self.cfg.optim.grad_clip,
                               self.mesh.group("model"), self.device)

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    @actor_method
    def describe(self) -> dict:
        optimizer = getattr(self.optimizer, "optim", self.optimizer)  # ZeRO wraps this rank's shard
        state_bytes = sum(t.numel() * t.element_size() for state in optimizer.state.values()
                          for t in state.values() if torch.is_tensor(t))
        return {"rank": self.rank, "stages": sorted(self.stages), "device": str(self.device),
                "parameters": sum(p.numel() for _, p in self.named_params),
                "parameter_bytes": sum(p.numel() * p.element_size() for _, p in self.named_params),
                "optimizer_state_bytes": state_bytes}

    @actor_method
    def named_grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().cpu().clone() for n, p in self.named_params if p.grad is not None}

    @actor_method
    def named_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.named_params}

    @actor_method
    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
