"""The CUDA/NCCL path's logic, checked on CPU with stand-ins for what only a GPU has.

- Point-to-point: NCCL coalesces a batch and returns ONE Work for it (gloo: one per operation).
  A stand-in backend whose batch returns one Work that delivers every receive only when waited
  proves that each receive of a batch is waited for before its buffer is read.
- Device choice under a torchrun-like environment and in a local launch that inherited LOCAL_RANK.
- The tensor-parallel reduce-scatter falls back to all-reduce only on gloo; an NCCL error propagates.
- Actor methods run on one actor thread per worker and make the worker's GPU current there.
- Sends: posted as soon as their tensor exists on gloo (matched by tag), in plan order on NCCL; a receive is
  waited for by the compute that reads it, not by the batch that posted it.
- The two point-to-point behaviours are chosen apart from the device: "order" (NCCL's) runs on CPU too,
  and what settle() keeps until the end of the step is the Works, never the tensors.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pipegpt.comm.p2p import CommError, Message, PointToPoint
from pipegpt.config import ConfigError, TrainConfig
from pipegpt.engine.placement import cuda_device_index, local_world_size, resolve_device, under_torchrun
from pipegpt.tensor_parallel import collectives as tpc
from pipegpt.train.worker import Worker, actor_method


class BatchWork:
    """A coalesced batch's single Work: the receives hold their data only once it is waited for.
    Each receive gets the value of its tag (what its sender would have sent)."""

    def __init__(self, ops, arrives: bool = True):
        self.ops, self.arrives, self.completed = ops, arrives, False

    def _deliver(self):
        for op in self.ops:
            if op.op is dist.irecv:
                op.tensor.fill_(float(op.tag))
        self.completed = True

    def wait(self, timeout=None):
        if not self.arrives:  # as NCCL's timed wait on a receive whose sender never sends
            raise RuntimeError("Work timed out in blocking wait")
        self._deliver()
        return True

    def is_completed(self):
        return self.completed


@pytest.fixture
def coalescing_backend(monkeypatch):
    """dist.batch_isend_irecv as on NCCL: one Work for the whole batch. Returns the batches posted."""
    posted = []

    def batch_isend_irecv(ops):
        posted.append(BatchWork(ops))
        return [posted[-1]]

    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    return posted


def _messages():
    send = Message(torch.zeros(3), peer=1, tag=1, label="send 0SEND_F0")
    recvs = [Message(torch.zeros(3), peer=1, tag=t, label=f"receive 0RECV_B{t}") for t in (2, 3)]
    return send, recvs


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_every_receive_of_a_coalesced_batch_is_waited_for(coalescing_backend, device_type):
    # The steady state of 1F1B: a send first, then the receives, in one batch.
    p2p = PointToPoint(rank=0, timeout_s=5, device_type=device_type)
    send, recvs = _messages()
    p2p.post([send], recvs)
    assert not any(p2p.done(m) for m in recvs), "a receive looked complete before its batch was"
    for message in recvs:
        p2p.wait(message)
        assert torch.equal(message.tensor, torch.full((3,), float(message.tag))), message.label
    p2p.settle()
    assert p2p.done(send)


def test_a_send_is_done_only_when_its_batch_is(coalescing_backend):
    p2p = PointToPoint(rank=0, timeout_s=5)
    send, recvs = _messages()
    p2p.post([send], recvs)
    assert not p2p.done(send)
    coalescing_backend[0].wait()
    assert p2p.done(send) and all(p2p.done(m) for m in recvs)


def test_one_work_per_operation_is_kept_per_message(monkeypatch):
    """gloo's form: each message waits only for its own operation."""
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [BatchWork([op]) for op in ops])
    p2p = PointToPoint(rank=0, timeout_s=5)
    send, recvs = _messages()
    p2p.post([send], recvs)
    p2p.wait(recvs[0])
    assert recvs[0].tensor[0] == 2 and recvs[1].tensor[0] == 0  # the other receive is still on its way
    assert not p2p.done(recvs[1])


