"""Token data: a built-in offline corpus and token files, memory-mapped.

The built-in corpus is the text of Python's own help topics
(`pydoc_data.topics.topics`), so a run needs no download.

open_tokens(path, split) reads a split ("train" or "val") of any of these, memory-mapped:
  - a directory made by `pipegpt prepare` (pipegpt.data.prepare): llm.c shards `train_000000.bin`, ...,
    `val_000000.bin`, ... and `meta.json` (tokenizer, vocabulary, token counts, max token id);
  - nanoGPT's directory: `train.bin` and `val.bin`, flat uint16 arrays;
  - llm.c's shards: `*_train_*.bin` / `*_val_*.bin` (or `*_train.bin`, `train_*.bin`): a header of 256
    int32 (magic 20240520, version 1, token count), then the uint16 tokens;
  - one file, flat uint16 (nanoGPT's train.bin) or one llm.c shard: the train split (no val split).
Several shards of a split read as one array (TokenShards), in file-name order.

No torch here, so `pipegpt prepare` runs without it.
"""
from __future__ import annotations

import functools
import json
import os
import re

import numpy as np

from pipegpt.data.tokenizers import ByteTokenizer, DataError

SHARD_MAGIC = 20240520       # llm.c's token shard: header of 256 int32 ...
SHARD_VERSION = 1            # ... version 1: uint16 tokens (llm.c's version 2 holds uint32 tokens)
SHARD_HEADER_INTS = 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
SPLITS = ("train", "val")
META_FILE = "meta.json"
SCAN_TOKENS = 1 << 30  # a split up to this size has its token ids scanned before a run (2 GiB: about a second)


