"""Host cost per microbatch and per step: pipegpt vs torch.distributed.pipelining where compute is negligible.

    .venv/bin/python benchmarks/bench_host.py                       # m 16, 64, 128; 1f1b and zb-h1; 3 rounds
    .venv/bin/python benchmarks/bench_host.py --microbatches 16,128 --schedules 1f1b --rounds 5

A tiny model (2 layers, n_embd 32, 2 heads, seq_len 16, vocabulary 256, untied embeddings, microbatch size 1) on
2 stages, one thread per rank: each action's compute is a few tens of microseconds, so the step time is the
runtime's own work per action (Python, autograd's bookkeeping, the point-to-point post, the trace) plus what a
step costs once (control, clip, optimizer). Both contenders are run as benchmarks/bench_pipeline.py runs them
(its helpers, imported); in every round each (schedule, m) runs pipegpt and torch.pp back to back, the order
swapped from one round to the next, so the machine's drift hits both alike. pipegpt runs twice: a driver call per
step, and --steps-per-call N (one call, one RPC round trip, for up to N steps) or auto (pipegpt's default: N
chosen once after 10 steps, from the round trip's share of a step). torch.pp's steps run free, one
after another with no collective of the benchmark's own between them, each timed from its start to the next
step's (the slowest rank's), as pipegpt's driver times its steps.

A line fitted by least squares over m, step_time = a + b * m, splits the median step times into the cost of one
microbatch (b) and of one step (a). Other processes only ever add time, so per (contender, m) the table takes the
least disturbed round (the smallest of the runs' median step times) and fits those; in brackets, the range of
each round's own fit. `pipegpt / torch`: pipegpt's figure over torch.pp's, per m and for the fits.

"host work" rows: each contender's step() alone on 2 fresh processes (pipegpt's PipelineRuntime with its Stages and
gloo point-to-point, torch.pp's schedule with its PipelineStages; no RPC, optimizer or clip), the CPU time of the
thread that runs it, summed over both ranks: the host's own work per step whatever the machine's load, where a step
time also carries the scheduler's delays. (A process's CPU would not do: gloo's loop thread spins while the pair's
lock is held elsewhere, so its CPU follows the step time.)

--py-spy DIR: every host-work run is recorded by py-spy (DIR/host-WHO-SCHEDULE-mM-roundR.speedscope.json), and a
last table splits each contender's stepping threads' samples under step() into parts: the model's forward (the
module's call, torch.pp's loss_fn), autograd's backward, posting point-to-point messages, waiting for them, and
the rest, the contender's own work (pipegpt's runtime and Stage; torch.pp's schedule and stage code): ms per step
at each m and, fitted over m, per microbatch: where the time grows with m.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline as bp  # noqa: E402  (a sibling script: its contenders, run the same way here)

CALLS = "pipegpt calls"  # pipegpt with --steps-per-call: one driver call for several steps

TINY = {"model": "tiny", "n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "vocab_size": 256, "untied": True}


def fit(ms: list[int], times: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line times = a + b * ms."""
    mean_m, mean_t = statistics.fmean(ms), statistics.fmean(times)
    b = sum((m - mean_m) * (t - mean_t) for m, t in zip(ms, times)) / sum((m - mean_m) ** 2 for m in ms)
    return mean_t - b * mean_m, b


def base_spec(args) -> dict:
    ns = argparse.Namespace(**TINY, stages=2, microbatches=max(args.microbatches), microbatch_size=1,
                            steps=args.steps, warmup=args.warmup, lr=1e-3, grad_clip=1.0, seed=1337, cores=None,
                            threads_per_worker=1, virtual_stages=None, bind_cores=args.bind_cores, schedules=None,
                            schedule="1f1b")
    base, _ = bp.build_specs(ns)
    return dict(base, torch_batch_gloo_loops=getattr(args, "torch_batch_gloo_loops", False))


