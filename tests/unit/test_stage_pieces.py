"""A Stage run piece by piece (embedding, each block, head) against the same Stage run whole: the same outputs,
input gradients and every named parameter gradient, with full B and with I then W, recomputation on and off,
bf16 autocast, tied embeddings (one slice holding both ends, and the ends on two slices); and two microbatches'
pieces interleaved (a composite action's loop) against the two run one after the other."""
import pytest
import torch
from torch.testing import assert_close

from pipegpt.config import ModelConfig
from pipegpt.model.gpt import GPT
from pipegpt.stages import Stage
from pipegpt.stages.stage import interleave

GPT2 = ModelConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=4, n_embd=32)  # tied embeddings
LLAMA = ModelConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=48,
                    arch="llama", bias=False, tie_embeddings=False, qkv_bias=True)
# (layers, embed, head) per stage: one stage holding the whole tied model; the ends and a middle apart
SPLITS = {"one": [(range(0, 3), True, True)],
          "three": [(range(0, 1), True, False), (range(1, 2), False, False), (range(2, 3), False, True)]}
B = 2

pytestmark = pytest.mark.usefixtures("one_thread")


def make_stages(cfg, split, recompute, autocast, microbatches=1):
    return [Stage(s, len(split), GPT(cfg, layers=layers, embed=embed, head=head, recompute=recompute, init_seed=7),
                  microbatches, autocast) for s, (layers, embed, head) in enumerate(split)]


def stage_data(stage, cfg, seed):
    """(input, targets, output gradient) of one microbatch for the stage."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    hidden = torch.randn(B, cfg.seq_len, cfg.n_embd, generator=g)
    grad = torch.randn(B, cfg.seq_len, cfg.n_embd, generator=g)
    return (tokens if stage.is_first else hidden), (targets if stage.is_last else None), \
        (None if stage.is_last else grad)


def run(stage, data, mb, pieces, split):
    """The stage's output, input gradient and parameters' gradients after one microbatch's forward and backward."""
    x, targets, grad = data
    if pieces:
        run_f = stage.forward_pieces(mb, x, targets)
        steps = 1
        while run_f.step():
            steps += 1
        assert steps == len(stage.piece_names())
        out = run_f.result
        grad_in = stage.backward_pieces(mb, grad, split=split).finish()
        if split:
            stage.weight_pieces(mb).finish()
    else:
        out = stage.forward(mb, x, targets)
        grad_in = stage.backward(mb, grad, split=split)
        if split:
            stage.backward_weight(mb)
    return out, grad_in, {n: p.grad for n, p in stage.module.named_parameters()}


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2-tied", "llama"])
@pytest.mark.parametrize("layout", SPLITS)
def test_pieces_equal_the_whole_stage(layout, cfg, recompute, autocast, split):
    whole = make_stages(cfg, SPLITS[layout], recompute, autocast)
    pieces = make_stages(cfg, SPLITS[layout], recompute, autocast)
    for s, (a, b) in enumerate(zip(whole, pieces)):
        data = stage_data(a, cfg, seed=s)
        out_a, in_a, grads_a = run(a, data, 0, False, split)
        out_b, in_b, grads_b = run(b, data, 0, True, split)
        assert torch.equal(out_a, out_b)
        assert (in_a is None) == (in_b is None) == a.is_first
        if in_a is not None:
            assert torch.equal(in_a, in_b) and in_a.abs().sum() > 0
        assert grads_a.keys() == grads_b.keys() and grads_a
        for name in grads_a:
            assert grads_a[name] is not None and grads_a[name].abs().sum() > 0, name
            assert torch.equal(grads_a[name], grads_b[name]), name
        assert not (a.seams or b.seams or a.pending_weight_grads or b.pending_weight_grads)


def test_piece_names_are_the_slices_layers():
    stages = make_stages(GPT2, SPLITS["three"], "none", None)
    assert [s.piece_names() for s in stages] == [("embedding", "block.0"), ("block.1",), ("block.2", "head")]
    assert make_stages(GPT2, SPLITS["one"], "none", None)[0].piece_names() == \
        ("embedding", "block.0", "block.1", "block.2", "head")


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
@pytest.mark.parametrize("layout", SPLITS)
def test_two_microbatches_interleaved_equal_them_one_after_the_other(layout, split):
    """A composite action's loop: microbatch 1's forward pieces in turns with microbatch 0's backward pieces."""
    whole = make_stages(GPT2, SPLITS[layout], "none", None, microbatches=2)
    mixed = make_stages(GPT2, SPLITS[layout], "none", None, microbatches=2)
    for s, (a, b) in enumerate(zip(whole, mixed)):
        mb0, mb1 = stage_data(a, GPT2, seed=10 + s), stage_data(a, GPT2, seed=20 + s)
        out0 = a.forward(0, mb0[0], mb0[1])
        in0 = a.backward(0, mb0[2], split=split)
        out1 = a.forward(1, mb1[0], mb1[1])
        in1 = a.backward(1, mb1[2], split=split)
        if split:
            a.backward_weight(0)
            a.backward_weight(1)

        got0 = b.forward(0, mb0[0], mb0[1])
        got1, got_in0 = interleave(b.forward_pieces(1, mb1[0], mb1[1]), b.backward_pieces(0, mb0[2], split=split))
        got_in1 = b.backward(1, mb1[2], split=split)
        if split:
            interleave(b.weight_pieces(0), b.weight_pieces(1))
        assert torch.equal(out0, got0) and torch.equal(out1, got1)
        for want, got in ((in0, got_in0), (in1, got_in1)):
            assert (want is None and got is None) or torch.equal(want, got)
        for (name, p), q in zip(a.module.named_parameters(), b.module.parameters()):
            assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)
        assert [t.item() for t in a.pop_losses()] == [t.item() for t in b.pop_losses()]
