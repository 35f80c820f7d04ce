"""Does the calibrated planner order layouts as they measure? Predicted beside measured step time, and Spearman.

    .venv/bin/python benchmarks/bench_plan_order.py                # 8 layouts, 2 rounds (about 2.5 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_plan_order.py --rounds 4
    .venv/bin/python benchmarks/bench_plan_order.py --threads-per-worker 1   # pp 1 on one thread, a core to spare
    taskset -c 0,1 python3 benchmarks/bench_plan_order.py --rounds 3        # 2 cores of a larger machine

Made for two cores (the planner's cluster: 2 CPU ranks a node). On a larger machine run it under `taskset` on two:
every process inherits the affinity, and pipegpt's default threads follow it (pipegpt.engine.placement).
One small model (4 layers, 256 wide, sequence 128), a fixed global batch of 16 sequences, 8 layouts: pp 1 and 2,
gpipe / 1f1b / zb-h1, 4 and 8 microbatches. Each is a `pipegpt run` of --steps steps at pipegpt run's default
threads, the cores over the ranks (pp 1 on two threads, pp 2 on one each: every layout uses the whole machine).
Rounds alternate the order of the layouts; a layout's measured time is the median of its steps after the first of
each run. Each round's costs are calibrated from that round's pp 2, 1f1b, m 8 run (`pipegpt plan --calibrate`, over
every step of it after the first: the run traces them all) and predict that round's layouts: the machine's speed
drifts by a few percent from one round to the next, and each layout is held against costs measured beside it. The
block's timings behind the thread and microbatch-size terms are the machine's, not a round's: timed once for all
rounds, the least of two child processes.
measured / predicted is the median over rounds of each round's ratio. The planner's own evaluate_layout predicts.
Measure on a quiet machine: this was a slow test once, and a busy CI machine's 16% between two layouts that cost
the same (gpipe and 1f1b at m 8) broke its rank order.
The calibrated model scales pp 1's compute by a block timed at 2 threads over 1
(pipegpt.costs.calibrated.ThreadScaling) and by the block timed alone over in two processes at once (pp 1's rank
has the machine to itself, each of the calibration's two did not), and m 4's (4 sequences per microbatch against
the calibrated run's 2) by a block's time per sequence at 4 over at 2 (MicrobatchScaling); their figures are in the
costs' line printed. Both timings are taken once for all rounds.
`--threads-per-worker 1` runs every layout on one thread: pp 1 then leaves a core idle, and its one rank computes
alone (the ranks-at-once term; one rank alone once measured about 8% faster than each of two ranks at once here,
the last table's ratio).

Three predictions: "new", the planner's (the step's parts from its trace, pipegpt.observe.step_time: the
optimizer per parameter byte, the rest -- the driver's round trip, the batch, the clip, the sync's tail -- a time
per step; the host's time between computes once per F and B); "per token", the host's time left inside F and B
and scaled with them (tokens, layers, threads), as before it was a term of its own; "linear", new without the
microbatch-size term (compute linear in tokens, as before it). The calibrated step's breakdown is
printed first; last, per layout, the measured actions' span beside the planner's makespan and the time outside
them beside the planner's after-term, which says which of the two a difference comes from, and one microbatch's
compute over all stages: pp 1 m 8's over pp 2 m 8's says whether a rank computes faster alone.
The machine's speed last: one thread's matmul probe (MachineSpeed) just before and after every run, its range over
the benchmark and per layout, beside the range of each layout's measured / predicted over rounds. A shared VM's
speed here moves by up to 2.3x between runs seconds apart. The probe says how far a figure can be trusted and
corrects nothing: dividing each run's step by its probes made the rounds' ranges wider, not narrower (the speed
changes within runs, and a one-thread matmul is not a 2-rank step), and each layout's fastest run over the
fastest calibration round's prediction spread 0.76-1.05.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FLAGS = ["--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--seq-len", "128"]
BATCH = 16
LAYOUTS = [(1, "1f1b", 4), (1, "1f1b", 8), (2, "gpipe", 4), (2, "1f1b", 4), (2, "zb-h1", 4),
           (2, "gpipe", 8), (2, "1f1b", 8), (2, "zb-h1", 8)]
CALIBRATION = (2, "1f1b", 8)  # the layout each round's costs are calibrated from
PROBE_MATMULS, PROBE_REPEATS = 12, 5  # one probe: the median of 5 timings of 12 matmuls (about 0.3 s here)


def calibration_run(k: int) -> str:
    pp, s, m = CALIBRATION
    return f"{pp}-{s}-{m}-{k}"


def ranks(values) -> list[float]:
    """Ranks from 0, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for t in range(i, j + 1):
            out[order[t]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a, b) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def measure(run_dir: Path, pp: int, schedule: str, m: int, steps: int, threads: str = "1",
            traced: bool = False) -> list[float]:
    given = [] if threads == "default" else ["--threads-per-worker", threads]
    given += ["--trace-steps", "all"] if traced else []  # the calibration run: every step's trace
    # on CPU, whatever GPUs the machine has (under "auto" pp 1 would take a lone GPU and pp 2 the cores)
    subprocess.run([sys.executable, "-m", "pipegpt", "run", *FLAGS, "--device", "cpu", "--stages", str(pp),
                    "--schedule", schedule,
                    "--microbatches", str(m), "--microbatch-size", str(BATCH // m), "--steps", str(steps),
                    *given, "--run-dir", str(run_dir), "--log-every", "100"],
                   check=True, capture_output=True, cwd=ROOT, timeout=600)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows[1:]]  # step 1 warms up


