"""Dropout under tensor parallelism (pipegpt.tensor_parallel.rng) against the one-process model.

Two gloo processes (tp=2) train one step of a whole GPT with dropout from the stream they share
(pipegpt.state.rng), recording every dropout mask they draw (aten's bernoulli_, under a dispatch mode that
changes nothing). Then, per dropout site: the masks of a sharded region (the attention probabilities of a rank's
heads; under sequence parallelism every site, over a sequence chunk) differ between the ranks, those of a
replicated region are equal; and the one-process model, whose dropout is handed those masks (joined over heads or
sequence chunks, one copy where replicated), computes the ranks' loss and every gradient. With recomputation the
masks drawn again in backward must be the forward's, or the gradients would not match.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from pipegpt.comm.rpc import free_port
from pipegpt.config import ModelConfig
from pipegpt.model.gpt import GPT
from pipegpt.state import rng
from pipegpt.tensor_parallel import gather_full
from pipegpt.tensor_parallel.layers import partial_grad_params, shard_for_tp

TP, SEED = 2, 99
CFG = ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, n_embd=16, dropout=0.3)
CASES = {  # name: (sequence parallelism, recomputation)
    "plain": (False, "none"), "sp": (True, "none"), "full-recompute": (False, "full"),
    "sp-selective-recompute": (True, "selective")}

pytestmark = pytest.mark.usefixtures("one_thread")


class Masks(TorchDispatchMode):
    """Records each dropout mask drawn (`given` None) or hands out the given ones in order instead."""

    def __init__(self, given: list[torch.Tensor] | None = None):
        super().__init__()
        self.given, self.drawn, self.phase = given, {"forward": [], "backward": []}, "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bernoulli_.float and self.given is not None:
            return args[0].copy_(self.given.pop(0))
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.drawn[self.phase].append(out.clone())
        return out


def batch():
    g = torch.Generator().manual_seed(5)
    return (torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g),
            torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g))


def train_step(model: GPT, masks: Masks) -> dict:
    x, y = batch()
    with masks:
        loss = model(x, y)
        masks.phase = "backward"
        loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "masks": masks.drawn}


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP,
                            timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(TP)))
    results = {}
    for name, (sp, recompute) in CASES.items():
        model = GPT(CFG, recompute=recompute, init_seed=SEED)
        shard_for_tp(model, rank, TP, group, sequence_parallel=sp)
        rng.seed_rank(SEED, 0, 0, torch.device("cpu"))  # as a worker seeds: the same on both tp ranks
        result = train_step(model, Masks())
        for p in partial_grad_params(model):
            dist.all_reduce(p.grad, group=group)
        result["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[name] = result
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier(group)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-dropout")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=TP, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(TP)]


@pytest.mark.parametrize("name", CASES)
def test_sharded_masks_differ_replicated_ones_match_and_the_one_process_model_agrees(ranks, name):
    sp, recompute = CASES[name]
    drawn = [r[name]["masks"]["forward"] for r in ranks]
    # per block: attention, attention's residual branch, the MLP's; the embedding's first
    assert len(drawn[0]) == len(drawn[1]) == 1 + 3 * CFG.n_layer
    joined = []
    for site, (a, b) in enumerate(zip(*drawn)):
        heads = a.dim() == 4
        if heads or sp:  # sharded: heads (dim 1 of [B, heads, T, T]) or the sequence (dim 1 of [B, T, C])
            assert not torch.equal(a, b), f"site {site}: tp ranks drew the same mask in a sharded region"
            joined.append(torch.cat([a, b], 1))
        else:
            assert torch.equal(a, b), f"site {site}: tp ranks drew different masks in a replicated region"
            joined.append(a)
    if recompute != "none":  # recomputation drew again, the forward's masks
        again = ranks[0][name]["masks"]["backward"]
        assert again and all(any(torch.equal(m, f) for f in drawn[0]) for m in again)
    given = Masks(given=joined)
    reference = train_step(GPT(CFG, init_seed=SEED), given)
    assert not given.given, "the one-process model drew fewer masks than the ranks"
    for r in ranks:
        assert_close(r[name]["loss"], reference["loss"], rtol=1e-5, atol=1e-6)
    for n, full in reference["grads"].items():
        assert_close(gather_full(n, [r[name]["grads"][n] for r in ranks], CFG.kv_heads), full, rtol=1e-4, atol=1e-6,
                     msg=lambda m: f"{n}: {m}")
