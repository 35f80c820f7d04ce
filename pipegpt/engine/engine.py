"""One rank's machinery, whatever role it serves: its device, its place in the mesh, the model stages a plan
gives it, point-to-point and the runtimes that walk the plan.

A role (training today: pipegpt.train.worker; inference next) owns an Engine and adds what it needs around it
(optimizer, loaders, gradient synchronisation). The Engine knows nothing of optimizers or checkpoints.
"""
from __future__ import annotations

import os
import resource

import torch

from pipegpt.comm.mesh import init_mesh
from pipegpt.comm.p2p import PointToPoint, resolve_matching
from pipegpt.config import TrainConfig
from pipegpt.engine.parallelize import Parallelized, parallelize
from pipegpt.engine.placement import cuda_device_index, resolve_device
from pipegpt.model.gpt import GPT
from pipegpt.model.partition import partition_layers
from pipegpt.parallelisms import stage_parallelism
from pipegpt.schedule import Plan, last_gradient_actions
from pipegpt.stages import Stage
from pipegpt.stages.runtime import PipelineRuntime, StepResult
from pipegpt.state import rng


class Engine:
    def __init__(self, rank: int, init_method: str):
        self.rank, self.init_method = rank, init_method
        self.device: torch.device | None = None
        self.mesh = None
        self.stages: dict[int, Stage] = {}
        self.parallelized: dict[int, Parallelized] = {}  # what parallelize did to each stage
        self.runtime = self.eval_runtime = None

    def start(self, cfg: TrainConfig) -> None:
        """Take this rank's device and join the process groups of cfg's grid."""
        rank = self.rank
        self.device = torch.device(resolve_device(cfg.runtime.device, cfg.world_size))
        if self.device.type == "cuda":
            self.device = torch.device("cuda", cuda_device_index(rank))
            torch.cuda.set_device(self.device)
            if cfg.runtime.precision == "fp32":  # as nanoGPT: fp32 matmuls on tensor cores (float64 is unaffected)
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        p = cfg.parallel
        # Every schedule puts the first stage on pipeline rank 0 and the last on rank 0 or pp-1,
        # so this group serves any plan a later build() brings.
        self.mesh = init_mesh(p.dims, rank, self.device, self.init_method,
                              cfg.runtime.wait_timeout_s, embedding_pp_indices=(0, p.stages - 1),
                              batch_loops=cfg.runtime.gloo_loops == "batch")

    def build(self, cfg: TrainConfig, plan: Plan, eval_plan: Plan | None, collectives=None) -> None:
        """This rank's model stages for the plan (whole from the per-name seeds, then cut to its tp shard), the
        runtimes that walk the plan and the forward-only evaluation plan, and its dropout streams."""
        self.plan = plan
        p, last = cfg.parallel, plan.num_stages - 1
        # Here, not in start(): a build() with another runtime.p2p_matching must get it (nothing is in flight now).
        matching = resolve_matching(cfg.runtime.p2p_matching, self.device.type)
        groups = cfg.runtime.p2p_groups
        on_pairs = groups == "pairs" or (groups == "auto" and self.device.type == "cuda")
        pairs = self.mesh.pair_groups() if matching == "order" and on_pairs else None  # every rank builds: collective
        self.p2p = PointToPoint(self.rank, cfg.runtime.wait_timeout_s, self.device.type, matching, pairs)
        ranges = partition_layers(cfg.model.n_layer, plan.num_stages, p.layers_per_stage)
        self.dtype = dtype = getattr(torch, cfg.runtime.dtype)
        self.stages, self.parallelized = {}, {}
        # Every stage's parallelisms, one description (pipegpt.parallelisms) applied by one step.
        self.parallelism = stage_parallelism(p.sharding, cfg.model.kv_heads, p.recompute, p.cp_comm,
                                             cfg.runtime.compile, cfg.model.qk_norm)
        for s in plan.stages_of(self.mesh.pp_index):
            module = GPT(cfg.model, layers=ranges[s], embed=s == 0, head=s == last,
                         recompute=p.recompute, init_seed=cfg.runtime.seed)
            self.parallelized[s] = done = parallelize(module, self.parallelism, self.mesh, device=self.device,
                                                      dtype=dtype, rank=self.rank,
                                                      timeout_s=cfg.runtime.wait_timeout_s)
            module = done.module
            self.stages[s] = Stage(s, plan.num_stages, module, plan.num_microbatches,
                                   torch.bfloat16 if cfg.runtime.precision == "bf16" else None)
        if self.stages.keys() >= {0, last} and last != 0 and cfg.model.tie_embeddings:
            # Both ends of a V live here: share one tensor, so the gradient sums by itself.
            self.stages[last].module.lm_head.weight = self.stages[0].module.wte.weight
        self.named_params = self._unique_named_params()
        # One-process names: the last stage's copy of a tied embedding is wte.weight.
        self.full_names = {id(p): stage.module.tied_parameter_names().get(local, local)
                           for stage in reversed(self.stages.values()) for local, p in stage.module.named_parameters()}
        self.sharding, self.width = p.sharding, cfg.model.n_embd  # what a message of another length takes
        seq = p.sharding.tokens_per_rank(cfg.model.seq_len)
        shape, pipeline = (p.microbatch_size, seq, cfg.model.n_embd), self.mesh.members["pp"]
        message_dtype = getattr(torch, cfg.runtime.message_dtype)
        self.runtime = PipelineRuntime(plan, self.rank, self.stages, self.p2p, pipeline, shape, dtype, self.device,
                                       collectives=collectives, message_dtype=message_dtype,
                                       group_members=self.mesh.members)
        self.eval_runtime = eval_plan and PipelineRuntime(eval_plan, self.rank, self.stages, self.p2p, pipeline,
                                                          shape, dtype, self.device, collectives=collectives,
                                                          message_dtype=message_dtype, group_members=self.mesh.members)
        # Dropout's streams: one per (pipeline rank, replica), shared by the tp ranks (pipegpt.state.rng).
        rng.seed_rank(cfg.runtime.seed, self.mesh.pp_index, self.mesh.dp_index, self.device)

    def _unique_named_params(self) -> list[tuple[str, torch.Tensor]]:
        seen, named = set(), []
        for stage in self.stages.values():
            for name, p in stage.module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    named.append((name, p))
        return named

    def params_by_stage(self) -> dict[int, list[torch.Tensor]]:
        """Each parameter under the stage whose gradients complete last among those using it
        (a tensor shared by two stages here, the V-shape's tied embedding, waits for both)."""
        done_at = last_gradient_actions(self.plan.ranks[self.mesh.pp_index])
        owner: dict[int, tuple[int, torch.Tensor]] = {}
        for s in sorted(self.stages, key=lambda s: done_at[s]):
            for p in self.stages[s].module.parameters():
                owner[id(p)] = (s, p)
        by_stage: dict[int, list[torch.Tensor]] = {s: [] for s in self.stages}
        for s, p in owner.values():
            by_stage[s].append(p)
        return by_stage

    def tied_copies(self) -> list[torch.Tensor]:
        """This rank's copy of the tied embedding, if the other copy lives on another rank."""
        if self.plan.stage_to_rank[0] == self.plan.stage_to_rank[-1]:
            return []  # both copies on one rank are one shared tensor (see build)
        return [stage.module.get_parameter(local) for stage in self.stages.values()
                for local in stage.module.tied_parameter_names()]

    def forward_only(self, inputs, targets, documents=None) -> list[float]:
        """The evaluation plan over one batch, without gradients: the last stage's losses per microbatch."""
        with torch.no_grad():
            losses = self.eval_runtime.step(inputs, targets, record=False, documents=documents).losses
            for stage in self.stages.values():
                stage.discard()
        return losses

    def score_rows(self, inputs, targets, activation_shape: tuple[int, ...]) -> list:
        """The evaluation plan over one batch of sequences of activation_shape's length, without gradients: on
        the last stage's ranks, per microbatch and sequence [sum of its targets' losses, targets counted]."""
        last = self.stages.get(self.eval_runtime.plan.num_stages - 1)
        if last is not None:
            last.per_row = True
        try:
            with torch.no_grad():
                return self.eval_runtime.step(inputs, targets, record=False, activation_shape=activation_shape).losses
        finally:
            if last is not None:
                last.per_row = False
            for stage in self.stages.values():
                stage.discard()

    def train_step(self, inputs, targets, record: bool, documents=None) -> StepResult:
        """The training plan over one batch; gradients accumulate in the stages' parameters."""
        return self.runtime.step(inputs, targets, record=record, documents=documents)

    def eval_mode(self, on: bool) -> None:
        for stage in self.stages.values():
            stage.module.train(not on)

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned, so the copy overlaps with the host's next steps
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch

    def synchronize(self) -> None:
        """On CUDA, until every kernel launched is done (a step is done when its kernels are, not launched)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def finishing(self) -> tuple[None, str, tuple[int, ...], str]:
        """Where a step is after its actions: in collectives with its model replica and dp peers."""
        members = self.mesh.members
        peers = tuple(sorted((set(members["model"]) | set(members["dp_cp"])) - {self.rank}))
        what = f"collectives with ranks {', '.join(map(str, peers))}" if peers else "nobody (computing)"
        return None, "finishing the step", peers, what

    def where(self) -> dict:
        """Which action this rank is on and which ranks it waits for (now: None between steps); answered on an
        RPC thread while a step runs on another, for the driver's stall watchdog."""
        now = device = None
        for runtime in (self.runtime, self.eval_runtime):
            if now is None and getattr(runtime, "now", None) is not None:
                # On CUDA the host may be far ahead (in settle() or a synchronize): where the GPU is says
                # whom this rank really waits for.
                now, device = runtime.now, runtime.device_now()
        return {"rank": self.rank, "pp_index": self.mesh.pp_index if self.mesh else None, "now": now,
                "device": device}

    def peak_memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def describe(self) -> dict:
        """What this rank holds and where it runs (a role adds its own state's bytes)."""
        return {"rank": self.rank, "stages": sorted(self.stages), "device": str(self.device),
                "device_name": self.device_name, "p2p_matching": self.p2p.matching,
                "p2p_groups": "pairs" if self.p2p.pairs else "world",
                "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "compiled": any(getattr(st.module, "_compiled_call_impl", None) is not None
                                for st in self.stages.values()),
                "parameters": sum(p.numel() for _, p in self.named_params),
                "parameter_bytes": sum(p.numel() * p.element_size() for _, p in self.named_params)}
