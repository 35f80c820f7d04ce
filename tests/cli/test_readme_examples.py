"""The README's and docs/'s examples run as written (a new user's first session), and their links lead somewhere.

Every command of the ```bash blocks of README.md and docs/*.md is parsed by the real command line (click), every
flag checked to exist, and every relative link checked to resolve, headings included (the fast tests). The slow
test then runs, README first and then docs/ by name, in one empty directory, every command a CPU machine without
internet can run, substituting only what must be:

  - steps fewer: `--steps N`, `--save-every N` and `step-NNNNNNNN` of 20 or more divided by 10 (as the
    checkpoint examples, which also shrink the model: TINY); a `pipegpt run` that gives no --steps gets
    `--steps 2`, a `plan --try` gets `--try-steps 2`;
  - `runs/<time>` is the run directory the first `pipegpt run` made; `my_schedule.txt`, a schedule you wrote, is
    that run's plan.txt (a schedule file);
  - `...` in `pipegpt plan ... --calibrate` is the plan command before it;
  - `VAR=value pipegpt ...` runs with VAR set (a rehearsed fault);
  - a command that two pages show alike (the same arguments after these substitutions, the same settings) runs
    once: running it again in the same directory proves nothing more (the planner's llama3-70b search is 30 s).

Not run (parsed only), each for the reason in NOT_RUN: installing (pip) and the test suite itself, GPUs, torchrun
on two nodes, what needs a download (GPT-2's BPE for `--tokenizer gpt2`, a Hugging Face model directory) or what
those commands make (data/books, ckpt/gpt2, runs/ft), and the planner's searches over hundreds of GPUs."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from helpers import ROOT, clean_env, run_pipegpt

TINY = ["--n-layer", "4", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--microbatches", "4",
        "--threads-per-worker", "1"]
TRAINING = ROOT / "docs" / "training.md"
CHECKPOINTS = "## Checkpoints"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# why a command is not run on a CPU machine without internet: (a pattern in the command, the reason)
NOT_RUN = [
    (r"^(python3 -m venv|\.venv/bin/pip |\.venv/bin/python -m pytest)", "installs, or runs this test suite"),
    (r"--device cuda|--config examples/configs/", "needs GPUs"),
    (r"^torchrun --nnodes 2", "needs two machines"),
    (r"--tokenizer gpt2", "needs GPT-2's BPE (tiktoken downloads it)"),
    (r"--from-hf gpt2/", "needs a Hugging Face GPT-2 directory (a download)"),
    (r"runs/ft|data/books", "needs what the commands above that were not run make"),
    (r"--gpus (512|1024)\b", "a search over hundreds of GPUs (the slow set keeps to smaller ones)"),
]


def readme_block(heading: str, path: Path = TRAINING) -> list[str]:
    text = path.read_text()
    block = text.split(heading, 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines() if line.strip()]


def readme_commands(path: Path = ROOT / "README.md") -> list[tuple[str, str]]:
    """(the heading above it, the command) for every command of every ```bash block of a markdown file, in order:
    comments cut, continued lines joined, `a && b` as two commands."""
    commands, heading = [], ""
    text = path.read_text()
    for part in re.split(r"(^#+ [^\n]*$|```bash\n.*?```)", text, flags=re.M | re.S):
        if part.startswith("#"):
            heading = part
        elif part.startswith("```bash"):
            body = part[len("```bash\n"):-3].replace("\\\n", " ")
            for line in body.splitlines():
                line = line.split("#", 1)[0].strip()
                commands += [(heading, " ".join(c.split())) for c in line.split("&&") if c.strip()]
    return commands


def all_commands() -> list[tuple[Path, str, str]]:
    """(document, heading, command) for README.md, then docs/*.md by name."""
    return [(doc, heading, command) for doc in DOCUMENTS for heading, command in readme_commands(doc)]


