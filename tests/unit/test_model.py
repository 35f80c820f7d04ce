"""The sliceable GPT against itself in one piece: loss and every named gradient."""
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

from helpers import ROOT
from pipegpt.config import MODEL_PRESETS, ConfigError, ModelConfig, model_config
from pipegpt.model.gpt import GPT, KVCache, build_reference_model, slice_state_dict
from pipegpt.model.partition import partition_layers
from pipegpt.model.split_backward import SplitLinear, defer_weight_grads

CFG = ModelConfig(vocab_size=64, seq_len=16, n_layer=5, n_head=4, n_embd=32)
# Llama-shaped: grouped-query attention (2 kv heads for 4), SwiGLU, RMSNorm, rotary, untied, q/k/v biases
LLAMA = ModelConfig(vocab_size=64, seq_len=16, n_layer=5, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=48,
                    arch="llama", bias=False, tie_embeddings=False, qkv_bias=True, rope_theta=500.0)
ARCHS = {"gpt2": CFG, "llama": LLAMA}
SEED = 1234

# (layers, embed, head) per slice; uneven, and with slices holding no blocks at all
SPLITS = {
    "2-way": [(range(0, 2), True, False), (range(2, 5), False, True)],
    "3-way": [(range(0, 1), True, False), (range(1, 4), False, False), (range(4, 5), False, True)],
    "3-way-bare-ends": [(range(0, 0), True, False), (range(0, 5), False, False), (range(5, 5), False, True)],
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: intra-op threads only contend


def batch(cfg=CFG, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    return x, y


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def make_slices(full, split, recompute="none"):
    slices = []
    for layers, embed, head in split:
        s = GPT(full.config, layers=layers, embed=embed, head=head, recompute=recompute)
        s.load_from_full(full.state_dict())
        slices.append(s)
    return slices


def chain_forward(slices, x, y):
    """Forward through the slices; returns (loss, [(input, output)] per slice)."""
    h, io = x, []
    for i, s in enumerate(slices):
        inp = h if i == 0 else h.detach().requires_grad_()
        out = s(inp, y if s.head else None)
        io.append((inp, out))
        h = out
    return h, io


def chain_backward(io):
    """Manual pipeline backward: last slice first, passing input grads along."""
    grad = None
    for inp, out in reversed(io):
        out.backward(grad)
        grad = inp.grad if inp.requires_grad else None


def full_loss_and_grads(cfg=CFG, recompute="none", x=None, y=None):
    full = build_reference_model(cfg, SEED, recompute=recompute)
    if x is None:
        x, y = batch(cfg)
    loss = full(x, y)
    loss.backward()
    return full, loss.detach(), grads(full)


def merged_slice_grads(slices, tie):
    merged = {}
    for s in slices:
        for n, p in s.named_parameters():
            merged[n] = p.grad.clone()
    if tie:  # the head's copy of the tied weight: its grad adds to wte's
        merged["wte.weight"] = merged["wte.weight"] + merged.pop("lm_head.weight")
    return merged


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("split", list(SPLITS))
def test_slices_match_full_model(split, tie, arch):
    cfg = ModelConfig(**{**ARCHS[arch].__dict__, "tie_embeddings": tie})
    full, ref_loss, ref_grads = full_loss_and_grads(cfg)
    slices = make_slices(full, SPLITS[split])
    x, y = batch(cfg)
    loss, io = chain_forward(slices, x, y)
    assert_close(loss, ref_loss)
    chain_backward(io)
    got = merged_slice_grads(slices, tie)
    assert set(got) == set(ref_grads)
    for n in ref_grads:
        assert_close(got[n], ref_grads[n], msg=n)


def test_parameter_names_are_one_process_names():
    full = GPT(CFG)
    names = [n for n, _ in full.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # tied: one tensor
    assert full.lm_head.weight is full.wte.weight
    for n in ("blocks.3.ln1.weight", "blocks.3.attn.qkv.weight", "blocks.3.attn.proj.bias",
              "blocks.3.ln2.bias", "blocks.3.mlp.fc.weight", "blocks.3.mlp.proj.weight", "ln_f.weight"):
        assert n in names
    stage = GPT(CFG, layers=range(2, 4), embed=False, head=True)
    snames = {n for n, _ in stage.named_parameters()}
    assert "lm_head.weight" in snames and "blocks.3.mlp.fc.weight" in snames
    assert not any(n.startswith(("blocks.0.", "blocks.1.", "blocks.4.", "wte", "wpe")) for n in snames)
    assert stage.tied_parameter_names() == {"lm_head.weight": "wte.weight"}
    assert GPT(CFG, layers=range(0, 2), head=False).tied_parameter_names() == {"wte.weight": "wte.weight"}
    assert full.tied_parameter_names() == {}
    untied = ModelConfig(**{**CFG.__dict__, "tie_embeddings": False})
    assert GPT(untied, layers=range(2, 4), embed=False).tied_parameter_names() == {}
    assert "lm_head.weight" in dict(GPT(untied).named_parameters())


def test_slices_get_full_model_init_without_loading():
    full = build_reference_model(CFG, SEED)
    sd = full.state_dict()
    for layers, embed, head in SPLITS["3-way"]:
        s = GPT(CFG, layers=layers, embed=embed, head=head, init_seed=SEED)
        for n, p in s.state_dict().items():
            assert torch.equal(p, sd[n]), n
    # the same after torch.manual_seed alone
    torch.manual_seed(7)
    a = GPT(CFG)
    torch.manual_seed(7)
    b = GPT(CFG, layers=range(3, 5), embed=False)
    assert torch.equal(b.lm_head.weight, a.wte.weight)
    assert torch.equal(b.blocks["4"].mlp.proj.weight, a.blocks["4"].mlp.proj.weight)
    # GPT-2 init: residual projections scaled by 1/sqrt(2 n_layer), LayerNorm at identity
    big = GPT(ModelConfig(n_layer=8, n_embd=256, n_head=4), init_seed=0)
    assert abs(big.blocks["0"].mlp.fc.weight.std().item() - 0.02) < 1e-3
    assert abs(big.blocks["0"].mlp.proj.weight.std().item() - 0.02 / 4) < 3e-4
    assert torch.all(big.blocks["0"].ln1.weight == 1) and torch.all(big.blocks["0"].attn.qkv.bias == 0)
    # different seeds differ
    assert not torch.equal(GPT(CFG, init_seed=1).wte.weight, GPT(CFG, init_seed=2).wte.weight)


def test_slice_state_dict_maps_tied_head():
    full = build_reference_model(CFG, SEED)
    sd = slice_state_dict(full.state_dict(), range(4, 5), embed=False, head=True, tie=True)
    assert set(sd) == {k for k in full.state_dict() if k.startswith(("blocks.4.", "ln_f."))} | {"lm_head.weight"}
    assert torch.equal(sd["lm_head.weight"], full.wte.weight)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_matches_none(recompute, arch):
    cfg = ModelConfig(**{**ARCHS[arch].__dict__, "dropout": 0.1})  # dropout masks must replay too
    _, ref_loss, ref_grads = full_loss_and_grads(cfg)
    _, loss, got = full_loss_and_grads(cfg, recompute=recompute)
    assert_close(loss, ref_loss)
    for n in ref_grads:
        assert_close(got[n], ref_grads[n], msg=n)


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_deferred_weight_grads(recompute, arch):
    """I then W: input grads are right before the closures run; W completes the grads (every linear
    layer deferred: SwiGLU's three and Llama's q, k, v too)."""
    cfg = ARCHS[arch]
    full, _, _ = full_loss_and_grads(cfg)
    x, y = batch(cfg)
    split = SPLITS["2-way"]
    ref = make_slices(full, split)
    _, io = chain_forward(ref, x, y)
    chain_backward(io)
    ref_input_grad = io[1][0].grad.clone()
    ref_grads = merged_slice_grads(ref, tie=cfg.tie_embeddings)

    slices = make_slices(full, split, recompute=recompute)
    _, io = chain_forward(slices, x, y)
    pending_per_slice = []
    grad = None
    for (inp, out), s in zip(reversed(io), reversed(slices)):
        with defer_weight_grads() as pending:
            out.backward(grad)
        pending_per_slice.append(pending)
        if inp.requires_grad:
            assert_close(inp.grad, ref_input_grad)  # correct before any W ran
            grad = inp.grad
        for n, m in s.named_modules():
            if isinstance(m, SplitLinear):
                assert m.weight.grad is None, n
                assert m.bias is None or m.bias.grad is None, n
        assert s.blocks["1" if s.embed else "2"].ln1.weight.grad is not None  # non-linear: normal backward
        n_linear = sum(isinstance(m, SplitLinear) for m in s.modules())
        assert len(pending) == n_linear
    for pending in pending_per_slice:
        for fn in pending:
            fn()
    got = merged_slice_grads(slices, tie=cfg.tie_embeddings)
    for n in ref_grads:
        assert_close(got[n], ref_grads[n], msg=n)


def test_deferred_grads_accumulate_with_tied_full_model():
    full, _, ref = full_loss_and_grads()
    full.zero_grad(set_to_none=True)
    x, y = batch()
    with defer_weight_grads() as pending:
        full(x, y).backward()
    # wte got its embedding grad in the backward; the head's share arrives with W
    emb_only = full.wte.weight.grad.clone()
    assert not torch.allclose(emb_only, ref["wte.weight"])
    for fn in pending:
        fn()
    for n, g in grads(full).items():
        assert_close(g, ref[n], msg=n)
    # outside the context, backward is an ordinary full backward
    full.zero_grad(set_to_none=True)
    full(x, y).backward()
    assert_close(full.blocks["0"].attn.qkv.weight.grad, ref["blocks.0.attn.qkv.weight"])


def test_defer_contexts_nest_and_backward_runs_on_calling_thread():
    import threading

    from pipegpt.model import split_backward

    lin = SplitLinear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    seen = []
    x.register_hook(lambda g: seen.append(threading.get_ident()))
    with defer_weight_grads() as outer:
        with defer_weight_grads() as inner:
            lin(x).sum().backward()
        assert len(inner) == 1 and outer == []
        lin(x).sum().backward()
        assert len(outer) == 1
    assert split_backward._DEFER_STACK == []
    assert seen == [threading.get_ident()] * 2  # CPU autograd: the caller's thread
    assert lin.weight.grad is None
    for fn in inner + outer:
        fn()
    assert_close(lin.weight.grad, 2 * torch.ones(4, 1) * x.detach().sum(0))


def test_split_linear_gradcheck():
    torch.manual_seed(0)
    lin = SplitLinear(5, 3).double()
    x = torch.randn(2, 4, 5, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lin, (x,))
    out = lin(x)
    g = torch.randn_like(out)
    ref = torch.autograd.grad(torch.nn.functional.linear(x, lin.weight, lin.bias), (x, lin.weight, lin.bias), g)
    with defer_weight_grads() as pending:
        (gx,) = torch.autograd.grad(out, (x,), g)
    assert_close(gx, ref[0])
    for fn in pending:
        fn()
    assert_close(lin.weight.grad, ref[1])
    assert_close(lin.bias.grad, ref[2])


def test_split_linear_autocast_bf16_cpu():
    lin = SplitLinear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    assert_close(lin.weight.grad, torch.ones(4, 1) * x.detach().sum(0), atol=0.1, rtol=0.02)


def test_padded_vocab_never_predicts_padding():
    cfg = ModelConfig(vocab_size=50, seq_len=16, n_layer=2, n_head=4, n_embd=32)
    padded = ModelConfig(**{**cfg.__dict__, "pad_vocab_to": 64})
    assert padded.padded_vocab_size == 64 and cfg.padded_vocab_size == 50
    for tie in (True, False):
        a = GPT(ModelConfig(**{**cfg.__dict__, "tie_embeddings": tie}), init_seed=0)
        b = GPT(ModelConfig(**{**padded.__dict__, "tie_embeddings": tie}), init_seed=0)
        assert b.lm_head.weight.shape[0] == 64
        with torch.no_grad():
            b.lm_head.weight[50:] = 100.0  # huge padded rows would win any argmax if not sliced
            sd = {k: (v[:50] if k in ("wte.weight", "lm_head.weight") else v) for k, v in b.state_dict().items()}
        a.load_state_dict(sd)
        x, y = batch(cfg)
        logits = b(x)
        assert logits.shape == (3, 16, 50)
        assert_close(logits, a(x))
        assert_close(b(x, y), a(x, y))


def test_recompute_value_rejected():
    with pytest.raises(ConfigError, match="recompute='some'.*none, full, selective"):
        GPT(CFG, recompute="some")
    with pytest.raises(ConfigError, match="layers"):
        GPT(CFG, layers=range(3, 9))


def test_config_errors_are_one_line_and_helpful():
    def msg(**kw):
        with pytest.raises(ConfigError) as e:
            ModelConfig(**kw).validate()
        text = str(e.value)
        assert "\n" not in text
        return text

    assert msg(n_embd=130, n_head=4) == (
        "n_embd=130 is not divisible by n_head=4: use a multiple of 4 such as 128 or 132")
    assert "n_layer=0" in msg(n_layer=0) and ">= 1" in msg(n_layer=0)
    assert "vocab_size=-3" in msg(vocab_size=-3)
    assert "seq_len" in msg(seq_len=0)
    assert "n_head=0" in msg(n_head=0)
    assert "pad_vocab_to=0" in msg(pad_vocab_to=0)
    assert "dropout=1.5" in msg(dropout=1.5)
    assert "n_embd=12.5" in msg(n_embd=12.5)
    with pytest.raises(ConfigError, match="n_embd=2 is not divisible by n_head=3: use a multiple of 3 such as 3$"):
        ModelConfig(n_embd=2, n_head=3).validate()
    with pytest.raises(ConfigError) as e:
        model_config("gpt3")
    assert "gpt3" in str(e.value) and "tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl" in str(e.value)
    with pytest.raises(ConfigError, match="n_layers.*valid settings"):
        model_config("tiny", n_layers=3)
    with pytest.raises(ConfigError, match="^n_layer=1 is fewer than the 2 pipeline stages it must fill: use at most "
                                          "1 stage or at least 2 layers$"):
        partition_layers(1, 2)
    with pytest.raises(ConfigError, match="use at most 3 stages or at least 4 layers$"):
        partition_layers(3, 4)


def test_presets():
    assert model_config("tiny") == ModelConfig()
    assert model_config("tiny", n_layer=None, seq_len=32).seq_len == 32
    assert model_config("gpt2", pad_vocab_to=64).padded_vocab_size == 50304
    shapes = {k: (c.n_layer, c.n_head, c.n_embd) for k, c in MODEL_PRESETS.items() if c.arch == "gpt2"}
    assert shapes == {"tiny": (4, 4, 128), "gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024),
                      "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)}
    # Llama presets as their Hugging Face configs give them: layers, heads, kv heads, width, ffn, vocabulary
    llamas = {k: (c.n_layer, c.n_head, c.kv_heads, c.n_embd, c.ffn_width, c.vocab_size)
              for k, c in MODEL_PRESETS.items() if c.arch == "llama" and not c.n_experts}  # MoE ones: test_moe
    assert llamas == {"tiny-llama": (4, 4, 2, 128, 352, 256), "smollm-135m": (30, 9, 3, 576, 1536, 49152),
                      "tinyllama-1.1b": (22, 32, 4, 2048, 5632, 32000),
                      "llama3-8b": (32, 32, 8, 4096, 14336, 128256), "llama3-70b": (80, 64, 8, 8192, 28672, 128256),
                      "llama3-405b": (126, 128, 8, 16384, 53248, 128256)}
    assert not MODEL_PRESETS["llama3-8b"].tie_embeddings and MODEL_PRESETS["smollm-135m"].tie_embeddings
    for c in MODEL_PRESETS.values():
        c.validate()
    # parameter count from shapes: embeddings + 12 C^2 + 13 C per block (with biases) + final LN
    c = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32)
    C = c.n_embd
    assert GPT(c).num_parameters() == 64 * C + 16 * C + 2 * (12 * C * C + 13 * C) + 2 * C


def test_model_imports_no_process_code():
    code = ("import sys, pipegpt.model.gpt, pipegpt.data.tokenizers, pipegpt.data.tokens, pipegpt.data.loader; "
            "print(sorted(m for m in sys.modules if m.startswith('pipegpt') or m == 'tiktoken'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert set(eval(out.stdout)) <= {"pipegpt", "pipegpt.arch", "pipegpt.dims", "pipegpt.model_config",
                                     "pipegpt.config", "pipegpt.model", "pipegpt.model.gpt",
                                     "pipegpt.model.split_backward", "pipegpt.model.moe", "pipegpt.data",
                                     "pipegpt.data.tokenizers", "pipegpt.data.tokens", "pipegpt.data.loader"}


def test_llama_parameters_and_kv_cache():
    """Llama's parameters by their one-process names and shapes; sampling with the KV cache (a prompt, then
    one token at a time, or in chunks) gives the logits of the whole sequence at once, for both architectures."""
    model = GPT(LLAMA, init_seed=3).eval()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    hd, kv = LLAMA.head_dim, LLAMA.kv_heads
    assert shapes["blocks.0.attn.q.weight"] == (32, 32) and shapes["blocks.0.attn.k.weight"] == (kv * hd, 32)
    assert shapes["blocks.0.attn.v.bias"] == (kv * hd,) and shapes["blocks.0.mlp.gate.weight"] == (48, 32)
    assert shapes["blocks.0.mlp.up.weight"] == (48, 32) and shapes["blocks.0.mlp.proj.weight"] == (32, 48)
    assert shapes["blocks.0.ln1.weight"] == (32,) and "blocks.0.ln1.bias" not in shapes
    assert "wpe.weight" not in shapes and shapes["lm_head.weight"] == (64, 32)
    assert "blocks.0.attn.proj.bias" not in shapes  # qkv_bias is q, k and v's only
    x, _ = batch(LLAMA, b=2)
    for cfg in (LLAMA, CFG):
        model = GPT(cfg, init_seed=3).eval()
        with torch.no_grad():
            whole = model(x)
            cache = KVCache()
            steps = [model(x[:, :9], cache=cache)]
            steps += [model(x[:, t:t + 1], cache=cache) for t in range(9, 12)]
            steps.append(model(x[:, 12:], cache=cache))
        assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)
        assert cache.length == cfg.seq_len


def test_grouped_query_attention_is_full_attention_with_shared_kv_heads():
    """Grouped-query attention (2 kv heads for 4 q heads) equals full attention whose k and v projections
    repeat each kv head for the q heads of its group (q heads 0, 1 use kv head 0; 2, 3 kv head 1)."""
    grouped = GPT(LLAMA, init_seed=5).eval()
    full_cfg = ModelConfig(**{**LLAMA.__dict__, "n_kv_head": 4})
    full = GPT(full_cfg, init_seed=5).eval()
    sd = grouped.state_dict()
    for i in range(LLAMA.n_layer):
        for part in ("k", "v"):
            for kind in ("weight", "bias"):
                t = sd[f"blocks.{i}.attn.{part}.{kind}"]
                sd[f"blocks.{i}.attn.{part}.{kind}"] = t.view(2, LLAMA.head_dim, *t.shape[1:]) \
                    .repeat_interleave(2, dim=0).reshape(4 * LLAMA.head_dim, *t.shape[1:])
    full.load_state_dict(sd)
    x, _ = batch(LLAMA, b=2)
    with torch.no_grad():
        assert_close(full(x), grouped(x))
