"""GPU smoke suite: the CUDA/NCCL path on one GPU. Skipped cleanly where CUDA is missing (but for a check of
its own child-process harness, which runs anywhere).

    python -m pytest tests/distributed/test_gpu_smoke.py -v

One GPU allows world size 1 only (NCCL refuses two ranks on one device), so these check what one
rank can: the actor runtime on CUDA in float64 against the CPU float64 model (zb-h1; zbv, whose two V stages
share the tied embedding on one rank), NCCL point-to-point to oneself through pipegpt's p2p layer
in mixed send+receive batches, the collectives the grid uses, and a receive that never comes.
Multi-rank NCCL (real peers) needs two GPUs and is not covered here.
"""
from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import queue as queues
import traceback
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from pipegpt.config import ModelConfig, TrainConfig  # noqa: E402
from pipegpt.data.loader import BatchSampler  # noqa: E402
from pipegpt.data.tokenizers import get_tokenizer
from pipegpt.data.tokens import builtin_tokens
from pipegpt.model.gpt import build_reference_model  # noqa: E402

from cluster_host import ClusterHost  # noqa: E402
from helpers import run_pipegpt  # noqa: E402

MODEL = ModelConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, n_embd=64)


def _config(schedule: str) -> TrainConfig:
    # float64: fp32 on CUDA means TF32 matmuls (as nanoGPT), whose rounding (~1e-3) would hide small errors
    return TrainConfig.build(MODEL, stages=1, schedule=schedule, microbatches=4, microbatch_size=2,
                             device="cuda", seed=11, timeout_s=120, dtype="float64")


def _reference_grads(cfg: TrainConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """Step 0's loss and clipped gradients of the whole model on CPU in float64."""
    model = build_reference_model(cfg.model, cfg.runtime.seed).double()
    sampler = BatchSampler(builtin_tokens(get_tokenizer(cfg.data.tokenizer)), cfg.batch_size, cfg.model.seq_len,
                           cfg.runtime.seed)
    x, y = sampler.batch(0)
    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@needs_cuda
@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_cuda_runtime_matches_the_float64_model(schedule):
    cfg = _config(schedule)
    host = ClusterHost(cfg)
    try:
        loss, grads, _ = host.run(cfg, 1)
    finally:
        host.close()
    ref_loss, ref_grads = _reference_grads(cfg)
    assert loss == pytest.approx(ref_loss, rel=1e-9)
    assert {n for n, _ in grads} == set(ref_grads)
    for name, grad in grads:
        ref = ref_grads[name]
        torch.testing.assert_close(grad, ref, rtol=1e-7, atol=1e-9 * float(ref.abs().max()),
                                   msg=lambda m: f"grad {name}: {m}")


# --------------------------------------------------------------------------------------------------------------
# NCCL in a world of one rank, each check in a fresh process (a timed-out communicator is aborted).

def _nccl_child(check: str, port: int, queue, stack_after_s: float) -> None:
    import torch.distributed as dist

    faulthandler.dump_traceback_later(stack_after_s, exit=True)  # a hang shows where, before the test gives up

    from pipegpt.comm.p2p import CommError, Message, PointToPoint
    from pipegpt.tensor_parallel import collectives as tpc

    device = torch.device("cuda", 0)
    try:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=timedelta(seconds=120), device_id=device)
        if check == "p2p":
            p2p = PointToPoint(0, timeout_s=60, device_type="cuda")
            got, want = [], []
            for n_send in (1, 3):  # the steady state (one send, one receive) and a larger mixed batch
                sends = [Message(torch.full((4096,), float(10 * n_send + i), device=device), 0, i, f"send {i}")
                         for i in range(n_send)]
                recvs = [Message(torch.empty(4096, device=device), 0, i, f"receive {i}") for i in range(n_send)]
                p2p.post(sends, recvs)
                for m in recvs:
                    p2p.wait(m)
                got += [float(m.tensor.sum()) / 4096 for m in recvs]  # read on the compute stream
                want += [float(10 * n_send + i) for i in range(n_send)]
                p2p.settle()
            queue.put(("ok", {"got": got, "want": want}))
        elif check == "collectives":
            x = torch.arange(8, dtype=torch.float64, device=device)
            dist.all_reduce(x)
            out = torch.empty(8, device=device)
            tpc._reduce_scatter_single(out, torch.arange(8.0, device=device))
            gathered = torch.empty(8, device=device)
            tpc._all_gather_single(gathered, torch.arange(8.0, device=device))
            queue.put(("ok", {"all_reduce_f64": x.tolist(), "reduce_scatter": out.tolist(),
                              "all_gather": gathered.tolist()}))
        elif check == "stuck":
            p2p = PointToPoint(0, timeout_s=3, device_type="cuda")
            recv = Message(torch.empty(16, device=device), 0, 0, "receive 0RECV_F0")
            try:
                p2p.post([], [recv])
            except dist.DistBackendError as e:  # NCCL 2.28 refuses a receive from itself with no send in its batch
                queue.put(("ok", f"refused at post: {str(e).splitlines()[0]}"))
            else:
                p2p.wait(recv)  # only orders the stream: the host goes on
                try:
                    p2p.settle()
                    queue.put(("ok", "settled: the receive that never came looked complete"))
                except CommError as e:
                    queue.put(("ok", str(e)))
        else:
            raise ValueError(f"no check named {check!r}")
        queue.put(("done", None))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put(("error", traceback.format_exc()))
    # os._exit skips the teardown (an aborted communicator can hang in destroy), and with it the queue's feeder
    # thread: what put() left to that thread must reach the pipe first, or the test waits for nothing.
    queue.close()
    queue.join_thread()
    os._exit(0)


