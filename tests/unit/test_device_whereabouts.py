"""Where a rank is, for the stall watchdog (PipelineRuntime.now and device_now()), on the CUDA control path run on
CPU with stand-ins: a comm batch is posted and marked as one, so its whereabouts name every peer in it (a GPU
blocked on rank 0's message is not "send to rank 2"), and a device query that blocks never holds up where()."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pipegpt.comm.p2p import PointToPoint
from pipegpt.config import ModelConfig
from pipegpt.model.gpt import GPT
from pipegpt.stages.runtime import DEVICE_QUERY_S, DEVICE_UNKNOWN, PipelineRuntime
from pipegpt.schedule import build_plan, lower
from pipegpt.stages import Stage

MODEL = ModelConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, n_embd=16)


class Work:
    """A coalesced batch's one Work: each receive holds its tag's value once waited for."""

    def __init__(self, ops):
        self.ops, self.delivered = ops, False

    def wait(self, timeout=None):
        if not self.delivered:
            for op in self.ops:
                if op.op is dist.irecv:
                    op.tensor.fill_(0.01 * op.tag)
        self.delivered = True
        return True

    def is_completed(self):
        return True


class Mark:
    def __init__(self, done: bool, blocks: threading.Event | None = None):
        self.done, self.blocks = done, blocks

    def query(self) -> bool:
        if self.blocks is not None:
            self.blocks.wait()  # as cudaEventQuery behind a synchronising thread's lock
        return self.done


def middle_rank(monkeypatch, posted_at: list):
    """Rank 1 of a 3-stage 1F1B on order-matched point-to-point whose batches record where the host was."""
    plan = lower(build_plan("1f1b", 3, 4))
    stage = Stage(1, 3, GPT(MODEL, layers=range(1, 2), embed=False, head=False, init_seed=0), plan.num_microbatches)
    runtime = PipelineRuntime(plan, 1, {1: stage}, PointToPoint(1, 5.0, "cpu", "order"), [0, 1, 2],
                              (1, MODEL.seq_len, MODEL.n_embd), torch.float32, "cpu")
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0:
                        SimpleNamespace(op=op, tensor=tensor, peer=peer, tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: posted_at.append(runtime.now) or [Work(ops)])
    return runtime


def test_a_batch_of_several_peers_is_named_by_all_of_them(monkeypatch):
    posted_at = []
    runtime = middle_rank(monkeypatch, posted_at)
    assert " ".join(map(str, runtime.actions[2:4])) == "1SEND_F0 1RECV_F1"  # to rank 2, from rank 0: one batch
    mixed = (2, "1SEND_F0+1RECV_F1", (0, 2), "send 1SEND_F0 to rank 2; receive 1RECV_F1 from rank 0")
    # the "GPU" got past everything but that batch
    runtime.intercept(marker=lambda action: Mark(done=str(action) != "1SEND_F0"))
    runtime.step(None, None, record=False)
    assert mixed in posted_at, posted_at  # the host, while posting it, waits for both peers
    assert runtime.device_now() == mixed
    assert runtime.device_now() is not None and runtime.at[2][2] == (2,)  # a lone action keeps its one peer


def test_a_device_query_that_blocks_leaves_where_after_its_limit(monkeypatch):
    runtime = middle_rank(monkeypatch, [])
    held = threading.Event()
    runtime.intercept(marker=lambda action: Mark(done=False, blocks=held))
    runtime.step(None, None, record=False)
    answer, t0 = [], time.monotonic()
    asker = threading.Thread(target=lambda: answer.append(runtime.device_now()), daemon=True)
    asker.start()
    asker.join(DEVICE_QUERY_S + 5)
    held.set()  # lets the stuck query go, whatever happened
    assert answer == [DEVICE_UNKNOWN], "where() was held up by a blocked device query"
    assert time.monotonic() - t0 < DEVICE_QUERY_S + 2


class HungInTheUpdate:
    """The rank's engine, its device standing in: every mark made once the optimizer step is launched stays
    incomplete (a GPU hung in the update); where() is asked while the host waits in synchronize()."""

    def __init__(self, runtime: PipelineRuntime):
        self.runtime, self.device, self.device_name, self.hung, self.asked = runtime, torch.device("cpu"), "cpu", \
            False, []
        runtime.intercept(marker=lambda action: Mark(done=not self.hung))

    def train_step(self, inputs, targets, record, documents=None):
        return self.runtime.step(inputs, targets, record=record)

    def finishing(self):
        return None, "finishing the step", (0, 2), "collectives with ranks 0, 2"

    def synchronize(self):
        self.asked.append((self.runtime.now, self.runtime.device_now()))

    def peak_memory(self):
        return 0


def test_a_gpu_hung_in_the_optimizer_step_is_said_to_be_there(monkeypatch):
    from pipegpt.config import TrainConfig
    from pipegpt.resilience.faults import FaultHook
    from pipegpt.stages.runtime import OPTIMIZER_STEP
    from pipegpt.train.worker import Worker

    runtime = middle_rank(monkeypatch, [])
    worker = Worker.__new__(Worker)  # the training role's step on a stand-in engine
    worker.engine = engine = HungInTheUpdate(runtime)
    worker.rank, worker.cfg, worker.fault, worker.syncs, worker.loader = 1, TrainConfig(), FaultHook(None), [], None
    worker.recorded_steps, worker.named_params = frozenset(), list(runtime.stages[1].module.named_parameters())
    worker.dp, worker.trained = None, [(n, p, p) for n, p in worker.named_params]  # no data parallelism
    worker._clip_gradients = lambda loss_finite: (1.0, True, [])
    worker.optimizer = SimpleNamespace(param_groups=[{}], step=lambda: setattr(engine, "hung", True))
    answer = worker.step(0)
    assert getattr(answer, "applied", False), answer
    host, device = engine.asked[0]
    assert host == device == OPTIMIZER_STEP, engine.asked  # not "finishing the step" with ranks 0 and 2
