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
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from pipegpt.state import checkpoint

PENDING = "pending.json"  # the manifest without its files, written by the driver when the snapshot begins
SHA_SUFFIX = ".sha256"  # rank-N.safetensors.sha256: written after the file, so its presence means the file is whole


def snapshot_root(run_dir: Path) -> Path:
    """Where a run's snapshots live: a directory per run in /dev/shm (else the temporary directory), named by
    the run directory so that a restarted driver finds it."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return base / f"pipegpt-snapshots-{key}"


def begin(root: Path, step: int, manifest: dict) -> Path:
    """An empty snapshot directory for the state after `step` steps, with its pending manifest; snapshots
    older than the newest one before it are removed (that one is complete by now, or its writers are gone)."""
    directory = root / f".tmp-{checkpoint.DIR_PREFIX}{step:08d}"
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
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


def remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def _snapshots(root: Path) -> list[Path]:
    """The snapshot directories under root (being written, or committed), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.removeprefix(".tmp-").startswith(checkpoint.DIR_PREFIX)]
    return sorted(found, key=lambda p: p.name.removeprefix(".tmp-"))
