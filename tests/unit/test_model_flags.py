"""The model's shape flags (issue 19): --arch and the Llama settings, model_flags' round trip, and the shape an
--init-from or --resume checkpoint gives when the flags are left out. In process: no worker starts."""
import dataclasses

import click
import pytest
from click.testing import CliRunner

from helpers import assert_one_line_error, invoke
from pipegpt import command_options, options as opts
from pipegpt.config import MODEL_PRESETS, ConfigError, ModelConfig, model_config


@click.command()
@opts.config_options
@command_options.model_options
@click.option("--config", "config_file", default=None)
@click.pass_context
def _build(ctx, config_file, **options):
    """train_config as `pipegpt run` calls it; prints nothing, keeps the config."""
    _build.cfg = opts.train_config(ctx, None, options, config_file=config_file)


def _model(*args) -> ModelConfig:
    result = CliRunner().invoke(_build, [str(a) for a in args], standalone_mode=False)
    if result.exception is not None:
        raise result.exception
    return _build.cfg.model


def _refusal(*args) -> str:
    with pytest.raises((ConfigError, click.UsageError)) as e:
        _model(*args)
    return str(e.value.message if isinstance(e.value, click.ClickException) else e.value)


def test_arch_llama_alone_starts_from_tiny_llama():
    assert _model("--arch", "llama") == MODEL_PRESETS["tiny-llama"]
    m = _model("--arch", "llama", "--n-kv-head", "1", "--ffn-hidden", "256", "--rope-theta", "500000",
               "--norm-eps", "1e-6", "--qkv-bias", "--n-layer", "2")
    assert (m.arch, m.n_kv_head, m.ffn_hidden, m.rope_theta, m.norm_eps, m.qkv_bias, m.n_layer) == \
        ("llama", 1, 256, 500000.0, 1e-6, True, 2)
    assert _model("--model", "smollm-135m", "--n-layer", "2").tie_embeddings is True
    assert _model("--model", "tiny") == MODEL_PRESETS["tiny"]


@pytest.mark.parametrize("args, fragments", [
    (["--n-kv-head", "2"], ["--n-kv-head 2", "--arch llama"]),
    (["--rope-theta", "5e5"], ["--rope-theta", "--arch llama"]),
    (["--qkv-bias"], ["--qkv-bias", "--arch llama"]),
    (["--model", "gpt2", "--arch", "llama"], ["--arch llama", "--model gpt2"]),
    (["--arch", "llama", "--n-kv-head", "3"], ["n_kv_head=3", "n_head=4", "1, 2, 4"]),
    (["--tie-embeddings", "--no-tie-embeddings"], ["--tie-embeddings", "--no-tie-embeddings"]),
])
def test_a_flag_that_does_not_apply_is_refused(args, fragments):
    line = _refusal(*args)
    assert all(f in line for f in fragments) and "\n" not in line, line


def test_the_cli_shows_a_bad_kv_head_count_in_one_line():
    assert_one_line_error(invoke("run", "--arch", "llama", "--n-kv-head", "3"), "n_kv_head=3", "n_head=4")
    assert_one_line_error(invoke("run", "--n-kv-head", "2"), "--n-kv-head 2", "--arch llama")


@pytest.mark.parametrize("model", [
    MODEL_PRESETS["tiny-llama"],
    dataclasses.replace(MODEL_PRESETS["tiny-llama"], n_layer=2, n_kv_head=1, rope_theta=500000.0, norm_eps=1e-6,
                        qkv_bias=True),
    dataclasses.replace(MODEL_PRESETS["smollm-135m"], n_layer=2),  # tied
    dataclasses.replace(MODEL_PRESETS["tiny-llama"], ffn_hidden=None),  # the multiple-of rule, stated
    ModelConfig(n_layer=2, n_embd=64, ffn_hidden=100, norm_eps=1e-6, tie_embeddings=False),
])
def test_model_flags_build_the_same_model(model):
    flags = command_options.model_flags(model, "bytes").split()
    assert flags[-2:] == ["--tokenizer", "bytes"]
    built = _model(*flags[:-2])
    assert built == model or (model.ffn_hidden is None and built.ffn_width == model.ffn_width
                              and dataclasses.replace(built, ffn_hidden=None) == model), (flags, built)


