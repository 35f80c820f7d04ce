"""Worker start-up paid once per driver: a server that imports torch once, then forks LocalCluster's workers.

A spawned worker is a fresh interpreter that imports torch, then torch._dynamo (torch.optim's constructor
imports it), seconds of CPU each, once per rank. The preload server is spawned instead, as early as the
driver can (start_early, before the driver imports torch itself, so the two imports overlap), imports those
modules once and forks each worker from itself in milliseconds.

The lifeline holds as for a spawned worker (pipegpt.comm.lifeline): the server is bound to the driver before
it imports anything, and each forked worker to the server before it runs anything (the parent-death signal
goes to the children of a process that dies, not to its grandchildren: a driver's death kills the server,
the server's death kills the workers). The server reaps its workers and reports each exit code to the driver,
which cannot wait for processes that are not its children (ForkedWorker: multiprocessing.Process's view).

What a spawned worker would have received from the driver at its start, a forked one receives with its fork
request: the environment (replaced whole), the working directory, the CPU affinity, stdout and stderr.
A variable read while torch is imported (TORCH_CPP_LOG_LEVEL, OMP_NUM_THREADS, ...) cannot change after the
fact: a request whose environment differs from the server's in anything but the variables read later
(read_late) is refused, and LocalCluster spawns its workers as before (LocalCluster.start_method says which
and why). Refused too: a server that found the
CUDA driver loaded after its imports (forking after CUDA is initialised is unsafe; the server only imports,
and torch's own CUDA check goes through NVML here), and one that could not import its modules.

Torch-free: the driver imports this module before torch; only the server process imports torch.
"""
from __future__ import annotations

import gc
import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import traceback
from multiprocessing import reduction

from pipegpt.comm.lifeline import bind_to_parent, run_worker
from pipegpt.comm.wait_window import WaitWindow

# What every local worker imports before it can serve: torch, torch._dynamo (torch.optim's constructor), RPC.
PRELOADED = ("torch", "torch._dynamo", "torch.optim", "torch.distributed.rpc", "pipegpt.comm.rpc")
# The environment LocalCluster's workers run in, unless the user set otherwise: applied before the server
# starts, since torch reads TORCH_CPP_LOG_LEVEL when it is imported.
LOCAL_ENV = {
    "TP_SOCKET_IFNAME": "lo",  # keep RPC on loopback: one machine
    "GLOO_SOCKET_IFNAME": "lo",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # TensorPipe logs every closed connection at shutdown; failures reach us anyway
}
# Variables read only once a worker runs (by pipegpt, RPC, gloo, NCCL or the CUDA driver), or by no one at an
# import (the terminal's size, pytest's test name, the shell's directories): they may differ between the
# server's start and a fork request.
LATE_NAMES = frozenset({"TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "SPT_NOENV", "MASTER_ADDR", "MASTER_PORT",
                        "CUDA_VISIBLE_DEVICES", "COLUMNS", "LINES", "PYTEST_CURRENT_TEST", "PWD", "OLDPWD"})
LATE_PREFIXES = ("PIPEGPT_", "NCCL_")
POLL_S = 0.05
# Where a shared server listens (serve_shared), for every driver started with it in its environment: a test
# session's, whose many short `pipegpt run`s would otherwise each start a server of their own.
SHARED_ADDRESS = "PIPEGPT_PRELOAD_ADDRESS"
STREAMS = (1, 2)  # stdout, stderr; a worker's stdin is /dev/null, as a spawned one's


def read_late(name: str) -> bool:
    return name in LATE_NAMES or name.startswith(LATE_PREFIXES)


