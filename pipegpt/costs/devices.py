"""The cluster a plan is for: GPU presets, units, and the Cluster the planner reads.

A preset is one GPU model in the node it usually comes in. Figures and where they come from:

* peak TFLOPS: dense (no 2:4 sparsity), PEAK_TFLOPS below (NVIDIA's datasheets), the same
  table MFU is measured against: bf16 = BF16 tensor cores, fp32 = TF32 tensor cores (what precision=fp32
  runs its matmuls on; plain FP32 on the V100, which has no TF32).
* memory: the datasheet's capacity (80 GB HBM is 80 GiB of memory chips; the planner compares its
  prediction with this figure, so leave what the CUDA context and the allocator's fragmentation take by
  giving --gpu-memory a little lower if you want a margin).
* HBM bandwidth: the datasheet's (it sets the optimizer step's time, which is memory-bound).
* intra-node: NVLink bandwidth per GPU and direction (half the datasheet's bidirectional figure) of the
  DGX/HGX node the GPU ships in; PCIe Gen4/Gen5 x16 per direction for cards without NVLink.
* inter-node: the node's InfiniBand/Ethernet bandwidth divided among its GPUs, as in the DGX reference
  designs (one 400 Gb/s ConnectX-7 per H100/H200, one 200 Gb/s HDR per A100); for the PCIe cards a
  typical cloud node's 100 Gb/s shared by its 8 GPUs.
* latency: a fixed cost per message or collective step (NVLink/PCIe ~5 us, network ~10 us), typical of
  NCCL on these systems.

These are typical, not measured on your cluster: override any of them (--gpu-tflops, --gpu-memory,
--intra-node-gbps, --inter-node-gbps) or calibrate the compute from a run (--calibrate).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pipegpt.config import ConfigError, PRECISIONS, nearest_multiples

GiB = 2**30
GB = 10**9


# Peak dense TFLOPS of one GPU (no 2:4 structured sparsity: where a datasheet gives only the sparse figure,
# it is halved), by a pattern on torch.cuda.get_device_name(). "bf16": BF16 tensor cores with FP32
# accumulation. "fp32": what precision=fp32 runs its matmuls on, TF32 tensor cores (the worker enables TF32
# on CUDA, as nanoGPT), except on the V100, which has no TF32 (and no BF16) tensor cores: plain FP32.
# Sources: NVIDIA's datasheets for H100 (SXM, PCIe, NVL), H200 (SXM, NVL), A100, L4, A10 and V100, and
# the Ada Lovelace architecture whitepaper (appendix, GeForce RTX 4090). The A10G is AWS's A10 variant,
# with no datasheet of its own: the A10's figures are used. --peak-tflops overrides this table.
PEAK_TFLOPS: list[tuple[str, float | None, float]] = [  # (pattern, bf16, fp32); the first match wins
    (r"H100.*NVL", 835.5, 417.5),
    (r"H100.*PCIE", 756.5, 378.0),
    (r"H100", 989.5, 494.5),
    (r"H200.*NVL", 835.5, 417.5),
    (r"H200", 989.5, 494.5),
    (r"A100", 312.0, 156.0),
    (r"\bL4\b", 121.0, 60.0),
    (r"\bA10G?\b", 125.0, 62.5),
    (r"V100S", None, 16.4),
    (r"V100.*PCIE", None, 14.0),
    (r"V100", None, 15.7),
    (r"RTX 4090", 165.2, 82.6),
]


def device_peak_tflops(device_name: str, precision: str) -> float | None:
    """One device's peak TFLOPS at `precision` ("bf16" or "fp32") from PEAK_TFLOPS; None if not listed."""
    for pattern, bf16, fp32 in PEAK_TFLOPS:
        if re.search(pattern, device_name.upper()):
            return bf16 if precision == "bf16" else fp32
    return None


