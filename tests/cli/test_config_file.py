"""`pipegpt run --config FILE`: TOML or JSON (a run's own config.json too), the options given overriding it."""
import json

import pytest

from tests.helpers import assert_one_line_error, invoke


@pytest.fixture
def launched(monkeypatch):
    """The TrainConfig `pipegpt run` would launch (no job starts)."""
    seen = {}

    def fake_launch(cfg, preset, run_dir, port, log_every, echo, overwrite=False, continuing=False):
        seen["cfg"] = cfg

    monkeypatch.setattr("pipegpt.train.launch.launch", fake_launch)
    return seen


def test_toml_flat_and_sections_with_flags_overriding(tmp_path, launched):
    path = tmp_path / "run.toml"
    path.write_text('stages = 2\nmicrobatches = 8\nlr = 3e-4\nn_layer = 6\n\n[runtime]\nsteps = 7\n')
    result = invoke("run", "--config", path, "--microbatches", 4)
    assert result.exit_code == 0, result.output
    cfg = launched["cfg"]
    assert (cfg.parallel.stages, cfg.parallel.microbatches, cfg.optim.lr, cfg.runtime.steps, cfg.model.n_layer) == \
        (2, 4, 3e-4, 7, 6)


def test_a_runs_own_config_json_rebuilds_it(tmp_path, launched):
    assert invoke("run", "--stages", 2, "--microbatches", 4, "--n-layer", 6, "--lr", 2e-3, "--steps", 5,
                  "--no-tie-embeddings").exit_code == 0
    first = launched["cfg"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(first.to_dict() if hasattr(first, "to_dict") else _sections(first)))
    assert invoke("run", "--config", path).exit_code == 0
    assert launched["cfg"] == first
    assert invoke("run", "--config", path, "--steps", 9).exit_code == 0
    assert launched["cfg"].runtime.steps == 9 and launched["cfg"].model == first.model


def _sections(cfg):
    import dataclasses
    return {name: dataclasses.asdict(getattr(cfg, name))
            for name in ("model", "parallel", "optim", "data", "runtime", "checkpoint", "eval")}


@pytest.mark.parametrize("text, fragments", [
    ("stagez = 2\n", ["unknown key 'stagez'", "parallel", "stages"]),
    ("[parallel]\nstagez = 2\n", ["unknown key parallel.stagez", "valid: stages"]),
    ("stages = \n", ["--config", "TOML"]),
])
def test_unknown_keys_and_bad_files_are_one_line(tmp_path, text, fragments):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert_one_line_error(invoke("run", "--config", path), *fragments)


def test_config_and_resume_together_are_refused(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{}")
    assert_one_line_error(invoke("run", "--config", path, "--resume", tmp_path), "--config", "--resume")


def test_stages_default_from_the_world_size_under_torchrun(monkeypatch, launched):
    for name, value in {"RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert invoke("run", "--tp", 2, "--microbatches", 4).exit_code == 0
    assert launched["cfg"].parallel.stages == 4
    assert invoke("run", "--stages", 8, "--microbatches", 8).exit_code == 0  # a --stages given wins
    assert launched["cfg"].parallel.stages == 8
    assert_one_line_error(invoke("run", "--dp", 3), "WORLD_SIZE 8", "--stages")
