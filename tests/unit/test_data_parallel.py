"""pipegpt.data_parallel: where each parameter lives in a stage's flat buffers and which elements each rank's
shard holds; the two ways of reduce-scattering and all-gathering (on gloo, two processes); and ZeRO-3's memory
inside a step: between a RESHARD and the next UNSHARD a rank holds its shard of the parameters, nothing more;
with the microbatch policy's prefetch two stages gathered at most, and once a stage's gradient reduce-scatter
is done only its shard of the gradients (counted from the storages). The numbers of a whole run: tests/distributed/test_zero.py."""
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
        torch.save({"ops": _ops(rank), "zero3": _zero3_step(rank), "prefetch": _prefetch_step(rank)},
                   f"{out}.{rank}")
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


# ZeRO-3 inside a step: two stages on one rank, gathered around each run of their actions (placed by hand: the
# microbatch policy's prefetch keeps two alternating stages gathered throughout)
ONE_RANK_TWO_STAGES = ("0UNSHARD 0F0 0RESHARD 1UNSHARD 1F0 1B0 1RESHARD 0UNSHARD 0B0 0F1 0RESHARD "
                       "1UNSHARD 1F1 1B1 1RESHARD 0UNSHARD 0B1 0RESHARD\n")


class Watched:
    """The plan's collectives, noting after each RESHARD what the rank's parameters hold."""

    def __init__(self, dp, stages):
        self.dp, self.stages, self.seen = dp, stages, []

    def reduce_grad(self, stage):
        self.dp.reduce_grad(stage)

    def unshard(self, stage):
        self.dp.unshard(stage)

    def ready(self, stage, backward):
        self.dp.ready(stage, backward)

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
    from pipegpt.stages.runtime import PipelineRuntime
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


class Counted:
    """The plan's collectives, noting after each of them and before each compute action which stages' full
    parameter and gradient buffers the rank holds, and its bytes (from the storages)."""

    def __init__(self, dp):
        self.dp, self.seen = dp, []

    def note(self, what):
        buffers = self.dp.buffers.values()
        self.seen.append((what, [b.stage for b in buffers if b.gathered],
                          [b.stage for b in buffers if b.grad_flat is not None], self.dp.storage_bytes()))

    def reduce_grad(self, stage):
        self.dp.reduce_grad(stage)
        self.note(f"{stage}REDUCE_GRAD")

    def unshard(self, stage):
        self.dp.unshard(stage)
        self.note(f"{stage}UNSHARD")

    def ready(self, stage, backward):
        self.dp.ready(stage, backward)

    def reshard(self, stage):
        self.dp.reshard(stage)
        self.note(f"{stage}RESHARD")


