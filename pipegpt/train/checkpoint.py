"""Checkpoints without a layout: tensors stored by their one-process names, resharded on load.

    RUN_DIR/checkpoints/step-00000100/
        manifest.json              step, model shape, config, tokenizer, the files; written last
        rank-00003.safetensors     what rank 3 owns: "param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>",
                                   "rng/<rank>"; its metadata says which tensor-parallel shard each is

Every rank writes only what it owns, in parallel (data-parallel replica 0 the parameters, each ZeRO-1
shard its optimizer moments; a tp-replicated tensor once; the tied embedding once). A checkpoint is
first written into `.tmp-step-...` and renamed into place by the driver once every rank has written
and the manifest is down, so a crash or SIGKILL mid-save leaves the previous checkpoint the latest.
Loading reads, for each name this rank now owns, the shards that cover it, whatever layout wrote
them: 4 stages resume as 2 stages x tp 2, as dp 2 with ZeRO-1, or in one process. safetensors holds
tensors only: nothing in a checkpoint can run code.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

FORMAT, VERSION = "pipegpt-checkpoint", 1
MANIFEST = "manifest.json"
DIR_PREFIX = "step-"


class CheckpointError(ValueError):
    """A path is not a usable checkpoint (one line naming the file and the problem)."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------------------
# Writing

def begin(root: Path, step: int) -> Path:
    """An empty temporary directory for the checkpoint after `step` steps (a stale one is cleared)."""
    tmp = Path(root) / f".tmp-{DIR_PREFIX}{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_rank_file(directory: Path, rank: int, tensors: dict, shards: dict[str, list[int]]) -> None:
    """One rank's tensors (key -> tensor) with, per key, its tensor-parallel [tp_rank, tp_size]."""
    from safetensors.torch import save_file

    path = Path(directory) / f"rank-{rank:05d}.safetensors"
    partial = path.with_suffix(".partial")
    save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, str(partial),
              metadata={"shards": json.dumps(shards)})
    _fsync(partial)
    os.replace(partial, path)


def commit(tmp: Path, manifest: dict, keep: int) -> Path:
    """Write the manifest, rename the directory into place, then keep only the newest `keep`."""
    tmp = Path(tmp)
    manifest = {"format": FORMAT, "version": VERSION,
                "files": sorted(p.name for p in tmp.glob("rank-*.safetensors")), **manifest}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
    _fsync(tmp / MANIFEST)
    final = tmp.with_name(tmp.name.removeprefix(".tmp-"))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)
    if keep > 0:
        for old in complete_checkpoints(final.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------------------------
# Finding and checking

def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under root that have a manifest, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(DIR_PREFIX) and (p / MANIFEST).is_file())


def resolve(path) -> Path:
    """A checkpoint directory, or the latest complete one of a run directory (or of its checkpoints/)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory (give a run directory or a checkpoint)")
    raise CheckpointError(f"{path}: not a checkpoint and holds no complete checkpoint "
                          f"(expected {MANIFEST} or checkpoints/{DIR_PREFIX}*/{MANIFEST})")


def read_manifest(checkpoint: Path) -> dict:
    """The manifest, after checking that every file it names is whole."""
    checkpoint = Path(checkpoint)
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{checkpoint / MANIFEST}: unreadable manifest ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{checkpoint / MANIFEST}: not a {FORMAT} version {VERSION} manifest")
    for name in manifest["files"]:
        _check_whole(checkpoint / name)
    return manifest


def _check_whole(path: Path) -> None:
    """A safetensors file whose size is what its header promises (a truncated copy is refused)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len)) if 8 + header_len <= size else None
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable tensor file ({e})") from None
    if header is None:
        raise CheckpointError(f"{path}: truncated tensor file (its header says more than the file holds)")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size != 8 + header_len + end:
        raise CheckpointError(f"{path}: truncated tensor file ({size} bytes, its header says {8 + header_len + end})")


def check_compatible(manifest: dict, model: dict, where: Path) -> None:
    """Refuse a checkpoint of another model shape, naming the settings that differ."""
    theirs = manifest["model"]
    diff = [f"{k}={theirs.get(k)!r} (this run: {model[k]!r})" for k in model if theirs.get(k) != model[k]]
    if diff:
        raise CheckpointError(f"{where}: checkpoint of another model: {', '.join(diff)}")


# --------------------------------------------------------------------------------------------------------------
# Reading, by one-process name

class CheckpointReader:
    """The full (one-process) tensor of any name, gathered from whichever shards hold it."""

    def __init__(self, checkpoint: Path):
        from safetensors import safe_open

        self.checkpoint, self.where = Path(checkpoint), {}
        self._files = {}
        for name in read_manifest(checkpoint)["files"]:
            f = safe_open(str(self.checkpoint / name), framework="pt")
            self._files[name] = f
            for key, (tp_rank, tp_size) in json.loads(f.metadata()["shards"]).items():
                self.where.setdefault(key, {})[tp_rank] = (name, tp_size)

    def has(self, key: str) -> bool:
        return key in self.where

    def full(self, key: str, name: str):
        """The one-process tensor stored under `key` ("param/<name>", "exp_avg/<name>", ...)."""
        from pipegpt.tensor_parallel import gather_full

        parts = self.where.get(key)
        if parts is None:
            raise CheckpointError(f"{self.checkpoint}: holds no {key}")
        tp_size = next(iter(parts.values()))[1]
        if sorted(parts) != list(range(tp_size)):
            raise CheckpointError(f"{self.checkpoint}: {key} has shards {sorted(parts)} of {tp_size}")
        shards = [self._files[parts[r][0]].get_tensor(key) for r in range(tp_size)]
        return shards[0] if tp_size == 1 else gather_full(name, shards)


# --------------------------------------------------------------------------------------------------------------
# Weights only, in one process (pipegpt convert, pipegpt sample)

def write_weights(out: Path, state_dict: dict, manifest: dict) -> Path:
    """A weights-only checkpoint of a one-process state dict ({name: tensor}; tied: `wte.weight` only) at `out`,
    atomically: written into `.tmp-<name>` beside it, then renamed into place by commit(). `manifest` adds
    the model, the tokenizer, ...; the step is 0 and "optimizer" false (so --resume refuses it)."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise CheckpointError(f"{out}: already exists: choose a new path for the checkpoint")
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {f"param/{name}": t for name, t in state_dict.items()}
    write_rank_file(tmp, 0, tensors, {key: [0, 1] for key in tensors})
    return commit(tmp, {"step": 0, "world_size": 1, "optimizer": False, "plan": None, **manifest}, keep=0)


def read_weights(checkpoint: Path) -> dict:
    """Every parameter a checkpoint holds, as a one-process state dict {name: tensor}, whatever layout wrote it."""
    reader = CheckpointReader(checkpoint)
    names = sorted(key.removeprefix("param/") for key in reader.where if key.startswith("param/"))
    return {name: reader.full(f"param/{name}", name) for name in names}