@dataclass(frozen=True)
class Device:
    """One GPU model as it is usually deployed (see the module docstring for the sources)."""

    name: str
    description: str
    peak_pattern: str  # a name device_peak_tflops recognises
    memory_bytes: int
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # per GPU and direction
    inter_node_bytes_per_s: float  # per GPU and direction
    gpus_per_node: int = 8

    def peak_tflops(self, precision: str) -> float | None:
        return device_peak_tflops(self.peak_pattern, precision)


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("h100", "NVIDIA H100 SXM5 80GB in a DGX H100 (NVLink 4: 900 GB/s; 8x 400 Gb/s InfiniBand)",
           "H100 SXM", 80 * GiB, 3.35e12, 450 * GB, 50 * GB),
    Device("h100-pcie", "NVIDIA H100 PCIe 80GB, PCIe Gen5 x16 (no NVLink); 100 Gb/s per 8-GPU node",
           "H100 PCIe", 80 * GiB, 2.0e12, 64 * GB, 12.5 * GB / 8),
    Device("h200", "NVIDIA H200 SXM 141GB in a DGX H200 (NVLink 4: 900 GB/s; 8x 400 Gb/s InfiniBand)",
           "H200", 141 * GiB, 4.8e12, 450 * GB, 50 * GB),
    Device("a100-80gb", "NVIDIA A100 SXM4 80GB in a DGX A100 (NVLink 3: 600 GB/s; 8x 200 Gb/s HDR InfiniBand)",
           "A100", 80 * GiB, 2.039e12, 300 * GB, 25 * GB),
    Device("a100-40gb", "NVIDIA A100 SXM4 40GB in a DGX A100 (NVLink 3: 600 GB/s; 8x 200 Gb/s HDR InfiniBand)",
           "A100", 40 * GiB, 1.555e12, 300 * GB, 25 * GB),
    Device("l4", "NVIDIA L4 24GB, PCIe Gen4 x16 (no NVLink); 100 Gb/s per 8-GPU node",
           "L4", 24 * GiB, 300e9, 32 * GB, 12.5 * GB / 8),
    Device("a10g", "NVIDIA A10G 24GB (AWS g5), PCIe Gen4 x16 (no NVLink); 100 Gb/s per 8-GPU node",
           "A10G", 24 * GiB, 600e9, 32 * GB, 12.5 * GB / 8),
    Device("v100", "NVIDIA V100 SXM2 32GB in a DGX-1 (NVLink 2: 300 GB/s; 4x 100 Gb/s EDR InfiniBand per node)",
           "V100", 32 * GiB, 900e9, 150 * GB, 50 * GB / 8),
)}

LATENCY_INTRA_S = 5e-6  # per message or collective step inside a node
LATENCY_INTER_S = 10e-6  # across nodes


@dataclass(frozen=True)
class Cluster:
    """What the planner needs to know about the machines: counts, memory, speed, links (bytes and seconds)."""

    gpus: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float  # one GPU, at the run's precision, FLOP/s
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    hbm_bytes_per_s: float
    precision: str = "bf16"
    name: str = "custom"
    latency_intra_s: float = LATENCY_INTRA_S
    latency_inter_s: float = LATENCY_INTER_S
    reserve_bytes: float = 0.0  # held back from memory_bytes: see default_reserve

    @property
    def usable_bytes(self) -> float:
        """What a plan may fill: the memory less the reserve."""
        return self.memory_bytes - self.reserve_bytes

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def describe(self) -> str:
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.gpus_per_node}" \
            if self.gpus % self.gpus_per_node == 0 else f"{self.gpus_per_node} per node"
        reserve = f" ({format_bytes(self.reserve_bytes)} reserved)" if self.reserve_bytes else ""
        return (f"{self.gpus} x {self.name} ({nodes}), {format_bytes(self.memory_bytes)} each{reserve}, "
                f"{self.peak_flops / 1e12:g} TFLOPS {self.precision}, links {format_rate(self.intra_node_bytes_per_s)} "
                f"in a node, {format_rate(self.inter_node_bytes_per_s)} between nodes (per {self.unit})")

    @property
    def unit(self) -> str:
        return "rank" if self.name.startswith("CPU") else "GPU"


_BYTE_UNITS = {"": GiB, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": GiB, "tib": 2**40}


def parse_bytes(text, what: str = "--gpu-memory") -> float:
    """'80GiB', '80 GB' (10^9), '81920MiB', or a bare number of GiB -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _BYTE_UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{what} {text!r}: give a size such as 80GiB, 40GB or 81920MiB (a bare number is GiB)")
    return float(m.group(1)) * _BYTE_UNITS[unit]


def parse_rate(text, what: str) -> float:
    """A link bandwidth -> bytes/s: '400' or '400Gbps' (gigabits/s), '450GB/s' (gigabytes/s), '3.2Tbps'."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z/]*)\s*", str(text))
    raw = m.group(2) if m else None
    value = float(m.group(1)) if m else 0
    if m and raw in ("GB/s", "GBps", "GByte/s"):
        factor = 1e9
    elif m and raw in ("MB/s",):
        factor = 1e6
    elif m and raw in ("TB/s",):
        factor = 1e12
    elif m and raw.lower() in ("", "gbps", "gb/s", "gbit/s"):
        factor = 1e9 / 8  # gigabits: the name of the option
    elif m and raw.lower() in ("mbps", "mbit/s"):
        factor = 1e6 / 8
    elif m and raw.lower() in ("tbps", "tbit/s"):
        factor = 1e12 / 8
    else:
        factor = None
    if factor is None or value <= 0:
        raise ConfigError(f"{what} {text!r}: give a bandwidth per GPU and direction such as 400 (Gbit/s), "
                          f"400Gbps or 50GB/s")
    return value * factor