def supported() -> bool:
    """Whether this platform forks and has the parent-death signal (Linux), and nobody asked for spawned workers."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and not spawn_asked()


def spawn_asked(env=os.environ) -> bool:
    """PIPEGPT_WORKER_START=spawn: every worker a fresh interpreter, as before the preload server (a way out, and
    the start-up benchmark's baseline)."""
    return env.get("PIPEGPT_WORKER_START", "") == "spawn"


def apply_local_env(env=os.environ) -> None:
    for name, value in LOCAL_ENV.items():
        env.setdefault(name, value)


_server: Preloader | None = None
_server_lock = threading.Lock()


def start_early(modules: tuple[str, ...] = PRELOADED) -> Preloader | None:
    """Start this process's preload server now (once; later calls return it), importing `modules`; None where
    workers cannot be forked here. A local driver calls it as early as it can, before importing torch itself
    (not under torchrun, which starts every process itself), from its main thread: the parent-death signal that
    binds the server follows the thread that started it."""
    global _server
    if not supported():
        return None
    with _server_lock:
        if _server is None or _server.gone:
            apply_local_env()
            address = os.environ.get(SHARED_ADDRESS)
            _server = (Preloader.connect(address) if address else None) or Preloader(modules)
        return _server


def server() -> Preloader | None:
    """The preload server started by start_early, or one started now."""
    return _server if _server is not None and not _server.gone else start_early()


class Preloader:
    """The driver's end of a preload server: its process, its pipe, and the exits it reported."""

    def __init__(self, modules: tuple[str, ...] = (), conn=None):
        """A server of this process's own, importing modules; or, given conn, a connection to a shared one."""
        self.proc = None  # a shared server is not this process's child
        if conn is None:
            ctx = multiprocessing.get_context("spawn")
            conn, theirs = ctx.Pipe()
            # Bound to this process before it imports anything, as a spawned worker is (run_worker). A daemon:
            # multiprocessing ends it (and so its workers) when this process exits normally.
            self.proc = ctx.Process(target=run_worker, name="pipegpt-preload", daemon=True,
                                    args=(os.getpid(), f"{__name__}:serve", theirs, tuple(modules)))
            self.proc.start()
            theirs.close()
        self.conn = conn
        self.exits: dict[int, int] = {}  # pid -> exit code, multiprocessing's sign convention
        self.forked: list[int] = []
        self.gone = False  # the server's end is closed: it exited
        self._answers: list[tuple] = []
        self._said = threading.Condition()
        # The server's words are read on a thread of their own: a signal's exception (SIGTERM, ^C) raised in the
        # driver's main thread in the middle of a message would leave the rest of it to be read as the next one.
        self._reader = threading.Thread(target=self._read, name="pipegpt-preload-reader", daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, address: str) -> Preloader | None:
        """A connection to the shared server at address (serve_shared), or None where there is none."""
        try:
            return cls(conn=multiprocessing.connection.Client(address, family="AF_UNIX"))
        except OSError:
            return None

    def close(self, timeout_s: float = 10.0) -> None:
        """Hang up (a shared server's child then ends, and what it forked with it). The reader sees the end before
        the descriptor closes, so that it never reads a later descriptor given the same number."""
        try:
            with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout_s)
        self.conn.close()

    def _exited(self) -> str:
        return (f"the preload server exited (code {self.proc.exitcode})" if self.proc is not None
                else "the shared preload server closed its connection")

    def fork(self, target: str, args_per_worker: list[tuple], names: list[str], timeout_s: float,
             env: dict[str, str] | None = None, cwd: str | None = None,
             streams: dict[int, int] | None = None) -> list[ForkedWorker] | str:
        """One worker per args, running target ("module:function") with them: the workers, or why not
        (the caller spawns them instead). Waits for the server's imports, at most timeout_s. The workers get
        this process's environment, working directory, stdout and stderr, or env, cwd and streams (their fd ->
        this process's fd that it writes to)."""
        streams = {fd: fd for fd in STREAMS if _is_open(fd)} if streams is None else streams
        request = ("fork", target, args_per_worker, names, dict(os.environ) if env is None else dict(env),
                   os.getcwd() if cwd is None else os.fspath(cwd), sorted(os.sched_getaffinity(0)), sys.executable,
                   list(streams))
        try:
            self.conn.send(request)
            with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                reduction.sendfds(s, list(streams.values()))
        except OSError:
            return self._exited()
        window = WaitWindow(timeout_s)
        with self._said:
            while not self._answers:
                if self.gone:
                    return self._exited()
                if window.timed_out():
                    return f"the preload server did not answer within {timeout_s:.0f}s"
                self._said.wait(POLL_S)
                window.poll()  # a pause of this process is not the server's time
            kind, value = self._answers.pop(0)
        if kind == "refused":
            return value
        return [ForkedWorker(self, pid, name) for pid, name in zip(value, names)]

    def exitcode(self, pid: int) -> int | None:
        with self._said:
            return self.exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> None:
        with self._said:
            self._said.wait_for(lambda: pid in self.exits, timeout)

    def _read(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                with self._said:
                    if message[0] == "exited":
                        self.exits[message[1]] = message[2]
                    else:
                        self.forked += message[1] if message[0] == "forked" else []
                        self._answers.append(message)
                    self._said.notify_all()
        except (EOFError, OSError):  # the server is gone: its workers were killed with it (parent-death signal)
            with self._said:
                self.gone = True
                for pid in self.forked:
                    self.exits.setdefault(pid, -signal.SIGKILL)
                self._said.notify_all()


class ForkedWorker:
    """A worker forked by the preload server, as multiprocessing.Process shows one: pid, exitcode, is_alive(),
    join(timeout), kill(). Its exit code is the server's word (only a parent can wait for a process)."""

    def __init__(self, preloader: Preloader, pid: int, name: str):
        self.preloader, self.pid, self.name = preloader, pid, name

    @property
    def exitcode(self) -> int | None:
        return self.preloader.exitcode(self.pid)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self.preloader.wait_exit(self.pid, timeout)

    def kill(self) -> None:
        if self.exitcode is None:  # not reaped yet, so the pid is still this worker's
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------------------------------------
# The server process

def serve(conn, modules: tuple[str, ...], start_env: dict[str, str] | None = None) -> None:
    """The server's target (run by lifeline.run_worker, bound to the driver): import, then fork on request
    and report exits until the driver's end closes. start_env: the environment before any import (this one's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the driver's and the workers' to handle
    start_env = dict(os.environ) if start_env is None else start_env
    refusal = _preload(modules)
    gc.freeze()  # what was imported is never collected: no collection walks (and copies) the forked pages
    exits: dict[int, int] = {}  # a descriptor readable once the worker exits (pidfd) -> its pid
    polled = False  # no pidfd here (Linux before 5.3): look for exits every POLL_S
    while True:
        try:
            ready = multiprocessing.connection.wait([conn, *exits], timeout=POLL_S if polled else None)
            if conn in ready:
                message = conn.recv()
                with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    fds = reduction.recvfds(s, len(message[-1])) if message[-1] else []
                for pid in _fork(conn, message, fds, refusal or _env_refusal(start_env, message[4])
                                 or _interpreter_refusal(message[7])):
                    try:
                        exits[os.pidfd_open(pid)] = pid
                    except (AttributeError, OSError):
                        polled = True
            _report_exits(conn, exits)
        except (EOFError, OSError):
            return  # the driver is gone or done: the workers die with this process


def start_shared(address: str, modules: tuple[str, ...] = PRELOADED, timeout_s: float = 120):
    """Start a shared server listening at address (a Unix socket's path), bound to this process as a driver's own
    server is; returns its process once it listens (before its imports end). Drivers that find SHARED_ADDRESS=address in their environment
    use it (start_early)."""
    apply_local_env()
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=run_worker, name="pipegpt-preload-shared", daemon=True,
                       args=(os.getpid(), f"{__name__}:serve_shared", address, tuple(modules)))
    proc.start()
    window = WaitWindow(timeout_s)
    while not os.path.exists(address):
        if not proc.is_alive() or window.timed_out():
            proc.kill()
            raise RuntimeError(f"the shared preload server did not listen at {address} (exit code {proc.exitcode})")
        window.poll()
        proc.join(POLL_S)
    return proc


def serve_shared(address: str, modules: tuple[str, ...]) -> None:
    """The shared server's target: import once, then serve each driver that connects from a child forked for it,
    which serves it as a driver's own server would (serve): its workers are that child's children, and die with
    it, and it ends when its driver's end of the connection closes (at the driver's death too: the lifeline)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)  # listening before importing: a driver that connects meanwhile waits for its answer
    start_env = dict(os.environ)
    _preload(modules)  # serve (in each child) says why not, if it failed
    gc.freeze()
    listener.settimeout(1.0)  # children that ended are reaped at least this often
    server_pid = os.getpid()
    while True:
        try:
            accepted, _ = listener.accept()
        except socket.timeout:
            accepted = None
        if accepted is not None and os.fork() == 0:
            listener.close()
            code = 1
            try:
                bind_to_parent(server_pid)
                serve(multiprocessing.connection.Connection(accepted.detach()), modules, start_env)
                code = 0
            finally:
                os._exit(code)
        if accepted is not None:
            accepted.close()
        while True:  # reap the children whose drivers are done
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def _preload(modules: tuple[str, ...]) -> str | None:
    """Import the modules; why workers must not be forked from here, or None."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch.cuda.is_available() without initialising CUDA
    try:
        for name in modules:
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - a spawned worker will meet it again and report it
        return f"the preload server could not import {name} ({type(e).__name__}: {e})"
    with open("/proc/self/maps") as f:
        if any("libcuda.so" in line for line in f):
            return "the CUDA driver was loaded while preloading"
    _find_title_memory()
    return None


def _find_title_memory() -> None:
    """setproctitle finds the command line's memory from the environment's, once (its first use): found here,
    before a worker replaces its environment, or a worker's title (engine.placement.name_process) would not take."""
    os.environ.setdefault("SPT_NOENV", "1")  # as name_process asks: the command line's own bytes only
    try:
        import setproctitle

        setproctitle.getproctitle()
    except ImportError:  # name_process falls back to /proc/self/comm
        pass


