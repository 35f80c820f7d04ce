"""`pipegpt convert`: GPT-2 in Hugging Face layout into a pipegpt checkpoint and back.

A small random transformers GPT2LMHeadModel (every parameter perturbed, so biases and LayerNorms are
not their initial 0 and 1) is saved with save_pretrained, imported with the CLI, and compared: logits and
loss in one process, the first loss of a 2-stage pipelined run started from it, and the model exported
back and reloaded by transformers. Also: OpenAI's old .bin layout, untied embeddings, bad inputs.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_one_line_error, invoke, run_pipegpt

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from pipegpt.state import checkpoint  # noqa: E402
from pipegpt.data.loader import BatchSampler  # noqa: E402
from pipegpt.data.tokenizers import ByteTokenizer
from pipegpt.data.tokens import builtin_tokens
from pipegpt.tools.sample import load_model  # noqa: E402

SHAPE = dict(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=256)
RUN_MODEL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--seq-len", "32", "--vocab-size", "256"]
TOKENS = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(5))


def hf_gpt2(seed: int = 0, **overrides) -> "transformers.GPT2LMHeadModel":
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**{**SHAPE, "bos_token_id": None, "eos_token_id": None, **overrides})
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))  # far from a fresh model, whose loss is about ln(256)
    return model.eval()


@torch.no_grad()
def hf_logits(model, tokens=TOKENS) -> torch.Tensor:
    return model(tokens).logits


def imported(tmp_path: Path, hf, name: str = "ckpt") -> Path:
    hf_dir = tmp_path / f"{name}-hf"
    hf.save_pretrained(hf_dir)
    out = tmp_path / name
    result = invoke("convert", "--from-hf", hf_dir, "--out", out, "--tokenizer", "bytes")
    assert result.exit_code == 0, result.output
    assert f"pipegpt run --init-from {out} {' '.join(RUN_MODEL)}" in result.output
    return out


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """(the transformers model, its import as a pipegpt checkpoint)"""
    hf = hf_gpt2()
    return hf, imported(tmp_path_factory.mktemp("tied"), hf)


def test_import_matches_transformers_logits_and_loss(tied):
    hf, ckpt = tied
    manifest = checkpoint.read_manifest(ckpt)
    assert manifest["step"] == 0 and manifest["optimizer"] is False and manifest["tokenizer"] == "bytes"
    assert manifest["model"] == {"vocab_size": 256, "seq_len": 32, "n_layer": 2, "n_head": 4, "n_embd": 32,
                                 "dropout": 0.0, "tie_embeddings": True, "pad_vocab_to": 1, "bias": True,
                                 "arch": "gpt2", "n_kv_head": None, "ffn_hidden": None, "rope_theta": 10000.0,
                                 "norm_eps": 1e-5, "qkv_bias": False}
    model, _, _ = load_model(ckpt)
    with torch.no_grad():
        ours, theirs = model(TOKENS), hf_logits(hf)
        assert (ours - theirs).abs().max().item() < 1e-4
        targets = torch.roll(TOKENS, -1, dims=1)
        targets[0, 5] = -1  # ignored positions are ignored by both
        loss = model(TOKENS, targets)
        ref = F.cross_entropy(theirs.reshape(-1, 256), targets.reshape(-1), ignore_index=-1)
        assert abs(loss.item() - ref.item()) < 1e-5


def test_a_pipelined_run_trains_from_the_imported_weights_and_exports(tied, tmp_path):
    hf, ckpt = tied
    run = tmp_path / "run"
    proc = run_pipegpt("run", "--init-from", ckpt, *RUN_MODEL, "--tokenizer", "bytes", "--stages", "2",
                       "--microbatches", "2", "--microbatch-size", "2", "--steps", "2", "--seed", "7",
                       "--threads-per-worker", "1", "--save-every", "2", "--run-dir", run, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    # The run's first batch: 2 microbatches x 2 sequences drawn by the run's seed from the built-in corpus.
    x, y = BatchSampler(builtin_tokens(ByteTokenizer()), 4, 32, seed=7).batch(0)
    with torch.no_grad():
        ref = F.cross_entropy(hf_logits(hf, x).reshape(-1, 256), y.reshape(-1)).item()
    assert abs(ref - math.log(256)) > 0.1  # a run that ignored --init-from (loss about ln 256) would fail
    assert abs(losses[0] - ref) < 1e-4, (losses, ref)
    assert len(losses) == 2 and losses[1] == losses[1] and losses[1] != losses[0]

    # The trained checkpoint (written by 2 stages, with optimizer state) exports from its run directory.
    result = invoke("convert", "--to-hf", tmp_path / "trained-hf", "--checkpoint", run)
    assert result.exit_code == 0, result.output
    trained = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "trained-hf").eval()
    model, _, found = load_model(run)
    assert found.name == "step-00000002"
    with torch.no_grad():
        assert (model(TOKENS) - hf_logits(trained)).abs().max().item() < 1e-5
        assert (hf_logits(trained) - hf_logits(hf)).abs().max().item() > 1e-4  # it did train


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_round_trip_reloads_in_transformers(tmp_path, tied, tie):
    hf, ckpt = tied if tie else (hf_gpt2(seed=1, tie_word_embeddings=False), None)
    if ckpt is None:
        ckpt = imported(tmp_path, hf)
        assert checkpoint.CheckpointReader(ckpt).has("param/lm_head.weight")
    result = invoke("convert", "--to-hf", tmp_path / "back", "--checkpoint", ckpt)
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tie and config["activation_function"] == "gelu_new"
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    assert (hf_logits(back) - hf_logits(hf)).abs().max().item() < 1e-5
    model, _, _ = load_model(ckpt)
    with torch.no_grad():
        assert (model(TOKENS) - hf_logits(hf)).abs().max().item() < 1e-4


def test_bin_in_openai_layout(tmp_path):
    """pytorch_model.bin without the `transformer.` prefix and with the attention-mask buffers."""
    hf = hf_gpt2(seed=2)
    hf_dir = tmp_path / "bin"
    hf_dir.mkdir()
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, hf_dir / "pytorch_model.bin")
    hf.config.to_json_file(hf_dir / "config.json")
    result = invoke("convert", "--from-hf", hf_dir, "--out", tmp_path / "ckpt")
    assert result.exit_code == 0, result.output
    model, manifest, _ = load_model(tmp_path / "ckpt")
    assert manifest["tokenizer"] == "bytes"  # the one that fits its 256-token vocabulary (issue 33: not gpt2)
    with torch.no_grad():
        assert (model(TOKENS) - hf_logits(hf)).abs().max().item() < 1e-4


@pytest.mark.parametrize("vocab_size, tokenizer", [(256, "bytes"), (50257, "gpt2"), (1000, None)])
def test_without_tokenizer_the_one_that_fits_the_vocabulary(vocab_size, tokenizer, tmp_path):
    """A GPT-2 of 50257 tokens gets gpt2 as before; one of 256 gets bytes, said in a line; any other asks."""
    hf_dir, out = tmp_path / "hf", tmp_path / "ckpt"
    hf_gpt2(seed=3, vocab_size=vocab_size).save_pretrained(hf_dir)
    result = invoke("convert", "--from-hf", hf_dir, "--out", out)
    if tokenizer is None:
        assert_one_line_error(result, "vocabulary of 1000 fits neither bytes (256) nor gpt2", "--tokenizer")
        assert not out.exists()
        return
    assert result.exit_code == 0, result.output
    assert checkpoint.read_manifest(out)["tokenizer"] == tokenizer
    assert f"--vocab-size {vocab_size} --tokenizer {tokenizer}" in result.output
    chosen = [line for line in result.output.splitlines() if line.startswith(f"tokenizer {tokenizer}: ")]
    assert len(chosen) == (tokenizer == "bytes"), result.output  # gpt2 for a GPT-2 goes without saying


def _hf_dir(tmp_path: Path, name: str, **config) -> Path:
    """A directory with a config.json (GPT-2 SHAPE with `config` changes) and the tied model's weights."""
    hf = tmp_path / name
    hf.mkdir()
    hf_gpt2().save_pretrained(hf)
    data = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**data, **config}))
    return hf


