"""A step's trace: one event per action of the rank's plan, in the plan's order, the actions of a comm batch
sharing its span; every message posted to the peer and with the tag the plan gives it (the runtime builds all
of this once, before the first step: nothing of it may drift from the plan)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pipegpt.comm.p2p import PointToPoint
from pipegpt.config import MODEL_PRESETS
from pipegpt.model.gpt import GPT
from pipegpt.stages.runtime import PipelineRuntime
from pipegpt.schedule import Kind, build_plan, lower
from pipegpt.schedule.messages import comm_batches
from pipegpt.stages import Stage


class Work:
    def __init__(self, op):
        self.op = op

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


@pytest.mark.parametrize("matching", ["tag", "order"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_step_traces_every_action_of_the_plan_in_its_order(monkeypatch, matching, schedule):
    posted = []
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer, tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: (posted.extend(ops), [Work(op) for op in ops])[1])
    cfg, m = MODEL_PRESETS["tiny"], 3
    plan = lower(build_plan(schedule, 2, m))
    stage = Stage(0, 2, GPT(cfg, layers=range(0, 1), embed=True, head=False, init_seed=0), m)
    p2p = PointToPoint(rank=0, timeout_s=5, device_type="cpu", matching=matching)
    runtime = PipelineRuntime(plan, 0, {0: stage}, p2p, [0, 1], (1, cfg.seq_len, cfg.n_embd), torch.float32, "cpu")
    tokens = [torch.zeros(1, cfg.seq_len, dtype=torch.long)] * m
    for _ in range(2):  # the second step walks the same program
        posted.clear()
        events = runtime.step(tokens, None, record=True).events
        actions = plan.ranks[0]
        assert [name for name, _, _ in events] == [str(a) for a in actions]
        assert all(start <= end for _, start, end in events)
        for first, end in comm_batches(actions, eager_sends=matching == "tag"):  # what the runtime posts as one
            assert len({(start, stop) for _, start, stop in events[first:end]}) == 1
        # Rank 0 sends each forward's output to rank 1 and receives each gradient from it, tagged
        # (microbatch * stages + sending stage) * 2 + backward.
        sends = [(op.peer, op.tag) for op in posted if op.op is dist.isend]
        recvs = [(op.peer, op.tag) for op in posted if op.op is dist.irecv]
        assert sends == [(1, (a.microbatch * 2 + 0) * 2) for a in actions if a.kind is Kind.SEND_F]
        assert recvs == [(1, (a.microbatch * 2 + 1) * 2 + 1) for a in actions if a.kind is Kind.RECV_B]
