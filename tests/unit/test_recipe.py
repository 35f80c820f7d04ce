"""The nanoGPT/llm.c recipe: the learning-rate schedule, bf16 mixed precision with fp32 master weights, and the
FLOPs/MFU figures, each against an oracle (a closed form, an fp32 run, a number computed by hand)."""
from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import time

import pytest
import torch

from helpers import assert_one_line_error, invoke, run_pipegpt
from pipegpt.config import MODEL_PRESETS, ModelConfig, OptimizerConfig, TrainConfig
from pipegpt.model.flops import flops_per_token, matmul_parameters
from pipegpt.costs.devices import device_peak_tflops
from pipegpt.observe.metrics import step_metrics
from pipegpt.engine.results import WorkerStep
from pipegpt.model.gpt import GPT
from pipegpt.train.optim import lr_at
from pipegpt.stages import Stage


# --------------------------------------------------------------------------------------------------------------
# The learning-rate schedule

def _closed_form(step: int, lr: float, warmup: int, min_lr: float, total: int, cosine: bool) -> float:
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if not cosine:
        return lr
    if step >= total:
        return min_lr
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) / 2


@pytest.mark.parametrize("warmup, schedule, min_lr", [(4, "cosine", 1e-4), (0, "cosine", 2e-4), (3, "constant", None),
                                                      (0, "constant", None), (2, "cosine", None)])