def test_on_cuda_a_receive_that_never_comes_ends_the_step_with_the_message_named(monkeypatch):
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [BatchWork(ops, arrives=False)])
    p2p = PointToPoint(rank=3, timeout_s=2, device_type="cuda")
    recv = Message(torch.zeros(3), peer=2, tag=0, label="receive 3RECV_F0")
    p2p.post([], [recv])
    with pytest.raises(CommError, match=r"rank 3: receive 3RECV_F0 with rank 2 failed after at most 2s"):
        p2p.settle()


def test_matched_by_order_each_lane_s_messages_go_on_its_own_group(coalescing_backend):
    """Rank 1 of three sends to rank 2 and to rank 0 and receives from rank 0 in one run: one batch per lane (a peer
    and a direction), each on its own group, so each message waits only for its own lane's Work (on one group NCCL
    would run them one after the other on one stream)."""
    groups = {0: ("1 to 0", "0 to 1"), 2: ("1 to 2", "2 to 1")}
    p2p = PointToPoint(rank=1, timeout_s=5, device_type="cuda", pairs=groups)
    to_2 = Message(torch.zeros(3), peer=2, tag=4, label="send 1SEND_F0")
    to_0 = Message(torch.zeros(3), peer=0, tag=5, label="send 1SEND_B2")
    from_0 = Message(torch.zeros(3), peer=0, tag=7, label="receive 1RECV_F3")
    p2p.post([to_2, to_0], [from_0])
    assert [[(op.peer, op.group) for op in batch.ops] for batch in coalescing_backend] == \
        [[(2, "1 to 2")], [(0, "1 to 0")], [(0, "0 to 1")]]
    p2p.wait(from_0)
    assert p2p.done(from_0) and not p2p.done(to_0) and not p2p.done(to_2)
    assert p2p.unsettled_peers() == (0, 2)


def test_matched_by_tag_or_without_a_pair_s_groups_a_batch_is_one_on_the_default_group(coalescing_backend):
    for p2p in (PointToPoint(rank=1, timeout_s=5, device_type="cpu", matching="tag", pairs={2: ("a", "b")}),
                PointToPoint(rank=1, timeout_s=5, device_type="cuda", pairs={0: ("1 to 0", "0 to 1")})):
        coalescing_backend.clear()
        p2p.post([Message(torch.zeros(3), peer=2, tag=4, label="send")],
                 [Message(torch.zeros(3), peer=2, tag=5, label="receive")])
        assert [[op.group for op in batch.ops] for batch in coalescing_backend] == [[None, None]]


@pytest.mark.parametrize("p", range(2, 9))
def test_every_schedule_s_messages_go_between_pipeline_pairs(p):
    """comm/mesh.py makes two groups for each pair of pipeline neighbours (the last with the first too); every
    registered schedule's stage hand-overs go between such a pair, so no message of theirs takes the default
    group. With data and tensor parallelism the pairs stay within each pipeline."""
    from pipegpt.comm.mesh import pipeline_pairs
    from pipegpt.dims import ParallelDims
    from pipegpt.schedule import SCHEDULES

    pairs = set(pipeline_pairs(ParallelDims(pp=p)))
    assert len(pairs) == (p if p > 2 else 1)
    for name, spec in SCHEDULES.items():
        placement = spec.stage_to_rank(p)
        hand_overs = {tuple(sorted(ab)) for ab in zip(placement, placement[1:]) if ab[0] != ab[1]}
        assert hand_overs <= pairs, (name, hand_overs - pairs)
    dims = ParallelDims(dp=2, pp=p, tp=2)
    pipelines = dims.groups(("pp",))
    assert all(any({a, b} <= set(members) for members in pipelines) for a, b in pipeline_pairs(dims))
    assert len(pipeline_pairs(dims)) == len(pairs) * 4


