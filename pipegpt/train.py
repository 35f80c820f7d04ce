"""Data -> model slices -> plan -> runtime -> optimizer, on every worker; and the driver that steers them.

Worker is the actor each rank runs. The driver (train()) talks to the workers
over RPC, one control message per step; activations never pass through it.
"""
from __future__ import annotations

import functools
import json
import math
import os
import resource
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from pipegpt.comm.data_parallel import GradientAverager
from pipegpt.comm.mesh import Grid, init_mesh
from pipegpt.comm.p2p import PointToPoint
from pipegpt.comm.rpc import reports_failures
from pipegpt.config import ConfigError, TrainConfig
from pipegpt.devices import cuda_device_index, local_world_size, resolve_device, under_torchrun
from pipegpt.data import BatchSampler, builtin_tokens, get_tokenizer, load_token_file
from pipegpt.model import GPT
from pipegpt.runtime import PipelineRuntime, last_gradient_actions
from pipegpt.schedule import Plan, ScheduleError, build_plan, lower, validate
from pipegpt.stages import Stage, partition_layers
from pipegpt.tensor_parallel import (REPLICATED, sequence_parallel_grad_params, shard_for_tp,
                                           tp_shard_spec, validate_tp)


def make_plan(cfg: TrainConfig) -> Plan:
    try:
        return validate(lower(build_plan(cfg.schedule, cfg.stages, cfg.microbatches, cfg.virtual_stages)))
    except ScheduleError as e:
        raise ConfigError(str(e)) from None


def check(cfg: TrainConfig) -> Plan:
    """Everything that can be refused before a worker starts; returns the plan."""
    cfg.validate()
    validate_tp(cfg.model, cfg.tp, cfg.sequence_parallel)
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ConfigError("sequence parallelism shards along the sequence across tensor-parallel ranks: use it with --tp 2 or more")
    plan = make_plan(cfg)
    partition_layers(cfg.model.n_layer, plan.num_stages, cfg.layers_per_stage)
    if resolve_device(cfg.device, cfg.world_size) == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = local_world_size(cfg.world_size)
        if have < local:
            raise ConfigError(f"device=cuda needs one GPU per rank on this machine ({local}), "
                              f"but {have} are visible: use --device cpu or fewer ranks")
    return plan


def _decays(name: str, p: torch.Tensor) -> bool:
    return p.dim() >= 2  # matrices decay; biases, LayerNorm gains do not (as GPT-2 / nanoGPT)


def make_optimizer(named_params: list[tuple[str, torch.Tensor]], cfg: TrainConfig, dp_group=None):
    """AdamW; with zero=1 and data parallelism, torch's ZeroRedundancyOptimizer shards its state across replicas."""
    groups = [
        {"params": [p for n, p in named_params if _decays(n, p)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named_params if not _decays(n, p)], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.zero and dp_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=dp_group,
                                       lr=cfg.lr, betas=cfg.betas, foreach=False)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, foreach=False)


FAULT_ENV = "PIPEGPT_FAULT"


