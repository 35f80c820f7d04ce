"""Checkpoint files (pipegpt.state.checkpoint), without workers: the safetensors writer and its SHA-256, the
check on load (a flipped byte refused naming the file; a checkpoint from before checksums still loads), files
that follow the umask, and what interrupted saves leave behind removed at the next save."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from pipegpt.config import ModelConfig
from pipegpt.model.gpt import GPT
from pipegpt.state import checkpoint

MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, n_embd=32)


def weights_checkpoint(path):
    gpt = GPT(MODEL, init_seed=0)
    checkpoint.write_weights(path, {n: p.detach() for n, p in gpt.named_parameters()},
                             {"model": dataclasses.asdict(MODEL), "tokenizer": "bytes"})
    return path


def flip_data_byte(path, key_prefix: str = "param/") -> str:
    """Flip one byte inside the data of the first tensor whose key starts with key_prefix; returns the key."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    key = next(k for k in sorted(header) if k.startswith(key_prefix))
    start, end = header[key]["data_offsets"]
    raw[8 + n + (start + end) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    return key


# --------------------------------------------------------------------------------------------------------------
# The writer

def test_the_writer_writes_safetensors_own_bytes_and_hashes_them(tmp_path):
    tensors = {"b": torch.randn(3, 4), "a": torch.randn(5), "z": torch.tensor(1.0)}
    metadata = {"shards": json.dumps({"a": [0, 1]})}
    digest = checkpoint.write_safetensors(tmp_path / "x.safetensors", tensors, metadata)
    written = (tmp_path / "x.safetensors").read_bytes()
    assert written == save(tensors, metadata=metadata)  # the library's own serialisation, byte for byte
    assert digest == hashlib.sha256(written).hexdigest() == checkpoint.file_sha256(tmp_path / "x.safetensors")


def test_mixed_dtypes_read_back_exactly(tmp_path):
    tensors = {"f64": torch.randn(3, dtype=torch.float64), "f32": torch.randn(2, 3), "bf16": torch.randn(5).bfloat16(),
               "rng": torch.get_rng_state(), "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5)}
    checkpoint.write_safetensors(tmp_path / "x.safetensors", tensors, {"k": "v"})
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"k": "v"} and set(f.keys()) == set(tensors)
        for key, t in tensors.items():
            got = f.get_tensor(key)
            assert got.dtype == t.dtype and torch.equal(got, t), key


def test_the_manifest_holds_each_files_sha256(tmp_path):
    ckpt = weights_checkpoint(tmp_path / "ckpt")
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    assert manifest["sha256"] == {name: hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
                                  for name in manifest["files"]}


# --------------------------------------------------------------------------------------------------------------
# Verified on load

def test_a_flipped_byte_is_refused_naming_the_file(tmp_path):
    ckpt = weights_checkpoint(tmp_path / "ckpt")
    victim = ckpt / "rank-00000.safetensors"
    size = victim.stat().st_size
    flip_data_byte(victim)
    assert victim.stat().st_size == size  # the size check alone cannot see it
    for load in (checkpoint.read_manifest, checkpoint.CheckpointReader, checkpoint.read_weights):
        with pytest.raises(checkpoint.CheckpointError) as e:
            load(ckpt)
        assert str(e.value).startswith(f"{victim}: corrupt: its SHA-256 is ")
        assert "\n" not in str(e.value) and len(str(e.value)) < 200 + len(str(victim))
    checkpoint.read_manifest(ckpt, verify=False)  # what the workers do, after the driver verified


def test_a_checkpoint_without_checksums_still_loads(tmp_path):
    ckpt = weights_checkpoint(tmp_path / "ckpt")
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    del manifest["sha256"]  # as written before checksums existed (version 1)
    manifest["version"] = 1
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    assert set(checkpoint.read_weights(ckpt)) == {n for n, _ in GPT(MODEL, init_seed=0).named_parameters()}


def test_a_manifest_of_this_version_without_checksums_is_refused(tmp_path):
    """A weight overwritten and its manifest's sha256 deleted loaded and trained: only a version 1 manifest (written
    before checksums) may lack them."""
    ckpt = weights_checkpoint(tmp_path / "ckpt")
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    assert manifest["version"] == checkpoint.VERSION >= 2
    del manifest["sha256"]
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match="records no SHA-256 for rank-00000.safetensors .* "
                                                         "hand-edited or damaged manifest"):
        checkpoint.read_manifest(ckpt)


