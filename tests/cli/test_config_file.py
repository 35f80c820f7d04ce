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


def test_where_a_file_starts_is_read_not_dropped(tmp_path, launched):
    """init_from in a file starts from it (it was dropped without a word: a fresh start); resume in a file is one
    line asking for --resume on the command line (a resume takes its run's settings, not the file's)."""
    import dataclasses

    from pipegpt.config import ModelConfig
    from pipegpt.model.gpt import GPT
    from pipegpt.state import checkpoint

    model = ModelConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, n_embd=32)
    ckpt = checkpoint.write_weights(tmp_path / "ckpt", GPT(model, init_seed=0).state_dict(),
                                    {"model": dataclasses.asdict(model), "tokenizer": "bytes"})
    path = tmp_path / "start.toml"
    path.write_text(f'resume = "{tmp_path / "runs" / "a"}"\n')
    assert_one_line_error(invoke("run", "--config", path), "resume is not read from a file",
                          f"--resume {tmp_path / 'runs' / 'a'}")
    path.write_text(f'stages = 2\n[checkpoint]\ninit_from = "{ckpt}"\n')
    result = invoke("run", "--config", path)
    assert result.exit_code == 0, result.output
    assert launched["cfg"].checkpoint.init_from == str(ckpt)
    assert launched["cfg"].model == model  # the checkpoint's shape, as --init-from on the command line


@pytest.mark.parametrize("text, fragments", [
    ("stages = 2\n[parallel]\nstages = 1\n", ["stages is given twice", "stages = 2", "[parallel] stages = 1"]),
    ("stagez = 2\n", ["did you mean stages?", "microbatches", "n_layer"]),
])
def test_settings_a_file_gives_twice_or_wrong_are_one_line(tmp_path, text, fragments, launched):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert_one_line_error(invoke("run", "--config", path), *fragments)


@pytest.mark.parametrize("text, message", [
    ("threads_per_worker = 0\n", "threads_per_worker=0 must be a positive integer"),
    ("threads_per_worker = -1\n", "threads_per_worker=-1 must be a positive integer"),
    ('schedule = "interleaved-1f1b"\nvirtual_stages = 0\n', "virtual_stages=0 must be a positive integer"),
])
def test_zero_or_negative_counts_are_refused_before_any_worker_starts(tmp_path, text, message, launched):
    """They were accepted (virtual stages 0 ran v = 2 and recorded 0) or failed inside every worker."""
    from pipegpt.config import ConfigError

    path = tmp_path / "c.toml"
    path.write_text(text)
    assert invoke("run", "--config", path).exit_code == 0
    with pytest.raises(ConfigError, match=message):
        launched["cfg"].validate()
