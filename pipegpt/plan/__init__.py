"""Planning a run before it starts: how to lay the model out (cost-balanced stages, timing, memory, search).

Pure Python (no torch): `pipegpt plan` answers in seconds on a laptop.

    devices.py   GPU presets (datasheet peak and memory, DGX/HGX links) and the Cluster the planner reads
    cost.py      per-layer F/B/I/W, collectives, messages and the optimizer step: analytical (FLOPs at an
                 efficiency, bytes over bandwidths) or calibrated from a run's trace
    memory.py    weights, gradients, optimizer state, activations and buffers of every rank
    balance.py   the contiguous layer split that makes the busiest rank's work the least
    search.py    dp x pp x tp, schedule, microbatching, recomputation, ZeRO-1, sequence parallelism and the
                 split, by branch and bound over the simulator (pipegpt.schedule.simulate)

    from pipegpt.plan.cost import AnalyticalCosts
    from pipegpt.plan.devices import make_cluster
    from pipegpt.plan.search import Request, search
    cluster = make_cluster(8, 8, "h100")
    result = search(Request(MODEL_PRESETS["gpt2"], 512, cluster, AnalyticalCosts(cluster)))
    result.best[0].layout.command(result.best[0].model, "bf16")   # the `pipegpt run ...` that runs it
"""