# ----------------------------------------------------------------------------------------------------------
# The host's own work: each contender's step() alone (no RPC, optimizer or clip), the CPU time of the thread
# that runs it. Gloo's own threads are left out: they spin while a peer holds a pair's lock (gloo's loop
# retries until it gets it), so their CPU follows the step time, not the work.

def _host_worker(rank: int, world: int, port: int, who: str, spec: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from pipegpt.model.gpt import GPT
    from pipegpt.stages import Stage, partition_layers

    torch.set_num_threads(1)
    if spec.get("bind_cores"):  # as bench_pipeline's workers: rank r on a core of its own
        from pipegpt.engine.placement import worker_cores
        os.sched_setaffinity(0, worker_cores(rank, world, 1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if who == "pipegpt" or spec.get("torch_batch_gloo_loops"):  # as pipegpt's init_mesh does
        from pipegpt.comm.mesh import batch_gloo_loops
        batch_gloo_loops(expected=1)  # the default group's loop
    cfg, m, last = bp.model_cfg(spec), spec["microbatches"], world - 1
    module = GPT(cfg, layers=partition_layers(cfg.n_layer, world)[rank], embed=rank == 0, head=rank == last,
                 init_seed=spec["seed"])
    x, y = bp.sampler_for(spec).batch(0)
    if who == "pipegpt":
        from pipegpt.comm.p2p import PointToPoint
        from pipegpt.stages.runtime import PipelineRuntime
        from pipegpt.schedule import build_plan, lower

        runtime = PipelineRuntime(lower(build_plan(spec["schedule"], world, m)), rank, {rank: Stage(rank, world, module, m)},
                                  PointToPoint(rank, 60.0, "cpu"), list(range(world)), (1, cfg.seq_len, cfg.n_embd),
                                  torch.float32, "cpu")
        xs, ys = list(x.split(1)), list(y.split(1))

        def step():
            runtime.step(xs if rank == 0 else None, ys if rank == last else None, record=False)
    else:
        import torch.nn.functional as F
        from torch.distributed import pipelining

        def loss_fn(logits, target):  # as bench_pipeline's torch.pp contender
            return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), target.reshape(-1)) / m

        stage = pipelining.PipelineStage(module, rank, world, torch.device("cpu"))
        cls = getattr(pipelining, spec["torch_schedule"])
        schedule = cls([stage] if cls.__name__ in bp.MULTI_STAGE else stage, n_microbatches=m, loss_fn=loss_fn,
                       scale_grads=False)

        def step():
            schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])
    cpu = []
    for _ in range(spec["steps"]):
        for p in module.parameters():
            p.grad = None
        dist.barrier()
        c0 = time.thread_time()
        step()
        cpu.append(time.thread_time() - c0)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, cpu)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"step_times": [sum(steps) for steps in zip(*per_rank)]}))
    dist.barrier()
    dist.destroy_process_group()


