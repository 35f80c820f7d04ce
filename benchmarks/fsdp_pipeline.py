"""torch.distributed.pipelining with FSDP2 at dp x pp on CPU gloo: what bench_zero.py puts beside pipegpt.

The layout torchtitan runs under pipeline parallelism (its parallelize.apply_fsdp and
pipeline_parallel.build_pipeline_schedule), on pipegpt's own model:
- a 2-D device mesh (dp, pp), rank = dp_index * pp + pp_index (pipegpt's order);
- each pp rank builds its stage as pipegpt does: GPT(config, layers=partition_layers(...)[p], embed=p == 0,
  head=p == pp - 1, init_seed=seed), so every stage starts from the values the one-process model has;
- fully_shard over the dp mesh per transformer block, then per stage module, all with reshard_after_forward=False
  (gathered once per step, not per microbatch: torchtitan's default under PP);
- force-sum reduction (gloo's reduce-scatter has no AVG: FSDP2 then sums and divides by dp afterwards);
- torch's Schedule1F1B with loss / microbatches and scale_grads=False (as torchtitan), on the same data pipegpt's
  RankLoader gives each replica, then AdamW with pipegpt's groups and learning rate, global-norm clipping.
The embedding is tied as in pipegpt: the first stage's wte and the last stage's lm_head start equal and their
gradient shards are summed over pp before clipping, so both copies take the same step.
"""
from __future__ import annotations

import json
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.data.loader import BatchSampler
from pipegpt.data.tokenizers import get_tokenizer
from pipegpt.data.tokens import builtin_tokens
from pipegpt.model.gpt import GPT, build_reference_model
from pipegpt.model.partition import partition_layers
from pipegpt.train.optim import lr_at, make_optimizer, set_lr

NOISE = 1e-7  # |grad| below this is fp32 rounding noise (real gradients are ~1e-4 and up); Adam's first step
# moves such an element by up to lr whichever sign its noise has, so the check compares elements with signal


def config(spec: dict) -> TrainConfig:
    """pipegpt's config of the same layout: model, batch, seed, optimizer (bench_zero.measure's)."""
    model = ModelConfig(vocab_size=256, seq_len=spec["seq_len"], n_layer=spec["n_layer"], n_head=spec["n_head"],
                        n_embd=spec["n_embd"])
    return TrainConfig.build(model, dp=spec["dp"], stages=spec["pp"], zero=0, microbatches=spec["m"],
                             microbatch_size=spec["mbs"], steps=spec["steps"], device="cpu")


def measure(spec: dict) -> dict:
    """dp x pp processes, `steps` steps; rank 0's step times (and the part in schedule.step), every rank's held
    bytes, the mean loss per step and the one-process check of step 1 (with spec["check"])."""
    world = spec["dp"] * spec["pp"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(spec, port, out), nprocs=world, join=True, start_method="spawn")
        return json.loads((Path(out) / "result.json").read_text())


def _rank(rank: int, spec: dict, port: int, out: str) -> None:
    torch.set_num_threads(1)  # as pipegpt's workers (threads_per_worker=1)
    world = spec["dp"] * spec["pp"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        result = _train(rank, spec)
        if rank == 0:
            (Path(out) / "result.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _build_stage(cfg: TrainConfig, p: int, dp_mesh):
    from torch.distributed.fsdp import fully_shard

    pp, seed = cfg.parallel.stages, cfg.runtime.seed
    layers = partition_layers(cfg.model.n_layer, pp)[p]
    module = GPT(cfg.model, layers=layers, embed=p == 0, head=p == pp - 1, init_seed=seed)
    for block in module.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
    for m in module.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):  # every FSDP module: each has its own groups
            m.set_force_sum_reduction_for_comms(True)
    return module


def _train(rank: int, spec: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    cfg = config(spec)
    dp, pp, m, mbs = spec["dp"], spec["pp"], spec["m"], spec["mbs"]
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    d, p = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    pp_group = mesh["pp"].get_group()
    module = _build_stage(cfg, p, mesh["dp"])
    first, last = p == 0, p == pp - 1
    stage = PipelineStage(module, p, pp, torch.device("cpu"), group=pp_group)
    V = cfg.model.vocab_size

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-1) / m

    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    named = list(module.named_parameters())
    optimizer = make_optimizer(named, cfg.optim)
    tied = module.tied_parameter_names()  # {"wte.weight"} on the first stage, {"lm_head.weight"} on the last
    counted = [t for n, t in named if not (last and n in tied)]  # the tied weight's norm counted once
    sampler = BatchSampler(builtin_tokens(get_tokenizer(cfg.data.tokenizer)), cfg.batch_size, cfg.model.seq_len,
                           cfg.runtime.seed)
    rows = slice(d * m * mbs, (d + 1) * m * mbs)  # pipegpt's RankLoader: replica d's slice of the global batch
    times, pipeline_times, losses, check = [], [], [], None
    for step in range(spec["steps"]):
        x, y = (t[rows] for t in sampler.batch(step))
        dist.barrier()
        t0 = time.perf_counter()
        mb_losses: list = []
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=mb_losses)
        else:
            schedule.step()
        pipeline_times.append(time.perf_counter() - t0)  # forwards, backwards, gathers, reduce-scatters
        for name in tied:  # the two copies' gradient shards (same dp slice of rows) summed over pp
            dist.all_reduce(dict(named)[name].grad.to_local(), group=pp_group)
        norm = _clip(counted, [t for _, t in named], cfg.optim.grad_clip)
        set_lr(optimizer, lr_at(step, cfg.optim, spec["steps"]))
        optimizer.step()
        dist.barrier()  # the step ends when every rank is done (pipegpt's driver waits for all)
        times.append(time.perf_counter() - t0)
        loss = torch.tensor(sum(float(v.detach()) for v in mb_losses) if last else 0.0, dtype=torch.float64)
        dist.all_reduce(loss)  # loss/m per microbatch: the sum over last-stage ranks is dp x the mean
        losses.append(float(loss) / dp)
        held = _held_bytes(module, named, optimizer)
        if step == 0 and spec.get("check"):
            check = _check_step_one(cfg, named, rank, losses[0], norm)
        optimizer.zero_grad(set_to_none=True)
    helds = [None] * dist.get_world_size()
    dist.all_gather_object(helds, held)
    return {"times": times, "pipeline_times": pipeline_times, "losses": losses, "held": helds, "check": check}