def optimizer_checkpoint(path, step: int = 2):
    """A checkpoint as a run writes it, of one rank: parameters and both Adam moments."""
    named = {n: p.detach() for n, p in GPT(MODEL, init_seed=0).named_parameters()}
    tmp = checkpoint.begin(path, step)
    tensors = {f"{kind}/{n}": t.clone() for n, t in named.items() for kind in ("param", "exp_avg", "exp_avg_sq")}
    name, sha = checkpoint.write_rank_file(tmp, 0, tensors, {key: [0, 1] for key in tensors})
    return checkpoint.commit(tmp, {"step": step, "model": dataclasses.asdict(MODEL), "world_size": 1,
                                   "optimizer": True}, keep=0, checksums={name: sha})


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["model"].update(n_embd=48), r"param/wte.weight is \[256, 32\] in rank-00000.safetensors, but its "
                                             r"manifest's model needs \[256, 48\]"),
    (lambda m: m.update(step=-1), "step -1 is not a step count"),
    (lambda m: m.update(step="2"), "step '2' is not a step count"),
])
def test_a_hand_edited_manifest_is_one_line(tmp_path, edit, message):
    ckpt = optimizer_checkpoint(tmp_path / "run")
    checkpoint.check_tensors(ckpt, MODEL)  # as written: every shape as its model says
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    edit(manifest)
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.check_tensors(ckpt, ModelConfig(**manifest["model"]))


def test_a_reshaped_moment_with_its_checksum_fixed_is_one_line(tmp_path):
    ckpt = optimizer_checkpoint(tmp_path / "run")
    path = ckpt / "rank-00000.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    tensors["exp_avg/lm_head.weight" if "exp_avg/lm_head.weight" in tensors else "exp_avg/wte.weight"] = \
        torch.zeros(32, 256)
    path.write_bytes(save(tensors, metadata))
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    manifest["sha256"]["rank-00000.safetensors"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    checkpoint.read_manifest(ckpt)  # whole and verified
    with pytest.raises(checkpoint.CheckpointError, match=r"exp_avg/.*weight is \[32, 256\] .* needs \[256, 32\]"):
        checkpoint.check_tensors(ckpt, MODEL)


def edit_manifest(ckpt, edit) -> None:
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    edit(manifest)
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))


LOADERS = (checkpoint.read_manifest, checkpoint.CheckpointReader, checkpoint.read_weights)


def test_a_manifest_edited_to_fewer_layers_is_refused_naming_what_is_left_over(tmp_path):
    """Issue 44: n_layer set to 1 loaded block 0 and dropped block 1's weights and moments without a word (loading
    checked for missing tensors, not left-over ones); the files' headers bind the manifest's model in both
    directions, in every loader, verified or not."""
    ckpt = optimizer_checkpoint(tmp_path / "run")
    edit_manifest(ckpt, lambda m: m["model"].update(n_layer=1))
    for load in LOADERS + (lambda c: checkpoint.read_manifest(c, verify=False),):
        with pytest.raises(checkpoint.CheckpointError) as e:
            load(ckpt)
        line = str(e.value)
        assert line.startswith(f"{ckpt}: holds 36 tensors its manifest's model (1-layer, n_embd 32) has no place "
                               f"for (param/blocks.1.") and line.endswith("and 32 more): a hand-edited manifest or "
                                                                       "another model's files"), line
        assert "\n" not in line and len(line) < 300 + len(str(ckpt)), line


def test_a_manifest_edited_to_more_layers_is_refused_naming_what_is_missing(tmp_path):
    ckpt = optimizer_checkpoint(tmp_path / "run")
    edit_manifest(ckpt, lambda m: m["model"].update(n_layer=3))
    with pytest.raises(checkpoint.CheckpointError, match=r": holds no param/blocks\.2\..* and 8 more, which its "
                                                         r"manifest's model \(3-layer, n_embd 32\) has"):
        checkpoint.read_manifest(ckpt)


def test_an_edited_step_is_refused(tmp_path):
    """Issue 44: step-00000080 with "step": 10 resumed "after step 10" with step 80's weights. A run's checkpoint
    is named for its step; under any other name (a copy) the manifest's own checksum refuses the edit."""
    ckpt = optimizer_checkpoint(tmp_path / "run", step=8)
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    for where in (ckpt, copy):
        edit_manifest(where, lambda m: m.update(step=1))
    with pytest.raises(checkpoint.CheckpointError, match=r"manifest.json: step 1, but its directory is step-00000008 "
                                                         r"\(step 8\): a hand-edited manifest or a renamed directory"):
        checkpoint.read_manifest(ckpt, verify=False)
    with pytest.raises(checkpoint.CheckpointError, match=r"copy/manifest.json: corrupt: its fields are not those "
                                                         r"whose SHA-256 it recorded"):
        checkpoint.read_manifest(copy)