def environment_and_words(command: str) -> tuple[dict[str, str], list[str]]:
    """A command's leading VAR=value settings apart from its words."""
    words, env = shlex.split(command), {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def pipegpt_args(command: str, previous: list[str] | None = None) -> list[str] | None:
    """The arguments after `pipegpt` (the console script, .venv's, or torchrun's `-m pipegpt`); None for a command
    of another program. `...` among them stands for the previous command's arguments."""
    words = environment_and_words(command)[1]
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
    """The command's numbers of steps, from 20, ten times smaller (step-00000140 -> step-00000014)."""
    words = shlex.split(command)
    assert words[0] == "pipegpt"
    return _scaled(words[1:])


def _scaled(args: list[str]) -> list[str]:
    out = []
    for prev, word in zip([""] + args, args):
        if prev in ("--steps", "--save-every"):
            word = str(_fewer(int(word)))
        word = re.sub(r"step-(\d{8})", lambda m: f"step-{_fewer(int(m.group(1))):08d}", word)
        out.append(word)
    return out


def _fewer(steps: int) -> int:
    return steps // 10 if steps >= 20 else steps


def test_every_command_of_the_readme_and_docs_parses_with_flags_that_exist(monkeypatch):
    """Each pipegpt command of README.md and docs/*.md, by the real click commands: a flag, choice or argument
    count that the command line would refuse fails here (paths need not exist)."""
    import click

    from pipegpt.cli import main

    monkeypatch.setattr(click.Path, "convert", lambda self, value, param, ctx: value)  # placeholders' paths
    commands = all_commands()
    assert any(CHECKPOINTS in heading for doc, heading, _ in commands if doc == TRAINING)
    parsed, previous, per_document = 0, None, {}
    for doc, heading, command in commands:
        args = pipegpt_args(command, previous)
        if args is None:
            continue
        where = f"{doc.relative_to(ROOT)} ({heading.strip()}): {command}"
        if args == ["--help"]:
            continue
        name, rest = args[0], args[1:]
        assert name in main.commands, where
        try:
            main.commands[name].make_context(name, list(rest))
        except click.ClickException as e:
            pytest.fail(f"{where}\n{e.format_message()}")
        parsed, previous = parsed + 1, args
        per_document[doc.name] = per_document.get(doc.name, 0) + 1
    assert parsed >= 40, parsed
    for name in ("README.md", "schedules.md", "planner.md", "training.md", "parallelism.md", "models.md"):
        assert per_document.get(name, 0) >= 2, per_document


def test_the_parse_check_can_fail():
    import click

    from pipegpt.cli import main

    with pytest.raises(click.NoSuchOption):
        main.commands["run"].make_context("run", ["--stages", "2", "--stage", "2"])
    with pytest.raises(click.BadParameter):
        main.commands["plan"].make_context("plan", ["--model", "tiny", "--gpus", "two"])
    with pytest.raises(click.UsageError):  # an argument too many
        main.commands["sample"].make_context("sample", ["runs/a", "runs/b"])


# --------------------------------------------------------------------------------------------------------------
# links

def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, flags=re.M)}


def relative_links(path: Path) -> list[str]:
    """The targets of the markdown links of a file that are not web addresses (code blocks left out)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"^[a-z]+:", t)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target}: no {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    return broken


def test_every_relative_link_of_the_readme_and_docs_resolves():
    checked = 0
    for doc in DOCUMENTS:
        assert not broken_links(doc), (doc.name, broken_links(doc))
        checked += len(relative_links(doc))
    assert checked >= 30, checked
    readme_links = relative_links(ROOT / "README.md")
    for page in ("schedules", "planner", "training", "parallelism", "models", "gpu", "contributing", "moe",
                 "architecture"):
        assert f"docs/{page}.md" in readme_links, page  # every page a click from the README


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Its part\n\n[there](b.md) [here](#its-part) [not](#nope) "
                                   "[web](https://example.com) [part](a.md#its-part)\n")
    assert broken_links(tmp_path / "a.md") == [f"b.md: no {tmp_path / 'b.md'}", "#nope: no heading #nope in a.md"]
    assert github_anchor("Clusters: torchrun and Slurm") == "clusters-torchrun-and-slurm"
    assert github_anchor("--layout auto") == "--layout-auto"


# --------------------------------------------------------------------------------------------------------------
# the slow set: the examples run

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
def test_every_example_that_a_cpu_can_run_runs_in_order(tmp_path):
    """README's and docs/'s commands in their order, in one fresh directory."""
    first_run, previous, ran, skipped, done = None, None, [], [], set()
    for doc, heading, command in all_commands():
        args = pipegpt_args(command, previous)
        why = next((reason for pattern, reason in NOT_RUN if re.search(pattern, command)), None)
        if args is None or why is not None:
            skipped.append((command, why or "not pipegpt"))
            continue
        previous = args
        args = runnable(args, heading, first_run, tmp_path)
        if (key := (tuple(args), tuple(sorted(environment_and_words(command)[0].items())))) in done:
            skipped.append((command, "ran as written above"))
            continue
        done.add(key)
        env = clean_env(**environment_and_words(command)[0])
        proc = run_pipegpt(*args, cwd=tmp_path, env=env, timeout=600)
        report = (f"{doc.name} ({heading.strip()}): {command}\nran: pipegpt {shlex.join(args)}\n{proc.stdout}\n"
                  f"{proc.stderr}")
        assert proc.returncode == 0, report
        assert "Traceback" not in proc.stdout + proc.stderr, report
        assert "nothing to do" not in proc.stdout, report
        if args[0] == "run" and first_run is None:
            first_run = next((tmp_path / "runs").iterdir())
        ran.append(command)
    print(f"\nran {len(ran)} commands; not run: " + "; ".join(f"{c} ({why})" for c, why in skipped))
    assert len(ran) >= 30, ran
