"""Which rank a failure is blamed on (issue 44): a failed collective is what the ranks left behind see when a
peer vanished, so the evidence of every rank decides (a process that died, a rank that failed by itself, one
that does not answer a ping), without workers: a Cluster over stand-in futures. And a lost rank is never
restarted into the same layout, whichever rank's failure arrived first."""
from __future__ import annotations

import pytest

import pipegpt.comm.rpc as rpc_module
from pipegpt.comm.rpc import Cluster, Failed, WorkerFailure

COMM = "CommError: rank 0: data-parallel gradient reduction failed: Operation timed out! (in _wait, replicas.py:172)"


class Answer:
    """A settled (or, pending=True, never settled) RPC future."""

    def __init__(self, value=None, pending: bool = False, error: Exception | None = None):
        self.value, self.pending, self.error = value, pending, error

    def done(self) -> bool:
        return not self.pending

    def wait(self):
        if self.error is not None:
            raise self.error
        return self.value

    def add_done_callback(self, fn) -> None:
        pass


class Ranks(Cluster):
    """A cluster whose rank `dead` (if any) has exited with `code`, as LocalCluster's process check says."""

    def __init__(self, world_size: int, dead: int | None = None, code: int = 75):
        self.world_size, self.timeout_s, self.dead, self.code = world_size, 30.0, dead, code

    def check_alive(self) -> None:
        if self.dead is not None:
            raise WorkerFailure(self.dead, f"process exited with code {self.code}", exit_code=self.code)


@pytest.fixture
def pings(monkeypatch):
    """Each rank's answer to a ping (default: answered); the pings sent, by rank."""
    answers, sent = {}, []

    def rpc_async(worker, fn, args=(), timeout=0):
        rank = int(worker.removeprefix("worker"))
        sent.append(rank)
        return answers.get(rank, Answer(rank))

    monkeypatch.setattr(rpc_module.rpc, "rpc_async", rpc_async)
    monkeypatch.setattr(rpc_module, "HEARTBEAT_TIMEOUT_S", 0.3)
    return answers, sent


def blamed(cluster: Cluster, futures: dict) -> WorkerFailure:
    with pytest.raises(WorkerFailure) as e:
        cluster._wait("step", futures, timeout=30)
    return e.value


def test_a_frozen_rank_is_blamed_not_the_rank_whose_collective_timed_out(pings):
    """freeze:1:3 at dp 2 said "rank 0 failed (CommError: ...)": rank 1 had stopped, rank 0 saw it."""
    answers, _ = pings
    answers[1] = Answer(pending=True)  # SIGSTOPped: not even the RPC agent answers
    failure = blamed(Ranks(2), {0: Answer(Failed(COMM)), 1: Answer(pending=True)})
    assert (failure.rank, failure.cause) == (1, f"stopped answering; rank 0 saw: {COMM}")


def test_a_rank_whose_process_died_is_blamed_with_its_exit_code(pings):
    answers, _ = pings
    answers[1] = Answer(error=RuntimeError("connection closed"))
    failure = blamed(Ranks(2, dead=1), {0: Answer(Failed(COMM)), 1: Answer(pending=True)})
    assert (failure.rank, failure.cause, failure.exit_code) == (1, "process exited with code 75", 75)


def test_a_rank_that_failed_by_itself_is_blamed(pings):
    answers, _ = pings
    answers[2] = Answer(pending=True)  # slow to answer, not silent for long: its own failure arrives first
    own = "RuntimeError: fault injected by PIPEGPT_FAULT at step 3 (in fail_now, faults.py:77)"
    failure = blamed(Ranks(3), {0: Answer(Failed(COMM)), 1: Answer(pending=True), 2: Answer(Failed(own))})
    assert (failure.rank, failure.cause) == (2, own)


def test_with_every_peer_answering_the_reporting_rank_stands(pings):
    failure = blamed(Ranks(2), {0: Answer(Failed(COMM)), 1: Answer(pending=True)})
    assert (failure.rank, failure.cause) == (0, COMM)


def test_a_failure_of_its_own_is_reported_at_once_without_asking_the_others(pings):
    _, sent = pings
    own = "RuntimeError: fault injected by PIPEGPT_FAULT at step 3 (in fail_now, faults.py:77)"
    failure = blamed(Ranks(2), {0: Answer(Failed(own)), 1: Answer(pending=True)})
    assert (failure.rank, failure.cause, sent) == (0, own, [])


class Process:
    def __init__(self, exitcode):
        self.exitcode = exitcode