@pytest.mark.parametrize("change, fragment", [
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ({"n_inner": 64}, "n_inner=64"),
    ({"model_type": "bert"}, "model_type='bert'"),
    ({"n_layer": 3}, "holds no 'h.2.ln_1.weight'"),
    ({"n_embd": 48}, "'wte.weight' has shape [256, 32], config.json implies [256, 48]"),
], ids=["activation", "eps", "n_inner", "model_type", "n_layer", "n_embd"])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, change, fragment):
    hf = _hf_dir(tmp_path, "hf", **change)
    assert_one_line_error(invoke("convert", "--from-hf", hf, "--out", tmp_path / "out"), fragment)
    assert not (tmp_path / "out").exists()


def test_bad_inputs_are_one_line_errors(tmp_path, tied):
    hf, ckpt = tied
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(invoke("convert", "--from-hf", empty, "--out", tmp_path / "x"), "config.json", "not found")
    assert_one_line_error(invoke("convert", "--from-hf", tmp_path / "nowhere", "--out", tmp_path / "x"),
                          "no such directory")
    (empty / "config.json").write_text(json.dumps(hf.config.to_dict()))
    assert_one_line_error(invoke("convert", "--from-hf", empty, "--out", tmp_path / "x"), "holds no model.safetensors")
    (empty / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert_one_line_error(invoke("convert", "--from-hf", empty, "--out", tmp_path / "x"), "unreadable weights")
    hf_dir = _hf_dir(tmp_path, "good")
    assert_one_line_error(invoke("convert", "--from-hf", hf_dir, "--out", ckpt), "already exists")
    assert_one_line_error(invoke("convert", "--from-hf", hf_dir), "needs --out")
    assert_one_line_error(invoke("convert", "--out", tmp_path / "x"), "--from-hf HF_DIR --out CHECKPOINT")
    assert_one_line_error(invoke("convert", "--to-hf", hf_dir, "--checkpoint", ckpt), "already holds config.json")
    assert_one_line_error(invoke("convert", "--to-hf", tmp_path / "y", "--checkpoint", tmp_path / "none"),
                   "no such file or directory")
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    # A weights-only checkpoint cannot be resumed (there is no optimizer state or step).
    assert_one_line_error(invoke("run", "--resume", ckpt, *RUN_MODEL, "--stages", "2", "--steps", "1"),
                   "weights only", "--init-from")
