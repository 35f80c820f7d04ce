"""The `pipegpt run` progress line: elapsed time and the time left at the pace of the steps after the first."""
from types import SimpleNamespace

from pipegpt.observe.progress import Clock, duration, progress_line


def _m(step):  # step: its number, from 1
    return SimpleNamespace(step=step, loss=2.5, step_time_s=0.1, tokens_per_s=1000.0)


def test_eta_from_the_steps_after_the_first():
    t = [100.0]
    clock = Clock(first_step=0, steps=11, now=lambda: t[0])
    t[0] = 130.0  # the first step: 30 s of warm-up, not counted in the rate
    clock.tick(0)
    assert clock.eta() is None
    t[0] = 140.0  # two more steps, 10 s each
    clock.tick(1)
    t[0] = 150.0
    clock.tick(2)
    assert clock.elapsed() == 50.0
    assert clock.eta() == 80.0  # 8 steps left at 10 s


def test_eta_of_a_resumed_attempt_counts_its_own_steps():
    t = [0.0]
    clock = Clock(first_step=5, steps=10, now=lambda: t[0])
    for step, at in [(5, 20.0), (6, 22.0)]:
        t[0] = at
        clock.tick(step)
    assert clock.eta() == 6.0  # steps 7, 8, 9 at 2 s


def test_the_line_shows_elapsed_and_eta():
    line = progress_line(_m(2), 10, elapsed_s=65, eta_s=3725)
    assert line.endswith("elapsed 1m05s  eta 1h02m")
    assert "eta ?" in progress_line(_m(1), 10, elapsed_s=3, eta_s=None)
    assert "eta" not in progress_line(_m(10), 10, elapsed_s=3, eta_s=0)  # the last step: nothing left
    assert duration(59.4) == "59s"
