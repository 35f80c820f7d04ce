"""`--ep N` on `pipegpt run`: the flag, the config file's [parallel] ep, and one line at exit 2 (before any
worker starts) for what does not fit."""
import pytest

from tests.helpers import assert_one_line_error, invoke


@pytest.fixture
def launched(monkeypatch):
    """The TrainConfig `pipegpt run` would launch (no job starts)."""
    seen = {}
    monkeypatch.setattr("pipegpt.train.launch.launch", lambda cfg, *args, **kwargs: seen.update(cfg=cfg))
    return seen


def test_ep_from_the_flag_and_from_a_config_file(tmp_path, launched):
    assert invoke("run", "--model", "tiny-moe", "--stages", 1, "--dp", 4, "--ep", 2).exit_code == 0
    cfg = launched["cfg"]
    assert cfg.parallel.ep == 2 and cfg.parallel.dims.size("ep") == 2 and cfg.parallel.dims.size("edp") == 2
    assert cfg.world_size == 4  # carved out of dp: the world unchanged
    path = tmp_path / "run.toml"
    path.write_text('model = "tiny-moe"\n\n[parallel]\nstages = 2\ndp = 2\nep = 2\n')
    assert invoke("run", "--config", path).exit_code == 0
    assert (launched["cfg"].parallel.ep, launched["cfg"].world_size) == (2, 4)


@pytest.mark.parametrize("args, fragments", [
    (("--n-layer", 2, "--dp", 2, "--ep", 2), ["--ep 2", "the model has none"]),
    (("--model", "tiny-moe", "--dp", 3, "--ep", 3), ["--ep 3 does not divide the 8 experts", "1, 2, 4, 8"]),
    (("--model", "tiny-moe", "--dp", 2, "--ep", 4), ["--ep 4 is carved out of dp x cp = 2"]),
    (("--model", "tiny-moe", "--dp", 2, "--ep", 0), ["ep=0"]),
])
def test_what_does_not_fit_is_one_line(args, fragments):
    assert_one_line_error(invoke("run", "--stages", 1, *args), *fragments)  # launch validates before any worker


def test_ep_with_zero_is_accepted(launched):
    assert invoke("run", "--model", "tiny-moe", "--stages", 1, "--dp", 4, "--ep", 2, "--zero", 3).exit_code == 0
    assert (launched["cfg"].parallel.ep, launched["cfg"].parallel.zero) == (2, 3)
    launched["cfg"].validate({})  # ZeRO 1-3 shard the experts over edp: not refused
