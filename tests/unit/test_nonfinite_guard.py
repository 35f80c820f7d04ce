"""The non-finite guard's pieces, without workers: strict JSON metrics, where a non-finite value appeared
first, the norm's flags, a checkpoint of non-finite values never committed, and lr inf/nan refused."""
from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch

from helpers import assert_one_line_error, invoke
from pipegpt.config import ConfigError, ModelConfig, TrainConfig
from pipegpt.state import checkpoint
from pipegpt.observe.metrics import StepMetrics, json_line
from pipegpt.train.optim import clip_grad_norm_, global_grad_norm
from pipegpt.engine.results import SavedFile, WorkerStep


def _refuse_nan(text):
    raise ValueError(f"not JSON: {text}")


def test_non_finite_metrics_are_null_in_strict_json():
    m = StepMetrics(3, math.nan, 0.5, 100.0, math.inf, [1, 2], lr=1e-3, cpu_per_rank=[0.5, -math.inf],
                    nonfinite="the loss is nan on rank 1 (stage 1)")
    row = json.loads(json_line(asdict(m)), parse_constant=_refuse_nan)  # NaN/Infinity would raise
    assert (row["loss"], row["grad_norm"], row["cpu_per_rank"], row["lr"]) == (None, None, [0.5, None], 1e-3)
    assert row["skipped_steps"] == 0 and row["nonfinite"] == "the loss is nan on rank 1 (stage 1)"


def _answer(rank, losses=(), stages=(), norm=math.nan):
    return WorkerStep(rank, list(losses), norm, 1e-3, 0, "cpu", applied=False, nonfinite_stages=list(stages))


def test_the_cause_names_the_loss_first_then_the_latest_stage_with_bad_gradients():
    from pipegpt.train.loop import nonfinite_cause

    # the loss: on the last stage's first rank that saw it (dp 2: ranks 1 and 3 hold stage 1)
    results = [_answer(0, stages=[0]), _answer(1, [2.0, math.inf], [1]), _answer(2), _answer(3, [math.nan])]
    assert nonfinite_cause(results, last_stage=1) == "the loss is inf on rank 1 (stage 1)"
    # gradients: the backward reaches the later stages first (stage 2 on rank 1 of a V-shape: ranks hold 0,3 and 1,2)
    results = [_answer(0, stages=[0, 3]), _answer(1, [1.0], stages=[1, 2])]
    assert nonfinite_cause(results, last_stage=3) == "the gradient norm is nan (first on rank 0, stage 3)"
    results = [_answer(0, stages=[0]), _answer(1, [1.0], stages=[1]), _answer(2, [1.0], stages=[1])]
    assert nonfinite_cause(results, last_stage=1) == "the gradient norm is nan (first on rank 1, stage 1)"
    assert nonfinite_cause([_answer(0, [1.0], norm=math.inf)], 0) == "the gradient norm is inf"


def test_the_norm_carries_the_loss_flag_and_says_whether_this_ranks_share_was_finite():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    assert global_grad_norm(params) == (math.sqrt(28.0), False, True)
    assert global_grad_norm(params, flagged=True)[1] is True
    assert clip_grad_norm_(params, params, 1.0) == pytest.approx(math.sqrt(28.0))  # the old entry point
    params[1].grad[2] = math.nan
    norm, flagged, mine_finite = global_grad_norm(params)
    assert math.isnan(norm) and not flagged and not mine_finite


def test_a_worker_finds_its_first_non_finite_parameter_or_moment():
    from types import SimpleNamespace

    from pipegpt.train.worker import first_nonfinite

    stages = {s: SimpleNamespace(module=torch.nn.Linear(3, 2)) for s in (2, 3)}
    worker = SimpleNamespace()  # only what save() looks at: stages, optimizer, one-process names
    worker.stages = stages
    worker.full_names = {id(p): f"blocks.{s}.{n}" for s, st in stages.items() for n, p in st.module.named_parameters()}
    worker.optimizer = torch.optim.AdamW([p for st in stages.values() for p in st.module.parameters()])
    worker._first_nonfinite = lambda: first_nonfinite(worker.stages, worker.full_names, worker.optimizer.state)
    assert worker._first_nonfinite() is None  # no moments yet
    for p in worker.optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    worker.optimizer.step()
    assert worker._first_nonfinite() is None
    worker.optimizer.state[stages[3].module.bias]["exp_avg_sq"][1] = math.inf
    assert worker._first_nonfinite() == (3, "exp_avg_sq/blocks.3.bias")
    with torch.no_grad():
        stages[3].module.weight[0, 0] = math.nan
    assert worker._first_nonfinite() == (3, "param/blocks.3.weight")


class _SavingCluster:
    """Answers save() as the workers would: rank 1 holds a non-finite Adam moment when told to."""

    def __init__(self, bad: bool):
        self.bad = bad

    def call(self, method, directory, step):
        assert method == "save"
        answers = []
        for rank in range(2):
            if self.bad and rank == 1:
                answers.append(SavedFile(rank, nonfinite=(1, "exp_avg_sq/blocks.1.mlp.fc.weight")))
            else:
                answers.append(SavedFile(rank, *checkpoint.write_rank_file(directory, rank, {"x": torch.ones(1)}, {})))
        return answers


def test_a_checkpoint_of_non_finite_values_is_never_committed(tmp_path):
    from pipegpt.train.driver import Job, NonFiniteError

    cfg = TrainConfig.build(ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16), stages=2, microbatches=2,
                            device="cpu", keep=1)
    job = Job(cfg)
    root = tmp_path / "checkpoints"
    job.cluster = _SavingCluster(bad=False)
    first = job.save(root, 1)
    job.cluster = _SavingCluster(bad=True)
    with pytest.raises(NonFiniteError) as e:
        job.save(root, 2)
    assert str(e.value) == ("step 2: exp_avg_sq/blocks.1.mlp.fc.weight is not finite on rank 1 (stage 1); "
                            "no checkpoint written")
    # keep=1 would have pruned the finite step-1 checkpoint had step 2 been committed
    assert sorted(p.name for p in root.iterdir()) == [first.name] == ["step-00000001"]
    assert json.loads((first / checkpoint.MANIFEST).read_text())["sha256"].keys() == \
        {"rank-00000.safetensors", "rank-00001.safetensors"}


@pytest.mark.parametrize("args, message", [
    (["--lr", "inf"], "Error: lr=inf must be a finite number (> 0)"),
    (["--lr", "nan"], "Error: lr=nan must be a finite number (> 0)"),
    (["--min-lr", "inf"], "Error: min_lr=inf must be a finite number (>= 0)"),
    (["--grad-clip", "nan"], "Error: grad_clip=nan must be a finite number (>= 0)"),
])
def test_a_non_finite_learning_rate_is_refused_before_any_worker_starts(no_workers, args, message):
    result = invoke("run", "--steps", "2", "--stages", "2", *args)
    assert assert_one_line_error(result) == message
    assert no_workers == []


def test_on_nonfinite_is_an_optimizer_setting_with_two_choices():
    assert TrainConfig().optim.on_nonfinite == "stop"
    TrainConfig.build(on_nonfinite="skip").validate()
    with pytest.raises(ConfigError, match="on_nonfinite='maybe' is not one of stop, skip"):
        TrainConfig.build(on_nonfinite="maybe").validate()