class TokenWork:
    """A Work that holds no tensor (as NCCL's once the stream has waited for it): complete when waited for."""

    def __init__(self):
        self.waits = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return True

    def is_completed(self):
        return bool(self.waits)


def test_settle_keeps_the_works_not_the_tensors(monkeypatch):
    """Until the end of the step the host must still wait for every send and receive (the timeout), but
    a message's memory must go when the runtime drops the message, not at settle()."""
    from torch.multiprocessing.reductions import StorageWeakRef

    works = []
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: (works.append(TokenWork()), [works[-1]])[1])
    p2p = PointToPoint(rank=0, timeout_s=5, device_type="cuda")
    send = Message(torch.zeros(1024), peer=1, tag=0, label="send 0SEND_F0")
    storage = StorageWeakRef(send.tensor.untyped_storage())
    p2p.post([send], [])
    p2p.wait(send)  # the stream waits (the schedule's release point); the runtime then drops the message
    del send
    assert storage.expired(), "settle()'s bookkeeping keeps the sent tensor alive"
    assert p2p.unsettled_peers() == (1,)
    p2p.settle()
    assert works[0].waits == [None, p2p.timeout]  # the host still waited for it, with the timeout


@pytest.mark.parametrize("device_type,matching,chosen", [
    ("cpu", "auto", "tag"), ("cuda", "auto", "order"), ("cpu", "order", "order"), ("cpu", "tag", "tag"),
    ("cuda", "order", "order")])
def test_the_matching_is_chosen_apart_from_the_device(device_type, matching, chosen):
    p2p = PointToPoint(rank=0, timeout_s=5, device_type=device_type, matching=matching)
    assert (p2p.matching, p2p.matches_by_tag) == (chosen, chosen == "tag")
    assert p2p.host_waits == (device_type != "cuda")  # on CPU the host stands in for the stream's wait


def test_tag_matching_is_refused_on_cuda():
    with pytest.raises(ValueError, match="NCCL matches point-to-point messages by order"):
        PointToPoint(rank=0, timeout_s=5, device_type="cuda", matching="tag")
    with pytest.raises(ConfigError, match="p2p_matching='tag' needs gloo"):
        TrainConfig.build(device="cuda", p2p_matching="tag").validate()
    with pytest.raises(ConfigError, match="p2p_matching='tags' is not one of auto, tag, order"):
        TrainConfig.build(p2p_matching="tags").validate()
    TrainConfig.build(device="cpu", p2p_matching="order").validate()
    with pytest.raises(ConfigError, match="p2p_groups='pair' is not one of auto, pairs, world"):
        TrainConfig.build(p2p_groups="pair").validate()
    TrainConfig.build(device="cpu", p2p_matching="order", p2p_groups="pairs").validate()


# --------------------------------------------------------------------------------------------------------------
# Device choice

TORCHRUN_NODE = {"RANK": "5", "WORLD_SIZE": "16", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
                 "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}


def test_torchrun_uses_the_local_world_size_and_local_rank():
    assert under_torchrun(TORCHRUN_NODE)
    assert local_world_size(16, TORCHRUN_NODE) == 4
    # 4 GPUs on a node of 4 ranks, 16 ranks in all: CUDA (comparing with 16 would fall back to CPU).
    assert resolve_device("auto", 16, cuda_count=4, env=TORCHRUN_NODE) == "cuda"
    assert resolve_device("auto", 16, cuda_count=2, env=TORCHRUN_NODE) == "cpu"
    assert cuda_device_index(5, TORCHRUN_NODE) == 1


def test_a_local_launch_ignores_an_inherited_local_rank():
    shell = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}  # e.g. left over from a launcher
    assert not under_torchrun(shell)
    assert [cuda_device_index(r, shell) for r in range(4)] == [0, 1, 2, 3]
    assert local_world_size(4, shell) == 4
    assert resolve_device("auto", 4, cuda_count=2, env=shell) == "cpu"
    assert resolve_device("auto", 4, cuda_count=4, env=shell) == "cuda"
    assert resolve_device("cpu", 4, cuda_count=4, env=shell) == "cpu"
    assert resolve_device("auto", 1, cuda_count=0, env={}) == "cpu"


