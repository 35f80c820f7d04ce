"""Checkpoints without a layout: tensors stored by their one-process names, resharded on load.

    RUN_DIR/checkpoints/step-00000100/
        manifest.json              step, model shape, config, tokenizer, the files; written last
        rank-00003.safetensors     what rank 3 owns: "param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>",
                                   "rng/<rank>" (and "cuda_rng/<rank>" on a GPU: pipegpt.state.rng);
                                   its metadata says which tensor-parallel shard each is, and for a
                                   ZeRO shard's piece where it starts in that shard (flattened) and its shape

Every rank writes only what it owns, in parallel (data-parallel replica 0 the parameters, each ZeRO shard
its pieces of the optimizer moments, and with ZeRO-3 of the parameters; a tp-replicated tensor once; the tied
embedding once; with experts over ep, each ep rank of edp index 0 its slice of a layer's stacked [E, ...]
experts, whose metadata says [ep rank, ep] and which load as the whole tensor, cut anew). A checkpoint is
first written into `.tmp-step-...` and renamed into place by the driver once every rank has written
and the manifest is down, so a crash or SIGKILL mid-save leaves the previous checkpoint the latest.
Loading reads, for each name this rank now owns, the shards that cover it, whatever layout wrote
them: 4 stages resume as 2 stages x tp 2, as dp 2 with ZeRO-1, or in one process. safetensors holds
tensors only: nothing in a checkpoint can run code.

Each file's SHA-256 is computed over the bytes as they are written (write_safetensors) and kept in the
manifest; read_manifest checks it before anything is loaded, so a flipped bit is refused in one line
naming the file. SHA-256 because hashlib always has it, OpenSSL computes it with the CPU's SHA
instructions where there are some, and `sha256sum rank-00003.safetensors` checks a file by hand.

The manifest is bound to its files too: its own fields carry a SHA-256 (fields_sha256), the tensors the files'
headers hold must be those its model has (none missing, none left over: a model edited to fewer layers would
otherwise load and drop the rest), and a checkpoint directory's name must be its step's.
"""
from __future__ import annotations

from pipegpt import run_files

import hashlib
import json
import math
import os
import shutil
import struct
from pathlib import Path

# Version 2 records a SHA-256 for every file and requires one; version 3 one of the manifest's own fields too.
# Version 1 manifests came before checksums (or carried them optionally) and still load, verified where they
# have them; every version is checked against its files' headers.
FORMAT, VERSION = "pipegpt-checkpoint", 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
DIR_PREFIX = "step-"
FIELDS_SHA256 = "fields_sha256"
# The tensors of a parameter, by key prefix ("param/<name>", ...); any other key (rng/<rank>) is not the model's.
TENSOR_KINDS = ("param", "exp_avg", "exp_avg_sq")


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
    """An empty temporary directory for the checkpoint after `step` steps. What interrupted saves left
    (`.tmp-step-*`, of any step: a save killed midway is never finished) is removed first."""
    root = Path(root)
    remove_unfinished(root)
    tmp = root / f".tmp-{DIR_PREFIX}{step:08d}"
    tmp.mkdir(parents=True)
    return tmp


