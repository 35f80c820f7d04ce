"""Planning a run before it starts: which layout for a model and a cluster (axes, schedule, microbatches,
recomputation, ZeRO, the layer split), from the costs pipegpt.costs composes.

Pure Python (no torch): `pipegpt plan` answers in seconds on a laptop.

    candidates.py   the request, the layouts and candidates searched, a plan with its predictions, a refusal
    structure.py    a schedule's plan, placement and activation peaks, built once per (schedule, p, m, v)
    bounds.py       the lower bounds that prune the search (a layout's, a candidate's makespan)
    search.py       the axes of pipegpt.dims (dp x pp x cp x tp), schedule, microbatching, recomputation, ZeRO
                    0-3, sequence parallelism and the split, by branch and bound over the simulator
                    (pipegpt.schedule.simulate)
    report.py       what `pipegpt plan` prints: ties ranked (within 1%: simplest first), the text report, the JSON
                    object, the line when nothing fits
    command.py      `pipegpt plan`'s work: options in, the search, its answer printed
    trial.py        `pipegpt plan --try`: the top plans run here and measured beside predicted
    auto.py         `pipegpt run --layout auto`: the search's best layout for the ranks a run finds
    run_plan.py     a run's plan from its config (schedule, lowering costs, the evaluation plan)

    from pipegpt.config import MODEL_PRESETS
    from pipegpt.planner.candidates import Request
    from pipegpt.costs.cost import AnalyticalCosts
    from pipegpt.costs.devices import make_cluster
    from pipegpt.planner.search import search
    cluster = make_cluster(8, 8, "h100")
    result = search(Request(MODEL_PRESETS["gpt2"], 512, cluster, AnalyticalCosts(cluster)))
    result.best[0].layout.command(result.best[0].model, "bf16")   # the `pipegpt run ...` that runs it
"""
