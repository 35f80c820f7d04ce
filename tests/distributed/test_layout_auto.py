"""`pipegpt run --layout auto`: the planner chooses the layout for the ranks the run has (torchrun's world size,
the GPUs here, or a rank per core), keeping the global batch; with --resume, a checkpoint of another layout goes on
in the chosen one (what an elastic torchrun job does after its world size changed)."""
import json
import os

import pytest

from helpers import assert_one_line_error, invoke, run_pipegpt
from pipegpt.config import MODEL_PRESETS, ConfigError, ModelConfig
from pipegpt.options import auto_layout
from pipegpt.planner.auto import choose_layout

TINY = ModelConfig()


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6, 8])
def test_the_chosen_layout_uses_every_rank_and_keeps_the_batch(ranks):
    chosen = choose_layout(TINY, 32, ranks, ranks, "fp32")
    lay = chosen.layout
    assert lay.dp * lay.pp * lay.tp == ranks
    assert lay.dp * lay.microbatches * lay.microbatch_size == 32
    assert not lay.pad_vocab
    assert choose_layout(TINY, 32, ranks, ranks, "fp32") == chosen  # every torchrun rank chooses alike


def test_a_gpu_is_planned_with_its_preset_links_and_its_own_memory():
    chosen = choose_layout(MODEL_PRESETS["gpt2"], 512, 16, 8, "bf16", "NVIDIA H100 80GB HBM3", 80 * 2**30)
    assert "16 x h100 (2 nodes x 8)" in chosen.cluster and "989.5 TFLOPS bf16" in chosen.cluster
    lay = chosen.layout
    assert lay.dp * lay.pp * lay.tp == 16 and lay.tp <= 8
    with pytest.raises(ConfigError, match="--layout auto does not know the GPU 'Some Future GPU'"):
        choose_layout(TINY, 32, 2, 2, "bf16", "Some Future GPU", 2**35)


def test_under_torchrun_the_world_size_decides():
    said = []
    env = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "RANK": "0"}
    settings = auto_layout(TINY, 24, {"device": "cpu", "precision": "fp32"}, said.append, env=env)
    assert settings["stages"] * settings["dp"] * settings["tp"] == 3
    assert settings["dp"] * settings["microbatches"] * settings["microbatch_size"] == 24
    assert said[0].startswith("pipegpt: --layout auto on 3 ranks: dp ")


@pytest.mark.parametrize("args", [["--stages", "2"], ["--tp", "1", "--dp", "2"], ["-m", "4"]])
def test_layout_auto_with_a_layout_flag_is_one_line(args):
    assert_one_line_error(invoke("run", "--layout", "auto", *args), "--layout auto chooses the layout: leave out")


def test_a_checkpoint_goes_on_in_the_layout_auto_chooses(tmp_path):
    run = tmp_path / "run"
    first = run_pipegpt("run", "--stages", "3", "--microbatches", "4", "--microbatch-size", "2", "--steps", "2",
                        "--save-every", "2", "--run-dir", run)
    assert first.returncode == 0, first.stderr
    proc = run_pipegpt("run", "--resume", run, "--layout", "auto", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    said = next(ln for ln in proc.stdout.splitlines() if ln.startswith("pipegpt: --layout auto on "))
    ranks = min(os.cpu_count() or 1, 8)
    assert said.startswith(f"pipegpt: --layout auto on {ranks} rank"), said
    config = json.loads((run / "config.json").read_text())["parallel"]
    assert config["stages"] * config["dp"] * config["tp"] == ranks
    assert config["dp"] * config["microbatches"] * config["microbatch_size"] == 8  # the run's global batch
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["attempt"]) for r in rows] == [(1, 1), (2, 1), (3, 2)]
