"""Configuration: one source of defaults, the CLI derived from it (and frozen), torch-free cross-field checks,
and a schedule file refused before any worker starts."""
from __future__ import annotations

import dataclasses
import time

import pytest

from helpers import assert_one_line_error, clean_env, invoke, run_pipegpt
from pipegpt.cli import main
from pipegpt.config import (SECTIONS, ConfigError, ModelConfig, TrainConfig, microbatch_size_for, section_of,
                            validate_tp)

# Every option of `pipegpt run`. A change here is a change of the CLI that users and scripts see: make it on purpose.
RUN_OPTIONS = [
    "--batch-size", "--data", "--document-mask", "--position-reset", "--no-document-mask", "--no-position-reset", "--eval-batches", "--eval-every", "--hellaswag", "--init-from", "--keep", "--resume", "--save-every", "--device", "--dp", "--cp", "--ep", "--cp-comm", "--dtype", "--grad-clip", "--layers-per-stage", "--layout", "--log-every", "--snapshot-every",
    "--lr", "--max-live", "--max-restarts", "--microbatch-size", "--min-ranks", "--microbatches", "--model", "--n-embd", "--n-head", "--n-layer", "--no-tie-embeddings",
    "--pad-vocab", "--port", "--recompute", "--run-dir", "--schedule", "--schedule-file", "--seed", "--seq-len",
    "--sequence-parallel", "--stages", "--steps", "--threads-per-worker", "--timeout", "--tokenizer", "--tp",
    "--step-timeout",  # a whole step's deadline, apart from --timeout's for each wait in it
    "--virtual-stages", "--vocab-size", "--weight-decay", "--zero", "--unshard", "-m", "-p", "-s", "-v",
    # the nanoGPT/llm.c recipe: learning-rate schedule, precision, compilation, MFU
    "--warmup-steps", "--min-lr", "--lr-schedule", "--precision", "--compile", "--peak-tflops",
    # measured timelines of chosen steps, py-spy flame graphs
    "--trace-steps", "--profile",
    # cost-balanced stages (the split from measured embedding/block/head costs)
    "--balance",
    # what a non-finite loss or gradient norm does: stop before the update, or skip it
    "--on-nonfinite", "--max-skipped-steps",
    # --resume restores a run's settings: its on/off ones can be turned off; a fresh run into a used directory
    "--no-compile", "--no-profile", "--no-sequence-parallel", "--overlap", "--overwrite",
    # dropout (per-rank streams, restored on resume): fine-tuning uses 0.1
    "--dropout",
    # what pipeline messages travel in (bf16 halves the bytes between stages)
    "--p2p-dtype",
    # settings from a TOML or JSON file (a run's config.json), the options given overriding it
    "--config",
    # Llama-shaped models (issue 19): the architecture and its settings
    "--arch", "--n-kv-head", "--ffn-hidden", "--rope-theta", "--norm-eps", "--qkv-bias", "--no-qkv-bias",
    "--tie-embeddings",
    # each local worker pinned to cores of its own (DeepSpeed's --bind_cores_to_rank)
    "--bind-cores", "--no-bind-cores",
    # several steps in one driver call: one RPC round trip for them (Keras' steps_per_execution)
    "--steps-per-call",
    # mixtures of experts (issue 45): each sets the ModelConfig field of its name
    "--n-experts", "--n-experts-per-token", "--n-shared-experts", "--expert-hidden", "--moe-every",
    "--first-dense-layers", "--router-score", "--router-aux-loss-coef", "--router-z-loss-coef",
    "--router-bias-update-rate", "--moe-capacity-factor",
    # Qwen3's and OLMoE's attention (issue 45): heads wider than n_embd / n_head, q/k RMSNorm
    "--head-dim", "--qk-norm",
    # the last step saved by default, so that `pipegpt sample RUN_DIR` works after any run (issue 47)
    "--save-final", "--no-save-final",
    # an optional Weights & Biases sink beside TensorBoard (issue 47)
    "--wandb",
    # the job checked and predicted on named devices, nothing started (issue 47)
    "--dry-run",
]


def _run_command():
    return main.get_command(None, "run")


def test_run_options_are_the_frozen_list():
    flags = sorted(flag for p in _run_command().params for flag in p.opts + p.secondary_opts if flag != "--help")
    assert flags == sorted(RUN_OPTIONS)


