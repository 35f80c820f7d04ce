"""Context parallelism on CPU: activation bytes per rank, forward + backward time, bytes sent; measured beside the
planner's model (pipegpt.costs).

    .venv/bin/python benchmarks/bench_context_parallel.py                    # memory at seq 4096, time at 2048
    .venv/bin/python benchmarks/bench_context_parallel.py --memory-seq 8192 --cps 1,2,4 --repeats 5
    .venv/bin/python benchmarks/bench_context_parallel.py --memory-seq 0 --cps 1,2 --repeats 7 --rounds 5
                                                                             # time only, cp 2 on 2 cores

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
  the cost model uses.
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


def _rank(rank: int, cp: int, comm: str, seq: int, args, port: int, threads: int, out) -> None:
    import torch
    import torch.distributed as dist

    from pipegpt.config import ModelConfig
    from pipegpt.context_parallel import attention
    from pipegpt.context_parallel.chunks import shard_sequence
    from pipegpt.context_parallel.layers import shard_for_cp
    from pipegpt.model.gpt import GPT
    from plan_memory_harness import StorageTracker

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp,
                            timeout=timedelta(seconds=120))
    model_cfg = ModelConfig(vocab_size=256, seq_len=seq, n_layer=args.n_layer, n_head=args.n_head,
                            n_embd=args.n_embd, arch=args.arch, n_kv_head=args.n_kv_head, bias=args.arch == "gpt2")
    model = shard_for_cp(GPT(model_cfg, init_seed=1), rank, cp, dist.group.WORLD if cp > 1 else None, comm)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.microbatch_size, seq), generator=g)
    y = torch.randint(0, 256, (args.microbatch_size, seq), generator=g)
    x, y = shard_sequence(x, rank, cp), shard_sequence(y, rank, cp)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    times, cpu, activation, sent = [], [], None, None
    for i in range(args.repeats + 1):
        for p in model.parameters():
            p.grad = None
        attention.reset_bytes_sent()
        if i == 0:  # the first pass (not timed) measures what the forward keeps
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


def measure(cp: int, comm: str, seq: int, args, threads: int | None = None) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    threads = threads or max(1, args.cores // cp)
    procs = [ctx.Process(target=_rank, args=(r, cp, comm, seq, args, port, threads, out)) for r in range(cp)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
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
    args = ap.parse_args()
    cps, comms = [int(c) for c in args.cps.split(",")], args.comms.split(",")
    print(f"model: {args.arch} {args.n_layer} layers x {args.n_embd} wide, {args.n_head} heads"
          f"{f' ({args.n_kv_head} kv)' if args.n_kv_head else ''}, microbatch {args.microbatch_size}; "
          f"{args.cores} cores, threads per rank = cores / cp")
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
    print("| cp | comm | threads per rank | wall ms (median of rounds) | rounds min..max | wall vs cp 1 | "
          "CPU ms per rank (busiest) | CPU vs one thread's / cp |")
    print("|---|---|---|---|---|---|---|---|")
    for c, rs in runs.items():
        cp, comm, threads = c
        ms = [r["ms"] for r in rs]
        print(f"| {cp} | {comm if cp > 1 else '-'} | {threads} | {wall[c]:.0f} | {min(ms):.0f}..{max(ms):.0f} | "
              f"{wall[c] / wall[first]:.2f} | {cpu[c]:.0f} | {cpu[c] / (cpu[work] / cp):.2f} |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")

if __name__ == "__main__":
    main()
