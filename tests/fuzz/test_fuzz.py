"""The composition fuzzer (tests/fuzz/layouts.py draws, run_case.py compares with one process in float64).

Default suite: the draws are reproducible and valid, with no worker started. Slow set: a fixed budget of seeds run
against the oracle. A longer campaign: `python tests/fuzz/campaign.py --minutes 60`; one seed again:
`python tests/fuzz/campaign.py --seed N`.
"""
from __future__ import annotations

import random

import pytest

from layouts import MAX_RANKS, config, draw, random_schedule_text
from pipegpt.schedule.schedule_file import parse_schedule_text

SLOW_SEEDS = range(8)  # about 10 s each on 2 cores


def test_a_seed_draws_the_same_case_every_time():
    assert [draw(seed) for seed in range(6)] == [draw(seed) for seed in range(6)]


def test_draws_cover_the_axes_and_stay_within_the_machine():
    cases = [draw(seed) for seed in range(40)]
    for case in cases:
        assert config(case.settings, case.model).world_size <= MAX_RANKS, case.describe()
    for axis in ("dp", "stages", "cp", "tp"):
        assert any(c.settings[axis] > 1 for c in cases), f"no draw of 40 spans {axis}"
    assert any(c.resume_settings for c in cases) and any(c.schedule_text for c in cases)
    assert {c.settings.get("zero", 0) for c in cases} == {0, 1, 2, 3}


@pytest.mark.parametrize("stages,microbatches", [(2, 3), (4, 5)])
def test_a_random_order_is_a_valid_schedule(stages, microbatches):
    for seed in range(20):
        plan = parse_schedule_text(random_schedule_text(random.Random(seed), stages, microbatches))
        assert plan.num_microbatches == microbatches and len(plan.ranks) == stages


@pytest.fixture(scope="module")
def hosts():
    from run_case import Hosts

    held = Hosts()
    yield held
    held.close()


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_a_drawn_case_matches_one_process(hosts, seed, tmp_path):
    from run_case import run_case

    case = draw(seed)
    print(case.describe())
    run_case(case, hosts, tmp_path)