def run_host_work(who: str, spec: dict, timeout: float, profile: str | None = None) -> dict:
    """_host_worker on 2 fresh processes (this file run as `_host WHO SPEC OUT`): per step, the summed CPU time
    of both ranks' stepping threads, as "step_times"; profile: a path, where py-spy records the run."""
    with tempfile.TemporaryDirectory(prefix="bench-host-") as workdir:
        spec_path, out_path = os.path.join(workdir, "spec.json"), os.path.join(workdir, "out.json")
        Path(spec_path).write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "_host", who, spec_path, out_path]
        if profile is not None:  # non-blocking: the ranks are not stopped for each sample
            cmd = [find_py_spy(), "record", "--nonblocking", "-r", str(PY_SPY_HZ), "--subprocesses", "--format",
                   "speedscope", "-o", profile, "--"] + cmd
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=workdir)
        if not os.path.exists(out_path):
            raise RuntimeError(f"host work of {who} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return json.loads(Path(out_path).read_text())


def measure(args, base: dict, schedules: list[str]) -> dict:
    """{(schedule, contender, m): [per-round result dict]}, contenders back to back, order swapped per round."""
    results: dict = {}
    for rnd in range(args.rounds):
        for m in args.microbatches:
            for s in schedules:
                # torch.pp's steps free-running: timed start to start, as pipegpt's driver times its own
                spec = dict(base, microbatches=m, schedule=s, torch_schedule=bp.TORCH_SCHEDULES[s], free_running=True,
                            steps_per_call=1)
                kinds = ["pipegpt", "torch", "pipegpt host", "torch host"] if bp.TORCH_SCHEDULES[s] else \
                    ["pipegpt", "pipegpt host"]
                if not args.host_work:
                    kinds = [k for k in kinds if not k.endswith(" host")]
                if args.steps_per_call != 1:
                    kinds.insert(1, CALLS)
                for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
                    try:
                        if kind.endswith(" host"):
                            who = kind.split()[0]
                            profile = None if args.py_spy is None else \
                                str(Path(args.py_spy, f"host-{who}-{s}-m{m}-round{rnd + 1}.speedscope.json"))
                            r = run_host_work(who, spec, args.timeout, profile)
                            if profile is not None:
                                r["parts"] = step_parts(profile, spec["steps"])
                        elif kind == CALLS:
                            r = bp.run_contender("pipegpt", dict(spec, steps_per_call=args.steps_per_call),
                                                 args.timeout)
                        else:
                            r = bp.run_contender(kind, spec, args.timeout)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        print(f"  round {rnd + 1} {s} m={m} {kind} FAILED: {str(e).splitlines()[0]}",
                              file=sys.stderr, flush=True)
                        r = None
                    results.setdefault((s, kind, m), []).append(r)
                    if r is not None:
                        print(f"  round {rnd + 1}/{args.rounds}  {s:<6} m={m:<4} {kind:<12} median step "
                              f"{1000 * timed_median(r, args.warmup, kind):7.1f} ms", file=sys.stderr, flush=True)
    return results


# ----------------------------------------------------------------------------------------------------------
# --py-spy: where the stepping threads' time goes

PY_SPY_HZ = 200
STEP_FRAME = "_host_worker.<locals>.step"
# (part, the frames that put a sample there): a sample goes to the part of its outermost such frame under
# step(); a sample under none of them is the contender's own work.
PARTS = (("forward", ("Module._wrapped_call_impl", "Module._call_impl", "_host_worker.<locals>.loss_fn")),
         ("backward", ("_run_backward", "_engine_run_backward")),
         ("p2p post", ("PointToPoint.post", "batch_isend_irecv", "isend", "irecv")),
         ("p2p wait", ("PointToPoint.wait", "PointToPoint._wait_host", "_wait_batch_p2p")))
OWN = "own work"


def find_py_spy() -> str:
    from pipegpt.observe.profile import find_py_spy as find

    found = find()
    if found is None:
        raise SystemExit("--py-spy: py-spy is not installed beside this interpreter nor on PATH (pip install py-spy)")
    return found


def step_parts(profile: str, steps: int) -> dict[str, float]:
    """{part: seconds per step} of a py-spy speedscope file: both ranks' samples under step(), by PARTS."""
    data = json.loads(Path(profile).read_text())
    names = [f["name"] for f in data["shared"]["frames"]]
    part_of = {name: part for part, frames in PARTS for name in frames}
    seconds = dict.fromkeys([part for part, _ in PARTS] + [OWN], 0.0)
    for thread in data["profiles"]:
        for stack, weight in zip(thread["samples"], thread["weights"]):
            frames = [names[i] for i in stack]
            if STEP_FRAME in frames:
                under = frames[frames.index(STEP_FRAME) + 1:]
                seconds[next((part_of[f] for f in under if f in part_of), OWN)] += weight
    return {part: t / steps for part, t in seconds.items()}


def parts_table(results: dict, schedules: list[str], ms: list[int]) -> list[list[str]]:
    """Per contender and part: the median over rounds of its ms per step at each m, and the slope over m."""
    rows = [["schedule", "contender", "part"] + [f"m={m} ms" for m in ms] + ["per microbatch ms", "share"]]
    for s in schedules:
        for kind in ("pipegpt host", "torch host"):
            runs = [[r["parts"] for r in results.get((s, kind, m), []) if r and "parts" in r] for m in ms]
            if not all(runs):
                continue
            label = "pipegpt" if kind == "pipegpt host" else f"torch.pp {bp.TORCH_SCHEDULES[s]}"
            per_m = {part: [statistics.median(r[part] for r in rs) for rs in runs] for part in runs[0][0]}
            whole = sum(per_m[part][-1] for part in per_m)
            for part, times in per_m.items():
                rows.append([s, label, part] + [f"{1000 * t:.2f}" for t in times] +
                            [f"{1000 * fit(ms, times)[1]:.3f}", f"{times[-1] / whole:.0%}" if whole else "n/a"])
    return rows


def timed_median(result: dict, warmup: int, kind: str, metric: str = "step") -> float:
    """Median over the timed steps of: "step" the step time as bench_pipeline reads it (a host-work kind: the
    stepping threads' CPU time); "workers" the workers' own time (pipegpt's less its RPC round trip, as torch.pp's
    workers time themselves)."""
    times = result["step_times"][warmup:]
    if metric == "workers" and kind == "pipegpt":
        times = [t - (c or 0.0) for t, c in zip(times, result["control_s"][warmup:])]
    return statistics.median(times)


def rounds_fit(results: dict, s: str, kind: str, ms: list[int], args, metric="step") -> list[tuple[float, float]]:
    fits = []
    for rnd in range(args.rounds):
        runs = [results[(s, kind, m)][rnd] for m in ms]
        if all(r is not None for r in runs):
            fits.append(fit(ms, [timed_median(r, args.warmup, kind, metric) for r in runs]))
    return fits


def ratio(x: float, y: float) -> str:
    """x / y, where both are costs (a fit can come out at or below zero when the noise is larger than it)."""
    return f"{x / y:.2f}x" if x > 0 and y > 0 else "n/a"


def paired(results: dict, s: str, kind: str, ms: list[int], args, metric: str = "step") -> list[str]:
    """Per m, the median over rounds of pipegpt's run over torch.pp's run of the same round (back to back, so
    the machine's drift between rounds cancels)."""
    out = []
    for m in ms:
        pairs = [(p, t) for p, t in zip(results[(s, kind, m)], results[(s, "torch", m)]) if p and t]
        ratios = [timed_median(p, args.warmup, kind, metric) / timed_median(t, args.warmup, "torch") for p, t in pairs]
        out.append(f"{statistics.median(ratios):.2f}x" if ratios else "n/a")
    return out


def table(results: dict, schedules: list[str], args, pick=min) -> list[list[str]]:
    """pick: how a (contender, m)'s rounds make its figure (min: the least disturbed; statistics.median), and
    with median, rows of the paired ratios by round."""
    ms = args.microbatches
    head = ["schedule", "contender"] + [f"m={m} ms" for m in ms] + ["per microbatch ms", "per step ms"]
    rows = [head]

    def ms_(x):
        return f"{1000 * x:.2f}"

    for s in schedules:
        fitted, bests = {}, {}
        torch_name = f"torch.pp {bp.TORCH_SCHEDULES[s]}"
        calls = f"pipegpt, {args.steps_per_call} steps a call"
        contenders = [("pipegpt", "pipegpt", "step"), ("pipegpt (in workers)", "pipegpt", "workers")]
        if args.steps_per_call != 1:
            contenders.insert(1, (calls, CALLS, "step"))
        if bp.TORCH_SCHEDULES[s]:
            contenders.append((torch_name, "torch", "step"))
        if args.host_work:
            contenders.append(("pipegpt host work", "pipegpt host", "step"))
            if bp.TORCH_SCHEDULES[s]:
                contenders.append((f"{torch_name} host work", "torch host", "step"))
        for label, kind, metric in contenders:
            best = []  # per m, the figure pick makes of its rounds
            for m in ms:
                runs = [r for r in results[(s, kind, m)] if r is not None]
                best.append(pick(timed_median(r, args.warmup, kind, metric) for r in runs) if runs else float("nan"))
            bests[label] = best
            a, b = fitted[label] = fit(ms, best)
            fits = rounds_fit(results, s, kind, ms, args, metric)
            spread = (lambda i: f" ({ms_(min(f[i] for f in fits))}-{ms_(max(f[i] for f in fits))})") if fits else \
                (lambda i: "")
            rows.append([s, label] + [f"{1000 * t:.1f}" for t in best] + [ms_(b) + spread(1), ms_(a) + spread(0)])
        if bp.TORCH_SCHEDULES[s]:
            for label, torch_label, metric in (("pipegpt", torch_name, "step"),
                                               *([(calls, torch_name, "step")] if args.steps_per_call != 1 else []),
                                               ("pipegpt (in workers)", torch_name, "workers"),
                                               *([("pipegpt host work", f"{torch_name} host work", "step")]
                                                 if args.host_work else [])):
                ratios = [ratio(p, t) for p, t in zip(bests[label], bests[torch_label])]
                (a, b), (ta, tb) = fitted[label], fitted[torch_label]
                rows.append([s, f"{label} / torch"] + ratios + [ratio(b, tb), ratio(a, ta)])
            if pick is not min:
                for label, kind in (("pipegpt", "pipegpt"), *([(calls, CALLS)] if args.steps_per_call != 1 else [])):
                    rows.append([s, f"{label} / torch, paired"] + paired(results, s, kind, ms, args) + ["", ""])
    return rows


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["_host"]:  # internal: one contender's host work, on 2 processes
        import torch.multiprocessing as mp

        from pipegpt.comm.rpc import free_port

        who, spec_path, out_path = argv[1:4]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        mp.spawn(_host_worker, args=(2, free_port(), who, json.loads(Path(spec_path).read_text()), out_path), nprocs=2,
                 join=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", default="16,64,128", help="comma list of m (at least two) [16,64,128]")
    ap.add_argument("--schedules", default="1f1b,zb-h1", help="comma list of pipegpt schedules [1f1b,zb-h1]")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each running every contender once [3]")
    ap.add_argument("--steps", type=int, default=12, help="steps per run [12]")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps of each run left out [2]")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one run may take [600]")
    ap.add_argument("--steps-per-call", default="8",
                    help="also run pipegpt with --steps-per-call N or auto (auto decides after 10 steps: give "
                         "--warmup 10 or more; 1: leave that contender out) [8]")
    ap.add_argument("--bind-cores", action="store_true",
                    help="pin each rank of both contenders to a core of its own, as `pipegpt run --bind-cores`")
    ap.add_argument("--torch-batch-gloo-loops", action="store_true",
                    help="give torch.pp's ranks what pipegpt's init_mesh does: gloo's loop threads under SCHED_BATCH")
    ap.add_argument("--no-host-work", dest="host_work", action="store_false",
                    help="leave out the host-work rows (their runs take about 40%% of a round)")
    ap.add_argument("--py-spy", default=None, metavar="DIR",
                    help="record every host-work run with py-spy into DIR and add a table of where its stepping "
                         "threads' time goes (forward, backward, p2p post, p2p wait, own work) per m")
    args = ap.parse_args(argv)
    if args.py_spy is not None:
        if not args.host_work:
            ap.error("--py-spy profiles the host-work runs: not with --no-host-work")
        find_py_spy()
        os.makedirs(args.py_spy, exist_ok=True)
    try:
        args.microbatches = sorted({int(m) for m in args.microbatches.split(",") if m.strip()})
    except ValueError:
        ap.error(f"--microbatches {args.microbatches!r}: a comma list of integers such as 16,64,128")
    if len(args.microbatches) < 2 or args.microbatches[0] < 2:
        ap.error(f"--microbatches {args.microbatches}: at least two values, each at least 2 (the stages)")
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for s in schedules:
        if s not in bp.TORCH_SCHEDULES:
            ap.error(f"--schedules: unknown schedule {s!r}: one of {', '.join(bp.TORCH_SCHEDULES)}")
    if args.steps_per_call != "auto":
        try:
            args.steps_per_call = int(args.steps_per_call)
        except ValueError:
            args.steps_per_call = 0
        if args.steps_per_call < 1:
            ap.error("--steps-per-call: a positive integer or auto")
    elif args.warmup < 10:
        ap.error(f"--steps-per-call auto decides after 10 steps: give --warmup 10 or more, not {args.warmup}")
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")

    base = base_spec(args)
    mdl = base["model"]
    print("host cost: pipegpt vs torch.distributed.pipelining, CPU, gloo, compute negligible")
    print(f"model       n_layer={mdl['n_layer']} n_embd={mdl['n_embd']} n_head={mdl['n_head']} "
          f"seq_len={mdl['seq_len']} vocab={mdl['vocab_size']} tied={mdl['tie_embeddings']}; microbatch size 1")
    print(f"pipeline    2 stages, 1 thread per rank; m = {', '.join(map(str, args.microbatches))}; "
          + "; ".join(f"{s} -> torch {bp.TORCH_SCHEDULES[s] or '(none)'}" for s in schedules))
    print(f"timing      {args.steps} steps per run, first {args.warmup} left out; {args.rounds} rounds, contenders "
          f"back to back, order swapped per round; step time as bench_pipeline measures it (pipegpt: the driver's "
          f"step_time_s; 'in workers': less the RPC round trip, as torch.pp's workers time themselves)")
    print("gloo loops  pipegpt's under SCHED_BATCH (its init_mesh); torch.pp's "
          + ("too (--torch-batch-gloo-loops)" if args.torch_batch_gloo_loops else "as torch leaves them"), flush=True)
    t_start, cpu_before = time.perf_counter(), bp._cpu_accounting()
    results = measure(args, base, schedules)
    print()
    from pipegpt.schedule.render import text_table

    right = set(range(2, 4 + len(args.microbatches)))
    print(text_table(table(results, schedules, args), right=right, rule=True))
    print("\n(per m the least disturbed round's median step; per microbatch / per step: the least-squares line over m, "
          "step = a + b m, of those steps, and in brackets the range of each round's own fit; x / torch: pipegpt's "
          "over torch.pp's)")
    if args.rounds > 1:
        print("\nThe same with, per m, the median over the rounds; paired: the median over rounds of pipegpt's run "
              "over torch.pp's run of the same round (back to back, so drift between rounds cancels):\n")
        print(text_table(table(results, schedules, args, pick=statistics.median), right=right, rule=True))
    if args.py_spy is not None:
        print(f"\nWhere the host work's time goes (py-spy at {PY_SPY_HZ} Hz, both ranks' samples under step(), per "
              f"step: the median over rounds; per microbatch: the least-squares slope over m; share: at m="
              f"{args.microbatches[-1]}; profiles in {args.py_spy}):\n")
        print(text_table(parts_table(results, schedules, args.microbatches), right=set(range(3, 5 + len(
            args.microbatches))), rule=True))
    print(f"\nTotal wall time {time.perf_counter() - t_start:.0f} s")
    print(bp._other_load(cpu_before, bp._cpu_accounting(), base["cores"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