def test_cli_defaults_are_the_config_defaults():
    fields = {f.name: f for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    compared = 0
    for param in _run_command().params:
        if param.name in fields:
            default = fields[param.name].default
            assert param.default in (default, str(default)), f"--{param.name}: CLI {param.default!r}, config {default!r}"
            compared += 1
    assert compared == sum(bool(f.metadata.get("help")) for f in fields.values()) >= 20


def test_a_setting_lives_in_exactly_one_section():
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert section_of("stages") == "parallel" and section_of("lr") == "optim" and section_of("steps") == "runtime"
    with pytest.raises(ConfigError, match="unknown setting 'stage'"):
        TrainConfig().replace(stage=2)


def test_build_routes_settings_to_their_sections():
    cfg = TrainConfig.build(ModelConfig(n_layer=2), stages=2, lr=3e-4, tokenizer="gpt2", steps=7)
    assert (cfg.parallel.stages, cfg.optim.lr, cfg.data.tokenizer, cfg.runtime.steps, cfg.model.n_layer) == \
        (2, 3e-4, "gpt2", 7, 2)
    assert cfg.replace(dp=2).world_size == 4 and cfg.world_size == 2


@pytest.mark.parametrize("settings, message", [
    ({"sequence_parallel": True}, "use it with --tp 2 or more"),
    ({"tp": 3}, "n_head=4 is not divisible by tp=3"),
    ({"microbatches": 0}, "microbatches=0 must be a positive integer"),
    ({"recompute": "some"}, "recompute='some' is not one of none, full, selective"),
    ({"zero": 4}, "zero=4 is not one of 0, 1, 2, 3"),
    ({"zero": 2}, "--zero 2 shards over the data-parallel replicas, and dp x cp = 1: nothing to shard"),
    ({"zero": 1}, "--zero 1 shards over the data-parallel replicas, and dp x cp = 1: nothing to shard"),  # was accepted, doing nothing
    ({"zero": 3, "cp": 2}, None),  # cp ranks hold the same weights: ZeRO shards over dp x cp
    ({"zero": 1, "dp": 2, "unshard": "step"}, "--unshard step places ZeRO-3's parameter gathers, and --zero is 1"),
    ({"zero": 3, "dp": 2, "unshard": "layer"}, "unshard='layer' is not one of step, microbatch"),
    ({"schedule_file": "x.txt", "virtual_stages": 2}, "--virtual-stages does not apply to --schedule-file"),
])
def test_cross_field_checks(settings, message):
    if message is None:
        TrainConfig.build(**settings).validate({})
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig.build(**settings).validate({})


def test_gloo_loops_is_batch_or_as_is():
    assert TrainConfig.build().runtime.gloo_loops == "batch"
    TrainConfig.build(gloo_loops="as-is").validate({})
    with pytest.raises(ConfigError, match="gloo_loops='idle' is not one of batch, as-is"):
        TrainConfig.build(gloo_loops="idle").validate({})


def test_p2p_dtype_defaults_to_the_compute_precision():
    message = lambda **kw: TrainConfig.build(**kw).validate({}).runtime.message_dtype  # noqa: E731
    assert message() == "float32" and message(dtype="float64") == "float64"  # the oracle's: messages exact
    assert message(precision="bf16") == "bfloat16" and message(precision="bf16", p2p_dtype="fp32") == "float32"
    assert message(p2p_dtype="bf16") == "bfloat16"
    with pytest.raises(ConfigError, match="p2p_dtype='fp16' is not one of auto, bf16, fp32"):
        TrainConfig.build(p2p_dtype="fp16").validate({})


def test_torchrun_world_size_must_match_the_grid():
    env = {"RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match=r"torchrun started 8 processes but dp x pp x cp x tp = 1 x 4 x 1 x 1 = 4"):
        TrainConfig().validate(env)
    TrainConfig.build(stages=8).validate(env)


def test_under_torchrun_tp_must_divide_the_processes_per_node():
    env = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match=r"^--tp 8 does not divide the 4 processes per node \(LOCAL_WORLD_SIZE\): "
                                          r"a tensor-parallel group must stay on one node; use --tp 1, 2, 4$"):
        TrainConfig.build(ModelConfig(n_head=8), stages=1, tp=8).validate(env)
    TrainConfig.build(stages=2, tp=4).validate(env)
    TrainConfig.build(ModelConfig(n_head=8), stages=1, tp=8).validate({})  # not under torchrun: one machine


def test_tp_not_dividing_the_node_exits_2_in_one_line(tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = run_pipegpt("run", "--stages", "3", "--tp", "2", "--steps", "1", "--run-dir", str(tmp_path / "run"),
                       env=clean_env(**env))
    assert_one_line_error(proc, "--tp 2 does not divide the 3 processes per node")


def test_batch_splits_into_microbatches_or_names_the_nearest():
    assert microbatch_size_for(32, 2, 4) == 4
    with pytest.raises(ConfigError, match="use a multiple of 8 such as 24 or 32"):
        microbatch_size_for(30, 2, 4)


def test_tp_divisibility_is_a_config_check():
    validate_tp(ModelConfig(), 2)
    with pytest.raises(ConfigError, match="pass --pad-vocab"):
        validate_tp(ModelConfig(vocab_size=50257, n_head=12, n_embd=768), 4)


# --------------------------------------------------------------------------------------------------------------
# Schedule files for `pipegpt run`: refused before any worker starts, naming file, line and token

def _refused(args, tmp_path):
    t0 = time.monotonic()
    proc = run_pipegpt("run", *args, "--run-dir", tmp_path / "run", timeout=60)
    line = assert_one_line_error(proc)
    assert time.monotonic() - t0 < 15
    assert not (tmp_path / "run").exists()
    return line


def test_a_bad_token_in_a_schedule_file_is_refused(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("0F0 0F1 0B0 0B1\n1F0 1X0 1F1 1B1\n")
    line = _refused(["--schedule-file", str(path)], tmp_path)
    assert f"{path}:2: bad token '1X0'" in line


def test_a_schedule_file_for_other_ranks_is_refused(tmp_path):
    path = tmp_path / "two.txt"
    path.write_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    line = _refused(["--schedule-file", str(path), "--stages", "4"], tmp_path)
    assert f"--stages 4 does not match {path}, which has 2 ranks" in line


def test_an_invalid_schedule_file_names_the_line(tmp_path):
    path = tmp_path / "early.txt"
    path.write_text("0F0 0B0\n1F0 1B0\n0F1 0B1\n")  # 3 lines: 3 ranks, but stage 0 appears on two of them
    line = _refused(["--schedule-file", str(path)], tmp_path)
    assert f"{path}:3:" in line


def test_schedule_and_schedule_file_exclude_each_other(tmp_path):
    path = tmp_path / "two.txt"
    path.write_text("0F0 0B0\n1F0 1B0\n")
    result = invoke("run", "--schedule", "gpipe", "--schedule-file", path)
    assert result.exit_code == 2 and "either --schedule or --schedule-file" in result.output
