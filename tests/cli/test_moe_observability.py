"""A tiny mixture of experts trained with --ep 2 shows its figures: the aux loss on the progress line, per-layer
imbalance, drops and router bias range in metrics.jsonl, the aux loss and imbalance in plot.svg, and the expert
all-to-alls (dispatch and combine, forward and backward) as trace events of their own in trace.json, which
`pipegpt simulate --trace` still reads."""
import json

from tests.helpers import run_pipegpt

RATE = 0.01


def test_a_moe_run_shows_its_experts(tmp_path):
    run = tmp_path / "run"
    proc = run_pipegpt("run", "--model", "tiny-moe", "--stages", 1, "--dp", 2, "--ep", 2, "--steps", 2,
                       "--microbatches", 2, "--batch-size", 8, "--router-bias-update-rate", RATE, "--device", "cpu",
                       "--run-dir", run, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ") and " loss " in line]
    assert len(steps) == 2 and all(" aux 0.0" in line.split(" ms")[0] for line in steps)  # tiny-moe has an aux loss

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        layers = row["moe_layers"]
        assert [layer["layer"] for layer in layers] == [0, 1, 2, 3]  # every block of tiny-moe is MoE
        assert row["moe_imbalance"] == max(layer["imbalance"] for layer in layers) > 1.0
        assert all(layer["imbalance"] >= 1.0 and layer["dropped"] == 0.0 for layer in layers)  # dropless
        assert row["moe_dropped"] == 0.0 and row["aux_loss"] > 0
        assert abs(row["aux_loss"] - sum(layer["aux_loss"] for layer in layers)) < 1e-9
        # one update of rate x sign(mean - load) per step, from 0: after step 1 some experts at -rate (above the
        # mean load), some at +rate; after step n within n x rate
        bound = row["step"] * RATE + 1e-6
        assert all(-bound <= layer["bias_min"] < layer["bias_max"] <= bound for layer in layers)
        if row["step"] == 1:
            assert all(abs(layer["bias_min"] + RATE) < 1e-6 and abs(layer["bias_max"] - RATE) < 1e-6
                       for layer in layers)

    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    exchanges = [e for e in trace if e.get("cat") == "expert all-to-all"]
    for rank in (0, 1):
        names = [e["name"] for e in exchanges if e["pid"] == rank and e["ph"] == "B"]
        # 4 layers x 2 microbatches each way
        for name in ("dispatch", "combine", "dispatch (backward)", "combine (backward)"):
            assert names.count(name) == 8, (rank, name, names)
        begins = [e for e in exchanges if e["pid"] == rank and e["ph"] == "B"]
        ends = [e for e in exchanges if e["pid"] == rank and e["ph"] == "E"]
        assert len(begins) == len(ends) and all(b["ts"] <= e["ts"] for b, e in zip(begins, ends))
    computes = [e for e in trace if e["ph"] == "X" and e["pid"] == 0]
    span = (min(e["ts"] for e in computes), max(e["ts"] + e["dur"] for e in computes))
    assert all(span[0] <= e["ts"] <= span[1] for e in exchanges if e["pid"] == 0)  # inside the step's actions

    plot = (run / "plot.svg").read_text()
    assert 'data-series="aux_loss"' in plot and 'data-series="moe_imbalance"' in plot
    simulated = run_pipegpt("simulate", "--trace", run, timeout=60)
    assert simulated.returncode == 0, simulated.stderr[-2000:]
