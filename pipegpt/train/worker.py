"""The training role on one rank: the rank's engine (device, mesh, stages, point-to-point, runtime) plus what a
training step adds: the optimizer, the data loaders, one gradient sync per parallelism, checkpoints.

The driver calls its methods over RPC; the methods marked @actor_method are the control plane's
whole surface (start, build, step, steps, measure_layer_costs, evaluate, hellaswag, save, load, where,
profile_start/stop, describe, shutdown, and for tests named_grads, named_parameters, named_optimizer_state).
Activations never pass through here: the runtime sends them worker to worker.
"""
from __future__ import annotations

import contextlib
import math
import resource
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipegpt.config import TrainConfig
from pipegpt.data.hellaswag import score_on_engine
from pipegpt.data.loader import RankLoader
from pipegpt.data.tokenizers import get_tokenizer
from pipegpt.data.tokens import builtin_tokens, open_tokens
from pipegpt.engine.actor import Role, actor_method
from pipegpt.engine.placement import name_process
from pipegpt.engine.results import SavedFile, WorkerStep
from pipegpt.model.gpt import Documents
from pipegpt.model.moe import counted_once, end_step as end_moe_step, merge_stats
from pipegpt.observe.clocks import clock_reading
from pipegpt.observe.exchanges import recording_exchanges, resolved
from pipegpt.observe.profile import Profiler
from pipegpt.observe.step_time import StepPhases
from pipegpt.observe.tensor_bytes import PeakTensorBytes, predicted_peak
from pipegpt.resilience.faults import FaultHook
from pipegpt.stages.runtime import OPTIMIZER_STEP
from pipegpt.schedule import Plan
from pipegpt.state import checkpoint, rng, snapshot
from pipegpt.train import zero_state
from pipegpt.train.grad_sync import (PlanCollectives, data_parallel_of, make_syncs, norm_over_world, not_counted,
                                     not_owned)
from pipegpt.train.optim import (clip_grads_, decays, global_grad_norm, lr_at, make_optimizer, moments_overflow_at,
                                  set_lr, step_tensor)

__all__ = ["Worker", "actor_method", "first_nonfinite"]


