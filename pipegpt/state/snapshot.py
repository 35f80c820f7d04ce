"""In-memory snapshots for restarts (--snapshot-every K, with --max-restarts).

Every K steps each rank copies what a checkpoint holds of it (weights, Adam moments, RNG streams; the step fixes
the data position) and writes the copy in a background thread into the host's shared memory (/dev/shm, a tmpfs:
RAM, no disk), as a checkpoint of the same format, so a restart loads it like any other (any layout). A rank's
death does not take the snapshot with it: the files belong to no process. A host's loss does; copies on a
peer host (Gemini, SOSP'23) are not built.

A snapshot is complete when every rank has written its file and its checksum next to it (rank-N.sha256); the
driver writes the manifest only when a restart takes it (commit), so a snapshot caught half-written is never
loaded. The driver keeps the newest two (the newer one may still be being written) and removes them all when
the run ends.

Snapshots belong to the driver that took them (and to its restarts, the same process after execve): a root
per run id, a new one for each `pipegpt run`, recorded in the run directory (snapshots.json) with the
driver's identity, which the root keeps too (owner.json). A restart takes only its own driver's snapshots;
another run, an --overwrite or a --resume of the directory never sees them. A driver killed outright leaves
its root behind (its workers die with it, by the lifeline): the next `pipegpt run` on the host removes every
root whose owner is gone (sweep).
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from pipegpt import run_files
from pipegpt.state import checkpoint, owner

PREFIX = "pipegpt-snapshots-"
OWNER = "owner.json"  # in a root: the identity of the driver whose snapshots it holds
PENDING = "pending.json"  # the manifest without its files, written by the driver when the snapshot begins
SHA_SUFFIX = ".sha256"  # rank-N.safetensors.sha256: written after the file, so its presence means the file is whole


def _base() -> Path:
    """Shared memory (/dev/shm, a tmpfs), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _record(run_dir: Path) -> dict:
    try:
        record = json.loads((Path(run_dir) / run_files.SNAPSHOTS).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def snapshot_root(run_dir: Path) -> Path:
    """Where a run directory's snapshots live: the root of the run id its snapshots.json names; for a directory
    that never took one, a name of its path (which no driver writes to)."""
    run_id = _record(run_dir).get("run_id")
    key = run_id if isinstance(run_id, str) and run_id.isalnum() else \
        hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return _base() / f"{PREFIX}{key}"


def own_root(run_dir: Path) -> Path | None:
    """This process's snapshots of run_dir (a restarted driver's too: execve keeps its identity); None where
    it took none there."""
    if _record(run_dir).get("owner") != owner.process_identity():
        return None
    return snapshot_root(run_dir)


def claim_root(run_dir: Path) -> Path:
    """The root this process's snapshots of run_dir go to: its own, else a new run id's, created with its
    owner and recorded in the run directory."""
    root = own_root(run_dir)
    if root is not None and root.is_dir():
        return root
    identity = owner.process_identity()
    root = _base() / f"{PREFIX}{secrets.token_hex(8)}"
    root.mkdir()
    try:
        run_files.write_whole(root / OWNER, json.dumps(identity))
        run_files.write_whole(Path(run_dir) / run_files.SNAPSHOTS,
                              json.dumps({"run_id": root.name.removeprefix(PREFIX), "owner": identity}))
    except OSError:  # a full disk: no root that nothing records
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def sweep() -> list[Path]:
    """Remove the roots whose owner is gone (a driver killed outright: nothing else removes them); those
    removed. A root without an owner (from before owners were kept, or being claimed) stays."""
    removed = []
    for root in _base().glob(f"{PREFIX}*"):
        try:
            identity = json.loads((root / OWNER).read_text())
            alive = owner.is_alive(identity)
        except (OSError, ValueError, TypeError):
            continue
        if not alive:
            shutil.rmtree(root, ignore_errors=True)
            removed.append(root)
    return removed


def begin(root: Path, step: int, manifest: dict) -> Path:
    """An empty snapshot directory for the state after `step` steps, with its pending manifest; snapshots
    older than the newest one before it are removed (that one is complete by now, or its writers are gone)."""
    directory = root / f".tmp-{checkpoint.DIR_PREFIX}{step:08d}"
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    with run_files.writing(directory / PENDING):
        (directory / PENDING).write_text(json.dumps(manifest, default=str))
    for old in _snapshots(root)[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return directory


def write_checksum(directory: Path, name: str, sha256: str) -> None:
    """A rank's file is whole: its checksum beside it (atomically, so a reader never sees half of it)."""
    tmp = directory / f".{name}{SHA_SUFFIX}"
    tmp.write_text(sha256)
    os.replace(tmp, directory / f"{name}{SHA_SUFFIX}")


def newest_complete(root: Path, after_step: int) -> Path | None:
    """The newest snapshot every rank finished, taken after more than `after_step` steps, committed as a
    checkpoint (its manifest written) so that --resume loads it; None if there is none."""
    for directory in reversed(_snapshots(root)):
        pending = directory / PENDING
        if not pending.is_file():
            continue
        manifest = json.loads(pending.read_text())
        if manifest["step"] <= after_step:
            return None
        sums = {p.name[:-len(SHA_SUFFIX)]: p.read_text() for p in directory.glob(f"rank-*{SHA_SUFFIX}")}
        if len(sums) == manifest["world_size"]:
            for p in directory.glob(f"rank-*{SHA_SUFFIX}"):
                p.unlink()
            pending.unlink()
            return checkpoint.commit(directory, manifest, keep=1, checksums=sums)
    return None


def keep_only(root: Path, kept: Path | None) -> None:
    """A restart's: every snapshot but the one it resumes goes (older ones, and those the failure left
    half-written, which would otherwise count among the newest two); the workers are gone by then."""
    for directory in _snapshots(root):
        if directory != kept:
            shutil.rmtree(directory, ignore_errors=True)


def remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def _snapshots(root: Path) -> list[Path]:
    """The snapshot directories under root (being written, or committed), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.removeprefix(".tmp-").startswith(checkpoint.DIR_PREFIX)]
    return sorted(found, key=lambda p: p.name.removeprefix(".tmp-"))
