"""--wandb PROJECT: every metrics row also goes to Weights & Biases, with TensorBoard's tags and values. wandb is no
dependency: without it the option is refused in one line before any work; with it (here a stand-in module that
records what pipegpt hands it, under WANDB_MODE=offline) a run logs each step's figures once, then finishes."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from helpers import ROOT, assert_one_line_error, clean_env, invoke, run_pipegpt

# what wandb.init, Run.log and Run.finish received, a JSON line each, in the run directory
STANDIN = '''
import json, os

class Run:
    def __init__(self, dir):
        self.path = os.path.join(dir, "wandb-standin.jsonl")

    def _say(self, **row):
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\\n")

    def log(self, data, step=None):
        self._say(call="log", data=data, step=step)

    def finish(self):
        self._say(call="finish")

def init(project=None, dir=None, group=None, name=None, config=None, **kwargs):
    run = Run(dir)
    run._say(call="init", project=project, group=group, name=name, config_keys=sorted(config or {}),
             mode=os.environ.get("WANDB_MODE"), kwargs=sorted(kwargs))
    return run
'''


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_the_package_is_refused_in_one_line():
    assert_one_line_error(invoke("run", "--wandb", "pipegpt", "--steps", "1"), "wandb='pipegpt' needs Weights & Biases",
                          "pip install wandb")


def test_a_run_logs_every_metrics_row_to_wandb_with_tensorboards_tags(tmp_path):
    (tmp_path / "standin").mkdir()
    (tmp_path / "standin" / "wandb.py").write_text(STANDIN)
    run = tmp_path / "run"
    env = clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path / "standin"), str(ROOT)]), WANDB_MODE="offline")
    proc = run_pipegpt("run", "--stages", "2", "--microbatches", "2", "--steps", "3", "--n-layer", "2", "--n-embd",
                       "32", "--n-head", "2", "--seq-len", "16", "--threads-per-worker", "1", "--no-save-final",
                       "--wandb", "my-project", "--run-dir", run, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [json.loads(line) for line in (run / "wandb-standin.jsonl").read_text().splitlines()]
    assert [c["call"] for c in calls] == ["init", "log", "log", "log", "finish"]
    init = calls[0]
    assert (init["project"], init["group"], init["name"], init["mode"], init["kwargs"]) == \
        ("my-project", "run", "run-attempt-1", "offline", [])
    assert init["config_keys"] == ["checkpoint", "data", "eval", "model", "optim", "parallel", "runtime"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [c["step"] for c in calls[1:4]] == [r["step"] for r in rows] == [1, 2, 3]
    for call, row in zip(calls[1:4], rows):
        assert call["data"]["train/loss"] == row["loss"] and call["data"]["train/lr"] == row["lr"]
        assert call["data"]["train/peak_memory_per_rank/rank1"] == row["peak_memory_per_rank"][1]
    assert json.loads((run / "config.json").read_text())["runtime"]["wandb"] == "my-project"