def test_lr_at_is_its_closed_form_at_every_step(warmup, schedule, min_lr):
    lr, total = 6e-4, 24
    optim = OptimizerConfig(lr=lr, warmup_steps=warmup, min_lr=min_lr, lr_schedule=schedule)
    final = lr / 10 if min_lr is None else min_lr  # the default min_lr is a tenth of lr
    got = [lr_at(s, optim, total) for s in range(total + 3)]
    want = [_closed_form(s, lr, warmup, final, total, schedule == "cosine") for s in range(total + 3)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    # Landmarks, by hand: warmup rises linearly to lr, never starting at 0; cosine is lr right after warmup,
    # the midpoint of lr and min_lr halfway, and min_lr from the end of the run on.
    assert got[0] == pytest.approx(lr / (warmup + 1)) and got[warmup] == pytest.approx(lr)
    if schedule == "cosine":
        assert got[warmup + (total - warmup) // 2] == pytest.approx((lr + final) / 2, rel=0.05)
        assert got[total:] == [final] * 3
        assert all(a >= b for a, b in zip(got[warmup:], got[warmup + 1:]))
    else:
        assert got[warmup:] == [lr] * (total + 3 - warmup)


def test_min_lr_defaults_to_a_tenth_of_lr():
    assert OptimizerConfig(lr=3e-4).final_lr == pytest.approx(3e-5)
    assert lr_at(100, OptimizerConfig(lr=3e-4), 100) == pytest.approx(3e-5)
    assert OptimizerConfig(lr=3e-4, min_lr=0.0).final_lr == 0.0


def test_a_real_run_uses_the_schedule_and_reports_flops(tmp_path):
    """The LR each step of a 2-stage run used, read back from metrics.jsonl, is lr_at's; FLOPs and MFU too."""
    run_dir = tmp_path / "run"
    args = ["--stages", "2", "--microbatches", "2", "--microbatch-size", "2", "--steps", "6", "--warmup-steps", "2",
            "--lr-schedule", "cosine", "--lr", "2e-3", "--device", "cpu", "--peak-tflops", "0.5"]
    proc = run_pipegpt("run", *args, "--run-dir", run_dir, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg = TrainConfig.build(lr=2e-3, warmup_steps=2, lr_schedule="cosine", steps=6, stages=2, microbatches=2,
                            microbatch_size=2, peak_tflops=0.5)
    assert [r["lr"] for r in records] == [lr_at(s, cfg.optim, 6) for s in range(6)]
    assert records[2]["lr"] == 2e-3 and records[5]["lr"] < records[3]["lr"]
    for r in records:
        assert r["flops_per_s"] == pytest.approx(flops_per_token(cfg.model) * cfg.tokens_per_step / r["step_time_s"])
        assert r["mfu"] == pytest.approx(r["flops_per_s"] / (2 * 0.5e12))  # two workers, 0.5 TFLOPS each
    if _has_tensorboard():  # not a dependency: event files only where it is installed
        assert list(run_dir.glob("events.out.tfevents.*")), sorted(p.name for p in run_dir.iterdir())


def _has_tensorboard() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------------------------
# bf16 mixed precision

def test_bf16_stage_keeps_the_residual_stream_and_gradients_fp32():
    """Autocast runs the matmuls in bf16; what travels between stages (outputs, input gradients) and every
    parameter's gradient stays fp32, the dtype of the receive buffers and of the master weights."""
    model = ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)
    first = Stage(0, 2, GPT(model, layers=range(0, 1), head=False, init_seed=1), 1, torch.bfloat16)
    last = Stage(1, 2, GPT(model, layers=range(1, 2), embed=False, init_seed=1), 1, torch.bfloat16)
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    out = first.forward(0, x)
    loss = last.forward(0, out, y)
    assert out.dtype == torch.float32 and loss.dtype == torch.float32
    grad = last.backward(0, None, split=True)  # zb-h1's I: weight gradients deferred
    last.backward_weight(0)
    first.backward(0, grad)
    assert grad.dtype == torch.float32
    for stage in (first, last):
        for name, p in stage.module.named_parameters():
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
    # The forward really ran in bf16: a fp32 forward of the same weights gives another loss.
    fp32 = Stage(1, 2, GPT(model, layers=range(1, 2), embed=False, init_seed=1), 1)
    assert float(fp32.forward(0, out, y)) != float(loss)


def _serve(conn, cfgs: list[TrainConfig], steps: int) -> None:
    """Child process (RPC initialises once per process): train each config for `steps` steps on one job."""
    from pipegpt.train.driver import Job

    job = None
    try:
        job = Job(cfgs[0], threads_per_worker=1)
        job.start()
        runs = []
        for cfg in cfgs:
            job.build(cfg)
            losses = []
            for step in range(steps):
                got = [loss for r in job.step(step) for loss in r.losses]
                losses.append(sum(got) / len(got))
            dtypes = {str(p.dtype) for named in job.call("named_parameters") for p in named.values()}
            runs.append({"losses": losses, "dtypes": dtypes, "describe": job.call("describe")})
        compiled = job.build(cfgs[0].replace(compile=True))  # lazy: nothing compiles before a forward
        conn.send(("ok", (runs, compiled)))
        job.close()
    except BaseException as e:
        if job is not None:
            job.kill()
        conn.send(("error", f"{type(e).__name__}: {e}"))


MODEL = ModelConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, n_embd=64)
STEPS = 20
# Measured (seed 3, 20 steps of AdamW at lr 1e-3, loss 5.52 -> 4.37): bf16 autocast differs from fp32 by at
# most 5.7e-5 relative in the step losses with fp32 pipeline messages, 1.1e-4 with bf16 ones (the default under
# bf16), the same for 1f1b and zb-h1, whose bf16 losses are identical.
# 1e-3 is ~9x that: a mean over 512 tokens averages bf16's rounding (2^-8 per value) down, while a wrong
# gradient anywhere (a lost or double-counted deferred W, a bf16 master weight) moves these losses by 1e-2.
BF16_RTOL = 1e-3


@pytest.fixture(scope="module")
def precision_runs():
    base = TrainConfig.build(MODEL, stages=2, microbatches=4, microbatch_size=4, device="cpu", seed=3, lr=1e-3,
                             steps=STEPS, timeout_s=60)
    cases = [(s, p) for s in ("1f1b", "zb-h1") for p in ("fp32", "bf16")] + [("1f1b", "bf16-fp32-messages")]
    cfgs = [base.replace(schedule=s, precision=p[:4], p2p_dtype="fp32" if p.endswith("messages") else "auto")
            for s, p in cases]
    for cfg in cfgs:
        cfg.validate({})
    conn, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_serve, args=(child, cfgs, STEPS))
    t0 = time.monotonic()
    proc.start()
    try:
        while not conn.poll(1.0):
            assert proc.is_alive() and time.monotonic() - t0 < 300, "the training child died or hung"
        status, value = conn.recv()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", value
    runs, compiled = value
    return dict(zip(cases, runs)), compiled


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bf16_tracks_fp32(precision_runs, schedule):
    runs, _ = precision_runs
    fp32, bf16 = runs[(schedule, "fp32")]["losses"], runs[(schedule, "bf16")]["losses"]
    rel = [abs(b - f) / f for b, f in zip(bf16, fp32)]
    print(f"\n{schedule}: bf16 vs fp32 step losses, max relative difference {max(rel):.2e}")
    assert max(rel) < BF16_RTOL, (fp32, bf16)
    assert max(rel) > 0, "bf16 gave fp32's losses exactly: autocast did not run"
    assert fp32[-1] < fp32[0] - 0.5  # it trains, so a wrong update would show


