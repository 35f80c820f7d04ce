"""Context parallelism on CPU: activation bytes per rank, forward + backward time, bytes sent; measured beside the
planner's model (pipegpt.costs).

    .venv/bin/python benchmarks/bench_context_parallel.py                    # memory at seq 4096, time at 2048
    .venv/bin/python benchmarks/bench_context_parallel.py --memory-seq 8192 --cps 1,2,4 --repeats 5
    .venv/bin/python benchmarks/bench_context_parallel.py --memory-seq 0 --cps 1,2 --repeats 7 --rounds 5
                                                                             # time only, cp 2 on 2 cores
    .venv/bin/python benchmarks/bench_context_parallel.py --profile --cps 2 --repeats 5
                                                          # CPU by op and thread: a cp rank beside one process

Every cp rank is a process (gloo) holding the whole one-stage model and two chunks of each sequence, as a
`pipegpt run --cp N --stages 1` rank does. Measured per configuration:
- activation bytes: the storages alive after the forward (a TorchDispatchMode sees every tensor an op returns,
  tests/unit/plan_memory_harness.py's StorageTracker), less the parameters: what the rank keeps for its backward;
  the largest over ranks, beside pipegpt.costs.activations.activation_bytes for the same sharding;
- forward + backward ms: the median over repeats, cp configurations alternated (each run starts its processes
  anew), threads per rank = cores / cp so every configuration uses the same cores; and each rank's CPU time
  (all its threads, gloo's included) beside one process's on one thread divided by cp: what a rank spends beyond
  its share, which a loaded machine changes far less than the wall time (two ranks or two threads that wait
  for each other lose whole time slices when other processes hold the cores);
- bytes sent per forward + backward by the attention (context_parallel.attention.bytes_sent), beside the count
  the cost model uses;
- the planner's prediction (pipegpt.planner.search.evaluate_layout, one stage, one microbatch: the simulator's
  compute and exposed cp communication, no gradient sync) on this machine as a cluster of CPU ranks: compute
  at the speed that makes its one-process step the measured one on one thread, links measured first (two gloo
  processes on one thread each swapping 4 KiB, then a K/V block, each way: latency and bandwidth), memory
  bandwidth from one thread copying the merged output block (the ring's merges). Beside the walls: predicted
  over cp 1 at the cores' threads (its wall measured: the calibrated planner's thread scaling, measured too);
  beside the CPU: predicted over one thread's work / cp.
--profile instead: one process on one thread over the whole sequence, then every cp rank on one thread, each op's
CPU time (the thread's, around each aten op) and each thread's (schedstat), by category and by op beside the one
process's share: where a rank's CPU goes beyond its share, gloo's threads included.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(rank: int, cp: int, comm: str, seq: int, args, port: int, threads: int):
    """This rank's one-stage model (cp-sharded) and its chunks of one batch of tokens, the same on every run."""
    import torch
    import torch.distributed as dist

    from pipegpt.config import ModelConfig
    from pipegpt.context_parallel.chunks import shard_sequence
    from pipegpt.context_parallel.layers import shard_for_cp
    from pipegpt.model.gpt import GPT

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp,
                            timeout=timedelta(seconds=120))
    model_cfg = ModelConfig(vocab_size=256, seq_len=seq, n_layer=args.n_layer, n_head=args.n_head,
                            n_embd=args.n_embd, arch=args.arch, n_kv_head=args.n_kv_head, bias=args.arch == "gpt2")
    model = shard_for_cp(GPT(model_cfg, init_seed=1), rank, cp, dist.group.WORLD if cp > 1 else None, comm)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.microbatch_size, seq), generator=g)
    y = torch.randint(0, 256, (args.microbatch_size, seq), generator=g)
    return model, shard_sequence(x, rank, cp), shard_sequence(y, rank, cp)


