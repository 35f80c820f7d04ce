"""`pipegpt run --layout auto`: the planner's best layout for the ranks this run has, for a user who knows only
the model and the machines, and for an elastic job (torchrun --nnodes MIN:MAX) whose world size changes
between restarts.

Every torchrun rank chooses on its own, so the choice depends only on what all of them see alike: the model,
the global batch, the world size, the ranks per node and the device's name and total memory (never its free
memory). On CPU the figures are nominal: a core per rank and gloo over the loopback.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pipegpt.config import ConfigError, ModelConfig

from .candidates import Layout, Request
from pipegpt.costs.cost import AnalyticalCosts
from pipegpt.costs.devices import DEVICES, GiB, make_cluster
from .report import no_fit_message
from .search import search

# One CPU rank: a core of a few hundred GFLOP/s peak in fp32 (a tenth reached), memory a share of a small host,
# gloo over the loopback. Only the ratios between layouts matter here.
CPU_RANK = dict(gpu_memory=8 * GiB, gpu_tflops=0.2, intra_node="5GB/s", inter_node="1GB/s")
# torch.cuda.get_device_name() -> the preset whose links (NVLink or PCIe, InfiniBand) the planner assumes; first
# match wins
GPU_PRESETS = [(r"H100.*(PCIE|NVL)", "h100-pcie"), (r"H100", "h100"), (r"H200", "h200"), (r"A100", "a100-80gb"),
               (r"\bL4\b", "l4"), (r"\bA10G?\b", "a10g"), (r"V100", "v100")]


@dataclass(frozen=True)
class AutoLayout:
    layout: Layout
    step_s: float  # the planner's predicted step time
    cluster: str  # the machines as the planner saw them

    def settings(self) -> dict:
        """The run settings (TrainConfig fields) that build this layout."""
        return self.layout.settings()

    def text(self) -> str:
        lay = self.layout
        v = f" v{lay.virtual_stages}" if lay.takes_virtual_stages else ""
        axes = lay.sharding.label({"cp": lay.cp_comm}, spaced=True)
        return (f"{axes}, {lay.schedule}{v}, {lay.microbatches} microbatches of "
                f"{lay.microbatch_size}, recompute {lay.recompute}, zero {lay.zero}; predicted step "
                f"{self.step_s * 1e3:.1f} ms on {self.cluster}")


def choose_layout(model: ModelConfig, batch_size: int, ranks: int, ranks_per_node: int, precision: str,
                  device_name: str | None = None, device_memory: int | None = None) -> AutoLayout:
    """The planner's fastest layout that uses all `ranks` and keeps the model as it is (no padded vocabulary:
    a checkpoint must load into it)."""
    precision = {"fp32": "fp32", "bf16": "bf16"}.get(precision, "fp32")
    if device_name in (None, "cpu"):
        cluster = make_cluster(ranks, ranks_per_node, precision=precision, reserve=0, name="CPU rank (nominal)",
                               **CPU_RANK)
    else:
        preset = next((name for pattern, name in GPU_PRESETS if re.search(pattern, device_name.upper())), None)
        if preset is None:
            raise ConfigError(f"--layout auto does not know the GPU {device_name!r} (it knows "
                              f"{', '.join(DEVICES)}): give --stages, --dp and --tp")
        # its links from the preset; its memory as the device reports it (an A100 40GB and 80GB share a name)
        cluster = make_cluster(ranks, ranks_per_node, device=preset, precision=precision, gpu_memory=device_memory)
    result = search(Request(model, batch_size, cluster, AnalyticalCosts(cluster), top=20, exact_gpus=True))
    fitting = [r for r in result.best if not r.layout.pad_vocab]
    if not fitting:
        raise ConfigError(f"--layout auto: {no_fit_message(result)}" if not result.best else
                          f"--layout auto: every layout on {ranks} ranks pads the vocabulary ({model.vocab_size}) "
                          f"for its tp: give --stages, --dp and --tp")
    best = fitting[0]
    return AutoLayout(best.layout, best.step_time, cluster.describe())
