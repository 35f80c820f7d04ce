"""An MoE model with expert parallelism on CPU: its pairs overlapped (--overlap on) against the same schedule
without pairs (--overlap off), measured beside the simulator's prediction of both: a row per layout and link.

    .venv/bin/python benchmarks/bench_overlap.py          # dualpipev, dp 2 x ep 2 x pp 2 (4 ranks), plain loopback
    .venv/bin/python benchmarks/bench_overlap.py --schedule 1f1b-overlap,dualpipev --stages 1,2 --link-rate none,600mbit
    (2 and 4 ranks, each on the plain loopback and on an emulated 600 Mbit/s link)

Each round runs, per layout (a schedule with its --stages) and link, `pipegpt run --model tiny-moe --stages S
--dp D --ep E` (one thread per rank) with --overlap on and off, which goes first alternating; a cell is the
median of every step but each run's first; "per round" is the median over rounds of a round's on / off, the two
run next to each other. The all-to-all's share of an unpaired step is read from the off runs' traces (the last
step's measured timeline): per rank, the time its exchanges took (posted to waited for, which off does at once)
over its actions' span, the mean over ranks. (A run with --ep 1 was the baseline before; under load it measured
slower than ep 2, which a quiet machine does not repeat: 392 against 649 ms a step at pp 1, --overlap off.)

The link: on CPU gloo's all-to-all is memory copies and socket calls, CPU work that the other half of a pair
cannot hide on a busy core; on GPUs it runs on the NIC and copy engines while the cores compute. --link-rate
(a tc rate such as 400mbit) and --link-delay-ms emulate such a link: each run goes into a network namespace of its
own (`unshare --net`, needs root) whose loopback, and only that, gets a tc qdisc (tbf for the rate, netem for the
delay), so the exchanges take wall time the processes spend waiting, not computing. Every process of a run
(all its ranks' messages: the all-to-alls, the pipeline's sends, the gradients' all-reduce) shares that one link.
The rest of the machine is untouched: nothing is added to the root namespace. Without unshare, tc or ip, or
with a kernel that lacks the qdisc, the bench refuses before running anything.

The simulator: costs F=1,B=2,W=1 per rank (a microbatch's F + B = 3; W is B's weight part) with a2a, the
all-to-all of one forward (a backward makes as many), fitted so that the simulated unpaired step over the
simulated one without exchanges is 1 / (1 - share); it then predicts on / off. Its seconds are scaled so that off's
prediction is off's measurement. The load average (the machine's, 1 minute) is printed per row: other processes
on the cores take from the ranks' compute, which the simulator does not model.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a plain script from a checkout: this checkout's pipegpt
    sys.path.insert(0, str(ROOT))
from pipegpt.schedule.registry import build_plan  # noqa: E402
from pipegpt.schedule.simulate import costs_for_plan, simulate_matching  # noqa: E402

PIPEGPT = [sys.executable, "-m", "pipegpt"]
COSTS = "F=1,B=2,W=1"  # a microbatch's compute is F + B = 3 (W is B's weight-gradient part)
# tbf's bucket must hold the loopback's largest packet (its MTU is 64 KiB) or such packets never leave; its queue
# is long enough that nothing is dropped (a drop would time TCP's retransmission, not the link).
TBF_BURST, TBF_LIMIT = "256kb", "64mb"


def link_prefix(rate: str | None, delay_ms: float | None) -> list[str]:
    """The command prefix that runs a command in a network namespace of its own whose loopback has the link:
    a tbf qdisc of `rate` (tc's units: 400mbit, 1gbit), netem's `delay_ms` under it (or alone). [] for no link."""
    qdiscs = []
    if rate:
        qdiscs.append(f"tc qdisc add dev lo root handle 1: tbf rate {rate} burst {TBF_BURST} limit {TBF_LIMIT}")
    if delay_ms:
        parent = "parent 1:1 handle 10:" if rate else "root"
        qdiscs.append(f"tc qdisc add dev lo {parent} netem delay {delay_ms:g}ms limit 100000")
    if not qdiscs:
        return []
    script = " && ".join(["ip link set lo up", *qdiscs, 'exec "$@"'])
    return ["unshare", "--net", "--", "sh", "-c", script, "sh"]


def check_link(prefix: list[str]) -> None:
    """Refuse (SystemExit, saying why) where the namespace or the qdisc cannot be made; runs `true` under it."""
    if not prefix:
        return
    missing = [tool for tool in ("unshare", "ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"--link-rate/--link-delay-ms need {', '.join(missing)} (util-linux, iproute2): not found")
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        why = " ".join(probe.stderr.split()).rstrip(".") or f"exit status {probe.returncode}"
        hint = " (this kernel has no netem: use --link-rate alone)" if "netem" in prefix[5] and \
            "unknown" in why.lower() else ""
        raise SystemExit(f"cannot emulate the link: `{prefix[5]}` in a new network namespace failed: {why}{hint}. "
                         f"It needs root (unshare --net) and tc's qdiscs; nothing was run.")


def step_times(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r["step_time_s"]) for r in rows if "step_time_s" in r][1:]  # the first step: warm-up


def exchange_share(run_dir: Path) -> float:
    """The share of the traced step that ranks spent in expert all-to-alls: per rank the union of its exchanges'
    spans over its actions' span, the mean over ranks."""
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    shares = []
    for rank in sorted({e["pid"] for e in events if e.get("ph") == "X"}):
        actions = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("pid") == rank and e.get("ph") == "X"]
        spans, opened = [], {}
        for e in sorted((e for e in events if e.get("pid") == rank and e.get("cat") == "expert all-to-all"),
                        key=lambda e: e["ts"]):
            if e["ph"] == "B":
                opened[e["tid"]] = e["ts"]
            elif e["ph"] == "E" and e["tid"] in opened:
                spans.append((opened.pop(e["tid"]), e["ts"]))
        covered, end = 0.0, float("-inf")
        for start, stop in sorted(spans):  # the union: exchanges on two lanes at once count once
            covered += max(0.0, stop - max(start, end))
            end = max(end, stop)
        span = max(b for _, b in actions) - min(a for a, _ in actions)
        shares.append(covered / span if span > 0 else 0.0)
    return statistics.mean(shares) if shares else 0.0