def _rank(rank: int, cp: int, comm: str, seq: int, args, port: int, threads: int, out) -> None:
    import torch.distributed as dist

    from pipegpt.context_parallel import attention
    from plan_memory_harness import StorageTracker

    model, x, y = _setup(rank, cp, comm, seq, args, port, threads)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    times, cpu, activation, sent = [], [], None, None
    for i in range(args.repeats + 1):
        for p in model.parameters():
            p.grad = None
        attention.reset_bytes_sent()
        if i == 0:  # the first pass (not timed) measures what the forward keeps
            model(x, y).backward()  # after a warm pass: what the first forward caches once (rotary tables,
            for p in model.parameters():  # a cp rank's positions) is no activation
                p.grad = None
            with StorageTracker() as tracker:
                loss = model(x, y)
                activation = tracker.held(params)
            loss.backward()
            sent = attention.bytes_sent()
            continue
        if cp > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        model(x, y).backward()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # every thread of the rank: its intra-op threads, gloo's
    out.put((rank, activation, sent, statistics.median(times), statistics.median(cpu)))
    dist.destroy_process_group()


def _spawn(target, cp: int, comm: str, seq: int, args, threads: int) -> list:
    """Run target in one process per cp rank; what each put on the queue, in rank order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=target, args=(r, cp, comm, seq, args, port, threads, out)) for r in range(cp)]
    for p in procs:
        p.start()
    rows = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return rows


def _link_rank(rank: int, cp: int, comm: str, seq: int, args, port: int, threads: int, out) -> None:
    """Two ranks swap a small message and a K/V block (both ways at once, as a ring step), each --repeats x 10
    times: (median seconds of each, seconds of one thread cloning the fp32 output block)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    tokens = args.microbatch_size * seq // 2
    kv_width = 2 * (args.n_kv_head or args.n_head) * (args.n_embd // args.n_head)
    times = []
    for numel in (1024, tokens * kv_width):
        send, recv = torch.ones(numel), torch.empty(numel)
        spent = []
        for i in range(10 * args.repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, 1 - rank),
                                                dist.P2POp(dist.irecv, recv, 1 - rank)]):
                work.wait()
            spent.append(time.perf_counter() - t0)
        times.append(statistics.median(spent[2:]))
    block, into = torch.randn(tokens * args.n_embd), torch.empty(tokens * args.n_embd)
    copies = []
    for _ in range(10 * args.repeats + 2):
        t0 = time.perf_counter()
        into.copy_(block)  # into a buffer already touched, as the merges' in-place passes
        copies.append(time.perf_counter() - t0)
    copies = copies[2:]
    out.put((rank, times[0], times[1], statistics.median(copies)))
    dist.destroy_process_group()


