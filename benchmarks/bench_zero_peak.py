"""ZeRO's peak memory per rank: the peak of tensor bytes by kind (pipegpt.observe.tensor_bytes) and the process's
peak RSS, beside the planner's predicted peak (pipegpt.costs.memory.plan_memory: each kind's own peak, their sum;
held_peak: the most held at one point between actions, what the count sees), for zero 0-3 and both of ZeRO-3's
gather policies at dp 2 and dp 4.

    python benchmarks/bench_zero_peak.py                                   # the issue's model: 8 x 512, vocab 4096
    python benchmarks/bench_zero_peak.py --n-layer 4 --n-embd 256 --dp 2   # smaller, quicker
    python benchmarks/bench_zero_peak.py --malloc-env                       # glibc returns freed memory (see below)

One pipeline rank holding a stage per block (interleaved-1f1b, v = n_layer: FSDP per block under --unshard
microbatch), one microbatch per step unless --microbatches; fp32 on CPU gloo, each layout a fresh job in a child
process. Tensor bytes: the last step's peak (recorded), the largest rank's; RSS: the process's max resident size
(ru_maxrss, which counts the interpreter, torch and gloo too: compare its differences between rows, not its
level); counting: what the step's samples cost the recorded step, beside the step's time (ms). --malloc-env runs
the workers with MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set (glibc hands large freed blocks back to
the system; not set by default: docs/parallelism.md says why).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

KINDS = ("parameters", "gathered", "gradients", "optimizer", "activations", "messages")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


def measure(spec: dict) -> dict:
    """In a child process: `steps` steps of the layout; per rank the last step's tensor bytes and peak RSS."""
    from pipegpt.config import ModelConfig, TrainConfig
    from pipegpt.train.driver import Job

    model = ModelConfig(vocab_size=spec["vocab"], seq_len=spec["seq_len"], n_layer=spec["n_layer"],
                        n_head=spec["n_head"], n_embd=spec["n_embd"])
    extra = {"unshard": spec["unshard"]} if spec["zero"] == 3 else {}
    cfg = TrainConfig.build(model, dp=spec["dp"], stages=1, zero=spec["zero"], schedule="interleaved-1f1b",
                            virtual_stages=spec["n_layer"], microbatches=spec["m"], microbatch_size=spec["mbs"],
                            steps=spec["steps"], device="cpu", timeout_s=600, **extra)
    with Job(cfg, threads_per_worker=1) as job:
        job.start()
        for step in range(spec["steps"]):
            results = job.step(step)
        job.close()
    return {"tensor_bytes": [r.tensor_bytes for r in results], "rss": [r.peak_memory for r in results],
            "step_s": [r.compute_s for r in results]}


def run_child(spec: dict, env: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                         timeout=3600, env={**os.environ, **env})
    if out.returncode:
        raise SystemExit(f"{spec}: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--malloc-env", action="store_true", help=f"run the workers with {MALLOC_ENV}")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return
    base = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "vocab": args.vocab,
            "seq_len": args.seq_len, "m": args.microbatches, "mbs": args.microbatch_size, "steps": args.steps}
    env = MALLOC_ENV if args.malloc_env else {}
    layouts = [(z, "step") for z in range(4)] + [(3, "microbatch")]
    print(f"GPT-2 shape: {args.n_layer} layers x {args.n_embd}, vocab {args.vocab}, seq {args.seq_len}; "
          f"{args.microbatches} x {args.microbatch_size} sequences per replica, a stage per block on one pipeline "
          f"rank, fp32, CPU gloo{'; ' + ' '.join(f'{k}={v}' for k, v in env.items()) if env else ''}")
    print("MiB per rank at the step's peak (the largest rank): measured tensor bytes by kind, their total, the "
          "planner's total (each kind's peak, with workspace) and held peak (one point, no workspace), the "
          "process's peak RSS")
    print(f"{'dp':>3}{'zero':>5}{'gather':>11}" + "".join(f"{k[:8]:>10}" for k in KINDS)
          + f"{'total':>10}{'planned':>10}{'held':>8}{'RSS':>9}{'counting':>14}")
    for dp in args.dp:
        for zero, policy in layouts:
            got = run_child({**base, "dp": dp, "zero": zero, "unshard": policy}, env)
            worst = max(range(dp), key=lambda r: got["tensor_bytes"][r]["total"])
            tb = got["tensor_bytes"][worst]
            planned, held = ((tb.get("predicted") or {}).get(k) for k in ("total", "held"))
            print(f"{dp:>3}{zero:>5}{policy if zero == 3 else '':>11}"
                  + "".join(f"{mib(tb['by_kind'][k]):>10}" for k in KINDS)
                  + f"{mib(tb['total']):>10}{mib(planned):>10}{mib(held):>8}{mib(max(got['rss'])):>9}"
                  + f"{1e3 * tb['sampling_s']:>7.1f}/{1e3 * got['step_s'][worst]:.0f}ms", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
