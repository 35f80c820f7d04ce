"""The README's checkpoint examples run in order as written (a new user's first session): scaled down a hundred
times (steps, save intervals and checkpoint names) on the tiny model, each command must train, not say "nothing
to do" nor miss a checkpoint that --keep pruned (the --init-from example named one the first run had pruned)."""
from __future__ import annotations

import re
import shlex

from helpers import ROOT, run_pipegpt

TINY = ["--n-layer", "4", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--microbatches", "4",
        "--threads-per-worker", "1"]


def readme_block(heading: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split(heading, 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines() if line.strip()]


def scaled(command: str) -> list[str]:
    """The command's numbers of steps a hundred times smaller (step-00001400 -> step-00000014)."""
    words = shlex.split(command)
    assert words[0] == "pipegpt"
    out = []
    for prev, word in zip([""] + words, words):
        if prev in ("--steps", "--save-every"):
            word = str(int(word) // 100)
        word = re.sub(r"step-(\d{8})", lambda m: f"step-{int(m.group(1)) // 100:08d}", word)
        out.append(word)
    return out[1:]


def test_the_checkpoint_examples_run_in_order(tmp_path):
    commands = readme_block("### Checkpoints: stop, resume, change the layout")
    assert len(commands) == 3 and "--init-from" in commands[2], commands
    for command in commands:
        args = scaled(command)
        model = [] if "--resume" in args or "--init-from" in args else TINY
        proc = run_pipegpt(*args, *model, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
        assert "nothing to do" not in proc.stdout, f"{command}\n{proc.stdout}"
