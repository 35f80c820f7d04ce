"""Cost-balanced stages: balance_layers against brute force, `pipegpt run --balance cost`, `simulate --balance`."""
from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
import sys

import pytest

from helpers import ROOT, assert_one_line_error, invoke, run_pipegpt
from pipegpt.config import ConfigError, ModelConfig, TrainConfig
from pipegpt.costs.balance import (balance, balance_layers, even_layers, parse_layer_costs, rank_loads,
                                  stage_costs)
from pipegpt.schedule.registry import SCHEDULES


def placement(schedule: str, ranks: int) -> tuple[int, ...]:
    spec = SCHEDULES[schedule]
    return spec.stage_to_rank(ranks, 2 if spec.takes_virtual_stages else None)


def splits(n_layer: int, num_stages: int):
    """Every split pipegpt allows: the middle stages hold a layer at least, the ends may hold none."""
    for cuts in itertools.combinations_with_replacement(range(n_layer + 1), num_stages - 1):
        counts = [b - a for a, b in zip((0,) + cuts, cuts + (n_layer,))]
        if all(c >= 1 for c in counts[1:-1]):
            yield counts


def brute_force(costs, embed, head, stage_to_rank) -> float:
    return min(max(rank_loads(c, costs, embed, head, stage_to_rank))
               for c in splits(len(costs), len(stage_to_rank)))


CASES = [(s, p) for s, ps in (("1f1b", (1, 2, 3, 4)), ("interleaved-1f1b", (1, 2, 3)), ("zbv", (1, 2, 3)))
         for p in ps]


@pytest.mark.parametrize("schedule,ranks", CASES)
@pytest.mark.parametrize("uniform", [True, False], ids=["same-blocks", "random-blocks"])
def test_optimal_against_brute_force(schedule, ranks, uniform):
    rng = random.Random(f"{schedule}/{ranks}/{uniform}")
    where = placement(schedule, ranks)
    S = len(where)
    for _ in range(25):
        L = rng.randint(max(S - 2, 1), 9)
        block = rng.choice([1.0, rng.uniform(0.1, 2)])
        costs = [block] * L if uniform else [rng.choice([0.0, rng.uniform(0, 2), float(rng.randint(1, 4))])
                                             for _ in range(L)]
        embed, head = rng.choice([0.0, rng.uniform(0, 1)]), rng.choice([0.0, rng.uniform(0, 6), 12.0])
        got = balance(costs, embed, head, where)
        assert got.exact and len(got.layers) == S and sum(got.layers) == L
        assert all(n >= 1 for n in got.layers[1:-1]), got
        same = len(set(costs)) <= 1
        assert got.method == ("uniform" if same or S == 1 else "chain" if len(set(where)) == S else "search")
        assert got.bottleneck == pytest.approx(max(rank_loads(got.layers, costs, embed, head, where)), rel=1e-12)
        assert got.bottleneck == pytest.approx(brute_force(costs, embed, head, where), rel=1e-9, abs=1e-12), \
            (costs, embed, head, got)
        assert balance_layers(costs, embed, head, where) == list(got.layers)


def test_heavy_head_moves_layers_off_the_last_stage():
    # 1f1b: the head costs 4 blocks; the even split 2,2,2,2 makes the last rank 6 blocks' worth
    assert balance_layers([1.0] * 8, 0.1, 4.0, (0, 1, 2, 3)) == [2, 3, 3, 0]
    # zbv: rank 0 holds both stage 0 and the last stage (the head): its blocks go elsewhere
    got = balance([1.0] * 8, 0.1, 4.0, placement("zbv", 2))
    assert got.layers[0] + got.layers[-1] < 4 and got.bottleneck < max(
        rank_loads(even_layers(8, 4), [1.0] * 8, 0.1, 4.0, placement("zbv", 2)))
    # interleaved (v=2): rank 1 holds the last stage
    where = placement("interleaved-1f1b", 2)
    got = balance([1.0] * 12, 0.1, 3.0, where)
    assert got.layers[-1] < even_layers(12, 4)[-1] and got.rank_loads[0] == pytest.approx(got.rank_loads[1], abs=1.2)


def test_even_split_kept_when_nothing_is_gained():
    for schedule, ranks in CASES:
        where = placement(schedule, ranks)
        if len(where) <= 8:
            assert balance_layers([1.0] * 8, 0.0, 0.0, where) == even_layers(8, len(where)), schedule


