"""The options of the commands (run and plan's model shape; simulate, plan, prepare, convert, sample, hellaswag),
declared apart from their commands (pipegpt.cli) so that cli.py reads as the list of commands; the model's shape
options made into a model (model_from_options) and written back for one (model_flags). torch-free, like cli.py.
"""
from __future__ import annotations

import click

from pipegpt.arch import ARCHITECTURES, GPT2
from pipegpt.config import ARCHS, CP_COMM, MODEL_PRESETS, ConfigError, ModelConfig, model_config
from pipegpt.model_config import MOE_FLAG_FIELDS, QK_NORMS

# The mixture-of-experts settings (docs/moe.md): each option sets the ModelConfig field of its name (--n-experts:
# n_experts), its type and help here.
EXPERT_OPTIONS = {
    "n_experts": (int, "Routed experts per MoE layer (default: the preset's; 0: a dense model)."),
    "n_experts_per_token": (int, "Experts each token goes to (top-k; default 2)."),
    "n_shared_experts": (int, "Always-active experts (Qwen2-MoE's, DeepSeek's; default 0)."),
    "expert_hidden": (int, "Each expert's SwiGLU width (default: --ffn-hidden)."),
    "moe_every": (int, "Every k-th layer (from --first-dense-layers on) is MoE (default 1: all)."),
    "first_dense_layers": (int, "The first k layers stay dense (DeepSeek's first_k_dense_replace; default 0)."),
    "router_score": (click.Choice(["softmax", "sigmoid"]), "The router's scores (default softmax)."),
    "router_aux_loss_coef": (float, "Load-balancing aux loss (Switch/Mixtral) coefficient (default 0)."),
    "router_z_loss_coef": (float, "Router z-loss coefficient (default 0)."),
    "router_bias_update_rate": (float, "DeepSeek-V3's aux-loss-free balancing: the router bias's step after each "
                                       "update (default 0: off)."),
    "moe_capacity_factor": (float, "Each expert's capacity as a multiple of its even share of a call's tokens; the "
                                   "overflow is dropped and counted (default 0: dropless)."),
}
assert tuple(EXPERT_OPTIONS) == MOE_FLAG_FIELDS
MODEL_OPTIONS = ("preset", "n_layer", "n_embd", "n_head", "seq_len", "vocab_size", "pad_vocab", "no_tie_embeddings",
                 "tie_embeddings", "dropout", "arch", "n_kv_head", "ffn_hidden", "rope_theta", "norm_eps", "qkv_bias",
                 "head_size", "qk_norm", *EXPERT_OPTIONS)
# settings of an architectural property (pipegpt.arch): given for an architecture without it, they are refused
# (GPT-2 has no grouping, rotary positions or q/k/v biases of their own)
ARCH_SPECIFIC = {"n_kv_head": ("--n-kv-head", "grouped_kv"), "rope_theta": ("--rope-theta", "rotary"),
                 "qkv_bias": ("--qkv-bias", "own_qkv_bias")}



