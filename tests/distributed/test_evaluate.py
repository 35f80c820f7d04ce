"""Evaluation: the forward-only plan, run by the same runtime, gives the one-process model's validation loss.
(The plan itself, for every schedule, is tests/unit/test_evaluation_plan.py.)"""
from __future__ import annotations

import pytest
import torch

from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.data.loader import BatchSampler
from pipegpt.data.tokenizers import get_tokenizer
from pipegpt.data.tokens import builtin_tokens
from pipegpt.model.gpt import build_reference_model

from cluster_host import ClusterHost

MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, n_embd=32)
BATCHES = 2


def reference_val_loss(cfg: TrainConfig) -> float:
    """The mean microbatch loss over the eval batches, in one process: windows of the built-in corpus drawn
    with seed + 1 (it has no held-out split), the same global batches for every layout."""
    model = build_reference_model(cfg.model, cfg.runtime.seed).to(getattr(torch, cfg.runtime.dtype)).eval()
    sampler = BatchSampler(builtin_tokens(get_tokenizer("bytes")), cfg.batch_size, cfg.model.seq_len,
                           cfg.runtime.seed + 1)
    losses = []
    with torch.no_grad():
        for k in range(BATCHES):
            x, y = sampler.batch(k)
            mbs = cfg.parallel.microbatch_size
            losses += [float(model(xm, ym)) for xm, ym in zip(x.split(mbs), y.split(mbs))]
    return sum(losses) / len(losses)


GRIDS = {"p2": {"stages": 2}, "p2-dp2": {"stages": 2, "dp": 2}, "p2-tp2": {"stages": 2, "tp": 2}}
SCHEDULE_CASES = [("1f1b", "p2"), ("zbv", "p2"), ("interleaved-1f1b", "p2"), ("zb-h1", "p2-dp2"), ("1f1b", "p2-tp2")]


@pytest.fixture(scope="module")
def hosts():
    made = {}
    yield lambda grid, cfg: made.setdefault(grid, ClusterHost(cfg))
    for host in made.values():
        host.close()


# p2-tp2 is slow: its own worker grid; tensor-parallel forwards are checked against one process by the oracle.
@pytest.mark.parametrize("schedule,grid", [pytest.param(s, g, marks=pytest.mark.slow) if g == "p2-tp2" else (s, g)
                                           for s, g in SCHEDULE_CASES], ids=[f"{s}-{g}" for s, g in SCHEDULE_CASES])
def test_validation_loss_equals_one_process(hosts, schedule, grid):
    cfg = TrainConfig.build(MODEL, schedule=schedule, microbatches=4, microbatch_size=2, device="cpu", seed=3,
                            timeout_s=60, eval_batches=BATCHES, **GRIDS[grid])
    loss = hosts(grid, cfg).evaluate(cfg)
    assert loss == pytest.approx(reference_val_loss(cfg), rel=1e-5)
