"""Planning a run before it starts: how to lay the model out (cost-balanced stages, timing, memory, search).

Pure Python (no torch): `pipegpt plan` answers in seconds on a laptop.

    devices.py   GPU presets (datasheet peak and memory, DGX/HGX links) and the Cluster the planner reads
    cost.py      per-layer F/B/I/W, collectives, messages and the optimizer step: analytical (FLOPs at an
                 efficiency, bytes over bandwidths) or calibrated from a run's trace
    memory.py    weights, gradients, optimizer state, activations and buffers of every rank
    balance.py   the contiguous layer split that makes the busiest rank's work the least
    search.py    dp x pp x tp, schedule, microbatching, recomputation, ZeRO-1, sequence parallelism and the
                 split, by branch and bound over the simulator (pipegpt.schedule.simulate)

    from pipegpt.plan import Request, make_cluster, AnalyticalCosts, search
    cluster = make_cluster(8, 8, "h100")
    result = search(Request(MODEL_PRESETS["gpt2"], 512, cluster, AnalyticalCosts(cluster)))
    result.best[0].layout.command(result.best[0].model, "bf16")   # the `pipegpt run ...` that runs it

The names below are imported on first use, so importing one submodule (pipegpt.plan.balance, say) does not
load the others.
"""
from __future__ import annotations

import importlib

_API = {
    "Request": "search", "Layout": "search", "Result": "search", "SearchResult": "search", "search": "search",
    "evaluate_layout": "search", "format_text": "search", "as_json": "search",
    "AnalyticalCosts": "cost", "CalibratedCosts": "cost", "calibrate_costs": "cost",
    "Cluster": "devices", "DEVICES": "devices", "make_cluster": "devices",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