def model_options(command):
    """The model's shape: a preset and the settings that override it (their names: MODEL_OPTIONS)."""
    for option in reversed([
        click.option("--model", "preset", default="tiny", show_default=True,
                     help=f"{', '.join(MODEL_PRESETS)} (--arch llama alone: tiny-llama)."),
        click.option("--arch", type=click.Choice(list(ARCHS)), default=None,
                     help="gpt2 or llama (rotary, RMSNorm, SwiGLU, grouped-query attention); default: the preset's."),
        click.option("--n-layer", type=int, default=None), click.option("--n-embd", type=int, default=None),
        click.option("--n-head", type=int, default=None), click.option("--seq-len", type=int, default=None),
        click.option("--vocab-size", type=int, default=None),
        click.option("--pad-vocab", is_flag=True,
                     help="Pad the vocabulary to a multiple of 64 (padded logits are never predicted)."),
        click.option("--no-tie-embeddings", is_flag=True, help="Separate LM-head weight instead of the token embedding."),
        click.option("--tie-embeddings", is_flag=True, default=None,
                     help="The LM head is the token embedding (default: the preset's; Llama presets mostly untie)."),
        click.option("--n-kv-head", type=int, default=None,
                     help="Llama: key/value heads (grouped-query attention; must divide --n-head; default n_head)."),
        click.option("--ffn-hidden", type=int, default=None,
                     help="The MLP's hidden width (default: 4 x n_embd for GPT-2; Llama: 8/3 x n_embd rounded up to a "
                          "multiple of 256)."),
        click.option("--rope-theta", type=float, default=None, help="Llama: rotary base (default 10000)."),
        click.option("--norm-eps", type=float, default=None, help="LayerNorm/RMSNorm epsilon (default 1e-5)."),
        click.option("--qkv-bias/--no-qkv-bias", default=None, help="Llama: biases on q, k, v only (Qwen2)."),
        click.option("--head-dim", "head_size", type=int, default=None,
                     help="Llama: each attention head's width (Hugging Face's head_dim; default n_embd / n_head)."),
        click.option("--qk-norm", type=click.Choice(list(QK_NORMS)), default=None,
                     help="Llama: RMSNorm of q and k before rotary, of each head (Qwen3) or of the whole projection "
                          "(OLMoE); default: the preset's, none."),
        click.option("--dropout", type=float, default=None,
                     help="Dropout probability of the embedding, attention and residual branches (default: the "
                          "preset's, 0.0; fine-tuning often uses 0.1)."),
        *[click.option(f"--{name.replace('_', '-')}", type=kind, default=None, help=text)
          for name, (kind, text) in EXPERT_OPTIONS.items()],
    ]):
        command = option(command)
    return command


def model_from_options(options: dict, vocab_size: int | None = None) -> ModelConfig:
    """The model model_options describe: the preset with the shape given overriding it (vocab_size: the
    default when --vocab-size is not given)."""
    o = {name: options.get(name) for name in MODEL_OPTIONS}
    preset = o["preset"] or "tiny"
    if o["arch"] in ARCHITECTURES and preset == "tiny":  # --arch alone: its own small preset (GPT-2's is tiny)
        preset = ARCHITECTURES[o["arch"]].default_preset
    arch = MODEL_PRESETS[preset].arch if preset in MODEL_PRESETS else None
    if o["arch"] is not None and arch is not None and o["arch"] != arch:
        raise ConfigError(f"--arch {o['arch']} does not match --model {preset} (a {arch} preset): leave out --arch "
                          f"or name a {o['arch']} preset")
    check_arch_flags(o, o["arch"] or arch)
    return model_config(preset, n_layer=o["n_layer"], n_embd=o["n_embd"], n_head=o["n_head"],
                        seq_len=o["seq_len"], vocab_size=vocab_size if o["vocab_size"] is None else o["vocab_size"],
                        tie_embeddings=tie_from_flags(o), pad_vocab_to=64 if o["pad_vocab"] else None,
                        dropout=o["dropout"],
                        n_kv_head=o["n_kv_head"], ffn_hidden=o["ffn_hidden"], rope_theta=o["rope_theta"],
                        norm_eps=o["norm_eps"], qkv_bias=o["qkv_bias"], head_size=o["head_size"], qk_norm=o["qk_norm"],
                        **{name: o[name] for name in EXPERT_OPTIONS})


def tie_from_flags(o: dict) -> bool | None:
    """tie_embeddings from --tie-embeddings / --no-tie-embeddings (None: neither given)."""
    if o.get("no_tie_embeddings") and o.get("tie_embeddings"):
        raise ConfigError("give either --tie-embeddings or --no-tie-embeddings, not both")
    return False if o.get("no_tie_embeddings") else (True if o.get("tie_embeddings") else None)


def check_arch_flags(o: dict, arch: str | None) -> None:
    """Refuse a setting of a property the architecture lacks (a Llama-only one given for a GPT-2); its default
    value (what GPT-2 has: a run's config.json holds them all) passes."""
    described, defaults = ARCHITECTURES.get(arch, GPT2), ModelConfig()
    for name, (flag, needs) in ARCH_SPECIFIC.items():
        if not getattr(described, needs) and o.get(name) is not None and o[name] != getattr(defaults, name):
            having = [a.name for a in ARCHITECTURES.values() if getattr(a, needs)]
            raise ConfigError(f"{flag} {shown_value(o[name])} applies to --arch {' or '.join(having)} only (this model "
                              f"is {arch or 'gpt2'}): leave it out or give --arch {having[0]}")