# --------------------------------------------------------------------------------------------------------------
# Reduce-scatter fallback

@pytest.fixture
def reduce_scatter_fails(monkeypatch):
    """A two-rank group whose reduce-scatter raises; all-reduce doubles (the other rank holds the same)."""
    monkeypatch.setattr(tpc, "group_size", lambda group: 2)
    monkeypatch.setattr(tpc, "_NO_REDUCE_SCATTER", set())
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)

    def failing(out, x, group=None):
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(tpc, "_reduce_scatter_single", failing)
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None, op=None: x.mul_(2))
    return monkeypatch


def test_reduce_scatter_falls_back_to_all_reduce_on_gloo(reduce_scatter_fails):
    reduce_scatter_fails.setattr(dist, "get_backend", lambda group=None: "gloo")
    x = torch.arange(8.0).view(1, 4, 2)
    out = tpc._reduce_scatter(x, 1, group=object())
    assert torch.equal(out, 2 * torch.arange(4.0, 8.0).view(1, 2, 2)), "rank 1's half of the sum"
    assert torch.equal(x, torch.arange(8.0).view(1, 4, 2)), "the input is not modified"
    assert tpc._NO_REDUCE_SCATTER == {"gloo"}


def test_reduce_scatter_errors_propagate_on_nccl(reduce_scatter_fails):
    reduce_scatter_fails.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="NCCL error"):
        tpc._reduce_scatter(torch.arange(8.0).view(1, 4, 2), 1, group=object())
    assert not tpc._NO_REDUCE_SCATTER


# --------------------------------------------------------------------------------------------------------------
# The worker's device on RPC threads

def test_every_worker_method_the_driver_calls_enters_the_device():
    own = {name for cls in Worker.__mro__ if cls.__module__.startswith("pipegpt.") for name in vars(cls)}
    public = [name for name in sorted(own) if not name.startswith("_") and callable(getattr(Worker, name))]
    assert {"start", "build", "step", "describe", "named_grads", "shutdown"} <= set(public)
    assert [n for n in public if not getattr(getattr(Worker, n), "is_actor_method", False)] == []


def test_an_actor_method_sets_the_current_device_on_its_own_thread(monkeypatch):
    current = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.__setitem__(threading.get_ident(), d))

    class Actor:
        device = torch.device("cuda", 3)

        @actor_method
        def where(self):
            return current.get(threading.get_ident())

    seen = []
    thread = threading.Thread(target=lambda: seen.append(Actor().where()))  # as an RPC pool thread
    thread.start()
    thread.join()
    assert seen == [torch.device("cuda", 3)]


# --------------------------------------------------------------------------------------------------------------
# One actor thread per worker: whichever RPC thread receives a call, the method runs on the same thread

def test_actor_methods_run_on_one_thread_whichever_thread_calls_them():
    class Actor:
        @actor_method
        def ident(self):
            return threading.get_ident()

        @actor_method
        def nested(self):
            return self.ident()  # an actor method calling another runs inline, it does not wait for itself

    actor, seen = Actor(), []
    callers = [threading.Thread(target=lambda: seen.append((actor.ident(), actor.nested()))) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=10)
    assert len(seen) == 4 and len({ident for pair in seen for ident in pair}) == 1
    assert seen[0][0] not in {t.ident for t in callers}


