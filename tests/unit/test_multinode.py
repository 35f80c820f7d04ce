"""Multi-node and timeouts (issue 16, item 7): the interface RPC and gloo bind to under torchrun, NCCL's error
handling, the first steps' timeout under --compile. (tp dividing the processes per node: tests/unit/test_config.py.)"""
from __future__ import annotations

import socket
import types

from pipegpt.comm.mesh import nccl_environment
from pipegpt.comm.rpc import bind_to_master_interface, interface_reaching
from pipegpt.config import COMPILE_STEPS, COMPILE_TIMEOUT_S, TrainConfig
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
            return [types.SimpleNamespace(rank=0, events=[])]

    for compile_, expected in ((True, COMPILE_TIMEOUT_S), (False, 60.0)):
        job = Job.__new__(Job)  # the driver's step, on a stand-in cluster
        job.cfg, job.cluster = TrainConfig.build(compile=compile_), Cluster()
        job.step_times, job.clock_offsets = [], [0.0]
        calls.clear()
        for step in range(COMPILE_STEPS + 2):
            job.step(step)
        assert calls == [expected] * COMPILE_STEPS + [None] * 2
