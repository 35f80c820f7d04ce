"""Inference where the model lives, against one process: generation's tokens/s and HellaSwag's examples/s.

    .venv/bin/python benchmarks/bench_inference.py                     # 1, 2, 4 stages x 1, 4, 16 prompts
    .venv/bin/python benchmarks/bench_inference.py --stages 1,2 --prompts 4 --n-layer 8 --n-embd 512

A weights-only checkpoint of a GPT-2-shaped model (random weights, bytes vocabulary) is written once. One process:
the whole model, the batched sampler (pipegpt.infer.generation.generate_in_process: all prompts in one left-padded
batch) and the one-process HellaSwag scorer (pipegpt.data.hellaswag.score). Workers: `--stages S` workers
(pipegpt.infer.job.InferenceJob), the prompts in min(S, prompts) groups through the stages, HellaSwag one example
per microbatch, 2 x S microbatches a step. Every process computes on --threads intra-op threads (default 1: on a
busy machine two threads of tiny matmuls spin against each other, measured 14x slower here). Each figure is the
best of --repeats timed runs after one untimed (warm-up); tokens/s counts new tokens only (prompts x
--max-new-tokens). Greedy: the workers' tokens are checked equal to the one process's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_pipeline import _cpu_accounting, _other_load  # noqa: E402 (how busy the machine was meanwhile)

WORDS = ("the pipeline sends activations forward and gradients back while every stage keeps its own cache of keys "
         "and values so that a token costs one position per stage").split()


def prompts_for(n: int) -> list[list[int]]:
    """n prompts of 8..39 bytes, different lengths."""
    return [list(" ".join(WORDS[(3 * i) % len(WORDS):][:2 + i % 6]).encode()[:8 + (7 * i) % 32]) for i in range(n)]


def hellaswag_file(path: Path, n: int) -> Path:
    lines = []
    for i in range(n):
        ctx = " ".join(WORDS[(i * 5) % len(WORDS):][:6 + i % 5])
        endings = [" ".join(WORDS[(i * 7 + 3 * k) % len(WORDS):][:2 + (i + k) % 4]) for k in range(4)]
        lines.append(json.dumps({"ctx": ctx, "endings": endings, "label": i % 4}))
    path.write_text("\n".join(lines) + "\n")
    return path


def make_checkpoint(path: Path, args):
    import torch

    from pipegpt.config import ModelConfig
    from pipegpt.model.gpt import GPT
    from pipegpt.state import checkpoint

    model = ModelConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                        n_embd=args.n_embd)
    gpt = GPT(model, init_seed=1)
    with torch.no_grad():  # away from the initial values, so that the tokens vary
        g = torch.Generator().manual_seed(1)
        for p in gpt.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    checkpoint.write_weights(path, {n: p.detach() for n, p in gpt.named_parameters()},
                             {"model": dataclasses.asdict(model), "tokenizer": "bytes"})


def best_of(repeats: int, run) -> tuple[float, object]:
    """(least seconds of `repeats` timed runs after an untimed one, the last result)."""
    result, times = run(), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - t0)
    return min(times), result


def one_process(path: Path, file: Path, args) -> dict:
    from pipegpt.data.hellaswag import read_examples, score
    from pipegpt.infer.generation import generate_in_process
    from pipegpt.infer.sampling import SamplingSettings
    from pipegpt.tools.sample import load_model

    import torch

    torch.set_num_threads(args.threads)
    model, _, _ = load_model(path, "cpu")
    settings = SamplingSettings(args.max_new_tokens, 0, None, 0, 256)
    out = {"generate": {}}
    for n in args.prompts:
        seconds, tokens = best_of(args.repeats, lambda: generate_in_process(model, prompts_for(n), settings))
        out["generate"][n] = {"seconds": seconds, "tokens": tokens}
    examples = read_examples(file)
    out["hellaswag"] = {"seconds": best_of(args.repeats, lambda: score(model, examples, "bytes", file))[0],
                        "examples": len(examples)}
    return out


def on_workers(path: str, file: str, stages: int, args, conn) -> None:
    """In a process of its own (RPC starts once per process): the job of `stages` workers, timed."""
    from pipegpt.data.hellaswag import read_examples, render_all
    from pipegpt.infer.job import InferenceJob, Layout
    from pipegpt.infer.sampling import SamplingSettings

    settings = SamplingSettings(args.max_new_tokens, 0, None, 0, 256)
    with InferenceJob(path, Layout(stages), device="cpu", timeout_s=300, warn=lambda line: None,
                      threads_per_worker=args.threads) as job:
        job.start()
        out = {"generate": {}}
        for n in args.prompts:
            prompts = prompts_for(n)
            seconds, tokens = best_of(args.repeats, lambda: job.generate(prompts, settings)[0])
            out["generate"][n] = {"seconds": seconds, "tokens": tokens}
        examples = read_examples(file)
        rendered = render_all(examples, "bytes", job.model.seq_len, 256, file)
        out["hellaswag"] = {"seconds": best_of(args.repeats, lambda: job.hellaswag(examples, rendered))[0],
                            "examples": len(examples)}
    conn.send(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default="1,2,4", help="worker layouts: pipeline stages (default 1,2,4)")
    parser.add_argument("--prompts", default="1,4,16", help="prompts generated together (default 1,4,16)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hellaswag-examples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every process (default 1)")
    args = parser.parse_args()
    args.prompts = [int(x) for x in args.prompts.split(",")]
    layouts = [int(x) for x in args.stages.split(",")]
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

    before = _cpu_accounting()
    with tempfile.TemporaryDirectory() as tmp:
        path, file = Path(tmp) / "ckpt", hellaswag_file(Path(tmp) / "hellaswag.jsonl", args.hellaswag_examples)
        make_checkpoint(path, args)
        base = one_process(path, file, args)
        measured = {}
        for stages in layouts:
            parent, child = mp.get_context("spawn").Pipe()
            proc = mp.get_context("spawn").Process(target=on_workers, args=(str(path), str(file), stages, args, child))
            proc.start()
            measured[stages] = parent.recv()
            proc.join(timeout=60)
    after = _cpu_accounting()

    cores = len(os.sched_getaffinity(0))
    print(f"GPT-2 shape: {args.n_layer} layers, n_embd {args.n_embd}, seq_len {args.seq_len}; greedy, "
          f"{args.max_new_tokens} new tokens per prompt; best of {args.repeats}; {cores} CPU cores, "
          f"{args.threads} thread{'s' * (args.threads > 1)} per process")
    print(f"{'stages':>6} {'prompts':>7} {'one process tok/s':>18} {'workers tok/s':>14} {'speedup':>8} {'same':>5}")
    for stages in layouts:
        for n in args.prompts:
            one, got = base["generate"][n], measured[stages]["generate"][n]
            rate = lambda r: n * args.max_new_tokens / r["seconds"]  # noqa: E731
            print(f"{stages:>6} {n:>7} {rate(one):>18.1f} {rate(got):>14.1f} {rate(got) / rate(one):>7.2f}x "
                  f"{'yes' if got['tokens'] == one['tokens'] else 'NO':>5}")
    print(f"HellaSwag ({args.hellaswag_examples} examples): one process "
          f"{base['hellaswag']['examples'] / base['hellaswag']['seconds']:.1f} examples/s; "
          + "; ".join(f"{s} stage{'s' * (s > 1)} {m['hellaswag']['examples'] / m['hellaswag']['seconds']:.1f}"
                      for s, m in measured.items()))
    print(_other_load(before, after, cores))


if __name__ == "__main__":
    main()
