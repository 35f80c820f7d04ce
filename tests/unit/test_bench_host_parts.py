"""benchmarks/bench_host.py --py-spy: a sample under step() goes to the part of its outermost known frame, the rest
to the contender's own work; samples outside step() (start-up, the barrier) are left out."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_host  # noqa: E402


def test_step_parts_by_outermost_frame(tmp_path):
    frames = ["<module>", bench_host.STEP_FRAME, "PipelineRuntime.step", "PipelineRuntime._communicate",
              "PointToPoint.post", "Module._call_impl", "_run_backward", "PointToPoint._wait_host", "Stage.forward",
              "_SplitLinearFn.backward", "dist.barrier"]
    at = {name: i for i, name in enumerate(frames)}

    def stack(*names):
        return [at[n] for n in names]

    root = ("<module>", bench_host.STEP_FRAME, "PipelineRuntime.step")
    samples = [
        stack(*root, "PipelineRuntime._communicate", "PointToPoint.post"),  # p2p post
        stack(*root, "PipelineRuntime._communicate", "PointToPoint._wait_host"),  # p2p wait
        stack(*root, "Stage.forward", "Module._call_impl", "PointToPoint.post"),  # forward: the outermost
        stack(*root, "_run_backward", "_SplitLinearFn.backward"),  # backward
        stack(*root, "Stage.forward"),  # the runtime's own
        stack(*root),  # own
        stack("<module>", "dist.barrier"),  # not under step(): left out
    ]
    weights = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 1.0]
    path = tmp_path / "p.speedscope.json"
    path.write_text(json.dumps({"shared": {"frames": [{"name": n} for n in frames]},
                                "profiles": [{"samples": samples[:4], "weights": weights[:4]},
                                             {"samples": samples[4:], "weights": weights[4:]}]}))
    parts = bench_host.step_parts(str(path), steps=2)
    expected = {"forward": 0.03, "backward": 0.04, "p2p post": 0.01, "p2p wait": 0.02, "own work": 0.11}
    assert parts.keys() == expected.keys()
    for part, seconds in expected.items():
        assert abs(parts[part] - seconds / 2) < 1e-12, part


def test_parts_table_fits_per_microbatch():
    runs = {("1f1b", "pipegpt host", m): [{"parts": {"forward": 0.001 * m, "own work": 0.002 + 0.0001 * m}}]
            for m in (16, 64)}
    rows = bench_host.parts_table(runs, ["1f1b"], [16, 64])
    by_part = {row[2]: row for row in rows[1:]}
    assert by_part["forward"][3:] == ["16.00", "64.00", "1.000", "88%"]  # 64 / (64 + 8.4)
    assert by_part["own work"][3:] == ["3.60", "8.40", "0.100", "12%"]
