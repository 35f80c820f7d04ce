"""What `pipegpt plan` prints: the text report (the table, each plan's memory, time and command, and with
--explain why the others lost and what does not fit), the JSON object, and the line when nothing fits."""
from __future__ import annotations

from pipegpt.arch import GPT2, layer_mix
from pipegpt.config import ModelConfig
from pipegpt.model.flops import flops_per_token

from pipegpt.costs import memory as memory_model
from .candidates import LAYOUT_AXES, MAX_ACTIONS, Refusal, Result, SearchResult
from pipegpt.costs.devices import format_bytes


def format_seconds(x: float) -> str:
    x = float(x)
    if x == 0:
        return "0"
    if x >= 1:
        return f"{x:.3g} s" if x < 100 else f"{x:.0f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} us"


def format_count(x: float, sep: str = "") -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{sep}{unit}"
    return f"{x:.3g}{sep}"


def memory_line(parts: dict) -> str:
    shown = [("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer"),
             ("activations", "activations"), ("workspace", "workspace"), ("communication", "communication")]
    return ", ".join(f"{label} {format_bytes(parts[key])}" for key, label in shown if parts.get(key))


def explain(runner: Result, best: Result) -> str:
    """Why `runner` is slower than `best`: the step-time part that grew the most, in numbers."""
    rb, bb = runner.breakdown, best.breakdown
    slower = runner.step_time / best.step_time - 1
    head = f"+{100 * slower:.1f}% step time"
    if slower < 1e-3:
        why = ("ties within 0.1%" + (f"; uses {runner.layout.world} GPUs vs {best.layout.world}"
                                     if runner.layout.world != best.layout.world else "")
               + (f"; peak memory {format_bytes(runner.peak_bytes)} vs {format_bytes(best.peak_bytes)}"
                  if runner.peak_bytes != best.peak_bytes else ""))
        return f"{head}: {why}"
    work = lambda b: b["compute"] - b["recompute"]  # noqa: E731
    deltas = {
        "compute": work(rb) - work(bb),
        "recompute": rb["recompute"] - bb["recompute"],
        "tp_comm": rb["tp_comm"] - bb["tp_comm"],
        "cp_comm": rb["cp_comm"] - bb["cp_comm"],
        "idle": rb["idle"] - bb["idle"],
        "dp_exposed": rb["dp_exposed"] - bb["dp_exposed"],
        "after": rb["after"] - bb["after"],
        "gathers": rb.get("gathers", 0.0) - bb.get("gathers", 0.0),
        "ep_comm": rb.get("ep_comm", 0.0) - bb.get("ep_comm", 0.0),  # last: dense plans' reasons as before
    }
    reasons = []
    for part, delta in sorted(deltas.items(), key=lambda kv: -kv[1])[:2]:
        if delta <= 0.05 * (runner.step_time - best.step_time) and reasons:
            break
        if part == "idle":
            reasons.append(f"bubble {100 * runner.bubble:.1f}% vs {100 * best.bubble:.1f}%")
        elif part == "compute":
            what = (f"{runner.layout.world} GPUs vs {best.layout.world}: " if runner.layout.world != best.layout.world
                    else "")
            reasons.append(f"{what}{format_seconds(work(rb))} of compute on its busiest GPU vs "
                           f"{format_seconds(work(bb))}")
        elif part == "recompute":
            reasons.append(f"{runner.layout.recompute} recomputation adds {format_seconds(rb['recompute'])} "
                           f"to its busiest GPU")
        elif part == "tp_comm":
            reasons.append(f"tensor-parallel collectives {format_seconds(rb['tp_comm'])} vs "
                           f"{format_seconds(bb['tp_comm'])}")
        elif part == "cp_comm":
            reasons.append(f"context-parallel K/V transfers not hidden {format_seconds(rb['cp_comm'])} vs "
                           f"{format_seconds(bb['cp_comm'])}")
        elif part == "gathers":
            reasons.append(f"ZeRO-3 parameter gathers not hidden: {format_seconds(rb.get('gathers', 0.0))} vs "
                           f"{format_seconds(bb.get('gathers', 0.0))}")
        elif part == "ep_comm":
            reasons.append(f"expert all-to-alls {format_seconds(rb.get('ep_comm', 0.0))} vs "
                           f"{format_seconds(bb.get('ep_comm', 0.0))}")
        elif part == "dp_exposed":
            reasons.append(f"gradient all-reduce not hidden: {format_seconds(rb['dp_exposed'])} vs "
                           f"{format_seconds(bb['dp_exposed'])}")
        else:
            zero = f", ZeRO-{runner.layout.zero} all-gather" if runner.layout.zero else ""
            reasons.append(f"after the last action (optimizer{zero}) "
                           f"{format_seconds(rb['after'])} vs {format_seconds(bb['after'])}")
    return f"{head}: " + "; ".join(reasons)


