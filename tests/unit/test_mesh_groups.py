"""comm/mesh.py init_mesh: on gloo, axes whose groups hold the same ranks share one process group, and a group of
every rank is the default one; on NCCL every axis keeps a communicator of its own."""
import ctypes
import os
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pipegpt.comm import mesh as mesh_module
from pipegpt.comm.mesh import batch_gloo_loops, group_members, init_mesh
from pipegpt.dims import ParallelDims

WORLD = object()


@pytest.fixture
def made(monkeypatch):
    """The member lists new_group was called with, in order (dist itself stubbed: no process group starts)."""
    calls = []

    def new_group(members):
        calls.append(list(members))
        return ("group", len(calls))

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "group", SimpleNamespace(WORLD=WORLD))
    monkeypatch.setattr(mesh_module, "nccl_environment", lambda: None)
    monkeypatch.setattr(mesh_module, "batch_gloo_loops", lambda expected: calls.append(("batched", expected)))
    return calls


def mesh_on(device: str, dims: ParallelDims, rank: int, **kw):
    return init_mesh(dims, rank, torch.device(device), "env://", 60.0, embedding_pp_indices=(0, dims.pp - 1), **kw)


def test_two_stages_on_gloo_make_no_group_beyond_the_default(made):
    mesh = mesh_on("cpu", ParallelDims(pp=2), rank=1)
    assert made == [("batched", 1)]  # the default group's loop thread, waited for until it has its name
    assert mesh.group("pp") is mesh.group("model") is mesh.group("embedding") is WORLD
    assert mesh.group("dp") is None and mesh.members["pp"] == [0, 1]


def test_gloo_makes_one_group_per_distinct_member_list_and_every_rank_makes_the_same(made):
    dims = ParallelDims(dp=2, pp=2)
    mesh = mesh_on("cpu", dims, rank=2)
    assert made.pop() == ("batched", 3)  # after the groups: each brings its own loop thread (the default, dp, pp)
    # pp, model and embedding are [0, 1] and [2, 3] alike; dp and dp_cp are [0, 2] and [1, 3] alike
    assert made == [[0, 2], [1, 3], [0, 1], [2, 3]]
    assert mesh.group("pp") is mesh.group("model") is mesh.group("embedding") == ("group", 4)
    assert mesh.group("dp") is mesh.group("dp_cp") == ("group", 1)
    made.clear()
    mesh_on("cpu", dims, rank=1)  # new_group is collective: every rank calls it for the same lists, in order
    assert made == [[0, 2], [1, 3], [0, 1], [2, 3], ("batched", 3)]


def test_gloo_loops_as_is_leaves_the_threads_alone(made):
    mesh_on("cpu", ParallelDims(dp=2, pp=2), rank=0, batch_loops=False)  # runtime.gloo_loops = "as-is"
    assert not any(call[0] == "batched" for call in made)


def test_nccl_keeps_a_communicator_per_axis(made):
    dims = ParallelDims(dp=2, pp=2)
    mesh = mesh_on("cuda", dims, rank=0)
    every = [members for groups in group_members(dims, (0, 1)).values() for members in groups if len(members) > 1]
    assert made == every and len(made) == 10  # and no "batched": NCCL has no loop thread
    assert len({id(mesh.group(name)) for name in ("pp", "model", "embedding", "dp", "dp_cp")}) == 5


def named_thread(name: str, started: threading.Event, done: threading.Event) -> threading.Thread:
    """A thread whose kernel name (/proc/self/task/T/comm) is `name`, as gloo names its loop thread."""
    def run():
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
        started.set()
        done.wait(30)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling policies")
def test_gloo_loop_threads_go_under_sched_batch_and_no_other_thread_does():
    done = threading.Event()
    loop_started, other_started = threading.Event(), threading.Event()
    loop = named_thread("gloo_tcp_loop", loop_started, done)
    other = named_thread("pt_gloo_runloop", other_started, done)
    try:
        assert loop_started.wait(10) and other_started.wait(10)
        assert batch_gloo_loops() == 1
        assert os.sched_getscheduler(loop.native_id) == os.SCHED_BATCH
        assert os.sched_getscheduler(other.native_id) == os.SCHED_OTHER
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
        assert batch_gloo_loops() == 0  # already batched: a second call (pair_groups) changes nothing
    finally:
        done.set()


@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling policies")
def test_torchs_own_gloo_group_has_a_loop_thread_by_that_name():
    """The name batch_gloo_loops looks for is gloo's: a real gloo group (one rank, in a process of its own) has one."""
    import subprocess
    import sys
    code = ("import tempfile, torch.distributed as dist; from pipegpt.comm.mesh import batch_gloo_loops; "
            "dist.init_process_group('gloo', store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1); "
            "print(batch_gloo_loops(expected=1), batch_gloo_loops(expected=1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-2:] == ["1", "0"], out.stderr[-2000:]


@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling policies")
def test_a_loop_thread_that_names_itself_late_is_waited_for_and_a_missing_one_is_not_waited_for_long():
    """A gloo loop thread names itself when it first runs, which on a loaded machine can come after its group
    was made (a world-1 group under three busy processes: 3 of 15 had no such thread yet): batch_gloo_loops waits
    for as many as the groups, up to its bound."""
    import time
    done, named = threading.Event(), threading.Event()

    def late():
        time.sleep(0.2)
        ctypes.CDLL(None).prctl(15, b"gloo_tcp_loop", 0, 0, 0)  # PR_SET_NAME
        named.set()
        done.wait(30)

    there = len(mesh_module._gloo_loop_threads())  # another test's real gloo group in this process, if any
    thread = threading.Thread(target=late, daemon=True)
    thread.start()
    try:
        assert batch_gloo_loops(expected=there + 1, wait_s=10) >= 1 and named.is_set()
        assert os.sched_getscheduler(thread.native_id) == os.SCHED_BATCH
        t0 = time.monotonic()
        assert batch_gloo_loops(expected=there + 2, wait_s=0.3) == 0  # never comes: the bound, not a hang
        assert 0.3 <= time.monotonic() - t0 < 5
    finally:
        done.set()