def run(args, schedule: str, stages: int, prefix: list[str], run_dir: Path, *extra: str) -> tuple[list, float]:
    """One `pipegpt run` (under the link's prefix): its timed steps and its traced step's exchange share."""
    cmd = [*prefix, *PIPEGPT, "run", "--model", "tiny-moe", "--stages", str(stages), "--dp", str(args.dp),
           "--schedule", schedule, "--microbatches", str(args.microbatches),
           "--microbatch-size", str(args.microbatch_size), "--steps", str(args.steps + 1), "--device", "cpu",
           "--threads-per-worker", "1", "--seed", "1", "--run-dir", str(run_dir), "--overwrite",
           *shlex.split(args.run_args), *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=1800)
    return step_times(run_dir), exchange_share(run_dir)


def simulated(schedule: str, stages: int, microbatches: int, a2a: float, overlap: str) -> float:
    """The simulator's makespan (units of a rank's F) of the schedule with all-to-all a2a per forward."""
    plan = build_plan(schedule, stages, microbatches)
    if overlap == "off":
        plan = plan.flattened()
    return float(simulate_matching(plan, costs_for_plan(f"{COSTS},a2a={a2a!r}", plan)).makespan)


def fit_a2a(schedule: str, stages: int, microbatches: int, slowdown: float) -> float:
    """The a2a at which the simulated unpaired step is `slowdown` times the one without exchanges (bisection:
    the makespan grows with a2a)."""
    plain = simulated(schedule, stages, microbatches, 0.0, "off")
    if slowdown <= 1:
        return 0.0
    low, high = 0.0, 1.0
    while simulated(schedule, stages, microbatches, high, "off") < slowdown * plain:
        low, high = high, 2 * high
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if simulated(schedule, stages, microbatches, mid, "off") < slowdown * plain \
            else (low, mid)
    return (low + high) / 2