def remove_unfinished(root: Path) -> None:
    """What interrupted saves left under root (`.tmp-step-*`): also when a run starts, as the space they hold
    may be what a full disk lacks."""
    root = Path(root)
    if root.is_dir():
        for stale in root.glob(f".tmp-{DIR_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)


# safetensors' dtype names (its format's spec)
_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
           "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str]) -> str:
    """A safetensors file of `tensors` (key -> tensor, any device) at `path`; returns the SHA-256 of the bytes
    written. Written here rather than by safetensors.torch.save_file: the hash is taken as each tensor goes
    out (no second read, no copy of the whole file in memory), a GPU tensor is copied to the host one at a
    time, and the file is created with open(), so it follows the umask (save_file's are 0600 whatever it is).
    The layout is safetensors' own: an 8-byte little-endian header length, a JSON header padded with spaces
    to 8 bytes, then the tensors' bytes back to back, the widest dtypes first so that each is aligned."""
    import torch

    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key in order:
        t = tensors[key]
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            digest.update(chunk)
        for key in order:
            data = tensors[key].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


def write_rank_file(directory: Path, rank: int, tensors: dict, shards: dict[str, list]) -> tuple[str, str]:
    """One rank's tensors (key -> tensor) with, per key, its tensor-parallel [tp_rank, tp_size], or for a piece
    of a ZeRO shard [tp_rank, tp_size, start, shape]: elements [start, start + numel) of that tp shard (of that
    shape) flattened; returns (the file's name, its SHA-256) for the manifest."""
    path = Path(directory) / rank_file_name(rank)
    partial = path.with_suffix(".partial")
    sha256 = write_safetensors(partial, tensors, {"shards": json.dumps(shards)})
    os.replace(partial, path)
    return path.name, sha256


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def commit(tmp: Path, manifest: dict, keep: int, checksums: dict[str, str] | None = None) -> Path:
    """Write the manifest, rename the directory into place, then keep only the newest `keep`.

    checksums: file name -> SHA-256 as the writers computed them; a file without one is hashed here.
    Only checkpoints of finite values are committed (the driver refuses the others before this), so
    the `keep` newest are the newest finite ones."""
    tmp = Path(tmp)
    files = sorted(p.name for p in tmp.glob("rank-*.safetensors"))
    checksums = dict(checksums or {})
    sha256 = {name: checksums.get(name) or file_sha256(tmp / name) for name in files}
    manifest = {"format": FORMAT, "version": VERSION, "files": files, "sha256": sha256, **manifest}
    manifest = json.loads(json.dumps(manifest, default=str))  # as read back: the checksum is of what a reader sees
    manifest[FIELDS_SHA256] = fields_sha256(manifest)
    try:
        with run_files.writing(tmp / MANIFEST):
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
            _fsync(tmp / MANIFEST)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # on a full disk its space is what the run lacks
        raise
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
    for root in (path / run_files.CHECKPOINTS, path):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory (give a run directory or a checkpoint)")
    if run_files.holds_run(path) or (path / run_files.CONFIG).is_file():  # a run that saved nothing (yet)
        raise CheckpointError(f"{path}: a run directory that holds no complete checkpoint: a run saves one after its "
                              f"last step (unless --no-save-final) and every --save-every N steps; let it finish, or "
                              f"train one: pipegpt run --run-dir NEW_DIR --save-every N ...")
    raise CheckpointError(f"{path}: not a checkpoint and holds no complete checkpoint "
                          f"(expected {MANIFEST} or checkpoints/{DIR_PREFIX}*/{MANIFEST})")


def read_manifest(checkpoint: Path, verify: bool = True) -> dict:
    """The manifest, after checking that every file it names is whole, that the tensors their headers hold are
    those of its model and its step that of its directory's name, and, with verify, that the files hold the bytes
    and the manifest the fields whose SHA-256 it records (every loader verifies: run --resume/--init-from in the
    driver before any worker starts, sample, convert, hellaswag; the workers then skip it)."""
    checkpoint = Path(checkpoint)
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{checkpoint / MANIFEST}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or \
            manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{checkpoint / MANIFEST}: not a {FORMAT} manifest of version "
                              f"{' or '.join(map(str, READABLE_VERSIONS))}")
    # Checkpoints written before checksums existed (version 1) may have no "sha256": they load on the size check.
    sha256 = manifest.get("sha256") or {}
    unsigned = [name for name in manifest["files"] if name not in sha256] if manifest["version"] >= 2 else []
    if unsigned:
        raise CheckpointError(f"{checkpoint / MANIFEST}: records no SHA-256 for {unsigned[0]} (every version "
                              f"{manifest['version']} manifest does): a hand-edited or damaged manifest; use another "
                              f"checkpoint")
    if not isinstance(manifest.get("step"), int) or manifest["step"] < 0:
        raise CheckpointError(f"{checkpoint / MANIFEST}: step {manifest.get('step')!r} is not a step count (an "
                              f"integer >= 0): a hand-edited or damaged manifest")
    _check_step_name(checkpoint, manifest)
    keys = set()
    for name in manifest["files"]:
        keys |= _check_whole(checkpoint / name)
        if verify and name in sha256:
            _check_sha256(checkpoint / name, sha256[name])
    _check_keys(checkpoint, manifest, keys)
    if verify and manifest["version"] >= 3 and manifest.get(FIELDS_SHA256) != fields_sha256(manifest):
        raise CheckpointError(f"{checkpoint / MANIFEST}: corrupt: its fields are not those whose SHA-256 it recorded "
                              f"when it was written (a hand-edited or damaged manifest); use another checkpoint")
    return manifest


