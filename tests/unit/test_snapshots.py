"""--snapshot-every's files (pipegpt.state.snapshot): a snapshot is taken only when every rank's file is whole,
only when newer than the checkpoint on disk, and then loads as a checkpoint naming its run; they belong to
the driver that took them, and are swept once it is gone."""
import json

import pytest
import torch

from pipegpt.state import checkpoint, snapshot


def _snapshot(root, step, ranks_done, world=2):
    directory = snapshot.begin(root, step, {"step": step, "world_size": world, "run_dir": "/runs/a"})
    for rank in ranks_done:
        name, sha = checkpoint.write_rank_file(directory, rank, {"param/w": torch.full((2,), float(step))},
                                               {"param/w": [0, 1]})
        snapshot.write_checksum(directory, name, sha)
    return directory


def test_the_newest_whole_snapshot_is_committed_and_a_half_written_one_is_not(tmp_path):
    root = tmp_path / "snapshots"
    _snapshot(root, 4, [0, 1])
    _snapshot(root, 5, [0])  # rank 1 died while writing its copy
    assert snapshot.newest_complete(root, after_step=5) is None
    found = snapshot.newest_complete(root, after_step=3)
    assert found == root / "step-00000004"
    manifest = checkpoint.read_manifest(found)  # checksums verified
    assert manifest["step"] == 4 and manifest["run_dir"] == "/runs/a" and len(manifest["files"]) == 2
    assert checkpoint.resolve(found) == found
    assert snapshot.newest_complete(root, after_step=4) is None  # not newer than the checkpoint on disk


def test_only_the_two_newest_snapshots_stay(tmp_path):
    root = tmp_path / "snapshots"
    for step in (1, 2, 3, 4):
        _snapshot(root, step, [0, 1])
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-00000003", ".tmp-step-00000004"]
    snapshot.remove(root)
    assert not root.exists()


def test_snapshots_live_in_shared_memory_by_run(tmp_path):
    a, b = snapshot.snapshot_root(tmp_path / "a"), snapshot.snapshot_root(tmp_path / "b")
    assert a != b and a == snapshot.snapshot_root(tmp_path / "x" / ".." / "a")
    assert str(a).startswith("/dev/shm/") or not str(a).startswith("/dev/")


# --------------------------------------------------------------------------------------------------------------
# snapshots belong to one driver (and its restarts): never taken by another run, swept once their driver is gone

@pytest.fixture
def shm(tmp_path, monkeypatch):
    """Shared memory stood in for by a directory of the test's own (the sweep looks at every root in it)."""
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setattr(snapshot, "_base", lambda: base)
    return base


def _gone_identity():
    """The identity of a process that ran and has ended."""
    import subprocess
    import sys

    from pipegpt.state.owner import process_identity

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    identity = process_identity(proc.pid)
    proc.kill()
    proc.wait()
    return identity


def test_a_drivers_snapshots_are_its_own_under_a_run_id_the_run_directory_records(shm, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert snapshot.own_root(run) is None  # it took none
    root = snapshot.claim_root(run)
    record = json.loads((run / "snapshots.json").read_text())
    assert root.parent == shm and root.name == f"pipegpt-snapshots-{record['run_id']}"
    assert snapshot.own_root(run) == root == snapshot.snapshot_root(run) == snapshot.claim_root(run)
    assert record["owner"] == json.loads((root / "owner.json").read_text())
    # the same directory, another driver (a later run there: --overwrite, --resume): none of these are its
    (run / "snapshots.json").write_text(json.dumps({**record, "owner": _gone_identity()}))
    assert snapshot.own_root(run) is None
    assert snapshot.claim_root(run) not in (root, None)  # a root of its own, under a new run id


def test_the_sweep_removes_the_snapshots_whose_driver_is_gone(shm, tmp_path):
    (tmp_path / "run").mkdir()
    mine = snapshot.claim_root(tmp_path / "run")
    _snapshot(mine, 3, [0, 1])
    dead = shm / "pipegpt-snapshots-0123456789abcdef"
    _snapshot(dead, 51, [0, 1])
    (dead / "owner.json").write_text(json.dumps(_gone_identity()))
    unknown = shm / "pipegpt-snapshots-cbedd9220704"  # keyed by a path, from before owners were kept
    _snapshot(unknown, 7, [0, 1])
    assert snapshot.sweep() == [dead]
    assert not dead.exists() and (mine / ".tmp-step-00000003").is_dir() and unknown.is_dir()


def test_a_restart_keeps_only_the_snapshot_it_resumes(tmp_path):
    """What the failure left half-written (a later step) would otherwise count among the two newest and have
    the next attempt's own snapshots removed under its writers."""
    root = tmp_path / "snapshots"
    _snapshot(root, 3, [0, 1])
    _snapshot(root, 4, [0, 1])
    _snapshot(root, 5, [0])  # rank 1 died writing it
    taken = snapshot.newest_complete(root, after_step=0)
    snapshot.keep_only(root, taken)
    assert taken == root / "step-00000004" and sorted(p.name for p in root.iterdir()) == [taken.name]
    for step in (5, 6):  # the next attempt's
        _snapshot(root, step, [0, 1])
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-00000005", ".tmp-step-00000006"]
