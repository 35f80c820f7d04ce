"""This machine's side of the network, torch-free: a free port, whether a port is free, and which interface
reaches the torchrun master (RPC and gloo listen there)."""
from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def interface_reaching(host: str, port: int) -> str | None:
    """The name of this machine's network interface whose IPv4 address routes to host (Linux), or None."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: nothing is sent; the kernel picks the route and so the address
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        except OSError:
            continue
        if socket.inet_ntoa(packed[20:24]) == local:
            return name
    return None


def bind_to_master_interface(env=os.environ) -> str | None:
    """Under torchrun, the interface RPC (TensorPipe) and gloo listen on: left to themselves they take the
    hostname's address, 127.0.1.1 on many distributions, which other nodes cannot reach. The one that routes
    to MASTER_ADDR reaches every node; TP_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME) set by the user win."""
    if env.get("TP_SOCKET_IFNAME"):
        return env["TP_SOCKET_IFNAME"]
    name = interface_reaching(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    if name is not None:
        env["TP_SOCKET_IFNAME"] = name
        env.setdefault("GLOO_SOCKET_IFNAME", name)
    return name