class MachineSpeed:
    """One thread's seconds for a fixed matmul (256 x 1024 by 1024 x 1024, PROBE_MATMULS of them, the median of
    PROBE_REPEATS), timed in this process just before and just after each run: how fast the machine was. A 2-core
    VM's speed here moves in steps that hold for seconds (one thread's matmul timed every 55 ms for 40 s, nothing
    else running: 70, then 55, then 45 ms; autocorrelation 0.77 at 1.8 s)."""

    def __init__(self):
        import torch

        torch.set_num_threads(1)
        generator = torch.Generator().manual_seed(0)
        self.a, self.b = (torch.randn(*shape, generator=generator) for shape in ((256, 1024), (1024, 1024)))

    def __call__(self) -> float:
        times = []
        for _ in range(PROBE_REPEATS):
            start = time.perf_counter()
            for _ in range(PROBE_MATMULS):
                self.a @ self.b
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def round_block_timer(config: dict, passes: int = 2):
    """calibrate_costs' block timer for every round: each request (the settings one term compares) timed once, in
    `passes` child processes (pipegpt.stages.block_timing), and kept: its first setting's least over the children,
    each other's that times the median over the children of its ratio to the first within one. A burst of load
    during one child's seconds then moves no round's thread or microbatch term. A request's settings are timed
    together even where an earlier request had one of them: a ratio of two children's timings holds the machine's
    drift between them (a term read x0.73 that way where one child's read x0.95-1.01)."""
    from pipegpt.costs.calibrated import block_timer

    measure = block_timer(config)  # the calibration run's config.json: its model, dtype and recomputation
    kept: dict = {}

    def timed(settings):
        settings = tuple(settings)
        if settings not in kept:
            runs = [measure(settings) for _ in range(passes)]
            first = settings[0]
            least = min(r[first] for r in runs)
            kept[settings] = {x: least * statistics.median(r[x] / r[first] for r in runs) for x in settings}
        return dict(kept[settings])

    return timed


def round_sharing_timer(config: dict):
    """calibrate_costs' timer of the block alone and in ranks at once, for every round: each (threads, size, k)
    timed once (its child alternates the two, rounds of each) and kept."""
    from pipegpt.costs.calibrated import shared_block_timer

    measure, kept = shared_block_timer(config), {}

    def timed(threads, size, at_once):
        if (threads, size, at_once) not in kept:
            kept[threads, size, at_once] = measure(threads, size, at_once)
        return kept[threads, size, at_once]

    return timed


