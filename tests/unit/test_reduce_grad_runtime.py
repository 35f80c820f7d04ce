"""REDUCE_GRAD at run time: the driver's plan has one per stage exactly when there are replicas, the runtime
launches it on its collectives where the plan says, and the gradient averager refuses a step whose plan
reduced a stage's gradients nowhere. (The numbers: tests/distributed/test_pipeline_oracle.py, dp cases.)"""
from __future__ import annotations

import pytest
import torch

from pipegpt.data_parallel import DataParallel, replicas
from pipegpt.data_parallel.shard_ops import NATIVE
from pipegpt.comm.p2p import PointToPoint
from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.model.gpt import GPT
from pipegpt.stages.runtime import PipelineRuntime
from pipegpt.schedule import Action, Kind, ScheduleError, add_reduce_grad, build_plan, lower
from pipegpt.schedule.schedule_file import dump_schedule_text
from pipegpt.stages import Stage
from pipegpt.planner.run_plan import make_plan

MODEL = ModelConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, n_embd=16)


class Recorder:
    """Collectives that note each launch with the stage's gradients at that moment."""

    def __init__(self, stage: Stage):
        self.stage, self.launched = stage, []

    def reduce_grad(self, stage: int) -> None:
        self.launched.append((stage, [p.grad.clone() for p in self.stage.module.parameters()]))


def whole_model(plan) -> Stage:
    return Stage(0, 1, GPT(MODEL, layers=range(0, 1), embed=True, head=True, init_seed=0), plan.num_microbatches)


def one_rank(plan, stage: Stage, collectives=None) -> PipelineRuntime:
    return PipelineRuntime(plan, 0, {0: stage}, PointToPoint(0, 5.0, "cpu"), [0], (1, MODEL.seq_len, MODEL.n_embd),
                           torch.float32, "cpu", collectives=collectives)


def test_the_runtime_launches_a_reduction_where_the_plan_has_it():
    plan = add_reduce_grad(build_plan("1f1b", 1, 2))
    assert plan.to_text() == "0F0 0B0 0F1 0B1 0REDUCE_GRAD\n"
    stage = whole_model(plan)
    recorder = Recorder(stage)
    runtime = one_rank(plan, stage, recorder)
    tokens = [torch.randint(0, MODEL.vocab_size, (1, MODEL.seq_len), generator=torch.Generator().manual_seed(i))
              for i in range(2)]
    result = runtime.step(tokens, tokens, record=True)
    assert [s for s, _ in recorder.launched] == [0]
    # launched after the last backward: the gradients it reduces are the step's
    assert all(torch.equal(g, p.grad) for g, p in zip(recorder.launched[0][1], stage.module.parameters()))
    assert [name for name, _, _ in result.events] == ["0F0", "0B0", "0F1", "0B1", "0REDUCE_GRAD"]
    assert runtime.at[4][3] == "nobody (launching a gradient reduction)"


def test_the_runtime_refuses_collectives_it_cannot_run():
    plan = add_reduce_grad(build_plan("1f1b", 1, 2))
    with pytest.raises(ScheduleError, match="no data-parallel replicas"):
        one_rank(plan, whole_model(plan))
    unshard = plan.with_ranks([(Action.parse("0UNSHARD"),) + plan.ranks[0] + (Action.parse("0RESHARD"),)])
    with pytest.raises(ScheduleError, match="this rank's collectives do not run UNSHARD"):
        one_rank(unshard, whole_model(plan), collectives=object())


class Work:
    def wait(self, timeout=None):
        return True


