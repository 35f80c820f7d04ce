"""Each architecture pipegpt builds, described as data: what its block is made of and which parameters, of
which shapes, it holds. Torch-free, and importing nothing of pipegpt: the config, the model, the planner's
memory and costs, tensor parallelism and the converters all read the one description here, so an
architecture's properties are named (`rotary`, `gated_mlp`, `norm == "rms"`) where code differs, and a third
architecture is one more ARCHITECTURES entry plus the modules it needs.

    gpt2   LayerNorm; learned positions (wpe); q, k, v in one matrix (attn.qkv); GELU MLP (mlp.fc, mlp.proj)
    llama  RMSNorm; rotary positions (no parameters); attn.q, attn.k, attn.v with n_kv_head key/value heads
           (grouped-query attention), heads of head_dim (n_embd / n_head unless head_size is set), optional
           q/k RMSNorms (attn.q_norm, attn.k_norm, by qk_norm); SwiGLU MLP (mlp.gate, mlp.up, mlp.proj);
           q/k/v biases by qkv_bias

Functions take a ModelConfig (`model`) and, for shapes, the tensor-parallel degree tp: shapes are one tp
rank's, as pipegpt.tensor_parallel shards them (column-parallel rows, row-parallel columns and the
vocabulary divided by tp; key/value rows by whole kv head; norms, wpe and row-parallel biases whole).

Layer kinds: a model's layers are a sequence of kinds (layer_kinds), each a LAYER_KINDS entry that says at which
shape its block is built (LayerKind.block_model: the ModelConfig its block reads). Today's architectures are all
"dense" (the block above, at the model's own shape). Everything that counts one block (its linears and shapes
here; FLOPs, memory and time in pipegpt.model.flops and pipegpt.costs; the torch block in pipegpt.model.gpt and
its tensor-parallel shards) counts it at its kind's block model, and a stage sums its layers (layer_mix).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

# How a block's linear is split over tp ranks: its rows (outputs), its rows by key/value head, or its columns.
COLUMN, KV, ROW = "column", "kv", "row"


@dataclass(frozen=True)
class Architecture:
    name: str                           # ModelConfig.arch
    title: str                          # its name in messages
    family: str                         # the name a run's first line gives its models
    norm: str                           # "layer" (LayerNorm: a gain, and a bias with bias=True) or "rms" (a gain)
    positions: str                      # "learned" (wpe [seq_len, n_embd]) or "rotary" (no parameters)
    mlp: str                            # "gelu" (mlp.fc, mlp.proj) or "swiglu" (mlp.gate, mlp.up, mlp.proj)
    fused_qkv: bool                     # q, k, v stacked in attn.qkv; else attn.q, attn.k, attn.v
    grouped_kv: bool                    # n_kv_head may be below n_head (grouped-query attention)
    own_qkv_bias: bool                  # q/k/v biases follow qkv_bias (Qwen2's), not bias
    bias: bool                          # its presets' bias (the only one a --config file may give)
    tie_embeddings: bool                # its presets' default
    default_preset: str                 # what `--arch NAME` alone builds
    ffn_rule: Callable[[int], int]      # the MLP width when ffn_hidden is not set, of n_embd
    # Hugging Face: its block prefix, (our module, theirs) in their files' order, the linears stored [in, out]
    hf_block_prefix: str
    hf_top: tuple[tuple[str, str], ...]
    hf_block: tuple[tuple[str, str], ...]
    hf_transposed: frozenset = frozenset()

    @property
    def rotary(self) -> bool:
        return self.positions == "rotary"

    @property
    def gated_mlp(self) -> bool:
        return self.mlp == "swiglu"

    @property
    def mlp_title(self) -> str:
        return {"gelu": "GELU", "swiglu": "SwiGLU"}[self.mlp]

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def mlp_saved(self) -> int:
        """MLP-wide tensors its forward keeps for the backward: gate and up outputs, SiLU's, their product;
        or fc's output and GELU's."""
        return 4 if self.gated_mlp else 2


GPT2 = Architecture(
    name="gpt2", title="GPT-2", family="GPT", norm="layer", positions="learned", mlp="gelu", fused_qkv=True,
    grouped_kv=False, own_qkv_bias=False, bias=True, tie_embeddings=True, default_preset="tiny",
    ffn_rule=lambda C: 4 * C,
    hf_block_prefix="h.{i}.", hf_top=(("wte", "wte"), ("wpe", "wpe"), ("ln_f", "ln_f")),
    hf_block=(("ln1", "ln_1"), ("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("ln2", "ln_2"),
              ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")),
    hf_transposed=frozenset({"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}))  # Conv1D
LLAMA = Architecture(
    name="llama", title="Llama", family="Llama", norm="rms", positions="rotary", mlp="swiglu", fused_qkv=False,
    grouped_kv=True, own_qkv_bias=True, bias=False, tie_embeddings=False, default_preset="tiny-llama",
    ffn_rule=lambda C: -(-(8 * C // 3) // 256) * 256,  # two thirds of 4 x n_embd, up to a multiple of 256
    hf_block_prefix="model.layers.{i}.", hf_top=(("wte", "model.embed_tokens"), ("ln_f", "model.norm")),
    hf_block=(("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"), ("attn.q", "self_attn.q_proj"),
              ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"), ("attn.proj", "self_attn.o_proj"),
              ("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm"),
              ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.proj", "mlp.down_proj")))
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (GPT2, LLAMA)}


@dataclass(frozen=True, eq=False)  # one object per kind: compared and hashed by identity, quickly
class LayerKind:
    """One kind of layer: its name and the ModelConfig its block is built at (dense: the model's own; a kind with
    a wider MLP: the model with another ffn_hidden). A kind whose block differs in more than its sizes (experts)
    adds its modules where pipegpt.model builds a block and its linears where block_linears lists them."""

    name: str
    title: str
    block_model: Callable = lambda model: model

    @property
    def piece(self) -> str:
        """Its block among measured costs (pipegpt.stages.measure, --balance cost): "block" (dense), "block.<kind>"."""
        return "block" if self.name == "dense" else f"block.{self.name}"


def _active_dense(model):
    """An MoE block's costs: a dense block of the architecture's MLP (SwiGLU or GELU) as wide as a token's active
    experts (top-k and shared), the router's linear added by block_linears; its parameters are block_shapes' (every
    expert)."""
    active = (model.experts_per_token + model.n_shared_experts) * model.expert_width
    return dataclasses.replace(model, ffn_hidden=active, expert_hidden=model.expert_width)


def _moe_layers(model) -> list[str]:
    """All but the first first_dense_layers, and of those every moe_every-th (the first of them MoE)."""
    first = model.first_dense_layers
    return ["moe" if i >= first and (i - first) % model.moe_every == 0 else "dense" for i in range(model.n_layer)]


DENSE = LayerKind("dense", "dense")
MOE = LayerKind("moe", "mixture of experts", _active_dense)
LAYER_KINDS: dict[str, LayerKind] = {DENSE.name: DENSE, MOE.name: MOE}
# Which kind each layer of a model is, by architecture (absent: every layer dense); a model with experts follows
# the "moe" rule whatever its architecture.
LAYER_RULES: dict[str, Callable] = {"moe": _moe_layers}


@functools.lru_cache(maxsize=1024)
def layer_kinds(model) -> tuple[LayerKind, ...]:
    """The kind of each of the model's n_layer layers."""
    rule = LAYER_RULES["moe"] if getattr(model, "n_experts", 0) else LAYER_RULES.get(model.arch)
    if rule is None:
        return (DENSE,) * model.n_layer
    names = tuple(rule(model))
    if len(names) != model.n_layer or any(n not in LAYER_KINDS for n in names):
        raise ValueError(f"{model.arch}'s layer rule gave {names!r}: want n_layer={model.n_layer} names of "
                         f"{', '.join(LAYER_KINDS)}")
    return tuple(LAYER_KINDS[n] for n in names)