def planned_fault(rank: int) -> tuple[str, int] | None:
    """PIPEGPT_FAULT=KIND:RANK:STEP makes RANK fail at STEP, to rehearse failure handling.

    KIND is raise (an exception), exit (the process dies) or freeze (the process stops: SIGSTOP).
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    kind, fault_rank, step = spec.split(":")
    return (kind, int(step)) if int(fault_rank) == rank else None


def _fail_now(kind: str, rank: int, step: int) -> None:
    if kind == "raise":
        raise RuntimeError(f"fault injected by {FAULT_ENV} at step {step}")
    if kind == "exit":
        os._exit(13)
    if kind == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    raise ValueError(f"{FAULT_ENV} kind {kind!r} is not one of raise, exit, freeze")


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
    """The actor on one rank: owns its model stages, its optimizer, its runtime and its device."""

    def __init__(self, rank: int, cfg: TrainConfig, init_method: str):
        # Nothing here can fail: the work is in start(), whose failure the driver hears about.
        self.rank, self.cfg, self.init_method = rank, cfg, init_method

    @actor_method
    def start(self) -> dict:
        rank, cfg, init_method = self.rank, self.cfg, self.init_method
        self.device = torch.device(resolve_device(cfg.device, cfg.world_size))
        if self.device.type == "cuda":
            self.device = torch.device("cuda", cuda_device_index(rank))
            torch.cuda.set_device(self.device)
        # Every schedule puts the first stage on pipeline rank 0 and the last on rank 0 or pp-1,
        # so this group serves any plan a later build() brings.
        self.mesh = init_mesh(Grid(cfg.dp, cfg.stages, cfg.tp), rank, self.device, init_method, cfg.timeout_s,
                              embedding_pp_indices=(0, cfg.stages - 1))
        self.p2p = PointToPoint(rank, cfg.timeout_s, self.device.type)
        self.fault = planned_fault(rank)
        return self.build(cfg)

    @actor_method
    def build(self, cfg: TrainConfig) -> dict:
        """(Re)build model stages, optimizer and runtime for cfg on the existing process group."""
        self.cfg = cfg
        plan = self.plan = make_plan(cfg)
        ranges = partition_layers(cfg.model.n_layer, plan.num_stages, cfg.layers_per_stage)
        last = plan.num_stages - 1
        self.stages: dict[int, Stage] = {}
        for s in plan.stages_of(self.mesh.pp_index):
            module = GPT(cfg.model, layers=ranges[s], embed=s == 0, head=s == last,
                         recompute=cfg.recompute, init_seed=cfg.seed)
            if cfg.tp > 1:  # built whole from the per-name seeds, then cut to this rank's shard
                shard_for_tp(module, self.mesh.tp_index, cfg.tp, self.mesh.group("tp"), cfg.sequence_parallel)
            self.stages[s] = Stage(s, plan.num_stages, module.to(self.device, getattr(torch, cfg.dtype)),
                                   cfg.microbatches)
        if plan.stage_to_rank[0] == plan.stage_to_rank[-1] and self.stages.keys() >= {0, last} \
                and last != 0 and cfg.model.tie_embeddings:
            # Both ends of a V live here: share one tensor, so the gradient sums by itself.
            self.stages[last].module.lm_head.weight = self.stages[0].module.wte.weight
        self.named_params = self._unique_named_params()
        dp_group = self.mesh.group("dp")
        self.optimizer = make_optimizer(self.named_params, cfg, dp_group)
        self.averager = None
        if dp_group is not None:
            self.averager = GradientAverager(self._params_by_stage(plan), dp_group, self.rank, cfg.timeout_s)
        seq = cfg.model.seq_len // cfg.tp if cfg.sequence_parallel else cfg.model.seq_len
        self.runtime = PipelineRuntime(
            plan, self.rank, self.stages, self.p2p, self.mesh.grid.pipeline_ranks(self.rank),
            (cfg.microbatch_size, seq, cfg.model.n_embd), getattr(torch, cfg.dtype), self.device,
            on_gradients_ready=self.averager.start if self.averager else lambda stage: None)
        self.sampler = None
        if 0 in self.stages or last in self.stages:
            tokens = load_token_file(cfg.data) if cfg.data else builtin_tokens(get_tokenizer(cfg.tokenizer))
            self.sampler = BatchSampler(tokens, cfg.batch_size, cfg.model.seq_len, cfg.seed)
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
        copies = []
        for stage in self.stages.values():
            for local in stage.module.tied_parameter_names():
                copies.append(stage.module.get_parameter(local))
        return copies

    @actor_method
    def step(self, step: int) -> dict:
        if self.fault and self.fault[1] == step:
            _fail_now(self.fault[0], self.rank, step)
        t0 = time.perf_counter()
        cfg = self.cfg
        for _, p in self.named_params:
            p.grad = None
        inputs = targets = None
        if self.sampler is not None:
            x, y = self.sampler.batch(step)
            lo = self.mesh.dp_index * cfg.microbatches * cfg.microbatch_size
            x, y = x[lo:lo + cfg.microbatches * cfg.microbatch_size], y[lo:lo + cfg.microbatches * cfg.microbatch_size]
            inputs = list(self._to_device(x).split(cfg.microbatch_size))
            targets = list(self._to_device(y).split(cfg.microbatch_size))
        result = self.runtime.step(inputs, targets)
        if self.averager:
            self.averager.finish()
        for stage in self.stages.values():  # replicated weights saw only this rank's part of the sequence
            for p in sequence_parallel_grad_params(stage.module):
                dist.all_reduce(p.grad, group=self.mesh.group("tp"))
        for copy in self._tied_copies():
            dist.all_reduce(copy.grad, group=self.mesh.group("embedding"))
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step is done when its kernels are, not launched
        return {"rank": self.rank, "losses": result.losses, "events": result.events,
                "grad_norm": grad_norm, "compute_s": time.perf_counter() - t0, "peak_memory": self._peak_memory()}

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned, so the copy overlaps with the host's next steps
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch

    def _clip_gradients(self) -> float:
        """Global gradient norm over one model replica, each value counted once, then clip.

        Not counted here: the last stage's copy of a tied embedding (rank 0 counts it), and
        tensor-parallel replicated weights on tp ranks other than 0.
        """
        skip = {id(p) for p in self._tied_copies()} if 0 not in self.stages else set()
        if self.mesh.tp_index > 0:
            skip |= {id(p) for n, p in self.named_params if tp_shard_spec(n) == REPLICATED}
        grads = [p.grad for _, p in self.named_params if p.grad is not None and id(p) not in skip]
        local = torch.stack([g.double().pow(2).sum() for g in grads]).sum() if grads else \
            torch.zeros((), dtype=torch.float64, device=self.device)
        if self.mesh.group("model") is not None:
            dist.all_reduce(local, group=self.mesh.group("model"))
        norm = float(local.sqrt())
        if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
            scale = self.cfg.grad_clip / (norm + 1e-6)
            for _, p in self.named_params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

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


@dataclass
class StepMetrics:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    grad_norm: float
    peak_memory_per_rank: list[int]


def step_metrics(step: int, results: list[dict], cfg: TrainConfig, elapsed: float) -> StepMetrics:
    losses = [loss for r in results for loss in r["losses"]]
    tokens = cfg.batch_size * cfg.model.seq_len
    return StepMetrics(step, sum(losses) / len(losses) if losses else math.nan, elapsed, tokens / elapsed,
                       results[0]["grad_norm"], [r["peak_memory"] for r in results])


def new_run_dir(root: str = "runs") -> Path:
    path = Path(root) / time.strftime("%Y%m%d-%H%M%S")
    suffix, candidate = 1, path
    while candidate.exists():
        suffix += 1
        candidate = Path(f"{path}-{suffix}")
    candidate.mkdir(parents=True)
    return candidate


def train(cfg: TrainConfig, cluster, run_dir: Path,
          on_step: Callable[[StepMetrics, list[dict]], None] = lambda m, results: None,
          init_method: str = "") -> list[StepMetrics]:
    """Drive cfg.steps training steps on an already-started cluster; writes metrics.jsonl."""
    cluster.spawn(Worker, lambda r: (r, cfg, init_method))
    cluster.call("start")  # every worker built before step 0 starts its clock
    history = []
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    with open(run_dir / "metrics.jsonl", "a") as log:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            results = cluster.call("step", step)
            metrics = step_metrics(step, results, cfg, time.perf_counter() - t0)
            log.write(json.dumps(asdict(metrics)) + "\n")
            log.flush()
            history.append(metrics)
            on_step(metrics, results)
    cluster.call("shutdown")
    return history


def measured_timeline(results: list[dict], plan: Plan):
    """One step's recorded actions from every rank as the Timeline type the simulator produces."""
    from pipegpt.schedule.actions import Action
    from pipegpt.schedule.simulate import Event, Timeline

    t0 = min((start for r in results for _, start, _ in r["events"]), default=0.0)
    events = [Event(r["rank"], Action.parse(name), start - t0, end - t0)
              for r in results for name, start, end in r["events"]]
    return Timeline(events, len(results), schedule=plan.name, num_microbatches=plan.num_microbatches,
                    stage_to_rank=plan.stage_to_rank, time_unit="s")