def _process_cpu_s() -> float:
    """CPU seconds of this whole process (every thread: compute, gloo, the RPC agent)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Worker(Role):
    @actor_method
    def start(self, plan: Plan, eval_plan: Plan | None = None) -> dict:
        """Take this rank's device, join the process groups, then build for the plan."""
        self.engine.start(self.cfg)
        self.fault = FaultHook.planned(self.rank)
        self._snapshot_writer: threading.Thread | None = None  # --snapshot-every's, writing the last copy
        self._build(self.cfg, plan, eval_plan)
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
        self.cfg, self.plan, engine = cfg, plan, self.engine
        p, last = cfg.parallel, plan.num_stages - 1
        # Steps whose per-action timestamps are recorded: --trace-steps and the last (trace.json); others skip it.
        self.recorded_steps = frozenset(cfg.runtime.traced_steps()) | {cfg.runtime.steps - 1}
        collectives = PlanCollectives()  # runs the plan's REDUCE_GRADs with the syncs made once the stages exist
        engine.build(cfg, plan, eval_plan, collectives=collectives)
        self.syncs = collectives.syncs = make_syncs(engine, cfg)
        # what other ranks count in the norm and store in a checkpoint: fixed until the next build
        self.uncounted, self.elsewhere = not_counted(self.syncs), not_owned(self.syncs)
        self.stages, self.named_params, self.full_names = engine.stages, engine.named_params, engine.full_names
        self.moments_limit = moments_overflow_at(engine.dtype)
        self.dp = data_parallel_of(self.syncs)
        # What the optimizer steps: (name, tensor, its parameter): the parameters, or under ZeRO the pieces of
        # this rank's shard (pipegpt.data_parallel), whose .grad holds the averaged gradient.
        self.sharded = self.dp is not None and self.dp.zero > 0
        self.pieces = self.dp.pieces() if self.sharded else []
        self.trained = ([(self.full_names[id(h.param)], h.value, h.param) for h in self.pieces] if self.sharded
                        else [(n, q, q) for n, q in self.named_params])
        self.optimizer = make_optimizer([(n, t) for n, t, _ in self.trained], cfg.optim, decaying={
            id(h.value) for h in self.pieces if decays(h)} if self.sharded else None)
        # The gradient norm sums each value once: over one model replica, or over every rank when the
        # replicas hold shards of it.
        self.norm_group = (dist.group.WORLD if self.sharded or norm_over_world(self.syncs)
                           else engine.mesh.group("model"))
        self.loader = self.val_loader = None
        # --document-mask: every stage's attention needs the documents' boundaries, so every rank reads the batch
        end_of_text = get_tokenizer(cfg.data.tokenizer).eot_token if cfg.data.document_mask else None
        if 0 in self.stages or last in self.stages or end_of_text is not None:
            train, val = self._tokens()
            loader = lambda tokens, seed: RankLoader(  # noqa: E731
                tokens, cfg.model.seq_len, plan.num_microbatches, p.microbatch_size, p.dp, engine.mesh.dp_index,
                seed, inputs=0 in self.stages, targets=last in self.stages, vocab_size=cfg.model.vocab_size,
                cp=p.cp, cp_index=engine.mesh.cp_index, end_of_text=end_of_text)
            self.loader = loader(train, cfg.runtime.seed)
            # Without a validation split (the built-in corpus, one flat file), validation windows come from
            # the training tokens under another seed: a check of the mechanics, not a held-out loss.
            self.val_loader = loader(train, cfg.runtime.seed + 1) if val is None else loader(val, cfg.runtime.seed)
        # On recorded steps, the peak of tensor bytes by kind, beside the planner's (None: it cannot model the plan).
        # Under --compile autograd's saved tensors are not hooked (Dynamo may recompile for hooks): seams only.
        self.tensor_bytes = PeakTensorBytes(self._held_tensors, engine.stages, engine.device,
                                            hook_saved=not cfg.runtime.compile)
        try:
            self.predicted_peak = predicted_peak(cfg, plan, engine.mesh.pp_index, engine.device.type)
        except Exception:  # a plan or model the memory model does not cover: measured only
            self.predicted_peak = None
        self.fault.on_build(engine)
        name_process(f"pipegpt: rank {self.rank} stage{'s' * (len(self.stages) > 1)} "
                     f"{','.join(map(str, sorted(self.stages)))}")

    def _tokens(self):
        """(train, val or None) token arrays."""
        data = self.cfg.data
        if data.data is None:
            return builtin_tokens(get_tokenizer(data.tokenizer)), None
        return open_tokens(data.data, "train"), open_tokens(data.data, "val")

    @actor_method
    def step(self, step: int) -> WorkerStep:
        """One training step: loader -> runtime -> finish gradients -> clip -> optimizer. A non-finite loss or
        gradient norm drops the update on every rank (the driver then stops the run, or counts the skip)."""
        return self._step(step)

    @actor_method
    def steps(self, first: int, count: int, stop_on_nonfinite: bool) -> list[WorkerStep]:
        """Steps first .. first + count - 1 in one call (--steps-per-call): one RPC round trip for them all.
        With stop_on_nonfinite the call ends after a step whose update was dropped, on every rank alike (they
        decide from the same all-reduced values), so the driver stops the run there as after step()."""
        answers = []
        for step in range(first, first + count):
            answers.append(self._step(step))
            if stop_on_nonfinite and not answers[-1].applied:
                break
        return answers

    def _step(self, step: int) -> WorkerStep:
        self.running_step = step  # where() says which step of a call of several is stuck
        number, engine = step + 1, self.engine  # a fault names its step from 1, as the console and metrics do
        self.fault.at_step_start(number, engine)
        t0, cpu0 = time.perf_counter(), _process_cpu_s()
        if self.dp is not None:
            self.dp.zero_grad()  # the flat gradient buffers (their views are the .grad autograd adds to)
        else:
            for _, p in self.named_params:
                p.grad = None
        inputs, targets, documents = self._batch(self.loader, step)
        record = step in self.recorded_steps
        phases = StepPhases(t0)  # the step's parts outside its actions, for the trace (pipegpt.observe.step_time)
        runtime = engine.runtime
        peak = self.tensor_bytes.measure(runtime) if record else contextlib.nullcontext()
        with peak, recording_exchanges(engine.runtime.clock, on=record and self.cfg.parallel.ep > 1) as exchanges:
            phases.mark("before the actions")
            result = engine.train_step(inputs, targets, record=record, documents=documents)
            phases.mark("actions")
        runtime.now = engine.finishing()  # for where(): gradient all-reduces, clipping
        for sync in self.syncs:
            sync.reduce()
        phases.mark("gradient sync")
        self.fault.after_gradients(number, result.losses, [(n, t) for n, t, _ in self.trained])
        grad_norm, finite, nonfinite_stages = self._clip_gradients(
            loss_finite=all(math.isfinite(loss) for loss in result.losses))
        runtime.launched(runtime.now)
        phases.mark("clip")
        lr = lr_at(step, self.cfg.optim, self.cfg.runtime.steps)
        if finite:
            runtime.now = OPTIMIZER_STEP  # a GPU hung in the update is named so, not "finishing the step"
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            if self.dp is not None:
                self.dp.after_update()
            runtime.launched(OPTIMIZER_STEP)
        if record:  # the update's kernels inside its part (the step ends synchronized anyway)
            engine.synchronize()
        phases.mark("optimizer")
        moe = self._end_moe_step(finite)
        engine.synchronize()
        engine.runtime.now = None
        phases.mark("end of the step")
        tensor_bytes = None
        if record:  # after the phases' end: the count is no part of the step's time
            self.tensor_bytes.sample()  # the moments exist from the first update on
            tensor_bytes = {**self.tensor_bytes.result(), "predicted": self.predicted_peak}
        return WorkerStep(rank=self.rank, losses=result.losses, grad_norm=grad_norm, lr=lr,
                          peak_memory=engine.peak_memory(), device_name=engine.device_name, events=result.events,
                          compute_s=time.perf_counter() - t0, cpu_s=_process_cpu_s() - cpu0, applied=finite,
                          nonfinite_stages=nonfinite_stages, moe=moe,
                          exchanges=resolved(exchanges, engine.runtime.clock),
                          phases=phases.spans if record else [], tensor_bytes=tensor_bytes)

    def _held_tensors(self) -> dict:
        """The rank's state by kind (pipegpt.observe.tensor_bytes): the flat buffers, or each parameter and its
        .grad without data parallelism; the optimizer's moments."""
        held = self.dp.held_tensors() if self.dp is not None else {
            "parameters": [p for _, p in self.named_params],
            "gradients": [p.grad for _, p in self.named_params if p.grad is not None]}
        return {**held, "optimizer": [t for state in self.optimizer.state.values() for k, t in state.items()
                                      if k != "step" and torch.is_tensor(t)]}  # the step: a scalar per tensor

    def _end_moe_step(self, applied: bool) -> dict:
        """The MoE layers' loads of the step, summed over the replicas that saw other tokens, move their
        router bias (DeepSeek-V3's, after an applied update only) and are forgotten (pipegpt.model.moe)."""
        if not self.cfg.model.n_experts:
            return merge_stats([])
        rate = self.cfg.model.router_bias_update_rate if applied else 0.0
        groups = [g for g in map(self.engine.mesh.group, self.engine.parallelism.load_groups) if g is not None]
        reduce = (lambda t: [dist.all_reduce(t, group=g) for g in groups]) if groups else None
        stats = merge_stats([end_moe_step(stage.module, rate, reduce) for _, stage in sorted(self.stages.items())])
        first = self.engine.mesh.tp_index == 0  # tp ranks share the aux loss, and without SP their tokens
        return counted_once(stats, first, first or self.engine.parallelism.splits_sequence)

    @actor_method
    def evaluate(self, batches: int) -> dict:
        """Mean loss of the forward-only plan over the first `batches` validation batches (the same each time)."""
        losses = []
        self.engine.eval_mode(True)
        try:
            for k in range(batches):
                inputs, targets, documents = self._batch(self.val_loader, k)
                losses += self.engine.forward_only(inputs, targets, documents)
        finally:
            self.engine.eval_mode(False)
        return {"rank": self.rank, "losses": losses}

    @actor_method
    def hellaswag(self, rendered: list) -> list | None:
        """This rank's part of HellaSwag on the current model (pipegpt.data.hellaswag.score_on_engine): the last
        stage's per-candidate loss sums, None elsewhere."""
        self.engine.eval_mode(True)
        try:
            return score_on_engine(self.engine, rendered)
        finally:
            self.engine.eval_mode(False)

    @actor_method(concurrent=True)
    def clock(self) -> tuple[str, float]:
        """This process's clock domain and perf_counter: the driver aligns ranks' traces by them."""
        return clock_reading()

    def _batch(self, loader: RankLoader | None, step: int):
        """(inputs, targets, documents) of a step on this rank's device, each a list of microbatches or None."""
        if loader is None:
            return None, None, None
        loader.step = step + 1
        parts = loader.parts(step)
        to_device = self.engine.to_device
        inputs, targets, starts = ([to_device(t) for t in ts] if ts else None for ts in parts)
        reset = self.cfg.data.position_reset
        return inputs, targets, None if starts is None else [Documents(s, reset) for s in starts]

    def _clip_gradients(self, loss_finite: bool) -> tuple[float, bool, list[int]]:
        """Clip by the global norm over one model replica, each value counted once (every sync says which of
        this rank's values another rank counts: the last stage's copy of a tied embedding, replicated weights
        on tp ranks other than 0, a shared key/value head's copies but the first of its group).

        Returns (the norm, whether the update may be applied, this rank's stages whose gradients were not
        finite). The update may be applied when the norm and every rank's loss are finite: the same answer
        on every rank, since the losses' flags travel with the norm's all-reduce; replicas agree on the
        norm (their gradients were averaged) but not on their losses, hence one more all-reduce with dp."""
        mesh, skip = self.engine.mesh, self.uncounted
        params = [t for _, t, _ in self.trained]
        counted = [t for _, t, q in self.trained if id(q) not in skip]
        norm, bad_loss, mine_finite = global_grad_norm(counted, self.norm_group, self.device,
                                                       flagged=not loss_finite)
        # A norm whose squares overflow the moments' dtype poisons Adam's state: not applied either.
        finite = norm < self.moments_limit and not bad_loss
        if mesh.group("dp_cp") is not None:  # replicas and cp ranks differ in their losses
            flag = torch.tensor(0.0 if finite else 1.0, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.group("dp_cp"))
            finite = flag.item() == 0.0
        if finite:
            clip_grads_(params, norm, self.cfg.optim.grad_clip)
        return norm, finite, [] if mine_finite else self._nonfinite_stages(counted)

    def _nonfinite_stages(self, counted: list[torch.Tensor]) -> list[int]:
        """This rank's stages with a counted gradient that is not finite."""
        ids = {id(t) for t in counted}
        bad = {id(q) for _, t, q in self.trained if id(t) in ids and t.grad is not None
               and not bool(torch.isfinite(t.grad).all())}
        return [s for s in sorted(self.stages) if any(id(p) in bad for p in self.stages[s].module.parameters())]

    @actor_method
    def save(self, directory: str, step: int) -> SavedFile:
        """Write what this rank owns of the checkpoint after `step` steps into `directory`; nothing when some
        value this rank holds is not finite (a checkpoint is never written from such a state)."""
        bad = (zero_state.first_nonfinite(self) if self.sharded
               else first_nonfinite(self.stages, self.full_names, self.optimizer.state))
        if bad is not None:
            return SavedFile(self.rank, nonfinite=bad)
        tensors, shards = self._checkpoint_tensors()
        self.fault.in_save(step, lambda: checkpoint.write_rank_file(  # a rehearsed kill mid-save: half a file
            directory, self.rank, dict(list(tensors.items())[:len(tensors) // 2]), {}))
        name, sha256 = checkpoint.write_rank_file(directory, self.rank, tensors, shards)
        return SavedFile(self.rank, name, sha256)

    def _checkpoint_tensors(self) -> tuple[dict, dict]:
        """What this rank owns of a checkpoint (RNG streams, parameters, Adam moments) and each tensor's tp shard."""
        tensors, shards = zero_state.checkpoint_tensors(self) if self.sharded else self._owned_tensors()
        mesh = self.engine.mesh
        if mesh.dp_index == 0 and mesh.cp_index == 0 and mesh.tp_index == 0:  # the MoE router biases: state
            biases = {f"param/{n}": b for n, b in self._router_biases().items()}
            tensors.update(biases)
            shards.update({key: [0, 1] for key in biases})
        return tensors, shards

    def _router_biases(self) -> dict[str, torch.Tensor]:
        return {n: b for _, stage in sorted(self.stages.items())
                for n, b in stage.module.state_dict(keep_vars=True).items() if n.endswith("expert_bias")}

    def _owned_tensors(self) -> tuple[dict, dict]:
        optimizer, mesh, elsewhere = self.optimizer, self.engine.mesh, self.elsewhere
        layout = self.engine.parallelism
        tensors = rng.rng_state(self.rank, self.device)
        # Replica 0 (dp and cp index 0: cp ranks hold the same weights) stores the parameters and moments; with
        # experts over ep, every rank stores what the syncs leave it (elsewhere: another rank stores it).
        if mesh.dp_index == 0 and mesh.cp_index == 0 or layout.ep > 1:
            tensors.update({f"param/{self.full_names[id(p)]}": p for _, p in self.named_params
                            if id(p) not in elsewhere})
            for p, state in optimizer.state.items():
                if id(p) not in elsewhere:
                    tensors.update({f"{k}/{self.full_names[id(p)]}": state[k] for k in ("exp_avg", "exp_avg_sq")})
        return tensors, {key: [0, 1] if rng.is_rng_key(key) else
                         layout.checkpoint_shard(key.split("/", 1)[1], mesh.tp_index, getattr(mesh, "ep_index", 0))
                         for key in tensors}

    @actor_method
    def snapshot(self, directory: str) -> float:
        """--snapshot-every: copy this rank's checkpoint state now (the next step changes it) and write the copy
        into `directory` in the background, its checksum last (pipegpt.state.snapshot). Returns the seconds the
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

    @actor_method
    def load(self, path: str, weights_only: bool = False) -> int:
        """Load a checkpoint written under any layout; returns the step it was taken after."""
        # The driver verified every file's checksum before any worker started (driver.start_from).
        reader, manifest = checkpoint.CheckpointReader(path, verify=False), checkpoint.read_manifest(path, verify=False)
        step = manifest["step"]
        tp_rank, tp = self.engine.mesh.tp_index, self.cfg.parallel.tp

        layout = self.engine.parallelism

        def mine(key: str, p: torch.Tensor) -> torch.Tensor:
            name = self.full_names[id(p)]
            value = reader.shard(f"{key}/{name}", name, tp_rank, tp)
            experts = layout.expert_slice(name, self.cfg.model.n_experts, getattr(self.engine.mesh, "ep_index", 0))
            return (value if experts is None else value[experts]).to(p.device, p.dtype)

        if self.sharded:
            zero_state.load(self, mine, step, weights_only)
            if weights_only:
                self._load_router_biases(reader)
                return 0
        else:
            with torch.no_grad():
                for _, p in self.named_params:
                    p.copy_(mine("param", p))
            if weights_only:
                self._load_router_biases(reader)
                return 0
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    self.optimizer.state[p] = {"step": step_tensor(step, p, group),  # on the GPU for fused AdamW
                                               "exp_avg": mine("exp_avg", p), "exp_avg_sq": mine("exp_avg_sq", p)}
        self._load_router_biases(reader)
        keys = [key for key in (f"rng/{self.rank}", f"cuda_rng/{self.rank}") if reader.has(key)]
        mesh = self.engine.mesh  # streams restored only under the same grid, else fresh (the driver says so)
        rng.resume_streams(manifest, self.cfg.parallel.dims, lambda: {key: reader.full(key, "") for key in keys},
                           self.rank, mesh.pp_index, mesh.dp_index, self.cfg.runtime.seed, self.device)
        if self.loader is not None:
            self.loader.load_state_dict({"step": step})
        return step

    @torch.no_grad()
    def _load_router_biases(self, reader) -> None:
        for name, bias in self._router_biases().items():
            if reader.has(f"param/{name}"):
                bias.copy_(reader.full(f"param/{name}", name))

    @actor_method
    def _whole(self):
        return self.dp.whole() if self.dp is not None else contextlib.nullcontext()

    @actor_method
    def named_optimizer_state(self) -> dict[str, torch.Tensor]:
        """{"exp_avg/<name>": moment, ...} of this rank's parameters, by one-process name (for tests; under ZeRO
        gathered from the shards: a collective)."""
        if self.sharded:
            return zero_state.gathered_moments(self)
        return {f"{k}/{self.full_names[id(p)]}": state[k].detach().cpu().clone()
                for p, state in self.optimizer.state.items() for k in ("exp_avg", "exp_avg_sq")}

    @actor_method
    def describe(self) -> dict:
        return self._describe()

    def _describe(self) -> dict:
        """describe()'s answer, for start() and build() too (a plain method, as _build)."""
        state_bytes = sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                          for t in state.values() if torch.is_tensor(t))
        described = {**self.engine.describe(), "optimizer_state_bytes": state_bytes}
        if self.dp is not None:  # what the flat buffers hold now, counted from their storages
            described["held_bytes"] = {**self.dp.storage_bytes(), "optimizer": state_bytes}
            if self.dp.zero >= 3:  # resharded parameters have no elements of their own: count the layout's
                described["parameters"] = sum(sum(b.layout.numels) for b in self.dp.buffers.values())
                described["parameter_bytes"] = sum(sum(b.layout.numels) * b.empty.element_size()
                                                   for b in self.dp.buffers.values())
        return described

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
        """Start py-spy on this process (pipegpt.observe.profile); None once it samples, else why not (one line)."""
        self.profiler = Profiler(directory, self.rank)
        return self.profiler.start()

    @actor_method
    def profile_stop(self) -> tuple[list[str], str | None]:
        """Stop py-spy: (the profiles it wrote, None or why not)."""
        profiler, self.profiler = getattr(self, "profiler", None), None
        return profiler.stop() if profiler is not None else ([], None)

    @actor_method
    def named_grads(self) -> dict[str, torch.Tensor]:
        """The last step's gradients as the optimizer saw them (under ZeRO gathered from the shards: a collective)."""
        if self.sharded:
            grads = self.dp.full_grads()
            return {n: grads[id(p)].cpu().clone() for n, p in self.named_params}
        return {n: p.grad.detach().cpu().clone() for n, p in self.named_params if p.grad is not None}

    @actor_method
    def named_buffers(self) -> dict[str, torch.Tensor]:
        """The stages' persistent buffers (the MoE layers' router bias), by one-process name."""
        return {n: b.detach().cpu().clone() for _, stage in sorted(self.stages.items())
                for n, b in stage.module.state_dict().items() if n.endswith("expert_bias")}

    @actor_method
    def named_parameters(self) -> dict[str, torch.Tensor]:
        with self._whole():
            return {n: p.detach().cpu().clone() for n, p in self.named_params}


def first_nonfinite(stages: dict, full_names: dict, optimizer_state) -> tuple[int, str] | None:
    """(stage, "param/<name>" or "exp_avg/<name>", ...) of the first parameter or Adam moment of this rank
    with a value that is not finite, or None (one check per tensor, read back at once)."""
    found = []
    for s in sorted(stages):
        for p in stages[s].module.parameters():
            moments = [(k, optimizer_state[p][k]) for k in ("exp_avg", "exp_avg_sq") if k in optimizer_state.get(p, {})]
            found += [(s, f"{k}/{full_names[id(p)]}", t) for k, t in [("param", p), *moments]]
    return zero_state.first_bad(found)
