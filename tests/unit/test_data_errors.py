"""Data and tokenizer errors said for what they are, in one short line: an llm.c shard with a damaged magic
(not "a token id above the vocabulary"), and tiktoken offline (no truncated urllib error inside)."""
from __future__ import annotations

import numpy as np
import pytest

from pipegpt.data.tokenizers import DataError, TiktokenTokenizer
from pipegpt.data.tokens import SHARD_MAGIC, load_token_file, open_tokens, shard_header


def _shard(path, magic: int, tokens=None):
    tokens = (np.arange(5000) % 200).astype("<u2") if tokens is None else tokens
    header = bytearray(shard_header(len(tokens)))
    header[:4] = int(magic).to_bytes(4, "little", signed=True)
    path.write_bytes(bytes(header) + tokens.tobytes())
    return path


@pytest.mark.parametrize("magic", [SHARD_MAGIC + 1, 0])
def test_an_llmc_shard_with_a_bad_magic_is_named_as_such(tmp_path, magic):
    path = _shard(tmp_path / "one.bin", magic)
    with pytest.raises(DataError) as e:
        open_tokens(path, "train", vocab_size=256)
    message = str(e.value)
    assert f"magic {magic}, not {SHARD_MAGIC}" in message and "llm.c" in message and str(path) in message, message
    assert "vocabulary" not in message and "\n" not in message and len(message) < 200 + len(str(path)), message
    with pytest.raises(DataError, match="magic"):  # nanoGPT's name for the file: read flat, refused the same
        load_token_file(_shard(tmp_path / "train.bin", magic))


def test_flat_tokens_are_still_read_as_tokens(tmp_path):
    """A flat uint16 file is not mistaken for a damaged shard (its header words would have to hold llm.c's
    version and its exact token count)."""
    path = tmp_path / "flat.bin"
    tokens = (np.arange(3000) % 256).astype(np.uint16)
    tokens.tofile(path)
    assert np.array_equal(np.asarray(open_tokens(path, "train", vocab_size=256)), tokens)


def test_the_offline_tokenizer_message_is_short_and_whole(monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")

    class ConnectionError(OSError):  # requests' own is an OSError too
        pass

    def offline(name):
        raise ConnectionError("HTTPSConnectionPool(host='openaipublic.blob.core.windows.net', port=443): Max "
                              "retries exceeded with url: /gpt-2/encodings/main/vocab.bpe (Caused by "
                              "NameResolutionError(\"<urllib3.connection.HTTPSConnection object at 0x7f>: Failed "
                              "to resolve 'openaipublic.blob.core.windows.net'\"))")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(DataError) as e:
        TiktokenTokenizer("gpt2")
    message = str(e.value)
    assert len("Error: " + message) <= 200, (len(message), message)
    assert "HTTPSConnectionPool" not in message and "urllib" not in message and "\n" not in message, message
    for fragment in ("gpt2", "ConnectionError", "network", "TIKTOKEN_CACHE_DIR", "--tokenizer bytes"):
        assert fragment in message, (fragment, message)


def test_token_ids_past_the_vocabulary_are_refused_before_any_worker_starts(tmp_path):
    """The built-in corpus by its max id; a prepared shard rewritten after meta.json by a scan of its own (meta's
    max id no longer holds for it); and, the last line, the loader's own check of each batch."""
    import dataclasses
    import os

    import numpy as np

    from pipegpt.config import ConfigError, TrainConfig
    from pipegpt.data.loader import RankLoader
    from pipegpt.data.prepare import prepare
    from pipegpt.data.tokenizers import DataError
    from pipegpt.data.tokens import SHARD_HEADER_BYTES, open_tokens
    from pipegpt.train.driver import check

    with pytest.raises(ConfigError, match=r"built-in corpus holds token id 226 .* give --vocab-size 227 or more"):
        check(dataclasses.replace(TrainConfig(), model=dataclasses.replace(TrainConfig().model, vocab_size=100)))

    text = tmp_path / "a.txt"
    text.write_text("hello world\n" * 400)
    prepare([text], tmp_path / "data", val_fraction=0.1)
    open_tokens(tmp_path / "data", "train", vocab_size=128)  # meta.json's max id: 'w' = 119
    shard = next((tmp_path / "data").glob("train_*.bin"))
    tokens = np.memmap(shard, dtype="<u2", mode="r+", offset=SHARD_HEADER_BYTES)
    tokens[5] = 300
    tokens.flush()
    meta = tmp_path / "data" / "meta.json"
    os.utime(shard, (os.path.getmtime(meta) + 5,) * 2)
    with pytest.raises(DataError, match=r"train_000000.bin: token id 300 .* not below the model.s vocabulary size 256"):
        open_tokens(tmp_path / "data", "train", vocab_size=256)

    loader = RankLoader(np.full(100, 300, dtype=np.uint16), 8, 1, 2, 1, 0, 0, True, True, vocab_size=256)
    with pytest.raises(DataError, match="step 1's batch holds token id 300, not below the model's vocabulary"):
        loader.batch(0)


def test_a_meta_json_whose_max_token_id_the_data_contradicts_is_caught_before_the_run(tmp_path):
    """Issue 44: meta.json said the largest id fit the vocabulary, a shard (no newer than meta.json) held a larger
    one, and the run failed at step 1 blaming a change after the check. The shards are scanned: the line names
    the file and the id."""
    import json
    import os

    from pipegpt.data.prepare import prepare
    from pipegpt.data.tokens import SHARD_HEADER_BYTES

    text = tmp_path / "a.txt"
    text.write_text("hello world\n" * 400)
    prepare([text], tmp_path / "data", val_fraction=0.1)
    shard = next((tmp_path / "data").glob("train_*.bin"))
    tokens = np.memmap(shard, dtype="<u2", mode="r+", offset=SHARD_HEADER_BYTES)
    tokens[5] = 300
    tokens.flush()
    meta = tmp_path / "data" / "meta.json"
    os.utime(meta, (os.path.getmtime(shard) + 5,) * 2)  # meta.json newer than the shard: once, it was trusted
    assert json.loads(meta.read_text())["splits"]["train"]["max_token_id"] == ord("w")
    with pytest.raises(DataError) as e:
        open_tokens(tmp_path / "data", "train", vocab_size=256)
    assert str(e.value).startswith(f"{shard}: token id 300 (tokenizer bytes) is not below the model's vocabulary "
                                   f"size 256; meta.json says 119 is the largest: "), str(e.value)