@functools.lru_cache(maxsize=1)
def builtin_text() -> str:
    """Python's help topics, values joined in sorted key order (about 465k characters)."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size < 2**16 else np.uint32


def builtin_tokens(tokenizer) -> np.ndarray:
    """The built-in corpus as a flat token array (uint16 when the vocabulary allows)."""
    text = builtin_text()
    dtype = token_dtype(tokenizer.vocab_size)
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)
    return np.asarray(tokenizer.encode(text), dtype=dtype)


def write_token_file(path, tokens) -> None:
    """Write tokens as a flat uint16 file (the format load_token_file reads)."""
    arr = np.asarray(tokens)
    if arr.size and int(arr.max()) >= 2**16:
        raise DataError(f"token id {int(arr.max())} does not fit a uint16 token file")
    arr.astype(np.uint16).tofile(os.fspath(path))


def load_token_file(path) -> np.ndarray:
    """A flat uint16 token file (nanoGPT's train.bin format), memory-mapped read-only."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"token file {path!r} not found: expected a flat uint16 .bin file (nanoGPT format)")
    size = os.path.getsize(path)
    if size == 0 or size % 2:
        raise DataError(f"token file {path!r} has {size} bytes: expected a non-empty flat uint16 array")
    _refuse_damaged_shard(path, size)
    return np.memmap(path, dtype=np.uint16, mode="r")


def _refuse_damaged_shard(path: str, size: int) -> None:
    """An llm.c shard whose magic is wrong would read as flat tokens, its header as token ids (and be refused
    as ids above the vocabulary): a file whose header holds llm.c's version and exactly the token count its
    size implies is such a shard, so it is refused as one."""
    if size < SHARD_HEADER_BYTES:
        return
    with open(path, "rb") as f:
        magic, version, count = (int(v) for v in np.frombuffer(f.read(12), dtype="<i4"))
    per_token = {1: 2, 2: 4}.get(version)
    if magic != SHARD_MAGIC and per_token and count > 0 and size - SHARD_HEADER_BYTES == per_token * count:
        raise DataError(f"{path}: an llm.c token shard header (version {version}, {count} tokens) with magic "
                        f"{magic}, not {SHARD_MAGIC}: the file is damaged; make it again")


# --------------------------------------------------------------------------------------------------------------
# Token shards (llm.c's format), prepared directories, and one function that opens any of them: open_tokens

def shard_header(count: int) -> bytes:
    """The 1024-byte header of an llm.c token shard holding `count` uint16 tokens."""
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, count
    return header.tobytes()


def read_shard(path) -> np.ndarray:
    """One llm.c token shard, its header checked, its tokens memory-mapped read-only."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such token shard")
    size = os.path.getsize(path)
    if size < SHARD_HEADER_BYTES:
        raise DataError(f"{path}: {size} bytes, shorter than the {SHARD_HEADER_BYTES}-byte header of an llm.c "
                        f"token shard (magic {SHARD_MAGIC})")
    with open(path, "rb") as f:
        magic, version, count = (int(v) for v in np.frombuffer(f.read(12), dtype="<i4"))
    if magic != SHARD_MAGIC:
        raise DataError(f"{path}: header magic {magic}, not {SHARD_MAGIC}: not an llm.c token shard")
    if version != SHARD_VERSION:
        raise DataError(f"{path}: llm.c shard version {version}: only version {SHARD_VERSION} (uint16 tokens) "
                        f"is supported")
    have = size - SHARD_HEADER_BYTES
    if count < 0 or have != 2 * count:
        raise DataError(f"{path}: the header says {count} tokens ({2 * count} bytes) but the file holds {have} "
                        f"bytes of tokens: truncated or damaged; make it again")
    if count == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=SHARD_HEADER_BYTES, shape=(count,))


def _is_shard(path: str) -> bool:
    """A file read as an llm.c shard: it starts with the shard magic (a flat file that happens to start with
    these four bytes, tokens 15928 and 309, is read as a shard too, and then refused if it is not one)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and int(np.frombuffer(head, dtype="<i4")[0]) == SHARD_MAGIC


class TokenShards:
    """Several memory-mapped token arrays read as one, in order, without copying them.

    Supports what BatchSampler and RankLoader use: len(), `dtype`, and indexing by an int, a slice or an
    integer array of any shape (a window may span two shards: the shards are one token stream).
    """

    def __init__(self, parts, paths):
        self.parts = list(parts)
        self.paths = [os.fspath(p) for p in paths]
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts], dtype=np.int64)
        self.dtype = np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __repr__(self) -> str:
        return f"TokenShards({len(self)} tokens in {len(self.parts)} shards, first {self.paths[0]!r})"

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                return self[np.arange(start, stop, step)]
            pieces = [part[max(start, lo) - lo:min(stop, hi) - lo]
                      for part, lo, hi in zip(self.parts, self.offsets[:-1], self.offsets[1:])
                      if max(start, lo) < min(stop, hi)]
            return np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.dtype)
        idx = np.asarray(key)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"TokenShards indices must be integers, not {idx.dtype}")
        flat = idx.astype(np.int64).ravel()
        flat = np.where(flat < 0, flat + n, flat)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"index out of range for {n} tokens")
        which = np.searchsorted(self.offsets, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for s in np.unique(which):
            mask = which == s
            out[mask] = self.parts[s][flat[mask] - self.offsets[s]]
        return out.reshape(idx.shape) if idx.ndim else out[0]

    def __array__(self, dtype=None, copy=None):
        arr = self[:]
        return arr if dtype is None else arr.astype(dtype)

    def max(self) -> int:
        return max(int(p.max()) for p in self.parts if len(p))


_SPLIT_FILE = re.compile(r"^(?:(?P<prefix>.+)_)?(?P<split>train|val)(?:_(?P<index>\d+))?\.bin$")


def _split_files(directory: str, split: str) -> list[str]:
    """The files of one split in a directory without meta.json, in shard order."""
    found = []
    for name in os.listdir(directory):
        m = _SPLIT_FILE.match(name)
        if m and m["split"] == split and os.path.isfile(os.path.join(directory, name)):
            found.append((m["prefix"] or "", int(m["index"]) if m["index"] else -1, name))
    return [os.path.join(directory, name) for *_, name in sorted(found)]


def read_meta(directory) -> dict | None:
    """A prepared directory's meta.json (None if it has none), checked to be whole."""
    path = os.path.join(os.fspath(directory), META_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
        meta["splits"]["train"]["tokens"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a pipegpt prepare meta.json ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:120]}); prepare the directory again") from None
    if not meta.get("complete"):
        raise DataError(f"{path}: this `pipegpt prepare` did not finish (meta.json says so): run it again "
                        f"into an empty directory")
    return meta