def test_a_concurrent_actor_method_answers_while_the_actor_thread_is_busy():
    release = threading.Event()

    class Actor:
        @actor_method
        def busy(self):
            return release.wait(timeout=10)

        @actor_method(concurrent=True)
        def where(self):
            return "answered"

    actor, done = Actor(), []
    busy = threading.Thread(target=lambda: done.append(actor.busy()))
    busy.start()
    try:
        assert actor.where() == "answered"  # would wait 10 s behind busy() on the actor thread
        assert done == []
    finally:
        release.set()
        busy.join(timeout=10)
    assert done == [True]


def test_an_exception_on_the_actor_thread_reaches_the_caller_as_a_failed_naming_its_place():
    from pipegpt.comm.rpc import Failed

    class Actor:
        @actor_method
        def broken(self):
            raise ValueError("bad shape 3")

    failed = Actor().broken()
    assert isinstance(failed, Failed)
    assert "ValueError: bad shape 3 (in broken, test_cuda_path.py:" in failed.cause


# --------------------------------------------------------------------------------------------------------------
# When sends are posted: as soon as the output exists on gloo (matched by tag), at the plan's SEND on NCCL

def _first_stage_log(monkeypatch, device_type: str, matching: str = "auto") -> list[str]:
    """Rank 0 of a lowered 2-rank gpipe plan whose forward 1 is sent only after forward 2, run against a
    backend stand-in: the compute actions and the posted sends in the order they happened (receives deliver
    zeros at once)."""
    from pipegpt.config import MODEL_PRESETS
    from pipegpt.model.gpt import GPT
    from pipegpt.stages.runtime import PipelineRuntime
    from pipegpt.schedule import Action, build_plan, lower, validate
    from pipegpt.stages import Stage

    log = []
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: (
        log.extend(f"post send tag {op.tag}" for op in ops if op.op is dist.isend), [BatchWork([op]) for op in ops])[1])
    cfg = MODEL_PRESETS["tiny"]
    stage = Stage(0, 2, GPT(cfg, layers=range(0, 1), embed=True, head=False, init_seed=0), 4)
    for name in ("forward", "backward"):
        original = getattr(stage, name)
        monkeypatch.setattr(stage, name, lambda mb, *a, _o=original, _n=name, **k: (log.append(f"{_n} {mb}"), _o(mb, *a, **k))[1])
    plan = lower(build_plan("gpipe", 2, 4))  # each send right behind its forward: hold forward 1's back
    first = [a for a in plan.ranks[0] if a != Action.parse("0SEND_F1")]
    first.insert(first.index(Action.parse("0F2")) + 1, Action.parse("0SEND_F1"))
    plan = validate(plan.with_ranks([first, plan.ranks[1]]))  # rank 0: F0 SEND_F0 F1 F2 SEND_F1 SEND_F2 F3 ...
    p2p = PointToPoint(rank=0, timeout_s=5, device_type=device_type, matching=matching)
    p2p.host_waits = True  # the stand-in's Works complete when waited for, on either path
    runtime = PipelineRuntime(plan, 0, {0: stage}, p2p, [0, 1], (1, cfg.seq_len, cfg.n_embd), torch.float32, "cpu")
    runtime.step([torch.zeros(1, cfg.seq_len, dtype=torch.long)] * 4, None, record=False)
    return log


def test_on_gloo_each_forward_output_is_posted_before_the_next_compute(monkeypatch):
    log = _first_stage_log(monkeypatch, "cpu")
    for mb in range(4):  # the forward's send right behind it (tag = (mb * 2 stages + stage 0) * 2 + forward)
        assert log[log.index(f"forward {mb}") + 1] == f"post send tag {mb * 4}", log


