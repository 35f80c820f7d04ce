"""What one block of a model costs on this machine's CPU under several settings, each an intra-op thread count and
a microbatch size: what `pipegpt plan --calibrate` scales a CPU run's compute by where a layout's ranks get another
number of threads than the calibration run's (pipegpt.costs.calibrated.ThreadScaling), or carry another number of
sequences per microbatch (MicrobatchScaling).

The planner is torch-free, so it runs this as a child process of its own (as planner/trial.py runs `pipegpt run`):

    python -m pipegpt.stages.block_timing '{"model": {...}, "settings": [[1, 2], [2, 2]]}'

prints [[1, 2, seconds], [2, 2, seconds]]: for each [threads, microbatch size], the least of the forward + backward
passes of one block of the run's model (pipegpt.stages.measure, the --balance cost measurement, block alone) over
rounds that take the settings in turn, `repeats` passes each: a burst of load elsewhere then falls on every
setting, not on one. At least `rounds` rounds, and more while they take under `budget_s` in all: a small block's
ratios of a few percent need many passes on a shared machine to find each setting's quiet one, and a large
block's passes are long enough to need few. A fresh process holds nothing else, and the block is what the
calibrated scale applies to; a plain matmul would leave out attention, the norms and the elementwise passes,
which threads and larger microbatches speed up less. A size of 0 asks for the optimizer instead: one AdamW step over
the model's parameters at that thread count (what a calibrated CPU run's optimizer term scales by).

With "at_once": k (one setting), the block is timed alone and in k processes at once, rounds alternating the two:
prints [[threads, size, alone, shared]]. Ranks on one machine slow each other down (memory bandwidth, caches);
a layout with fewer of them than the calibration run's computes faster by their ratio (ThreadScaling).
"""
from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import time

import torch

from pipegpt.config import ModelConfig
from pipegpt.stages.measure import measure_layer_costs

REPEATS = 3  # the least of the passes: interference only adds time (pipegpt.stages.measure)
ROUNDS = 2
BUDGET_S = 3.0
MAX_ROUNDS = 30
OPTIMIZER = 0  # a setting's size 0: the optimizer's step over the model's parameters, not the block
OPTIMIZER_PARAMS = 64 * 2**20  # at most this many parameters timed (1 GiB with the moments and gradients)


def block_seconds(model: ModelConfig, settings, recompute: str = "none", dtype: str = "float32",
                  bf16: bool = False, repeats: int = REPEATS, rounds: int = ROUNDS,
                  budget_s: float = BUDGET_S) -> dict[tuple[int, int], float]:
    """{(threads, microbatch size): least seconds of one block's forward + backward on the CPU (size 0: of one
    optimizer step, optimizer_step_seconds)}."""
    out, before, start, done = {}, torch.get_num_threads(), time.perf_counter(), 0
    try:
        while done < rounds or (done < MAX_ROUNDS and time.perf_counter() - start < budget_s):
            done += 1
            for threads, size in settings:
                torch.set_num_threads(int(threads))
                if int(size) == OPTIMIZER:
                    seconds = optimizer_step_seconds(model, repeats)
                else:
                    seconds = _block_pass(model, int(size), recompute, dtype, bf16, repeats)
                key = (int(threads), int(size))
                out[key] = min(out.get(key, seconds), seconds)
    finally:
        torch.set_num_threads(before)
    return out


def optimizer_step_seconds(model: ModelConfig, repeats: int = REPEATS) -> float:
    """Least seconds of one AdamW step (foreach, as on a CPU rank: pipegpt.train.optim) over the whole model's fp32
    parameters, up to OPTIMIZER_PARAMS of them: elementwise and bound by memory, so a second thread's gain depends
    on what the step's tensors and moments take against the caches (one block's fit them far better than a
    model's), and the model's own size is what its ranks update."""
    from pipegpt.model.gpt import GPT

    with torch.device("meta"):  # the shapes alone, at any size
        shapes = [p.shape for p in GPT(model, init_seed=0).parameters()]
    params, total = [], 0
    for shape in shapes:
        if total >= OPTIMIZER_PARAMS:
            break
        params.append(torch.nn.Parameter(torch.randn(shape)))
        params[-1].grad = torch.randn(shape)
        total += params[-1].numel()
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    times = []
    for k in range(1 + repeats):
        t0 = time.perf_counter()
        optimizer.step()
        if k:
            times.append(time.perf_counter() - t0)
    return min(times)


