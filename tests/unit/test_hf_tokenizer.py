"""--tokenizer PATH: a Hugging Face tokenizer.json (the tokenizers library, offline) for prepare, run, sample and
convert; a converted Llama remembers its directory's tokenizer.json."""
from __future__ import annotations

import json

import pytest

from helpers import TEXT, assert_one_line_error, invoke, make_tokenizer_json

tokenizers = pytest.importorskip("tokenizers")

from pipegpt.config import ConfigError, canonical_tokenizer, check_tokenizer_name  # noqa: E402
from pipegpt.data.tokenizers import DataError, get_tokenizer  # noqa: E402



def test_encode_decode_round_trip_and_the_name_is_the_absolute_path(tmp_path, monkeypatch):
    make_tokenizer_json(tmp_path / "tokenizer.json")
    monkeypatch.chdir(tmp_path)
    tok = get_tokenizer("tokenizer.json")
    assert tok.name == str(tmp_path / "tokenizer.json") == canonical_tokenizer("tokenizer.json")
    ids = tok.encode("gradients back")
    assert 0 < len(ids) < len("gradients back") and tok.decode(ids) == "gradients back"
    assert tok.eot_token == 0 and 256 < tok.vocab_size <= 300


def test_bad_names_and_files_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="nor the path of a Hugging Face tokenizer.json"):
        check_tokenizer_name("llama")
    with pytest.raises(DataError, match="no such file"):
        get_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
        get_tokenizer(str(tmp_path / "bad.json"))
    assert_one_line_error(invoke("run", "--tokenizer", tmp_path / "missing.json", "--steps", "1"), "no such file")


def test_prepare_with_a_tokenizer_json(tmp_path):
    path = make_tokenizer_json(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text(TEXT)
    result = invoke("prepare", tmp_path / "a.txt", "--out", tmp_path / "data", "--tokenizer", path)
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == path and meta["eot_token"] == 0


def test_a_converted_llama_remembers_its_tokenizer_json(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    path = make_tokenizer_json(tmp_path / "hf" / "tokenizer.json")
    result = invoke("convert", "--from-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    assert result.exit_code == 0, result.output
    assert f"tokenizer {path}" in result.output
    result = invoke("sample", tmp_path / "ckpt", "--prompt", "the pipeline", "--max-new-tokens", "5",
                    "--temperature", "0")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("the pipeline")