def test_on_gloo_a_send_whose_send_follows_its_compute_goes_with_that_batch(monkeypatch):
    """1F1B's rank 0 runs F2 then the batch 0RECV_B1 0SEND_F2: F2's output goes in one post with that receive
    (one gloo exchange), not alone before it (a handshake of its own for both ranks' gloo threads)."""
    from pipegpt.config import MODEL_PRESETS
    from pipegpt.model.gpt import GPT
    from pipegpt.stages.runtime import PipelineRuntime
    from pipegpt.schedule import build_plan, lower
    from pipegpt.stages import Stage

    posts = []
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: (
        posts.append(sorted(("send" if op.op is dist.isend else "recv", op.tag) for op in ops)),
        [BatchWork([op]) for op in ops])[1])
    cfg, m = MODEL_PRESETS["tiny"], 4
    stage = Stage(0, 2, GPT(cfg, layers=range(0, 1), embed=True, head=False, init_seed=0), m)
    monkeypatch.setattr(stage, "backward", lambda mb, grad, split=False: None)
    plan = lower(build_plan("1f1b", 2, m))  # rank 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 RECV_B1 SEND_F2 B1 ...
    runtime = PipelineRuntime(plan, 0, {0: stage}, PointToPoint(0, 5, "cpu"), [0, 1], (1, cfg.seq_len, cfg.n_embd),
                              torch.float32, "cpu")
    runtime.step([torch.zeros(1, cfg.seq_len, dtype=torch.long)] * m, None, record=False)
    forward = lambda mb: ("send", mb * 4)  # noqa: E731 - tag (mb * 2 stages + stage 0) * 2
    backward = lambda mb: ("recv", (mb * 2 + 1) * 2 + 1)  # noqa: E731 - stage 1's gradient
    # F0 (warm-up) goes as soon as made; each later forward with the receive of the backward that follows it
    assert posts == [[forward(0)], *[[backward(mb - 1), forward(mb)] for mb in (1, 2, 3)], [backward(3)]], posts


@pytest.mark.parametrize("device_type,matching", [("cuda", "auto"), ("cpu", "order")])
def test_on_nccl_the_sends_behind_a_run_s_receives_are_a_batch_of_their_own(monkeypatch, device_type, matching):
    """1F1B's rank 0 runs F2 then 0RECV_B1 0SEND_F2 (and so on): matched by order, the receive is posted alone
    and F2's output right behind it, in a batch of its own (one NCCL group each, one after the other on the
    stream), so B1 waits for its gradient, not for stage 1 taking F2's output; on gloo (the test above) they go
    in one post. 0SEND_F1 0RECV_B0, a send before the receive, stays one batch."""
    from pipegpt.config import MODEL_PRESETS
    from pipegpt.model.gpt import GPT
    from pipegpt.stages.runtime import PipelineRuntime
    from pipegpt.schedule import build_plan, lower
    from pipegpt.stages import Stage

    posts = []
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: (
        posts.append([("send" if op.op is dist.isend else "recv", op.tag) for op in ops]), [BatchWork(ops)])[1])
    cfg, m = MODEL_PRESETS["tiny"], 4
    stage = Stage(0, 2, GPT(cfg, layers=range(0, 1), embed=True, head=False, init_seed=0), m)
    monkeypatch.setattr(stage, "backward", lambda mb, grad, split=False: None)
    p2p = PointToPoint(0, 5, device_type, matching=matching)
    p2p.host_waits = True  # the stand-in's Works complete when waited for, on either path
    runtime = PipelineRuntime(lower(build_plan("1f1b", 2, m)), 0, {0: stage}, p2p, [0, 1],
                              (1, cfg.seq_len, cfg.n_embd), torch.float32, "cpu")
    runtime.step([torch.zeros(1, cfg.seq_len, dtype=torch.long)] * m, None, record=False)
    forward = lambda mb: ("send", mb * 4)  # noqa: E731 - tag (mb * 2 stages + stage 0) * 2
    backward = lambda mb: ("recv", (mb * 2 + 1) * 2 + 1)  # noqa: E731 - stage 1's gradient
    steady = [batch for mb in (2, 3) for batch in ([backward(mb - 1)], [forward(mb)])]
    assert posts == [[forward(0)], [forward(1), backward(0)], *steady, [backward(3)]], posts


