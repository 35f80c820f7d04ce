"""ZeRO-3's UNSHARD/RESHARD as actions of the plan: the pass that places them by policy (step, microbatch with
its prefetch),
validation (gathers and frees pair up; no compute on a sharded stage), schedule files that carry them, their
cost in the simulator and their look in the renderers, and the driver's plan with and without --zero 3.
(That such a plan trains like one process: tests/distributed/test_zero.py.)"""
from __future__ import annotations

import pytest

from pipegpt.config import ConfigError, ModelConfig, TrainConfig
from pipegpt.planner.run_plan import evaluation_plan, make_plan
from pipegpt.schedule import (SCHEDULES, Action, Kind, ScheduleError, add_reduce_grad, add_unshard_reshard, build_plan,
                              lower, validate, without_unshard_reshard)
from pipegpt.schedule.render import ascii_gantt, to_svg
from pipegpt.schedule.schedule_file import load_schedule_file
from pipegpt.schedule.simulate import Costs, simulate

from helpers import assert_one_line_error, invoke


def lowered(name: str, p: int = 2, m: int = 4):
    return add_reduce_grad(lower(build_plan(name, p, m)))


def sharding_of(actions, stage: int) -> list[str]:
    """The stage's gathers, frees and compute, in order, as text."""
    kinds = (Kind.UNSHARD, Kind.RESHARD)
    return [str(a) for a in actions if a.stage == stage and (a.kind.is_compute or a.kind in kinds)]


def test_step_gathers_each_stage_once_around_all_its_actions():
    plan = validate(add_unshard_reshard(lowered("1f1b", 2, 3), "step"))
    assert plan.to_text().splitlines() == [
        "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0RECV_B1 0SEND_F2 0B1 0RECV_B2 0B2 0REDUCE_GRAD 0RESHARD",
        # the gather goes before the messages that feed the first forward, the free after the reduction
        "1UNSHARD 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1REDUCE_GRAD 1RESHARD 1SEND_B2"]


def most_gathered(actions) -> int:
    """The most stages a rank holds gathered at once along its actions."""
    gathered, most = set(), 0
    for a in actions:
        if a.kind is Kind.UNSHARD:
            gathered.add(a.stage)
        elif a.kind is Kind.RESHARD:
            gathered.discard(a.stage)
        most = max(most, len(gathered))
    return most


def test_microbatch_gathers_around_each_run_of_a_stages_actions():
    plan = validate(add_unshard_reshard(add_reduce_grad(lower(build_plan("interleaved-1f1b", 2, 4, 3))),
                                        "microbatch"))
    assert sharding_of(plan.ranks[0], 0)[:8] == ["0UNSHARD", "0F0", "0F1", "0RESHARD", "0UNSHARD", "0F2", "0F3",
                                                 "0RESHARD"]
    for r, actions in enumerate(plan.ranks):
        assert most_gathered(actions) == 2
        runs = [sharding_of(actions, s).count(f"{s}UNSHARD") for s in plan.stages_of(r)]
        assert runs == [sharding_of(actions, s).count(f"{s}RESHARD") for s in plan.stages_of(r)]
        assert min(runs) >= 1 and sum(runs) >= 6  # the stage a rank computes most stays gathered; others go and come
    # one stage per rank: a single run, the same as step
    assert add_unshard_reshard(lowered("1f1b"), "microbatch") == add_unshard_reshard(lowered("1f1b"), "step")


def test_microbatch_prefetches_each_gather_one_run_ahead():
    """FSDP per block (pp 1, a stage per layer, one microbatch): each gather is posted before the stage before
    it computes; a stage freed and gathered again with no compute between stays gathered (2 around 3F0 3B0)."""
    plan = validate(add_unshard_reshard(add_reduce_grad(lower(build_plan("interleaved-1f1b", 1, 1, 4))),
                                        "microbatch"))
    assert plan.to_text() == ("0UNSHARD 1UNSHARD 0F0 0RESHARD 2UNSHARD 1F0 1RESHARD 3UNSHARD 2F0 3F0 3B0 3REDUCE_GRAD "
                              "3RESHARD 1UNSHARD 2B0 2REDUCE_GRAD 2RESHARD 0UNSHARD 1B0 1REDUCE_GRAD 1RESHARD 0B0 "
                              "0REDUCE_GRAD 0RESHARD\n")
    for name in SCHEDULES:  # two stages gathered at most; each gather but a rank's first has a compute to hide it
        if SCHEDULES[name].synthesized:
            continue
        for p, m, v in ((2, 4, None), (4, 8, None), (2, 4, 3), (1, 2, 4)):
            try:
                plan = validate(add_unshard_reshard(add_reduce_grad(lower(build_plan(name, p, m, v))), "microbatch"))
            except ScheduleError:
                continue
            for actions in plan.ranks:
                assert most_gathered(actions) <= 2, (name, p, m, v)
                gathers = [i for i, a in enumerate(actions) if a.kind is Kind.UNSHARD]
                for i in gathers[1:]:
                    s = actions[i].stage
                    ahead = next(k for k in range(i, len(actions)) if actions[k].kind.is_compute
                                 and actions[k].stage == s)
                    assert any(a.kind.is_compute for a in actions[i:ahead]), (name, p, m, v, i)


