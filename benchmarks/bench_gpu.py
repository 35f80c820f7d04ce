"""One GPU, one command: the GPU smoke suite, GPT-2 124M bf16 throughput and MFU, the planner's memory beside
`torch.cuda.max_memory_allocated`.

    .venv/bin/python benchmarks/bench_gpu.py                          # on a machine with a CUDA GPU
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --model tiny --microbatch-size 2 --steps 4   # dry run

What it does, in order, each part timed and reported even when an earlier one failed:
  1. `pytest -m gpu` (every test that needs a GPU: the CUDA/NCCL control path on one rank in
     tests/distributed/test_gpu_smoke.py, fused AdamW, the device's generators): passed or the failures;
  2. `pipegpt run --stages 1 --precision bf16 --model gpt2 --pad-vocab ...` as a user runs it, eager and then
     with `--compile` (--compile off|on|both, both by default; vocabulary padded to 50,304 as nanoGPT and llm.c
     do; the built-in corpus, so nothing is downloaded): per step tokens/s and MFU from metrics.jsonl (medians
     after --warmup steps; MFU against pipegpt's table of peaks, or --peak-tflops);
  3. each run's model, plan and microbatch size through the planner's memory model (pipegpt.costs.memory, the
     one `pipegpt plan` uses): predicted bytes beside the run's measured peak (max_memory_allocated on CUDA; on
     CPU the process's peak RSS, which also holds the interpreter and torch).
The table prints on stdout and goes to --json as well (a device run's $OUT). On a lent machine (its python3
holds PyTorch, click, tiktoken, safetensors and pytest; the tests run the `pipegpt` console script, which the
offline editable install puts beside that python3; about 3 minutes on an H200):

    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
    PYTHONUNBUFFERED=1 python3 benchmarks/bench_gpu.py --json $OUT/gpu.json 2>&1 | tee $OUT/gpu.log
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pipegpt.costs.activations import memory_precision  # noqa: E402
from pipegpt.costs.memory import plan_memory  # noqa: E402
from pipegpt.model_config import ModelConfig  # noqa: E402
from pipegpt.schedule import build_plan  # noqa: E402
from pipegpt.stages import partition_layers  # noqa: E402

PIPEGPT = [sys.executable, "-m", "pipegpt"]


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """The command's result; one past its time comes back as exit status 124 (a later part still runs)."""
    try:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(command, 124, out, f"no end within {timeout_s:g} s (--timeout)")


def smoke(timeout_s: float) -> dict:
    start = time.perf_counter()
    proc = _run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-m", "gpu", "tests"], timeout_s)
    summary = (proc.stdout.strip().splitlines() or [proc.stderr.strip() or "(no output)"])[-1]
    return {"exit": proc.returncode, "summary": summary, "seconds": round(time.perf_counter() - start, 1),
            "output_tail": (proc.stdout + proc.stderr)[-6000:]}  # the failures, in --json


def train(args, run_dir: Path, compiled: bool) -> dict:
    command = [*PIPEGPT, "run", "--stages", "1", "--device", args.device, "--model", args.model,
               "--precision", args.precision, "--microbatches", str(args.microbatches),
               "--microbatch-size", str(args.microbatch_size), "--steps", str(args.steps), "--log-every", "1",
               "--pad-vocab", "--run-dir", str(run_dir)]
    if compiled:
        command.append("--compile")
    if args.peak_tflops:
        command += ["--peak-tflops", str(args.peak_tflops)]
    start = time.perf_counter()
    proc = _run(command, args.timeout)
    result = {"command": " ".join(command[3:]), "exit": proc.returncode, "seconds": round(time.perf_counter() - start, 1)}
    if proc.returncode != 0:
        result["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return result
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[args.warmup:] or rows
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    result.update({"steps_timed": len(timed), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
                   "step_ms": 1000 * statistics.median(r["step_time_s"] for r in timed),
                   "mfu": statistics.median(mfus) if mfus else None,
                   "measured_peak_bytes": max(rows[-1]["peak_memory_per_rank"]),
                   "device_name": _device_name(args.device)})
    return result


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else device


def predicted(run_dir: Path) -> dict:
    """The planner's memory model on the run's own settings (config.json). The run is one stage on one rank, so
    no sharding, layer split or context parallelism enters (pipegpt.train.driver's host-memory check reads a
    whole TrainConfig the same way)."""
    config = json.loads((run_dir / "config.json").read_text())
    model, parallel, runtime = ModelConfig(**config["model"]), config["parallel"], config["runtime"]
    plan = build_plan(parallel["schedule"], 1, parallel["microbatches"])
    device = "cuda" if runtime.get("device") == "cuda" else "cpu"
    (rank,) = plan_memory(model, plan, partition_layers(model.n_layer, plan.num_stages),
                          microbatch_size=parallel["microbatch_size"], recompute=parallel["recompute"],
                          precision=memory_precision(runtime["precision"], runtime["dtype"]), device=device)
    return {"predicted_bytes": rank.total, "weights": rank.weights, "gradients": rank.gradients,
            "optimizer": rank.optimizer, "activations": rank.activations, "workspace": rank.workspace}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--microbatch-size", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="leading steps left out of the medians [5]")
    ap.add_argument("--compile", nargs="?", const="on", default="both", choices=["off", "on", "both"],
                    help="the run eager (off), with --compile (on) or one of each, eager first [both]")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak for MFU (default: its table)")
    ap.add_argument("--no-smoke", action="store_true", help="leave out the smoke suite")
    ap.add_argument("--timeout", type=float, default=420, help="seconds each part may take [420]")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    out: dict = {}
    if not args.no_smoke:
        out["smoke"] = smoke(args.timeout)
    out["runs"] = []
    for compiled in {"off": [False], "on": [True], "both": [False, True]}[args.compile]:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            run = {"compile": compiled, **train(args, run_dir, compiled)}
            if run["exit"] == 0:
                run["memory"] = predicted(run_dir)
        out["runs"].append(run)
    _print(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


def _print(out: dict) -> None:
    if "smoke" in out:
        s = out["smoke"]
        outcome = "FAILED" if s["exit"] != 0 else "passed" if "passed" in s["summary"] else "did not run"
        print(f"smoke suite: {outcome} ({s['summary']}; {s['seconds']} s)")
        if s["exit"] != 0:
            print(s["output_tail"])
    gib = 2 ** 30
    rows = []
    for t in out["runs"]:
        print(f"run: pipegpt {t['command']}")
        if t["exit"] != 0:
            print(f"  failed (exit {t['exit']}): {t['error']}")
            continue
        m = t["memory"]
        mfu = "n/a (no peak known: --peak-tflops)" if t["mfu"] is None else f"{100 * t['mfu']:.1f}%"
        rows.append(f"| {t['device_name'] or '?'} | {'compiled' if t['compile'] else 'eager'} | "
                    f"{t['tokens_per_s']:,.0f} | {t['step_ms']:.1f} | {mfu} | {t['measured_peak_bytes'] / gib:.2f} | "
                    f"{m['predicted_bytes'] / gib:.2f} | {m['predicted_bytes'] / t['measured_peak_bytes']:.2f} |")
        parts = ", ".join(f"{k} {m[k] / gib:.2f}" for k in ("weights", "gradients", "optimizer", "activations",
                                                            "workspace"))
        print(f"  predicted, GiB: {parts} (medians over {t['steps_timed']} steps)")
    if rows:
        print("| device | run | tokens/s | step ms | MFU | measured peak GiB | predicted GiB | predicted / measured |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        print("\n".join(rows))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
