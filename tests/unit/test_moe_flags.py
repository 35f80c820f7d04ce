"""The mixture-of-experts flags (docs/moe.md): each sets its ModelConfig field; model_flags writes them back; a
config file's model section holds them; bad values and router flags on a dense model are refused in one line."""
import dataclasses
import json

import pytest

from helpers import assert_one_line_error, invoke
from pipegpt import command_options
from pipegpt.config import MODEL_PRESETS
from test_model_flags import _model, _refusal

FLAGS = ["--n-experts", "4", "--n-experts-per-token", "1", "--n-shared-experts", "2", "--expert-hidden", "64",
         "--moe-every", "2", "--first-dense-layers", "1", "--router-score", "sigmoid", "--router-aux-loss-coef",
         "0.01", "--router-z-loss-coef", "0.001", "--router-bias-update-rate", "0.001", "--moe-capacity-factor", "1.25"]


def test_every_flag_sets_its_field():
    model = _model("--arch", "llama", *FLAGS)
    assert model == dataclasses.replace(
        MODEL_PRESETS["tiny-llama"], n_experts=4, n_experts_per_token=1, n_shared_experts=2, expert_hidden=64,
        moe_every=2, first_dense_layers=1, router_score="sigmoid", router_aux_loss_coef=0.01,
        router_z_loss_coef=0.001, router_bias_update_rate=0.001, moe_capacity_factor=1.25)
    assert _model("--model", "tiny-moe", "--n-experts", "16").n_experts == 16
    gpt2 = _model("--n-experts", "4")  # GPT-2's tiny: GELU experts (docs/moe.md)
    assert (gpt2.arch, gpt2.n_experts, gpt2.bias) == ("gpt2", 4, True)


@pytest.mark.parametrize("model", [MODEL_PRESETS["tiny-moe"],
                                   dataclasses.replace(MODEL_PRESETS["tiny-moe"], n_layer=2, moe_every=2,
                                                       router_score="sigmoid", moe_capacity_factor=1.5)])
def test_model_flags_build_the_same_moe(model):
    flags = command_options.model_flags(model, "bytes").split()
    assert _model(*flags[:-2]) == model, flags


def test_a_config_file_holds_them_in_the_model_section(tmp_path):
    model = dataclasses.replace(MODEL_PRESETS["tiny-moe"], n_layer=2, first_dense_layers=1)
    (tmp_path / "run.json").write_text(json.dumps({"model": dataclasses.asdict(model)}))
    assert _model("--config", tmp_path / "run.json") == model


@pytest.mark.parametrize("args, fragments", [
    (["--router-aux-loss-coef", "0.1"], ["router_aux_loss_coef set on a model without experts"]),
    (["--model", "tiny-moe", "--n-experts-per-token", "9"], ["n_experts_per_token=9 is above n_experts=8"]),
    (["--model", "tiny-moe", "--moe-capacity-factor", "-1"], ["moe_capacity_factor=-1.0", "0: dropless"]),
])
def test_bad_values_are_refused_in_one_line(args, fragments):
    line = _refusal(*args)
    assert all(f in line for f in fragments) and "\n" not in line, line


def test_the_cli_refuses_before_any_worker_starts():
    assert_one_line_error(invoke("run", "--model", "tiny-moe", "--n-experts-per-token", "9"),
                          "n_experts_per_token=9 is above n_experts=8")


def test_the_planners_run_command_builds_the_same_moe():
    from pipegpt.planner.candidates import model_args

    for model in (dataclasses.replace(MODEL_PRESETS["tiny-moe"], first_dense_layers=1),
                  dataclasses.replace(MODEL_PRESETS["tiny-moe"], n_experts_per_token=None, router_score="sigmoid")):
        args = model_args(model)
        assert "--n-experts" in args and _model(*args) == model, args