@pytest.mark.parametrize("policy", ["step", "microbatch"])
def test_every_schedule_validates_with_either_policy_and_the_pass_is_idempotent(policy):
    for name in SCHEDULES:
        if SCHEDULES[name].synthesized:
            continue
        for p, m in ((2, 4), (4, 8)):
            try:
                plan = lowered(name, p, m)
            except ScheduleError:
                continue
            sharded = validate(add_unshard_reshard(plan, policy))
            assert add_unshard_reshard(sharded, policy) == sharded
            assert without_unshard_reshard(sharded) == plan
            for r, actions in enumerate(sharded.ranks):  # no message run is split by a gather or a free
                kinds = [a.kind.is_p2p for a in actions]
                plain = [a.kind.is_p2p for a in plan.ranks[r]]
                assert _runs(kinds) == _runs(plain), (name, r)


def _runs(flags: list[bool]) -> list[int]:
    out, n = [], 0
    for f in flags + [False]:
        if f:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


@pytest.mark.parametrize("actions,problem", [
    ("0UNSHARD 0F0 0RESHARD 0F1 0UNSHARD 0B0 0B1 0RESHARD", "frees stage 0's parameters before 0F1 uses them"),
    ("0UNSHARD 0F0 0UNSHARD 0F1 0B0 0B1 0RESHARD", "gathers stage 0's parameters again: no 0RESHARD since the last"),
    ("0UNSHARD 0F0 0F1 0RESHARD 0UNSHARD 0B0 0B1", "has no 0RESHARD to go with it"),
    ("0UNSHARD 0F0 0F1 0RESHARD 0RESHARD 0B0 0B1", "has no 0UNSHARD to go with it"),
])
def test_validate_pairs_gathers_and_frees(actions, problem):
    plan = build_plan("1f1b", 2, 2)
    ranks = list(plan.ranks)
    ranks[0] = tuple(Action.parse(t) for t in actions.split())
    with pytest.raises(ScheduleError, match=problem):
        validate(plan.with_ranks(ranks))
    ranks[0] = tuple(Action.parse(t) for t in "0UNSHARD 0F0 0F1 0RESHARD 0UNSHARD 0B0 0B1 0RESHARD".split())
    validate(plan.with_ranks(ranks))  # gathered twice, freed twice: valid


def test_a_schedule_file_with_gathers_runs_and_one_computing_sharded_is_refused_by_line(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("0UNSHARD 0F0 0F1 0B0 0B1 0RESHARD\n1UNSHARD 1F0 1B0 1RESHARD 1UNSHARD 1F1 1B1 1RESHARD\n")
    plan = load_schedule_file(good)
    cfg = TrainConfig.build(ModelConfig(n_layer=2), stages=2, microbatches=2, dp=2, zero=3, schedule_file=str(good))
    made = make_plan(cfg.replace(stages=None, microbatches=None))
    assert sharding_of(made.ranks[1], 1) == sharding_of(plan.ranks[1], 1)  # kept where the file put them
    with pytest.raises(ConfigError, match=r"gathers parameters \(0UNSHARD\), and --zero is 1: .*give --zero 3"):
        make_plan(cfg.replace(stages=None, microbatches=None, zero=1))  # dropped unseen before
    bad = tmp_path / "bad.txt"
    bad.write_text("# a hand-written plan\n0UNSHARD 0F0 0F1 0B0 0B1 0RESHARD\n1UNSHARD 1F0 1RESHARD 1B0 1F1 1B1\n")
    with pytest.raises(ScheduleError, match=r"bad.txt:3: rank 1 step 2 \(1RESHARD\): frees stage 1's parameters "
                                            r"before 1B0 uses them"):
        load_schedule_file(bad)


def test_the_drivers_plan_gathers_with_zero_3_only():
    cfg = TrainConfig.build(ModelConfig(n_layer=6), stages=2, microbatches=4, dp=2, schedule="interleaved-1f1b",
                            virtual_stages=3)
    assert "UNSHARD" not in make_plan(cfg.replace(zero=2)).to_text()
    step, micro = make_plan(cfg.replace(zero=3)), make_plan(cfg.replace(zero=3, unshard="microbatch"))
    assert step.to_text().count("UNSHARD") == 6 and micro.to_text().count("UNSHARD") > 12
    assert without_unshard_reshard(step) == without_unshard_reshard(micro) == make_plan(cfg)
    evaluation = evaluation_plan(step)  # forward-only, gathered once per stage
    assert evaluation.is_forward_only and evaluation.to_text().count("UNSHARD") == 6
    # two stages a rank (a V): both stay gathered through the step under either policy, the gathers prefetched
    v = TrainConfig.build(ModelConfig(n_layer=4), stages=2, microbatches=4, dp=2, schedule="zbv", zero=3)
    assert make_plan(v.replace(unshard="microbatch")).to_text().count("UNSHARD") == 4


def test_a_gather_holds_its_rank_up_in_the_simulator_and_is_drawn():
    plan = add_unshard_reshard(lowered("zbv", 2, 4), "step")
    costs = Costs.uniform(4, F=1, B=2, W=1)
    free = simulate(plan, costs)
    assert free.makespan == simulate(lowered("zbv", 2, 4), costs).makespan  # gathers at no cost change nothing
    charged = simulate(plan, Costs(costs.forward, costs.backward, costs.weight, gather_comm=(0.5,) * 4))
    gathers = [e for e in charged.events if e.action.kind is Kind.UNSHARD]
    assert len(gathers) == plan.to_text().count("UNSHARD") and all(e.end - e.start == 0.5 for e in gathers)
    assert charged.makespan > free.makespan and charged.busy_per_rank == free.busy_per_rank  # waiting is not busy
    for r in range(2):  # no compute overlaps a gather of its rank
        spans = sorted((e.start, e.end) for e in charged.events if e.rank == r and e.end > e.start)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert "UNSHARD parameter gather" in ascii_gantt(charged, width=200) and "#e15759" in to_svg(charged)


@pytest.mark.parametrize("args,message", [
    (["--dp", "1", "--zero", "2"], "Error: --zero 2 shards over the data-parallel replicas, and dp x cp = 1: "
                                   "nothing to shard: give --dp 2 or more, or --zero 0"),
    (["--dp", "2", "--zero", "1", "--unshard", "step"], "Error: --unshard step places ZeRO-3's parameter gathers, "
                                                        "and --zero is 1: give --zero 3 or leave --unshard out"),
])
def test_bad_zero_settings_are_one_line_before_any_worker(no_workers, args, message):
    assert assert_one_line_error(invoke("run", "--steps", "2", "--stages", "2", *args)) == message


def test_a_schedule_file_that_does_not_pair_is_one_line(no_workers, tmp_path):
    path = tmp_path / "unpaired.txt"
    path.write_text("0UNSHARD 0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    line = assert_one_line_error(invoke("run", "--steps", "2", "--dp", "2", "--zero", "3", "--schedule-file",
                                        str(path)))
    assert line.startswith(f"Error: {path}:1: rank 0 step 0 (0UNSHARD): has no 0RESHARD to go with it")


