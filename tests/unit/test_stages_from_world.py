"""`pipegpt run` under torchrun without --stages: the stages are what the world leaves after dp x cp x tp."""
from __future__ import annotations

import click
import pytest

from pipegpt.config import ConfigError
from pipegpt.options import _stages_from_world

TORCHRUN = {"RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"}


def stages(world: int, dp=None, cp=None, tp=None, env=TORCHRUN):
    settings = {"dp": dp, "cp": cp, "tp": tp, "stages": None}
    _stages_from_world(click.Context(click.Command("run")), settings, {**env, "WORLD_SIZE": str(world)})
    return settings["stages"]


def test_every_axis_but_pp_takes_its_share_of_the_world():
    assert stages(4) == 4
    assert stages(4, cp=2) == 2  # the defect: cp was left out (4 / (dp x tp) = 4 stages, refused)
    assert stages(16, dp=2, cp=2, tp=2) == 2
    assert stages(12, dp=3, tp=2) == 2


def test_a_world_the_axes_do_not_divide_is_refused_naming_them():
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE 6 is not a multiple of --dp 1 x --cp 4 x --tp 1: give "
                                          r"--stages, or sizes that divide it$"):
        stages(6, cp=4)


def test_outside_torchrun_nothing_is_set():
    assert stages(4, cp=2, env={}) is None
