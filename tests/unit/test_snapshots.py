"""--snapshot-every's files (pipegpt.state.snapshot): a snapshot is taken only when every rank's file is whole,
only when newer than the checkpoint on disk, and then loads as a checkpoint naming its run."""
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
