"""Inference where the model lives, against one process: generation's tokens/s and HellaSwag's examples/s.

    .venv/bin/python benchmarks/bench_inference.py                     # 1, 2, 4 stages x 1, 4, 16 prompts
    .venv/bin/python benchmarks/bench_inference.py --stages 1,2 --prompts 4 --n-layer 8 --n-embd 512

A weights-only checkpoint of a GPT-2-shaped model (random weights, bytes vocabulary) is written once. One process:
the whole model, the batched sampler (pipegpt.infer.generation.generate_in_process: all prompts in one left-padded
batch) and the one-process HellaSwag scorer (pipegpt.data.hellaswag.score). Workers: `--stages S` workers
(pipegpt.infer.job.InferenceJob), the prompts in min(S, prompts) groups through the stages, HellaSwag one example
per microbatch, 2 x S microbatches a step; every job stays up, and each round every contender takes its turn
at each measurement (interleaved: the machine's drift hits them alike). Every process computes on --threads intra-op threads (default 1: on a
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


def timed(run) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = run()
    return time.perf_counter() - t0, result


class OneProcess:
    """The whole model here: the batched sampler and the one-process HellaSwag scorer."""

    def __init__(self, path: Path, file: Path, args):
        import torch

        from pipegpt.data.hellaswag import read_examples
        from pipegpt.infer.sampling import SamplingSettings
        from pipegpt.tools.sample import load_model

        torch.set_num_threads(args.threads)
        self.model, _, _ = load_model(path, "cpu")
        self.settings = SamplingSettings(args.max_new_tokens, 0, None, 0, 256)
        self.file, self.examples = file, read_examples(file)

    def run(self, what: str, n: int | None = None) -> tuple[float, object]:
        from pipegpt.data.hellaswag import score
        from pipegpt.infer.generation import generate_in_process

        if what == "generate":
            return timed(lambda: generate_in_process(self.model, prompts_for(n), self.settings))
        return timed(lambda: score(self.model, self.examples, "bytes", self.file))

    def close(self) -> None:
        pass


def serve_workers(path: str, file: str, stages: int, args, conn) -> None:
    """In a process of its own (RPC starts once per process): the job of `stages` workers, timing what it is asked."""
    from pipegpt.data.hellaswag import read_examples, render_all
    from pipegpt.infer.job import InferenceJob, Layout
    from pipegpt.infer.sampling import SamplingSettings

    settings = SamplingSettings(args.max_new_tokens, 0, None, 0, 256)
    with InferenceJob(path, Layout(stages), device="cpu", timeout_s=300, warn=lambda line: None,
                      threads_per_worker=args.threads) as job:
        job.start()
        examples = read_examples(file)
        rendered = render_all(examples, "bytes", job.model.seq_len, 256, file)
        conn.send("ready")
        while (asked := conn.recv()) is not None:
            what, n = asked
            if what == "generate":
                conn.send(timed(lambda: job.generate(prompts_for(n), settings)[0]))
            else:
                conn.send(timed(lambda: job.hellaswag(examples, rendered)))


class Workers:
    """A job of `stages` workers in a child process, asked over a pipe (its answers timed there)."""

    def __init__(self, path: Path, file: Path, stages: int, args):
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=serve_workers, args=(str(path), str(file), stages, args,
                                                                                child))
        self.proc.start()
        assert self.conn.recv() == "ready"

    def run(self, what: str, n: int | None = None) -> tuple[float, object]:
        self.conn.send((what, n))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=120)


def measure(contenders: dict, args) -> dict:
    """Per contender the least seconds (and the result) of each measurement over --repeats rounds after a warm-up
    round; within a round the contenders take turns, so the machine's drift hits them alike."""
    best: dict = {name: {} for name in contenders}
    jobs = [("generate", n) for n in args.prompts] + [("hellaswag", None)]
    for round_ in range(args.repeats + 1):
        for job in jobs:
            for name, contender in contenders.items():
                seconds, result = contender.run(*job)
                if round_ and (job not in best[name] or seconds < best[name][job][0]):
                    best[name][job] = (seconds, result)
    return best


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
        contenders = {"one": OneProcess(path, file, args)}
        try:
            for stages in layouts:  # started one after another, then all kept up while measured in turns
                contenders[stages] = Workers(path, file, stages, args)
            best = measure(contenders, args)
        finally:
            for contender in contenders.values():
                contender.close()
    after = _cpu_accounting()

    cores = len(os.sched_getaffinity(0))
    print(f"GPT-2 shape: {args.n_layer} layers, n_embd {args.n_embd}, seq_len {args.seq_len}; greedy, "
          f"{args.max_new_tokens} new tokens per prompt; best of {args.repeats}; {cores} CPU cores, "
          f"{args.threads} thread{'s' * (args.threads > 1)} per process")
    print(f"{'stages':>6} {'prompts':>7} {'one process tok/s':>18} {'workers tok/s':>14} {'speedup':>8} {'same':>5}")
    for stages in layouts:
        for n in args.prompts:
            (one, expected), (got, tokens) = best["one"][("generate", n)], best[stages][("generate", n)]
            rate = lambda seconds: n * args.max_new_tokens / seconds  # noqa: E731
            print(f"{stages:>6} {n:>7} {rate(one):>18.1f} {rate(got):>14.1f} {one / got:>7.2f}x "
                  f"{'yes' if tokens == expected else 'NO':>5}")
    examples_per_s = lambda name: args.hellaswag_examples / best[name][("hellaswag", None)][0]  # noqa: E731
    print(f"HellaSwag ({args.hellaswag_examples} examples): one process {examples_per_s('one'):.1f} examples/s; "
          + "; ".join(f"{s} stage{'s' * (s > 1)} {examples_per_s(s):.1f}" for s in layouts))
    print(_other_load(before, after, cores))


if __name__ == "__main__":
    main()
