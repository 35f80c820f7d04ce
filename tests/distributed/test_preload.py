"""The preload server (pipegpt.comm.preload): a forked worker gets what a spawned one got from its driver, its
exit is reported, it dies with the server, and a request the server cannot honour soundly is refused.

The servers here import nothing (modules=()): the mechanism, in a fraction of a second. The real thing (torch
preloaded, `pipegpt run`) is exercised by every `pipegpt run` test; test_orphans kills a driver while its forked
workers start.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, clean_env
from pipegpt.comm import preload

pytestmark = pytest.mark.skipif(not preload.supported(), reason="forks workers on Linux only")

TARGETS = "preload_targets"  # tests/distributed/preload_targets.py, on the server's sys.path as on this one's


@pytest.fixture
def server():
    preloader = preload.Preloader(modules=())
    yield preloader
    preloader.proc.kill()
    preloader.proc.join(timeout=10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZXx"
    except OSError:
        return False


def test_a_forked_worker_gets_the_drivers_environment_directory_cores_and_streams(server, tmp_path, monkeypatch,
                                                                                    capfd):
    monkeypatch.setenv("PIPEGPT_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:1])
    try:
        workers = server.fork(f"{TARGETS}:report", [(str(tmp_path / "seen.json"),)], ["pipegpt-rank0"], 60)
    finally:
        os.sched_setaffinity(0, cores)
    assert not isinstance(workers, str), workers
    workers[0].join(30)
    assert workers[0].exitcode == 0
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"probe": "set after the server started", "cwd": str(tmp_path), "cores": cores[:1],
                    "name": "pipegpt-rank0", "ppid": server.proc.pid, "torch": False}
    assert f"reported to {tmp_path / 'seen.json'}" in capfd.readouterr().out  # this process's stdout, as now


def test_a_request_may_give_the_environment_directory_and_streams(server, tmp_path):
    """What a test's command asks for (helpers.run_pipegpt): its own environment, directory and output."""
    out_read, out_write = os.pipe()
    env = {**os.environ, "PIPEGPT_PROBE": "given"}
    try:
        workers = server.fork(f"{TARGETS}:report", [(str(tmp_path / "seen.json"),)], ["pipegpt"], 60, env=env,
                              cwd=str(tmp_path), streams={1: out_write})
    finally:
        os.close(out_write)
    assert not isinstance(workers, str), workers
    workers[0].join(30)
    with os.fdopen(out_read) as f:
        assert f.read() == f"reported to {tmp_path / 'seen.json'}\n"
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert (seen["probe"], seen["cwd"], workers[0].exitcode) == ("given", str(tmp_path), 0)


def test_close_ends_the_reader_before_the_descriptor_goes():
    """close() wakes the reader (blocked in recv) with the connection's end and waits for it: a descriptor closed
    under a blocked reader stays blocked in it, and would read the next descriptor given that number (a test's
    next pipe) as the server's."""
    address = os.environ.get(preload.SHARED_ADDRESS)
    if address is None:
        pytest.skip("no shared preload server in this session")
    preloader = preload.Preloader.connect(address)
    assert preloader._reader.is_alive()
    preloader.close()
    assert not preloader._reader.is_alive() and preloader.gone and preloader.conn.closed


def test_exits_are_reported_as_multiprocessing_reports_them(server):
    workers = server.fork(f"{TARGETS}:exit_with", [(13,), (0,)], ["pipegpt-rank0", "pipegpt-rank1"], 60)
    for w in workers:
        w.join(30)
    assert [w.exitcode for w in workers] == [13, 0]
    waiting = server.fork(f"{TARGETS}:wait", [()], ["pipegpt-rank0"], 60)[0]
    assert waiting.is_alive()
    waiting.kill()
    waiting.join(30)
    assert waiting.exitcode == -signal.SIGKILL and not waiting.is_alive()


def test_a_dead_server_takes_its_workers(server):
    workers = server.fork(f"{TARGETS}:wait", [(), ()], ["pipegpt-rank0", "pipegpt-rank1"], 60)
    assert all(_alive(w.pid) for w in workers)
    server.proc.kill()
    deadline = time.monotonic() + 5
    while any(_alive(w.pid) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(w.pid) for w in workers)
    for w in workers:
        w.join(5)
    assert [w.exitcode for w in workers] == [-signal.SIGKILL] * 2  # what the driver is told