def _clip(counted: list, params: list, max_norm: float) -> float:
    """The global gradient norm over every rank's shards of `counted` (each element once), then pipegpt's clip of
    every gradient of `params`."""
    local = sum(float(t.grad.to_local().double().pow(2).sum()) for t in counted if t.grad is not None)
    total = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(total)
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        for t in params:
            if t.grad is not None:
                t.grad.to_local().mul_(max_norm / (norm + 1e-6))
    return norm


def _held_bytes(module, named: list, optimizer) -> dict:
    """Bytes this rank holds after the optimizer step, from the storages (each counted once): the parameter
    shards and any gathered copy still allocated, the gradient shards, the optimizer state's local parts."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    def storages(tensors) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            s = t.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return sum(n for ptr, n in seen.items() if ptr)  # a freed gathered copy: storage resized to 0

    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    gathered = [fp._unsharded_param for sub in module.modules() if isinstance(sub, FSDPModule)
                for group in fully_shard.state(sub)._fsdp_param_groups for fp in group.fsdp_params
                if hasattr(fp, "_unsharded_param")]
    return {"parameters": storages([local(t) for _, t in named] + gathered),
            "gradients": storages([local(t.grad) for _, t in named if t.grad is not None]),
            "optimizer": sum(local(v).numel() * local(v).element_size() for s in optimizer.state.values()
                             for v in s.values() if torch.is_tensor(v))}


def _check_step_one(cfg: TrainConfig, named: list, rank: int, loss: float, norm: float) -> dict | None:
    """After step 1, the gathered parameters of every stage against one AdamW step of the one-process model on
    the same global batch (accumulated over the same microbatches, clipped, pipegpt's learning rate). A
    collective: every rank gathers its stage; rank 0 compares and returns the verdict, the others None."""
    full = {n: t.full_tensor().detach() for n, t in named}  # over dp; the pp_index-0 replicas' copies suffice
    stages = [None] * dist.get_world_size()
    dist.gather_object(full, stages if rank == 0 else None, dst=0)
    if rank != 0:
        return None
    torch.manual_seed(cfg.runtime.seed)
    model = build_reference_model(cfg.model, cfg.runtime.seed)
    optimizer = make_optimizer(list(model.named_parameters()), cfg.optim)
    sampler = BatchSampler(builtin_tokens(get_tokenizer(cfg.data.tokenizer)), cfg.batch_size, cfg.model.seq_len,
                           cfg.runtime.seed)
    x, y = sampler.batch(0)
    chunks = list(zip(x.split(cfg.parallel.microbatch_size), y.split(cfg.parallel.microbatch_size)))
    ref_loss = 0.0
    for xm, ym in chunks:
        part = model(xm, ym) / len(chunks)
        part.backward()
        ref_loss += float(part.detach())
    ref_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip))
    ref = dict(model.named_parameters(remove_duplicate=False))  # lm_head.weight: the tied wte.weight
    signal = {n: t.grad.abs() > NOISE for n, t in ref.items()}
    set_lr(optimizer, lr_at(0, cfg.optim, cfg.runtime.steps))
    optimizer.step()
    lr, worst, worst_noise, bad, names = cfg.optim.lr, 0.0, 0.0, [], set()
    for stage in stages:
        for name, value in stage.items():
            names.add(name)
            diff, real = (value - ref[name].detach()).abs(), signal[name]
            over = diff[real] - (1e-5 * ref[name].detach().abs()[real] + 1e-3 * lr)
            worst = max(worst, float(diff[real].max()) if real.any() else 0.0)
            worst_noise = max(worst_noise, float(diff[~real].max()) if (~real).any() else 0.0)
            if (over > 0).any() or (diff[~real] > 2 * lr).any():
                bad.append(name)
    ok = not bad and names == set(ref) and abs(loss - ref_loss) <= 1e-5 * ref_loss
    return {"ok": ok, "bad": bad, "tensors": len(names), "loss": loss, "ref_loss": ref_loss, "norm": norm,
            "ref_norm": ref_norm, "max_diff": worst, "max_diff_noise": worst_noise, "lr": lr}