def _env_refusal(start_env: dict[str, str], env: dict[str, str]) -> str | None:
    changed = sorted(name for name in start_env.keys() | env.keys()
                     if start_env.get(name) != env.get(name) and not read_late(name))
    return f"the environment changed since the preload server started ({', '.join(changed)})" if changed else None


def _interpreter_refusal(executable: str) -> str | None:
    """A worker's sys.executable is its server's: a driver of another interpreter (a shared server's client, a
    virtual environment's twin) would see its workers look for tools (py-spy) beside the wrong one."""
    if executable != sys.executable:
        return f"the driver's interpreter ({executable}) is not the preload server's ({sys.executable})"
    return None


def _fork(conn, message: tuple, fds: list[int], refusal: str | None) -> list[int]:
    """The workers a request asks for, forked (their pids), or none and the refusal sent."""
    _, target, args_per_worker, names, env, cwd, cores, _, streams = message
    pids = []
    if refusal is None:
        server_pid = os.getpid()
        for name, args in zip(names, args_per_worker):
            pid = os.fork()
            if pid == 0:
                _become_worker(conn, server_pid, dict(zip(streams, fds)), env, cwd, cores, name, target, args)
            pids.append(pid)
    for fd in fds:
        os.close(fd)
    conn.send(("refused", refusal) if refusal else ("forked", pids))
    return pids