def format_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def format_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.4g} GB/s"


def make_cluster(gpus: int | None, gpus_per_node: int | None = None, device: str | None = None,
                 gpu_memory=None, gpu_tflops: float | None = None, intra_node=None, inter_node=None,
                 precision: str = "bf16", hbm=None, reserve=None, name: str | None = None) -> Cluster:
    """A Cluster from a preset and/or explicit figures; ConfigError (one line) for anything missing or wrong.

    gpu_memory, intra_node and inter_node may be strings with units (see parse_bytes, parse_rate) or numbers
    (bytes, bytes/s)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    preset = None
    if device is not None:
        preset = DEVICES.get(str(device).lower())
        if preset is None:
            raise ConfigError(f"unknown device preset {device!r}: known presets are {', '.join(DEVICES)} "
                              f"(or give --gpu-memory, --gpu-tflops and the link bandwidths)")
    if gpus is None or isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"--gpus {gpus!r}: give the number of GPUs (an integer >= 1)")
    per_node = gpus_per_node if gpus_per_node is not None else (preset.gpus_per_node if preset else None)
    if per_node is None:
        per_node = min(gpus, 8)
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ConfigError(f"--gpus-per-node {per_node!r} must be an integer >= 1")
    if gpus > per_node and gpus % per_node:
        raise ConfigError(f"--gpus {gpus} is not a multiple of --gpus-per-node {per_node}: whole nodes only, "
                          f"e.g. --gpus {nearest_multiples(gpus, per_node)}")
    per_node = min(per_node, gpus)

    def pick(given, parse, preset_value, flag):
        if given is not None:
            return parse(given) if isinstance(given, str) else float(given)
        if preset_value is None:
            raise ConfigError(f"give {flag} or a --device preset ({', '.join(DEVICES)})")
        return float(preset_value)

    memory = pick(gpu_memory, lambda t: parse_bytes(t, "--gpu-memory"), preset and preset.memory_bytes,
                  "--gpu-memory")
    if gpu_tflops is not None:
        if not gpu_tflops > 0:
            raise ConfigError(f"--gpu-tflops {gpu_tflops} must be > 0")
        peak = float(gpu_tflops) * 1e12
    else:
        tflops = preset.peak_tflops(precision) if preset else None
        if preset is not None and tflops is None:
            raise ConfigError(f"{preset.name} has no {precision} tensor cores in the datasheet table: use "
                              f"--precision fp32 or give --gpu-tflops")
        peak = pick(None, None, tflops and tflops * 1e12, "--gpu-tflops")
    intra = pick(intra_node, lambda t: parse_rate(t, "--intra-node-gbps"), preset and preset.intra_node_bytes_per_s,
                 "--intra-node-gbps")
    if inter_node is None and preset is None and gpus <= per_node:
        inter = intra  # one node: never used
    else:
        inter = pick(inter_node, lambda t: parse_rate(t, "--inter-node-gbps"),
                     preset and preset.inter_node_bytes_per_s, "--inter-node-gbps")
    hbm_rate = float(hbm) if hbm is not None else (preset.hbm_bytes_per_s if preset else 2.0e12)
    held = default_reserve(memory) if reserve is None else (
        parse_bytes(reserve, "--reserve") if isinstance(reserve, str) else float(reserve))
    if not 0 <= held < memory:
        raise ConfigError(f"--reserve {format_bytes(held)} must be at least 0 and below the GPU's memory "
                          f"({format_bytes(memory)})")
    return Cluster(gpus, per_node, memory, peak, intra, inter, hbm_rate, precision,
                   name or (preset.name if preset else "custom GPU"), reserve_bytes=held)


def default_reserve(memory_bytes: float) -> float:
    """Memory a plan leaves free by default: 2 GiB, or a tenth of a smaller GPU.

    The planner counts tensors only; a process also holds its CUDA context (several hundred MiB with cuBLAS
    workspaces), NCCL's buffers per channel and peer, and the caching allocator's fragmentation, none of which the
    memory model sees. 2 GiB is a round figure of that order (a choice, not a measurement); --reserve sets it."""
    return min(2 * 2**30, memory_bytes / 10)
