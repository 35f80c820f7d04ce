"""Fixtures shared by tests/unit, tests/cli and tests/distributed; the plain helpers they use are in tests/helpers.py.

tests/unit: in one process (a few start a helper process: `python -c` import probes, a spawned pair or
job behind a module fixture). tests/cli: the `pipegpt` commands, through click's CliRunner or the console
script. tests/distributed: worker processes (LocalCluster, mp.spawn, torchrun) and what they compute.
"""
from __future__ import annotations

import pytest

from helpers import NoWorkers, one_thread as _one_thread, scrub_environ


@pytest.fixture(scope="module")
def one_thread():
    """The whole module on one torch thread (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    with _one_thread():
        yield


@pytest.fixture
def clean_environ(monkeypatch):
    """This process's environment without torchrun's variables or PIPEGPT_FAULT, for commands run in-process."""
    scrub_environ(monkeypatch)


@pytest.fixture
def no_workers(monkeypatch, clean_environ):
    """`pipegpt run` in-process that must refuse before any worker starts: starting a cluster fails the
    test. Returns the list of clusters started (empty unless the refusal came too late)."""
    import pipegpt.comm.rpc as rpc_module

    monkeypatch.setattr(rpc_module, "LocalCluster", NoWorkers)
    monkeypatch.setattr(rpc_module, "TorchrunCluster", NoWorkers)
    NoWorkers.started.clear()
    return NoWorkers.started