def _become_worker(conn, server_pid: int, streams: dict[int, int], env: dict[str, str], cwd: str, cores: list[int],
                   name: str, target: str, args: tuple) -> None:
    """In a forked child: become the worker a spawned process would have been, run target, exit."""
    code = 1
    try:
        conn.close()
        bind_to_parent(server_pid)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, received in streams.items():
            os.dup2(received, fd)
            os.close(received)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        os.sched_setaffinity(0, cores)
        # multiprocessing's own start of a forked child (as its fork start method runs it): stdin closed, its
        # after-fork hooks, the exit code and a failure's traceback as a spawned worker's. Not the interpreter's
        # exit handlers, which a fork start skips too (they would tear down torch's registrations one by one).
        code = multiprocessing.Process(target=_run_named, args=(target, *args), name=name)._bootstrap()
    except BaseException:  # noqa: BLE001 - the worker's setup failed: said, and the exit code tells the driver
        traceback.print_exc()
    finally:
        os._exit(code)


def _run_named(target: str, *args) -> None:
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(*args)


def _report_exits(conn, exits: dict[int, int]) -> None:
    """Reap the workers that exited and tell the driver their exit codes."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for fd in [fd for fd, watched in exits.items() if watched == pid]:
            os.close(fd)
            del exits[fd]
        conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))
