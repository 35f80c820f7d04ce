"""`pipegpt run --resume` restores the run: every setting from the checkpoint's config except those given on
the command line, each change printed as one line; a resume with nothing left to do writes nothing; each
attempt's config is kept and every metrics.jsonl row names its attempt.

One real run (module fixture) saves the checkpoints; the tests copy its directory before resuming into it.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from helpers import NoWorkers, assert_one_line_error, invoke, lock_held_elsewhere, read_only, run_pipegpt

SAVED_ARGS = ["--stages", "2", "--microbatches", "2", "--microbatch-size", "2", "--steps", "4", "--save-every", "2",
              "--layers-per-stage", "3,1", "--lr", "0.002", "--seed", "7", "--threads-per-worker", "1"]


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return proc


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-step run on its own token file, checkpoints after steps 2 and 4."""
    root = tmp_path_factory.mktemp("resume")
    data = root / "tokens.bin"
    (np.arange(20_000) % 251).astype(np.uint16).tofile(data)
    run = root / "run"
    _ok(run_pipegpt("run", *SAVED_ARGS, "--data", data, "--run-dir", run, timeout=240))
    return run, data


@pytest.fixture
def run_copy(saved, tmp_path):
    run, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def _changes(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("--")]


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_takes_the_runs_settings_and_keeps_each_attempts_config(saved, run_copy):
    """No --data, --save-every, --lr, ... given: the checkpoint's run's are used, not the defaults; the one
    setting given (--steps) is the one change printed."""
    _, data = saved
    proc = _ok(run_pipegpt("run", "--resume", run_copy, "--steps", "6", timeout=240))
    assert _changes(proc.stdout) == ["--steps 4 -> 6"], proc.stdout
    first = json.loads((run_copy / "configs" / "attempt-1.json").read_text())
    second = json.loads((run_copy / "configs" / "attempt-2.json").read_text())
    assert json.loads((run_copy / "config.json").read_text()) == second  # the latest: trace.json's layout
    assert second["data"]["data"] == str(data) and second["checkpoint"]["save_every"] == 2
    assert second["optim"]["lr"] == 0.002 and second["runtime"]["seed"] == 7
    assert second["parallel"]["layers_per_stage"] == [3, 1] and second["runtime"]["steps"] == 6
    assert first["runtime"]["steps"] == 4 and first["checkpoint"]["resume"] is None
    assert (run_copy / "checkpoints" / "step-00000006").is_dir()  # --save-every came back with the run
    assert [(r["step"], r["attempt"]) for r in _rows(run_copy)] == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (6, 2)]


def test_resume_under_another_layout_prints_each_change(saved, run_copy):
    proc = _ok(run_pipegpt("run", "--resume", run_copy, "--steps", "5", "--stages", "1", timeout=240))
    assert _changes(proc.stdout) == ["--stages 2 -> 1",
                                     "--layers-per-stage 3,1 -> default (follows the options given)",
                                     "--steps 4 -> 5"], proc.stdout
    cfg = json.loads((run_copy / "config.json").read_text())
    assert cfg["parallel"]["stages"] == 1 and cfg["data"]["data"] == str(saved[1])


def test_a_resume_with_nothing_to_do_starts_nothing_and_writes_nothing(no_workers, run_copy):
    before = {p: p.stat().st_mtime_ns for p in run_copy.rglob("*")}
    result = invoke("run", "--resume", run_copy, "--lr", "0.01")
    assert result.exit_code == 0, result.output
    assert not NoWorkers.started
    lines = result.stdout.splitlines()
    assert _changes(result.stdout) == ["--lr 0.002 -> 0.01"], lines
    assert lines[-1].startswith("nothing to do: the checkpoint was taken after step 4 of 4"), lines
    assert {p: p.stat().st_mtime_ns for p in run_copy.rglob("*")} == before


