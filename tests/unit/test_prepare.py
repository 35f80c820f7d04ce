"""`pipegpt prepare` (text -> llm.c token shards + meta.json), reading every supported layout back with
open_tokens, the one-line DataError of each bad input, and `pipegpt run --data DIR` as a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import ROOT, assert_one_line_error, invoke, run_pipegpt
from pipegpt.data.tokenizers import ByteTokenizer, DataError, get_tokenizer
from pipegpt.data.tokens import SHARD_MAGIC, TokenShards, open_tokens, write_token_file
from pipegpt.data.prepare import prepare

TEXTS = [
    "First document.\nIt has two lines.\n",
    "Zweites Dokument: ünïcödé → ∞ 🐍\n" * 20,
    "def third(x):\n    return x + 1\n" * 40,
]


@pytest.fixture
def texts(tmp_path) -> list[Path]:
    paths = []
    for i, text in enumerate(TEXTS):
        p = tmp_path / f"doc{i}.txt"
        p.write_bytes(text.encode("utf-8"))
        paths.append(p)
    return paths


def _prepare_cli(*args) -> "click.testing.Result":  # noqa: F821
    return invoke("prepare", *args)


def _shard_bytes(tokens, magic=SHARD_MAGIC, version=1, count=None) -> bytes:
    header = np.zeros(256, dtype="<i4")
    tokens = np.asarray(tokens, dtype="<u2")
    header[:3] = magic, version, len(tokens) if count is None else count
    return header.tobytes() + tokens.tobytes()


def _one_line_error(excinfo, *fragments):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for f in fragments:
        assert str(f) in msg, (f, msg)


# --------------------------------------------------------------------------------------------------------------
# prepare: the files it writes

def test_prepare_writes_llmc_shards_and_meta(texts, tmp_path):
    out = tmp_path / "data"
    result = _prepare_cli(*texts, "--out", out, "--tokenizer", "bytes", "--val-fraction", "0.1",
                          "--shard-tokens", "500")
    assert result.exit_code == 0, result.output
    total = sum(len(t.encode()) for t in TEXTS)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is True and meta["tokenizer"] == "bytes" and meta["vocab_size"] == 256
    assert meta["eot_token"] is None and meta["documents"] == 3
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["tokens"] + val["tokens"] == total  # bytes: one token per byte, no separator
    assert 0.05 * total < val["tokens"] < 0.15 * total
    assert train["shards"] == [f"train_{i:06d}.bin" for i in range(len(train["shards"]))]
    assert len(train["shards"]) == -(-train["tokens"] // 500) >= 3
    assert val["shards"] == ["val_000000.bin"]
    assert meta["max_token_id"] == max(b for t in TEXTS for b in t.encode())
    assert sorted(os.listdir(out)) == sorted(["meta.json"] + train["shards"] + val["shards"])  # no temp files
    # llm.c's header, exactly: 256 int32 (magic, version, token count, then zeros), then uint16 tokens
    seen = 0
    for name in train["shards"]:
        raw = (out / name).read_bytes()
        header = np.frombuffer(raw[:1024], dtype="<i4")
        count = min(500, train["tokens"] - seen)
        assert list(header[:3]) == [20240520, 1, count] and not header[3:].any()
        assert len(raw) == 1024 + 2 * count
        seen += count
    assert "wrote" in result.stdout and f"{train['tokens']:,} train tokens" in result.stdout


def test_prepare_round_trip_bytes(texts, tmp_path):
    out = tmp_path / "data"
    prepare(texts, out, "bytes", val_fraction=0.2, shard_tokens=128)
    train, val = open_tokens(out, "train"), open_tokens(out, "val")
    assert isinstance(train, TokenShards) and train.dtype == np.uint16
    tok = ByteTokenizer()
    train_text, val_text = tok.decode(train[:]), tok.decode(val[:])
    assert train_text + val_text == "".join(TEXTS)
    # the cut is at a line start, and no text is in both splits
    assert train_text.endswith("\n") and len(val_text) > 0


def test_prepare_split_is_at_a_line_start_near_the_fraction(tmp_path):
    lines = [f"line {i:03d}\n" for i in range(100)]  # 9 bytes each
    src = tmp_path / "one.txt"
    src.write_text("".join(lines))
    prepare([src], tmp_path / "d", val_fraction=0.25)
    val = ByteTokenizer().decode(open_tokens(tmp_path / "d", "val")[:])
    assert val == "".join(lines[75:])


def test_prepare_without_val(texts, tmp_path):
    meta = prepare(texts, tmp_path / "d", val_fraction=0)
    assert meta["splits"]["val"] == {"tokens": 0, "shards": [], "max_token_id": None}
    assert open_tokens(tmp_path / "d", "val") is None
    assert len(open_tokens(tmp_path / "d")) == sum(len(t.encode()) for t in TEXTS)


def test_prepare_gpt2_round_trip_with_end_of_text(texts, tmp_path):
    try:
        tok = get_tokenizer("gpt2")
    except DataError:
        pytest.skip("tiktoken cannot load GPT-2's BPE offline")
    out = tmp_path / "data"
    meta = prepare(texts, out, "gpt2", val_fraction=0.1)
    assert meta["vocab_size"] == 50257 and meta["eot_token"] == 50256 and meta["max_token_id"] == 50256
    train, val = open_tokens(out, "train", vocab_size=50257), open_tokens(out, "val")
    assert int(train[0]) == 50256
    decoded = tok.decode(list(train[:]) + list(val[:]))
    assert decoded == "".join("<|endoftext|>" + t for t in TEXTS)


def test_prepare_loads_no_torch():
    code = "import sys, pipegpt.data.prepare; print(any(m.split('.')[0] == 'torch' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------------------------
# prepare: refusals

def test_prepare_refuses_a_directory_holding_tokens(texts, tmp_path):
    out = tmp_path / "data"
    assert _prepare_cli(texts[0], "--out", out).exit_code == 0
    before = sorted(os.listdir(out))
    assert_one_line_error(_prepare_cli(texts[1], "--out", out), str(out), "already holds prepared tokens")
    assert sorted(os.listdir(out)) == before


def test_prepare_refuses_non_utf8_and_leaves_nothing(texts, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\xff\xfe not utf-8\n")
    out = tmp_path / "data"
    with pytest.raises(DataError) as e:
        prepare([texts[0], bad], out, shard_tokens=4)
    _one_line_error(e, bad, "not UTF-8", "byte 5")
    assert not out.exists()  # created by this prepare, so removed with what it wrote
    result = _prepare_cli(bad, "--out", out)
    assert result.exit_code == 2 and result.stderr.splitlines()[-1].startswith("Error: ")


def test_prepare_refuses_missing_input_and_gpt2_offline(tmp_path):
    result = _prepare_cli(tmp_path / "nope.txt", "--out", tmp_path / "d")
    assert result.exit_code == 2 and "nope.txt" in result.stderr
    try:
        get_tokenizer("gpt2")
        return
    except DataError:
        pass
    src = tmp_path / "a.txt"
    src.write_text("hi\n")
    assert_one_line_error(_prepare_cli(src, "--out", tmp_path / "d", "--tokenizer", "gpt2"), "TIKTOKEN_CACHE_DIR",
                          "--tokenizer bytes")
    assert not (tmp_path / "d").exists()


def test_an_unfinished_prepare_does_not_read_as_whole(texts, tmp_path, monkeypatch):
    import pipegpt.data.prepare as prep

    calls = []

    def interrupt(n):
        calls.append(n)
        if len(calls) == 2:
            raise KeyboardInterrupt

    out = tmp_path / "data"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(texts, out, shard_tokens=50, on_bytes=interrupt)
    assert os.listdir(out) == []  # what it wrote is removed; the directory was there before
    # killed outright instead: whole shards and a meta.json that says "not complete"
    prep._write_json(str(out / "meta.json"), {"splits": {"train": {"tokens": 1, "shards": []}}, "complete": False})
    (out / "train_000000.bin").write_bytes(_shard_bytes(range(10)))
    with pytest.raises(DataError) as e:
        open_tokens(out)
    _one_line_error(e, out / "meta.json", "did not finish")


# --------------------------------------------------------------------------------------------------------------
# reading the other layouts

def test_nanogpt_directory(tmp_path):
    write_token_file(tmp_path / "train.bin", np.arange(100) % 50)
    write_token_file(tmp_path / "val.bin", np.arange(30))
    train, val = open_tokens(tmp_path), open_tokens(tmp_path, "val")
    assert isinstance(train, np.memmap) and train.dtype == np.uint16
    np.testing.assert_array_equal(train, np.arange(100) % 50)
    np.testing.assert_array_equal(val, np.arange(30))
    assert open_tokens(tmp_path, vocab_size=50, seq_len=99) is not None


def test_llmc_shards_in_order(tmp_path):
    # fineweb-style names; index 10 after 2 whatever the zero padding
    (tmp_path / "fineweb_val_000000.bin").write_bytes(_shard_bytes([7, 8, 9]))
    (tmp_path / "fineweb_train_2.bin").write_bytes(_shard_bytes(np.arange(0, 40)))
    (tmp_path / "fineweb_train_10.bin").write_bytes(_shard_bytes(np.arange(40, 100)))
    train = open_tokens(tmp_path)
    assert isinstance(train, TokenShards) and len(train) == 100
    assert [Path(p).name for p in train.paths] == ["fineweb_train_2.bin", "fineweb_train_10.bin"]
    np.testing.assert_array_equal(train[:], np.arange(100))
    np.testing.assert_array_equal(open_tokens(tmp_path, "val"), [7, 8, 9])
    # tinyshakespeare-style single shards, and one shard given as a file
    other = tmp_path / "ts"
    other.mkdir()
    (other / "tiny_shakespeare_train.bin").write_bytes(_shard_bytes([1, 2, 3, 4]))
    np.testing.assert_array_equal(open_tokens(other), [1, 2, 3, 4])
    np.testing.assert_array_equal(open_tokens(other / "tiny_shakespeare_train.bin"), [1, 2, 3, 4])
    assert open_tokens(other / "tiny_shakespeare_train.bin", "val") is None


def test_flat_file_is_train_only(tmp_path):
    path = tmp_path / "tokens.bin"
    write_token_file(path, np.arange(20))
    tokens = open_tokens(path)
    assert isinstance(tokens, np.memmap)
    np.testing.assert_array_equal(tokens, np.arange(20))
    assert open_tokens(path, "val") is None


# --------------------------------------------------------------------------------------------------------------
# bad input: one line naming the file and the problem

def _bad_cases(tmp_path):
    """(path to open, open_tokens keywords, fragments the message must hold), one per problem."""
    cases = {}
    cases["missing"] = (tmp_path / "nowhere", {}, [tmp_path / "nowhere", "no such file or directory"])
    d = tmp_path / "magic"
    d.mkdir()
    (d / "x_train_000000.bin").write_bytes(_shard_bytes(range(10), magic=12345))
    cases["magic"] = (d, {}, [d / "x_train_000000.bin", "magic 12345", "20240520"])
    d = tmp_path / "version"
    d.mkdir()
    (d / "x_train_000000.bin").write_bytes(_shard_bytes(range(10), version=2))
    cases["version"] = (d, {}, [d / "x_train_000000.bin", "version 2", "only version 1"])
    d = tmp_path / "truncated"
    d.mkdir()
    (d / "x_train_000000.bin").write_bytes(_shard_bytes(range(10), count=100))
    cases["truncated"] = (d, {}, [d / "x_train_000000.bin", "100 tokens", "20 bytes", "truncated"])
    d = tmp_path / "short"
    d.mkdir()
    (d / "train_000000.bin").write_bytes(b"\x00" * 100)
    cases["short-header"] = (d, {}, [d / "train_000000.bin", "100 bytes", "1024-byte header"])
    d = tmp_path / "odd"
    d.mkdir()
    (d / "train.bin").write_bytes(b"\x01\x00\x02")
    cases["odd-flat"] = (d, {}, [d / "train.bin", "3 bytes", "uint16"])
    d = tmp_path / "vocab-scan"
    d.mkdir()
    write_token_file(d / "train.bin", [1, 2, 300, 4])
    cases["vocab-scan"] = (d, {"vocab_size": 256}, [d / "train.bin", "token id 300", "vocabulary size 256"])
    d = tmp_path / "few"
    d.mkdir()
    write_token_file(d / "train.bin", range(10))
    cases["too-few"] = (d, {"seq_len": 64}, [d, "10 train tokens", "seq_len=64", "at least 65"])
    d = tmp_path / "empty-dir"
    d.mkdir()
    cases["no-train"] = (d, {}, [d, "no train tokens", "train_*.bin"])
    return cases


BAD_IDS = ["missing", "magic", "version", "truncated", "short-header", "odd-flat", "vocab-scan", "too-few", "no-train"]


@pytest.mark.parametrize("case", BAD_IDS)
def test_bad_token_data_is_one_line_naming_the_file(tmp_path, case):
    path, kwargs, fragments = _bad_cases(tmp_path)[case]
    with pytest.raises(DataError) as e:
        open_tokens(path, **kwargs)
    _one_line_error(e, *fragments)


def test_prepared_directory_checks(texts, tmp_path):
    out = tmp_path / "data"
    prepare(texts, out, "bytes", shard_tokens=200)
    meta = out / "meta.json"
    with pytest.raises(DataError) as e:  # the max id comes from meta.json: no scan
        open_tokens(out, vocab_size=100)
    _one_line_error(e, meta, "token id", "tokenizer bytes", "vocabulary size 100")
    with pytest.raises(DataError) as e:
        open_tokens(out, tokenizer="gpt2")
    _one_line_error(e, meta, "prepared with tokenizer 'bytes'", "--tokenizer bytes")
    assert open_tokens(out, vocab_size=256, seq_len=64, tokenizer="bytes") is not None
    (out / "train_000001.bin").unlink()
    with pytest.raises(DataError) as e:
        open_tokens(out)
    _one_line_error(e, out / "train_000001.bin", "no such token shard")
    (out / "train_000001.bin").write_bytes(_shard_bytes(range(5)))  # a shard that is whole but not the one
    with pytest.raises(DataError) as e:
        open_tokens(out)
    _one_line_error(e, meta, "prepare the directory again")


# --------------------------------------------------------------------------------------------------------------
# pipegpt run on prepared data, as a user runs it

def test_run_trains_on_a_prepared_directory(texts, tmp_path):
    out = tmp_path / "data"
    prepare(texts, out, "bytes", val_fraction=0.1, shard_tokens=300)
    run_dir = tmp_path / "run"
    proc = run_pipegpt("run", "--data", out, "--stages", "2", "--microbatches", "2", "--steps", "2",
                       "--run-dir", run_dir, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((run_dir / "config.json").read_text())["data"]["data"] == str(out)


@pytest.mark.parametrize("case", ["truncated", "vocab-scan"])
def test_run_refuses_bad_data_before_any_worker_starts(tmp_path, case):
    path, _, fragments = _bad_cases(tmp_path)[case]
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_pipegpt("run", "--data", path, "--stages", "2", "--microbatches", "2", "--steps", "2",
                       "--run-dir", run_dir, timeout=120)
    report = f"exit {proc.returncode} in {time.monotonic() - t0:.1f}s\n{proc.stdout}\n{proc.stderr}"
    assert_one_line_error(proc, *fragments)
    assert not run_dir.exists() and proc.stdout == "", report


def test_check_refuses_gpt2_offline_in_one_line():
    from pipegpt.config import ModelConfig, TrainConfig
    from pipegpt.train.driver import check

    try:
        get_tokenizer("gpt2")
        pytest.skip("tiktoken can load GPT-2's BPE here")
    except DataError:
        pass
    cfg = TrainConfig.build(ModelConfig(vocab_size=50257), tokenizer="gpt2", stages=2, microbatches=2)
    with pytest.raises(DataError) as e:
        check(cfg)
    _one_line_error(e, "TIKTOKEN_CACHE_DIR", "--tokenizer bytes")


def test_documents_start_with_the_end_of_text_token(texts, tmp_path, monkeypatch):
    """What gpt2 does, offline: a tokenizer with an end-of-text token puts it before every document."""
    import pipegpt.data.prepare as prep

    class WithEot(ByteTokenizer):
        name, vocab_size, eot_token = "bytes+eot", 257, 256

    monkeypatch.setattr(prep, "get_tokenizer", lambda name: WithEot())
    meta = prep.prepare(texts, tmp_path / "d", "bytes+eot", val_fraction=0.1, shard_tokens=100)
    assert meta["eot_token"] == 256 and meta["max_token_id"] == 256 and meta["vocab_size"] == 257
    stream = np.concatenate([open_tokens(tmp_path / "d")[:], open_tokens(tmp_path / "d", "val")[:]])
    starts = np.flatnonzero(stream == 256)
    assert list(starts) == [0] + list(np.cumsum([len(t.encode()) + 1 for t in TEXTS])[:-1])
    docs = [bytes(stream[a + 1:b].astype(np.uint8)).decode() for a, b in zip(starts, list(starts[1:]) + [len(stream)])]
    assert docs == TEXTS
    with pytest.raises(DataError, match="token id 256"):
        open_tokens(tmp_path / "d", vocab_size=256)