@pytest.mark.parametrize("device_type,matching", [("cuda", "auto"), ("cpu", "order")])
def test_on_nccl_a_receive_posted_early_is_waited_for_by_the_compute_that_reads_it(monkeypatch, device_type,
                                                                                   matching):
    """gpipe 2x2 lowered with a latency: rank 0 posts 0RECV_B0 and 0RECV_B1 after 0F1, a batch each, before
    backward 0. Gradient 0 is waited for just before backward 0, gradient 1 only after it, just before backward 1,
    which reads what that wait delivered (a receive holds its tag's value once waited for)."""
    from pipegpt.config import MODEL_PRESETS
    from pipegpt.model.gpt import GPT
    from pipegpt.schedule import Action, build_plan, lower
    from pipegpt.schedule.simulate import Costs
    from pipegpt.stages import Stage
    from pipegpt.stages.runtime import PipelineRuntime

    log = []

    class LoggedWork(BatchWork):
        def wait(self, timeout=None):
            log.extend(f"wait {'send' if op.op is dist.isend else 'recv'} {op.tag}" for op in self.ops)
            return super().wait(timeout)

    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: (
        log.extend(f"post {'send' if op.op is dist.isend else 'recv'} {op.tag}" for op in ops), [LoggedWork(ops)])[1])
    cfg, m = MODEL_PRESETS["tiny"], 2
    stage = Stage(0, 2, GPT(cfg, layers=range(0, 1), embed=True, head=False, init_seed=0), m)
    monkeypatch.setattr(stage, "backward",
                        lambda mb, grad, split=False: log.append(f"backward {mb} {grad.flatten()[0]:g}"))
    plan = lower(build_plan("gpipe", 2, m), Costs.uniform(2, F=1, B=2, W=1, comm=1))
    assert plan.ranks[0] == tuple(map(Action.parse, "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0B1".split()))
    p2p = PointToPoint(0, 5, device_type, matching=matching)
    p2p.host_waits = True  # the stand-in's Works complete when waited for, on either path
    runtime = PipelineRuntime(plan, 0, {0: stage}, p2p, [0, 1], (1, cfg.seq_len, cfg.n_embd), torch.float32, "cpu")
    runtime.step([torch.zeros(1, cfg.seq_len, dtype=torch.long)] * m, None, record=False)
    first, second = log.index("backward 0 3"), log.index("backward 1 7")  # each read its own gradient
    assert log.index("post recv 7") < log.index("wait recv 3") < first, log  # both posted, the first waited for
    assert "wait recv 7" not in log[:first] and log.index("wait recv 7") < second, log


@pytest.mark.parametrize("device_type,matching", [("cuda", "auto"), ("cpu", "order")])
def test_on_nccl_sends_keep_the_plans_order(monkeypatch, device_type, matching):
    log = _first_stage_log(monkeypatch, device_type, matching)
    sends = [line for line in log if line.startswith("post send")]
    assert sends == [f"post send tag {mb * 4}" for mb in range(4)]
    # the plan holds forward 1's send until after forward 2
    assert log.index("forward 2") < log.index("post send tag 4"), log


# --------------------------------------------------------------------------------------------------------------
# The control plane's TensorPipe channels

def test_rpc_registers_only_the_cpu_channel(monkeypatch):
    """TensorPipe's GPU channels (cuda_ipc, cuda_gdr) fail at start-up on some clusters; only CPU control messages
    travel over RPC, so the agent gets the basic channel alone (and the TCP transport)."""
    import torch.distributed.rpc as rpc

    from pipegpt.comm import rpc as control

    given = {}
    monkeypatch.setattr(rpc, "TensorPipeRpcBackendOptions", lambda **kwargs: given.update(kwargs) or kwargs)
    control._rpc_options("tcp://127.0.0.1:1", 5.0)
    assert given.get("_channels") == ["basic"] and given["_transports"] == ["uv"]