def test_a_change_to_a_variable_read_at_import_is_refused(server, monkeypatch):
    """OMP_NUM_THREADS is read when torch loads its OpenMP: a worker forked from a server started without it
    would not honour it. The caller spawns instead."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert server.fork(f"{TARGETS}:exit_with", [(0,)], ["pipegpt-rank0"], 60) == \
        "the environment changed since the preload server started (OMP_NUM_THREADS)"


def test_a_server_that_cannot_import_its_modules_refuses():
    preloader = preload.Preloader(modules=("pipegpt.no_such_module",))
    try:
        refusal = preloader.fork(f"{TARGETS}:exit_with", [(0,)], ["pipegpt-rank0"], 60)
        assert refusal.startswith("the preload server could not import pipegpt.no_such_module (ModuleNotFoundError"), \
            refusal
    finally:
        preloader.proc.kill()
        preloader.proc.join(timeout=10)


DIES_WHILE_STARTING = """
import sys
from pipegpt.comm.rpc import LocalCluster, WorkerFailure
try:
    LocalCluster(2, 60, 1, cores=[(0,), (99999,)])  # rank 1's core does not exist: it dies while starting
except WorkerFailure as e:
    print(e)
    sys.exit(0)
sys.exit("started")
"""


def test_a_forked_worker_that_dies_while_starting_is_named():
    proc = subprocess.run([sys.executable, "-c", DIES_WHILE_STARTING], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "rank 1 failed: process exited with code 1", proc.stdout + proc.stderr
    assert "OSError: [Errno 22] Invalid argument" in proc.stderr  # the worker's own traceback, as a spawned one's


def test_pipegpt_worker_start_spawn_is_the_way_back_to_one_interpreter_per_worker(monkeypatch):
    """The escape hatch (and bench_startup's baseline): nothing is forked, start_early starts no server."""
    monkeypatch.setenv("PIPEGPT_WORKER_START", "spawn")
    assert preload.spawn_asked() and not preload.supported() and preload.start_early() is None
    monkeypatch.setenv("PIPEGPT_WORKER_START", "fork")
    assert not preload.spawn_asked()


@pytest.fixture
def shared(tmp_path):
    address = str(tmp_path / "server.sock")
    proc = preload.start_shared(address, modules=())
    yield address, proc
    proc.kill()
    proc.join(timeout=10)


DRIVER_OF_SHARED = """
import sys, time
from pipegpt.comm import preload
server = preload.Preloader.connect(sys.argv[1])
workers = server.fork("preload_targets:wait", [(), ()], ["pipegpt-rank0", "pipegpt-rank1"], 60)
assert not isinstance(workers, str), workers
print(" ".join(str(w.pid) for w in workers), flush=True)
time.sleep(600)
"""


def test_a_shared_servers_workers_die_with_the_driver_that_asked_for_them(shared, tmp_path):
    """The shared server (a test session's) keeps the lifeline: the driver killed, its workers go, the server and
    the next driver's workers stay."""
    address, server_proc = shared
    driver = subprocess.Popen([sys.executable, "-c", DRIVER_OF_SHARED, address], cwd=ROOT, env=clean_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        other = preload.Preloader.connect(address)
        survivor = other.fork(f"{TARGETS}:wait", [()], ["pipegpt-rank0"], 60)[0]
        driver.kill()
        driver.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
        assert server_proc.is_alive() and survivor.is_alive()
        survivor.kill()
        survivor.join(10)
        assert survivor.exitcode == -signal.SIGKILL
    finally:
        driver.kill()


def test_a_driver_without_a_shared_server_starts_its_own(tmp_path, monkeypatch):
    assert preload.Preloader.connect(str(tmp_path / "nobody.sock")) is None


def test_a_driver_of_another_interpreter_is_refused(server, monkeypatch):
    """A worker's sys.executable is its server's: a driver run by another interpreter (a virtual environment's
    twin, a shared server's client) spawns its own, or its workers would look for py-spy beside the wrong one."""
    monkeypatch.setattr(sys, "executable", "/elsewhere/bin/python")
    refusal = server.fork(f"{TARGETS}:exit_with", [(0,)], ["pipegpt-rank0"], 60)
    assert refusal.startswith("the driver's interpreter (/elsewhere/bin/python) is not the preload server's ("), \
        refusal
