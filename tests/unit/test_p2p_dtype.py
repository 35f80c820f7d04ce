"""--p2p-dtype: pipeline messages travel in the message dtype (sends cast to it, receive buffers are allocated in
it), while each stage computes in its own dtype (what it receives is cast back before it is used)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pipegpt.comm.p2p import PointToPoint
from pipegpt.config import MODEL_PRESETS
from pipegpt.model.gpt import GPT
from pipegpt.stages.runtime import PipelineRuntime
from pipegpt.schedule import build_plan, lower
from pipegpt.stages import Stage


class Work:
    """A Work of a stand-in backend: a receive delivers 0.5 when waited for."""

    def __init__(self, op):
        self.op, self.completed = op, False

    def wait(self, timeout=None):
        if self.op.op is dist.irecv:
            self.op.tensor.fill_(0.5)
        self.completed = True
        return True

    def is_completed(self):
        return self.completed


@pytest.mark.parametrize("matching", ["tag", "order"])
@pytest.mark.parametrize("message_dtype", [torch.bfloat16, torch.float32, None])
def test_messages_travel_in_the_message_dtype(monkeypatch, matching, message_dtype):
    posted = []
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: (posted.extend(ops), [Work(op) for op in ops])[1])
    cfg = MODEL_PRESETS["tiny"]
    stage = Stage(0, 2, GPT(cfg, layers=range(0, 1), embed=True, head=False, init_seed=0), 2)
    grads_seen = []
    backward = stage.backward
    monkeypatch.setattr(stage, "backward", lambda mb, grad, **k: (grads_seen.append(grad.dtype), backward(mb, grad, **k))[1])
    p2p = PointToPoint(rank=0, timeout_s=5, device_type="cpu", matching=matching)
    p2p.host_waits = True
    runtime = PipelineRuntime(lower(build_plan("1f1b", 2, 2)), 0, {0: stage}, p2p, [0, 1],
                              (1, cfg.seq_len, cfg.n_embd), torch.float32, "cpu", message_dtype=message_dtype)
    runtime.step([torch.zeros(1, cfg.seq_len, dtype=torch.long)] * 2, None, record=False)
    wire = torch.float32 if message_dtype is None else message_dtype
    assert [(op.op, op.tensor.dtype) for op in posted if op.op is dist.isend] == [(dist.isend, wire)] * 2
    assert [op.tensor.dtype for op in posted if op.op is dist.irecv] == [wire] * 2
    assert grads_seen == [torch.float32] * 2  # the stage computes in its own dtype
    assert all(p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0 for p in stage.module.parameters())