def fields_sha256(manifest: dict) -> str:
    """The SHA-256 of a manifest's fields in a canonical JSON form: all but the checksums (the files' have their
    own check: a file replaced with its checksum fixed is refused by its tensors' names and shapes)."""
    fields = {k: v for k, v in manifest.items() if k not in (FIELDS_SHA256, "sha256")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_step_name(checkpoint: Path, manifest: dict) -> None:
    """A run's checkpoint directory is named for its step (step-00000080 holds step 80). Weights-only checkpoints
    (convert's, step 0, no optimizer) live under any name the user chose."""
    name = checkpoint.name
    digits = name.removeprefix(DIR_PREFIX)
    if manifest.get("optimizer", True) is not False and name.startswith(DIR_PREFIX) and digits.isdigit() \
            and int(digits) != manifest["step"]:
        raise CheckpointError(f"{checkpoint / MANIFEST}: step {manifest['step']}, but its directory is {name} (step "
                              f"{int(digits)}): a hand-edited manifest or a renamed directory; use another checkpoint")


def _check_keys(checkpoint: Path, manifest: dict, keys: set[str]) -> None:
    """The files hold every parameter the manifest's model has and nothing of a parameter it has not (what a
    manifest edited to fewer layers, or another model's files, would leave out silently). A manifest without
    usable model settings is refused where the model is built (model_config)."""
    from pipegpt.arch import buffer_shapes, head_shapes, named_shapes

    try:
        model = model_config(checkpoint, manifest)
    except CheckpointError:
        return
    names = set(named_shapes(model)) | set(buffer_shapes(model))
    # a tied lm_head is wte: a state dict's copy of it (write_weights of GPT.state_dict()) has its place
    aliases = {name for name, _ in head_shapes(model)} - names if model.tie_embeddings else set()
    held = {key for key in keys if key.split("/", 1)[0] in TENSOR_KINDS}
    extra = sorted((key for key in held if key.split("/", 1)[1] not in names | aliases),  # parameters first
                   key=lambda key: (TENSOR_KINDS.index(key.split("/", 1)[0]), key))
    missing = sorted(f"param/{name}" for name in names if f"param/{name}" not in held)
    shape = f"{model.n_layer}-layer, n_embd {model.n_embd}"
    if extra:
        shown = ", ".join(extra[:4]) + (f" and {len(extra) - 4} more" if len(extra) > 4 else "")
        raise CheckpointError(f"{checkpoint}: holds {len(extra)} tensors its manifest's model ({shape}) has no "
                              f"place for ({shown}): a hand-edited manifest or another model's files")
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CheckpointError(f"{checkpoint}: holds no {shown}, which its manifest's model ({shape}) has: a "
                              f"hand-edited manifest or another model's files")


def file_sha256(path: Path) -> str:
    digest, chunk = hashlib.sha256(), bytearray(1 << 20)  # hashlib.file_digest is Python 3.11+
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            digest.update(view[:n])
    return digest.hexdigest()


# Files verified in this process, by identity and the checksum they matched: the driver reads a
# checkpoint's manifest more than once (checked before the workers start, again to load), and hashing
# a large checkpoint twice would double the wait for nothing.
_verified: set[tuple] = set()


def _check_sha256(path: Path, expected: str) -> None:
    try:
        st = path.stat()
        identity = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, expected)
        if identity in _verified:
            return
        found = file_sha256(path)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable tensor file ({e.strerror or e})") from None
    if found != expected:
        raise CheckpointError(f"{path}: corrupt: its SHA-256 is {found[:12]}..., the manifest recorded "
                              f"{expected[:12]}... when it was written; use another checkpoint")
    _verified.add(identity)