def test_large_inputs_take_the_closed_forms_and_are_exact():
    """100 layers on 32-64 ranks: the uniform and chain methods, not a search (their time: bench_planner.py)."""
    for schedule, ranks in (("1f1b", 64), ("interleaved-1f1b", 32), ("zbv", 32)):
        got = balance([0.7] * 100, 0.2, 5.0, placement(schedule, ranks))
        assert got.exact and got.method == "uniform" and sum(got.layers) == 100
    chain = balance([1 + (i % 3) / 10 for i in range(100)], 0.2, 5.0, placement("1f1b", 32))
    assert chain.method == "chain" and chain.exact


def test_search_that_stops_early_says_so():
    rng = random.Random(5)
    costs = [rng.uniform(0.5, 1.5) for _ in range(40)]
    where = placement("zbv", 8)
    got = balance(costs, 0.3, 3.0, where, node_limit=200)
    assert got.method == "search" and not got.exact
    assert got.lower_bound <= got.bottleneck <= max(rank_loads(even_layers(40, 16), costs, 0.3, 3.0, where))
    assert stage_costs(got.layers, costs, 0.3, 3.0)[-1] == pytest.approx(got.stage_costs[-1])


@pytest.mark.parametrize("args,message", [
    (([1.0] * 2, 0.0, 0.0, (0, 1, 2, 3, 4)), "fewer than the 3 middle stages"),
    (([1.0, -1.0], 0.0, 0.0, (0, 1)), "layer_costs[1]=-1.0 must be a finite number >= 0"),
    (([1.0], float("nan"), 0.0, (0, 1)), "embed_cost=nan"),
    (([1.0], 0.0, 0.0, ()), "stage_to_rank is empty"),
])
def test_bad_arguments(args, message):
    with pytest.raises(ConfigError, match=None) as e:
        balance_layers(*args)
    assert message in str(e.value)


def test_config_refuses_cost_with_an_explicit_split():
    cfg = TrainConfig.build(ModelConfig(n_layer=8), balance="cost", layers_per_stage=(2, 2, 2, 2))
    with pytest.raises(ConfigError, match="leave out --layers-per-stage 2,2,2,2"):
        cfg.validate()
    with pytest.raises(ConfigError, match="balance='weights' is not one of even, cost"):
        TrainConfig.build(ModelConfig(n_layer=8), balance="weights").validate()
    # what the driver records after measuring: the split and the costs it came from
    cfg.replace(balanced_costs=(0.1, 1.0, 3.0)).validate()


def test_parse_layer_costs(tmp_path):
    costs = parse_layer_costs("embed=0.1, block=1, head=3, B=3, W=1.5, comm=0.2", 4)
    assert (costs.embed, costs.blocks, costs.head, costs.backward, costs.weight, costs.comm) == \
        (0.1, (1.0,) * 4, 3.0, 3.0, 1.5, 0.2)
    path = tmp_path / "layers.json"
    path.write_text(json.dumps({"embed": 0.1, "blocks": [1, 1, 2, 2], "head": 3}))
    assert parse_layer_costs(str(path)).blocks == (1.0, 1.0, 2.0, 2.0)
    for spec, n, message in (("embed=1,head=1", 4, "give block="), ("embed=1,block=1,head=1", None, "--layers N"),
                             ("embed=1,block=1,head=1,x=2", 4, "unknown key 'x'"),
                             ("embed=1,block=1,head=1,B=1,W=2", 4, "W=2 > B=1"), (str(path), 3, "--layers 3")):
        with pytest.raises(ConfigError) as e:
            parse_layer_costs(spec, n)
        assert message in str(e.value), str(e.value)


