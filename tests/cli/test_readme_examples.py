"""The README's examples run in order as written (a new user's first session).

Every command of the README's ```bash blocks is parsed by the real command line (click), every flag checked to
exist (the fast test). The slow test then runs, in the README's order, in one empty directory, every command a CPU
machine without internet can run, substituting only what must be:

  - steps a hundred times fewer: `--steps N`, `--save-every N` and `step-NNNNNNNN` divided by 100 (as the
    checkpoint examples, which also shrink the model: TINY); a `pipegpt run` that gives no --steps gets
    `--steps 2`, a `plan --try` gets `--try-steps 2`;
  - `runs/<time>` is the run directory the first `pipegpt run` made; `my_schedule.txt`, a schedule you wrote, is
    that run's plan.txt (a schedule file);
  - `...` in `pipegpt plan ... --calibrate` is the plan command before it.

Not run (parsed only), each for the reason in NOT_RUN: installing (pip) and the test suite itself, `--device
cuda`, torchrun on two nodes, and what needs a download (GPT-2's BPE for `--tokenizer gpt2`, a Hugging Face
model directory) or what those commands make (data/books, ckpt/gpt2, runs/ft)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from helpers import ROOT, run_pipegpt

TINY = ["--n-layer", "4", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--microbatches", "4",
        "--threads-per-worker", "1"]
CHECKPOINTS = "### Checkpoints: stop, resume, change the layout"

# why a command is not run on a CPU machine without internet: (a pattern in the command, the reason)
NOT_RUN = [
    (r"^(python3 -m venv|\.venv/bin/pip |\.venv/bin/python -m pytest)", "installs, or runs this test suite"),
    (r"--device cuda", "needs GPUs"),
    (r"^torchrun --nnodes 2", "needs two machines"),
    (r"--tokenizer gpt2", "needs GPT-2's BPE (tiktoken downloads it)"),
    (r"--from-hf gpt2/", "needs a Hugging Face GPT-2 directory (a download)"),
    (r"runs/ft|data/books", "needs what the commands above that were not run make"),
]


def readme_block(heading: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split(heading, 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines() if line.strip()]


def readme_commands() -> list[tuple[str, str]]:
    """(the heading above it, the command) for every command of every ```bash block, in order: comments cut,
    continued lines joined, `a && b` as two commands."""
    commands, heading = [], ""
    text = (ROOT / "README.md").read_text()
    for part in re.split(r"(^#+ [^\n]*$|```bash\n.*?```)", text, flags=re.M | re.S):
        if part.startswith("#"):
            heading = part
        elif part.startswith("```bash"):
            body = part[len("```bash\n"):-3].replace("\\\n", " ")
            for line in body.splitlines():
                line = line.split("#", 1)[0].strip()
                commands += [(heading, " ".join(c.split())) for c in line.split("&&") if c.strip()]
    return commands


def pipegpt_args(command: str, previous: list[str] | None = None) -> list[str] | None:
    """The arguments after `pipegpt` (the console script, .venv's, or torchrun's `-m pipegpt`); None for a command
    of another program. `...` among them stands for the previous command's arguments."""
    words = shlex.split(command)
    if words[0] in ("pipegpt", ".venv/bin/pipegpt"):
        args = words[1:]
    elif words[0] == "torchrun" and "pipegpt" in words:
        args = words[words.index("pipegpt") + 1:]
    else:
        return None
    if "..." in args:
        at = args.index("...")
        args = args[:at] + (previous or [])[1:] + args[at + 1:]
    return args


def scaled(command: str) -> list[str]:
    """The command's numbers of steps a hundred times smaller (step-00001400 -> step-00000014)."""
    words = shlex.split(command)
    assert words[0] == "pipegpt"
    return _scaled(words[1:])


