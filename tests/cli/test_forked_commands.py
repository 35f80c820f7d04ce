"""helpers.run_pipegpt forks each `pipegpt` command from the session's preload server (torch imported once, not
once per command): what it gives back is what the console script gives, and a timeout is a timeout."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from helpers import ROOT, _forked, assert_one_line_error, clean_env, run_pipegpt
from pipegpt.comm import preload


@pytest.fixture(autouse=True)
def shared_server():
    if preload.SHARED_ADDRESS not in os.environ:  # set by conftest's session fixture, after this module's import
        pytest.skip("no shared preload server in this session")


@pytest.mark.parametrize("args", [["simulate", "--schedule", "1f1b", "-p", "2", "-m", "4"],
                                  ["run", "--stages", "0"]], ids=["simulate", "refusal"])
def test_a_forked_command_gives_what_the_console_script_gives(args, monkeypatch):
    forked = _forked(args, clean_env(), 60, ROOT)
    assert forked is not None, "the shared server refused the command"
    monkeypatch.setenv("PIPEGPT_TEST_FORK", "0")
    script = run_pipegpt(*args)
    assert (forked.returncode, forked.stdout, forked.stderr) == (script.returncode, script.stdout, script.stderr)
    if args[0] == "run":
        assert "stages" in assert_one_line_error(forked)


def test_a_forked_command_past_its_timeout_is_killed_and_said(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        _forked(["run", "--steps", "100000", "--run-dir", str(tmp_path / "run")], clean_env(), 4, ROOT)
    assert time.monotonic() - t0 < 30 and raised.value.timeout == 4