def refusal_line(r: Refusal, capacity: float) -> str:
    parts = {k: v for k, v in r.parts.items() if k != "total"}
    dominant = r.dominant()
    share = parts[dominant] / r.needs if r.needs else 0
    return (f"{r.name}: needs at least {format_bytes(r.needs)} > {format_bytes(capacity)} "
            f"({dominant} {format_bytes(parts[dominant])}, {100 * share:.0f}%; {r.what})")


def no_fit_message(res: SearchResult) -> str:
    """The one line printed when no plan fits."""
    c = res.request.cluster
    if not res.refusals:
        return (f"no plan for this model on {c.gpus} GPUs: no layout passes the checks (tensor parallelism within "
                f"{c.gpus_per_node} GPUs per node, schedules, at most {MAX_ACTIONS} actions per plan)")
    lean = min(res.refusals, key=lambda r: r.needs)
    parts = {k: v for k, v in lean.parts.items() if k != "total"}
    dominant = lean.dominant()
    return (f"no plan fits {c.gpus} x {format_bytes(c.memory_bytes)}{_less_reserve(c)}: the leanest, "
            f"{lean.name} "
            f"({lean.what}), needs at least {format_bytes(lean.needs)} per GPU, most of it {dominant} "
            f"({format_bytes(parts[dominant])}, {100 * parts[dominant] / lean.needs:.0f}%): use more or larger GPUs, "
            f"a smaller model or sequence")


def describe_model(model: ModelConfig) -> str:
    params = memory_model.parameter_count(model, range(model.n_layer), True, True, 1)
    mix = layer_mix(model, range(model.n_layer))
    kinds = f" ({', '.join(f'{n} {kind.title}' for kind, n in mix)})" if len(mix) > 1 else ""  # layers that differ
    flops = format_count(flops_per_token(model), " ")
    heads = f"{model.n_head} heads"
    if model.architecture is not GPT2:  # stated where GPT-2's line implies it: kv heads = heads, MLP 4 x width
        heads = (f"{model.arch}, {model.n_head} heads ({model.kv_heads} key/value), {model.architecture.mlp_title} "
                 f"{model.ffn_width}"
                 + (", untied head" if not model.tie_embeddings else ""))
    return (f"{format_count(params)} parameters: {model.n_layer} layers{kinds}, width {model.n_embd}, {heads}, "
            f"seq {model.seq_len}, vocabulary {model.vocab_size}; {flops}FLOP per token")