SHARED_ROUNDS = 6
BARRIER_TIMEOUT_S = 300.0  # a process at once that died or hangs ends the timing instead of stalling it


def shared_block_seconds(model: ModelConfig, threads: int, size: int, at_once: int, recompute: str = "none",
                         dtype: str = "float32", bf16: bool = False, rounds: int = SHARED_ROUNDS,
                         repeats: int = REPEATS) -> tuple[float, float]:
    """(alone, shared): one block's least seconds timed alone in this process, and that times the median over
    rounds of each round's shared over alone (shared: the mean over the `at_once` processes of their least
    seconds timed all at once). Rounds alternate the two, and each round's ratio is of timings taken side by
    side: a burst of load elsewhere moves a round, not the median."""
    ctx = multiprocessing.get_context("spawn")
    barrier, answers = ctx.Barrier(at_once, timeout=BARRIER_TIMEOUT_S), ctx.Queue()
    args = (model, threads, size, recompute, dtype, bf16, rounds, repeats, barrier)
    others = [ctx.Process(target=_time_beside, args=(*args, answers), daemon=True) for _ in range(at_once - 1)]
    for process in others:
        process.start()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        alone, shared = [], []
        for _ in range(rounds):
            barrier.wait()
            shared.append(_block_pass(model, size, recompute, dtype, bf16, repeats))
            barrier.wait()  # the others wait at the next round's start while this one times alone
            alone.append(_block_pass(model, size, recompute, dtype, bf16, repeats))
        theirs = [answers.get(timeout=BARRIER_TIMEOUT_S) for _ in others]
    finally:
        torch.set_num_threads(before)
        for process in others:
            process.join(timeout=BARRIER_TIMEOUT_S)
            if process.is_alive():
                process.kill()
    ratios = [statistics.mean(times) / a for a, times in zip(alone, zip(shared, *theirs))]
    return min(alone), min(alone) * statistics.median(ratios)


def _time_beside(model, threads, size, recompute, dtype, bf16, rounds, repeats, barrier, answers) -> None:
    torch.set_num_threads(threads)
    shared = []
    for _ in range(rounds):
        barrier.wait()
        shared.append(_block_pass(model, size, recompute, dtype, bf16, repeats))
        barrier.wait()
    answers.put(shared)


def _block_pass(model: ModelConfig, size: int, recompute: str, dtype: str, bf16: bool, repeats: int) -> float:
    return measure_layer_costs(model, size, torch.device("cpu"), getattr(torch, dtype), recompute,
                               torch.bfloat16 if bf16 else None, repeats=repeats, warmup=1, pieces=("block",))["block"]


def main(argv=None) -> int:
    request = json.loads((sys.argv[1:] if argv is None else argv)[0])
    fields = set(ModelConfig.__dataclass_fields__)
    model = ModelConfig(**{k: v for k, v in request["model"].items() if k in fields})
    options = (request.get("recompute", "none"), request.get("dtype", "float32"), bool(request.get("bf16", False)))
    if request.get("at_once"):
        (threads, size), = request["settings"]
        alone, shared = shared_block_seconds(model, int(threads), int(size), int(request["at_once"]), *options)
        print(json.dumps([[threads, size, alone, shared]]))
        return 0
    seconds = block_seconds(model, request["settings"], *options)
    print(json.dumps([[threads, size, s] for (threads, size), s in seconds.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
