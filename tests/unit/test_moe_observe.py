"""What a mixture of experts shows: per-layer figures from end_step (imbalance, drops, aux loss, the router bias
range) merged over ranks, in metrics rows and TensorBoard; one figure on the progress line (a dense run's line
unchanged byte for byte); the aux loss and imbalance panels of the plot; the expert all-to-alls as trace events."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from pipegpt.config import ModelConfig
from pipegpt.model.gpt import GPT
from pipegpt.model.moe import end_step, merge_stats, moe_layers
from pipegpt.observe.exchanges import ExchangeRecorder, recording_exchanges, resolved, trace_events
from pipegpt.observe.metrics import StepMetrics, json_line, tensorboard_scalars
from pipegpt.observe.plot import plot_runs
from pipegpt.stages.timing import HostClock
from pipegpt.observe.progress import progress_line

pytestmark = pytest.mark.usefixtures("one_thread")


def _model() -> GPT:
    config = ModelConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, n_embd=16, arch="llama", bias=False,
                         n_experts=4, n_experts_per_token=2, expert_hidden=8, first_dense_layers=1,
                         router_aux_loss_coef=0.1).validate()
    return GPT(config, init_seed=0)


def test_end_step_reports_each_moe_layer_by_its_block():
    model = _model()
    first, second = moe_layers(model)  # blocks 1 and 2 (block 0 is dense)
    first.tokens_per_expert.copy_(torch.tensor([6.0, 2, 4, 4]))  # mean 4, max 6
    second.tokens_per_expert.copy_(torch.tensor([1.0, 1, 1, 5]))  # mean 2, max 5
    first.dropped.fill_(3)
    first.aux_sum, first.calls = 0.5, 2
    stats = end_step(model, rate=0.25)
    rows = stats["moe_layers"]
    assert [r["layer"] for r in rows] == [1, 2]
    assert (rows[0]["imbalance"], rows[1]["imbalance"]) == (1.5, 2.5)
    assert (rows[0]["dropped"], rows[1]["dropped"]) == (3.0, 0.0)
    assert (rows[0]["aux_loss"], rows[1]["aux_loss"]) == (0.25, 0.0)
    # the bias after the update: rate x sign(mean - load)
    assert (rows[0]["bias_min"], rows[0]["bias_max"]) == (-0.25, 0.25)
    assert (rows[1]["bias_min"], rows[1]["bias_max"]) == (-0.25, 0.25)
    assert (stats["moe_imbalance"], stats["moe_dropped"], stats["aux_loss"]) == (2.5, 3.0, 0.25)


def test_layers_merge_over_stages_and_replicas():
    def row(layer, imbalance, dropped, aux, lo, hi):
        return {"layer": layer, "imbalance": imbalance, "dropped": dropped, "aux_loss": aux, "bias_min": lo,
                "bias_max": hi}

    stage0 = {"aux_loss": 0.2, "moe_imbalance": 1.5, "moe_dropped": 1.0, "moe_layers": [row(0, 1.5, 1.0, 0.2, 0, 0)]}
    stage1 = {"aux_loss": 0.4, "moe_imbalance": 2.0, "moe_dropped": 2.0, "moe_layers": [row(1, 2.0, 2.0, 0.4, -1, 1)]}
    replica = {"aux_loss": 0.6, "moe_imbalance": 1.5, "moe_dropped": 5.0, "moe_layers": [row(0, 1.5, 5.0, 0.6, 0, 0)]}
    merged = merge_stats([stage1, {}, stage0, replica], replicas=2)
    assert merged["moe_layers"] == [row(0, 1.5, 6.0, pytest.approx(0.4), 0, 0), row(1, 2.0, 2.0, 0.2, -1, 1)]
    assert merged["aux_loss"] == pytest.approx(sum(r["aux_loss"] for r in merged["moe_layers"]))
    assert merge_stats([merged]) == merged  # a worker's merge, then the driver's


def test_metrics_rows_and_tensorboard_carry_the_layers():
    layers = [{"layer": 3, "imbalance": 2.0, "dropped": 0.0, "aux_loss": float("nan"), "bias_min": -0.1,
               "bias_max": 0.2}]
    m = StepMetrics(1, 4.0, 1.0, 100.0, 1.0, [0], moe={"aux_loss": 0.1, "moe_imbalance": 2.0, "moe_dropped": 0.0,
                                                        "moe_layers": layers})
    row = json.loads(json_line({**m.moe, "loss": 4.0}))  # strict JSON: a nan inside a layer's row is null
    assert row["moe_layers"] == [{**layers[0], "aux_loss": None}]
    scalars = dict(tensorboard_scalars(m))
    assert scalars["train/moe/layer3/imbalance"] == 2.0 and scalars["train/moe/layer3/bias_min"] == -0.1
    assert "train/moe/layer3/aux_loss" not in scalars and "train/moe_layers" not in scalars


def _line(moe=None):
    m = SimpleNamespace(step=2, loss=2.5, step_time_s=0.1, tokens_per_s=1000.0)
    if moe is not None:
        m.moe = moe
    return progress_line(m, 10, elapsed_s=65, eta_s=3725)


def test_the_progress_line_shows_one_moe_figure_and_a_dense_line_is_unchanged():
    dense = "step  2/10 [####................] loss 2.5000    100.0 ms      1,000 tok/s  elapsed 1m05s  eta 1h02m"
    assert _line() == dense and _line({}) == dense  # StepMetrics of a dense run: moe {}
    assert _line({"aux_loss": 0.0123, "moe_imbalance": 1.8}) == dense.replace("2.5000 ", "2.5000 aux 0.0123 ")
    assert _line({"aux_loss": 0.0, "moe_imbalance": 1.8}) == dense.replace("2.5000 ", "2.5000 imb 1.80 ")


def _run_dir(tmp_path, name, moe: bool):
    run = tmp_path / name
    run.mkdir()
    rows = [{"step": s, "loss": 5.0 - s, "lr": 1e-3, "tokens_per_s": 100.0,
             **({"aux_loss": 0.1 / s, "moe_imbalance": 1.0 + s} if moe else {})} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_plot_draws_aux_loss_and_imbalance_only_for_moe_runs(tmp_path):
    dense, moe = _run_dir(tmp_path, "dense", False), _run_dir(tmp_path, "moe", True)
    plain = plot_runs([dense])
    assert "aux_loss" not in plain and 'height="' in plain
    drawn = plot_runs([moe])
    for series in ("aux_loss", "moe_imbalance"):
        assert re.search(f'data-panel="{series}" data-series="{series}" data-run="moe" d="M', drawn)
    height = lambda svg: int(re.search(r'<svg[^>]* height="(\d+)"', svg).group(1))  # noqa: E731
    assert height(drawn) > height(plain)  # a third row of panels
    both = plot_runs([dense, moe])  # overlaid: the MoE run's lines, none for the dense one
    assert 'data-series="aux_loss" data-run="moe"' in both and 'data-series="aux_loss" data-run="dense"' not in both


def test_exchanges_are_recorded_only_inside_the_block():
    from pipegpt.expert_parallel import all_to_all as hook  # noqa: F401  (the package's function)
    import importlib

    module = importlib.import_module("pipegpt.expert_parallel.all_to_all")
    clock = HostClock()
    with recording_exchanges(clock, on=False) as none:
        assert none is None and module.recorder is None
    with recording_exchanges(clock) as recorder:
        assert module.recorder is recorder
        recorder.add("dispatch", clock.mark(), 7)
    assert module.recorder is None
    ((what, start, end, rows),) = resolved(recorder, clock)
    assert (what, rows) == ("dispatch", 7) and start <= end


def test_trace_events_nest_and_overlapping_spans_take_another_thread():
    spans = [("dispatch", 1.0, 2.0, 4), ("combine", 2.5, 3.0, 4),  # one after another: one thread
             ("dispatch (backward)", 4.0, 6.0, 3), ("combine (backward)", 5.0, 7.0, 3)]  # overlapping: two
    events = trace_events([(1, spans)], t0=1.0)
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert threads == {1: "expert all-to-all", 2: "expert all-to-all 2"}
    timed = [(e["name"], e["ph"], e["tid"], e["ts"]) for e in events if e["ph"] in "BE"]
    assert timed == [("dispatch", "B", 1, 0.0), ("dispatch", "E", 1, 1e6), ("combine", "B", 1, 1.5e6),
                     ("combine", "E", 1, 2e6), ("dispatch (backward)", "B", 1, 3e6),
                     ("dispatch (backward)", "E", 1, 5e6), ("combine (backward)", "B", 2, 4e6),
                     ("combine (backward)", "E", 2, 6e6)]
    assert all(e["pid"] == 1 and e.get("cat", "expert all-to-all") == "expert all-to-all" for e in events)
    assert ExchangeRecorder(lambda: 0.0).spans == []