def run_job(cfg: TrainConfig, run_dir: Path, port: int | None = None,
            on_step: Callable[[StepMetrics], None] = lambda m: None) -> list[StepMetrics] | None:
    """Start (or join, under torchrun) the workers, train, and write metrics and the last step's trace.

    Returns the step metrics on the driver, None on the other torchrun ranks.
    """
    from pipegpt.comm.rpc import LocalCluster, TorchrunCluster, free_port, port_is_free
    from pipegpt.schedule.render import to_chrome_trace

    plan = check(cfg)
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != cfg.world_size:
            raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes but dp x pp x tp = "
                              f"{cfg.dp} x {cfg.stages} x {cfg.tp} = {cfg.world_size}")
        cluster, init_method = TorchrunCluster(cfg.timeout_s), "env://"
        if not cluster.is_driver:
            cluster.close()  # serve the driver's requests until it shuts everyone down
            return None
    else:
        if port is not None and not port_is_free(port):
            raise ConfigError(f"port {port} is in use: choose a free port or leave --port out")
        threads = cfg.threads_per_worker or max(1, (os.cpu_count() or 1) // cfg.world_size)
        init_method = f"tcp://127.0.0.1:{port or free_port()}"
        cluster = LocalCluster(cfg.world_size, cfg.timeout_s, threads)
    last_results: list[dict] = []

    def record(metrics: StepMetrics, results: list[dict]) -> None:
        last_results[:] = results
        on_step(metrics)

    try:
        history = train(cfg, cluster, run_dir, record, init_method)
    except BaseException:
        cluster.kill()
        raise
    cluster.close()
    if last_results:
        trace = to_chrome_trace(measured_timeline(last_results, plan))
        (run_dir / "trace.json").write_text(json.dumps(trace))
    return history
