"""Multi-node and timeouts (issue 16, item 7): the interface RPC and gloo bind to under torchrun, NCCL's error
handling, the first steps' timeout under --compile, a step's deadline apart from a wait's (issue 30). (tp dividing the processes per node: tests/unit/test_config.py.)"""
from __future__ import annotations

import socket
import types

import pytest

from pipegpt.comm.mesh import nccl_environment
from pipegpt.comm.network import bind_to_master_interface, interface_reaching
from pipegpt.config import COMPILE_STEPS, COMPILE_TIMEOUT_S, ConfigError, TrainConfig
from pipegpt.train.driver import Job


def _addresses() -> dict[str, str]:
    """{interface: its IPv4 address} of this machine's interfaces that have one."""
    found = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                import fcntl
                import struct
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        found[name] = socket.inet_ntoa(packed[20:24])
    return found


def test_the_interface_is_the_one_whose_address_routes_to_the_master():
    assert interface_reaching("127.0.0.1", 29500) == "lo"
    for name, address in _addresses().items():  # an address of this machine is reached from itself
        assert interface_reaching(address, 29500) == name


def test_rpc_and_gloo_bind_to_it_unless_the_user_chose():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert bind_to_master_interface(env) == "lo"
    assert env["TP_SOCKET_IFNAME"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TP_SOCKET_IFNAME": "eth7", "GLOO_SOCKET_IFNAME": "x"}
    assert bind_to_master_interface(env) == "eth7" and env["GLOO_SOCKET_IFNAME"] == "x"


def test_nccl_errors_reach_the_waiting_rank_instead_of_killing_it():
    env = {}
    nccl_environment(env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # CleanUpOnly: abort, raise in the wait
    env = {"NCCL_ASYNC_ERROR_HANDLING": "1"}  # the user's (old name) wins
    nccl_environment(env)
    assert env == {"NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_compile_gives_the_first_steps_their_own_timeout():
    assert TrainConfig().runtime.wait_timeout_s == 60.0
    assert TrainConfig.build(compile=True).runtime.wait_timeout_s == COMPILE_TIMEOUT_S
    assert TrainConfig.build(compile=True, timeout_s=2000.0).runtime.wait_timeout_s == 2000.0
    calls = []

    class Cluster:
        def call(self, method, *args, **kwargs):
            calls.append(kwargs.get("timeout_s"))
            return [types.SimpleNamespace(rank=0, events=[], compute_s=None)]

    # A step's deadline is its own (--step-timeout, default 10 x --timeout), not one wait's: the first steps get
    # three times as long, and under --compile at least the compile timeout.
    for settings, first, later in (({"compile": True, "timeout_s": 20.0}, COMPILE_TIMEOUT_S, 200.0),
                                   ({"compile": True}, 1800.0, 600.0), ({}, 1800.0, 600.0),
                                   ({"step_timeout_s": 90.0}, 270.0, 90.0)):
        job = Job.__new__(Job)  # the driver's step, on a stand-in cluster
        job.cfg, job.cluster = TrainConfig.build(**settings), Cluster()
        job.step_times, job.clock_offsets = [], [0.0]
        calls.clear()
        for step in range(COMPILE_STEPS + 2):
            job.step(step)
        assert calls == [first] * COMPILE_STEPS + [later] * 2, settings


def test_a_step_timeout_below_the_communication_timeout_is_refused():
    with pytest.raises(ConfigError, match=r"step_timeout_s=30.0 must be at least timeout_s=60.0: a step is many "
                                          r"waits, each bounded by --timeout \(leave --step-timeout out for 10 x"):
        TrainConfig.build(step_timeout_s=30.0).validate()
    TrainConfig.build(step_timeout_s=60.0).validate()


def test_a_step_past_its_deadline_names_the_option_that_sets_it():
    from pipegpt.comm.rpc import Cluster, WorkerFailure

    class Silent(Cluster):  # one actor whose step never answers
        world_size, timeout_s = 1, 60.0

        def __init__(self):
            never = types.SimpleNamespace(done=lambda: False, add_done_callback=lambda fn: None)
            self.actors = [types.SimpleNamespace(rpc_async=lambda timeout: types.SimpleNamespace(step=lambda *a: never))]

    with pytest.raises(WorkerFailure, match=r"rank 0 failed: no answer to step\(\) within 0s \(ranks \[0\] "
                                            r"pending; --step-timeout sets the limit\)"):
        Silent().call("step", 0, timeout_s=0.2, limit_flag="--step-timeout")