def _prefetch_step(rank: int) -> dict:
    """FSDP per block: one rank's pipeline of 4 stages (interleaved, pp 1, one microbatch), zero 3 over 2 ranks,
    gathered by the microbatch policy (prefetched); its gradients against the same model in plain torch."""
    from pipegpt.comm.p2p import PointToPoint
    from pipegpt.config import ModelConfig
    from pipegpt.data_parallel import DataParallel
    from pipegpt.model.gpt import GPT
    from pipegpt.stages.runtime import PipelineRuntime
    from pipegpt.schedule import add_reduce_grad, add_unshard_reshard, build_plan, lower, validate
    from pipegpt.stages import Stage

    model = dataclasses.replace(ModelConfig(vocab_size=64, seq_len=8, n_layer=4, n_head=2, n_embd=16),
                                tie_embeddings=False)
    plan = validate(add_unshard_reshard(add_reduce_grad(lower(build_plan("interleaved-1f1b", 1, 1, 4))),
                                        "microbatch"))
    stages = {s: Stage(s, 4, GPT(model, layers=range(s, s + 1), embed=s == 0, head=s == 3, init_seed=0), 1)
              for s in range(4)}
    params = {s: list(st.module.parameters()) for s, st in stages.items()}
    full = {s: sum(p.numel() * 4 for p in ps) for s, ps in params.items()}
    dp = DataParallel(params, params, None, rank, zero=3, rank=rank, timeout_s=60)
    counted = Counted(dp)
    runtime = PipelineRuntime(plan, rank, stages, PointToPoint(rank, 60.0, "cpu"), [rank], (1, 8, 16),
                              torch.float32, "cpu", collectives=counted)
    runtime.intercept(before_compute=lambda a: counted.note(str(a)))
    tokens = [torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(rank))]
    dp.zero_grad()
    runtime.step(tokens, tokens, record=False)
    dp.finish()
    counted.note("finish")
    one = GPT(model, init_seed=0)  # the same weights by name, whole: each rank's gradient, then their average
    one(tokens[0], tokens[0]).backward()
    mine = {n: p.grad for n, p in one.named_parameters()}
    theirs = {n: g.clone() for n, g in mine.items()}
    for g in theirs.values():
        dist.all_reduce(g)
    got = dp.full_grads()
    names = {id(p): n for st in stages.values() for n, p in st.module.named_parameters()}
    return {"plan": plan.to_text(), "seen": counted.seen, "full": full,
            "grads": {names[i]: g for i, g in got.items()}, "want": {n: g / 2 for n, g in theirs.items()}}


def test_prefetch_holds_two_stages_gathered_and_frees_reduced_gradients(two_ranks):
    shard = lambda s, full: full[s] // 2  # noqa: E731 (a bucket's padding: a few bytes more)
    for rank in range(2):
        got = two_ranks[rank]["prefetch"]
        assert got["plan"] == ("0UNSHARD 1UNSHARD 0F0 0RESHARD 2UNSHARD 1F0 1RESHARD 3UNSHARD 2F0 3F0 3B0 "
                               "3REDUCE_GRAD 3RESHARD 1UNSHARD 2B0 2REDUCE_GRAD 2RESHARD 0UNSHARD 1B0 1REDUCE_GRAD "
                               "1RESHARD 0B0 0REDUCE_GRAD 0RESHARD\n")
        seen = {what: (gathered, grads, held) for what, gathered, grads, held in got["seen"]}
        # the gather of the next stage is posted before this one computes: two gathered, never three
        assert seen["0F0"][0] == [0, 1] and seen["1F0"][0] == [1, 2] and seen["2F0"][0] == [2, 3]
        assert seen["3B0"][0] == [2, 3] and seen["2B0"][0] == [1, 2] and seen["1B0"][0] == [0, 1]
        assert max(len(g) for _, g, _, _ in got["seen"]) == 2
        # gradients: a stage's full buffer from its backward until its reduce-scatter is done (waited for at
        # the next REDUCE_GRAD): two at most, and then the shard only
        assert [seen[a][1] for a in ("3F0", "3B0", "2B0", "1B0", "0B0")] == [[], [3], [2, 3], [1, 2], [0, 1]]
        assert [seen[f"{s}REDUCE_GRAD"][1] for s in (3, 2, 1, 0)] == [[3], [2], [1], [0]]
        full, total = got["full"], sum(got["full"].values())
        for what, gathered, grads, held in got["seen"]:
            want_params = sum(shard(s, full) for s in full) + sum(full[s] for s in gathered)
            want_grads = sum(shard(s, full) for s in full) + sum(full[s] for s in grads)
            assert want_params <= held["parameters"] <= want_params + 64, what
            assert want_grads <= held["gradients"] <= want_grads + 64, what
        assert seen["finish"][:2] == ([], []) and total // 2 <= seen["finish"][2]["gradients"] <= total // 2 + 64
        for name, want in got["want"].items():  # the averaged gradients of the whole model, gathered from shards
            torch.testing.assert_close(got["grads"][name], want, rtol=1e-5, atol=1e-6, msg=name)
