"""The docs' tables of `pipegpt plan` answers, made by `pipegpt plan` itself, so they cannot go stale.

A table in a Markdown page sits between two comments that hold the command's options:

    <!-- plan-table: --model llama3-8b --gpus 8 --device h100 --batch-tokens 131072 -->
    | # | layout | ... |
    <!-- end plan-table -->

    python scripts/plan_tables.py docs/llama-plan.md            # names the tables that differ (exit 1)
    python scripts/plan_tables.py docs/llama-plan.md --write    # writes them

The options are parsed by the real `pipegpt plan` command; the numbers are its --json answer.
"""
from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass

GiB = 2**30
BLOCK = re.compile(r"<!-- plan-table: (?P<args>[^>]*?) -->\n(?P<table>.*?)<!-- end plan-table -->", re.S)
SHORT = {"weights": "w", "gradients": "g", "optimizer": "opt", "activations": "act", "workspace": "ws",
         "communication": "comm"}


@dataclass(frozen=True)
class Block:
    """One table in a page: the plan options it answers, where it stands, what it holds now."""

    args: str
    start: int
    end: int
    table: str


def blocks(text: str) -> list[Block]:
    return [Block(m["args"], m.start("table"), m.end("table"), m["table"]) for m in BLOCK.finditer(text)]


def plan_answer(args: str) -> dict:
    """`pipegpt plan ARGS --json`'s answer, the options parsed by the command itself."""
    from pipegpt import command_options
    from pipegpt.cli import plan
    from pipegpt.planner.command import PlanOptions, plan_command

    with plan.make_context("plan", shlex.split(args) + ["--json"]) as ctx:
        options = dict(ctx.params)
    model = command_options.model_from_options(options)
    settings = {k: v for k, v in options.items() if k not in command_options.MODEL_OPTIONS}
    return json.loads(plan_command(model, PlanOptions(**settings)))


def table(answer: dict) -> str:
    """The Markdown table of an answer's plans (the first with its memory by part), and a line naming the ties."""
    from pipegpt.planner.report import TIE

    rows = ["| # | layout | schedule | m x mbs | rc | ZeRO | step | tokens/s per GPU | MFU | bubble | peak memory |",
            "|---|---|---|---|---|---|---:|---:|---:|---:|---|"]
    plans = answer["plans"]
    for i, p in enumerate(plans, 1):
        peak = f"{p['peak_memory_bytes'] / GiB:.1f} GiB"
        if i == 1:
            parts = p["memory_per_rank"][p["peak_memory_rank"]]
            peak += ": " + " + ".join(f"{SHORT[k]} {parts[k] / GiB:.1f}" for k in SHORT if parts.get(k, 0) >= 0.05 * GiB)
        schedule = p["schedule"] + (f" v{p['virtual_stages']}" if p["schedule"] == "interleaved-1f1b" else "")
        zero = f"{p['zero']} ({p['unshard']})" if p.get("unshard") else str(p["zero"])
        per_gpu, mfu = p["tokens_per_s"] / p["gpus"], p["mfu"]
        rows.append(f"| {i} | {_layout(p)} | {schedule} | {p['microbatches']} x {p['microbatch_size']} | "
                    f"{p['recompute']} | {zero} | {_seconds(p['step_time_s'])} | "
                    f"{f'{per_gpu:,.0f}' if per_gpu >= 100 else f'{per_gpu:.1f}'} | "
                    f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | "
                    f"{100 * p['bubble_fraction']:.1f}% | {peak} |")
    fastest = min(p["step_time_s"] for p in plans)
    tied = sum(1 for p in plans if p["step_time_s"] <= fastest * (1 + TIE))
    note = (f"\n#1-#{tied} are within {100 * TIE:.0f}% of the fastest, a tie: ranked by simplicity, then memory.\n"
            if tied > 1 else "")
    return "\n".join(rows) + "\n" + note


def _layout(p: dict) -> str:
    from pipegpt.dims import AXES, ParallelDims

    dims = ParallelDims(**{axis: p.get(axis, 1) for axis in AXES})
    return dims.label({"cp": p.get("cp_comm")}) + (" sp" if p["sequence_parallel"] else "")


def _seconds(x: float) -> str:
    """3 significant figures, as the tables have them: 2.10 s, 85.0 s, 255 s, 136 ms."""
    if x < 1:
        return f"{x * 1e3:.3g} ms"
    return f"{x:.3g} s" if x >= 100 else f"{x:#.3g} s"


def regenerate(text: str) -> str:
    """The page with every plan table made anew."""
    out, at = [], 0
    for b in blocks(text):
        out += [text[at:b.start], table(plan_answer(b.args))]
        at = b.end
    return "".join(out) + text[at:]


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    path, write = argv[0], "--write" in argv[1:]
    with open(path) as f:
        text = f.read()
    made = regenerate(text)
    if write:
        with open(path, "w") as f:
            f.write(made)
        print(f"wrote {len(blocks(text))} plan tables in {path}")
        return 0
    stale = [b.args for b, new in zip(blocks(text), blocks(made)) if b.table != new.table]
    for args in stale:
        print(f"stale: pipegpt plan {args}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