def _check_whole(path: Path) -> set[str]:
    """A safetensors file whose header is well formed and whose size is what its header promises (a truncated
    copy is refused); the keys of the tensors it holds."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len)) if 8 + header_len <= size else None
    except (OSError, struct.error) as e:
        raise CheckpointError(f"{path}: unreadable tensor file ({e})") from None
    except ValueError as e:  # not JSON (or not UTF-8): a damaged header
        raise CheckpointError(f"{path}: corrupt: its header is not a safetensors header ({e}); use another "
                              f"checkpoint") from None
    if header is None:
        raise CheckpointError(f"{path}: truncated tensor file (its header says more than the file holds)")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt: its header is not a safetensors header (not a JSON object); use "
                              f"another checkpoint")
    tensors = {key: value for key, value in header.items() if key != "__metadata__"}
    bad = next((key for key, value in tensors.items() if _extent(value) is None), None)
    if bad is not None:  # a flipped byte in "__metadata__" makes it one of these
        raise CheckpointError(f"{path}: corrupt: its header is not a safetensors header ({bad[:60]!r} is no tensor "
                              f"entry); use another checkpoint")
    end = max(map(_extent, tensors.values()), default=0)
    if size != 8 + header_len + end:
        raise CheckpointError(f"{path}: truncated tensor file ({size} bytes, its header says {8 + header_len + end})")
    return set(tensors)


def _extent(entry) -> int | None:
    """Where a header entry's data ends; None where the entry is not what safetensors writes."""
    try:
        start, end = entry["data_offsets"]
        shape, dtype = entry["shape"], entry["dtype"]
    except (KeyError, TypeError, ValueError):
        return None
    fine = isinstance(start, int) and isinstance(end, int) and 0 <= start <= end and dtype in _DTYPES.values() \
        and isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
    return end if fine else None


def check_tensors(checkpoint: Path, model) -> None:
    """Every parameter and moment the model (a ModelConfig: the manifest's, or the run's) has is in the checkpoint,
    each shard of the shape that model gives it: a hand-edited manifest (n_embd changed) or a reshaped tensor is
    one line here, not a shape error in a worker. Only the files' headers are read."""
    import torch

    from pipegpt.arch import named_shapes
    from pipegpt.parallelisms import expert_param
    from pipegpt.tensor_parallel import shard_tensor

    reader = CheckpointReader(checkpoint, verify=False)
    params = {name: torch.empty(shape, device="meta") for name, shape in named_shapes(model).items()}
    optimizer = read_manifest(checkpoint, verify=False).get("optimizer", True)
    for name, p in params.items():
        for kind in ("param", "exp_avg", "exp_avg_sq") if optimizer else ("param",):
            key = f"{kind}/{name}"
            if not reader.has(key):
                raise CheckpointError(f"{checkpoint}: holds no {key}, which its manifest's model has: a hand-edited "
                                      f"manifest or another model's files")
            for tp_rank, (file, tp_size) in sorted(reader.where[key].items()):
                want = list((p.chunk(tp_size)[tp_rank] if expert_param(name) and tp_size > 1
                             else shard_tensor(name, p, tp_rank, tp_size, model.kv_heads)).shape)
                pieces = reader.pieces.get(key, {}).get(tp_rank)
                have = pieces[0][2] if pieces else reader._files[file].get_slice(key).get_shape()
                if list(have) != want:
                    raise CheckpointError(f"{checkpoint}: {key} is {list(have)} in {file}, but its manifest's model "
                                          f"needs {want}: a hand-edited manifest or a reshaped tensor")


def check_compatible(manifest: dict, model: dict, where: Path) -> None:
    """Refuse a checkpoint of another model shape, naming the settings that differ."""
    theirs = manifest["model"]
    keys = [*model, *(k for k in theirs if k not in model)]  # a setting either side leaves out is at its default
    diff = [f"{k}={theirs.get(k)!r} (this run: {model.get(k)!r})" for k in keys if theirs.get(k) != model.get(k)]
    if diff:
        raise CheckpointError(f"{where}: checkpoint of another model: {', '.join(diff)}")


# --------------------------------------------------------------------------------------------------------------
# Reading, by one-process name

def model_config(checkpoint: Path, manifest: dict):
    """The ModelConfig a checkpoint's manifest holds (a CheckpointError when its settings are unusable)."""
    from pipegpt.config import ConfigError, ModelConfig

    try:
        return ModelConfig(**manifest["model"]).validate()
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{checkpoint / MANIFEST}: no usable model settings ({e})") from None