def test_a_lost_rank_is_the_restarts_cause_whichever_failure_arrived_first():
    """lose:1:3 with --min-ranks 1 said, 1 run in 11, "rank 0 failed ... restart 1 of 1, same layout": the
    lost rank came back. Its exit code (the rehearsed lost device's) decides."""
    from pipegpt.resilience.faults import LOST_DEVICE_EXIT
    from pipegpt.train.restart import _lost, _with_lost_rank

    first = WorkerFailure(0, COMM)
    cause = _with_lost_rank(first, [Process(-9), Process(LOST_DEVICE_EXIT)])  # rank 0 killed on the way out
    assert (cause.rank, cause.exit_code, _lost(cause)) == (1, LOST_DEVICE_EXIT, True)
    assert _with_lost_rank(first, [Process(-9), Process(13)]) is first  # a plain exit: same layout
    assert _with_lost_rank(first, []) is first  # torchrun: no local processes


def test_a_shrink_lowers_zero_where_that_is_what_makes_a_layout_build():
    """lose:1:3 at --dp 2 --zero 3 said "no layout of this model and batch builds on 1 ranks"; a checkpoint loads
    at any ZeRO level. Where replicas remain, ZeRO stays."""
    from pipegpt.config import ModelConfig, TrainConfig
    from pipegpt.resilience.elastic import shrunk_layout
    from pipegpt.train.restart import restart_args

    model = ModelConfig(vocab_size=256, seq_len=16, n_layer=8, n_head=4, n_embd=32)
    cfg = TrainConfig.build(model, stages=1, dp=2, microbatches=2, zero=3, unshard="microbatch", device="cpu")
    one = shrunk_layout(cfg, 1)
    p = one.cfg.parallel
    assert (p.dp, p.stages, p.microbatches, p.zero, p.unshard) == (1, 1, 4, 0, None)
    assert one.flags == {"--stages": 1, "--dp": 1, "--microbatches": 4, "--schedule": "1f1b", "--zero": 0,
                         "--unshard": None}
    argv = ["run", "--dp", "2", "--zero", "3", "--unshard=microbatch", "--steps", "6"]
    assert restart_args(argv, "runs/a", one.flags) == ["run", "--steps", "6", "--stages", "1", "--dp", "1",
                                                       "--microbatches", "4", "--schedule", "1f1b", "--zero", "0",
                                                       "--resume", "runs/a"]
    wide = TrainConfig.build(model, stages=2, dp=2, microbatches=2, zero=2, device="cpu")
    three = shrunk_layout(wide, 3)  # dp 2 x pp 1 builds: ZeRO-2 kept
    assert (three.cfg.parallel.dp, three.cfg.parallel.zero) == (2, 2) and "--zero" not in three.flags
    # ZeRO-1 at one replica is refused too (it did nothing): its shrink to dp 1 says --zero 0
    zero1 = shrunk_layout(cfg.replace(zero=1, unshard=None), 1)
    assert (zero1.cfg.parallel.dp, zero1.cfg.parallel.zero) == (1, 0) and zero1.flags["--zero"] == 0


def test_a_shrink_lowers_ep_to_what_the_remaining_replicas_can_carry():
    """--ep is carved out of dp x cp: at dp 4 ep 4 a shrink to 2 ranks keeps experts spread over both (ep 2), and
    the restart's command line says so; to one rank, ep 1 and no --ep flag."""
    from pipegpt.config import MODEL_PRESETS, TrainConfig
    from pipegpt.resilience.elastic import shrunk_layout
    from pipegpt.train.restart import restart_args

    model = MODEL_PRESETS["tiny-moe"]
    cfg = TrainConfig.build(model, stages=1, dp=4, ep=4, microbatches=2, device="cpu")
    two = shrunk_layout(cfg, 2)
    assert (two.cfg.parallel.dp, two.cfg.parallel.ep, two.cfg.parallel.microbatches) == (2, 2, 4)
    assert two.flags["--ep"] == 2
    argv = ["run", "--model", "tiny-moe", "--dp", "4", "--ep", "4", "--steps", "6"]
    assert restart_args(argv, "runs/a", two.flags) == ["run", "--model", "tiny-moe", "--steps", "6", "--stages", "1",
                                                       "--dp", "2", "--microbatches", "4", "--schedule", "1f1b",
                                                       "--ep", "2", "--resume", "runs/a"]
    one = shrunk_layout(cfg, 1)
    assert (one.cfg.parallel.dp, one.cfg.parallel.ep) == (1, 1) and "--ep" not in one.flags