def model_flags(model: ModelConfig, tokenizer: str) -> str:
    """The `pipegpt run` model flags that build exactly this model (as --init-from requires)."""
    preset = next((name for name, m in MODEL_PRESETS.items() if m == model), None)
    if preset is not None:
        flags = f"--model {preset}"
    else:
        flags = (f"--n-layer {model.n_layer} --n-embd {model.n_embd} --n-head {model.n_head} "
                 f"--seq-len {model.seq_len} --vocab-size {model.vocab_size}")
        arch = model.architecture
        if arch is not GPT2:  # its shape in full: `--arch NAME` alone starts from that architecture's own preset
            flags = f"--arch {arch.name} {flags}" + (f" --n-kv-head {model.kv_heads}" if arch.grouped_kv else "")
            flags += f" --ffn-hidden {model.ffn_width}" + (f" --rope-theta {model.rope_theta}" if arch.rotary else "")
            flags += f" --norm-eps {model.norm_eps}" + (" --qkv-bias" if arch.own_qkv_bias and model.qkv_bias else "")
            flags += " --tie-embeddings" if model.tie_embeddings else " --no-tie-embeddings"
            flags += "" if model.head_size is None else f" --head-dim {model.head_size}"
            flags += "" if model.qk_norm == "none" else f" --qk-norm {model.qk_norm}"
        else:
            flags += "" if model.ffn_hidden is None else f" --ffn-hidden {model.ffn_hidden}"
            flags += "" if model.norm_eps == 1e-5 else f" --norm-eps {model.norm_eps}"
            flags += "" if model.tie_embeddings else " --no-tie-embeddings"
        if model.n_experts:  # the settings that differ from a dense model's defaults
            defaults = ModelConfig()
            flags += "".join(f" --{name.replace('_', '-')} {getattr(model, name)}" for name in EXPERT_OPTIONS
                             if getattr(model, name) != getattr(defaults, name))
    return f"{flags} --tokenizer {tokenizer}"


def shown_value(value) -> str:
    if value is None:
        return "default"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


CONVERT = [
    click.option("--from-hf", "from_hf", type=click.Path(), default=None,
                 help="Import: a Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE or OLMoE "
                      "directory (config.json and model.safetensors or pytorch_model.bin, either sharded with its index)."),
    click.option("--out", type=click.Path(), default=None, help="Import: the checkpoint directory to create."),
    click.option("--tokenizer", type=str, metavar="bytes|gpt2|tokenizer.json", default=None,
                 help="Import: the tokenizer the checkpoint remembers (default: the directory's tokenizer.json for "
                      "Llama-family models, else bytes; gpt2 for GPT-2)."),
    click.option("--to-hf", "to_hf", type=click.Path(), default=None,
                 help="Export: the directory for config.json and model.safetensors."),
    click.option("--checkpoint", "source", type=click.Path(), default=None,
                 help="Export: a checkpoint, or a run directory (its latest checkpoint)."),
]


def convert_options(command):
    return _stacked(command, CONVERT)


# what a command reading a checkpoint may override (sample, hellaswag)
READING = [
    click.option("--tokenizer", type=str, metavar="bytes|gpt2|tokenizer.json", default=None,
                 help="Override the tokenizer the checkpoint remembers."),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                 help="auto: CUDA when a GPU is visible."),
]


HELLASWAG = [
    click.option("--file", "jsonl", required=True, type=click.Path(), metavar="FILE",
                 help="HellaSwag jsonl (nanoGPT's hellaswag_val.jsonl): ctx, endings (4), label per line."),
    click.option("--limit", type=click.IntRange(min=1), default=None, help="Score only the first N examples."),
    *READING,
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object."),
]


def hellaswag_options(command):
    return _stacked(command, HELLASWAG)


