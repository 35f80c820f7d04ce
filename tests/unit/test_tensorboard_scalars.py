"""TensorBoard gets every metric of a metrics.jsonl row: evaluations, per-rank values, counters."""
import math

import pytest

from pipegpt.observe.metrics import StepMetrics, tensorboard_scalars


def _row(**extra):
    return StepMetrics(step=4, loss=2.5, step_time_s=0.2, tokens_per_s=1e4, grad_norm=math.nan,
                       peak_memory_per_rank=[100, 200], lr=1e-3, **extra)


def test_every_number_gets_a_tag():
    tags = dict(tensorboard_scalars(_row(val_loss=2.7, hellaswag_acc=0.25, hellaswag_acc_norm=0.3,
                                         cpu_per_rank=[0.9, 1.0], skipped_steps=1)))
    assert tags["eval/val_loss"] == 2.7 and tags["eval/hellaswag_acc"] == 0.25
    assert tags["eval/hellaswag_acc_norm"] == 0.3
    assert tags["train/loss"] == 2.5 and tags["train/lr"] == 1e-3 and tags["train/skipped_steps"] == 1
    assert tags["train/peak_memory_per_rank/rank1"] == 200 and tags["train/cpu_per_rank/rank0"] == 0.9
    assert "train/grad_norm" not in tags and "train/step" not in tags  # nan and the step itself
    assert "eval/val_loss" not in dict(tensorboard_scalars(_row()))  # not an evaluation step


def test_the_event_file_holds_val_loss(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    m = _row(val_loss=2.7)
    for tag, value in tensorboard_scalars(m):
        writer.add_scalar(tag, value, m.step)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert "eval/val_loss" in events.Tags()["scalars"]