def _in_child(check: str, timeout_s: float = 90):
    from pipegpt.comm.rpc import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_nccl_child, args=(check, free_port(), queue, timeout_s - 20))
    proc.start()
    try:
        status, value = queue.get(timeout=timeout_s)
    except queues.Empty:
        pytest.fail(f"the {check} check reported nothing in {timeout_s:g} s: its stack, dumped after "
                    f"{timeout_s - 20:g} s, is in the captured stderr")
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", value
    return value


def test_a_check_that_fails_sends_its_traceback_to_the_test():
    """The harness, on any machine: a failing child (no such check; off a GPU, no CUDA either) reports before its
    os._exit, so the test sees the error instead of waiting on an empty queue."""
    with pytest.raises(AssertionError, match="Traceback"):
        _in_child("no such check", timeout_s=60)


@needs_cuda
def test_nccl_self_send_receive_in_mixed_batches():
    result = _in_child("p2p")
    assert result["got"] == result["want"]


@needs_cuda
def test_nccl_collectives_of_the_grid_in_a_world_of_one():
    result = _in_child("collectives")
    assert result == {"all_reduce_f64": [float(i) for i in range(8)], "reduce_scatter": [float(i) for i in range(8)],
                      "all_gather": [float(i) for i in range(8)]}


@needs_cuda
def test_a_receive_that_never_comes_ends_with_a_clear_error():
    """One GPU has no peer that could fail to send, so the receive is from the rank itself: NCCL either refuses it
    at once (2.28 checks that a batch's receives from itself have their sends) or it times out as a late peer's."""
    message = _in_child("stuck")
    assert (message.startswith("rank 0: receive 0RECV_F0 with rank 0 failed after at most 3s")
            or message.startswith("refused at post:") and "invalid usage" in message.lower()), message


# --------------------------------------------------------------------------------------------------------------
# The CLI on CUDA, as a user runs it

@needs_cuda
def test_pipegpt_run_on_cuda(tmp_path):
    proc = run_pipegpt("run", "--stages", "1", "--device", "cuda", "--steps", "5", "--run-dir", tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 5 and metrics[-1]["loss"] < metrics[0]["loss"]
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    assert events and all(e["dur"] >= 0 for e in events)
    starts = [e["ts"] for e in sorted(events, key=lambda e: e["ts"])]
    assert starts[0] >= 0
