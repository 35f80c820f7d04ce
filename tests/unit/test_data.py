"""Built-in corpus, tokenizers, token files and the deterministic batch sampler."""
import numpy as np
import pytest
import torch

from pipegpt.data.loader import BatchSampler
from pipegpt.data.tokenizers import ByteTokenizer, DataError, get_tokenizer
from pipegpt.data.tokens import builtin_text, builtin_tokens, load_token_file, write_token_file


def test_builtin_corpus_is_python_help_topics():
    from pydoc_data.topics import topics

    text = builtin_text()
    assert len(text) > 100_000
    assert text.startswith(topics[sorted(topics)[0]])
    assert text.endswith(topics[sorted(topics)[-1]])


def test_byte_tokenizer_round_trip():
    tok = get_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    text = "def f(x):\n    return x → ∞ ünïcödé 🐍"
    ids = tok.encode(text)
    assert ids[:3] == [100, 101, 102] and all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, dtype=np.uint16)) == text


def test_builtin_tokens_bytes():
    tokens = builtin_tokens(get_tokenizer("bytes"))
    assert tokens.dtype == np.uint16
    assert tokens.tobytes() == np.frombuffer(builtin_text().encode(), np.uint8).astype(np.uint16).tobytes()
    assert ByteTokenizer().decode(tokens[:200]) == builtin_text()[:200]


def test_gpt2_tokenizer_works_or_says_why_in_one_line():
    try:
        tok = get_tokenizer("gpt2")
    except DataError as e:  # offline: tiktoken cannot fetch its BPE file
        assert "\n" not in str(e) and "network" in str(e) and "bytes" in str(e)
        return
    assert tok.vocab_size == 50257
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_unknown_tokenizer():
    with pytest.raises(DataError, match="unknown tokenizer 'sentencepiece': use one of bytes, gpt2"):
        get_tokenizer("sentencepiece")


def test_token_file_round_trip(tmp_path):
    path = tmp_path / "train.bin"
    tokens = np.array([1, 2, 3, 65535, 0, 50256], dtype=np.uint16)
    write_token_file(path, tokens)
    assert path.stat().st_size == 12
    loaded = load_token_file(path)
    assert isinstance(loaded, np.memmap) and loaded.dtype == np.uint16
    np.testing.assert_array_equal(loaded, tokens)


def test_token_file_errors(tmp_path):
    with pytest.raises(DataError, match="not found") as e:
        load_token_file(tmp_path / "missing.bin")
    assert "missing.bin" in str(e.value) and "\n" not in str(e.value)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(DataError, match="3 bytes"):
        load_token_file(odd)
    with pytest.raises(DataError, match="uint16"):
        write_token_file(tmp_path / "big.bin", [70000])


def test_sampler_shapes_and_shift():
    tokens = np.arange(1000, dtype=np.uint16)
    s = BatchSampler(tokens, batch_size=4, seq_len=16, seed=0)
    x, y = s.batch(0)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # windows of consecutive tokens, inside the array (the last target included)
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 15, dtype=torch.int64))
    assert torch.equal(y, x + 1) and int(y.max()) <= 999


def test_sampler_is_deterministic_per_seed_and_step():
    tokens = builtin_tokens(ByteTokenizer())
    a = BatchSampler(tokens, 8, 32, seed=3)
    b = BatchSampler(tokens, 8, 32, seed=3)
    first, second = a.next(), a.next()
    assert a.step == 2
    for got, want in zip(b.batch(1), second):  # any process, any order: same batch for step 1
        assert torch.equal(got, want)
    for got, want in zip(b.batch(0), first):
        assert torch.equal(got, want)
    assert not torch.equal(first[0], second[0])
    assert not torch.equal(BatchSampler(tokens, 8, 32, seed=4).batch(0)[0], first[0])
    x, y = first  # windows are real slices of the corpus
    text = builtin_text().encode()
    row = bytes(x[0].tolist())
    start = text.find(row)
    assert start >= 0 and text[start + 1:start + 33] == bytes(y[0].tolist())


