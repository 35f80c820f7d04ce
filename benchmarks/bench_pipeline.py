"""pipegpt vs torch.distributed.pipelining vs the one-process model, measured side by side on CPU (gloo).

    .venv/bin/python benchmarks/bench_pipeline.py                       # 2 stages, 1f1b, 8 x 4, tiny
    .venv/bin/python benchmarks/bench_pipeline.py --stages 4 --microbatches 16
    .venv/bin/python benchmarks/bench_pipeline.py --schedules gpipe,1f1b,interleaved-1f1b

Contenders (each run is a fresh set of processes; contenders are interleaved across repeats, ABC ABC ABC):

  pipegpt     `pipegpt run ... --device cpu --run-dir TMP` as a user runs it; per-step `step_time_s`,
              `tokens_per_s` and `peak_memory_per_rank` read back from TMP/metrics.jsonl.
  torch.pp    torch.distributed.pipelining with the same model: one pipegpt.model.GPT slice per stage
              (pipegpt.stages.partition_layers split, same init seed, tied embedding synchronised the way
              pipegpt does it), PipelineStage + the matching torch schedule, worker processes started with
              torch.multiprocessing spawn, gloo, the same AdamW (pipegpt.train.optim.make_optimizer), the same
              global-norm gradient clip and the same threads per process (cores // ranks).
  1-process   GPT(cfg) whole in one process, gradient accumulation over the same microbatches, same
              optimizer and clip, torch.set_num_threads(cores).

All three see exactly the same batches (pipegpt.data.loader.BatchSampler, same seed) and start from exactly the
same weights, so their losses must agree: the table prints the first and last step's loss as a check.

This file is also its own worker: `bench_pipeline.py _run torch|single SPEC.json OUT.json` runs one contender
once and writes its measurements (the parent never imports torch, so it takes no memory or CPU from them).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO))

# pipegpt schedule name -> torch.distributed.pipelining schedule class name (None: no counterpart).
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
    "zb-h1": "ScheduleInterleavedZeroBubble",  # its ZB1P with one stage per rank is ZB-H1
}
MULTI_STAGE = {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}


# ----------------------------------------------------------------------------------------------------------
# Layout shared by every contender: which model stages exist and which rank holds them (same as pipegpt).

def virtual_stages_for(schedule: str, virtual_stages: int | None) -> int | None:
    """--virtual-stages as the schedule gets it: only where it applies (elsewhere the schedule's own)."""
    from pipegpt.schedule import schedule_spec

    return virtual_stages if schedule_spec(schedule).takes_virtual_stages else None


def stage_layout(schedule: str, ranks: int, virtual_stages: int | None) -> tuple[int, list[int]]:
    """(number of model stages, stage -> rank), as pipegpt's schedule registry places them."""
    from pipegpt.schedule import schedule_spec

    stage_to_rank = schedule_spec(schedule).stage_to_rank(ranks, virtual_stages_for(schedule, virtual_stages))
    return len(stage_to_rank), list(stage_to_rank)


def model_cfg(spec: dict):
    from pipegpt.config import ModelConfig

    return ModelConfig(**spec["model"])


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def process_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sampler_for(spec: dict):
    from pipegpt.data.loader import BatchSampler
    from pipegpt.data.tokenizers import get_tokenizer
    from pipegpt.data.tokens import builtin_tokens

    tokens = builtin_tokens(get_tokenizer("bytes"))
    return BatchSampler(tokens, spec["microbatches"] * spec["microbatch_size"], spec["model"]["seq_len"], spec["seed"])


def optim_cfg(spec: dict):
    from pipegpt.config import OptimizerConfig

    return OptimizerConfig(lr=spec["lr"], grad_clip=spec["grad_clip"])


def clip_(named_params, counted_twice: set, grad_clip: float) -> float:
    """pipegpt's global-norm clip (pipegpt.train.optim), over every rank of the pipeline."""
    import torch.distributed as dist

    from pipegpt.train.optim import clip_grad_norm_

    params = [p for _, p in named_params]
    group = dist.group.WORLD if dist.is_initialized() else None
    return clip_grad_norm_([p for p in params if id(p) not in counted_twice], params, grad_clip, group)


# ----------------------------------------------------------------------------------------------------------
# Contender 2: torch.distributed.pipelining

def _torch_worker(rank: int, world: int, port: int, spec: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    from pipegpt.model.gpt import GPT
    from pipegpt.stages import partition_layers
    from pipegpt.train.optim import make_optimizer

    if spec.get("bind_cores"):  # as pipegpt's --bind-cores: rank r on the next threads_per_worker cores
        from pipegpt.engine.placement import worker_cores

        os.sched_setaffinity(0, worker_cores(rank, world, spec["threads_per_worker"]))
    torch.set_num_threads(spec["threads_per_worker"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if spec.get("torch_batch_gloo_loops"):  # what pipegpt's init_mesh does (comm/mesh.py batch_gloo_loops)
        from pipegpt.comm.mesh import batch_gloo_loops
        batch_gloo_loops(expected=1)  # the default group's loop
    cfg = model_cfg(spec)
    num_stages, stage_to_rank = stage_layout(spec["schedule"], world, spec["virtual_stages"])
    last = num_stages - 1
    ranges = partition_layers(cfg.n_layer, num_stages)
    # Ascending: on a V that is [rank, 2p-1-rank], the order torch's V schedules want.
    mine = [s for s in range(num_stages) if stage_to_rank[s] == rank]
    modules = {s: GPT(cfg, layers=ranges[s], embed=s == 0, head=s == last, init_seed=spec["seed"]) for s in mine}
    tied_here = cfg.tie_embeddings and last != 0 and {0, last} <= set(mine)
    if tied_here:  # both ends of a V on this rank: one shared tensor, as pipegpt does
        modules[last].lm_head.weight = modules[0].wte.weight
    # The tied embedding's two copies on different ranks: sum their grads (pipegpt's "embedding" group).
    tie_ranks = sorted({stage_to_rank[0], stage_to_rank[last]})
    tie_group = dist.new_group(tie_ranks) if cfg.tie_embeddings and len(tie_ranks) == 2 else None
    tied_copies = []
    if tie_group is not None:
        for s in mine:
            for local in modules[s].tied_parameter_names():
                tied_copies.append(modules[s].get_parameter(local))
    seen, named = set(), []
    for s in mine:
        for n, p in modules[s].named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((n, p))
    counted_twice = {id(p) for p in tied_copies} if 0 not in mine else set()
    optimizer = make_optimizer(named, optim_cfg(spec))

    m, V = spec["microbatches"], cfg.vocab_size

    # The head slice returns logits (GPT.forward without targets); the loss is computed here, the same
    # cross-entropy pipegpt computes inside GPT.forward. Divided by m with scale_grads=False, as pipegpt
    # divides each microbatch's loss by m (scale_grads=True would also scale a V-shape's shared tied
    # weight once per stage holding it, i.e. twice).
    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1)) / m

    device = torch.device("cpu")
    stages = [pipelining.PipelineStage(modules[s], s, num_stages, device) for s in mine]
    cls = getattr(pipelining, spec["torch_schedule"])
    if cls.__name__ in MULTI_STAGE:
        schedule = cls(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)

    sampler = sampler_for(spec) if (0 in mine or last in mine) else None
    step_times, losses = [], []
    action_times: dict[str, list[float]] = {"F": [], "B": [], "wait": [], "step_wait": []}
    if spec.get("instrument"):  # per-action compute and p2p wait times, to compare with pipegpt's trace
        from torch.distributed.pipelining import schedules as _sched

        _orig_wait = _sched._wait_batch_p2p

        def _timed_wait(work, _orig=_orig_wait):
            t = time.perf_counter()
            try:
                return _orig(work)
            finally:
                action_times["wait"].append(time.perf_counter() - t)

        _sched._wait_batch_p2p = _timed_wait
        for st in stages:
            for name, attr in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
                def timed(*a, _orig=getattr(st, attr), _name=name, **k):
                    t = time.perf_counter()
                    try:
                        return _orig(*a, **k)
                    finally:
                        action_times[_name].append(time.perf_counter() - t)
                setattr(st, attr, timed)
    profile = None
    if spec.get("cprofile") and rank == spec.get("cprofile_rank", 0):
        import cProfile

        profile = cProfile.Profile()
    dist.barrier()
    cpu_s = []  # this process's CPU time per step, every thread
    # free_running: steps one after another as a training loop runs them, each timed from its start to the next
    # one's on its rank (the slowest rank's), with no collective of the benchmark's own between them
    free_running, mine_timed = spec.get("free_running", False), []
    for step in range(spec["steps"]):
        if profile is not None and step == spec["warmup"]:
            profile.enable()
        cpu0 = process_cpu_s()
        t0 = time.perf_counter()
        for _, p in named:
            p.grad = None
        x = y = None
        if sampler is not None:
            x, y = sampler.batch(step)
        step_losses: list = []
        kwargs = {}
        if last in mine:
            kwargs = {"target": y, "losses": step_losses}
        args = (x,) if 0 in mine else ()
        schedule.step(*args, **kwargs)
        for copy in tied_copies:
            dist.all_reduce(copy.grad, group=tie_group)
        clip_(named, counted_twice, spec["grad_clip"])
        optimizer.step()
        if spec.get("instrument"):
            action_times["step_wait"].append(sum(action_times["wait"]))
            action_times["wait"].clear()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        cpu_s.append(process_cpu_s() - cpu0)
        loss = torch.tensor([float(sum(float(v) for v in step_losses)) if last in mine else 0.0], dtype=torch.float64)
        if free_running:  # no collective between steps: gathered once the steps are done
            mine_timed.append((t0, float(elapsed), float(loss)))
            continue
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
        step_times.append(float(elapsed))
        dist.all_reduce(loss)  # only the last stage's rank contributes
        losses.append(float(loss))
    if free_running:
        step_times[:], losses[:] = _free_running_times(mine_timed, world)
    if profile is not None:
        profile.disable()
        profile.dump_stats(spec["cprofile"])
    peaks, actions, cpus = [None] * world, [None] * world, [None] * world
    dist.all_gather_object(peaks, peak_rss_bytes())
    dist.all_gather_object(actions, action_times)
    dist.all_gather_object(cpus, cpu_s)
    if rank == 0:
        cpu_per_rank = [[c / t for c, t in zip(rank_cpu, step_times)] for rank_cpu in cpus]  # as pipegpt's metric
        Path(out_path).write_text(json.dumps({"step_times": step_times, "losses": losses, "peak_memory_per_rank": peaks,
                                              "action_times": actions, "cpu_per_rank": list(zip(*cpu_per_rank))}))
    dist.barrier()
    dist.destroy_process_group()


def _free_running_times(mine: list[tuple[float, float, float]], world: int) -> tuple[list[float], list[float]]:
    """(step times, losses) from every rank's (start, span, loss) per step: a step lasts from its start to the
    next one's (the last: its span), the slowest rank's; its loss is the ranks' sum (the last stage's)."""
    import torch.distributed as dist

    every = [None] * world
    dist.all_gather_object(every, mine)
    times = [max((steps[k + 1][0] - steps[k][0]) if k + 1 < len(steps) else steps[k][1] for steps in every)
             for k in range(len(mine))]
    return times, [sum(steps[k][2] for steps in every) for k in range(len(mine))]


def run_torch(spec: dict, out_path: str) -> None:
    import torch.multiprocessing as mp

    from pipegpt.comm.rpc import free_port

    port = free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_torch_worker, args=(spec["stages"], port, spec, out_path), nprocs=spec["stages"], join=True)


# ----------------------------------------------------------------------------------------------------------
# Contender 3: the whole model in one process

def run_single(spec: dict, out_path: str) -> None:
    import torch

    from pipegpt.model.gpt import GPT
    from pipegpt.train.optim import make_optimizer

    torch.set_num_threads(spec.get("single_threads") or spec["cores"])
    cfg = model_cfg(spec)
    model = GPT(cfg, init_seed=spec["seed"])
    named = list(model.named_parameters())  # named_parameters() yields the tied weight once
    optimizer = make_optimizer(named, optim_cfg(spec))
    sampler = sampler_for(spec)
    m, mbs = spec["microbatches"], spec["microbatch_size"]
    step_times, compute_times, losses = [], [], []
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        for _, p in named:
            p.grad = None
        x, y = sampler.batch(step)
        total, t1 = 0.0, time.perf_counter()
        for xm, ym in zip(x.split(mbs), y.split(mbs)):
            loss = model(xm, ym)
            (loss / m).backward()
            total += float(loss.detach())
        compute_times.append(time.perf_counter() - t1)  # the forwards and backwards alone (bench_floor's split)
        clip_(named, set(), spec["grad_clip"])
        optimizer.step()
        step_times.append(time.perf_counter() - t0)
        losses.append(total / m)
    Path(out_path).write_text(json.dumps({"step_times": step_times, "compute_times": compute_times,
                                          "losses": losses, "peak_memory_per_rank": [peak_rss_bytes()]}))


# ----------------------------------------------------------------------------------------------------------
# Contender 1: pipegpt as a user runs it

def pipegpt_exe() -> list[str]:
    exe = Path(sys.executable).parent / "pipegpt"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pipegpt"]


def pipegpt_command(spec: dict, run_dir: str) -> list[str]:
    mdl = spec["model"]
    cmd = pipegpt_exe() + ["run", "--stages", str(spec["stages"]), "--microbatches", str(spec["microbatches"]),
            "--microbatch-size", str(spec["microbatch_size"]), "--schedule", spec["schedule"],
            "--steps", str(spec["steps"]), "--model", spec["preset"],
            "--n-layer", str(mdl["n_layer"]), "--n-embd", str(mdl["n_embd"]), "--n-head", str(mdl["n_head"]),
            "--seq-len", str(mdl["seq_len"]), "--vocab-size", str(mdl["vocab_size"]),
            "--lr", str(spec["lr"]), "--lr-schedule", "constant",
            "--grad-clip", str(spec["grad_clip"]),
            "--seed", str(spec["seed"]), "--device", "cpu", "--run-dir", run_dir,
            "--log-every", str(10 ** 6), "--threads-per-worker", str(spec["threads_per_worker"])]
    if not mdl["tie_embeddings"]:
        cmd += ["--no-tie-embeddings"]
    if spec.get("bind_cores"):
        cmd += ["--bind-cores"]
    if "steps_per_call" in spec:  # else pipegpt's default (auto)
        cmd += ["--steps-per-call", str(spec["steps_per_call"])]
    cmd += spec.get("extra_args", [])  # a benchmark's own flags (bench_floor: --balance cost, --trace-steps)
    v = virtual_stages_for(spec["schedule"], spec["virtual_stages"])
    if v:
        cmd += ["--virtual-stages", str(v)]
    return cmd


def run_pipegpt(spec: dict, workdir: str, timeout: float) -> dict:
    run_dir = os.path.join(workdir, "run")
    cmd = pipegpt_command(spec, run_dir)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=workdir)
    if proc.returncode != 0:
        raise RuntimeError(f"pipegpt run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = {"step_times": [r["step_time_s"] for r in rows], "losses": [r["loss"] for r in rows],
              "peak_memory_per_rank": rows[-1]["peak_memory_per_rank"],
              "tokens_per_s": [r["tokens_per_s"] for r in rows],
              "control_s": [r.get("control_s") for r in rows], "cpu_per_rank": [r.get("cpu_per_rank") for r in rows],
              "driver_cpu": [r.get("driver_cpu") for r in rows]}
    if spec.get("keep_trace"):
        shutil.copy(Path(run_dir, "trace.json"), spec["keep_trace"])
    if spec.get("analyse"):  # the last step measured beside predicted, and the runtime's gaps between actions
        result.update(analyse_trace(run_dir, timeout))
    return result