def _max_id(tokens) -> int:
    return tokens.max() if isinstance(tokens, TokenShards) else int(np.max(tokens))


def open_tokens(path, split: str = "train", *, vocab_size: int | None = None, seq_len: int | None = None,
                tokenizer: str | None = None):
    """One split of token data, memory-mapped: a numpy array (one file) or TokenShards (several).

    `path` is a directory (`pipegpt prepare`'s, nanoGPT's train.bin/val.bin, or llm.c shards) or one file
    (flat uint16 or one llm.c shard: the train split). A missing "val" split gives None; a missing "train"
    split is an error. Given, these are checked too (a DataError naming the file otherwise):
    `vocab_size`: every token id is below it (meta.json's max id where there is one, else the max over the
    tokens); `seq_len`: there is at least one window of seq_len + 1 tokens; `tokenizer`: the one meta.json
    names, if it names one.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or directory (expected a directory from `pipegpt prepare`, "
                        f"nanoGPT's train.bin/val.bin, llm.c shards, or one flat uint16 token file)")
    meta, source = None, path
    if os.path.isdir(path):
        meta = read_meta(path)
        if meta is not None:
            source = os.path.join(path, META_FILE)
            entry = meta["splits"].get(split) or {"tokens": 0, "shards": []}
            files = [os.path.join(path, name) for name in entry.get("shards", [])]
            parts = [read_shard(f) for f in files]
            have = sum(len(p) for p in parts)
            if have != entry["tokens"]:
                raise DataError(f"{source}: says {entry['tokens']} {split} tokens but its shards hold {have}: "
                                f"prepare the directory again")
        else:
            files = _split_files(path, split)
            parts = [load_token_file(f) if os.path.basename(f) == f"{split}.bin" else read_shard(f) for f in files]
        if not files or not sum(len(p) for p in parts):
            if split != "train":
                return None
            raise DataError(f"{path}: no train tokens: expected train_*.bin shards and meta.json "
                            f"(pipegpt prepare), train.bin (nanoGPT) or *_train_*.bin shards (llm.c)")
    else:
        if split != "train":
            return None  # one file is the train split
        files = [path]
        parts = [read_shard(path) if _is_shard(path) else load_token_file(path)]
        if not len(parts[0]):
            raise DataError(f"{path}: holds no tokens")
    tokens = parts[0] if len(parts) == 1 else TokenShards(parts, files)

    if tokenizer is not None and meta is not None and meta.get("tokenizer") not in (None, tokenizer):
        raise DataError(f"{source}: prepared with tokenizer {meta['tokenizer']!r}, but the tokenizer is "
                        f"{tokenizer!r}: use --tokenizer {meta['tokenizer']}")
    if vocab_size is not None:
        recorded = meta["splits"].get(split, {}).get("max_token_id") if meta is not None else None
        # meta.json's max id holds for shards no newer than it; a shard written since is scanned itself. Up to
        # SCAN_TOKENS (under a second) the others are scanned too: meta.json may not describe them (edited, or
        # shards replaced with their times kept).
        fresh = recorded is not None and not any(os.path.getmtime(f) > os.path.getmtime(source) for f in files)
        scan = not fresh or len(tokens) <= SCAN_TOKENS
        checks = ([(source, int(recorded))] if fresh else []) + \
            ([(f, _max_id(p)) for f, p in zip(files, parts) if len(p)] if scan else [])
        for where, top in checks:
            if top >= vocab_size:
                named = f" (tokenizer {meta['tokenizer']})" if meta and meta.get("tokenizer") else ""
                wrong = f"; {META_FILE} says {recorded} is the largest" if where != source and recorded is not None \
                    and top > int(recorded) else ""
                raise DataError(f"{where}: token id {top}{named} is not below the model's vocabulary size "
                                f"{vocab_size}{wrong}: use the tokenizer the data was made with (--tokenizer) or a "
                                f"larger --vocab-size")
    if seq_len is not None and len(tokens) < seq_len + 1:
        raise DataError(f"{path}: {len(tokens)} {split} tokens are too few for seq_len={seq_len}: "
                        f"need at least {seq_len + 1}")
    return tokens