PREPARE = [
    click.option("--out", "-o", required=True, type=click.Path(file_okay=False),
                 help="Directory for the shards and meta.json (created; must not hold prepared tokens already)."),
    click.option("--tokenizer", type=str, metavar="bytes|gpt2|tokenizer.json", default="bytes", show_default=True,
                 help="bytes (vocabulary 256, offline) or gpt2 (tiktoken BPE; documents start with token 50256)."),
    click.option("--val-fraction", type=click.FloatRange(0, 1, max_open=True), default=0.01, show_default=True,
                 help="The tail of the input that becomes the val split (cut at a line start)."),
    click.option("--shard-tokens", type=click.IntRange(min=1), default=100_000_000, show_default=True,
                 help="Tokens per shard file."),
]


def prepare_options(command):
    return _stacked(command, PREPARE)


SAMPLE = [
    click.option("--prompt", multiple=True, show_default="a newline",
                 help="The text to continue; repeat it for several prompts, generated together."),
    click.option("--prompts-file", type=click.Path(), default=None, metavar="FILE",
                 help="Prompts to continue, one per line (blank lines skipped), instead of --prompt."),
    click.option("--batch", type=click.IntRange(min=1), default=None,
                 help="Prompts generated together (default: all); the batches run one after another."),
    click.option("--max-new-tokens", type=int, default=200, show_default=True, help="Tokens to generate."),
    click.option("--temperature", type=float, default=0.8, show_default=True,
                 help="Softmax temperature; 0: always the most likely token (greedy)."),
    click.option("--top-k", type=int, default=200, show_default=True, help="Draw only from the k most likely tokens."),
    click.option("--seed", type=int, default=1337, show_default=True, help="Seed of the draws."),
    *READING,
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt: prompt, text, new_tokens."),
]


def sample_options(command):
    return _stacked(command, SAMPLE)