def analyse_trace(run_dir: str, timeout: float) -> dict:
    """fidelity (`pipegpt simulate --trace`: predicted makespan / measured span of the last step) and the
    per-action overhead: the median gap between one action's end and the next one's start on a rank (the
    runtime's own work between actions; waits for peers are inside the RECV actions)."""
    proc = subprocess.run(pipegpt_exe() + ["simulate", "--trace", run_dir, "--json"], capture_output=True, text=True,
                          timeout=timeout)
    fidelity = json.loads(proc.stdout)["fidelity"] if proc.returncode == 0 else None
    trace = json.loads(Path(run_dir, "trace.json").read_text())
    by_rank: dict = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            by_rank.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"]))
    gaps = []
    for spans in by_rank.values():
        spans.sort()
        gaps += [max(0.0, nxt[0] - cur[1]) for cur, nxt in zip(spans, spans[1:])]
    return {"fidelity": fidelity, "action_gap_us": median(gaps), "actions": sum(map(len, by_rank.values()))}


def run_contender(kind: str, spec: dict, timeout: float) -> dict:
    workdir = tempfile.mkdtemp(prefix=f"bench-{kind}-")
    try:
        t0 = time.perf_counter()
        if kind == "pipegpt":
            result = run_pipegpt(spec, workdir, timeout)
        else:
            spec_path, out_path = os.path.join(workdir, "spec.json"), os.path.join(workdir, "out.json")
            Path(spec_path).write_text(json.dumps(spec))
            cmd = [sys.executable, str(Path(__file__).resolve()), "_run", kind, spec_path, out_path]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=workdir)
            if proc.returncode != 0 or not os.path.exists(out_path):
                raise RuntimeError(f"{kind} contender failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
            result = json.loads(Path(out_path).read_text())
        result["wall_s"] = time.perf_counter() - t0
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# The parent: configuration, interleaved repeats, the table

def build_specs(args) -> tuple[dict, list[str]]:
    from pipegpt.config import model_config

    model = model_config(args.model, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                         seq_len=args.seq_len, vocab_size=args.vocab_size,
                         tie_embeddings=False if args.untied else None)
    cores = args.cores or os.cpu_count() or 1
    base = {
        "preset": args.model, "model": {k: getattr(model, k) for k in model.__dataclass_fields__},
        "stages": args.stages, "microbatches": args.microbatches, "microbatch_size": args.microbatch_size,
        "steps": args.steps, "warmup": args.warmup, "lr": args.lr, "grad_clip": args.grad_clip, "seed": args.seed,
        "cores": cores, "threads_per_worker": args.threads_per_worker or max(1, cores // args.stages),
        "virtual_stages": args.virtual_stages, "bind_cores": args.bind_cores,
    }
    schedules = [s.strip() for s in (args.schedules or args.schedule).split(",") if s.strip()]
    return base, schedules


def check_schedule(base: dict, schedule: str) -> str | None:
    """Why pipegpt would refuse this schedule here (None: it runs)."""
    from pipegpt.config import ConfigError
    from pipegpt.schedule import ScheduleError, build_plan
    from pipegpt.model.partition import partition_layers

    try:
        plan = build_plan(schedule, base["stages"], base["microbatches"],
                          virtual_stages_for(schedule, base["virtual_stages"]))
        partition_layers(base["model"]["n_layer"], plan.num_stages)
    except (ScheduleError, ConfigError) as e:
        return " ".join(str(e).split())
    return None


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(results: list[dict], spec: dict) -> dict:
    w = spec["warmup"]
    tokens = spec["microbatches"] * spec["microbatch_size"] * spec["model"]["seq_len"]
    times = [t for r in results for t in r["step_times"][w:]]
    per_repeat = [median(r["step_times"][w:]) for r in results]
    tps = [tokens / t for t in times]
    peaks = [max(col) for col in zip(*[r["peak_memory_per_rank"] for r in results])]
    return {"tokens_per_s": median(tps), "step_ms": 1000 * median(times),
            "step_ms_range": (1000 * min(per_repeat), 1000 * max(per_repeat)),
            "peak_mib": [p / 2**20 for p in peaks],
            "loss_first": results[0]["losses"][0], "loss_last": results[0]["losses"][-1],
            "wall_s": median([r["wall_s"] for r in results]), "timed_steps": len(times)}


def describe(base: dict, schedules: list[str], contenders: list[str], args) -> str:
    from pipegpt.model.partition import partition_layers

    m = base["model"]
    n_params = _param_count(m)
    tokens = base["microbatches"] * base["microbatch_size"] * m["seq_len"]
    lines = [
        "pipegpt vs torch.distributed.pipelining vs one process -- CPU, gloo, measured side by side",
        f"model       {base['preset']}: n_layer={m['n_layer']} n_embd={m['n_embd']} n_head={m['n_head']} "
        f"seq_len={m['seq_len']} vocab={m['vocab_size']} tied={m['tie_embeddings']} dropout={m['dropout']} "
        f"({n_params / 1e6:.2f}M parameters)",
        f"pipeline    {base['stages']} stages (one worker process per stage/rank), "
        f"{base['microbatches']} microbatches x {base['microbatch_size']} sequences x {m['seq_len']} tokens "
        f"= {tokens} tokens/step",
    ]
    for s in schedules:
        why = check_schedule(base, s)
        num_stages, s2r = stage_layout(s, base["stages"], base["virtual_stages"]) if why is None else (0, [])
        split = [len(r) for r in partition_layers(m["n_layer"], num_stages)] if why is None else None
        torch_name = TORCH_SCHEDULES.get(s)
        lines.append(f"schedule    {s} -> torch {torch_name or '(none)'}; "
                     + (f"{num_stages} model stages, layers per stage {split}, stage->rank {s2r}"
                        if why is None else f"skipped: {why}"))
    lines += [
        f"threads     {base['threads_per_worker']} per pipeline worker ({base['cores']} cores / {base['stages']} ranks); "
        f"one-process baseline {base['cores']}",
        f"optimizer   AdamW (pipegpt.train.optim.make_optimizer) lr={base['lr']} wd=0.1 betas=(0.9, 0.95) foreach=True, "
        f"global grad-norm clip {base['grad_clip']}",
        f"timing      {base['steps']} steps per run, first {base['warmup']} skipped; {args.repeats} repeats, "
        f"contenders interleaved per repeat ({', '.join(contenders)}); medians over all timed steps of all repeats",
    ]
    return "\n".join(lines)


def _cpu_accounting() -> tuple[float, float, float]:
    """(wall s, machine busy CPU s from /proc/stat, CPU s of this process and its finished children)."""
    import resource

    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = sum(getattr(resource.getrusage(w), a) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for a in ("ru_utime", "ru_stime"))
    return time.monotonic(), busy, own


def _other_load(before, after, cores: int) -> str:
    """How much CPU processes outside this benchmark took while it ran: they make every number noisier."""
    wall = after[0] - before[0]
    other = max(0.0, (after[1] - before[1]) - (after[2] - before[2]))
    share = other / (wall * cores) if wall > 0 else 0.0
    line = (f"other processes used {share:.0%} of the machine's {cores} cores during the benchmark "
            f"(load average now {os.getloadavg()[0]:.1f})")
    if share > 0.10:
        line += ": absolute numbers are inflated and noisy; ratios between interleaved contenders hold up better"
    return line


def _param_count(m: dict) -> int:
    V, C, L, T = m["vocab_size"], m["n_embd"], m["n_layer"], m["seq_len"]
    per_block = 12 * C * C + 13 * C if m["bias"] else 12 * C * C + 2 * C
    head = 0 if m["tie_embeddings"] else V * C
    return V * C + T * C + L * per_block + 2 * C + head


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["_run"]:  # internal: one contender, one run
        kind, spec_path, out_path = argv[1:4]
        spec = json.loads(Path(spec_path).read_text())
        {"torch": run_torch, "single": run_single}[kind](spec, out_path)
        return 0

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", "-p", type=int, default=2, help="pipeline ranks (worker processes) [2]")
    ap.add_argument("--microbatches", "-m", type=int, default=8, help="[8]")
    ap.add_argument("--microbatch-size", type=int, default=4, help="sequences per microbatch [4]")
    ap.add_argument("--schedule", "-s", default="1f1b", help="pipegpt schedule name [1f1b]")
    ap.add_argument("--schedules", default=None,
                    help="comma list of pipegpt schedules to run, each against its torch counterpart where one "
                         "exists (e.g. gpipe,1f1b,zb-h1,interleaved-1f1b); overrides --schedule")
    ap.add_argument("--virtual-stages", "-v", type=int, default=None, help="stages per rank for interleaved-1f1b [2]")
    ap.add_argument("--steps", type=int, default=12, help="steps per run [12]")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps of each run left out of the medians [2]")
    ap.add_argument("--repeats", type=int, default=3, help="runs per contender, interleaved [3]")
    ap.add_argument("--model", default="tiny", help="pipegpt.config.MODEL_PRESETS name [tiny]")
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--n-embd", type=int, default=None)
    ap.add_argument("--n-head", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=None, help="the built-in corpus is bytes: any size >= 256")
    ap.add_argument("--untied", action="store_true", help="a separate LM-head weight")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--cores", type=int, default=None, help="cores to size threads by [os.cpu_count()]")
    ap.add_argument("--threads-per-worker", type=int, default=None, help="[cores // stages, at least 1]")
    ap.add_argument("--bind-cores", action="store_true",
                    help="pin each rank of both sides to its own cores (pipegpt run --bind-cores)")
    ap.add_argument("--contenders", default="pipegpt,torch,single",
                    help="subset of pipegpt,torch,single [all three]")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one run may take [600]")
    ap.add_argument("--json", dest="json_out", default=None, help="also write every measurement to this file")
    args = ap.parse_args(argv)
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")

    base, schedules = build_specs(args)
    kinds = [k.strip() for k in args.contenders.split(",") if k.strip()]
    for k in kinds:
        if k not in ("pipegpt", "torch", "single"):
            ap.error(f"unknown contender {k!r}")
    # Work list per repeat: (label, kind, schedule, spec)
    jobs = []
    skipped = {}
    for s in schedules:
        if s not in TORCH_SCHEDULES:
            ap.error(f"unknown schedule {s!r}: one of {', '.join(TORCH_SCHEDULES)}")
        why = check_schedule(base, s)
        if why:
            skipped[s] = why
            continue
        spec = dict(base, schedule=s, torch_schedule=TORCH_SCHEDULES[s])
        if "pipegpt" in kinds:
            jobs.append((f"pipegpt {s}", "pipegpt", s, spec))
        if "torch" in kinds and TORCH_SCHEDULES[s]:
            jobs.append((f"torch.pp {TORCH_SCHEDULES[s]}", "torch", s, spec))
    if "single" in kinds:
        jobs.append(("1-process (grad accum)", "single", None, dict(base, schedule=None, torch_schedule=None)))
    contenders = [label for label, *_ in jobs]
    print(describe(base, schedules, contenders, args), flush=True)
    if not jobs:
        print("nothing to run")
        return 1

    results: dict[str, list[dict]] = {label: [] for label in contenders}
    t_start = time.perf_counter()
    cpu_before = _cpu_accounting()
    failures: dict[str, list[str]] = {label: [] for label in contenders}
    for rep in range(args.repeats):
        for label, kind, s, spec in jobs:
            try:
                r = run_contender(kind, spec, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # one failed run must not lose the others
                lines = [ln for ln in str(e).splitlines() if ln.strip()]
                why = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else type(e).__name__)
                failures[label].append(why.strip())
                print(f"  repeat {rep + 1}/{args.repeats}  {label:<34} FAILED: {why.strip()}", file=sys.stderr, flush=True)
                continue
            results[label].append(r)
            med = 1000 * median(r["step_times"][args.warmup:])
            print(f"  repeat {rep + 1}/{args.repeats}  {label:<34} median step {med:8.1f} ms  "
                  f"(run took {r['wall_s']:.1f} s)", file=sys.stderr, flush=True)

    summary = {label: summarize(results[label], jobs[i][3]) for i, label in enumerate(contenders) if results[label]}
    ref = {s: summary[f"pipegpt {s}"] for s in schedules if f"pipegpt {s}" in summary}
    first_ref = next(iter(ref.items()), None)
    head = ["contender", "tokens/s", "step ms", "(repeat medians)", "vs pipegpt", "peak RSS/rank MiB", "loss first->last"]
    rows = [head]
    for label, kind, s, spec in jobs:
        if label not in summary:
            rows.append([label + " (every run failed)", "-", "-", "-", "-", "-", "-"])
            continue
        sm = summary[label]
        if failures[label]:
            label += f" ({len(failures[label])} of {args.repeats} runs failed)"
        if kind in ("pipegpt", "torch"):
            ratio = f"x{sm['tokens_per_s'] / ref[s]['tokens_per_s']:.2f}" if s in ref else "-"
        elif first_ref is not None:
            ratio = f"x{sm['tokens_per_s'] / first_ref[1]['tokens_per_s']:.2f}" + \
                    (f" ({first_ref[0]})" if len(ref) > 1 else "")
        else:
            ratio = "-"
        lo, hi = sm["step_ms_range"]
        rows.append([label, f"{sm['tokens_per_s']:,.0f}", f"{sm['step_ms']:.1f}", f"{lo:.1f}-{hi:.1f}", ratio,
                     " ".join(f"{p:.0f}" for p in sm["peak_mib"]),
                     f"{sm['loss_first']:.4f} -> {sm['loss_last']:.4f}"])
    print()
    from pipegpt.schedule.render import text_table

    print(text_table(rows, right={1, 2, 3}, rule=True))
    for s, why in skipped.items():
        print(f"skipped {s}: {why}")
    for label, whys in failures.items():
        for why in sorted(set(whys)):
            print(f"failed {label}: {why}")
    print(f"\n(total benchmark wall time {time.perf_counter() - t_start:.0f} s; ratio = tokens/s / pipegpt's with the "
          f"same schedule; peak RSS = max RSS of each worker process, torch library included)")
    print(_other_load(cpu_before, _cpu_accounting(), base["cores"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"config": base, "schedules": schedules, "results": results, "failures": failures,
                                                   "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
