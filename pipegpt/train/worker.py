"""The actor on one rank: its model stages, optimizer, runtime, loader and device.

The driver calls its methods over RPC; the methods marked @actor_method are the control plane's
whole surface (start, build, step, measure_layer_costs, evaluate, save, load, where, profile_start/stop,
describe, shutdown, and for tests named_grads, named_parameters, named_optimizer_state). Activations never
pass through here: the runtime sends them worker to worker.
"""
from __future__ import annotations

import functools
import math
import os
import resource
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipegpt.comm.data_parallel import GradientAverager, sum_in_buckets
from pipegpt.comm.mesh import init_mesh
from pipegpt.comm.p2p import PointToPoint
from pipegpt.comm.rpc import on_actor_thread, reports_failures
from pipegpt.config import TrainConfig
from pipegpt.data.loader import RankLoader
from pipegpt.data.tokenizers import get_tokenizer
from pipegpt.data.tokens import builtin_tokens, open_tokens
from pipegpt.train.placement import cuda_device_index, resolve_device
from pipegpt.train import checkpoint, rng, snapshot
from pipegpt.train.clocks import clock_reading
from pipegpt.train.faults import (GPU_STUCK, IN_SAVE, NAN_GRAD, NAN_LOSS, NOT_FAILURES, STUCK, fail_now, get_gpu_stuck,
                                  get_stuck, planned_fault)
from pipegpt.model.gpt import GPT
from pipegpt.train.optim import clip_grads_, global_grad_norm, lr_at, make_optimizer, set_lr
from pipegpt.train.profile import Profiler
from pipegpt.train.results import SavedFile, WorkerStep
from pipegpt.runtime import PipelineRuntime, last_gradient_actions
from pipegpt.schedule import Plan
from pipegpt.stages import Stage, partition_layers
from pipegpt.tensor_parallel import REPLICATED, kv_replicas, shard_tensor, tp_shard_spec
from pipegpt.tensor_parallel.layers import (replicated_kv_params, sequence_parallel_grad_params, shard_for_tp,
                                            sum_replicated_kv_grads)


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


