"""What is refused before any worker starts: the settings, the data, the faults, the checkpoint to start from,
the plan, the devices, and on CPU this machine's memory against what the job will hold.

    plan = check(cfg)          # every refusal is one ConfigError line
"""
from __future__ import annotations

import os
from pathlib import Path

from pipegpt.config import ConfigError, TrainConfig
from pipegpt.engine.placement import local_world_size, resolve_device
from pipegpt.model.partition import partition_layers
from pipegpt.planner.run_plan import check_layers_fill, make_plan
from pipegpt.resilience.faults import check_faults
from pipegpt.schedule import Plan
from pipegpt.state import checkpoint


def check(cfg: TrainConfig, devices: bool = True) -> Plan:
    """Everything that can be refused before a worker starts; returns the plan. devices=False leaves out this
    machine's devices (a dry run checks a job meant for others)."""
    from pipegpt.data.tokenizers import get_tokenizer
    from pipegpt.data.tokens import builtin_tokens, open_tokens

    cfg.validate(os.environ)
    try:
        check_faults(cfg.world_size, cfg.runtime.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.data.data is not None:  # headers, sizes, token ids below the vocabulary, enough tokens, the tokenizer
        m = cfg.model
        open_tokens(cfg.data.data, "train", vocab_size=m.vocab_size, seq_len=m.seq_len, tokenizer=cfg.data.tokenizer)
        open_tokens(cfg.data.data, "val", vocab_size=m.vocab_size, tokenizer=cfg.data.tokenizer)
    else:  # the built-in corpus is tokenized by each worker: gpt2 offline fails here, in one line
        top = int(builtin_tokens(get_tokenizer(cfg.data.tokenizer)).max())
        if top >= cfg.model.vocab_size:
            raise ConfigError(f"the built-in corpus holds token id {top} (tokenizer {cfg.data.tokenizer}), not below "
                              f"vocab_size={cfg.model.vocab_size}: give --vocab-size {top + 1} or more")
    if cfg.data.document_mask and get_tokenizer(cfg.data.tokenizer).eot_token is None:
        raise ConfigError(f"--document-mask finds documents by the end-of-text token, and tokenizer "
                          f"{cfg.data.tokenizer} has none: use one with <|endoftext|>, <|end_of_text|> or </s>")
    start_from(cfg)
    if cfg.eval.hellaswag:
        from pipegpt.data.hellaswag import read_examples

        if not cfg.eval.eval_every:
            raise ConfigError("--hellaswag scores the model at evaluation steps: give --eval-every N too")
        read_examples(cfg.eval.hellaswag)  # a bad file is refused before any worker starts
    plan = make_plan(cfg)
    check_layers_fill(cfg, plan)
    partition_layers(cfg.model.n_layer, plan.num_stages, cfg.parallel.layers_per_stage)
    if devices and resolve_device(cfg.runtime.device, cfg.world_size) == "cuda":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = local_world_size(cfg.world_size)
        if have < local:
            raise ConfigError(f"device=cuda needs one GPU per rank on this machine ({local}), "
                              f"but {have} are visible: use --device cpu or fewer ranks")
    return plan


PROCESS_BYTES = 400 * 2**20  # a worker's own footprint before its model: the interpreter, torch, gloo, RPC


def check_host_memory(cfg: TrainConfig, plan: Plan, meminfo: str = "/proc/meminfo") -> None:
    """On CPU, the planner's estimate of what this machine's ranks hold (weights, gradients, optimizer state,
    activations, message buffers; pipegpt.costs.memory) against the memory it has available: a job larger than
    the machine is one line now, not a worker killed by the kernel a minute or two later."""
    from pipegpt.costs.activations import memory_precision
    from pipegpt.costs.memory import plan_memory

    try:
        with open(meminfo) as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return  # not Linux: nothing to compare with
    p, m = cfg.parallel, cfg.model
    ranks = plan_memory(m, plan, partition_layers(m.n_layer, plan.num_stages, p.layers_per_stage),
                        microbatch_size=p.microbatch_size, sharding=p.sharding, recompute=p.recompute,
                        precision=memory_precision(cfg.runtime.precision, cfg.runtime.dtype), device="cpu")
    local = local_world_size(cfg.world_size)
    per_replica = sum(r.total for r in ranks) * p.tp * p.cp  # every tp and cp rank of a pipeline rank holds as much
    need = (per_replica * p.dp if local == cfg.world_size else max(r.total for r in ranks) * local) \
        + PROCESS_BYTES * local
    if need > available:
        raise ConfigError(f"this job needs about {need / 2**30:.1f} GiB of host memory on this machine ({local} "
                          f"rank{'s' * (local > 1)}: weights, gradients, optimizer state, activations), and "
                          f"{available / 2**30:.1f} GiB is available: use a smaller model (--model, --n-layer), "
                          f"fewer ranks here, or more machines")


def start_from(cfg: TrainConfig) -> Path | None:
    """The checkpoint --resume or --init-from names, checked whole and of this model's shape (None: neither)."""
    path = cfg.checkpoint.resume or cfg.checkpoint.init_from
    if path is None:
        return None
    try:
        found = checkpoint.resolve(path)
        manifest = checkpoint.read_manifest(found)
        checkpoint.check_compatible(manifest, cfg.model.settings(), found)
        checkpoint.check_tensors(found, cfg.model)
        if cfg.checkpoint.resume and not manifest.get("optimizer", True):
            raise checkpoint.CheckpointError(f"{found}: holds weights only (no optimizer state, no step): "
                                             f"start from it with --init-from")
    except checkpoint.CheckpointError as e:
        raise ConfigError(str(e)) from None
    return found



def hellaswag_rows(cfg: TrainConfig, had: tuple | None = None) -> tuple:
    """(what they depend on, --hellaswag's examples, their candidates' tokens): a token id the model cannot take
    is refused now. `had`: an earlier answer, kept when it still holds."""
    key = (cfg.eval.hellaswag, cfg.data.tokenizer, cfg.model.seq_len, cfg.model.vocab_size)
    if had is not None and had[0] == key:
        return had
    if not cfg.eval.hellaswag:
        return key, None, None
    from pipegpt.data.hellaswag import read_examples, render_all

    examples = read_examples(cfg.eval.hellaswag)
    return key, examples, render_all(examples, *key[1:], cfg.eval.hellaswag)