@functools.lru_cache(maxsize=1024)
def uniform(model) -> bool:
    """Every layer of the model is of one kind."""
    return len(set(layer_kinds(model))) <= 1


@functools.lru_cache(maxsize=8192)
def layer_mix(model, layers) -> tuple[tuple[LayerKind, int], ...]:
    """(kind, how many) of a slice's layers, kinds in the order they first appear. layers: a range of the model's
    layers, or a count (only where every layer is alike: a count does not say which layers a slice holds)."""
    if isinstance(layers, int):
        if layers and not uniform(model):
            raise ValueError(f"{model.arch}'s layers differ: give the slice's layers as a range, not a count "
                             f"({layers})")
        return ((layer_kinds(model)[0] if model.n_layer else DENSE, layers),) if layers else ()
    kinds = layer_kinds(model)
    counts: dict[LayerKind, int] = {}
    for i in layers:
        counts[kinds[i]] = counts.get(kinds[i], 0) + 1
    return tuple(counts.items())


def stage_ranges(layers_per_stage) -> list[range]:
    """Each stage's range of layers from the stages' counts (or ranges, kept)."""
    out, start = [], 0
    for n in layers_per_stage:
        r = n if isinstance(n, range) else range(start, start + n)
        out.append(r)
        start = r.stop
    return out