def test_balance_and_simulate_with_layer_costs_load_no_torch():
    code = ("import sys; import pipegpt.costs.balance; from pipegpt.cli import main\n"
            "try:\n    main(['simulate', '-p', '4', '-m', '8', '--layer-costs', 'embed=0,block=1,head=3', '--layers', "
            "'8', '--balance', 'cost', '--no-chart'])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "layers per stage  2,3,3,0" in done.stdout


# --------------------------------------------------------------------------------------------------------------
# pipegpt simulate --layer-costs ... --balance even|cost

def simulate(*args):
    return invoke("simulate", *args)


def test_simulate_balance_cost_beats_even_with_a_heavy_head():
    made = {}
    for schedule in ("1f1b", "zbv", "interleaved-1f1b"):
        for how in ("even", "cost"):
            result = simulate("-s", schedule, "-p", "4", "-m", "16", "--layer-costs", "embed=0.1,block=1,head=4",
                              "--layers", "8", "--balance", how, "--json")
            assert result.exit_code == 0, result.output
            made[schedule, how] = json.loads(result.stdout)
        even, cost = made[schedule, "even"], made[schedule, "cost"]
        assert cost["makespan"] < even["makespan"], schedule
        assert sum(cost["layers_per_stage"]) == 8 and cost["balance"] == "cost"
        assert sum(cost["busy_per_rank"]) == pytest.approx(sum(even["busy_per_rank"]))  # the same work, moved
    assert made["1f1b", "even"]["layers_per_stage"] == [2, 2, 2, 2]
    assert made["1f1b", "cost"]["layers_per_stage"] == [2, 3, 3, 0]
    # F per stage from the split, B = 2F, W = F
    assert made["1f1b", "cost"]["costs"]["F"] == pytest.approx([2.1, 3, 3, 4])
    assert made["1f1b", "cost"]["costs"]["B"] == pytest.approx([4.2, 6, 6, 8])
    text = simulate("-s", "1f1b", "-p", "4", "-m", "16", "--layer-costs", "embed=0.1,block=1,head=4",
                    "--layers", "8", "--balance", "cost", "--no-chart").stdout
    assert "layers per stage  2,3,3,0  (balance cost)" in text


@pytest.mark.parametrize("args,message", [
    (["--balance", "cost"], "--balance goes with --layer-costs"),
    (["--layers", "8"], "--layers goes with --layer-costs"),
    (["--layer-costs", "embed=0,block=1,head=2", "--layers", "8", "--costs", "F=1"], "not both"),
    (["--layer-costs", "embed=0,block=1,head=2", "--layers", "8", "--balance", "best"], "'best' is not one of"),
    (["--layer-costs", "embed=0,block=1,head=2", "--layers", "3"], "3 layers are fewer than the 4 stages"),
])
def test_simulate_bad_input_is_one_line_exit_2(args, message):
    assert_one_line_error(simulate("-s", "1f1b", "-p", "4", "-m", "8", *args), message)


# --------------------------------------------------------------------------------------------------------------
# pipegpt run --balance cost

@pytest.mark.parametrize("args,message", [
    (["--balance", "cost", "--layers-per-stage", "2,2,2,2"], "leave out --layers-per-stage 2,2,2,2"),
    (["--balance", "weights"], "'weights' is not one of 'even', 'cost'"),
])
def test_run_bad_balance_is_one_line_exit_2(args, message):
    assert_one_line_error(invoke("run", "--n-layer", "8", "--steps", "1", *args), message)


def test_run_balance_cost_moves_layers_off_a_heavy_head_then_auto_orders_for_the_costs(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_pipegpt("run", "--balance", "cost", "--schedule", "auto", "--stages", "4", "--microbatches", "4",
                       "--steps", "2", "--vocab-size", "4096", "--n-layer", "8", "--run-dir", run_dir, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("pipegpt: balanced layers per stage "))
    layers = [int(n) for n in line.split()[5].split(",")]
    assert sum(layers) == 8 and len(layers) == 4 and layers[-1] < 2, line  # even: 2,2,2,2
    assert "(costs: embed " in line and " ms, block " in line and " ms, head " in line
    config = json.loads((run_dir / "config.json").read_text())["parallel"]
    assert config["layers_per_stage"] == layers and config["balance"] == "cost"
    embed, block, head = config["balanced_costs"]
    assert head > block > 0 and embed >= 0
    # the split first, then the order written for those stages' measured forward and backward costs
    said = next(ln for ln in proc.stdout.splitlines() if ln.startswith("pipegpt: schedule auto"))
    # "auto = zb-h1's order" when no written order beat a fixed one
    assert re.match(r"pipegpt: schedule auto( = [\w-]+'s order)? \(max live 4\)", said), said
    assert "best fixed schedule " in said and "lower bound " in said, said
    embed_f, embed_b, embed_w, block_f, block_b, block_w, head_f, head_b, head_w = config["schedule_costs"]
    assert head_f > block_f > 0 and block_b > block_w > 0 and head_b > head_w > 0
    assert head_f + head_b == pytest.approx(head, rel=0.5)
    assert (run_dir / "plan.txt").read_text().startswith("# name: auto")
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["loss"] > 0 for m in metrics)
