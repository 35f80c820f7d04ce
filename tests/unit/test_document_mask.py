"""--document-mask and --position-reset in one process: attention stays within each packed document, and with
position reset each document is computed exactly as if it were a sequence of its own."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipegpt.config import ConfigError, ModelConfig, TrainConfig
from pipegpt.data.loader import document_starts
from pipegpt.model.gpt import GPT, Documents

EOT = 0
GPT2 = ModelConfig(vocab_size=64, seq_len=24, n_layer=2, n_head=2, n_embd=32)
LLAMA = ModelConfig(vocab_size=64, seq_len=24, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64,
                    arch="llama", bias=False)
# two sequences: documents of 7, 10 and 7 tokens; of 24
DOCS = [[7, 10, 7], [24]]


def packed(lengths_per_row, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in lengths_per_row:
        row = []
        for n in lengths:
            doc = torch.randint(1, 64, (n,), generator=g)
            doc[0] = EOT  # a document opens with the end-of-text token (pipegpt prepare's and llm.c's shards)
            row.append(doc)
        rows.append(torch.cat(row))
    return torch.stack(rows)


def test_document_starts():
    x = torch.tensor([[5, 0, 3, 4, 0, 0, 9], [1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 0, 3, 4, 5]])
    assert document_starts(x, 0).tolist() == [[0, 1, 1, 1, 4, 5, 5], [0] * 7, [0, 0, 0, 3, 3, 3, 3]]


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_with_position_reset_each_document_is_its_own_sequence(config):
    torch.manual_seed(0)
    model = GPT(config, init_seed=3).double()
    x = packed(DOCS)
    docs = Documents(document_starts(x, EOT), reset_positions=True)
    logits = model(x, documents=docs)
    start = 0
    for n in DOCS[0]:
        alone = model(x[:1, start:start + n])
        torch.testing.assert_close(logits[:1, start:start + n], alone, rtol=1e-10, atol=1e-10)
        start += n
    torch.testing.assert_close(logits[1:], model(x[1:]), rtol=1e-10, atol=1e-10)  # one document: no change


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_the_loss_and_gradients_equal_the_documents_run_alone(config):
    """Targets within each document (a document's last target is the next document's end-of-text token: left out
    here by ignore_index, as it is the one target a document alone does not have)."""
    x = packed([[8, 9, 7]])
    y = torch.roll(x, -1, 1)
    y[0, [7, 16, 23]] = -1
    packed_model, alone_model = (GPT(config, init_seed=3).double() for _ in range(2))
    loss = packed_model(x, y, documents=Documents(document_starts(x, EOT), reset_positions=True))
    loss.backward()
    total, start = 0, 0
    for n in (8, 9, 7):
        part = alone_model(x[:, start:start + n], y[:, start:start + n])
        total = total + part * (n - 1) / 21  # mean over the 21 counted targets
        start += n
    total.backward()
    assert loss.item() == pytest.approx(total.item(), rel=1e-12)
    for (name, a), (_, b) in zip(packed_model.named_parameters(), alone_model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_without_reset_a_document_sees_none_before_it_but_keeps_its_positions(config):
    model = GPT(config, init_seed=3).double()
    x = packed(DOCS)
    other = x.clone()
    other[0, :7] = packed([[7]], seed=9)[0]  # another first document of the same length
    docs = Documents(document_starts(x, EOT))
    a, b = model(x, documents=docs), model(other, documents=docs)
    torch.testing.assert_close(a[:1, 7:], b[:1, 7:], rtol=1e-10, atol=1e-10)  # later documents never see it
    torch.testing.assert_close(a[:1, :7], model(x[:1, :7]), rtol=1e-10, atol=1e-10)  # the first: as alone
    if config.arch == "gpt2":  # the second keeps positions 7.., not 0..
        assert not torch.allclose(a[:1, 7:17], model(x[:1, 7:17]))
    else:  # rotary attention sees relative positions only: within a document, the shift changes nothing
        torch.testing.assert_close(a[:1, 7:17], model(x[:1, 7:17]), rtol=1e-9, atol=1e-9)


def test_bad_document_settings_are_refused():
    with pytest.raises(ConfigError, match="give --document-mask too"):
        TrainConfig.build(position_reset=True).validate()
    with pytest.raises(ConfigError, match="bytes tokenizer has none"):
        TrainConfig.build(document_mask=True).validate()
    TrainConfig.build(document_mask=True, position_reset=True, tokenizer="gpt2").validate()
