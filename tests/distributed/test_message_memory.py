"""Message memory follows the schedule, on both point-to-point behaviours (tag as gloo, order as NCCL).

Four gloo ranks run one step of a tiny model per (behaviour, schedule, microbatch count) with the real
runtime and stages. Each rank counts the storage bytes of message tensors it still holds (a tensor to
send from the compute that makes it, a received buffer from its batch), leaving out what a stage holds
as its input (an activation), and keeps the peak over the step. 1F1B's peak does not depend on the
microbatch count, GPipe's grows with it (its forwards are all in flight before the first backward),
and every peak is what pipegpt.schedule.messages.message_peaks says (which the planner's memory model
counts).

Before message buffers were released at the schedule's release points, every send (and, on the order
behaviour, every receive) lived until the end of the step, so 1F1B's peak grew with m too.
"""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipegpt.config import ModelConfig
from pipegpt.schedule import build_plan, lower
from pipegpt.schedule.messages import message_peaks

P = 4
MICROBATCHES = (4, 8, 16)
SCHEDULES = ("1f1b", "gpipe")
MATCHINGS = ("tag", "order")
MODEL = ModelConfig(vocab_size=64, seq_len=16, n_layer=P, n_head=2, n_embd=32)
MESSAGE = MODEL.seq_len * MODEL.n_embd * 4  # one sequence per microbatch, fp32


def _peak_message_bytes(rank: int, matching: str, schedule: str, m: int) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    from pipegpt.comm.p2p import PointToPoint
    from pipegpt.model.gpt import GPT
    from pipegpt.stages.runtime import PipelineRuntime
    from pipegpt.stages import Stage, partition_layers

    plan = lower(build_plan(schedule, P, m))
    last, ranges = plan.num_stages - 1, partition_layers(MODEL.n_layer, plan.num_stages)
    stages = {s: Stage(s, plan.num_stages, GPT(MODEL, layers=ranges[s], embed=s == 0, head=s == last, init_seed=0), m)
              for s in plan.stages_of(rank)}
    held: dict[int, tuple[StorageWeakRef, int]] = {}  # data_ptr -> (the storage, its bytes)
    peak = 0

    def hold(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        held[storage.data_ptr()] = StorageWeakRef(storage), storage.nbytes()

    def measure() -> None:
        nonlocal peak
        inputs = {x.untyped_storage().data_ptr() for stage in stages.values() for x in stage.inputs.values()}
        peak = max(peak, sum(n for ptr, (ref, n) in held.items() if not ref.expired() and ptr not in inputs))

    p2p = PointToPoint(rank, timeout_s=30, device_type="cpu", matching=matching)
    post = p2p.post

    def counted_post(sends, recvs):
        post(sends, recvs)
        for message in recvs:
            hold(message.tensor)
        measure()

    p2p.post = counted_post
    for s, stage in stages.items():
        def counted(method, sent_to):
            def run(*args, **kwargs):
                out = method(*args, **kwargs)
                if out is not None and 0 <= sent_to <= last and plan.stage_to_rank[sent_to] != rank:
                    hold(out)  # on its way to another rank
                measure()
                return out
            return run
        stage.forward = counted(stage.forward, s + 1)
        stage.backward = counted(stage.backward, s - 1)
    runtime = PipelineRuntime(plan, rank, stages, p2p, list(range(P)), (1, MODEL.seq_len, MODEL.n_embd),
                              torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, MODEL.vocab_size, (1, MODEL.seq_len), generator=g) for _ in range(2 * m)]
    runtime.step(tokens[:m] if 0 in stages else None, tokens[m:] if last in stages else None, record=False)
    return peak


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                            timeout=timedelta(seconds=60))
    peaks = {(matching, schedule, m): _peak_message_bytes(rank, matching, schedule, m)
             for matching in MATCHINGS for schedule in SCHEDULES for m in MICROBATCHES}
    torch.save(peaks, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    """{(matching, schedule, m): [peak message bytes of each rank]}."""
    from pipegpt.comm.rpc import free_port

    out = tmp_path_factory.mktemp("message-memory")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=P, join=True)
    per_rank = [torch.load(out / f"rank{r}.pt") for r in range(P)]
    return {case: [ranks[case] for ranks in per_rank] for case in per_rank[0]}


@pytest.mark.parametrize("matching", MATCHINGS)
def test_1f1b_holds_as_many_messages_whatever_the_microbatch_count(peaks, matching):
    measured = [peaks[(matching, "1f1b", m)] for m in MICROBATCHES]
    assert all(row == measured[0] for row in measured), dict(zip(MICROBATCHES, measured))
    assert max(measured[0]) <= (P + 1) * MESSAGE  # bounded by the stage count


@pytest.mark.parametrize("matching", MATCHINGS)
def test_gpipe_holds_every_microbatchs_message(peaks, matching):
    for m in MICROBATCHES:  # every forward is in flight before the first backward acknowledges one
        assert min(peaks[(matching, "gpipe", m)]) >= m * MESSAGE, (m, peaks[(matching, "gpipe", m)])


@pytest.mark.parametrize("matching", MATCHINGS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_schedule_predicts_what_each_rank_holds(peaks, matching, schedule):
    for m in MICROBATCHES:
        predicted = message_peaks(lower(build_plan(schedule, P, m)), eager_sends=matching == "tag")
        assert peaks[(matching, schedule, m)] == [n * MESSAGE for n in predicted], (m, predicted)