def test_bf16_messages_track_fp32_messages(precision_runs):
    """--p2p-dtype: bf16 by default under bf16 (the messages really are narrower: the losses move), fp32 on
    request; both within the tolerance of fp32 training."""
    runs, _ = precision_runs
    fp32, wide = runs[("1f1b", "fp32")]["losses"], runs[("1f1b", "bf16-fp32-messages")]["losses"]
    narrow = runs[("1f1b", "bf16")]["losses"]
    assert narrow != wide
    for losses in (narrow, wide):
        assert max(abs(b - f) / f for b, f in zip(losses, fp32)) < BF16_RTOL


def test_split_backward_under_bf16_equals_full_backward(precision_runs):
    runs, _ = precision_runs
    assert runs[("zb-h1", "bf16")]["losses"] == pytest.approx(runs[("1f1b", "bf16")]["losses"], rel=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bf16_keeps_fp32_master_weights(precision_runs, schedule):
    run = precision_runs[0][(schedule, "bf16")]
    assert run["dtypes"] == {"torch.float32"}
    for d in run["describe"]:
        assert d["parameter_bytes"] == 4 * d["parameters"]
        # AdamW's exp_avg and exp_avg_sq in fp32 (plus a 4-byte step count per tensor)
        assert 8 * d["parameters"] <= d["optimizer_state_bytes"] < 8 * d["parameters"] + 4096
        assert d["compiled"] is False


def test_compile_reaches_every_worker(precision_runs):
    """--compile: each worker compiles its stages' modules in place (the compilation itself happens at the
    first forward, ~30 s for this model on 2 CPU cores, so it is not run here)."""
    _, compiled = precision_runs
    assert [d["compiled"] for d in compiled] == [True, True]
    assert TrainConfig.build(compile=True).runtime.compile is True


# --------------------------------------------------------------------------------------------------------------
# FLOPs and MFU

def test_flops_per_token_by_hand():
    # GPT-2 small: N = 12 layers x (12 x 768^2 + 13 x 768) + ln_f 2 x 768 + head 50257 x 768 = 123,653,376
    # (nanoGPT prints "number of parameters: 123.65M"); attention 12 x 12 x 12 x 64 x 1024 = 113,246,208.
    gpt2 = MODEL_PRESETS["gpt2"]
    assert matmul_parameters(gpt2) == 12 * (12 * 768**2 + 13 * 768) + 2 * 768 + 50257 * 768 == 123_653_376
    assert flops_per_token(gpt2) == 6 * 123_653_376 + 113_246_208 == 855_166_464
    # N is the model's parameter count without the position embedding (and an untied token embedding).
    for model in (MODEL_PRESETS["tiny"], dataclasses.replace(MODEL_PRESETS["tiny"], bias=False, tie_embeddings=False,
                                                              vocab_size=250, pad_vocab_to=64)):
        whole = GPT(model, init_seed=0)
        lookups = whole.wpe.weight.numel() + (0 if model.tie_embeddings else whole.wte.weight.numel())
        assert matmul_parameters(model) == whole.num_parameters() - lookups


def _results(device_name: str) -> list[WorkerStep]:
    return [WorkerStep(rank=0, losses=[], grad_norm=1.0, lr=1e-3, peak_memory=0, device_name=device_name),
            WorkerStep(rank=1, losses=[2.0], grad_norm=1.0, lr=1e-3, peak_memory=0, device_name=device_name)]


def test_mfu_is_flops_per_second_over_the_peak():
    cfg = TrainConfig.build(MODEL_PRESETS["gpt2"], stages=2, microbatches=4, microbatch_size=2)
    m = step_metrics(0, _results("cpu"), cfg, 0.5)
    assert m.flops_per_s == 855_166_464 * (4 * 2 * 1024) / 0.5 and m.mfu is None and m.lr == 1e-3
    assert step_metrics(0, _results("cpu"), cfg.replace(peak_tflops=20.0), 0.5).mfu == \
        pytest.approx(m.flops_per_s / (2 * 20e12))  # --peak-tflops is one device's: 2 ranks, 40 TFLOPS in all
    h100 = step_metrics(0, _results("NVIDIA H100 80GB HBM3"), cfg.replace(precision="bf16"), 0.5)
    assert h100.mfu == pytest.approx(m.flops_per_s / (2 * 989.5e12))
    assert step_metrics(0, _results("NVIDIA H100 80GB HBM3"), cfg.replace(dtype="float64"), 0.5).mfu is None
    assert step_metrics(0, _results("Some Future GPU"), cfg, 0.5).mfu is None


def test_control_time_and_cpu_shares_come_from_the_workers_answers():
    cfg = TrainConfig.build(MODEL_PRESETS["tiny"], stages=2, microbatches=4)
    results = [dataclasses.replace(r, compute_s=c, cpu_s=u)
               for r, c, u in zip(_results("cpu"), (0.30, 0.45), (0.25, 0.40))]
    m = step_metrics(0, results, cfg, 0.5, driver_cpu_s=0.01)
    assert m.control_s == pytest.approx(0.05)  # 0.5 s at the driver, 0.45 s in the slowest worker's step()
    assert m.cpu_per_rank == pytest.approx([0.5, 0.8]) and m.driver_cpu == pytest.approx(0.02)
    assert step_metrics(0, _results("cpu"), cfg, 0.5).control_s is None  # answers without timings


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA A100-PCIE-40GB", "fp32", 156.0),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5), ("NVIDIA H100 PCIe", "bf16", 756.5), ("NVIDIA H100 NVL", "fp32", 417.5),
    ("NVIDIA H200", "bf16", 989.5), ("NVIDIA L4", "bf16", 121.0), ("NVIDIA L40S", "bf16", None),
    ("NVIDIA A10G", "bf16", 125.0), ("NVIDIA A10", "fp32", 62.5), ("Tesla V100-SXM2-16GB", "fp32", 15.7),
    ("Tesla V100-SXM2-16GB", "bf16", None), ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
])
def test_peak_table(name, precision, peak):
    assert device_peak_tflops(name, precision) == peak


# --------------------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, before any worker starts

@pytest.mark.parametrize("args, must_name", [
    (["--lr-schedule", "linear"], ["--lr-schedule", "'linear'", "cosine", "constant"]),
    (["--warmup-steps", "-1"], ["warmup_steps=-1", ">= 0"]),
    (["--min-lr", "0.01", "--lr", "0.001"], ["min_lr=0.01", "lr=0.001"]),
    (["--precision", "bf16", "--dtype", "float64"], ["precision=bf16", "float64"]),
    (["--precision", "fp16"], ["--precision", "'fp16'"]),
    (["--peak-tflops", "-3"], ["peak_tflops=-3"]),
])
def test_bad_recipe_input_is_one_line_and_exit_2(no_workers, tmp_path, args, must_name):
    run_dir = tmp_path / "run"
    assert_one_line_error(invoke("run", *args, "--stages", "2", "--steps", "2", "--run-dir", run_dir), *must_name)
    assert not run_dir.exists()
