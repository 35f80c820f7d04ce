"""What `pipegpt plan` prints: the text report (the table, each plan's memory, time and command, and with
--explain why the others lost and what does not fit), the JSON object, and the line when nothing fits."""
from __future__ import annotations

from pipegpt.arch import GPT2, layer_mix
from pipegpt.config import ConfigError, ModelConfig
from pipegpt.model.flops import flops_per_token

from pipegpt.costs import memory as memory_model
from pipegpt.dims import AXES
from .candidates import LAYOUT_AXES, MAX_ACTIONS, Layout, Refusal, Result, SearchResult, model_args
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


def busiest_line(r: Result) -> str:
    """Where the busiest rank's step goes: compute, collectives, idle, what is exposed, the step's end."""
    b = r.breakdown
    return (f"busiest rank {b['rank']}: compute {format_seconds(b['compute'])}"
            + (f" (recomputation {format_seconds(b['recompute'])})" if b["recompute"] else "")
            + (f", tensor-parallel collectives {format_seconds(b['tp_comm'])}" if b["tp_comm"] else "")
            + (f", context-parallel K/V exposed {format_seconds(b['cp_comm'])}" if b["cp_comm"] else "")
            + (f", expert all-to-alls {format_seconds(b['ep_comm'])}" if b.get("ep_comm") else "")
            + f", idle {format_seconds(b['idle'])}"
            + (f"; gradient {'reduce-scatter' if r.layout.zero else 'all-reduce'} exposed "
               f"{format_seconds(b['dp_exposed'])}" if b["dp_exposed"] > 0 else "")
            + (f"; parameter gathers exposed {format_seconds(b['gathers'])}" if b.get("gathers") else "")
            + f"; after the last action {format_seconds(b['after'])}")


TIE = 0.01  # plans predicted within 1% of the fastest are ties: the model cannot tell them apart


def simplicity(layout: Layout) -> tuple:
    """What a person weighs between plans that tie: GPUs used, parallel axes over 1, more than one model stage
    per rank (interleaved or V-shaped), the ZeRO level; less is simpler."""
    axes = sum(1 for axis in AXES if getattr(layout, axis, 1) > 1)
    return layout.world, axes, layout.stages > layout.pp, layout.zero


def rank_ties(best: list[Result]) -> list[Result]:
    """The plans (fastest first) with those within TIE of the fastest ranked by simplicity, then peak memory."""
    tied = tie_group(best)
    return sorted(tied, key=lambda r: (simplicity(r.layout), r.peak_bytes, r.step_time)) + best[len(tied):]


def ties_line(best: list[Result]) -> str | None:
    """The note under the table when its first plans tie (None when #1 stands alone)."""
    n = len(tie_group(best))
    if n < 2:
        return None
    return (f"#1-#{n} predict step times within {100 * TIE:.0f}% of the fastest, a tie for this model: ranked by "
            f"simplicity (fewer GPUs and parallel axes, one model stage per rank, lower ZeRO), then memory")


def tie_group(best: list[Result]) -> list[Result]:
    """The plans within TIE of the fastest: the first ones once rank_ties ranked them."""
    limit = min((r.step_time for r in best), default=0.0) * (1 + TIE)
    return [r for r in best if r.step_time <= limit]


def explain(runner: Result, best: Result, tied: bool | None = None) -> str:
    """Why `runner` ranks below `best`: a tie (tied; by default within TIE of best), what makes it less simple;
    else the step-time parts that grew the most, in numbers (never two that print alike)."""
    slower = runner.step_time / best.step_time - 1
    pct = 100 * slower if abs(slower) >= 5e-4 else 0.0
    head = f"{pct:+.1f}% step time"
    if slower <= TIE if tied is None else tied:
        return f"{head}, a tie (within {100 * TIE:.0f}%): {_less_simple(runner, best)}"
    rb, bb = runner.breakdown, best.breakdown
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
    for part, delta in sorted(deltas.items(), key=lambda kv: -kv[1]):
        if len(reasons) == 2 or (delta <= 0.05 * (runner.step_time - best.step_time) and reasons):
            break
        reason = _reason(part, runner, best)
        if reason is not None:
            reasons.append(reason)
    if not reasons:  # every part prints alike: the steps themselves, to the digit that differs
        digits = next(d for d in range(3, 12) if f"{runner.step_time:.{d}g}" != f"{best.step_time:.{d}g}")
        reasons.append(f"step {runner.step_time:.{digits}g} s vs {best.step_time:.{digits}g} s")
    return f"{head}: " + "; ".join(reasons)


