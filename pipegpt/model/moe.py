"""A mixture-of-experts feed-forward: the `moe` layer kind's MLP (pipegpt.arch).

    router       a linear C -> E (mlp.router.weight); scores softmax or sigmoid of its logits; each token goes to
                 its top-k experts by score (plus, for selection only, the load-balancing bias), weighted by its
                 scores there (renormalised to sum to 1 with norm_topk_prob)
    experts      E experts of width expert_hidden, each the architecture's own MLP without biases (as Megatron-Core
                 builds its experts from the model's MLP and DeepSpeed-MoE wraps it): SwiGLU (Llama), stacked as
                 mlp.experts_gate and mlp.experts_up [E, H, C] and mlp.experts_proj [E, C, H]; or GELU (GPT-2),
                 mlp.experts_fc [E, H, C] and mlp.experts_proj [E, C, H]
    shared       n_shared_experts always-active experts as one of width n_shared x H (mlp.shared.*), of the same MLP
    capacity     moe_capacity_factor 0: dropless; else each expert takes at most ceil(factor x N x k / E) of a
                 call's N tokens' assignments, in token order, and drops (counts) the rest
    experts over ep ranks (pipegpt.expert_parallel): a layer then holds its ep rank's E/ep experts and
                 `expert_parallel` (an object with run(x_sorted, counts, compute)) moves the sorted assignments
                 to their experts' ranks and back; routing, capacity and the aux loss stay per call on this
                 rank's tokens, so each rank drops what one process would drop of the same tokens

Load balancing:
    aux loss     router_aux_loss_coef x E x sum_i f_i P_i (Switch / Mixtral; f_i: the share of the N tokens sent to
                 expert i, P_i its mean score), plus router_z_loss_coef x mean(logsumexp(logits)^2). Neither is
                 added to the returned loss: `inject_aux_loss` passes the hidden state through and gives the aux
                 loss gradient `aux_loss_scale` in backward (Megatron's MoEAuxLossAutoScaler), so every pipeline
                 stage's layers add theirs to that stage's backward, scaled as the stage scales its loss. Where
                 a call's tokens are split over ranks (sequence parallelism, cp), its sums are reduced over them
                 first (token_sums), so f_i and P_i are the whole call's.
    bias         expert_bias (a buffer: checkpointed, not trained), added to the scores for selection only;
                 `end_step` moves it by rate x sign(mean load - load) after each optimizer step (DeepSeek-V3).

`expert_outputs` is the one place that chooses how experts are computed: torch._grouped_mm on a CUDA device that
has it (bf16), else a loop over each expert's contiguous tokens. Under autocast (bf16) a layer casts its experts'
weights once per step (expert_weights) and every call of the step shares the cast, and the rows it dispatches to
other ranks travel in bf16 (the dtype the experts read them in), as Megatron-Core and DeepEP send them.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipegpt.model.split_backward import SplitLinear

# Stacked [E, ...], cut over ep along dim 0: a SwiGLU layer's, a GELU layer's (MoE.expert_names: one layer's)
SWIGLU_EXPERTS, GELU_EXPERTS = ("experts_gate", "experts_up", "experts_proj"), ("experts_fc", "experts_proj")
EXPERT_PARAMS = ("experts_gate", "experts_up", "experts_fc", "experts_proj")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on (bf16 training), else x's."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def use_grouped_mm(x: torch.Tensor) -> bool:
    """Whether expert_outputs runs as one grouped matmul: CUDA bf16 where torch has _grouped_mm (sm90 and up)."""
    return (x.is_cuda and compute_dtype(x) == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def expert_outputs(x: torch.Tensor, counts: list[int], *weights: torch.Tensor,
                   grouped: bool | None = None) -> torch.Tensor:
    """Each expert's MLP of its tokens: x [sum(counts), C] sorted by expert (counts[e] rows for expert e); weights
    gate, up [E, H, C] and proj [E, C, H] (SwiGLU) or fc [E, H, C] and proj (GELU) -> [sum(counts), C].
    grouped: force the path (None: use_grouped_mm)."""
    *inputs, proj = weights
    if grouped is None:
        grouped = use_grouped_mm(x)
    if grouped:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        dtype = compute_dtype(x)
        x = x.to(dtype)
        hidden = _activation([torch._grouped_mm(x, w.to(dtype).transpose(1, 2), offs=offs) for w in inputs])
        return torch._grouped_mm(hidden, proj.to(dtype).transpose(1, 2), offs=offs)
    outs = [F.linear(_activation([F.linear(xe, w[e]) for w in inputs]), proj[e])
            for e, xe in enumerate(x.split(counts)) if counts[e]]
    if outs:
        return torch.cat(outs)
    # No rows (an ep rank whose experts got no token): still a function of x, so the autograd graph, and the
    # all-to-alls in its backward, are every rank's alike
    return x[:, :0].sum() + x.new_zeros(0, proj.size(1))


def _activation(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The hidden layer from the input matmuls' outputs: silu(gate) * up (SwiGLU), or GPT-2's tanh GELU of fc."""
    return F.silu(inputs[0]) * inputs[1] if len(inputs) == 2 else F.gelu(inputs[0], approximate="tanh")


