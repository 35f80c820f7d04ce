"""Planning a run before it starts: how to lay the model out (cost-balanced stages, timing, memory, search).

Pure Python (no torch): `pipegpt plan` answers in seconds on a laptop.

    devices.py      GPU presets (datasheet peak and memory, DGX/HGX links) and the Cluster the planner reads
    cost.py         per-layer F/B/I/W, collectives, messages and the optimizer step: analytical (FLOPs at an
                    efficiency, bytes over bandwidths) or calibrated from a run's trace
    memory.py       weights, gradients, optimizer state, activations and buffers of every rank
    balance.py      the contiguous layer split that makes the busiest rank's work the least
    candidates.py   the request, the layouts and candidates searched, a plan with its predictions, a refusal
    structure.py    a schedule's plan, placement and activation peaks, built once per (schedule, p, m, v)
    stage_costs.py  a candidate's per-stage times, bytes and parameters, composed from the per-layer costs
    bounds.py       the lower bounds that prune the search (a layout's, a candidate's makespan)
    search.py       dp x pp x tp, schedule, microbatching, recomputation, ZeRO-1, sequence parallelism and the
                    split, by branch and bound over the simulator (pipegpt.schedule.simulate)
    report.py       what `pipegpt plan` prints: the text report, the JSON object, the line when nothing fits
    command.py      `pipegpt plan`'s work: options in, the search, its answer printed
    trial.py        `pipegpt plan --try`: the top plans run here and measured beside predicted

    from pipegpt.plan.candidates import Request
    from pipegpt.costs.cost import AnalyticalCosts
    from pipegpt.costs.devices import make_cluster
    from pipegpt.plan.search import search
    cluster = make_cluster(8, 8, "h100")
    result = search(Request(MODEL_PRESETS["gpt2"], 512, cluster, AnalyticalCosts(cluster)))
    result.best[0].layout.command(result.best[0].model, "bf16")   # the `pipegpt run ...` that runs it
"""