def kv_local_heads(model, tp: int) -> int:
    """Key/value heads one tp rank holds: kv_heads/tp, or one (shared by tp/kv_heads ranks) when tp > kv_heads."""
    return max(1, model.kv_heads // tp)


@dataclass(frozen=True)
class Linear:
    """One block linear on one tp rank: its name in the block, weight [rows, cols], bias [rows] or none."""

    name: str
    rows: int
    cols: int
    bias: bool
    split: str  # COLUMN, KV or ROW


@functools.lru_cache(maxsize=1024)
def block_linears(model, tp: int = 1, kind: LayerKind = DENSE) -> tuple[Linear, ...]:
    """The block's linears in the model's order (attention's, then the MLP's), at kind's block model."""
    model = kind.block_model(model)
    arch = ARCHITECTURES[model.arch]
    h, F, A = model.n_embd, model.ffn_width, model.attention_width
    qkv_bias = model.qkv_bias if arch.own_qkv_bias else model.bias
    if arch.fused_qkv:
        attention = [Linear("attn.qkv", 3 * h // tp, h, qkv_bias, COLUMN)]
    else:
        kv = kv_local_heads(model, tp) * model.head_dim
        attention = [Linear("attn.q", A // tp, h, qkv_bias, COLUMN), Linear("attn.k", kv, h, qkv_bias, KV),
                     Linear("attn.v", kv, h, qkv_bias, KV)]
    inputs = [Linear(n, F // tp, h, model.bias, COLUMN) for n in (("mlp.gate", "mlp.up") if arch.gated_mlp
                                                                  else ("mlp.fc",))]
    router = [Linear("mlp.router", model.n_experts, h, False, COLUMN)] if kind is MOE else []
    return (*attention, Linear("attn.proj", h, A // tp, model.bias, ROW), *router, *inputs,
            Linear("mlp.proj", h, F // tp, model.bias, ROW))


def _norm(model, name: str) -> list[tuple[str, tuple[int, ...]]]:
    out = [(f"{name}.weight", (model.n_embd,))]
    if ARCHITECTURES[model.arch].norm == "layer" and model.bias:
        out.append((f"{name}.bias", (model.n_embd,)))
    return out


def _linear(lin: Linear) -> list[tuple[str, tuple[int, ...]]]:
    out = [(f"{lin.name}.weight", (lin.rows, lin.cols))]
    if lin.bias:
        out.append((f"{lin.name}.bias", (lin.rows,)))
    return out


@functools.lru_cache(maxsize=1024)
def block_shapes(model, tp: int = 1, kind: LayerKind = DENSE) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name within the block, shape) of one block's parameters, in GPT.named_parameters order."""
    linears = block_linears(model, tp, kind)
    out = _norm(model, "ln1")
    out += [p for lin in linears if lin.name.startswith("attn.") for p in _linear(lin)]
    out += _qk_norm_shapes(model)
    out += _norm(model, "ln2")
    if kind is MOE:
        return tuple(out + _moe_shapes(model))
    out += [p for lin in linears if lin.name.startswith("mlp.") for p in _linear(lin)]
    return tuple(out)


def _qk_norm_shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    """The q and k RMSNorms' gains (qk_norm): a head's width (Qwen3), or the whole projection's (OLMoE)."""
    if model.qk_norm == "head":
        return [("attn.q_norm.weight", (model.head_dim,)), ("attn.k_norm.weight", (model.head_dim,))]
    if model.qk_norm == "projection":
        return [("attn.q_norm.weight", (model.attention_width,)),
                ("attn.k_norm.weight", (model.kv_heads * model.head_dim,))]
    return []


def _moe_shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    """pipegpt.model.moe.MoE's parameters: the stacked experts, the router, the shared experts. Experts are the
    architecture's MLP without biases: SwiGLU's gate, up, proj; GELU's fc, proj."""
    E, C, H, S = model.n_experts, model.n_embd, model.expert_width, model.n_shared_experts * model.expert_width
    inputs = ("gate", "up") if ARCHITECTURES[model.arch].gated_mlp else ("fc",)
    out = [*((f"mlp.experts_{n}", (E, H, C)) for n in inputs), ("mlp.experts_proj", (E, C, H)),
           ("mlp.router.weight", (E, C))]
    if S:
        out += [*((f"mlp.shared.{n}.weight", (S, C)) for n in inputs), ("mlp.shared.proj.weight", (C, S))]
    return out


@functools.lru_cache(maxsize=1024)
def embedding_shapes(model, tp: int = 1) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out = [("wte.weight", (model.padded_vocab_size // tp, model.n_embd))]
    if not ARCHITECTURES[model.arch].rotary:
        out.append(("wpe.weight", (model.seq_len, model.n_embd)))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def head_shapes(model, tp: int = 1, lm_head: bool = True) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """ln_f's and, with lm_head (a slice whose head is not tied to its own wte), lm_head's."""
    return tuple(_norm(model, "ln_f") + ([("lm_head.weight", (model.padded_vocab_size // tp, model.n_embd))]
                                         if lm_head else []))


def stage_shapes(model, layers, embed: bool, head: bool, tp: int = 1) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter one tp rank of a slice holds (layers: a range, or a count where every
    layer is alike), in GPT.named_parameters order (block names without their index). A tied lm_head in a slice
    that holds the embedding is wte."""
    if isinstance(layers, int):
        blocks = block_shapes(model, tp, *(kind for kind, _ in layer_mix(model, layers))) * layers
    else:
        kinds = layer_kinds(model)
        blocks = tuple(p for i in layers for p in block_shapes(model, tp, kinds[i]))
    return ((embedding_shapes(model, tp) if embed else ()) + blocks
            + (head_shapes(model, tp, not (embed and model.tie_embeddings)) if head else ()))


def named_shapes(model) -> dict[str, tuple[int, ...]]:
    """{one-process name: shape} of the whole model's parameters."""
    out = dict(embedding_shapes(model))
    out.update((f"blocks.{i}.{name}", shape) for i, kind in enumerate(layer_kinds(model))
               for name, shape in block_shapes(model, 1, kind))
    out.update(head_shapes(model, lm_head=not model.tie_embeddings))
    return out


def buffer_shapes(model) -> dict[str, tuple[int, ...]]:
    """{one-process name: shape} of the model's state that is not a parameter: each MoE layer's router bias
    (checkpointed as param/<name>, updated by pipegpt.model.moe.end_step, never by the optimizer)."""
    return {f"blocks.{i}.mlp.expert_bias": (model.n_experts,) for i, kind in enumerate(layer_kinds(model))
            if kind is MOE}


def hf_names(model) -> list[tuple[str, str, bool]]:
    """(Hugging Face name, one-process name, stored transposed) of every parameter of the model, in the order
    of the architecture's hf_top, its blocks' hf_block, then an untied lm_head."""
    arch = ARCHITECTURES[model.arch]
    top = dict(embedding_shapes(model) + head_shapes(model, lm_head=False))

    def tensors(names, ours, theirs, prefix=""):
        return [(f"{theirs}.{n[len(ours) + 1:]}", f"{prefix}{n}", n.endswith(".weight") and ours in arch.hf_transposed)
                for n in names if n.startswith(ours + ".")]

    out = [t for ours, theirs in arch.hf_top for t in tensors(top, ours, theirs)]
    for i, kind in enumerate(layer_kinds(model)):
        block = dict(block_shapes(model, 1, kind))
        out += [(arch.hf_block_prefix.format(i=i) + hf, name, t) for ours, theirs in arch.hf_block
                for hf, name, t in tensors(block, ours, theirs, f"blocks.{i}.")]
    if not model.tie_embeddings:
        out.append(("lm_head.weight", "lm_head.weight", False))
    return out


# The model presets (--model NAME), each a ModelConfig's fields. Llama-shaped ones: untied unless stated (SmolLM
# ties), no biases.
_LLAMA = dict(arch=LLAMA.name, bias=LLAMA.bias, tie_embeddings=LLAMA.tie_embeddings)
PRESET_SHAPES: dict[str, dict] = {
    "tiny": dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_embd=128),
    "gpt2": dict(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(vocab_size=50257, seq_len=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(vocab_size=50257, seq_len=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(vocab_size=50257, seq_len=1024, n_layer=48, n_head=25, n_embd=1600),
    "tiny-llama": dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=128,
        ffn_hidden=352, **_LLAMA),
    "smollm-135m": dict(vocab_size=49152, seq_len=2048, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
        ffn_hidden=1536, rope_theta=10000.0, **{**_LLAMA, "tie_embeddings": True}),
    "tinyllama-1.1b": dict(vocab_size=32000, seq_len=2048, n_layer=22, n_head=32, n_kv_head=4,
        n_embd=2048, ffn_hidden=5632, rope_theta=10000.0, **_LLAMA),
    "llama3-8b": dict(vocab_size=128256, seq_len=8192, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
        ffn_hidden=14336, rope_theta=500000.0, **_LLAMA),
    "llama3-70b": dict(vocab_size=128256, seq_len=8192, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192,
        ffn_hidden=28672, rope_theta=500000.0, **_LLAMA),
    "llama3-405b": dict(vocab_size=128256, seq_len=8192, n_layer=126, n_head=128, n_kv_head=8,
        n_embd=16384, ffn_hidden=53248, rope_theta=500000.0, **_LLAMA),
    # Mixtures of experts (pipegpt.model.moe)
    "tiny-moe": dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn_hidden=352,
        n_experts=8, n_experts_per_token=2, n_shared_experts=1, expert_hidden=96, router_aux_loss_coef=0.01,
        **_LLAMA),
    "mixtral-8x7b": dict(vocab_size=32000, seq_len=32768, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
        ffn_hidden=14336, rope_theta=1e6, n_experts=8, n_experts_per_token=2, expert_hidden=14336,
        router_aux_loss_coef=0.02, **_LLAMA),
    "olmoe-1b-7b": dict(vocab_size=50304, seq_len=4096, n_layer=16, n_head=16, n_embd=2048, ffn_hidden=1024,
        rope_theta=10000.0, n_experts=64, n_experts_per_token=8, expert_hidden=1024, norm_topk_prob=False,
        router_aux_loss_coef=0.01, qk_norm="projection", **_LLAMA),
    # Qwen3-MoE (Hugging Face's Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json): heads of 128 wider than
    # n_embd / n_head, each head's q and k RMSNormed, every layer MoE, no shared experts
    "qwen3-30b-a3b": dict(vocab_size=151936, seq_len=40960, n_layer=48, n_head=32, n_kv_head=4, n_embd=2048,
        head_size=128, ffn_hidden=6144, rope_theta=1e6, norm_eps=1e-6, qk_norm="head", n_experts=128,
        n_experts_per_token=8, expert_hidden=768, router_aux_loss_coef=0.001, **_LLAMA),
    "qwen3-235b-a22b": dict(vocab_size=151936, seq_len=40960, n_layer=94, n_head=64, n_kv_head=4, n_embd=4096,
        head_size=128, ffn_hidden=12288, rope_theta=1e6, norm_eps=1e-6, qk_norm="head", n_experts=128,
        n_experts_per_token=8, expert_hidden=1536, router_aux_loss_coef=0.001, **_LLAMA),
}
