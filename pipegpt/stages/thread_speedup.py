"""What one block of a model costs on this machine's CPU at each of several intra-op thread counts: the measured
thread speedup that `pipegpt plan --calibrate` scales a CPU run's compute by where a layout's ranks get another
number of threads than the calibration run's (pipegpt.costs.calibrated.ThreadScaling).

The planner is torch-free, so it runs this as a child process of its own (as planner/trial.py runs `pipegpt run`):

    python -m pipegpt.stages.thread_speedup '{"model": {...}, "microbatch_size": 2, "threads": [1, 2]}'

prints {"1": seconds, "2": seconds}: the least of `repeats` forward + backward passes of one block of the run's
model at its microbatch size (pipegpt.stages.measure, the --balance cost measurement, block alone). A fresh process
holds nothing else, and the block is what the calibrated scale applies to; a plain matmul would leave out
attention, the norms and the elementwise passes, which threads speed up less.
"""
from __future__ import annotations

import json
import sys

import torch

from pipegpt.config import ModelConfig
from pipegpt.stages.measure import measure_layer_costs

REPEATS = 3  # the least of three: interference only adds time (pipegpt.stages.measure)


def block_seconds(model: ModelConfig, microbatch_size: int, threads, recompute: str = "none",
                  dtype: str = "float32", bf16: bool = False, repeats: int = REPEATS) -> dict[int, float]:
    """{threads: least seconds of one block's forward + backward on the CPU at that many intra-op threads}."""
    out, before = {}, torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(int(n))
            out[int(n)] = measure_layer_costs(model, microbatch_size, torch.device("cpu"), getattr(torch, dtype),
                                              recompute, torch.bfloat16 if bf16 else None, repeats=repeats,
                                              warmup=1, pieces=("block",))["block"]
    finally:
        torch.set_num_threads(before)
    return out


def main(argv=None) -> int:
    request = json.loads((sys.argv[1:] if argv is None else argv)[0])
    fields = set(ModelConfig.__dataclass_fields__)
    model = ModelConfig(**{k: v for k, v in request["model"].items() if k in fields})
    seconds = block_seconds(model, int(request["microbatch_size"]), request["threads"],
                            request.get("recompute", "none"), request.get("dtype", "float32"),
                            bool(request.get("bf16", False)))
    print(json.dumps({str(k): v for k, v in seconds.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
