"""examples/configs/*.toml: each is read by `pipegpt run --config` into the run it describes (no job starts), and
planned by the `pipegpt plan` command its header names: the planner finds the file's layout and schedule among the
plans that fit the device it was written for."""
from __future__ import annotations

import json
import shlex

import pytest

from helpers import ROOT, invoke

CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.toml"))


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """The TrainConfig `pipegpt run` would launch, in a directory that has the files' data directories."""
    seen = {}
    monkeypatch.setattr("pipegpt.train.launch.launch", lambda cfg, *args, **kwargs: seen.update(cfg=cfg))
    monkeypatch.chdir(tmp_path)
    for data in ("data/fineweb", "data/llama"):
        (tmp_path / data).mkdir(parents=True)
    return seen


def plan_command(path) -> list[str]:
    line = next(ln for ln in path.read_text().splitlines() if ln.startswith("# plan: pipegpt plan "))
    return shlex.split(line.removeprefix("# plan: pipegpt "))


def test_the_four_example_configs_are_there():
    assert [p.name for p in CONFIGS] == ["gpt2-124m.toml", "llama3-8b-8gpu.toml", "long-context-cp.toml",
                                         "zero3.toml"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_an_example_config_is_a_run_the_planner_finds_fits(path, launched):
    result = invoke("run", "--config", path)
    assert result.exit_code == 0, result.output
    cfg = launched["cfg"]
    par = cfg.parallel
    assert cfg.runtime.device == "cuda" and cfg.runtime.precision == "bf16"

    args = plan_command(path)
    assert args[0] == "plan" and "--all-gpus" in args
    # the plan command describes this run: its model, its GPUs, its batch
    gpus = int(args[args.index("--gpus") + 1])
    assert gpus == par.dp * par.stages * par.cp * par.tp, (gpus, par)
    sequences = par.dp * par.microbatches * par.microbatch_size
    if "--batch-size" in args:
        assert int(args[args.index("--batch-size") + 1]) == sequences
    else:
        assert int(args[args.index("--batch-tokens") + 1]) == sequences * cfg.model.seq_len
    planned = invoke(*args, "--json")
    assert planned.exit_code == 0, planned.output
    answer = json.loads(planned.stdout)
    shape = ("arch", "n_layer", "n_embd", "n_head", "n_kv_head", "seq_len", "vocab_size", "ffn_hidden")
    assert {k: answer["model"][k] for k in shape} == {k: getattr(cfg.model, k) for k in shape}
    mine = [p for p in answer["plans"]
            if (p["dp"], p["pp"], p["cp"], p["tp"], p["schedule"], p["virtual_stages"], p["zero"]) ==
            (par.dp, par.stages, par.cp, par.tp, par.schedule, par.virtual_stages or 1, par.zero)]
    assert mine, [(p["dp"], p["pp"], p["cp"], p["tp"], p["schedule"], p["virtual_stages"]) for p in answer["plans"]]
    usable = answer["cluster"]["memory_bytes"] - answer["cluster"]["reserve_bytes"]
    assert 0 < mine[0]["peak_memory_bytes"] <= usable
