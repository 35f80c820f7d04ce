"""The planner leaves memory for what its model does not count (CUDA context, NCCL buffers, fragmentation)."""
import pytest

from helpers import invoke
from pipegpt.config import ConfigError, ModelConfig
from pipegpt.planner.candidates import Request
from pipegpt.costs.cost import AnalyticalCosts
from pipegpt.costs.devices import GiB, default_reserve, make_cluster
from pipegpt.planner.search import search

MODEL = ModelConfig(vocab_size=256, seq_len=64, n_layer=8, n_head=4, n_embd=128)


def _plans(memory, reserve=None):
    cluster = make_cluster(2, 2, gpu_memory=memory, gpu_tflops=100, intra_node="100GB/s", reserve=reserve)
    res = search(Request(MODEL, 8, cluster, AnalyticalCosts(cluster, 0.5, 0.0), top=1000, schedules=("1f1b",)))
    return cluster, res.best


def test_a_plan_filling_99_percent_no_longer_fits_by_default():
    _, roomy = _plans(64 * GiB, reserve=0)
    fullest = max(roomy, key=lambda r: r.peak_bytes)
    memory = fullest.peak_bytes / 0.99  # the plan fills 99% of it, as 79.2 of 80 GiB
    _, exact = _plans(memory, reserve=0)
    assert fullest.layout in [r.layout for r in exact]
    cluster, reserved = _plans(memory)
    assert cluster.reserve_bytes == default_reserve(memory) > 0
    assert fullest.layout not in [r.layout for r in reserved]
    assert all(r.peak_bytes <= cluster.usable_bytes for r in reserved)


def test_the_default_is_2_gib_on_an_80_gib_gpu_and_a_tenth_of_a_small_one():
    assert default_reserve(80 * GiB) == 2 * GiB and 79.2 * GiB > 80 * GiB - default_reserve(80 * GiB)
    assert default_reserve(8 * GiB) == pytest.approx(0.8 * GiB)
    with pytest.raises(ConfigError, match="--reserve"):
        make_cluster(2, 2, gpu_memory="8GiB", gpu_tflops=100, intra_node="100GB/s", reserve="8GiB")


def test_plan_reserve_option():
    out = invoke("plan", "--model", "tiny", "--gpus", "2", "--device", "h100", "--batch-size", "8",
                 "--reserve", "10GiB")
    assert out.exit_code == 0, out.output
    assert "10.0 GiB reserved" in out.output