def test_zero_config_checks():
    with pytest.raises(ConfigError, match="nothing to shard"):
        TrainConfig.build(zero=3).validate({})


def test_costs_text_takes_the_gather_time():
    costs = Costs.parse("F=1,B=2,gather_comm=0.5", 2)
    assert costs.gather_comm == (0.5, 0.5) and costs.as_dict()["gather_comm"] == [0.5, 0.5]


def test_a_zero3_role_refuses_a_plan_that_never_gathers_a_stage():
    from types import SimpleNamespace

    from pipegpt.train.grad_sync import DataParallelSync

    plan = lowered("1f1b")  # no UNSHARD
    engine = SimpleNamespace(plan=plan, rank=0, stages={0: None}, mesh=SimpleNamespace(pp_index=0))
    cfg = TrainConfig.build(ModelConfig(n_layer=2), stages=2, dp=2, zero=3)
    with pytest.raises(ScheduleError, match="rank 0: the plan has no 0UNSHARD, and --zero 3 shards stage 0's"):
        DataParallelSync(engine, cfg)


def test_a_prefetched_gather_overlaps_the_compute_it_precedes_in_the_simulator():
    """FSDP per block (pp 1, 4 stages, 1 microbatch; F=1, B=2, each gather 0.5): only the first gather holds
    the rank up; each other runs during the compute it was posted before. The events are the waits."""
    plan = validate(add_unshard_reshard(add_reduce_grad(lower(build_plan("interleaved-1f1b", 1, 1, 4))),
                                        "microbatch"))
    costs = Costs.uniform(4, F=1, B=2, W=1)
    free = simulate(plan, costs)
    charged = simulate(plan, Costs(costs.forward, costs.backward, costs.weight, gather_comm=(0.5,) * 4))
    assert free.makespan == 12 and charged.makespan == 12.5
    assert [(str(e.action), e.start, e.end) for e in charged.events if e.action.kind is Kind.UNSHARD] == [
        ("0UNSHARD", 0, 0.5)]
    # the same gathers, each right before its stage's compute: every one is waited for
    unfetched = "0UNSHARD 0F0 0RESHARD 1UNSHARD 1F0 1RESHARD 2UNSHARD 2F0 3UNSHARD 3F0 3B0 3REDUCE_GRAD 3RESHARD " \
                "2B0 2REDUCE_GRAD 2RESHARD 1UNSHARD 1B0 1REDUCE_GRAD 1RESHARD 0UNSHARD 0B0 0REDUCE_GRAD 0RESHARD"
    serial = validate(plan.with_ranks([tuple(Action.parse(t) for t in unfetched.split())]))
    assert simulate(serial, Costs(costs.forward, costs.backward, costs.weight, gather_comm=(0.5,) * 4)).makespan == 15