def microbatch_compute(run_dir: Path) -> float:
    """One microbatch's forward and backward over all stages of a run (each stage's median F and B from its trace,
    pipegpt.schedule.calibrate): pp 1's one stage against pp 2's two is the same work, so their ratio is how much
    faster a rank computes in the one layout than in the other."""
    from pipegpt.run_files import read_measured_run
    from pipegpt.schedule.calibrate import calibrate_run
    from pipegpt.schedule.schedule_file import load_schedule_file

    files = read_measured_run(str(run_dir))
    costs = calibrate_run(load_schedule_file(files.plan_path), files)[1].costs
    return sum(costs.forward) + sum(costs.backward)


def main(argv=None) -> int:
    from pipegpt.config import ModelConfig
    from pipegpt.costs.calibrated import calibrate_costs
    from pipegpt.costs.devices import make_cluster
    from pipegpt.planner.candidates import Layout, Request
    from pipegpt.planner.search import evaluate_layout
    from pipegpt.observe.step_time import breakdown_text
    from pipegpt.schedule.calibrate import breakdown

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first left out) [6]")
    ap.add_argument("--threads-per-worker", default="default",
                    help="each worker's intra-op threads, or 'default' (cores / ranks, as pipegpt run's default)")
    args = ap.parse_args(argv)
    model = ModelConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, n_embd=256)
    measured = {x: [] for x in LAYOUTS}  # each round's run: the median of its steps after the first
    traced = {x: [] for x in LAYOUTS}  # each run's last step in parts (pipegpt.observe.step_time)
    computed = {x: [] for x in LAYOUTS}  # each run's one microbatch over all stages
    cluster = make_cluster(2, 2, gpu_memory="64GiB", gpu_tflops=1.0, intra_node="80", precision="fp32")
    calibrated = []  # per round: the costs calibrated from that round's pp 2, 1f1b, m 8 run
    per_token = []  # the same with the host's time per compute inside F and B (host_per_action=False)
    timer = sharing = None  # the block's timings are the machine's: one set for every round
    speed, probed = MachineSpeed(), {x: [] for x in LAYOUTS}  # each round's run: its probes before and after
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for pp, s, m in (LAYOUTS if k % 2 == 0 else LAYOUTS[::-1]):
                run_dir = Path(tmp) / f"{pp}-{s}-{m}-{k}"
                before = speed()
                steps = measure(run_dir, pp, s, m, args.steps, args.threads_per_worker,
                                traced=(pp, s, m) == CALIBRATION)
                probed[(pp, s, m)].append((before, speed()))
                measured[(pp, s, m)].append(statistics.median(steps))
                traced[(pp, s, m)].append(breakdown(json.loads((run_dir / "trace.json").read_text())))
                computed[(pp, s, m)].append(microbatch_compute(run_dir))
            run_dir = Path(tmp) / calibration_run(k)
            config = json.loads((run_dir / "config.json").read_text())
            timer, sharing = timer or round_block_timer(config), sharing or round_sharing_timer(config)
            calibrated.append(calibrate_costs(str(run_dir), cluster, timer, sharing))
            per_token.append(calibrate_costs(str(run_dir), cluster, timer, sharing, host_per_action=False))
        parts = breakdown(json.loads((Path(tmp) / calibration_run(0) / "trace.json").read_text()))

    def variants(costs, host_inside):
        linear = copy.copy(costs)  # without the microbatch-size term
        linear.microbatch = None
        return costs, host_inside, linear

    def predict(c):
        return [evaluate_layout(Request(model, BATCH, cluster, c), Layout(1, pp, 1, s, 1, m, BATCH // m))
                for pp, s, m in LAYOUTS]

    # per round: every layout predicted from that round's calibration (the machine's speed drifts by a few
    # percent between rounds, and a layout is measured against the costs measured beside it)
    per_round = [[predict(c) for c in variants(*costs)] for costs in zip(calibrated, per_token)]
    rounds = [[[measured[x][k] / per_round[k][v][i].step_time for k in range(args.rounds)]
               for i, x in enumerate(LAYOUTS)] for v in range(3)]  # each round's ratio, per variant and layout
    ratio = [[statistics.median(layout) for layout in variant] for variant in rounds]
    predicted, predicted_per_token, predicted_linear = ([statistics.median(r[v][i].step_time for r in per_round)
                                                   for i in range(len(LAYOUTS))] for v in range(3))
    observed = [statistics.median(measured[x]) for x in LAYOUTS]
    if parts is not None:
        print("the first calibrated run's last step:\n" + breakdown_text(parts) + "\n")
    for costs in calibrated:
        print(costs.describe())
    print("\npredicted: the median over rounds, each round's from its own calibration; measured / predicted: the "
          "median over rounds of each round's ratio")
    print(f"{'layout':16} {'predicted ms':>12} {'(per token)':>11} {'(linear)':>8} {'measured ms':>11} "
          f"{'measured/predicted':>18} {'(per token)':>11} {'(linear)':>8}")
    for i, ((pp, s, m), p, q, n, o) in enumerate(zip(LAYOUTS, predicted, predicted_per_token, predicted_linear,
                                                      observed)):
        print(f"{f'pp{pp} {s} m{m}':16} {p * 1e3:12.1f} {q * 1e3:11.1f} {n * 1e3:8.1f} {o * 1e3:11.1f} "
              f"{ratio[0][i]:18.2f} {ratio[1][i]:11.2f} {ratio[2][i]:8.2f}")
    print(f"Spearman (predicted, measured): {spearman(predicted, observed):.3f} "
          f"(per token {spearman(predicted_per_token, observed):.3f}, "
          f"linear {spearman(predicted_linear, observed):.3f})")
    print("\nwhere the difference lies (measured: the median over rounds of each run's last step):")
    print(f"{'layout':16} {'actions ms':>10} {'makespan ms':>11} {'outside ms':>10} {'after ms':>8} "
          f"{'microbatch ms':>13}")
    for i, (pp, s, m) in enumerate(LAYOUTS):
        makespan, after = (statistics.median(getattr(r[0][i], a) for r in per_round) for a in ("makespan", "after"))
        parts_of = [b for b in traced[(pp, s, m)] if b is not None]
        actions = statistics.median(b.part("actions") for b in parts_of) if parts_of else float("nan")
        outside = statistics.median(b.total - b.part("actions") for b in parts_of) if parts_of else float("nan")
        print(f"{f'pp{pp} {s} m{m}':16} {actions * 1e3:10.1f} {makespan * 1e3:11.1f} {outside * 1e3:10.1f} "
              f"{after * 1e3:8.1f} {statistics.median(computed[(pp, s, m)]) * 1e3:13.2f}")
    alone, together = (statistics.median(computed[(pp, "1f1b", 8)]) for pp in (1, 2))
    print(f"microbatch ms: F + B of every stage, the median over rounds; pp 1 1f1b m8 over pp 2 1f1b m8 (the same "
          f"microbatch, one rank against two): {alone / together:.3f}")
    print_machine_speed(probed, rounds[0])
    return 0


def print_machine_speed(probed, rounds) -> None:
    """How far the machine's speed moved over the benchmark, and each layout's measured / predicted per round:
    their range says what the medians above can be held to."""
    probes = [t for runs in probed.values() for pair in runs for t in pair]
    moved = sum(abs(a - b) / min(a, b) > 0.05 for runs in probed.values() for a, b in runs)
    print(f"\nthe machine's speed (MachineSpeed: one thread's {PROBE_MATMULS} matmuls, before and after each run): "
          f"{min(probes) * 1e3:.1f}-{max(probes) * 1e3:.1f} ms over the benchmark; before and after one run "
          f"differed by over 5% in {moved} of {len(probes) // 2} runs")
    print(f"{'layout':16} {'probe ms (min-max)':>18} {'measured/predicted (min-max over rounds)':>41}")
    for (pp, s, m), ratios in zip(LAYOUTS, rounds):
        times = [t * 1e3 for pair in probed[pp, s, m] for t in pair]
        print(f"{f'pp{pp} {s} m{m}':16} {f'{min(times):.1f}-{max(times):.1f}':>18} "
              f"{f'{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})':>41}")


if __name__ == "__main__":
    sys.exit(main())
