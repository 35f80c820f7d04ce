"""The composition fuzzer's campaign: draw cases seed after seed, run each against one process, report a table.

    .venv/bin/python tests/fuzz/campaign.py --minutes 60            # seeds 0, 1, 2, ... for an hour
    .venv/bin/python tests/fuzz/campaign.py --seed 1234             # rerun one seed (a finding's)
    .venv/bin/python tests/fuzz/campaign.py --minutes 60 --json campaign.jsonl

Each case prints one line: its seed, what it drew and the outcome; a failure prints the first lines of its error.
The last lines count cases, outcomes and the layouts, schedules and options covered. Exit 1 when a case failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from layouts import RANDOM_FILE, draw, layout_name  # noqa: E402
from run_case import Hosts, run_case  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, help="run this one seed")
    parser.add_argument("--start", type=int, default=0, help="the first seed of a campaign")
    parser.add_argument("--cases", type=int, default=0, help="stop after this many cases (0: no limit)")
    parser.add_argument("--minutes", type=float, default=5.0, help="stop starting cases after this long")
    parser.add_argument("--json", help="append one JSON line per case to this file")
    args = parser.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else range(args.start, sys.maxsize)
    deadline = time.monotonic() + args.minutes * 60
    hosts, outcomes, covered, failures = Hosts(), Counter(), Counter(), []
    try:
        for n, seed in enumerate(seeds):
            if args.seed is None and (time.monotonic() > deadline or (args.cases and n >= args.cases)):
                break
            case = draw(seed)
            started = time.monotonic()
            try:
                run_case(case, hosts)
                outcome, detail = "ok", ""
            except Exception as e:  # noqa: BLE001 - every finding is reported, the campaign goes on
                outcome, detail = "FAIL", "".join(traceback.format_exception_only(type(e), e)).strip()
                failures.append((seed, case.describe(), detail))
                hosts.close()  # a failed case may leave its workers in any state
            took = time.monotonic() - started
            outcomes[outcome] += 1
            _count(covered, case)
            print(f"{outcome:4} {took:5.1f}s  {case.describe()}" + (f"\n     {detail[:400]}" if detail else ""),
                  flush=True)
            if args.json:
                with open(args.json, "a") as fh:
                    fh.write(json.dumps({"seed": seed, "case": case.describe(), "outcome": outcome,
                                         "seconds": round(took, 2), "error": detail}) + "\n")
    finally:
        hosts.close()
    print(f"\n{sum(outcomes.values())} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    for what in ("layout", "schedule", "model", "option"):
        print(f"{what}s: " + ", ".join(f"{k} {v}" for k, v in sorted(covered.items()) if k.startswith(what + ":"))
              .replace(what + ":", ""))
    for seed, described, detail in failures:
        print(f"failed: {described}\n  {detail.splitlines()[0] if detail else ''}\n"
              f"  rerun: python tests/fuzz/campaign.py --seed {seed}")
    return 1 if failures else 0


def _count(covered: Counter, case) -> None:
    s = case.settings
    covered["layout:" + layout_name(s)] += 1
    covered["schedule:" + (RANDOM_FILE if case.schedule_text else s["schedule"])] += 1
    covered["model:" + case.model] += 1
    for key in ("sequence_parallel", "cp_comm", "zero", "unshard", "recompute"):
        if key in s:
            covered[f"option:{key}={s[key]}"] += 1
    if case.resume_settings is not None:
        covered["option:resume"] += 1


if __name__ == "__main__":
    sys.exit(main())