def _less_simple(runner: Result, best: Result) -> str:
    """The first of simplicity's and memory's terms where a tied plan loses (or 'as simple')."""
    L, B = runner.layout, best.layout
    ours, theirs = simplicity(L), simplicity(B)
    words = [f"uses {L.world} GPUs vs {B.world}", f"{ours[1]} parallel axes over 1 vs {theirs[1]}",
             f"{L.stages // L.pp} model stages per rank vs {B.stages // B.pp}", f"ZeRO-{L.zero} vs ZeRO-{B.zero}"]
    for mine, other, text in zip(ours, theirs, words):
        if mine != other:
            return text
    if format_bytes(runner.peak_bytes) != format_bytes(best.peak_bytes):
        return f"peak memory {format_bytes(runner.peak_bytes)} vs {format_bytes(best.peak_bytes)}"
    return "as simple, and as much memory"


def _reason(part: str, runner: Result, best: Result) -> str | None:
    """One part of the step in which `runner` loses, as `theirs vs ours`; None where the two print alike."""
    rb, bb = runner.breakdown, best.breakdown

    def versus(text: str, mine: float, other: float, unit=format_seconds) -> str | None:
        a, b = unit(mine), unit(other)
        return None if a == b else text.format(a, b)

    if part == "idle":
        return versus("bubble {} vs {}", runner.bubble, best.bubble, lambda x: f"{100 * x:.1f}%")
    if part == "compute":
        what = (f"{runner.layout.world} GPUs vs {best.layout.world}: " if runner.layout.world != best.layout.world
                else "")
        work = lambda b: b["compute"] - b["recompute"]  # noqa: E731
        return versus(what + "{} of compute on its busiest GPU vs {}", work(rb), work(bb))
    if part == "recompute":
        return (f"{runner.layout.recompute} recomputation adds {format_seconds(rb['recompute'])} to its busiest GPU"
                if rb["recompute"] else None)
    if part == "tp_comm":
        return versus("tensor-parallel collectives {} vs {}", rb["tp_comm"], bb["tp_comm"])
    if part == "cp_comm":
        return versus("context-parallel K/V transfers not hidden {} vs {}", rb["cp_comm"], bb["cp_comm"])
    if part == "gathers":
        return versus("ZeRO-3 parameter gathers not hidden: {} vs {}", rb.get("gathers", 0.0), bb.get("gathers", 0.0))
    if part == "ep_comm":
        return versus("expert all-to-alls {} vs {}", rb.get("ep_comm", 0.0), bb.get("ep_comm", 0.0))
    if part == "dp_exposed":
        return versus("gradient all-reduce not hidden: {} vs {}", rb["dp_exposed"], bb["dp_exposed"])
    zero = f", ZeRO-{runner.layout.zero} all-gather" if runner.layout.zero else ""
    return versus(f"after the last action (optimizer{zero}) {{}} vs {{}}", rb["after"], bb["after"])


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


def model_name(model: ModelConfig) -> str:
    """The preset and the options that change it, as `pipegpt run` takes them ("llama3-70b with --seq-len
    131072"), or "custom" for a shape no preset of its width gives."""
    try:
        args = model_args(model)
    except ConfigError:
        return "custom"
    if args[:1] != ["--model"]:
        return "custom"
    return args[1] + (f" with {' '.join(args[2:])}" if args[2:] else "")


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
    lines = [f"model: {model_name(req.model)}, {describe_model(req.model)}",
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
    tie = ties_line(res.best)
    if tie:
        lines.append(tie)
    for i, r in enumerate(res.best, 1):
        L = r.layout
        lines += ["", f"#{i} {L.short()}",
                  f"  peak memory {format_bytes(r.peak_bytes)} of {format_bytes(c.usable_bytes)} usable on "
                  f"pipeline rank "
                  f"{r.peak_rank}: {memory_line(r.memory[r.peak_rank])}",
                  f"  {busiest_line(r)}",
                  f"  layers per stage {','.join(map(str, L.layers_per_stage))}",
                  f"  {L.command(r.model, precision)}"]
        if L.world > c.gpus_per_node:
            lines.append(f"  (on {-(-L.world // c.gpus_per_node)} nodes: torchrun --nnodes "
                         f"{-(-L.world // c.gpus_per_node)} --nproc-per-node {c.gpus_per_node} ... -m pipegpt run ...)")
    if req.explain and res.best:
        best = res.best[0]
        lines += ["", "why the others lost (against #1):"]
        tied = tie_group(res.best)
        for i, r in enumerate(res.best[1:], 2):
            lines.append(f"  #{i} {r.layout.short()}: {explain(r, best, r in tied)}")
        for s, r in res.runners.items():
            if isinstance(r, Result):
                lines.append(f"  best {s}: {r.layout.short()}: {explain(r, best, False)}")
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
        "why": ({f"#{i}": explain(r, res.best[0], r in tie_group(res.best)) for i, r in enumerate(res.best[1:], 2)}
                if res.best else {}),
        "refused": [{**{axis: getattr(r.dims, axis) for axis in LAYOUT_AXES}, "needs_bytes": r.needs, "parts": r.parts,
                     "variant": r.what} for r in res.refusals[:20]],
    }


def _less_reserve(c) -> str:
    return f" ({format_bytes(c.usable_bytes)} after the {format_bytes(c.reserve_bytes)} --reserve)" \
        if c.reserve_bytes else ""