class CheckpointReader:
    """The full (one-process) tensor of any name, gathered from whichever shards hold it."""

    def __init__(self, checkpoint: Path, verify: bool = True):
        from safetensors import safe_open

        self.checkpoint, self.where = Path(checkpoint), {}
        self.pieces: dict[str, dict[int, list]] = {}  # key -> tp rank -> [(file, start, shape)] (ZeRO shards)
        self._files = {}
        manifest = read_manifest(checkpoint, verify)
        # Llama's k and v shards are split by kv head (pipegpt.tensor_parallel.layout): their count comes from the
        # model that wrote them (n_kv_head None or absent: one per query head).
        model = manifest.get("model") or {}
        self.kv_heads = model.get("n_kv_head") or model.get("n_head")
        for name in manifest["files"]:
            f = safe_open(str(self.checkpoint / name), framework="pt")
            self._files[name] = f
            for key, (tp_rank, tp_size, *piece) in json.loads(f.metadata()["shards"]).items():
                self.where.setdefault(key, {})[tp_rank] = (name, tp_size)
                if piece:
                    self.pieces.setdefault(key, {}).setdefault(tp_rank, []).append((name, piece[0], piece[1]))

    def has(self, key: str) -> bool:
        return key in self.where

    def full(self, key: str, name: str):
        """The one-process tensor stored under `key` ("param/<name>", "exp_avg/<name>", ...)."""
        import torch

        from pipegpt.parallelisms import expert_param
        from pipegpt.tensor_parallel import gather_full

        parts = self.where.get(key)
        if parts is None:
            raise CheckpointError(f"{self.checkpoint}: holds no {key}")
        tp_size = next(iter(parts.values()))[1]
        if sorted(parts) != list(range(tp_size)):
            raise CheckpointError(f"{self.checkpoint}: {key} has shards {sorted(parts)} of {tp_size}")
        pieces = self.pieces.get(key, {})
        shards = [self._joined(key, pieces[r]) if r in pieces else self._files[parts[r][0]].get_tensor(key)
                  for r in range(tp_size)]
        if tp_size > 1 and expert_param(name):  # experts written per ep rank: the slices of [E, ...] in order
            return torch.cat(shards)
        return shards[0] if tp_size == 1 else gather_full(name, shards, self.kv_heads)

    def shard(self, key: str, name: str, tp_rank: int, tp_size: int):
        """Rank tp_rank's tensor-parallel shard (of tp_size) of the tensor stored under `key`, whatever the tp
        layout that wrote it."""
        from pipegpt.tensor_parallel import shard_tensor

        return shard_tensor(name, self.full(key, name), tp_rank, tp_size, self.kv_heads)
    def _joined(self, key: str, pieces: list):
        """A tp shard from the pieces ZeRO shards wrote of it, which must cover it end to end."""
        import torch

        shape, at, parts = pieces[0][2], 0, []
        for file, start, _ in sorted(pieces, key=lambda piece: piece[1]):
            if start != at:
                raise CheckpointError(f"{self.checkpoint}: {key}'s pieces leave elements {at}..{start} out")
            parts.append(self._files[file].get_tensor(key).reshape(-1))
            at += parts[-1].numel()
        if at != math.prod(shape):
            raise CheckpointError(f"{self.checkpoint}: {key}'s pieces hold {at} of its {math.prod(shape)} elements")
        return torch.cat(parts).view(shape)


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
    name, sha256 = write_rank_file(tmp, 0, tensors, {key: [0, 1] for key in tensors})
    return commit(tmp, {"step": 0, "world_size": 1, "optimizer": False, "plan": None, **manifest}, keep=0,
                  checksums={name: sha256})


def read_weights(checkpoint: Path) -> dict:
    """Every parameter a checkpoint holds, as a one-process state dict {name: tensor}, whatever layout wrote it."""
    reader = CheckpointReader(checkpoint)
    names = sorted(key.removeprefix("param/") for key in reader.where if key.startswith("param/"))
    return {name: reader.full(f"param/{name}", name) for name in names}