def test_the_averager_refuses_a_stage_the_plan_never_reduced(monkeypatch):
    monkeypatch.setattr(replicas.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(replicas.dist, "all_reduce", lambda flat, group=None, async_op=False: Work())
    params = {s: [torch.nn.Parameter(torch.ones(3))] for s in (0, 2)}
    averager = DataParallel(params, params, group="dp", index=0, zero=0, rank=0, timeout_s=5, ops=NATIVE)
    for ps in params.values():  # the gradients are views of the stage's flat buffer: autograd adds into them
        ps[0].grad.fill_(4.0)
    averager.reduce_grad(0)
    averager.reduce_grad(2)
    averager.finish()
    assert all(torch.equal(ps[0].grad, torch.full((3,), 2.0)) for ps in params.values())  # divided by dp
    averager.reduce_grad(2)  # a plan without 0REDUCE_GRAD
    with pytest.raises(ValueError, match="rank 0: the plan has no 0REDUCE_GRAD, so stage 0's gradients were not"):
        averager.finish()


def reductions(plan) -> list[str]:
    return [str(a) for acts in plan.ranks for a in acts if a.kind is Kind.REDUCE_GRAD]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_the_drivers_plan_reduces_gradients_with_replicas_only(schedule):
    cfg = TrainConfig.build(MODEL, stages=2, microbatches=4, schedule=schedule)
    one = make_plan(cfg)
    two = make_plan(cfg.replace(dp=2))
    assert reductions(one) == [] and one == lower(build_plan(schedule, 2, 4))
    assert sorted(reductions(two)) == [f"{s}REDUCE_GRAD" for s in range(two.num_stages)]
    assert two == add_reduce_grad(one)


def test_a_schedule_file_replays_with_or_without_reductions(tmp_path):
    cfg = TrainConfig.build(MODEL, stages=2, microbatches=4)
    written = make_plan(cfg.replace(dp=2))
    new, old = tmp_path / "new.txt", tmp_path / "old.txt"
    new.write_text(dump_schedule_text(written))  # a dp run's plan.txt
    old.write_text(dump_schedule_text(make_plan(cfg)))  # one from before REDUCE_GRAD, or from dp 1
    for path in (new, old):
        replay = cfg.replace(schedule_file=str(path), stages=None, microbatches=None)
        assert make_plan(replay.replace(dp=2)).ranks == written.ranks
        assert reductions(make_plan(replay)) == []
    late = tmp_path / "late.txt"  # a file may place a reduction later: it runs where the file says
    late.write_text(dump_schedule_text(written).replace("1REDUCE_GRAD 1SEND_B3", "1SEND_B3 1REDUCE_GRAD"))
    plan = make_plan(cfg.replace(schedule_file=str(late), stages=None, microbatches=None, dp=2))
    assert plan.ranks[1][-2:] == (Action.parse("1SEND_B3"), Action.parse("1REDUCE_GRAD"))


class Gathers:
    """Collectives for ZeRO-3's actions that do nothing."""

    def reduce_grad(self, stage: int) -> None: ...
    def unshard(self, stage: int) -> None: ...
    def reshard(self, stage: int) -> None: ...
    def ready(self, stage: int, backward: bool) -> None: ...


def test_every_collective_kind_has_a_row_naming_a_group_of_the_mesh():
    from pipegpt.dims import GROUP_AXES
    from pipegpt.schedule.actions import COLLECTIVE_KINDS
    from pipegpt.stages.runtime import COLLECTIVE_RUNS, GROUP_WORDS

    assert set(COLLECTIVE_RUNS) == set(COLLECTIVE_KINDS)
    assert {run.group for run in COLLECTIVE_RUNS.values()} <= set(GROUP_AXES) and set(GROUP_WORDS) == set(GROUP_AXES)
    assert all(callable(getattr(Gathers(), run.method)) for run in COLLECTIVE_RUNS.values())


def gathering_plan(plan):
    return plan.with_ranks([(Action.parse("0UNSHARD"),) + plan.ranks[0] + (Action.parse("0RESHARD"),)])


def test_a_collectives_whereabouts_name_its_groups_peers():
    plan = gathering_plan(add_reduce_grad(build_plan("1f1b", 1, 2)))
    stage = whole_model(plan)
    runtime = PipelineRuntime(plan, 0, {0: stage}, PointToPoint(0, 5.0, "cpu"), [0], (1, MODEL.seq_len, MODEL.n_embd),
                              torch.float32, "cpu", collectives=Gathers(), group_members={"dp_cp": [0, 2, 4]})
    assert runtime.at[0][2:] == ((2, 4), "its data-parallel peers, ranks 2, 4 (gathering stage 0's parameters)")
    assert runtime.at[-1][2:] == ((2, 4), "its data-parallel peers, ranks 2, 4 (freeing stage 0's parameters)")
    assert runtime.at[-2][2:] == ((), "nobody (launching a gradient reduction)")
    assert runtime.ready_at[1][2][2:] == runtime.at[0][2:]  # the wait before 0F0 is the gather's
    # Without the members (a test's runtime), the group is named as before.
    unnamed = one_rank(plan, stage, Gathers())
    assert unnamed.at[0][2:] == ((), "its data-parallel peers (gathering stage 0's parameters)")


def test_a_collective_over_another_group_is_named_by_that_group(monkeypatch):
    from pipegpt.stages import runtime as runtime_module

    monkeypatch.setitem(runtime_module.COLLECTIVE_RUNS, Kind.UNSHARD,
                        runtime_module.COLLECTIVE_RUNS[Kind.UNSHARD]._replace(group="tp"))
    plan = gathering_plan(build_plan("1f1b", 1, 2))
    stage = whole_model(plan)
    runtime = PipelineRuntime(plan, 1, {0: stage}, PointToPoint(1, 5.0, "cpu"), [1], (1, MODEL.seq_len, MODEL.n_embd),
                              torch.float32, "cpu", collectives=Gathers(), group_members={"tp": [0, 1], "dp_cp": [1]})
    assert runtime.at[0][2:] == ((0,), "its tensor-parallel peers, rank 0 (gathering stage 0's parameters)")
    assert runtime.at[-1][2:] == ((), "its data-parallel peers (freeing stage 0's parameters)")
    with pytest.raises(ScheduleError, match="no tensor-parallel peers to gather its parameters from"):
        one_rank(plan, stage)