SIMULATE = [
    click.option("--schedule", "-s", default=None, metavar="NAME",
                 help="Schedule name, a comma list, or 'all' to compare (default 1f1b)."),
    click.option("--stages", "-p", type=click.IntRange(min=1), default=None,
                 help="Pipeline ranks p (each holds one stage, or v for interleaved/V schedules)."),
    click.option("--microbatches", "-m", type=click.IntRange(min=1), default=None, help="Microbatches per step."),
    click.option("--costs", "costs_spec", default=None, metavar="SPEC",
                 help="'F=1,B=2,W=1,comm=0.1' (act_bytes=, a2a= too) or a .json file with per-stage lists. Numbers are "
                      "per rank's share of the model: schedules with v stages per rank run each at 1/v. "
                      "Default F=1,B=2,W=1,comm=0."),
    click.option("--virtual-stages", "-v", type=click.IntRange(min=1), default=None,
                 help="Stages per rank for interleaved-1f1b (default 2) and auto (default 1)."),
    click.option("--schedule-file", type=click.Path(dir_okay=False), default=None,
                 help="Simulate a plan from a file (one line of actions per rank) instead of a generator."),
    click.option("--trace", "trace_dir", type=click.Path(), default=None, metavar="RUN_DIR",
                 help="Measured beside predicted: calibrate costs from a run directory's trace.json, simulate "
                      "its plan.txt with them, show both and the fidelity (predicted / measured)."),
    click.option("--trace-step", type=click.IntRange(min=1), default=None, metavar="N",
                 help="With --trace: read the run's traces/step-N.json (a step `pipegpt run --trace-steps` named) "
                      "instead of trace.json (the last step)."),
    click.option("--breakdown", is_flag=True,
                 help="With --trace: the whole step in its parts (the actions, the gradient sync's tail, the clip, the "
                      "optimizer, the driver's round trip, the rest), measured beside predicted."),
    click.option("--out", "-o", type=click.Path(dir_okay=False), default=None,
                 help="Also write a picture: .svg, .html or .json (Chrome trace for Perfetto). With several "
                      "schedules the name goes before the extension (out.1f1b.svg); with --trace, .html is one "
                      "page with both timelines, .svg/.json two files (out.measured.svg, out.predicted.svg)."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object (a list with several schedules)."),
    click.option("--no-chart", is_flag=True, help="Leave out the ASCII chart."),
    click.option("--width", type=click.IntRange(min=40), default=None, help="Chart width (default: the terminal's)."),
    click.option("--layer-costs", "layer_costs_spec", default=None, metavar="SPEC",
                 help="Per-layer forward costs instead of --costs: 'embed=0.1,block=1,head=3' (B=2,W=1 as multiples "
                      "of F and comm= may follow) with --layers N, or a .json file with the same keys (\"blocks\": "
                      "one cost per block). Each stage's F is its layers' sum, plus the embedding on the first and "
                      "the head on the last."),
    click.option("--layers", "n_layers", type=click.IntRange(min=1), default=None,
                 help="With --layer-costs: the number of blocks."),
    click.option("--balance", type=click.Choice(["even", "cost"]), default=None,
                 help="With --layer-costs: split the layers evenly (as pipegpt run does by default) or by cost (as "
                      "pipegpt run --balance cost does). Default even."),
    click.option("--max-live", type=int, default=None, metavar="N",
                 help="For auto and auto-v: the most stage-microbatches' activations a rank may hold at once (the "
                      "peak live column). Default 1F1B's memory: stages x stages per rank."),
    click.option("--forward-only", is_flag=True,
                 help="The schedules' forwards alone: the plans evaluation runs (validation loss, HellaSwag)."),
    click.option("--decode-steps", type=click.IntRange(min=1), default=None, metavar="K",
                 help="Generation's plan: --microbatches prompt groups through --stages ranks, a prefill and K-1 "
                      "decode steps, each group's next step waiting for its token; shows the steady state's bubble."),
    click.option("--p2p-matching", type=click.Choice(["tag", "order"]), default=None,
                 help="How messages are matched: tag (gloo: a send leaves as soon as its output exists; the default) "
                      "or order (NCCL: a send leaves at its SEND, a rank's batches on one lane, a peer and a "
                      "direction, run one after another and each completes together, a run's sends after its last "
                      "receive a batch of their own; the plan is lowered for the costs, as a run lowers it)."),
    click.option("--overlap", type=click.Choice(["on", "off"]), default=None,
                 help="A schedule's pairs (a forward and a backward of two microbatches run as one action, each "
                      "half's all-to-all, --costs a2a=, under the other's compute): on (the default) or off (each "
                      "pair's halves one after the other)."),
]


def simulate_options(command):
    return _stacked(command, SIMULATE)


def _stacked(command, options: list):
    for option in reversed(options):
        command = option(command)
    return command


# `pipegpt plan`'s own options (its model options are model_options'), applied in this order
PLAN_OPTIONS = [
    click.option("--batch-size", type=int, default=None, help="Sequences per step, all replicas together."),
    click.option("--batch-tokens", type=int, default=None, help="Tokens per step (a multiple of seq_len)."),
    click.option("--gpus", type=int, required=True, help="GPUs available (a plan may use fewer)."),
    click.option("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the preset's node, 8)."),
    click.option("--device", default=None, metavar="PRESET",
                  help="GPU preset: h100, h100-pcie, h200, a100-80gb, a100-40gb, l4, a10g, v100 (datasheet peak and "
                       "memory, links of the usual DGX/HGX node); the options below override it."),
    click.option("--gpu-memory", default=None, metavar="SIZE", help="Memory per GPU: 80GiB, 40GB, 81920MiB."),
    click.option("--reserve", default=None, metavar="SIZE",
                  help="Memory per GPU no plan may use: the CUDA context, NCCL buffers, fragmentation (default: 2GiB, "
                       "or a tenth of a smaller GPU; 0 fills the whole memory)."),
    click.option("--gpu-tflops", type=float, default=None, help="Peak dense TFLOPS per GPU at --precision."),
    click.option("--intra-node-gbps", default=None, metavar="RATE",
                  help="Bandwidth per GPU and direction inside a node: Gbit/s, or with a unit (450GB/s)."),
    click.option("--inter-node-gbps", default=None, metavar="RATE",
                  help="Bandwidth per GPU and direction between nodes: Gbit/s, or with a unit (50GB/s)."),
    click.option("--precision", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
                  help="What the plan runs with (pipegpt run --precision)."),
    click.option("--efficiency", type=float, default=None,
                  help="Achieved / peak matmul FLOP/s of the analytical model (default 0.5)."),
    click.option("--layer-overhead-us", type=float, default=None,
                  help="Least host time of one block's forward, microseconds (default 100; backward twice)."),
    click.option("--calibrate", "calibrate_dir", type=click.Path(), default=None, metavar="RUN_DIR",
                  help="Scale compute to a run's measured F/B/W instead of --efficiency: the median over the "
                       "steps it traced (trace.json and --trace-steps' traces/)."),
    click.option("--schedule", "-s", "schedules", default="all", show_default=True,
                  help="Schedules to consider: a comma list or 'all' (every generated one; name auto or auto-v to add "
                       "them, written for unit costs here and for the measured ones by pipegpt run)."),
    click.option("--all-gpus", is_flag=True, help="Only layouts that use every GPU (dp x pp x cp x tp = --gpus)."),
    click.option("--dp", "only_dp", type=click.IntRange(min=1), default=None,
                  help="Only layouts with this many data-parallel replicas (as pipegpt run --dp)."),
    click.option("--stages", "-p", "only_pp", type=click.IntRange(min=1), default=None,
                  help="Only layouts with this many pipeline ranks (as pipegpt run --stages)."),
    click.option("--tp", "only_tp", type=click.IntRange(min=1), default=None,
                  help="Only layouts with this many tensor-parallel ranks (as pipegpt run --tp)."),
    click.option("--cp", "only_cp", type=click.IntRange(min=1), default=None,
                  help="Only layouts with this many context-parallel ranks (as pipegpt run --cp; default: 1, 2, 4, ... "
                       "while the GPUs allow and a rank keeps 2048 tokens or more)."),
    click.option("--cp-comm", type=click.Choice(CP_COMM), default=None,
                  help="Only layouts whose keys and values travel this way with cp > 1 (as pipegpt run --cp-comm; "
                       "default: both are weighed)."),
    click.option("--ep", "only_ep", type=click.IntRange(min=1), default=None,
                  help="Only layouts with this much expert parallelism, carved out of dp x cp x tp (a model with "
                       "experts; default: every size dividing that product and the expert count)."),
    click.option("--moe-imbalance", type=float, default=None,
                  help="The busiest expert rank's tokens over the mean: its expert compute and all-to-alls scale by "
                       "it (default 1.25, Switch Transformers' capacity factor; docs/moe-planning.md)."),
    click.option("--moe-dispatcher", type=click.Choice(["alltoall", "deepep"]), default=None,
                  help="How tokens reach their experts in the predicted run: alltoall (default: what pipegpt run "
                       "does) or deepep, a what-if for a run with DeepEP (one copy per token and remote node; "
                       "docs/moe-planning.md)."),
    click.option("--zero", "only_zero", type=click.Choice(["0", "1", "2", "3"]), default=None,
                  callback=lambda ctx, param, value: None if value is None else int(value),
                  help="Only layouts at this ZeRO level (as pipegpt run --zero; 1-3 need dp > 1). Default: 0-3 (3 "
                       "under either --unshard policy), whichever is fastest where several fit."),
    click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Plans to print."),
    click.option("--explain", is_flag=True, help="Also say why the runners-up lost (and what does not fit)."),
    click.option("--try", "try_top", type=click.IntRange(min=1), default=None, metavar="K",
                  help="Run the top K plans here for --try-steps steps each (pipegpt run, device as --try-device) and "
                       "print measured step time beside predicted."),
    click.option("--try-steps", type=click.IntRange(min=2), default=5, show_default=True,
                  help="Steps per tried plan; the first (warm-up) is left out of the median."),
    click.option("--try-device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True),
    click.option("--try-dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
                  help="Where the tried runs keep their directories, DIR/plan-K (default: a new runs/plan-try-<time>)."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object."),
]


def plan_options(command):
    return _stacked(command, PLAN_OPTIONS)
