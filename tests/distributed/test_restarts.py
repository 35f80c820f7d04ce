"""--max-restarts: a worker that dies, raises or stalls no longer ends the run; the driver starts the workers
again in the same layout from the run's latest checkpoint, and the losses go on as if nothing had happened."""
import json
import subprocess
import time

import pytest

from helpers import PIPEGPT, assert_one_line_error, clean_env, invoke, run_pipegpt

RUN = ("run", "--stages", "2", "--microbatches", "4", "--steps", "6", "--save-every", "2")


def last_rows(run_dir) -> dict:
    """Each step's last row (a step redone after a restart appears twice)."""
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    return rows


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("restarts") / "reference"
    proc = run_pipegpt(*RUN, "--run-dir", run_dir, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return last_rows(run_dir)


def test_a_dead_worker_is_restarted_and_the_losses_go_on_bit_for_bit(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_pipegpt(*RUN, "--max-restarts", "1", "--run-dir", run_dir, timeout=300,
                       env=clean_env(PIPEGPT_FAULT="exit:1:6"))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("pipegpt: rank 1 failed at step")]
    assert len(said) == 1 and "restart 1 of 1, same layout, from " in said[0] and "step-00000004" in said[0], said
    assert "(process exited with code 13)" in said[0], said
    rows = last_rows(run_dir)
    assert sorted(rows) == sorted(uninterrupted)
    assert [rows[s]["loss"] for s in sorted(rows)] == [uninterrupted[s]["loss"] for s in sorted(rows)]
    after = [r for r in rows.values() if r["attempt"] == 2]
    assert after and after[0]["recovery_s"] > 0 and all(r["recovery_s"] is None for r in after[1:])
    # step 6 failed, step 4's checkpoint resumed: step 5, completed before the failure, is done again
    assert after[0]["steps_lost"] == 1 and all(r["steps_lost"] is None for r in after[1:])
    assert "pipegpt: recovered: step 5 done" in proc.stdout and "; 1 completed step done again" in proc.stdout


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
def test_a_restart_resumes_the_newest_snapshot_in_memory_not_the_older_checkpoint(uninterrupted, tmp_path):
    from pipegpt.state.snapshot import snapshot_root

    run_dir = tmp_path / "run"
    proc = run_pipegpt("run", "--stages", "2", "--microbatches", "4", "--steps", "6", "--save-every", "3",
                       "--snapshot-every", "1", "--max-restarts", "1", "--run-dir", run_dir, timeout=300,
                       env=clean_env(PIPEGPT_FAULT="exit:1:6"))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    said = next(ln for ln in proc.stderr.splitlines() if ln.startswith("pipegpt: rank 1 failed at step 6"))
    # the disk holds step 3's checkpoint; step 4's snapshot was whole a step before the failure (step 5's was
    # being written as it struck, and is taken if it was whole)
    assert "from the snapshot in memory " in said and ("step-00000004 (after step 4" in said or
                                                       "step-00000005 (after step 5" in said), said
    rows = last_rows(run_dir)
    assert sorted(rows) == sorted(uninterrupted)
    assert [rows[s]["loss"] for s in sorted(rows)] == [uninterrupted[s]["loss"] for s in sorted(rows)]
    first_again = min(s for s, r in rows.items() if r["attempt"] == 2)
    assert first_again >= 5 and rows[first_again]["steps_lost"] == 6 - first_again  # 1 or 0, never 2 (step 3's)
    assert all(rows[s]["snapshot_s"] > 0 for s in (1, 2, 4)) and rows[3]["snapshot_s"] is None  # a checkpoint
    assert not snapshot_root(run_dir).exists()  # the run is over: its snapshots leave the memory


TINY = ("--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--vocab-size", "256", "--stages", "2",
        "--microbatches", "2", "--threads-per-worker", "1")


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
def test_a_dead_runs_snapshots_are_never_taken_by_a_later_run(tmp_path):
    """A driver killed outright leaves its snapshots in shared memory. The next run in its directory (here
    --resume auto: no checkpoint, so the run starts again) restarts from its own state, never from the dead
    run's snapshot (which would take that run's step and settings: "nothing to do", 2 steps of 6 trained);
    it removes them, and its rows are a new attempt's."""
    from pipegpt.run_files import read_metrics
    from pipegpt.state.snapshot import snapshot_root

    run_dir = tmp_path / "run"
    dead = subprocess.Popen([PIPEGPT, "run", *TINY, "--steps", "500", "--snapshot-every", "1", "--max-restarts", "1",
                             "--run-dir", str(run_dir)], env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while len(read_metrics(run_dir)) < 4 and dead.poll() is None and time.monotonic() - t0 < 240:
            time.sleep(0.2)
        root = snapshot_root(run_dir)
        assert any(p.name.removeprefix(".tmp-").startswith("step-") for p in root.iterdir()), list(root.iterdir())
    finally:
        dead.kill()  # SIGKILL: nothing of it runs again; its workers die with it
        dead.wait()
    proc = run_pipegpt("run", *TINY, "--steps", "6", "--snapshot-every", "4", "--max-restarts", "1",
                       "--run-dir", run_dir, "--resume", "auto", timeout=300, env=clean_env(PIPEGPT_FAULT="raise:1:3"))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    said = next(ln for ln in proc.stderr.splitlines() if ln.startswith("pipegpt: rank 1 failed at step 3"))
    assert said.endswith("from the start (no checkpoint yet)"), said
    assert "nothing to do" not in proc.stdout and not root.exists()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and {r["attempt"] for r in rows} == {3}, rows


@pytest.mark.slow
def test_a_second_failure_past_the_limit_ends_the_run_and_keeps_the_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_pipegpt(*RUN, "--max-restarts", "1", "--run-dir", run_dir, timeout=300,
                       env=clean_env(PIPEGPT_FAULT="exit:1:4,raise:0:6"))
    assert proc.returncode == 1, proc.stderr
    assert "restart 1 of 1" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: rank 0 failed") and "after 1 restart" in last, last
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved[-1] == "step-00000004", saved  # the last before the second failure


@pytest.mark.slow
def test_no_checkpoint_yet_starts_the_run_again(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_pipegpt("run", "--stages", "2", "--microbatches", "4", "--steps", "6", "--max-restarts", "2",
                       "--run-dir", run_dir, timeout=300, env=clean_env(PIPEGPT_FAULT="raise:0:3"))
    assert proc.returncode == 0, proc.stderr
    assert "from the start (no checkpoint yet)" in proc.stderr
    rows = last_rows(run_dir)
    assert [rows[s]["loss"] for s in sorted(rows)] == [uninterrupted[s]["loss"] for s in sorted(rows)]


@pytest.mark.parametrize("args,message", [
    (["--max-restarts", "-1"], "max_restarts=-1 must be an integer >= 0"),
    (["--resume", "auto"], "--resume auto resumes the run in --run-dir"),
    (["--min-ranks", "1"], "--min-ranks 1 says how few ranks a restart may go on with: give --max-restarts N"),
    (["--max-restarts", "1", "--min-ranks", "9"], "min_ranks=9 must be between 1 and this job's 4 ranks"),
    (["--snapshot-every", "2"], "--snapshot-every 2 keeps snapshots for restarts: give --max-restarts N too"),
    (["--snapshot-every", "-1", "--max-restarts", "1"], "snapshot_every=-1 must be an integer >= 0"),
])
def test_bad_restart_options_are_one_line(args, message):
    assert_one_line_error(invoke("run", "--steps", "1", *args), message)


def test_resume_auto_starts_fresh_then_resumes(tmp_path):
    from pipegpt.options import resume_auto

    run_dir = tmp_path / "run"
    assert resume_auto(str(run_dir)) == (None, False)
    (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    assert resume_auto(str(run_dir)) == (None, True)  # no complete checkpoint: the run starts again there
    (run_dir / "checkpoints" / "step-00000002" / "manifest.json").write_text("{}")
    assert resume_auto(str(run_dir)) == (str(run_dir), True)


def test_restart_state_reads_the_count_the_failure_time_and_the_steps_lost(tmp_path):
    import json

    from pipegpt.train.restart import restart_state, write_restart_state

    assert restart_state(tmp_path) == (0, None, None) == restart_state(None)
    write_restart_state(tmp_path, 2, 1764000000.5, 3)
    assert restart_state(tmp_path) == (2, 1764000000.5, 3)
    write_restart_state(tmp_path, 1, 1764000000.5, None)
    assert restart_state(tmp_path) == (1, 1764000000.5, None)
    # another process's file (a run that shares the directory, an old restart) is not this attempt's
    state = json.loads((tmp_path / "restart.json").read_text())
    (tmp_path / "restart.json").write_text(json.dumps({**state, "process": [state["process"][0] + 1, 0]}))
    assert restart_state(tmp_path) == (0, None, None)


def test_restart_args_resume_the_run_and_drop_what_would_contradict_it():
    from pipegpt.train.restart import restart_args

    argv = ["run", "--stages", "2", "--config", "c.toml", "--overwrite", "--init-from=x", "--resume", "old"]
    assert restart_args(argv, "runs/a") == ["run", "--stages", "2", "--resume", "runs/a"]
    assert restart_args(["run", "--overwrite", "--init-from", "x"], None) == ["run", "--init-from", "x"]
    # the same run directory on every attempt, where restart.json is
    assert restart_args(["run", "--run-dir", "a"], None, run_dir="a") == ["run", "--run-dir", "a"]
    assert restart_args(["run"], None, run_dir="runs/b") == ["run", "--run-dir", "runs/b"]


@pytest.mark.slow
def test_a_lost_device_shrinks_the_layout_and_goes_on_like_a_manual_resume(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_pipegpt("run", "--stages", "3", "--microbatches", "4", "--steps", "8", "--save-every", "2",
                       "--max-restarts", "1", "--min-ranks", "2", "--run-dir", run_dir, timeout=300,
                       env=clean_env(PIPEGPT_FAULT="lose:2:6"))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    said = next(ln for ln in proc.stderr.splitlines() if ln.startswith("pipegpt: rank 2 failed"))
    assert "dp 1 x pp 3 x tp 1, 1f1b, 4 microbatches -> dp 1 x pp 2 x tp 1, 1f1b, 4 microbatches" in said, said
    rows = last_rows(run_dir)
    resumed = [s for s, r in rows.items() if r["attempt"] == 2]
    # the same checkpoint resumed by hand in the layout the restart chose
    manual = tmp_path / "manual"
    by_hand = run_pipegpt("run", "--resume", run_dir / "checkpoints" / "step-00000004", "--stages", "2",
                          "--run-dir", manual, "--save-every", "0", timeout=300)
    assert by_hand.returncode == 0, by_hand.stderr
    expected = last_rows(manual)
    assert sorted(expected) == sorted(resumed)
    for s in resumed:
        assert rows[s]["loss"] == pytest.approx(expected[s]["loss"], rel=1e-5), s


@pytest.mark.slow
def test_a_lost_device_without_min_ranks_ends_the_run_in_one_line(tmp_path):
    proc = run_pipegpt("run", "--stages", "2", "--microbatches", "2", "--steps", "3", "--max-restarts", "1",
                       "--run-dir", tmp_path / "run", timeout=300, env=clean_env(PIPEGPT_FAULT="lose:1:2"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == ("Error: rank 1's device is gone (process exited with code 75): "
                                                    "give --min-ranks K to go on with fewer ranks; all workers stopped")


@pytest.mark.slow
def test_a_stalled_rank_is_restarted(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_pipegpt(*RUN, "--max-restarts", "1", "--run-dir", run_dir, timeout=300,
                       env=clean_env(PIPEGPT_FAULT="stuck:1:6"))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert any(ln.startswith("pipegpt: rank 1 stalled at step") and "restart 1 of 1" in ln
               for ln in proc.stderr.splitlines()), proc.stderr
    rows = last_rows(run_dir)
    assert [rows[s]["loss"] for s in sorted(rows)] == [uninterrupted[s]["loss"] for s in sorted(rows)]


def test_the_shrunk_layout_keeps_the_global_batch_and_uses_the_ranks_left():
    from pipegpt.config import ModelConfig, TrainConfig
    from pipegpt.resilience.elastic import shrunk_layout

    model = ModelConfig(vocab_size=256, seq_len=16, n_layer=8, n_head=4, n_embd=32)
    cfg = TrainConfig.build(model, stages=4, dp=2, microbatches=4, device="cpu")
    seven = shrunk_layout(cfg, 7)  # dp 2 keeps a pipeline of 3
    assert (seven.cfg.parallel.dp, seven.cfg.parallel.stages, seven.cfg.parallel.microbatches) == (2, 3, 4)
    assert seven.flags == {"--stages": 3, "--dp": 2, "--microbatches": 4, "--schedule": "1f1b"}
    assert seven.ratio > 1  # the same work on fewer ranks
    one = shrunk_layout(cfg, 1)  # one rank: one replica, twice the microbatches, the global batch kept
    assert (one.cfg.parallel.dp, one.cfg.parallel.stages, one.cfg.parallel.microbatches) == (1, 1, 8)
    v = shrunk_layout(TrainConfig.build(model, stages=4, schedule="zbv", microbatches=8, device="cpu"), 3)
    assert v.cfg.parallel.schedule == "zbv" and v.cfg.parallel.stages == 3
    sharded = cfg.replace(zero=3)  # ZeRO-3 keeps two replicas to shard over, or lowers ZeRO on one (issue 44)
    assert shrunk_layout(sharded, 7).cfg.parallel.dp == 2 and shrunk_layout(sharded, 1).cfg.parallel.zero == 0


def test_a_shrunk_layout_keeps_its_context_parallel_ranks():
    from pipegpt.config import ModelConfig, TrainConfig
    from pipegpt.resilience.elastic import layout_text, shrunk_layout

    model = ModelConfig(vocab_size=256, seq_len=16, n_layer=8, n_head=4, n_embd=32)
    cfg = TrainConfig.build(model, stages=2, cp=2, microbatches=4, device="cpu")  # 4 ranks
    three = shrunk_layout(cfg, 3)  # a pipeline of one stage with its 2 cp ranks: the sequence cut stays
    assert (three.cfg.parallel.stages, three.cfg.parallel.cp, three.cfg.world_size) == (1, 2, 2)
    assert layout_text(three.cfg) == "dp 1 x pp 1 x cp 2 x tp 1, 1f1b, 4 microbatches"


@pytest.mark.slow
def test_a_lost_device_under_context_parallelism_shrinks_and_goes_on_like_a_manual_resume(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_pipegpt("run", "--stages", "2", "--cp", "2", "--microbatches", "2", "--steps", "6", "--save-every",
                       "2", "--max-restarts", "1", "--min-ranks", "2", "--run-dir", run_dir, timeout=300,
                       env=clean_env(PIPEGPT_FAULT="lose:3:4"))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    said = next(ln for ln in proc.stderr.splitlines() if ln.startswith("pipegpt: rank 3 failed"))
    assert "dp 1 x pp 2 x cp 2 x tp 1, 1f1b, 2 microbatches -> dp 1 x pp 1 x cp 2 x tp 1" in said, said
    rows = last_rows(run_dir)
    resumed = [s for s, r in rows.items() if r["attempt"] == 2]
    by_hand = run_pipegpt("run", "--resume", run_dir / "checkpoints" / "step-00000002", "--stages", "1",
                          "--run-dir", tmp_path / "manual", "--save-every", "0", timeout=300)
    assert by_hand.returncode == 0, by_hand.stderr
    expected = last_rows(tmp_path / "manual")
    assert sorted(expected) == sorted(resumed)
    for s in resumed:
        assert rows[s]["loss"] == pytest.approx(expected[s]["loss"], rel=1e-5), s


ISSUE_MODEL = ("--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--vocab-size", "256",
               "--threads-per-worker", "1")  # issue 44's T, one stage: the layout is each test's


@pytest.mark.slow
def test_a_frozen_rank_is_the_one_a_restart_names(tmp_path):
    """Issue 44: freeze:1:3 at dp 2 said "rank 0 failed at step 3 (CommError: rank 0: data-parallel gradient
    reduction failed ...)": rank 0's collective timed out (--timeout 8) before rank 1's heartbeat did (10 s)."""
    proc = run_pipegpt("run", *ISSUE_MODEL, "--stages", "1", "--dp", "2", "--steps", "4", "--microbatches", "2",
                       "--save-every", "2", "--max-restarts", "1", "--timeout", "8", "--run-dir", tmp_path / "run",
                       timeout=300, env=clean_env(PIPEGPT_FAULT="freeze:1:3"))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    said = [ln for ln in proc.stderr.splitlines() if " failed at step 3 " in ln]
    assert len(said) == 1 and said[0].startswith("pipegpt: rank 1 failed at step 3 (stopped answering"), said
    assert "restart 1 of 1, same layout" in said[0], said


@pytest.mark.slow
def test_a_lost_device_under_zero_3_shrinks_to_one_replica_with_zero_lowered(tmp_path):
    """Issue 44: at --dp 2 --zero 3, lose:1:3 said "no layout of this model and batch builds on 1 ranks" (rc 1);
    ZeRO lowered to 0 on the one replica left, the run goes on like a manual resume in that layout."""
    run_dir = tmp_path / "run"
    proc = run_pipegpt("run", *ISSUE_MODEL, "--stages", "1", "--dp", "2", "--zero", "3", "--steps", "6",
                       "--microbatches", "2", "--save-every", "2", "--max-restarts", "1", "--min-ranks", "1",
                       "--run-dir", run_dir, timeout=300, env=clean_env(PIPEGPT_FAULT="lose:1:3"))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    said = next(ln for ln in proc.stderr.splitlines() if ln.startswith("pipegpt: rank 1 failed at step 3"))
    assert ("dp 2 x pp 1 x tp 1, 1f1b, 2 microbatches -> dp 1 x pp 1 x tp 1, 1f1b, 4 microbatches, predicted step "
            "x2.00, ZeRO 3 -> 0 (one replica left to shard over)") in said, said
    assert "--zero 3 -> 0" in proc.stdout.splitlines(), proc.stdout
    rows = last_rows(run_dir)
    resumed = [s for s, r in rows.items() if r["attempt"] == 2]
    by_hand = run_pipegpt("run", "--resume", run_dir / "checkpoints" / "step-00000002", "--dp", "1", "--zero", "0",
                          "--microbatches", "4", "--run-dir", tmp_path / "manual", "--save-every", "0", timeout=300)
    assert by_hand.returncode == 0, by_hand.stderr
    expected = last_rows(tmp_path / "manual")
    assert sorted(expected) == sorted(resumed) == [3, 4, 5, 6]
    for s in resumed:
        assert rows[s]["loss"] == pytest.approx(expected[s]["loss"], rel=1e-5), s