def test_a_schedule_given_on_resume_replaces_the_saved_layout_settings(no_workers, run_copy):
    """What was chosen for the saved schedule (its split of the layers) is not forced on another one."""
    result = invoke("run", "--resume", run_copy / "checkpoints" / "step-00000004", "--schedule", "zb-h1")
    assert result.exit_code == 0, result.output
    assert _changes(result.stdout) == ["--schedule 1f1b -> zb-h1",
                                       "--layers-per-stage 3,1 -> default (follows the options given)"], result.stdout


def test_a_resume_whose_checkpoints_cannot_be_written_is_refused_before_work(no_workers, run_copy):
    """--save-every comes back with the run: a read-only checkpoints/ is found before a step, not after."""
    with read_only(run_copy / "checkpoints") as checkpoints:
        assert_one_line_error(invoke("run", "--resume", run_copy, "--steps", "6"), f"{checkpoints}",
                              "not writable", "--save-every 0")
    assert not NoWorkers.started


def test_a_resume_into_another_runs_directory_is_refused(no_workers, run_copy, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 0, "attempt": 1, "loss": 5.0}\n')
    assert_one_line_error(invoke("run", "--resume", run_copy, "--steps", "6", "--run-dir", other),
                          f"--run-dir {other} holds another run", "leave out --run-dir")
    assert (other / "metrics.jsonl").read_text().count("\n") == 1 and not NoWorkers.started


def test_a_resumed_attempt_has_an_eta_and_its_summary_covers_the_whole_run(saved, run_copy):
    """The progress line said `eta ?` on every line after a resume (its clock started from step 0, not from the
    checkpoint), and the summary covered the last attempt only."""
    proc = _ok(run_pipegpt("run", "--resume", run_copy, "--steps", "9", "--log-every", "2", timeout=240))
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ") and "/9 [" in line]
    assert [line.split()[1] for line in progress] == ["6/9", "8/9", "9/9"], proc.stdout
    assert all("eta ?" not in line for line in progress[1:]) and "eta " in progress[1], proc.stdout
    # the cosine decays over --steps: a longer run moves the rate under the resumed step, and says so
    from pipegpt.config import OptimizerConfig
    from pipegpt.train.optim import lr_at

    optim = OptimizerConfig(lr=0.002)
    assert (f"--steps 4 -> 9 moves the cosine learning-rate schedule: step 5 runs at lr {lr_at(4, optim, 9):.3g}, "
            f"not the {lr_at(4, optim, 4):.3g} the run was heading for") in proc.stdout, proc.stdout
    rows = _rows(run_copy)
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("done: "))
    assert summary.startswith(f"done: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} in 9 steps "
                              f"(5 in this attempt, from step 5); "), summary


def test_a_resume_into_a_directory_a_live_run_holds_is_refused(no_workers, run_copy):
    with lock_held_elsewhere(run_copy) as pid:
        assert_one_line_error(invoke("run", "--resume", run_copy, "--steps", "6"),
                              f"{run_copy} is in use by another pipegpt run (pid {pid})")
    assert not NoWorkers.started


def test_resuming_an_older_checkpoint_moves_the_later_ones_off_the_line(run_copy):
    """History is a line: from step 2 of a run that saved 2 and 4, the later checkpoint moves aside, so the latest
    and --keep follow the branch that runs (--keep 2 would otherwise have pruned step 2 and kept the old 4), and
    the old branch's metrics rows are marked abandoned."""
    from pipegpt.run_files import read_metrics
    from pipegpt.state.checkpoint import resolve

    proc = _ok(run_pipegpt("run", "--resume", run_copy / "checkpoints" / "step-00000002", "--steps", "3",
                           "--save-every", "1", "--keep", "2", timeout=240))
    moved = [p for p in run_copy.iterdir() if p.name.startswith("abandoned-")]
    assert len(moved) == 1 and sorted(p.name for p in (moved[0] / "checkpoints").iterdir()) == ["step-00000004"]
    assert (f"pipegpt: the run goes on after step 2, before its latest checkpoint: moved the later ones "
            f"(step-00000004) to {moved[0]}; their metrics rows are marked abandoned") in proc.stdout.splitlines()
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    assert resolve(run_copy).name == "step-00000003"  # what the next --resume of the run goes on from
    assert [(r["step"], r["attempt"]) for r in _rows(run_copy) if r.get("abandoned")] == [(3, 1), (4, 1)]
    assert [(r["step"], r["attempt"]) for r in read_metrics(run_copy)] == [(1, 1), (2, 1), (3, 2)]