def test_sampler_on_memmap_and_edge_sizes(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file(path, np.arange(17))
    s = BatchSampler(load_token_file(path), batch_size=2, seq_len=16, seed=0)
    x, y = next(iter(s))
    assert torch.equal(x, torch.arange(16).expand(2, 16)) and torch.equal(y, x + 1)
    with pytest.raises(DataError, match="too few"):
        BatchSampler(np.arange(16), batch_size=2, seq_len=16, seed=0)


# --------------------------------------------------------------------------------------------------------------
# The per-rank loader

def _loader(tokens, dp_index, inputs=True, targets=True):
    from pipegpt.data.loader import RankLoader

    return RankLoader(tokens, seq_len=8, microbatches=3, microbatch_size=2, dp=2, dp_index=dp_index, seed=5,
                      inputs=inputs, targets=targets)


def test_rank_loader_gives_its_replica_the_reference_batch_slice():
    from pipegpt.data.loader import BatchSampler

    tokens = np.arange(1000, dtype=np.uint16) % 251
    reference = BatchSampler(tokens, batch_size=2 * 3 * 2, seq_len=8, seed=5)
    for step in (0, 1, 7):
        x, y = reference.batch(step)
        for d in range(2):
            inputs, targets = _loader(tokens, d).batch(step)
            assert len(inputs) == len(targets) == 3
            assert torch.equal(torch.cat(inputs), x[6 * d:6 * d + 6])
            assert torch.equal(torch.cat(targets), y[6 * d:6 * d + 6])


def test_rank_loader_draws_only_what_its_stages_use():
    tokens = np.arange(1000, dtype=np.uint16) % 251
    assert _loader(tokens, 0, targets=False).batch(0)[1] is None
    assert _loader(tokens, 0, inputs=False).batch(0)[0] is None


def test_rank_loader_position_is_a_state_that_restores():
    tokens = np.arange(1000, dtype=np.uint16) % 251
    loader = _loader(tokens, 1)
    loader.next(), loader.next()
    state = loader.state_dict()
    expected = loader.next()
    resumed = _loader(tokens, 1)
    resumed.load_state_dict(state)
    assert state == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(resumed.next()[0], expected[0]))


# --------------------------------------------------------------------------------------------------------------
# open_tokens and several shards read as one (TokenShards)

def _shards(tmp_path, sizes):
    """A prepared-style directory of llm.c shards holding 0, 1, 2, ... split at `sizes`; and the whole array."""
    from pipegpt.data.tokens import shard_header

    whole = (np.arange(sum(sizes)) % 60000).astype(np.uint16)
    start = 0
    for i, n in enumerate(sizes):
        (tmp_path / f"train_{i:06d}.bin").write_bytes(shard_header(n) + whole[start:start + n].tobytes())
        start += n
    return whole


def test_open_tokens_reads_a_flat_file_like_load_token_file(tmp_path):
    from pipegpt.data.tokens import open_tokens

    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(50))
    np.testing.assert_array_equal(open_tokens(path), load_token_file(path))
    assert open_tokens(path, "val") is None
    with pytest.raises(DataError, match="unknown split 'test'"):
        open_tokens(path, "test")


def test_token_shards_index_like_one_array(tmp_path):
    from pipegpt.data.tokens import TokenShards, open_tokens

    whole = _shards(tmp_path, [100, 1, 57, 0, 200])
    tokens = open_tokens(tmp_path)
    assert isinstance(tokens, TokenShards) and len(tokens) == len(whole) == 358 and tokens.shape == (358,)
    np.testing.assert_array_equal(tokens[:], whole)
    np.testing.assert_array_equal(np.asarray(tokens), whole)
    for s in (slice(95, 160), slice(100, 101), slice(0, 0), slice(-10, None), slice(3, 300, 7)):
        np.testing.assert_array_equal(tokens[s], whole[s])
    for i in (0, 99, 100, 101, 157, 158, 357, -1):
        assert tokens[i] == whole[i]
    idx = np.random.default_rng(0).integers(0, 358 - 17, size=(9, 1)) + np.arange(17)  # windows across shards
    got = tokens[idx]
    assert got.shape == (9, 17) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, whole[idx])
    with pytest.raises(IndexError):
        tokens[np.array([358])]
    assert tokens.max() == int(whole.max())


def test_sampler_and_rank_loader_on_shards_equal_one_array(tmp_path):
    from pipegpt.data.loader import RankLoader
    from pipegpt.data.tokens import open_tokens

    whole = _shards(tmp_path, [300, 10, 300])
    tokens = open_tokens(tmp_path)
    for step in (0, 1, 5):
        for got, want in zip(BatchSampler(tokens, 6, 32, seed=1).batch(step), BatchSampler(whole, 6, 32, seed=1).batch(step)):
            assert torch.equal(got, want)
        a = RankLoader(tokens, 16, 3, 2, 2, 1, 1, inputs=True, targets=True).batch(step)
        b = RankLoader(whole, 16, 3, 2, 2, 1, 1, inputs=True, targets=True).batch(step)
        for xs, ys in zip(a, b):
            assert all(torch.equal(x, y) for x, y in zip(xs, ys))