@pytest.mark.parametrize("edit", [lambda m: m["model"].update(n_head=2),  # the same shapes: only a checksum sees it
                                  lambda m: m["model"].update(norm_eps=1e-3),
                                  lambda m: m.update(optimizer=False)])
def test_any_edit_of_the_manifests_fields_is_refused_where_they_are_verified(tmp_path, edit):
    ckpt = optimizer_checkpoint(tmp_path / "run")
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    assert manifest[checkpoint.FIELDS_SHA256] == checkpoint.fields_sha256(manifest)
    edit_manifest(ckpt, edit)
    for load in LOADERS:
        with pytest.raises(checkpoint.CheckpointError) as e:
            load(ckpt)
        assert str(e.value) == (f"{ckpt / checkpoint.MANIFEST}: corrupt: its fields are not those whose SHA-256 it "
                                f"recorded when it was written (a hand-edited or damaged manifest); use another "
                                f"checkpoint")


def damage_header(path, at: int, value: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] = value
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("at, value, why", [
    (20, 0x7F, r"\('__metadata\\x7f_' is no tensor entry\)"),  # the case: "__metadata__" -> "__metadata\x7f_"
    (8, ord("["), r"\((Expecting|Extra data)"),                   # not JSON any more
])
def test_a_damaged_header_is_one_corrupt_line(tmp_path, at, value, why):
    """Issue 44: a flipped byte in a safetensors header was KeyError 'data_offsets' from the size check, in every
    loader (and in --resume's first read of the manifest, unverified)."""
    ckpt = weights_checkpoint(tmp_path / "ckpt")
    victim = ckpt / "rank-00000.safetensors"
    damage_header(victim, at, value)
    for load in LOADERS + (lambda c: checkpoint.read_manifest(c, verify=False),):
        with pytest.raises(checkpoint.CheckpointError, match=f"^{victim}: corrupt: its header is not a safetensors "
                                                             f"header {why}"):
            load(ckpt)


def test_a_file_changed_after_a_successful_check_is_checked_again(tmp_path):
    ckpt = weights_checkpoint(tmp_path / "ckpt")
    checkpoint.read_manifest(ckpt)
    victim = ckpt / "rank-00000.safetensors"
    flip_data_byte(victim)
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 1_000_000))
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        checkpoint.read_manifest(ckpt)


# --------------------------------------------------------------------------------------------------------------
# The umask, and interrupted saves

@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoint_and_exported_files_follow_the_umask(tmp_path, umask):
    from pipegpt.tools.convert import export_hf

    old = os.umask(umask)
    try:
        ckpt = weights_checkpoint(tmp_path / "ckpt")
        export_hf(ckpt, tmp_path / "hf")
    finally:
        os.umask(old)
    files = [ckpt / "rank-00000.safetensors", ckpt / checkpoint.MANIFEST, tmp_path / "hf" / "model.safetensors",
             tmp_path / "hf" / "config.json"]
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(0o666 & ~umask) for f in files}


def test_the_next_save_removes_what_interrupted_saves_left(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (4, 6):  # two saves killed midway, each with half a file
        stale = root / f".tmp-step-{step:08d}"
        stale.mkdir(parents=True)
        (stale / "rank-00000.partial").write_bytes(b"\0" * 1000)
    tmp = checkpoint.begin(root, 8)
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-00000008"] and not any(tmp.iterdir())
    checkpoint.write_rank_file(tmp, 0, {"param/x": torch.ones(2)}, {"param/x": [0, 1]})
    final = checkpoint.commit(tmp, {"step": 8}, keep=0)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000008"] and final == root / "step-00000008"


def test_a_dense_manifest_records_no_expert_settings_and_one_from_before_experts_still_fits():
    """Dense manifests read as they did before experts existed; an MoE checkpoint is another model."""
    from pipegpt.config import ModelConfig

    dense = ModelConfig(arch="llama", bias=False, n_layer=2)
    assert "n_experts" not in dense.settings() and "router_score" not in dense.settings()
    checkpoint.check_compatible({"model": dense.settings()}, dense.settings(), Path("old"))
    moe = ModelConfig(arch="llama", bias=False, n_layer=2, n_experts=4)
    assert moe.settings()["n_experts"] == 4 and "router_score" in moe.settings()
    with pytest.raises(checkpoint.CheckpointError, match=r"another model: n_experts=4 \(this run: None\)"):
        checkpoint.check_compatible({"model": moe.settings()}, dense.settings(), Path("moe"))
