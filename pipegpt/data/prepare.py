"""`pipegpt prepare`: text files -> uint16 token shards in llm.c's format, split into train and val.

    prepare(["a.txt", "b.txt"], "data/mine", tokenizer="gpt2", val_fraction=0.01)

writes `data/mine/train_000000.bin`, ..., `data/mine/val_000000.bin`, ... and `data/mine/meta.json`.
pipegpt.data.tokens.open_tokens reads them back (`pipegpt run --data data/mine`).

Documents: each input file is one document. With a tokenizer that has an end-of-text token (gpt2: 50256),
every document starts with it, as in llm.c's shards, so the model sees where documents begin; the bytes
tokenizer has none, and its documents follow each other as they are. So decoding all train tokens and then
all val tokens gives back "".join(EOT + text for text in texts), EOT being "<|endoftext|>" or "".

The split is by position: val is the tail of the concatenated input, from a line start near the byte
(1 - val_fraction) of the way through it (the first line start after that byte in its ~1 MiB chunk, else the
last one before it, else that byte itself, moved to a character boundary). By position rather than by document, so one long file (a book, a dump) splits too and the val
fraction holds whatever the file sizes; no text is in both splits, and the split is known before tokenizing
starts, so the input is read once and shards are written as tokens come (memory stays at a chunk). A long file
is tokenized in chunks of about 1 MiB cut at line ends, which can tokenize a run of newlines across a cut as
two tokens instead of one; decoding is unchanged.

Shard format (llm.c): a header of 256 int32, little-endian (magic 20240520, version 1, token count, zeros),
then the tokens as uint16. Each shard is written under a temporary name and renamed when whole, and meta.json
says `"complete": false` until the end, so an interrupted prepare never leaves a shard or a directory that
reads as whole. Nothing here imports torch.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterable, Sequence

import numpy as np

from pipegpt.data.tokenizers import ByteTokenizer, DataError, get_tokenizer
from pipegpt.data.tokens import META_FILE, SHARD_HEADER_BYTES, SPLITS, shard_header

DEFAULT_VAL_FRACTION = 0.01
DEFAULT_SHARD_TOKENS = 100_000_000  # llm.c's shard size: 200 MB of uint16
CHUNK_BYTES = 1 << 20
FORMAT = ("llm.c token shards: a header of 256 little-endian int32 (magic 20240520, version 1, token count), "
          "then the tokens as little-endian uint16")


class ShardWriter:
    """Tokens of one split into `{split}_000000.bin`, ... of at most `shard_tokens` tokens each."""

    def __init__(self, out_dir: str, split: str, shard_tokens: int):
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.names: list[str] = []
        self.tokens = 0
        self.max_token_id: int | None = None
        self._file = None
        self._in_shard = 0

    def _path(self, index: int) -> str:
        return os.path.join(self.out_dir, f"{self.split}_{index:06d}.bin")

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype="<u2")
        if not tokens.size:
            return
        top = int(tokens.max())
        self.max_token_id = top if self.max_token_id is None else max(self.max_token_id, top)
        pos = 0
        while pos < tokens.size:
            if self._file is None:
                self._file = open(self._path(len(self.names)) + ".tmp", "wb")
                self._file.write(bytes(SHARD_HEADER_BYTES))
                self._in_shard = 0
            take = min(tokens.size - pos, self.shard_tokens - self._in_shard)
            self._file.write(tokens[pos:pos + take].tobytes())
            self._in_shard += take
            self.tokens += take
            pos += take
            if self._in_shard == self.shard_tokens:
                self._close()

    def _close(self) -> None:
        f, self._file = self._file, None
        f.seek(0)
        f.write(shard_header(self._in_shard))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        final = self._path(len(self.names))
        os.replace(final + ".tmp", final)
        self.names.append(os.path.basename(final))

    def finish(self) -> None:
        if self._file is not None:
            self._close()

    def abort(self) -> None:
        """Drop the shard being written (its temporary file); whole shards stay."""
        if self._file is not None:
            f, self._file = self._file, None
            f.close()
            _remove(self._path(len(self.names)) + ".tmp")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _chunks(path: str) -> Iterable[bytes]:
    """A file in pieces of about CHUNK_BYTES that end at a line end (or at the end of the file)."""
    with open(path, "rb") as f:
        while True:
            data = f.read(CHUNK_BYTES)
            if not data:
                return
            if not data.endswith(b"\n"):
                data += f.readline()
            yield data


def _cut(data: bytes, at: int) -> int:
    """Where val starts in a chunk cut near its byte `at`: the first line start in [at, len(data)), else the
    last one in (0, at), else `at` itself moved forward to the start of a UTF-8 character."""
    if at <= 0:
        return 0
    after = data.find(b"\n", max(at - 1, 0), len(data) - 1)
    if after >= 0:
        return after + 1
    before = data.rfind(b"\n", 0, max(at - 1, 0))
    if before >= 0:
        return before + 1
    while at < len(data) and 0x80 <= data[at] < 0xC0:
        at += 1
    return at


def _check_out_dir(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"{out}: exists and is not a directory")
    if os.path.isdir(out):
        taken = sorted(n for n in os.listdir(out)
                       if n in (META_FILE, META_FILE + ".tmp")
                       or (n.split("_")[0] in SPLITS and (n.endswith(".bin") or n.endswith(".bin.tmp"))))
        if taken:
            raise DataError(f"{out}: already holds prepared tokens ({', '.join(taken[:3])}"
                            f"{', ...' if len(taken) > 3 else ''}): remove them or choose another --out")


def input_bytes(inputs: Sequence) -> int:
    return sum(os.path.getsize(os.fspath(p)) for p in inputs)


def check_prepare(inputs: Sequence, out, tokenizer: str = "bytes", val_fraction: float = DEFAULT_VAL_FRACTION,
                  shard_tokens: int = DEFAULT_SHARD_TOKENS):
    """Everything prepare() refuses before it writes anything; returns the tokenizer."""
    inputs = [os.fspath(p) for p in inputs]
    out = os.fspath(out)
    if not inputs:
        raise DataError("no input files: give one or more text files")
    for p in inputs:
        if not os.path.isfile(p):
            raise DataError(f"{p}: no such file")
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} must be at least 0 and below 1")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens={shard_tokens} must be >= 1")
    tok = get_tokenizer(tokenizer)
    if tok.vocab_size > 2**16:
        raise DataError(f"tokenizer {tokenizer!r} has {tok.vocab_size} tokens: more than uint16 shards hold")
    _check_out_dir(out)
    return tok


def prepare(inputs: Sequence, out, tokenizer: str = "bytes", val_fraction: float = DEFAULT_VAL_FRACTION,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, on_bytes: Callable[[int], None] = lambda n: None) -> dict:
    """Tokenize `inputs` (text files, UTF-8, one document each) into shards under `out`; returns meta.json's
    content. `on_bytes(n)` is told of every n input bytes done (a progress bar)."""
    inputs = [os.fspath(p) for p in inputs]
    out = os.fspath(out)
    tok = check_prepare(inputs, out, tokenizer, val_fraction, shard_tokens)
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)

    total = input_bytes(inputs)
    cut = total - int(round(val_fraction * total)) if val_fraction > 0 else total + 1
    meta = {"format": FORMAT, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot_token": tok.eot_token,
            "documents": len(inputs), "val_fraction": val_fraction, "shard_tokens": shard_tokens,
            "complete": False}
    meta_path = os.path.join(out, META_FILE)
    _write_json(meta_path, meta)

    writers = {split: ShardWriter(out, split, shard_tokens) for split in SPLITS}

    def encode(text_bytes: bytes, where: str, offset: int) -> np.ndarray:
        try:
            text = text_bytes.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not UTF-8 text (byte {offset + e.start}: {e.reason})") from None
        if isinstance(tok, ByteTokenizer):
            return np.frombuffer(text_bytes, dtype=np.uint8).astype("<u2")
        return np.asarray(tok.encode(text), dtype="<u2")

    seen = 0  # bytes of input before the current chunk
    split = "train"
    try:
        for path in inputs:
            if tok.eot_token is not None:
                writers[split].write(np.array([tok.eot_token], dtype="<u2"))
            in_file = 0
            for data in _chunks(path):
                if split == "train" and seen + len(data) > cut:
                    at = _cut(data, cut - seen)
                    writers["train"].write(encode(data[:at], path, in_file))
                    split = "val"
                    writers["val"].write(encode(data[at:], path, in_file + at))
                else:
                    writers[split].write(encode(data, path, in_file))
                seen += len(data)
                in_file += len(data)
                on_bytes(len(data))
        for w in writers.values():
            w.finish()
        if not writers["train"].tokens:
            raise DataError(f"{', '.join(inputs)}: no text to tokenize" if not seen else
                            f"all {writers['val'].tokens} tokens went to val: use a smaller --val-fraction")
    except BaseException:  # a bad input or Ctrl-C: remove what this prepare wrote
        for w in writers.values():
            w.abort()
            for name in w.names:
                _remove(os.path.join(out, name))
        _remove(meta_path)
        if created:
            try:
                os.rmdir(out)
            except OSError:
                pass
        raise
    meta["splits"] = {split: {"tokens": w.tokens, "shards": w.names, "max_token_id": w.max_token_id}
                      for split, w in writers.items()}
    meta["max_token_id"] = max(w.max_token_id for w in writers.values() if w.max_token_id is not None)
    meta["complete"] = True
    _write_json(meta_path, meta)
    return meta