def format_text(res: SearchResult) -> str:
    req, c = res.request, res.request.cluster
    precision = c.precision
    from pipegpt.config import MODEL_PRESETS

    name = next((n for n, m in MODEL_PRESETS.items() if m == req.model), "custom")
    lines = [f"model: {name}, {describe_model(req.model)}",
             f"batch: {req.batch_size} sequences x {req.model.seq_len} tokens = "
             f"{req.batch_size * req.model.seq_len:,} tokens per step",
             f"cluster: {c.describe()}",
             f"costs: {req.costs.describe()}",
             f"best plan per layout and schedule; searched {res.stats['layouts']} layouts "
             f"({res.stats['layouts_expanded']} expanded), "
             f"{res.stats['candidates']} candidates; {res.stats['popped']} checked, {res.stats['simulated']} simulated "
             f"(+{res.stats['cache_hits']} from cache) in {res.stats['seconds_total']:.2f} s", ""]
    rows = [["#", "layout", "GPUs", "schedule", "m x mbs", "recompute", "zero", "split", "step", "tokens/s", "MFU",
             "bubble", "peak memory"]]
    for i, r in enumerate(res.best, 1):
        L = r.layout
        sched = L.schedule + (f" v{L.virtual_stages}" if L.takes_virtual_stages else "")
        rows.append([i, L.mesh_name, L.world, sched,
                     f"{L.microbatches} x {L.microbatch_size}", L.recompute,
                     f"{L.zero} ({L.unshard})" if L.unshard else L.zero,
                     "balanced" if L.balanced else "even", format_seconds(r.step_time), format_count(r.tokens_per_s),
                     "-" if r.mfu is None else f"{100 * r.mfu:.1f}%", f"{100 * r.bubble:.1f}%",
                     f"{format_bytes(r.peak_bytes)} (rank {r.peak_rank})"])
    from pipegpt.schedule.render import text_table

    lines.append(text_table(rows, right={0, 2, 6, 8, 9, 10, 11}, rule=True))
    for i, r in enumerate(res.best, 1):
        L, b = r.layout, r.breakdown
        lines += ["", f"#{i} {L.short()}",
                  f"  peak memory {format_bytes(r.peak_bytes)} of {format_bytes(c.usable_bytes)} usable on "
                  f"pipeline rank "
                  f"{r.peak_rank}: {memory_line(r.memory[r.peak_rank])}",
                  f"  busiest rank {b['rank']}: compute {format_seconds(b['compute'])}"
                  + (f" (recomputation {format_seconds(b['recompute'])})" if b["recompute"] else "")
                  + (f", tensor-parallel collectives {format_seconds(b['tp_comm'])}" if b["tp_comm"] else "")
                  + (f", context-parallel K/V exposed {format_seconds(b['cp_comm'])}" if b["cp_comm"] else "")
                  + (f", expert all-to-alls {format_seconds(b['ep_comm'])}" if b.get("ep_comm") else "")
                  + f", idle {format_seconds(b['idle'])}"
                  + (f"; gradient {'reduce-scatter' if L.zero else 'all-reduce'} exposed "
                     f"{format_seconds(b['dp_exposed'])}" if b["dp_exposed"] > 0 else "")
                  + (f"; parameter gathers exposed {format_seconds(b['gathers'])}" if b.get("gathers") else "")
                  + f"; after the last action {format_seconds(b['after'])}",
                  f"  layers per stage {','.join(map(str, L.layers_per_stage))}",
                  f"  {L.command(r.model, precision)}"]
        if L.world > c.gpus_per_node:
            lines.append(f"  (on {-(-L.world // c.gpus_per_node)} nodes: torchrun --nnodes "
                         f"{-(-L.world // c.gpus_per_node)} --nproc-per-node {c.gpus_per_node} ... -m pipegpt run ...)")
    if req.explain and res.best:
        best = res.best[0]
        lines += ["", "why the others lost (against #1):"]
        for i, r in enumerate(res.best[1:], 2):
            lines.append(f"  #{i} {r.layout.short()}: {explain(r, best)}")
        for s, r in res.runners.items():
            if isinstance(r, Result):
                lines.append(f"  best {s}: {r.layout.short()}: {explain(r, best)}")
            else:
                lines.append(f"  {s}: {r}")
        cut = best.layout.sharding.replica_size
        lighter = sorted((x for x in res.refusals if x.model_parallel < cut),
                         key=lambda x: (-x.model_parallel, x.needs))
        if lighter:
            lines.append("  less model parallelism does not fit (the nearest layouts):")
            seen = set()
            for x in lighter:
                if x.dims._replace(dp=1) in seen:  # one line per model cut
                    continue
                seen.add(x.dims._replace(dp=1))
                lines.append("    " + refusal_line(x, c.usable_bytes))
                if len(seen) == 4:
                    break
    return "\n".join(lines)


def as_json(res: SearchResult) -> dict:
    req, c = res.request, res.request.cluster
    from dataclasses import asdict

    return {
        "model": asdict(req.model), "batch_size": req.batch_size, "tokens_per_step": req.batch_size * req.model.seq_len,
        "cluster": asdict(c), "costs": req.costs.describe(), "stats": res.stats,
        "plans": [r.as_dict(c.precision) for r in res.best],
        "runners": {s: (r.as_dict(c.precision) if isinstance(r, Result) else r) for s, r in res.runners.items()},
        "why": ({f"#{i}": explain(r, res.best[0]) for i, r in enumerate(res.best[1:], 2)} if res.best else {}),
        "refused": [{**{axis: getattr(r.dims, axis) for axis in LAYOUT_AXES}, "needs_bytes": r.needs, "parts": r.parts,
                     "variant": r.what} for r in res.refusals[:20]],
    }


def _less_reserve(c) -> str:
    return f" ({format_bytes(c.usable_bytes)} after the {format_bytes(c.reserve_bytes)} --reserve)" \
        if c.reserve_bytes else ""
