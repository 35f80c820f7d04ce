"""pipegpt.data_parallel: where each parameter lives in a stage's flat buffers and which elements each rank's
shard holds; the two ways of reduce-scattering and all-gathering (on gloo, two processes); and ZeRO-3's memory
inside a step: between a RESHARD and the next UNSHARD a rank holds its shard of the parameters, nothing more
(counted from the storages). The numbers of a whole run: tests/distributed/test_zero.py."""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipegpt.data_parallel import FlatLayout, Piece, choose_shard_ops
from pipegpt.data_parallel.shard_ops import ALL_REDUCE, NATIVE

from plan_memory_harness import free_port


def test_a_layout_cuts_each_bucket_into_equal_chunks():
    layout = FlatLayout([5, 3, 7], element_size=4, bucket_bytes=1000, shards=2)
    assert layout.offsets == [0, 5, 8] and layout.total == 16 and layout.shard_numel == 8  # 15, padded to 16
    assert layout.pieces(0) == [Piece(0, 0, 5, 0), Piece(1, 0, 3, 5)]
    assert layout.pieces(1) == [Piece(2, 0, 7, 0)]  # elements 8..14; 15 is padding
    # a tensor alone in its bucket (the tied embedding's copies) starts one and ends it
    alone = FlatLayout([5, 3, 7], element_size=4, bucket_bytes=1000, shards=2, alone=frozenset({1}))
    assert [(b.first, b.end, b.padded) for b in alone.buckets] == [(0, 1, 6), (1, 2, 4), (2, 3, 8)]
    assert alone.pieces(0) == [Piece(0, 0, 3, 0), Piece(1, 0, 2, 3), Piece(2, 0, 4, 5)]
    assert FlatLayout([5, 3, 7], 4, bucket_bytes=1000).total == 15  # unsharded: no padding


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_the_shards_hold_every_element_once(shards):
    numels = [7, 1, 30, 12, 5, 64, 3]
    layout = FlatLayout(numels, element_size=4, bucket_bytes=4 * 20, shards=shards, alone=frozenset({3}))
    assert len(layout.buckets) > 2 and all(b.padded % shards == 0 for b in layout.buckets)
    held = sorted((pc.param, e) for r in range(shards) for pc in layout.pieces(r) for e in range(pc.start, pc.stop))
    assert held == [(i, e) for i, n in enumerate(numels) for e in range(n)]
    for r in range(shards):  # a piece sits in the shard buffer where its bucket's chunk does
        assert all(0 <= pc.shard_offset and pc.shard_offset + pc.numel <= layout.shard_numel for pc in layout.pieces(r))


def test_the_ops_are_chosen_by_backend():
    assert choose_shard_ops("nccl") is NATIVE and choose_shard_ops("gloo") is NATIVE
    assert choose_shard_ops("mpi") is ALL_REDUCE  # a backend without reduce-scatter: all-reduce, keep the shard


def _worker(rank: int, port: int, out: str) -> None:
    """Both checks below in one pair of processes (starting them is most of the time)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        torch.save({"ops": _ops(rank), "zero3": _zero3_step(rank)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("data-parallel") / "out")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


def _ops(rank: int) -> dict:
    results = {}
    for ops in (NATIVE, ALL_REDUCE):
        bucket = torch.arange(8, dtype=torch.float32) * (rank + 1)  # summed: 3 x arange
        chunk = torch.empty(4)
        ops.reduce_scatter(chunk, bucket, None, rank).wait()
        full = torch.full((8,), -1.0)
        full[rank * 4:(rank + 1) * 4] = 10 * (rank + 1)
        ops.all_gather(full, full[rank * 4:(rank + 1) * 4], None, rank).wait()  # in place, as ZeRO-1/2 do
        results[ops.name] = (chunk, full)
    return results


def test_both_ways_reduce_scatter_and_all_gather_alike(two_ranks):
    for rank in range(2):
        for chunk, full in two_ranks[rank]["ops"].values():
            assert torch.equal(chunk, 3 * torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32))
            assert torch.equal(full, torch.tensor([10.0] * 4 + [20.0] * 4))


# ZeRO-3 inside a step: two stages on one rank, gathered around each run of their actions (--unshard microbatch)
ONE_RANK_TWO_STAGES = "0F0 1F0 1B0 0B0 0F1 1F1 1B1 0B1\n"


class Watched:
    """The plan's collectives, noting after each RESHARD what the rank's parameters hold."""

    def __init__(self, dp, stages):
        self.dp, self.stages, self.seen = dp, stages, []

    def reduce_grad(self, stage):
        self.dp.reduce_grad(stage)

    def unshard(self, stage):
        self.dp.unshard(stage)

    def reshard(self, stage):
        self.dp.reshard(stage)
        gathered = any(self.dp.unsharded.values())
        self.seen.append((stage, gathered, self.dp.storage_bytes()["parameters"],
                          sum(p.untyped_storage().nbytes() for p in self.stages[stage].module.parameters())))


def _zero3_step(rank: int) -> dict:
    from pipegpt.comm.p2p import PointToPoint
    from pipegpt.config import ModelConfig
    from pipegpt.data_parallel import DataParallel
    from pipegpt.model.gpt import GPT
    from pipegpt.runtime import PipelineRuntime
    from pipegpt.schedule import add_reduce_grad, add_unshard_reshard, validate
    from pipegpt.schedule.schedule_file import parse_schedule_text
    from pipegpt.stages import Stage

    model = dataclasses.replace(ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=16),
                                tie_embeddings=False)
    plan = validate(add_unshard_reshard(add_reduce_grad(parse_schedule_text(ONE_RANK_TWO_STAGES)), "microbatch"))
    stages = {s: Stage(s, 2, GPT(model, layers=range(s, s + 1), embed=s == 0, head=s == 1, init_seed=0), 2)
              for s in (0, 1)}
    params = {s: list(st.module.parameters()) for s, st in stages.items()}
    full = {s: sum(p.numel() * 4 for p in ps) for s, ps in params.items()}
    dp = DataParallel(params, params, None, rank, zero=3, rank=rank, timeout_s=60)
    shard = sum(buf.param_shard.untyped_storage().nbytes() for buf in dp.buffers.values())
    watched = Watched(dp, stages)
    runtime = PipelineRuntime(plan, rank, stages, PointToPoint(rank, 60.0, "cpu"), [rank], (1, 8, 16),
                              torch.float32, "cpu", collectives=watched)
    tokens = [torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(rank * 2 + i)) for i in range(2)]
    dp.zero_grad()
    runtime.step(tokens, tokens, record=False)
    dp.finish()
    return {"seen": watched.seen, "shard": shard, "full": full, "plan": plan.to_text(), "after": dp.storage_bytes()}


def test_between_reshard_and_unshard_a_rank_holds_its_shard_only(two_ranks):
    for rank in range(2):
        got = two_ranks[rank]["zero3"]
        assert got["plan"].count("UNSHARD") == 5  # a gather per run of a stage's actions
        assert [s for s, *_ in got["seen"]] == [0, 1, 0, 1, 0]
        total = sum(got["full"].values())
        assert total // 2 <= got["shard"] <= total // 2 + 64  # half, padded per bucket
        for stage, gathered, held, stage_bytes in got["seen"]:
            assert not gathered and held == got["shard"] and stage_bytes == 0, (stage, held, stage_bytes)
        # after the step: the shard of the parameters and of the gradients, the full gradients freed
        assert got["after"] == {"parameters": got["shard"], "gradients": got["shard"]}
