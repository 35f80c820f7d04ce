"""What one block of each layer kind, the embedding and the head (with the loss) cost on a device: `pipegpt run
--balance cost`.

Each piece is built alone as a model slice (the same GPT slices the stages are) and driven through a Stage on one
microbatch of the run's shape: forward then backward, timed together, `repeats` times after `warmup` untimed
runs; the least sample is the cost. Interference on a shared machine only adds time, and one head's samples
spread +-15%, so their median moved from process to process across the near-tie between two splits (the heavy
head's 6,2 against 7,1) and the split flipped; the least is steady, and near what the piece costs in a run.
Blocks of one kind have one shape, so one block of each kind (the first of the model's layers of that kind) stands
for all of that kind (pipegpt.arch.layer_kinds; pipegpt.costs.balance.per_layer_costs spreads them over the layers):
"block" is the dense kind's, "block.<kind>" another's (LayerKind.piece). The head's grows with the vocabulary. The
random state is left as it was (fork_rng), so a run's dropout does not depend on whether it was balanced.
"""
from __future__ import annotations

import time

import torch

from pipegpt.arch import layer_kinds
from pipegpt.config import ModelConfig
from pipegpt.model.gpt import GPT
from pipegpt.stages.stage import Stage

PIECES = ("embed", "block", "head")


def measure_layer_costs(model: ModelConfig, microbatch_size: int, device: torch.device, dtype: torch.dtype,
                        recompute: str = "none", autocast_dtype: torch.dtype | None = None, repeats: int = 15,
                        warmup: int = 3, seed: int = 0, pieces: tuple[str, ...] | None = None) -> dict[str, float]:
    """{"embed": s, "block": s, "head": s} (and "block.<kind>" for each other layer kind): least seconds of one
    microbatch's forward + backward of each piece; "<piece>_forward" and "<piece>_weight": the forward's share and
    the weight gradients' (the schedule synthesizer's F and W; the backward is timed as its two halves, the input
    gradient then the weights'). pieces: only these (None: all)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        B, T, C = microbatch_size, model.seq_len, model.n_embd
        tokens = torch.randint(0, model.vocab_size, (B, T), device=device)
        hidden = torch.randn(B, T, C, device=device, dtype=dtype)
        grad = torch.ones(B, T, C, device=device, dtype=dtype)
        first = {}
        for i, kind in enumerate(layer_kinds(model)):
            first.setdefault(kind.piece, i)
        slices = {"embed": (0, dict(layers=range(0), embed=True, head=False)),
                  **{piece: (1, dict(layers=range(i, i + 1), embed=False, head=False)) for piece, i in first.items()},
                  "head": (2, dict(layers=range(0), embed=False, head=True))}
        slices = {piece: at for piece, at in slices.items() if pieces is None or piece in pieces}
        out = {}
        for piece, (index, where) in slices.items():
            module = GPT(model, recompute=recompute, init_seed=seed, **where).to(device, dtype)
            stage = Stage(index, 3, module, 1, autocast_dtype)
            inputs = tokens if piece == "embed" else hidden
            times, forward_times, weight_times = [], [], []
            for k in range(warmup + repeats):
                _sync(device)
                t0 = time.perf_counter()
                y = stage.forward(0, inputs, tokens if piece == "head" else None)
                _sync(device)
                t1 = time.perf_counter()
                stage.backward(0, None if piece == "head" else grad, split=True)
                _sync(device)
                t2 = time.perf_counter()
                stage.backward_weight(0)
                _sync(device)
                if k >= warmup:
                    times.append(time.perf_counter() - t0)
                    forward_times.append(t1 - t0)
                    weight_times.append(time.perf_counter() - t2)
                module.zero_grad(set_to_none=True)
            stage.pop_losses()
            out[piece] = min(times)
            out[f"{piece}_forward"] = min(min(forward_times), out[piece])
            out[f"{piece}_weight"] = min(min(weight_times), out[piece] - out[f"{piece}_forward"])
            del module, stage
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