def _process_cpu_s() -> float:
    """CPU seconds of this whole process (every thread: compute, gloo, the RPC agent)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Worker:
    def __init__(self, rank: int, cfg: TrainConfig, init_method: str):
        # Nothing here can fail: the work is in start(), whose failure the driver hears about.
        self.rank, self.cfg, self.init_method = rank, cfg, init_method

    @actor_method
    def start(self, plan: Plan, eval_plan: Plan | None = None) -> dict:
        """Take this rank's device, join the process groups, then build for the plan."""
        cfg, rank = self.cfg, self.rank
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
                              cfg.runtime.wait_timeout_s,
                              embedding_pp_indices=(0, p.stages - 1))
        self.fault = planned_fault(rank)
        self._snapshot_writer: threading.Thread | None = None  # --snapshot-every's, writing the last copy
        self._build(cfg, plan, eval_plan)
        return self._describe()

    @actor_method
    def build(self, cfg: TrainConfig, plan: Plan, eval_plan: Plan | None = None) -> dict:
        """(Re)build model stages, optimizer, runtimes and loaders for cfg and the driver's plans (training;
        forward-only for evaluation), on the existing process groups (the grid must not change)."""
        self._build(cfg, plan, eval_plan)
        return self._describe()

    def _build(self, cfg: TrainConfig, plan: Plan, eval_plan: Plan | None) -> None:
        """build()'s work, shared with start() as a plain method: an actor method called from another would hand
        back its exception as a Failed value (reports_failures) instead of raising it."""
        self.cfg, self.plan = cfg, plan
        p, last = cfg.parallel, plan.num_stages - 1
        # Here, not in start(): a build() with another runtime.p2p_matching must get it (nothing is in flight now).
        self.p2p = PointToPoint(self.rank, cfg.runtime.wait_timeout_s, self.device.type, cfg.runtime.p2p_matching)
        # Steps whose per-action timestamps are recorded: --trace-steps and the last (trace.json); others skip it.
        self.recorded_steps = frozenset(cfg.runtime.traced_steps()) | {cfg.runtime.steps - 1}
        ranges = partition_layers(cfg.model.n_layer, plan.num_stages, p.layers_per_stage)
        dtype = getattr(torch, cfg.runtime.dtype)
        self.stages: dict[int, Stage] = {}
        for s in plan.stages_of(self.mesh.pp_index):
            module = GPT(cfg.model, layers=ranges[s], embed=s == 0, head=s == last,
                         recompute=p.recompute, init_seed=cfg.runtime.seed)
            if p.tp > 1:  # built whole from the per-name seeds, then cut to this rank's shard
                shard_for_tp(module, self.mesh.tp_index, p.tp, self.mesh.group("tp"), p.sequence_parallel)
            module = module.to(self.device, dtype)  # fp32 master weights under bf16 autocast too
            if cfg.runtime.compile:
                module.compile()  # in place: parameter names and the module's attributes stay as they are
            self.stages[s] = Stage(s, plan.num_stages, module, plan.num_microbatches,
                                   torch.bfloat16 if cfg.runtime.precision == "bf16" else None)
        if self.stages.keys() >= {0, last} and last != 0 and cfg.model.tie_embeddings:
            # Both ends of a V live here: share one tensor, so the gradient sums by itself.
            self.stages[last].module.lm_head.weight = self.stages[0].module.wte.weight
        self.named_params = self._unique_named_params()
        # One-process names: the last stage's copy of a tied embedding is wte.weight.
        self.full_names = {id(p): stage.module.tied_parameter_names().get(local, local)
                           for stage in reversed(self.stages.values()) for local, p in stage.module.named_parameters()}
        dp_group = self.mesh.group("dp")
        self.optimizer = make_optimizer(self.named_params, cfg.optim, dp_group if p.zero else None)
        self.averager = None
        if dp_group is not None:
            self.averager = GradientAverager(self._params_by_stage(plan), dp_group, self.rank,
                                             cfg.runtime.wait_timeout_s)
        seq = p.sharding.tokens_per_rank(cfg.model.seq_len)
        shape, pipeline = (p.microbatch_size, seq, cfg.model.n_embd), self.mesh.members["pp"]
        message_dtype = getattr(torch, cfg.runtime.message_dtype)
        self.runtime = PipelineRuntime(
            plan, self.rank, self.stages, self.p2p, pipeline, shape, dtype, self.device,
            on_gradients_ready=self.averager.start if self.averager else lambda stage: None,
            message_dtype=message_dtype)
        self.eval_runtime = eval_plan and PipelineRuntime(eval_plan, self.rank, self.stages, self.p2p, pipeline,
                                                          shape, dtype, self.device, message_dtype=message_dtype)
        self.loader = self.val_loader = None
        if 0 in self.stages or last in self.stages:
            train, val = self._tokens()
            loader = lambda tokens, seed: RankLoader(  # noqa: E731
                tokens, cfg.model.seq_len, plan.num_microbatches, p.microbatch_size, p.dp, self.mesh.dp_index, seed,
                inputs=0 in self.stages, targets=last in self.stages)
            self.loader = loader(train, cfg.runtime.seed)
            # Without a validation split (the built-in corpus, one flat file), validation windows come from
            # the training tokens under another seed: a check of the mechanics, not a held-out loss.
            self.val_loader = loader(train, cfg.runtime.seed + 1) if val is None else loader(val, cfg.runtime.seed)
        # Dropout's streams: one per (pipeline rank, replica), shared by the tp ranks (pipegpt.train.rng).
        rng.seed_rank(cfg.runtime.seed, self.mesh.pp_index, self.mesh.dp_index, self.device)

    def _tokens(self):
        """(train, val or None) token arrays."""
        data = self.cfg.data
        if data.data is None:
            return builtin_tokens(get_tokenizer(data.tokenizer)), None
        return open_tokens(data.data, "train"), open_tokens(data.data, "val")

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
    def step(self, step: int) -> WorkerStep:
        """One training step: loader -> runtime -> finish gradients -> clip -> optimizer. A non-finite loss or
        gradient norm drops the update on every rank (the driver then stops the run, or counts the skip)."""
        number = step + 1  # a fault names its step from 1, as the console and metrics.jsonl do
        if self.fault and self.fault[0] not in NOT_FAILURES and self.fault[1] == number:
            fail_now(*self.fault)
        if self.fault == (STUCK, number):
            get_stuck(self.stages.values())
        if self.fault == (GPU_STUCK, number):
            get_gpu_stuck(self.runtime, self.p2p)
        t0, cpu0 = time.perf_counter(), _process_cpu_s()
        for _, p in self.named_params:
            p.grad = None
        inputs, targets = self._batch(self.loader, step)
        result = self.runtime.step(inputs, targets, record=step in self.recorded_steps)
        self.runtime.now = self._finishing()  # for where(): gradient all-reduces, clipping, optimizer
        self._finish_gradients()
        if self.fault == (NAN_LOSS, number) and result.losses:
            result.losses[0] = math.nan
        if self.fault == (NAN_GRAD, number):
            next(p for _, p in self.named_params if p.grad is not None).grad.view(-1)[0] = math.nan
        grad_norm, finite, nonfinite_stages = self._clip_gradients(
            loss_finite=all(math.isfinite(loss) for loss in result.losses))
        lr = lr_at(step, self.cfg.optim, self.cfg.runtime.steps)
        if finite:
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step is done when its kernels are, not launched
        self.runtime.now = None
        return WorkerStep(rank=self.rank, losses=result.losses, grad_norm=grad_norm, lr=lr,
                          peak_memory=self._peak_memory(), device_name=self.device_name, events=result.events,
                          compute_s=time.perf_counter() - t0, cpu_s=_process_cpu_s() - cpu0, applied=finite,
                          nonfinite_stages=nonfinite_stages)

    @actor_method
    def evaluate(self, batches: int) -> dict:
        """Mean loss of the forward-only plan over the first `batches` validation batches (the same each time)."""
        losses = []
        for stage in self.stages.values():
            stage.module.eval()
        try:
            with torch.no_grad():
                for k in range(batches):
                    losses += self.eval_runtime.step(*self._batch(self.val_loader, k), record=False).losses
                    for stage in self.stages.values():
                        stage.discard()
        finally:
            for stage in self.stages.values():
                stage.module.train()
        return {"rank": self.rank, "losses": losses}

    def _finishing(self) -> tuple[None, str, tuple[int, ...], str]:
        """Where a step is after its actions: in collectives with its model replica and dp peers."""
        members = self.mesh.members
        peers = tuple(sorted(set(members["model"]) | set(members["dp"]) - {self.rank}))
        what = f"collectives with ranks {', '.join(map(str, peers))}" if peers else "nobody (computing)"
        return None, "finishing the step", peers, what

    @actor_method(concurrent=True)
    def clock(self) -> tuple[str, float]:
        """This process's clock domain and perf_counter: the driver aligns ranks' traces by them."""
        return clock_reading()

    @actor_method(concurrent=True)
    def where(self) -> dict:
        """Which action this rank is on and which ranks it waits for (now: None between steps); answered
        on an RPC thread while step() runs on another, for the driver's stall watchdog."""
        now = device = None
        for runtime in (getattr(self, "runtime", None), getattr(self, "eval_runtime", None)):
            if now is None and getattr(runtime, "now", None) is not None:
                # On CUDA the host may be far ahead (in settle() or a synchronize): where the GPU is says
                # whom this rank really waits for.
                now, device = runtime.now, runtime.device_now()
        mesh = getattr(self, "mesh", None)
        return {"rank": self.rank, "pp_index": mesh.pp_index if mesh else None, "now": now, "device": device}

    def _batch(self, loader: RankLoader | None, step: int):
        if loader is None:
            return None, None
        loader.step = step + 1
        inputs, targets = loader.batch(step)
        return ([self._to_device(x) for x in inputs] if inputs else None,
                [self._to_device(y) for y in targets] if targets else None)

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned, so the copy overlaps with the host's next steps
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch

    def _finish_gradients(self) -> None:
        """Sum what other ranks contributed: data-parallel replicas (started during the step), the
        sequence-parallel partial gradients, a key/value head's other copies (tp > n_kv_head), the tied
        embedding's other copy."""
        if self.averager:
            self.averager.finish()
        # Replicated weights saw only this rank's part of the sequence: summed over tp, in buckets.
        partial = [p.grad for stage in self.stages.values() for p in sequence_parallel_grad_params(stage.module)]
        if partial:
            sum_in_buckets(partial, self.mesh.group("tp"))
        # A kv head shared by tp/n_kv_head ranks got from each only its q heads' part: summed over them.
        shared = [p for stage in self.stages.values() for p in replicated_kv_params(stage.module)]
        if shared:
            sum_replicated_kv_grads(shared, self.mesh.group("tp"), self.cfg.model.kv_heads, self.mesh.tp_index,
                                    self.cfg.parallel.tp)
        for copy in self._tied_copies():
            dist.all_reduce(copy.grad, group=self.mesh.group("embedding"))

    def _clip_gradients(self, loss_finite: bool) -> tuple[float, bool, list[int]]:
        """Clip by the global norm over one model replica, each value counted once: not the last stage's
        copy of a tied embedding (rank 0 counts it), nor replicated weights on tp ranks other than 0, nor a
        shared key/value head's copies but the first of its group.

        Returns (the norm, whether the update may be applied, this rank's stages whose gradients were not
        finite). The update may be applied when the norm and every rank's loss are finite: the same answer
        on every rank, since the losses' flags travel with the norm's all-reduce; replicas agree on the
        norm (their gradients were averaged) but not on their losses, hence one more all-reduce with dp."""
        skip = {id(p) for p in self._tied_copies()} if 0 not in self.stages else set()
        if self.mesh.tp_index > 0:
            skip |= {id(p) for n, p in self.named_params if tp_shard_spec(n) == REPLICATED}
        if self.mesh.tp_index % kv_replicas(self.cfg.model.kv_heads, self.cfg.parallel.tp):
            skip |= {id(p) for stage in self.stages.values() for p in replicated_kv_params(stage.module)}
        params = [p for _, p in self.named_params]
        counted = [p for p in params if id(p) not in skip]
        norm, bad_loss, mine_finite = global_grad_norm(counted, self.mesh.group("model"), self.device,
                                                       flagged=not loss_finite)
        finite = math.isfinite(norm) and not bad_loss
        if self.cfg.parallel.dp > 1:
            flag = torch.tensor(0.0 if finite else 1.0, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mesh.group("dp"))
            finite = flag.item() == 0.0
        if finite:
            clip_grads_(params, norm, self.cfg.optim.grad_clip)
        return norm, finite, [] if mine_finite else self._nonfinite_stages(counted)

    def _nonfinite_stages(self, counted: list[torch.Tensor]) -> list[int]:
        """This rank's stages with a counted gradient that is not finite."""
        ids = {id(p) for p in counted}
        return [s for s in sorted(self.stages) if any(
            id(p) in ids and p.grad is not None and not bool(torch.isfinite(p.grad).all())
            for p in self.stages[s].module.parameters())]

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    @property
    def _local_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose state this rank holds: under ZeRO, ZeroRedundancyOptimizer keeps this replica's
        shard in an inner one."""
        return getattr(self.optimizer, "optim", self.optimizer)

    def _owned(self, p: torch.Tensor) -> bool:
        """Whether this rank stores p: tp-replicated tensors on tp rank 0 only, the tied embedding
        on the rank holding stage 0 only."""
        if self.mesh.tp_index > 0 and tp_shard_spec(self.full_names[id(p)]) == REPLICATED:
            return False
        return 0 in self.stages or all(p is not copy for copy in self._tied_copies())

    @actor_method
    def save(self, directory: str, step: int) -> SavedFile:
        """Write what this rank owns of the checkpoint after `step` steps into `directory`; nothing when some
        value this rank holds is not finite (a checkpoint is never written from such a state)."""
        bad = self._first_nonfinite()
        if bad is not None:
            return SavedFile(self.rank, nonfinite=bad)
        tensors, shards = self._checkpoint_tensors()
        if self.fault == (IN_SAVE, step):  # rehearse a kill mid-save: half a file, then SIGKILL
            checkpoint.write_rank_file(directory, self.rank, dict(list(tensors.items())[:len(tensors) // 2]), {})
            fail_now(IN_SAVE, step)
        name, sha256 = checkpoint.write_rank_file(directory, self.rank, tensors, shards)
        return SavedFile(self.rank, name, sha256)

    def _checkpoint_tensors(self) -> tuple[dict, dict]:
        """What this rank owns of a checkpoint (RNG streams, parameters, Adam moments) and each tensor's tp shard."""
        optimizer = self._local_optimizer
        shard = [self.mesh.tp_index, self.cfg.parallel.tp]
        tensors = rng.rng_state(self.rank, self.device)
        if self.mesh.dp_index == 0:
            tensors.update({f"param/{self.full_names[id(p)]}": p for _, p in self.named_params if self._owned(p)})
        if self.mesh.dp_index == 0 or self.cfg.parallel.zero:
            for p, state in optimizer.state.items():
                if self._owned(p):
                    tensors.update({f"{k}/{self.full_names[id(p)]}": state[k] for k in ("exp_avg", "exp_avg_sq")})
        whole = lambda key: rng.is_rng_key(key) or tp_shard_spec(key.split("/", 1)[1]) == REPLICATED  # noqa: E731
        return tensors, {key: [0, 1] if whole(key) else shard for key in tensors}

    @actor_method
    def snapshot(self, directory: str) -> float:
        """--snapshot-every: copy this rank's checkpoint state now (the next step changes it) and write the copy
        into `directory` in the background, its checksum last (pipegpt.train.snapshot). Returns the seconds the
        copy held the rank up. One snapshot is written at a time: the previous one is waited for first."""
        t0 = time.perf_counter()
        if self._snapshot_writer is not None:
            self._snapshot_writer.join()
        tensors, shards = self._checkpoint_tensors()
        copies = {key: t.detach().to("cpu", copy=True) for key, t in tensors.items()}

        def write():
            name, sha256 = checkpoint.write_rank_file(directory, self.rank, copies, shards)
            snapshot.write_checksum(Path(directory), name, sha256)

        self._snapshot_writer = threading.Thread(target=write, name="pipegpt-snapshot", daemon=True)
        self._snapshot_writer.start()
        return time.perf_counter() - t0

    def _first_nonfinite(self) -> tuple[int, str] | None:
        """(stage, "param/<name>" or "exp_avg/<name>", ...) of the first parameter or Adam moment of this rank
        with a value that is not finite, or None (one check per tensor, read back at once)."""
        state, found = self._local_optimizer.state, []
        for s in sorted(self.stages):
            for p in self.stages[s].module.parameters():
                moments = [(k, state[p][k]) for k in ("exp_avg", "exp_avg_sq") if k in state.get(p, {})]
                found += [(s, f"{k}/{self.full_names[id(p)]}", t) for k, t in [("param", p), *moments]]
        if not found:
            return None
        finite = torch.stack([torch.isfinite(t).all() for _, _, t in found]).tolist()
        return next(((s, key) for (s, key, _), ok in zip(found, finite) if not ok), None)

    @actor_method
    def load(self, path: str, weights_only: bool = False) -> int:
        """Load a checkpoint written under any layout; returns the step it was taken after."""
        # The driver verified every file's checksum before any worker started (driver.start_from).
        reader, manifest = checkpoint.CheckpointReader(path, verify=False), checkpoint.read_manifest(path, verify=False)
        step = manifest["step"]
        tp_rank, tp = self.mesh.tp_index, self.cfg.parallel.tp

        def mine(key: str, p: torch.Tensor) -> torch.Tensor:
            name = self.full_names[id(p)]
            full = reader.full(f"{key}/{name}", name)
            return shard_tensor(name, full, tp_rank, tp, self.cfg.model.kv_heads).to(p.device, p.dtype)

        with torch.no_grad():
            for _, p in self.named_params:
                p.copy_(mine("param", p))
        if weights_only:
            return 0
        optimizer = self._local_optimizer
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p] = {"step": torch.tensor(float(step)),
                                      "exp_avg": mine("exp_avg", p), "exp_avg_sq": mine("exp_avg_sq", p)}
        if manifest["world_size"] == self.cfg.world_size:
            keys = [key for key in (f"rng/{self.rank}", f"cuda_rng/{self.rank}") if reader.has(key)]
            rng.restore_rng({key: reader.full(key, "") for key in keys}, self.rank, self.device)
        if self.loader is not None:
            self.loader.load_state_dict({"step": step})
        return step

    @actor_method
    def model_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by one-process name (its tensor-parallel shards), on the CPU."""
        return {self.full_names[id(p)]: p.detach().cpu().clone() for _, p in self.named_params}

    @actor_method
    def named_optimizer_state(self) -> dict[str, torch.Tensor]:
        """{"exp_avg/<name>": moment, ...} of this rank's parameters, by one-process name (for tests)."""
        return {f"{k}/{self.full_names[id(p)]}": state[k].detach().cpu().clone()
                for p, state in self._local_optimizer.state.items() for k in ("exp_avg", "exp_avg_sq")}

    @actor_method
    def describe(self) -> dict:
        return self._describe()

    def _describe(self) -> dict:
        """describe()'s answer, for start() and build() too (a plain method, as _build)."""
        state_bytes = sum(t.numel() * t.element_size() for state in self._local_optimizer.state.values()
                          for t in state.values() if torch.is_tensor(t))
        return {"rank": self.rank, "stages": sorted(self.stages), "device": str(self.device),
                "device_name": self.device_name, "p2p_matching": self.p2p.matching,
                "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "compiled": any(getattr(st.module, "_compiled_call_impl", None) is not None
                                for st in self.stages.values()),
                "parameters": sum(p.numel() for _, p in self.named_params),
                "parameter_bytes": sum(p.numel() * p.element_size() for _, p in self.named_params),
                "optimizer_state_bytes": state_bytes}

    @actor_method
    def measure_layer_costs(self) -> dict[str, float]:
        """Least seconds (of 15) of forward + backward of the embedding, one block, and the head with the loss, each on
        one microbatch of the run's shape on this rank's device (for --balance cost; pipegpt.stages.measure)."""
        from pipegpt.stages.measure import measure_layer_costs

        cfg = self.cfg
        return measure_layer_costs(cfg.model, cfg.parallel.microbatch_size, self.device,
                                   getattr(torch, cfg.runtime.dtype), cfg.parallel.recompute,
                                   torch.bfloat16 if cfg.runtime.precision == "bf16" else None,
                                   seed=cfg.runtime.seed)

    @actor_method
    def profile_start(self, directory: str) -> str | None:
        """Start py-spy on this process (pipegpt.train.profile); None once it samples, else why not (one line)."""
        self.profiler = Profiler(directory, self.rank)
        return self.profiler.start()

    @actor_method
    def profile_stop(self) -> tuple[list[str], str | None]:
        """Stop py-spy: (the profiles it wrote, None or why not)."""
        profiler, self.profiler = getattr(self, "profiler", None), None
        return profiler.stop() if profiler is not None else ([], None)

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