def test_a_config_file_names_a_llama(tmp_path):
    import json

    model = dataclasses.replace(MODEL_PRESETS["tiny-llama"], n_layer=2, rope_theta=500000.0)
    (tmp_path / "run.json").write_text(json.dumps({"model": dataclasses.asdict(model), "stages": 2}))
    assert _model("--config", tmp_path / "run.json") == model
    (tmp_path / "flat.toml").write_text('arch = "llama"\nn_kv_head = 1\n')
    assert _model("--config", tmp_path / "flat.toml") == dataclasses.replace(MODEL_PRESETS["tiny-llama"], n_kv_head=1)


def test_plan_lists_every_preset():
    plan = invoke("plan", "--help").stdout
    assert all(name in plan for name in MODEL_PRESETS), plan


# --------------------------------------------------------------------------------------------------------------
# --init-from and --resume: the checkpoint's shape unless a flag is given; a flag that disagrees is refused

LLAMA = dataclasses.replace(MODEL_PRESETS["tiny-llama"], n_layer=2)
WIDE_GPT = model_config("tiny", n_layer=2, n_embd=64, n_head=2, seq_len=32, tie_embeddings=False)


@pytest.fixture
def checkpoint_of(monkeypatch):
    """The --init-from checkpoint holds `model` (its manifest read back, as the driver would)."""
    def held(model):
        monkeypatch.setattr(opts, "initial_model",
                            lambda path: {"model": dataclasses.asdict(model), "checkpoint": "ckpt/step_2"})
    return held


@pytest.mark.parametrize("model", [LLAMA, WIDE_GPT])
def test_init_from_takes_the_checkpoints_shape(checkpoint_of, model):
    checkpoint_of(model)
    assert _model("--init-from", "ckpt") == model
    assert _model("--init-from", "ckpt", "--n-layer", "2", "--dropout", "0.1") == \
        dataclasses.replace(model, dropout=0.1)  # flags that agree are fine; dropout may differ


@pytest.mark.parametrize("model, args, fragments", [
    (LLAMA, ["--n-kv-head", "4"], ["--n-kv-head 4", "n_kv_head 2", "ckpt/step_2"]),
    (LLAMA, ["--model", "tiny-llama"], ["--model tiny-llama", "n_layer"]),
    (LLAMA, ["--arch", "gpt2"], ["--arch gpt2", "arch llama"]),
    (WIDE_GPT, ["--n-embd", "128"], ["--n-embd 128", "n_embd 64"]),
    (WIDE_GPT, ["--tie-embeddings"], ["--tie-embeddings", "tie_embeddings off"]),
])
def test_a_flag_that_disagrees_with_the_checkpoint_is_refused(checkpoint_of, model, args, fragments):
    checkpoint_of(model)
    line = _refusal("--init-from", "ckpt", *args)
    assert all(f in line for f in fragments) and "\n" not in line, line


def test_resume_takes_the_checkpoints_llama_shape(monkeypatch):
    monkeypatch.setattr(opts, "saved_run", lambda path: {"config": {}, "model": dataclasses.asdict(LLAMA),
                                                         "checkpoint": "run/checkpoints/step_2"})
    assert _model("--resume", "run") == LLAMA
    assert "--n-kv-head 1" in _refusal("--resume", "run", "--n-kv-head", "1")


@pytest.mark.parametrize("model", [
    dataclasses.replace(MODEL_PRESETS["tiny-llama"], n_layer=8, n_kv_head=1, rope_theta=500000.0, qkv_bias=True,
                        tie_embeddings=True),
    dataclasses.replace(MODEL_PRESETS["llama3-8b"], n_layer=4),
    model_config("tiny", n_layer=2, tie_embeddings=False),
])
def test_the_planners_run_command_builds_the_same_model(model):
    from pipegpt.planner.candidates import model_args

    assert _model(*model_args(model)) == model