class _InjectAuxLoss(torch.autograd.Function):
    """Identity on the hidden state; in backward, gives the aux loss the gradient `scale`."""

    @staticmethod
    def forward(ctx, hidden, aux, scale):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def inject_aux_loss(hidden: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    return _InjectAuxLoss.apply(hidden, aux, scale)


class SharedExperts(nn.Module):
    """The always-active experts, as one MLP of the architecture's kind without biases: SwiGLU (gate, up, proj)
    or GELU (fc, proj)."""

    def __init__(self, C: int, hidden: int, gated: bool):
        super().__init__()
        if gated:
            self.gate, self.up = SplitLinear(C, hidden, bias=False), SplitLinear(C, hidden, bias=False)
        else:
            self.fc = SplitLinear(C, hidden, bias=False)
        self.proj = SplitLinear(hidden, C, bias=False)

    def forward(self, x):
        inputs = [self.gate, self.up] if hasattr(self, "gate") else [self.fc]
        return self.proj(_activation([linear(x) for linear in inputs]))


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        C, E, H = config.n_embd, config.n_experts, config.expert_width
        self.n_experts, self.top_k = E, config.experts_per_token
        self.score, self.normalise = config.router_score, config.norm_topk_prob
        self.aux_coef, self.z_coef = config.router_aux_loss_coef, config.router_z_loss_coef
        self.capacity_factor = config.moe_capacity_factor
        self.router = SplitLinear(C, E, bias=False)
        gated = config.architecture.gated_mlp
        self.expert_names = SWIGLU_EXPERTS if gated else GELU_EXPERTS  # the inputs' [E, H, C], then proj's
        for name in self.expert_names:
            setattr(self, name, nn.Parameter(torch.empty((E, C, H) if name == "experts_proj" else (E, H, C))))
        self.shared = SharedExperts(C, config.n_shared_experts * H, gated) if config.n_shared_experts else None
        self.drop = nn.Dropout(config.dropout)
        self.register_buffer("expert_bias", torch.zeros(E))
        # Since the last end_step: assignments each expert took, assignments dropped, the aux losses' sum and calls
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.aux_sum, self.calls = 0.0, 0
        self.aux_loss_scale = 1.0  # the gradient each call's aux loss gets: the stage's loss scale (1/microbatches)
        self.expert_parallel = None  # pipegpt.expert_parallel's ExpertGroup where experts are spread over ranks
        self.cast_weights = CastOnce()
        # False where the layer's calls keep nothing for their backward (full recomputation, set by GPT): a cast
        # kept for the step would only add memory there
        self.cast_once = True
        # Where a call's tokens are spread over ranks (sequence parallelism over tp, cp): functions summing a tensor
        # over each group holding the call's other tokens, autograd-correct for that group's gradient sums
        # (set by shard_for_tp and shard_for_cp), so the aux loss is the one-process call's
        self.token_sums: list = []

    def route(self, x: torch.Tensor):
        """x [N, C] -> logits [N, E], scores [N, E], chosen experts [N, k], their weights [N, k]."""
        logits = self.router(x)
        logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits  # routing in fp32
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        chosen = (scores.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.normalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, scores, chosen, weights

    def kept(self, chosen: torch.Tensor) -> torch.Tensor:
        """[N, k] which assignments their experts take: all (dropless), or each expert's first `capacity` in
        token order."""
        if not self.capacity_factor:
            return torch.ones_like(chosen, dtype=torch.bool)
        N, k = chosen.shape
        capacity = math.ceil(self.capacity_factor * N * k / self.n_experts)
        onehot = F.one_hot(chosen.reshape(-1), self.n_experts)  # in token order, a token's k slots together
        place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # each assignment's place in its expert's queue
        return (place < capacity).view(N, k)

    def over_call(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks holding this call's other tokens (itself where this rank holds them all)."""
        for token_sum in self.token_sums:
            t = token_sum(t)
        return t

    def aux_loss(self, logits, scores, chosen) -> torch.Tensor:
        # Sums over the call's tokens, then divided by their count: the means of the whole call where ranks hold
        # parts of it (counts carry no gradient; the scores' sums do, through the reductions' backward)
        E = scores.size(1)
        N = self.over_call(scores.new_tensor(float(scores.size(0))))
        aux = logits.new_zeros(())
        if self.aux_coef:
            share = self.over_call(torch.bincount(chosen.reshape(-1), minlength=E).to(scores.dtype)) / N
            probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            aux = aux + self.aux_coef * E * (share * self.over_call(probs.sum(0)) / N).sum()
        if self.z_coef:
            aux = aux + self.z_coef * self.over_call(logits.logsumexp(-1).square().sum()) / N
        return aux

    def assign(self, x: torch.Tensor) -> "Assignments":
        """x [N, C] -> its routing and its kept assignments sorted by expert (stably: in token order within one)."""
        logits, scores, chosen, weights = self.route(x)
        keep = self.kept(chosen)
        flat_expert = chosen.reshape(-1)[keep.reshape(-1)]
        flat_token = torch.arange(x.size(0), device=x.device).repeat_interleave(self.top_k)[keep.reshape(-1)]
        order = flat_expert.argsort(stable=True)
        counts = torch.bincount(flat_expert, minlength=self.n_experts)
        kept_weights = weights.reshape(-1)[keep.reshape(-1)]
        return Assignments(logits, scores, chosen, keep, flat_token[order], kept_weights[order], counts)

    def experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on rows sorted by them, counts[e] rows for (local) expert e."""
        return expert_outputs(rows, counts, *self.expert_weights(compute_dtype(rows)))

    def expert_weights(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's expert weights in `dtype` (the experts' matmuls'): the parameters where they are in it; else,
        while autograd records, one cast shared by every call until the weights change or end_step (a cast per
        call would keep a bf16 copy of the rank's experts per microbatch in flight); a cast per call under full
        recomputation (cast_once False), whose checkpoints keep none."""
        params = [getattr(self, name) for name in self.expert_names]
        if all(p.dtype == dtype for p in params):
            return params
        if not torch.is_grad_enabled() or not self.cast_once:
            return [p.to(dtype) for p in params]
        return self.cast_weights.get(params, dtype)

    def dispatched(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows about to travel to the experts' ranks, in the dtype the experts compute in (the same values they
        would read after the cast; under bf16, half the bytes)."""
        return rows.to(compute_dtype(rows))

    def weigh(self, y: torch.Tensor, a: "Assignments", n_tokens: int) -> torch.Tensor:
        """The experts' outputs y (rows as a.tokens) weighted and summed per token: [n_tokens, C]."""
        y = y * a.weights[:, None].to(y.dtype)
        return torch.zeros((n_tokens, y.size(1)), dtype=y.dtype, device=y.device).index_add_(0, a.tokens, y)

    def account(self, hidden: torch.Tensor, a: "Assignments") -> torch.Tensor:
        """Training: count the loads and drops, and give the aux loss its gradient through `hidden` (returned)."""
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.tokens_per_expert += a.counts.to(self.tokens_per_expert.dtype)
                self.dropped += (~a.keep).sum()
            aux = self.aux_loss(a.logits, a.scores, a.chosen)
            if aux.requires_grad:
                self.aux_sum, self.calls = self.aux_sum + aux.detach(), self.calls + 1
                hidden = inject_aux_loss(hidden, aux, self.aux_loss_scale)
        return hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        a = self.assign(x)
        y = (self.experts(x[a.tokens], a.counts.tolist()) if self.expert_parallel is None
             else self.expert_parallel.run(self.dispatched(x[a.tokens]), a.counts, self.experts))
        out = self.weigh(y, a, x.size(0))
        if self.shared is not None:
            out = out + self.shared(x)
        return self.account(self.drop(out.view(shape)), a)


class CastOnce:
    """An MoE layer's expert weights cast for its matmuls, kept while the parameters are unchanged (same version
    and storage) and until forget(). The cast's backward (a dtype conversion) saves no tensor, so every call's
    backward runs through it and adds into the fp32 weights' .grad exactly as a cast per call does."""

    __slots__ = ("key", "weights")

    def __init__(self):
        self.key, self.weights = None, None

    def get(self, params: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        key = (dtype, *((p._version, p.data_ptr(), p.requires_grad) for p in params))
        if key != self.key:
            self.key, self.weights = key, [p.to(dtype) for p in params]
        return self.weights

    def forget(self) -> None:
        self.key, self.weights = None, None

    def __deepcopy__(self, memo):  # a copied layer casts its own (autograd's tensors do not deep-copy)
        return CastOnce()

    def __reduce__(self):
        return CastOnce, ()


@dataclasses.dataclass
class Assignments:
    """A call's routing (logits, scores [N, E], chosen [N, k], keep [N, k]) and its kept assignments sorted by
    expert: each one's token and weight, and the count per expert [E]."""

    logits: torch.Tensor
    scores: torch.Tensor
    chosen: torch.Tensor
    keep: torch.Tensor
    tokens: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor


def block_steps(block: nn.Module, x: torch.Tensor, documents, full_recompute: bool):
    """A block whose MLP is an MoE over ep ranks (block.ln1, attn, ln2, mlp: model.gpt.Block), as the Stage's
    forward_steps (stages.overlap): its forward in three parts, the dispatch and the combine posted between them
    as cuts, so that in a pair the other half computes while the tokens travel, in the backward too.

        before    x + attention, the norm, routing, the shared expert; the rows for the experts
        counts    posted: how many rows go to each expert (they size the dispatch)
        dispatch  rows to their experts' ranks (the residual stream, shared output and weights carried past it)
        experts   this rank's experts on the rows it received
        combine   outputs back to the ranks that sent them (the carried tensors past it again)
        after     weighted sum per token, plus the shared expert's, dropout, plus the residual stream

    Each part runs under checkpoint where the model recomputes whole blocks (the all-to-alls are not repeated in
    backward). Equals block(x) in value and gradients; the aux loss's gradient goes in through the residual
    stream instead of the MLP's output, where it is the same."""
    moe, ep = block.mlp, block.mlp.expert_parallel
    shape = x.shape
    run = _checkpointed if full_recompute and torch.is_grad_enabled() else _called

    def before(x):
        h = x + block.attn(block.ln1(x), None, documents)
        xn = block.ln2(h).reshape(-1, shape[-1])
        a = moe.assign(xn)
        shared = moe.shared(xn) if moe.shared is not None else xn.new_zeros(0)
        return moe.account(h, a), shared, a.weights, moe.dispatched(xn[a.tokens]), a

    h, shared, weights, rows, a = run(before, x)
    received_counts = yield ep.post_counts(a.counts)  # a plain handle: no gradient goes back
    dispatch, route = ep.post_dispatch([h, shared, weights], rows, a.counts, received_counts)
    (h, shared, weights), received = dispatch.unpack((yield dispatch))

    def experts(received):
        return moe.experts(received[route.by_expert], route.expert_counts)[route.by_source]

    combine = ep.post_combine([h, shared, weights], run(experts, received), route)
    (h, shared, weights), back = combine.unpack((yield combine))

    def after(h, shared, weights, back):
        out = moe.weigh(back, dataclasses.replace(a, weights=weights), math.prod(shape[:-1]))
        if moe.shared is not None:
            out = out + shared
        return h + moe.drop(out.view(shape))

    return run(after, h, shared, weights, back)


def _checkpointed(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _called(fn, *args):
    return fn(*args)


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Every MoE layer of module gives its aux loss the gradient `scale` (the one its loss's backward starts
    from: 1/microbatches on a pipeline stage)."""
    for layer in moe_layers(module):
        layer.aux_loss_scale = scale


@torch.no_grad()
def end_step(module: nn.Module, rate: float, all_reduce=None) -> dict:
    """After an optimizer step: each MoE layer's loads since the last step (summed over replicas by
    all_reduce(tensor), if given) move its expert bias by rate x sign(mean - load), and are forgotten.
    Returns this module's stats ({} without MoE layers): aux_loss (the sum over layers of each layer's mean aux loss per call),
    moe_imbalance (the worst layer's max / mean load), moe_dropped (assignments dropped) and moe_layers, per layer
    {layer (its block's number), imbalance, dropped, aux_loss, bias_min, bias_max (after the update)}."""
    named = [(int(name.split(".")[1]) if name.startswith("blocks.") else i, m)
             for i, (name, m) in enumerate(module.named_modules()) if isinstance(m, MoE)]
    if not named:
        return {}
    per_layer = []
    for number, layer in named:
        load = layer.tokens_per_expert.clone()
        if all_reduce is not None:
            all_reduce(load)
        if rate and load.sum() > 0:
            layer.expert_bias += rate * torch.sign(load.mean() - load)
        mean = float(load.mean())
        per_layer.append({"layer": number, "imbalance": float(load.max()) / mean if mean else 0.0,
                          "dropped": float(layer.dropped),
                          "aux_loss": float(layer.aux_sum) / layer.calls if layer.calls else 0.0,
                          "bias_min": float(layer.expert_bias.min()), "bias_max": float(layer.expert_bias.max())})
        layer.tokens_per_expert.zero_()
        layer.dropped.zero_()
        layer.aux_sum, layer.calls = 0.0, 0
        # the step's update may have written the weights without a version ZeRO-3's gathers keep (p.data = ...)
        layer.cast_weights.forget()
    return {"aux_loss": sum(s["aux_loss"] for s in per_layer),
            "moe_imbalance": max(s["imbalance"] for s in per_layer),
            "moe_dropped": sum(s["dropped"] for s in per_layer), "moe_layers": per_layer}


def counted_once(stats: dict, aux_here: bool, tokens_here: bool) -> dict:
    """A rank's end_step stats as merge_stats over every rank must see them where ranks share figures (tp ranks:
    one aux loss, and without sequence parallelism the same tokens): the aux loss only where aux_here, the dropped
    assignments only where tokens_here."""
    if not stats:
        return stats
    return {**stats, "aux_loss": stats["aux_loss"] if aux_here else 0.0,
            "moe_dropped": stats["moe_dropped"] if tokens_here else 0.0}


def merge_stats(stats: list[dict], replicas: int = 1) -> dict:
    """Several modules' (or ranks') end_step stats as one: aux losses summed over the layers, averaged over
    `replicas` (data-parallel copies that saw other tokens); the worst imbalance; dropped assignments summed.
    moe_layers: a row per layer, its copies (replicas, whose loads were summed alike) merged the same way."""
    stats = [s for s in stats if s]
    if not stats:
        return {}
    layers: dict[int, list[dict]] = {}
    for s in stats:
        for row in s.get("moe_layers", ()):
            layers.setdefault(row["layer"], []).append(row)
    merged = [{"layer": number, "imbalance": max(r["imbalance"] for r in rows),
               "dropped": sum(r["dropped"] for r in rows),
               "aux_loss": sum(r["aux_loss"] for r in rows) / replicas,
               "bias_min": min(r["bias_min"] for r in rows), "bias_max": max(r["bias_max"] for r in rows)}
              for number, rows in sorted(layers.items())]
    return {"aux_loss": sum(s["aux_loss"] for s in stats) / replicas,
            "moe_imbalance": max(s["moe_imbalance"] for s in stats),
            "moe_dropped": sum(s["moe_dropped"] for s in stats), **({"moe_layers": merged} if merged else {})}