def test_resume_auto_into_a_live_runs_directory_with_fewer_steps_is_refused_by_the_lock(no_workers, run_copy):
    """Issue 44: `--resume auto` with a --steps the checkpoint has passed said "nothing to do" (exit 0) while another
    run held the directory and went on saving; the lock comes first, naming its pid."""
    with lock_held_elsewhere(run_copy) as pid:
        for resume in ("auto", str(run_copy)):
            assert_one_line_error(invoke("run", "--resume", resume, "--run-dir", run_copy, "--steps", "2"),
                                  f"{run_copy} is in use by another pipegpt run (pid {pid})")
    assert not NoWorkers.started


def _edit_manifest(ckpt, edit):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    edit(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _fewer_layers(ckpt):
    _edit_manifest(ckpt, lambda m: (m["model"].update(n_layer=1), m["config"]["model"].update(n_layer=1)))


def _flip_header_byte(ckpt):  # "__metadata__" -> "__metadata\x7f_"
    raw = bytearray((ckpt / "rank-00000.safetensors").read_bytes())
    raw[20] = 0x7F
    (ckpt / "rank-00000.safetensors").write_bytes(bytes(raw))


DAMAGE = {  # issue 44: each loaded silently (other tokens, a 1-layer resumed run) or was a traceback
    "fewer layers": (_fewer_layers, "holds 108 tensors its manifest's model (1-layer, n_embd 128) has no place for "
                                    "(param/blocks.1."),
    "edited step": (lambda c: _edit_manifest(c, lambda m: m.update(step=1)),
                    "manifest.json: step 1, but its directory is step-00000004 (step 4)"),
    "edited head count": (lambda c: _edit_manifest(c, lambda m: (m["model"].update(n_head=2),
                                                                 m["config"]["model"].update(n_head=2))),
                          "manifest.json: corrupt: its fields are not those whose SHA-256 it recorded"),
    "flipped header byte": (_flip_header_byte, "rank-00000.safetensors: corrupt: its header is not a safetensors "
                                               "header"),
}
LOADERS = {
    "sample": lambda ckpt, tmp: ("sample", ckpt, "--max-new-tokens", "3"),
    "sample on workers": lambda ckpt, tmp: ("sample", ckpt, "--stages", "2", "--max-new-tokens", "3"),
    "resume": lambda ckpt, tmp: ("run", "--resume", ckpt.parent.parent, "--steps", "6"),
    "hellaswag": lambda ckpt, tmp: ("hellaswag", ckpt, "--file", tmp / "hs.jsonl"),
    "convert": lambda ckpt, tmp: ("convert", "--to-hf", tmp / "hf", "--checkpoint", ckpt),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_one_line_in_every_loader(no_workers, run_copy, tmp_path, damage):
    ckpt = run_copy / "checkpoints" / "step-00000004"
    edit, fragment = DAMAGE[damage]
    edit(ckpt)
    (tmp_path / "hs.jsonl").write_text('{"ctx": "a b", "endings": ["c", "d", "e", "f"], "label": 0}\n')
    for name, args in LOADERS.items():
        assert_one_line_error(invoke(*args(ckpt, tmp_path)), f"{ckpt}", fragment)
    assert not NoWorkers.started and not (tmp_path / "hf").exists()
