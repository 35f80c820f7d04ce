"""examples/slurm/train.sbatch as Slurm would run it, on this machine: stand-in `srun` and `scontrol` on PATH start
two "nodes" (a torchrun agent each, one CPU worker, gloo) that meet by c10d rendezvous at the first node's address.
The job trains; submitted again with more steps, it goes on from the shared run directory's last checkpoint
(--resume auto). examples/torchrun/multinode.sh's command is parsed by the real command line."""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, clean_env

SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--microbatches", "2",
        "--threads-per-worker", "1", "--timeout", "60", "--log-every", "1"]

# srun: the job step once per node, in parallel, each knowing its node (as srun --ntasks-per-node=1 does)
SRUN = """#!/bin/bash
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$SLURM_LOGS/node-$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
# scontrol show hostnames LIST: one host a line (every "node" here is this machine)
SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] || { echo "stand-in scontrol: only 'show hostnames'" >&2; exit 1; }
tr ',' '\\n' <<< "$3"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _submit(tmp_path: Path, job_id: int, *options: str) -> subprocess.CompletedProcess:
    bin_dir, logs = tmp_path / "bin", tmp_path / f"job-{job_id}"
    bin_dir.mkdir(exist_ok=True)
    logs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = clean_env(PATH=path, SLURM_JOB_ID=str(job_id), SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2",
                    SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1", SLURM_LOGS=str(logs), GPUS_PER_NODE="1",
                    RUN_DIR=str(tmp_path / "shared" / "run"), RDZV_PORT=str(_free_port()), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(SBATCH), *options], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)
    proc.stdout += "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.iterdir()))
    return proc


def _rows(run_dir: Path) -> list[tuple[int, int]]:
    return [(r["step"], r["attempt"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def test_the_sbatch_job_trains_on_two_nodes_and_a_resubmission_resumes(tmp_path):
    run_dir = tmp_path / "shared" / "run"
    first = _submit(tmp_path, 1, *TINY, "--steps", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert _rows(run_dir) == [(1, 1), (2, 1)], first.stdout
    assert json.loads((run_dir / "config.json").read_text())["parallel"]["stages"] == 2  # a rank per "node"
    assert (run_dir / "checkpoints" / "step-00000002").is_dir()  # the last step, saved by default

    again = _submit(tmp_path, 2, *TINY, "--steps", "4")
    assert again.returncode == 0, again.stdout + again.stderr
    assert _rows(run_dir) == [(1, 1), (2, 1), (3, 2), (4, 2)], again.stdout
    assert f"resuming {run_dir}/checkpoints/step-00000002" in again.stdout, again.stdout


def test_the_examples_commands_are_pipegpt_run_commands_the_cli_accepts(monkeypatch):
    """The sbatch's default settings with its layout (and the commented --layout auto), and multinode.sh's."""
    import click

    from pipegpt.cli import main

    monkeypatch.setattr(click.Path, "convert", lambda self, value, param, ctx: value)
    text = SBATCH.read_text()
    arrays = dict(re.findall(r"^#? ?(TRAIN|LAYOUT)=\((.*?)\)", text, flags=re.M | re.S))
    assert set(arrays) == {"TRAIN", "LAYOUT"}
    train = shlex.split(arrays["TRAIN"].replace('"${DATA:-data/fineweb}"', "data/fineweb"))
    for layout in (["--dp", "8"], ["--layout", "auto"]):
        assert " ".join(layout) in text
        main.commands["run"].make_context("run", ["--run-dir", "r", "--resume", "auto", *layout, *train])
    script = (ROOT / "examples" / "torchrun" / "multinode.sh").read_text().replace("\\\n", " ")
    command = next(line for line in script.splitlines() if line.startswith("torchrun "))
    words = [re.sub(r"\$\{\w+:-(.*)\}", r"\1", w) for w in shlex.split(command)]
    assert words[words.index("--rdzv_backend") + 1] == "c10d"
    at = next(i for i in range(len(words)) if words[i:i + 2] == ["-m", "pipegpt"])
    assert words[at + 2] == "run" and "--resume" in words
    main.commands["run"].make_context("run", words[at + 3:])
