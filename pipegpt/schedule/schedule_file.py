"""Schedule files: a plan written by hand (or by Plan.to_text) and read back.

One line per rank, in rank order, of action strings separated by spaces or
commas (so a CSV with a row per rank works too)::

    # name: my-1f1b
    # stages: 0 1 2 3          <- stage_to_rank: stage s lives on rank <s-th number>
    0F0 0F1 0F2 0F3 0B0 ...
    1F0 1F1 1F2 1B0 ...

Blank lines and `#` comments are ignored, except the optional `# stages:`
(or `# stage_to_rank:`), `# name:` and `# max_live:` headers (the memory limit: the most
stage-microbatches' activations a rank may hold at once, a pair holding both of its halves').
A pair of a forward and a backward of two microbatches run as one action is written
"0F5&3B2" (or "(0F5;3B2)"). Without `# stages:` each stage
lives on the rank whose line uses it, which is stage s on rank s for
1F1B-like files. The number of microbatches is the largest one used plus one.
Files may be compute-only or lowered (with SEND/RECV), with or without
collectives (1REDUCE_GRAD: a stage and no microbatch); either way the plan is
validated, so a dependency error names the rank, the step and the line.
"""
from __future__ import annotations

import os
import re

from .actions import Action, Plan, ScheduleError, flattened
from .validate import PlanError, check_max_live, validate

_HEADER_RE = re.compile(r"^#\s*(stages|stage_to_rank|name|max_live|max-live)\s*:\s*(.*)$", re.IGNORECASE)
_SPLIT_RE = re.compile(r"[\s,;]+")
_TOKEN_RE = re.compile(r"\([^()]*\)?|[^\s,;]+")  # a composite "(0F3;0B1)" is one token: its ";" splits nothing


def load_schedule_file(path) -> Plan:
    """Read and validate a schedule file; errors read "FILE:LINE: ..."."""
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ScheduleError(f"{name}: cannot read schedule file: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ScheduleError(f"{name}: not a text file") from None
    default_name = os.path.splitext(os.path.basename(name))[0]
    return parse_schedule_text(text, source=name, default_name=default_name)


def check_against_file(plan: Plan, source: str, stages: int | None, microbatches: int | None) -> None:
    """A schedule file fixes the ranks and microbatches: refuse a --stages or --microbatches (None: not
    given) that differs from the plan's. source names the file (or the run) in the message."""
    for flag, given, actual, what in (("--stages", stages, plan.num_ranks, "ranks"),
                                      ("--microbatches", microbatches, plan.num_microbatches, "microbatches")):
        if given is not None and given != actual:
            raise ScheduleError(f"{flag} {given} does not match {source}, which has {actual} {what}: "
                                f"leave {flag} out")


def parse_schedule_text(text: str, source: str = "<schedule>", default_name: str = "file") -> Plan:
    """Parse schedule-file text (see the module docstring); source names it in errors."""
    rows: list[list[Action]] = []
    row_lines: list[int] = []
    stage_to_rank: tuple[int, ...] | None = None
    plan_name = default_name
    max_live = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        header = _HEADER_RE.match(line)
        if header:
            key, value = header.group(1).lower(), header.group(2).split("#")[0].strip()
            if key == "name":
                plan_name = value or plan_name
                continue
            if key in ("max_live", "max-live"):
                if not value.isdigit() or int(value) < 1:
                    raise ScheduleError(f"{source}:{lineno}: bad '# max_live:' header {value!r} (expected the most "
                                        f"stage-microbatches a rank may hold, a whole number >= 1)")
                max_live = int(value)
                continue
            numbers = [t for t in _SPLIT_RE.split(value.strip("[]() ")) if t]
            if not numbers or not all(t.isdigit() for t in numbers):
                raise ScheduleError(f"{source}:{lineno}: bad '# {key}:' header {value!r} "
                                    f"(expected the rank of each stage, e.g. '# stages: 0 1 2 3 3 2 1 0')")
            stage_to_rank = tuple(int(t) for t in numbers)
            continue
        line = line.split("#", 1)[0]
        tokens = _TOKEN_RE.findall(line)
        if not tokens:
            continue
        actions = []
        for token in tokens:
            try:
                actions.append(Action.parse(token))
            except ScheduleError as e:
                if "&" in token or token.startswith("(") and token.endswith(")"):  # a pair: say what is wrong
                    raise ScheduleError(f"{source}:{lineno}: bad token {token!r}: {e}") from None
                raise ScheduleError(f"{source}:{lineno}: bad token {token!r} (expected <stage><kind><microbatch> "
                                    f"such as 2F0, 1B3, 0W5 or 1SEND_B3)") from None
        rows.append(actions)
        row_lines.append(lineno)
    if not rows:
        raise ScheduleError(f"{source}: no actions (expected one line of actions per rank)")

    if stage_to_rank is None:
        owner: dict[int, int] = {}
        for r, actions in enumerate(rows):
            for a in flattened(actions):
                owner.setdefault(a.stage, r)
        missing = [s for s in range(max(owner) + 1) if s not in owner]
        if missing:
            raise ScheduleError(f"{source}: stage {missing[0]} has no actions; stages must be numbered 0.."
                                f"{max(owner)} (or give '# stages: ...' with the rank of each stage)")
        stage_to_rank = tuple(owner[s] for s in range(len(owner)))
        for r, actions in enumerate(rows):
            other = next((a for a in flattened(actions) if owner[a.stage] != r), None)
            if other is not None:
                raise ScheduleError(f"{source}:{row_lines[r]}: {other} is on rank {r}, but stage {other.stage} is "
                                    f"already on rank {owner[other.stage]} (line {row_lines[owner[other.stage]]}); "
                                    f"a stage lives on one rank")
    elif max(stage_to_rank) + 1 != len(rows):
        raise ScheduleError(f"{source}: '# stages:' places stages on {max(stage_to_rank) + 1} ranks but the file "
                            f"has {len(rows)} rank lines")
    num_microbatches = 1 + max(a.microbatch for actions in rows for a in flattened(actions))
    plan = Plan(plan_name, num_microbatches, stage_to_rank, tuple(map(tuple, rows)), meta={"source": source})
    try:
        validate(plan)
        if max_live is not None:
            check_max_live(plan, max_live)
        return plan
    except PlanError as e:
        raise ScheduleError(f"{source}:{row_lines[e.rank]}: {e}") from None
    except ScheduleError as e:
        raise ScheduleError(f"{source}: {e}") from None


def dump_schedule_text(plan: Plan) -> str:
    """The schedule-file text of a plan, with name and stages headers (so V placements round-trip)."""
    stages = " ".join(map(str, plan.stage_to_rank))
    return f"# name: {plan.name}\n# stages: {stages}\n" + plan.to_text()
