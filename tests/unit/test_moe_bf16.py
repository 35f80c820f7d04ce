"""An MoE layer under --precision bf16: its expert weights cast once per step and shared by every call (the
gradients bitwise those of a cast per call, recomputed or not), and the rows its dispatch and combine send in
bf16 (fp32 under fp32), on both ways of dispatching (the plain layer's and block_steps' cuts)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from pipegpt.config import ModelConfig
from pipegpt.expert_parallel.dispatch import ExpertGroup
from pipegpt.model.gpt import GPT
from pipegpt.model.moe import MoE, block_steps, end_step

MOE = ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                  ffn_hidden=48, bias=False, tie_embeddings=False, n_experts=4, n_experts_per_token=2,
                  n_shared_experts=1, expert_hidden=16)
BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


def _layer(seed=0):
    torch.manual_seed(seed)
    layer = MoE(MOE)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _cast_per_call(layer):
    """layer as it was: every call casts the expert weights itself."""
    layer.expert_weights = lambda dtype: [getattr(layer, name).to(dtype) for name in layer.expert_names]
    return layer


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpointed"])
def test_one_cast_per_step_gives_the_gradients_of_a_cast_per_call_bitwise(recompute):
    shared, per_call = _layer(), _cast_per_call(_layer())
    xs = [torch.randn(2, 8, MOE.n_embd) for _ in range(3)]
    grads = []
    for layer in (shared, per_call):
        with torch.autocast(**BF16):  # every microbatch's forward, then the backwards in reverse (a pipeline's)
            outs = [checkpoint(layer, x, use_reentrant=False) if recompute else layer(x) for x in xs]
        for out, g in reversed(list(zip(outs, xs))):
            out.backward(g)
        grads.append({n: p.grad for n, p in layer.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    assert shared.experts_gate.grad.abs().sum() > 0


def test_the_cast_is_shared_until_the_weights_change_or_the_step_ends():
    layer = _layer()
    x = torch.randn(2, 8, MOE.n_embd)
    with torch.autocast(**BF16):
        first = layer.expert_weights(torch.bfloat16)
        layer(x).sum().backward()
        assert layer.expert_weights(torch.bfloat16) is first  # one bf16 copy of the experts for every call
        assert first[0].dtype == torch.bfloat16 and torch.equal(first[0], layer.experts_gate.to(torch.bfloat16))
        torch.optim.SGD(layer.parameters(), lr=0.1).step()
        after_step = layer.expert_weights(torch.bfloat16)
        assert after_step is not first and torch.equal(after_step[0], layer.experts_gate.to(torch.bfloat16))
        end_step(layer, 0.0)
        assert layer.expert_weights(torch.bfloat16) is not after_step
        with torch.no_grad():  # sampling: nothing kept
            assert layer.expert_weights(torch.bfloat16)[0].grad_fn is None
    assert layer.expert_weights(torch.float32)[0] is layer.experts_gate  # fp32: the parameters themselves
    assert copy.deepcopy(layer).cast_weights.weights is None


def test_full_recomputation_casts_per_call():
    """Its checkpoints keep nothing of a call, so a cast kept for the step would only add memory."""
    full, none = GPT(MOE, recompute="full"), GPT(MOE)
    assert [b.mlp.cast_once for b in full.blocks.values()] == [False, False]
    assert [b.mlp.cast_once for b in none.blocks.values()] == [True, True]
    layer = full.blocks["0"].mlp
    with torch.autocast(**BF16):
        assert layer.expert_weights(torch.bfloat16)[0] is not layer.expert_weights(torch.bfloat16)[0]


class _Recording:
    """An ep group of one that records the rows the layer hands it to dispatch."""

    def __init__(self):
        self.sent = []

    def run(self, x_sorted, counts, compute):
        self.sent.append(x_sorted)
        return compute(x_sorted, counts.tolist())


@pytest.mark.parametrize("bf16, dtype", [(True, torch.bfloat16), (False, torch.float32)], ids=["bf16", "fp32"])
def test_the_plain_layer_dispatches_rows_in_the_experts_dtype(bf16, dtype):
    layer, ep = _layer(), _Recording()
    layer.expert_parallel = ep
    with torch.autocast(**BF16, enabled=bf16):
        layer(torch.randn(2, 8, MOE.n_embd))
    (rows,) = ep.sent
    assert rows.dtype == dtype and rows.shape == (2 * 8 * MOE.n_experts_per_token, MOE.n_embd)


@pytest.mark.parametrize("bf16, dtype", [(True, torch.bfloat16), (False, torch.float32)], ids=["bf16", "fp32"])
def test_block_steps_send_rows_in_the_experts_dtype_both_ways(bf16, dtype):
    """The cuts carry the fp32 residual stream past the exchange (their flat tensor is fp32), yet only the rows
    travel, in bf16 under bf16: 2 bytes an element, rows x C of them each way."""
    torch.manual_seed(0)
    block = GPT(MOE, init_seed=1).blocks["0"]
    block.mlp.expert_parallel = ExpertGroup(None, 1, 0)
    x = torch.randn(2, 8, MOE.n_embd, requires_grad=True)
    rows = 2 * 8 * MOE.n_experts_per_token
    with torch.autocast(**BF16, enabled=bf16):
        steps = block_steps(block, x, None, False)
        counts = next(steps)
        cuts = [steps.send(counts.wait())]
        cuts.append(steps.send(_posted_rows(cuts[0], rows, dtype)))
        try:
            steps.send(_posted_rows(cuts[1], rows, dtype))
        except StopIteration as end:
            out = end.value
    assert cuts[0].sent.dtype == torch.float32  # the carried residual stream's dtype
    with torch.autocast(**BF16, enabled=bf16):
        whole = block(x)  # the block in one piece: the same values (rows rounded as the experts round them)
    torch.testing.assert_close(out, whole, rtol=0, atol=0)
    grad = torch.randn(rows, MOE.n_embd, dtype=torch.float32)
    back = cuts[1].transpose(torch.cat((torch.zeros(cuts[1]._carried_size), grad.reshape(-1))))
    assert back.pending.out.dtype == dtype  # the gradient's way back: the rows' dtype too


def _posted_rows(cut, rows, dtype):
    """What the cut posted to send (its rows: dtype, count), checked; then what it received."""
    posted = cut._pending.pending.out
    assert posted.dtype == dtype and posted.shape == (rows, MOE.n_embd)
    return cut.wait()