def _scaled(args: list[str]) -> list[str]:
    out = []
    for prev, word in zip([""] + args, args):
        if prev in ("--steps", "--save-every"):
            word = str(int(word) // 100)
        word = re.sub(r"step-(\d{8})", lambda m: f"step-{int(m.group(1)) // 100:08d}", word)
        out.append(word)
    return out


def test_every_readme_command_parses_with_flags_that_exist(monkeypatch):
    """Each pipegpt command of the README, by the real click commands: a flag, choice or argument count that
    the command line would refuse fails here (paths need not exist)."""
    import click

    from pipegpt.cli import main

    monkeypatch.setattr(click.Path, "convert", lambda self, value, param, ctx: value)  # placeholders' paths
    commands = readme_commands()
    assert len(commands) > 25 and any(CHECKPOINTS in heading for heading, _ in commands)
    parsed, previous = 0, None
    for heading, command in commands:
        args = pipegpt_args(command, previous)
        if args is None:
            continue
        name, rest = args[0], args[1:]
        assert name in main.commands, command
        try:
            main.commands[name].make_context(name, list(rest))
        except click.ClickException as e:
            pytest.fail(f"README ({heading.strip()}): {command}\n{e.format_message()}")
        parsed, previous = parsed + 1, args
    assert parsed >= 25, parsed


def test_the_parse_check_can_fail():
    import click

    from pipegpt.cli import main

    with pytest.raises(click.NoSuchOption):
        main.commands["run"].make_context("run", ["--stages", "2", "--stage", "2"])
    with pytest.raises(click.BadParameter):
        main.commands["plan"].make_context("plan", ["--model", "tiny", "--gpus", "two"])
    with pytest.raises(click.UsageError):  # an argument too many
        main.commands["sample"].make_context("sample", ["runs/a", "runs/b"])


# 22 s: the slow set's run of every example covers these (the default suite keeps the parse check above, and
# tests/distributed/test_checkpoint.py the resume and --init-from they show).
@pytest.mark.slow
def test_the_checkpoint_examples_run_in_order(tmp_path):
    commands = readme_block(CHECKPOINTS)
    assert len(commands) == 3 and "--init-from" in commands[2], commands
    for command in commands:
        args = scaled(command)
        model = [] if "--resume" in args or "--init-from" in args else TINY
        proc = run_pipegpt(*args, *model, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
        assert "nothing to do" not in proc.stdout, f"{command}\n{proc.stdout}"


def runnable(args: list[str], heading: str, first_run: Path | None, cwd: Path) -> list[str]:
    """The substitutions the module's docstring lists."""
    args = _scaled(args)
    if args[0] == "run" and "--steps" not in args:
        args += ["--steps", "2"]
    if "--try" in args:
        args += ["--try-steps", "2"]
    if CHECKPOINTS in heading and "--resume" not in args and "--init-from" not in args:
        args += TINY
    if first_run is not None:
        args = [str(first_run) if a == "runs/<time>" else a for a in args]
        if "my_schedule.txt" in args and not (cwd / "my_schedule.txt").exists():
            (cwd / "my_schedule.txt").write_text((first_run / "plan.txt").read_text())
    return args


@pytest.mark.slow
def test_every_readme_example_that_a_cpu_can_run_runs_in_order(tmp_path):
    """The README's commands in its order, in one fresh directory (about 5 minutes on 2 busy cores)."""
    first_run, previous, ran, skipped = None, None, [], []
    for heading, command in readme_commands():
        args = pipegpt_args(command, previous)
        why = next((reason for pattern, reason in NOT_RUN if re.search(pattern, command)), None)
        if args is None or why is not None:
            skipped.append((command, why or "not pipegpt"))
            continue
        previous = args
        args = runnable(args, heading, first_run, tmp_path)
        proc = run_pipegpt(*args, cwd=tmp_path, timeout=300)
        report = f"README ({heading.strip()}): {command}\nran: pipegpt {shlex.join(args)}\n{proc.stdout}\n{proc.stderr}"
        assert proc.returncode == 0, report
        assert "Traceback" not in proc.stdout + proc.stderr, report
        assert "nothing to do" not in proc.stdout, report
        if args[0] == "run" and first_run is None:
            first_run = next((tmp_path / "runs").iterdir())
        ran.append(command)
    print(f"\nran {len(ran)} README commands; not run: " + "; ".join(f"{c} ({why})" for c, why in skipped))
    assert len(ran) >= 20, ran