def links(args) -> list[tuple[str, list[str]]]:
    """(label, command prefix) per link the rows measure: every --link-rate with every --link-delay-ms."""
    rates = [None if r in ("none", "0", "") else r for r in args.link_rate.split(",")]
    delays = [float(d) for d in args.link_delay_ms.split(",")]
    out = []
    for rate in rates:
        for delay in delays:
            label = " + ".join([*([rate] if rate else []), *([f"{delay:g} ms"] if delay else [])]) or "none"
            out.append((label, link_prefix(rate, delay)))
    return out


def layouts(args) -> list[tuple[str, int]]:
    """(schedule, pipeline ranks) per layout: --schedule and --stages, comma lists paired in order (one of
    either goes with every entry of the other)."""
    schedules, stages = args.schedule.split(","), [int(p) for p in str(args.stages).split(",")]
    if len(schedules) != len(stages) and 1 not in (len(schedules), len(stages)):
        raise SystemExit(f"--schedule has {len(schedules)} entries and --stages {len(stages)}: pair them")
    n = max(len(schedules), len(stages))
    return list(zip(schedules * (n // len(schedules)), stages * (n // len(stages))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="dualpipev", help="a schedule, or a comma list paired with --stages'")
    ap.add_argument("--stages", default="2", help="pipeline ranks (pp), or a comma list paired with --schedule's")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (one more is run and left out)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--link-rate", default="none",
                    help="comma list of links' rates in tc's units (400mbit, 1gbit), none for the plain loopback")
    ap.add_argument("--link-delay-ms", default="0", help="comma list of one-way delays added by netem (0: none)")
    ap.add_argument("--run-args", default="", help="more `pipegpt run` options for every run, e.g. '--seq-len 256'")
    args = ap.parse_args(argv)
    setups = links(args)
    for _, prefix in setups:
        check_link(prefix)
    rows = [(schedule, stages, label, prefix) for schedule, stages in layouts(args) for label, prefix in setups]
    runs = {(row[:3], k): [] for row in rows for k in ("on", "off")}  # per round: its steps' times
    shares = {row[:3]: [] for row in rows}  # per off run
    loads = {row[:3]: [] for row in rows}
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        for k in range(args.rounds):
            for schedule, stages, label, prefix in rows:
                key = (schedule, stages, label)
                loads[key].append(os.getloadavg()[0])
                for overlap in (("on", "off") if k % 2 == 0 else ("off", "on")):
                    steps, share = run(args, schedule, stages, prefix, Path(tmp) / f"{overlap}-{k}", "--ep",
                                       str(args.ep), "--overlap", overlap)
                    runs[key, overlap].append(steps)
                    if overlap == "off":
                        shares[key].append(share)
                loads[key].append(os.getloadavg()[0])
    print(f"tiny-moe on CPU, dp {args.dp} x ep {args.ep} x pp (ranks: dp x pp, gloo, a thread each; {os.cpu_count()} "
          f"cores); m {args.microbatches} x {args.microbatch_size} sequences; {args.rounds} rounds x {args.steps} "
          f"steps, on/off alternated; ms are medians; load: the 1-minute load average during the row's runs")
    print()
    print("| schedule | pp | link | load | a2a share | a2a fit | off ms | on ms | on / off | per round | "
          "predicted off | predicted on | predicted on / off |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for schedule, stages, label, _ in rows:
        key = (schedule, stages, label)
        on, off = (statistics.median(t for steps in runs[key, k] for t in steps) for k in ("on", "off"))
        share = statistics.median(shares[key])
        # each round's on over its off, run next to each other: steadier than the medians where the load drifts
        per_round = statistics.median(statistics.median(a) / statistics.median(b)
                                      for a, b in zip(runs[key, "on"], runs[key, "off"]))
        a2a = fit_a2a(schedule, stages, args.microbatches, 1 / (1 - min(share, 0.99)))
        sim_on, sim_off = (simulated(schedule, stages, args.microbatches, a2a, o) for o in ("on", "off"))
        scale = off / sim_off
        print(f"| {schedule} | {stages} | {label} | {statistics.mean(loads[key]):.1f} | {share:.1%} | {a2a:.3f} | "
              f"{off * 1e3:.0f} | {on * 1e3:.0f} | {on / off:.3f} | {per_round:.3f} | {sim_off * scale * 1e3:.0f} | "
              f"{sim_on * scale * 1e3:.0f} | {sim_on / sim_off:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