def measure_link(seq: int, args) -> dict:
    """This machine as the planner's cluster sees it: gloo's latency and bandwidth between two processes,
    one thread's copy bandwidth (the cost model's HBM)."""
    rows = _spawn(_link_rank, 2, "ring", seq, args, 1)
    small, large, copy = (max(r[i] for r in rows) for i in (1, 2, 3))
    kv_bytes = 4 * args.microbatch_size * seq // 2 * 2 * (args.n_kv_head or args.n_head) * (args.n_embd // args.n_head)
    out_bytes = 4 * args.microbatch_size * seq // 2 * args.n_embd
    link = {"latency_s": small, "bytes_per_s": kv_bytes / max(large - small, 1e-9), "copy_bytes_per_s": out_bytes / copy}
    print(f"this machine's links (gloo, two processes on one thread each): {small * 1e6:.0f} us a 4 KiB swap, "
          f"{large * 1e3:.3f} ms a K/V block of {kv_bytes / 2**20:.2f} MiB: {link['bytes_per_s'] / 1e9:.2f} GB/s; "
          f"one thread copies {link['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    return link


def planner_ms(cp: int, comm: str, seq: int, args, link: dict, one_thread_ms: float) -> dict:
    """The planner's forward + backward for one cp rank on one thread (see the module docstring): {"ms", "cp_ms"
    (exposed cp communication), "describe"}. Compute is scaled so that cp 1's prediction is one_thread_ms."""
    from dataclasses import replace

    from pipegpt.config import ModelConfig
    from pipegpt.costs.cost import AnalyticalCosts
    from pipegpt.costs.devices import make_cluster
    from pipegpt.planner.candidates import Layout, Request
    from pipegpt.planner.search import evaluate_layout

    model = ModelConfig(vocab_size=256, seq_len=seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                        arch=args.arch, n_kv_head=args.n_kv_head, bias=args.arch == "gpt2")

    def predict(c: int, tflops: float) -> dict:
        cluster = make_cluster(c, c, gpu_memory="64GiB", gpu_tflops=tflops, intra_node=link["bytes_per_s"],
                               precision="fp32", hbm=link["copy_bytes_per_s"], reserve=0,
                               name="CPU rank (this machine)")
        cluster = replace(cluster, latency_intra_s=link["latency_s"])
        costs = AnalyticalCosts(cluster, efficiency=1.0, layer_overhead_s=0.0)  # the measurement has the host
        result = evaluate_layout(Request(model, args.microbatch_size, cluster, costs),
                                 Layout(1, 1, 1, "1f1b", 1, 1, args.microbatch_size, cp=c, cp_comm=comm))
        parts = result.breakdown  # the busiest rank's; the bench runs no gradient sync and no optimizer
        ms = sum(parts[k] for k in ("compute", "recompute", "tp_comm", "cp_comm", "idle")) * 1e3
        return {"ms": ms, "cp_ms": parts["cp_comm"] * 1e3}

    tflops = 1.0
    for _ in range(4):  # compute ~ 1 / tflops; the memory-bound terms make it a fixed point
        tflops *= predict(1, tflops)["ms"] / one_thread_ms
    return predict(cp, tflops) | {"tflops": tflops}


def measure(cp: int, comm: str, seq: int, args, threads: int | None = None) -> dict:
    rows = _spawn(_rank, cp, comm, seq, args, threads or max(1, args.cores // cp))
    return {"activation": max(r[1] for r in rows), "sent": max(r[2] for r in rows),
            "ms": max(r[3] for r in rows) * 1e3, "cpu_ms": max(r[4] for r in rows) * 1e3}


def predicted(cp: int, comm: str, seq: int, args) -> tuple[int, int | None]:
    """(activation bytes, bytes sent per forward + backward) as pipegpt.costs models them."""
    from pipegpt.config import ModelConfig
    from pipegpt.costs import activations
    from pipegpt.dims import Sharding

    model = ModelConfig(vocab_size=256, seq_len=seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                        arch=args.arch, n_kv_head=args.n_kv_head, bias=args.arch == "gpt2")
    sharding = Sharding(cp=cp)
    act = activations.activation_bytes(model, args.n_layer, microbatch_size=args.microbatch_size, sharding=sharding,
                                       embed=True, head=True, device="cpu")
    try:
        from pipegpt.costs.cost import cp_bytes_per_layer
    except ImportError:
        return act, None
    return act, cp_bytes_per_layer(model, args.microbatch_size, sharding, comm) * args.n_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory-seq", type=int, default=4096, help="0: no memory table")
    ap.add_argument("--time-seq", type=int, default=2048)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--comms", default="ring,allgather")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-kv-head", type=int, default=None)
    ap.add_argument("--arch", default="gpt2")
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds of the timing runs")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--profile", action="store_true",
                    help="only the table of CPU time by op: one cp rank beside one process on one thread")
    args = ap.parse_args()
    cps, comms = [int(c) for c in args.cps.split(",")], args.comms.split(",")
    print(f"model: {args.arch} {args.n_layer} layers x {args.n_embd} wide, {args.n_head} heads"
          f"{f' ({args.n_kv_head} kv)' if args.n_kv_head else ''}, microbatch {args.microbatch_size}; "
          f"{args.cores} cores, threads per rank = cores / cp")
    if args.profile:
        return profile_table(cps, comms, args)
    if args.memory_seq:
        memory_table(cps, comms, args)
    time_table(cps, comms, args)


def memory_table(cps, comms, args) -> None:
    print(f"\nactivation bytes per rank and bytes sent per forward + backward, seq {args.memory_seq}:")
    print("| cp | comm | activation MiB | predicted MiB | vs cp 1 | sent MiB | predicted sent MiB |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for cp in cps:
        for comm in (comms if cp > 1 else comms[:1]):
            got = measure(cp, comm, args.memory_seq, args)
            act, sent = predicted(cp, comm, args.memory_seq, args)
            base = base or got["activation"]
            print(f"| {cp} | {comm if cp > 1 else '-'} | {got['activation'] / 2**20:.1f} | {act / 2**20:.1f} | "
                  f"{got['activation'] / base:.2f} | {got['sent'] / 2**20:.2f} | "
                  f"{'-' if sent is None else f'{sent / 2**20:.2f}'} |")


def time_table(cps, comms, args) -> None:
    """Wall time per forward + backward, and CPU time per rank (all its threads) beside the work of one process
    on one thread shared by cp: what a rank spends beyond its share, as CPU, whatever else the machine runs."""
    print(f"\nforward + backward, seq {args.time_seq} (median of {args.repeats} per run; {args.rounds} rounds "
          f"alternated; load average {os.getloadavg()[0]:.1f} at the start):")
    work = (1, comms[0], 1)  # the reference: one process, one thread
    configs = [work] + [(cp, comm, max(1, args.cores // cp)) for cp in cps for comm in (comms if cp > 1 else comms[:1])]
    runs = {c: [] for c in configs}
    for _ in range(args.rounds):
        for c in configs:
            runs[c].append(measure(c[0], c[1], args.time_seq, args, threads=c[2]))
    wall = {c: statistics.median(r["ms"] for r in rs) for c, rs in runs.items()}
    cpu = {c: statistics.median(r["cpu_ms"] for r in rs) for c, rs in runs.items()}
    first = configs[1]
    link = measure_link(args.time_seq, args)
    planned = {c: planner_ms(c[0], c[1], args.time_seq, args, link, wall[work]) for c in configs}
    print(f"the planner's CPU ranks: those links, compute at {planned[first]['tflops'] * 1e3:.1f} GFLOP/s (fitted)")
    print("| cp | comm | threads per rank | wall ms (median of rounds) | rounds min..max | wall vs cp 1 | "
          "predicted vs cp 1 | CPU ms per rank (busiest) | CPU vs one thread's / cp | "
          "predicted vs one thread's / cp | predicted cp comm ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c, rs in runs.items():
        cp, comm, threads = c
        ms, pred = [r["ms"] for r in rs], planned[c]
        # cp 1 at the cores' threads: its wall stands for the planner's (the calibrated planner measures the
        # threads' speedup too), so the predicted columns are for one thread per rank
        ahead, share = (f"{pred['ms'] / wall[first]:.2f}", f"{pred['ms'] / (planned[work]['ms'] / cp):.3f}") \
            if threads == 1 else ("1.00", "-")
        print(f"| {cp} | {comm if cp > 1 else '-'} | {threads} | {wall[c]:.0f} | {min(ms):.0f}..{max(ms):.0f} | "
              f"{wall[c] / wall[first]:.2f} | {ahead} | {cpu[c]:.0f} | {cpu[c] / (cpu[work] / cp):.2f} | "
              f"{share} | {pred['cp_ms']:.2f} |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


# --profile: where a cp rank's CPU goes, op by op, beside one process on one thread doing the whole sequence.
# Every figure is CPU time of the thread that spent it (CLOCK_THREAD_CPUTIME_ID around each aten op; each thread's
# schedstat run time), so another process holding the cores stretches the walls but hardly these.

_KERNELS = {"_scaled_dot_product_flash_attention_for_cpu": "attention kernel forward",
            "_scaled_dot_product_flash_attention_for_cpu_backward": "attention kernel backward"}
_CP_REGIONS = {"merge_into": "log-sum-exp merges", "shift": "gloo send/recv posted (main thread)",
               "wait": "gloo send/recv posted (main thread)", "block_forward": "around the block kernels",
               "block_backward": "around the block kernels"}


def _op_timer():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCpuTimes(TorchDispatchMode):
        """Thread CPU ns per (where, aten op): where is the innermost pipegpt.context_parallel function on the
        stack (or "model"), read outside the timed span."""

        def __init__(self):
            super().__init__()
            self.ns: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.thread_time_ns()
            result = func(*args, **(kwargs or {}))
            spent = time.thread_time_ns() - t0
            frame, where = sys._getframe(1), "model"
            while frame is not None:
                if f"pipegpt{os.sep}context_parallel{os.sep}" in frame.f_code.co_filename:
                    where = frame.f_code.co_name
                    break
                frame = frame.f_back
            key = (where, str(func.overloadpacket).removeprefix("aten."))
            self.ns[key] = self.ns.get(key, 0) + spent
            return result

    del torch
    return OpCpuTimes()


def _thread_cpu_ns() -> dict[int, tuple[str, int]]:
    """{thread id: (name, ns on a CPU so far)} of this process (Linux schedstat)."""
    threads = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            threads[int(task.name)] = (stat[stat.index("(") + 1:stat.rindex(")")],
                                       int((task / "schedstat").read_text().split()[0]))
        except OSError:  # a thread that ended meanwhile
            pass
    return threads


def _profile_rank(rank: int, cp: int, comm: str, seq: int, args, port: int, threads: int, out) -> None:
    import threading

    import torch.distributed as dist

    model, x, y = _setup(rank, cp, comm, seq, args, port, threads)
    main = threading.get_native_id()
    model(x, y).backward()  # warm-up: kernels chosen, buffers allocated, gloo's pairs connected
    per_thread: list[dict[str, float]] = []
    for _ in range(args.repeats):
        if cp > 1:
            dist.barrier()
        before = _thread_cpu_ns()
        model(x, y).backward()
        spent: dict[str, float] = {}
        for tid, (name, ns) in _thread_cpu_ns().items():
            name = "main thread" if tid == main else f"thread {name}"
            spent[name] = spent.get(name, 0.0) + (ns - before.get(tid, (name, 0))[1]) / 1e6
        per_thread.append(spent)
    ops: dict = {}
    for _ in range(args.repeats):
        if cp > 1:
            dist.barrier()
        with _op_timer() as timer:
            model(x, y).backward()
        for key, ns in timer.ns.items():
            ops[key] = ops.get(key, 0.0) + ns / 1e6 / args.repeats
    threads_ms = {name: statistics.median(p.get(name, 0.0) for p in per_thread) for p in per_thread for name in p}
    out.put((rank, threads_ms, ops))
    if cp > 1:
        dist.destroy_process_group()


def _category(where: str, op: str) -> str:
    if op in _KERNELS:
        return _KERNELS[op]
    if op.startswith("c10d."):
        return "gloo send/recv posted (main thread)"
    if where == "model":
        return "model (matmuls, GELU, norms, loss...)"
    return _CP_REGIONS.get(where, "ring/all-gather bookkeeping (stack, slices, zeros, +=, casts)")


def profile_table(cps, comms, args) -> None:
    """One process on one thread over the whole sequence, then each cp configuration (one thread per rank): per
    category and per op, CPU ms per forward + backward (mean of --repeats instrumented passes) and each rank's
    excess over its share (the one process's / cp)."""
    seq = args.time_seq
    base = _spawn(_profile_rank, 1, comms[0], seq, args, 1)[0]
    link = measure_link(seq, args)
    print(f"\nCPU ms per forward + backward by category and op, seq {seq}, one thread per process (thread CPU time, "
          f"mean of {args.repeats} passes under a dispatch-mode timer; threads: median of {args.repeats} plain passes):")
    for cp in [c for c in cps if c > 1]:
        for comm in comms:
            rows = _spawn(_profile_rank, cp, comm, seq, args, 1)
            _print_profile(cp, comm, base, rows)
            # the planner calibrated to the one process's CPU (all threads): a rank's time over its share
            one = sum(base[1].values())
            pred = planner_ms(cp, comm, seq, args, link, one)
            print(f"the planner: a rank at x{pred['ms'] / (one / cp):.3f} of its share, {pred['cp_ms']:.2f} ms of it "
                  f"cp communication exposed, the rest its merges")


def _print_profile(cp: int, comm: str, base, rows) -> None:
    ranks = [f"rank {r[0]}" for r in rows]
    share = {k: v / cp for k, v in base[2].items()}
    print(f"\ncp {cp} {comm}:")
    print(f"| category | one process | its share (/{cp}) | " + " | ".join(ranks) + " | mean rank - share |")
    print("|---|---|---|" + "---|" * len(ranks) + "---|")
    cats: dict = {}
    for src, table in [("one", base[2])] + [(name, r[2]) for name, r in zip(ranks, rows)]:
        for (where, op), ms in table.items():
            row = cats.setdefault(_category(where, op), {})
            row[src] = row.get(src, 0.0) + ms
    for src, r in [("one", base)] + list(zip(ranks, rows)):
        for name, ms in r[1].items():
            if name != "main thread" and ms >= 0.05:
                cats.setdefault(f"{name} (gloo's: the transfers)", {})[src] = ms
        # plain passes' main thread less the timed passes' ops: Python and autograd (noisy on a loaded machine)
        timed = sum(r[2].values())
        cats.setdefault("main thread outside the ops", {})[src] = r[1]["main thread"] - timed
    total = {src: sum(row.get(src, 0.0) for row in cats.values()) for src in ["one"] + ranks}
    for name, row in sorted(cats.items(), key=lambda kv: -kv[1].get("one", 0.0) - kv[1].get(ranks[0], 0.0)) + [
            ("total (all threads)", total)]:
        mean = sum(row.get(r, 0.0) for r in ranks) / len(ranks)
        print(f"| {name} | {row.get('one', 0.0):.2f} | {row.get('one', 0.0) / cp:.2f} | "
              + " | ".join(f"{row.get(r, 0.0):.2f}" for r in ranks) + f" | {mean - row.get('one', 0.0) / cp:+.2f} |")
    main = {src: r[1]["main thread"] for src, r in [("one", base)] + list(zip(ranks, rows))}
    print("CPU per rank over its share, all threads: " + ", ".join(
        f"{r} {total[r] / (total['one'] / cp):.3f}" for r in ranks) + "; the main thread alone: " + ", ".join(
        f"{r} {main[r] / (main['one'] / cp):.3f}" for r in ranks))
    print(f"\n| op (where) | one process / {cp} | " + " | ".join(ranks) + " |")
    print("|---|---|" + "---|" * len(ranks))
    keys = set(base[2]) | {k for r in rows for k in r[2]}
    diffs = {k: sum(r[2].get(k, 0.0) for r in rows) / len(rows) - share.get(k, 0.0) for k in keys}
    for key in sorted(keys, key=lambda k: -abs(diffs[k])):
        if abs(diffs[key]) < 0.1 and share.get(key, 0.0) < 1.0:
            continue
        print(f"| {key[1]} ({key[0]}) | {share.get(key, 0.0):.2f} | "
              + " | ".join(f"{r[2].get(key, 0.0):.2f}" for r in rows) + " |")


if __name__ == "__main__":
    main()
