"""Fixtures shared by tests/unit, tests/cli and tests/distributed; the plain helpers they use are in tests/helpers.py.

tests/unit: in one process (a few start a helper process: `python -c` import probes, a spawned pair or
job behind a module fixture). tests/cli: the `pipegpt` commands, through click's CliRunner or the console
script. tests/distributed: worker processes (LocalCluster, mp.spawn, torchrun) and what they compute.
"""
from __future__ import annotations

import os

import pytest

from helpers import NoWorkers, one_thread as _one_thread, scrub_environ


@pytest.fixture(scope="session", autouse=True)
def shared_preload_server(tmp_path_factory):
    """One preload server for the whole session (pipegpt.comm.preload.serve_shared): every `pipegpt run` and
    in-process job forks its workers from it instead of starting a server of its own that imports torch again.
    A driver's own server, as users' runs start it, is what test_orphans and test_preload exercise."""
    from pipegpt.comm import preload

    if not preload.supported() or preload.SHARED_ADDRESS in os.environ:
        yield None
        return
    address = str(tmp_path_factory.mktemp("preload") / "server.sock")
    server = preload.start_shared(address, preload.PRELOADED + ("pipegpt.train.worker",))
    os.environ[preload.SHARED_ADDRESS] = address
    yield address
    del os.environ[preload.SHARED_ADDRESS]
    server.kill()
    server.join(timeout=10)


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
