"""The actor control plane: a driver steers one worker actor per rank over torch.distributed.rpc.

Only small control messages travel here (build, step, metrics, shutdown);
activations and gradients go worker to worker over c10d (p2p.py).

Two ways to get a cluster:
  LocalCluster    the driver starts one process per rank on this machine, watches
                  them, and brings everything down when one fails;
  TorchrunCluster under torchrun every process is a worker and rank 0 also
                  hosts the driver.
"""
from __future__ import annotations

import concurrent.futures
import functools
import gc
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping
from urllib.parse import parse_qsl, urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

from pipegpt.comm import preload
from pipegpt.comm.lifeline import run_worker
from pipegpt.comm.network import bind_to_master_interface, free_port, port_is_free  # noqa: F401 (names of rpc's)
from pipegpt.comm.wait_window import WaitWindow, pause_line

POLL_S = 0.05
HEARTBEAT_EVERY_S = 2.0
# A loaded machine can delay an answer by seconds; a stopped process never answers.
HEARTBEAT_TIMEOUT_S = 10.0


# What a rank reports when a peer vanished under a collective or a message (a symptom, not the cause): pipegpt's
# CommError, gloo's closed connections and timeouts.
_SYMPTOM = re.compile(r"^CommError\b|Connection (closed|reset) by peer|[Tt]imed out")


class WorkerFailure(RuntimeError):
    """A worker raised, died or stopped answering; names the rank and the cause."""

    verb = "failed"

    def __init__(self, rank: int, cause: str, report: str = "", exit_code: int | None = None):
        self.rank, self.cause, self.report = rank, cause, report  # report: lines to show before the error
        self.exit_code = exit_code  # the process's, where it exited
        super().__init__(f"rank {rank} {self.verb}: {cause}")


class WorkerStalled(WorkerFailure):
    """A worker alive and answering, but holding the job up (the stall watchdog's verdict)."""

    verb = "stalled"


def _rpc_options(init_method: str, timeout_s: float):
    # TCP only: TensorPipe's shared-memory transport busy-polls a reactor thread in every process
    # (measured: a third of a core in all for a 4-rank job on 2 cores), and the control plane carries
    # one small message per step, whose latency does not matter.
    # CPU channel only: the GPU ones (cuda_ipc, cuda_gdr, cuda_xth) fail at start-up on some clusters (PyTorch
    # #95487, #130513; tensorpipe #412), and no CUDA tensor travels here (the workers answer with CPU values).
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout_s, num_worker_threads=16,
                                           _transports=["uv"], _channels=["basic"])


def quiet_torch_warnings() -> None:
    """Silence a deprecation warning gloo process groups trigger inside torch itself."""
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)


def _local_worker_main(rank: int, world_size: int, init_method: str, timeout_s: float, threads: int,
                       cores: tuple[int, ...] | None = None) -> None:
    """A LocalCluster worker, once pipegpt.comm.lifeline has bound it to the driver (its process target), or to the
    preload server that forked it (pipegpt.comm.preload)."""
    if cores:  # first, so every thread this process starts (torch's, gloo's, RPC's) inherits the mask
        os.sched_setaffinity(0, cores)
    quiet_torch_warnings()
    torch.set_num_threads(threads)
    # torch's modules, imported by now, live as long as the process: frozen, no collection walks them again (not
    # during the import of torch._dynamo that torch.optim's first step makes, nor any full collection after).
    gc.freeze()
    rpc.init_rpc(f"worker{rank}", rank=rank + 1, world_size=world_size + 1,  # the driver is RPC rank 0
                 rpc_backend_options=_rpc_options(init_method, timeout_s))
    rpc.shutdown()  # serve requests until the driver shuts everyone down
    # The process ends here: its last collection need not walk what was made since (torch._dynamo's modules among
    # it, none of it garbage) while the driver's close() waits for this process to end.
    gc.freeze()


def _ping() -> int:
    return os.getpid()


_actor: Any = None  # this worker process's actor (Cluster.spawn)


def _make_actor(cls: type, args: tuple) -> None:
    global _actor
    _actor = cls(*args)


def _invoke(method: str, args: tuple) -> Any:
    return getattr(_actor, method)(*args)


class ActorHandle:
    """A worker's actor, called by name through _invoke: `handle.rpc_async(timeout).method(*args)` is a future of
    its answer. An RRef would do the same, but pickling one into every call costs both ends a fork's bookkeeping,
    a third of a call's round trip on a small job (benchmarks/README.md, bench_host.py)."""

    def __init__(self, worker: str):
        self.worker = worker

    def rpc_async(self, timeout: float = 0) -> "_Calls":
        return _Calls(self.worker, timeout)


class _Calls:
    def __init__(self, worker: str, timeout: float):
        self.worker, self.timeout = worker, timeout

    def __getattr__(self, method: str) -> Callable[..., Any]:
        return lambda *args: rpc.rpc_async(self.worker, _invoke, args=(method, args), timeout=self.timeout)


def _last_line(error: BaseException) -> str:
    """The remote exception's own message and where it was raised, from the text RPC wraps it in."""
    text = str(error).split("\nAt:\n")[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(error).__name__
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)
    where = f" (in {frames[-1][2]}, {os.path.basename(frames[-1][0])}:{frames[-1][1]})" if frames else ""
    return lines[-1] + where


def _answer(fut) -> Any:
    """A settled RPC's value; None while it is pending or where it failed (its peer gone)."""
    try:
        return fut.wait() if fut.done() else None
    except Exception:  # noqa: BLE001 - a call that cannot complete is no answer
        return None


@dataclass
class Failed:
    """What an actor method returns instead of raising (RPC would print the remote traceback)."""

    cause: str


class ActorThread:
    """The one thread on which a worker runs its actor methods, one at a time in arrival order.

    The RPC agent runs each request on whichever of its pool threads is free, a different one from step to
    step, and per-thread native state (the math libraries' scratch buffers, malloc's per-thread arenas) is
    allocated anew on every thread that computes: one thread keeps a worker's memory from growing with each
    new one. Daemon: a rank stuck in an action must not keep its process alive once the job is being torn down."""

    def __init__(self, name: str = "pipegpt-actor"):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            future, fn = self._inbox.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
                    future.set_exception(e)

    def run(self, fn: Callable[[], Any]) -> Any:
        """fn() on the actor thread, waited for here; called from the actor thread itself, fn runs inline
        (an actor method that calls another would otherwise wait for itself)."""
        if threading.current_thread() is self._thread:
            return fn()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((future, fn))
        return future.result()


_actor_thread: ActorThread | None = None
_actor_thread_lock = threading.Lock()


def on_actor_thread(fn: Callable[[], Any]) -> Any:
    """fn() on this process's ActorThread (started on first use)."""
    global _actor_thread
    with _actor_thread_lock:
        if _actor_thread is None:
            _actor_thread = ActorThread()
    return _actor_thread.run(fn)


def reports_failures(method):
    """Decorate actor methods: an exception becomes a Failed naming its type, message and place."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every failure must reach the driver
            frame = traceback.extract_tb(e.__traceback__)[-1]
            return Failed(f"{type(e).__name__}: {e} (in {frame.name}, {os.path.basename(frame.filename)}:{frame.lineno})")

    return wrapper


class Cluster:
    """Actors, one per rank, and a way to call them all and notice failures quickly."""

    world_size: int
    timeout_s: float

    def spawn(self, cls: type, args_for_rank: Callable[[int], tuple]) -> None:
        """Make each rank's actor, cls(*args_for_rank(rank)), in its worker process; returns once all exist."""
        made = {r: rpc.rpc_async(f"worker{r}", _make_actor, args=(cls, args_for_rank(r)), timeout=0)
                for r in range(self.world_size)}
        self._wait("spawn", made, self.timeout_s)
        self.actors = [ActorHandle(f"worker{r}") for r in range(self.world_size)]

    def call(self, method: str, *args, ranks=None, timeout_s: float | None = None, stall_after_s: float | None = None,
             on_stall: Callable[[float], None] | None = None, limit_flag: str = "--timeout") -> list[Any]:
        """Call method on every actor (or the given ranks) and wait for all, failing fast. limit_flag: the option
        that sets timeout_s, named when a call runs past it.

        stall_after_s, on_stall: once the call has waited that long, on_stall(seconds waited) runs here;
        it may raise (a WorkerFailure); if it returns, the call waits on and asks again as long later."""
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        # No timeout in RPC itself (0): _wait's window bounds the wait, leaving out any pause of this process,
        # which RPC's own timer would count against the workers.
        futures = {r: getattr(self.actors[r].rpc_async(timeout=0), method)(*args) for r in ranks}
        return self._wait(method, futures, timeout_s or self.timeout_s, stall_after_s, on_stall, limit_flag)

    def _wait(self, method: str, futures: dict[int, Any], timeout: float, stall_after_s: float | None = None,
              on_stall: Callable[[float], None] | None = None, limit_flag: str = "--timeout") -> list[Any]:
        """call()'s wait for the answers of `method`, one future per rank."""
        ranks = list(futures)
        settled = threading.Event()  # wakes the loop as soon as any answer arrives
        for fut in futures.values():
            fut.add_done_callback(lambda _: settled.set())
        window = WaitWindow(timeout, stall_after_s if on_stall else None, ranks)
        next_heartbeat = window.now + HEARTBEAT_EVERY_S
        pings: dict[int, Any] = {}
        while True:
            settled.clear()
            paused = window.poll()
            if paused is not None:  # the driver itself was stopped: no worker is late for it
                print(pause_line(paused), file=sys.stderr, flush=True)
            self.check_alive()
            for r, fut in futures.items():
                if fut.done():
                    try:
                        value = fut.wait()
                    except Exception as e:
                        # A dead worker's connection can close before its exit code is visible:
                        # give the process check a moment, so the cause named is the real one.
                        for _ in range(10):
                            time.sleep(POLL_S)
                            self.check_alive()
                        raise WorkerFailure(r, _last_line(e)) from None
                    if isinstance(value, Failed):
                        raise self._cause(r, value.cause, futures)
            if all(f.done() for f in futures.values()):
                return [futures[r].wait() for r in ranks]
            if window.timed_out():
                late = [r for r, f in futures.items() if not f.done()]
                raise WorkerFailure(late[0], f"no answer to {method}() within {timeout:.0f}s (ranks {late} pending; "
                                             f"{limit_flag} sets the limit)")
            if window.stall_due():
                on_stall(window.waited())
                window.stall_checked()
            if window.now > next_heartbeat:
                # A rank that stops answering pings is stuck (or stopped), not merely busy:
                # the RPC agent answers from its own threads while compute runs.
                for r in ranks:
                    if r in pings and not pings[r].done():
                        if window.silent_for(r) > HEARTBEAT_TIMEOUT_S:
                            raise WorkerFailure(r, f"stopped answering (no heartbeat for {window.silent_for(r):.0f}s)")
                        continue
                    if r in pings:
                        window.heard_from(r)
                    pings[r] = rpc.rpc_async(f"worker{r}", _ping, timeout=0)
                next_heartbeat = window.now + HEARTBEAT_EVERY_S
            settled.wait(POLL_S)

    def _cause(self, rank: int, cause: str, futures: dict[int, Any]) -> WorkerFailure:
        """The failure to report when `rank` failed with `cause`. A failed collective or message is what the ranks
        left behind see when a peer vanished: then the evidence of every rank decides, for up to the heartbeat's
        limit: a rank whose process died (check_alive raises it), one that failed by itself, one that does not
        answer a ping; failing those, `rank`."""
        if not _SYMPTOM.search(cause):
            return WorkerFailure(rank, cause)
        pings = {r: rpc.rpc_async(f"worker{r}", _ping, timeout=0) for r in range(self.world_size) if r != rank}
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S
        while True:
            self.check_alive()
            own = [(r, value.cause) for r, value in ((r, _answer(f)) for r, f in futures.items() if r != rank)
                   if isinstance(value, Failed) and not _SYMPTOM.search(value.cause)]
            if own:
                return WorkerFailure(*own[0])
            if time.monotonic() > deadline or all(p.done() for p in pings.values()):
                break
            time.sleep(POLL_S)
        for _ in range(10):  # a ping refused by a dead process: its exit, where it can be seen, names it
            self.check_alive()
            time.sleep(POLL_S)
        silent = [r for r, p in pings.items() if not p.done() or _answer(p) is None]
        return WorkerFailure(silent[0], f"stopped answering; rank {rank} saw: {cause[:160]}") if silent else \
            WorkerFailure(rank, cause)

    def ask(self, method: str, *args, timeout_s: float) -> dict[int, Any]:
        """Call method on every actor and wait at most timeout_s: {rank: answer} of the ranks that answered
        in time (one that failed, raised or stayed silent is left out). For quick questions to a busy job."""
        futures = {r: getattr(self.actors[r].rpc_async(timeout=0), method)(*args)  # bounded below, as call()
                   for r in range(self.world_size)}
        window = WaitWindow(timeout_s)
        while not all(f.done() for f in futures.values()) and not window.timed_out():
            time.sleep(POLL_S / 5)
            paused = window.poll()
            if paused is not None:
                print(pause_line(paused), file=sys.stderr, flush=True)
        answers = {}
        for r, fut in futures.items():
            if fut.done():
                try:
                    value = fut.wait()
                except Exception:  # noqa: BLE001 - a rank that cannot answer is reported as silent
                    continue
                if not isinstance(value, Failed):
                    answers[r] = value
        return answers

    def check_alive(self) -> None:
        pass

    def close(self) -> None:
        raise NotImplementedError


class ClusterJob:
    """A driver's hold on its workers (train.driver.Job, infer.job.InferenceJob). `with` kills them when the block
    raises and shuts them down in order otherwise; close() may be called before that, once or more."""

    cluster: Cluster | None = None

    def close(self) -> None:
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.call("shutdown")
            cluster.close()

    def kill(self) -> None:
        if self.cluster is not None:
            self.cluster.kill()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb) -> None:
        if kind is not None:
            self.kill()
        else:
            self.close()


class LocalCluster(Cluster):
    """One worker process per rank on this machine; this process is the driver.

    The driver binds every rendezvous port itself before a worker starts: the control plane's (it is
    RPC rank 0) and the process groups' store (`group_init_method`, port 0 unless group_port is given).
    A port chosen here but bound seconds later by a starting worker could be taken in between by
    another job, and two rendezvous on one port garble each other.
    """

    def __init__(self, world_size: int, timeout_s: float, threads_per_worker: int, group_port: int | None = None,
                 cores: list[tuple[int, ...]] | None = None, preloaded: bool = True):
        """preloaded: fork the workers from this process's preload server (pipegpt.comm.preload), where it can;
        otherwise, and where it refuses, each is spawned (start_method says which, and why)."""
        self.world_size, self.timeout_s = world_size, timeout_s
        preload.apply_local_env()
        self.store = dist.TCPStore("127.0.0.1", group_port or 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.group_init_method = f"tcp://127.0.0.1:{self.store.port}"
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._closing = False
        joined = threading.Event()
        error: list[BaseException] = []

        def join_rpc():
            try:
                rpc.init_rpc("driver", rank=0, world_size=world_size + 1,
                             rpc_backend_options=_rpc_options(init_method, timeout_s))
            except BaseException as e:  # noqa: BLE001 - reported below
                error.append(e)
            joined.set()

        threading.Thread(target=join_rpc, daemon=True).start()  # binds the control plane's port at once
        args = [(r, world_size, init_method, timeout_s, threads_per_worker, cores[r] if cores else None)
                for r in range(world_size)]
        self.procs = self._start_workers(args, timeout_s, preloaded)
        window = WaitWindow(timeout_s)
        while not joined.wait(POLL_S):  # a worker that dies while starting must not leave us waiting
            self.check_alive()
            window.poll()  # a pause of this process is not the workers' time
            if window.timed_out():
                self.kill()
                raise WorkerFailure(0, f"workers did not start within {timeout_s:.0f}s")
        if error:
            self.kill()
            raise WorkerFailure(0, f"could not start the control plane: {_last_line(error[0])}")

    def _start_workers(self, args: list[tuple], timeout_s: float, preloaded: bool) -> list:
        target, names = f"{__name__}:_local_worker_main", [f"pipegpt-rank{r}" for r in range(len(args))]
        asked = not preloaded or preload.spawn_asked()
        server = None if asked else preload.server()
        why = "not preloaded: asked so" if asked else "not preloaded: this platform cannot fork workers"
        if server is not None:
            workers = server.fork(target, args, names, timeout_s)
            if not isinstance(workers, str):
                self.start_method = "forked from the preload server"
                return workers
            why = workers
        self.start_method = f"spawned ({why})"
        ctx = mp.get_context("spawn")
        # The target is lifeline's, a torch-free module: the new process is tied to this one before it
        # spends seconds importing torch, so a driver killed at any moment takes its workers with it.
        procs = [ctx.Process(target=run_worker, daemon=False, name=name, args=(os.getpid(), target, *a))
                 for name, a in zip(names, args)]
        for p in procs:
            p.start()
        return procs

    def check_alive(self) -> None:
        if self._closing:
            return
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None:
                code = p.exitcode
                cause = (f"killed by signal {signal.Signals(-code).name}" if code < 0
                         else f"process exited with code {code}")
                self.kill()
                raise WorkerFailure(rank, cause, exit_code=code)

    def kill(self) -> None:
        """Bring every worker down now (they may be blocked in communication)."""
        self._closing = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        self._closing = True
        try:
            rpc.shutdown(graceful=True, timeout=min(self.timeout_s, 30))
        finally:
            for p in self.procs:
                p.join(timeout=10)
            self.kill()


ATTEMPT_SCHEME = "pipegpt-attempt"


def attempt_prefix(env: Mapping[str, str] = os.environ) -> str:
    """The store keys of this torchrun attempt. torchrun's agent serves one store for the job's whole life and
    starts every restart's processes on it: keys left by an attempt whose processes are gone (their addresses)
    would be read by the next attempt's ranks, which then connect to nothing. The restart count tells attempts
    apart; the world size, a new round of an elastic job whose agents keep their count."""
    return (f"pipegpt/{env.get('TORCHELASTIC_RUN_ID', '')}/restart-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            f"/world-{env['WORLD_SIZE']}/")


def _attempt_rendezvous(url: str, timeout: timedelta | None = None, **_):
    """The rendezvous behind ATTEMPT_SCHEME: torchrun's store (env://, as torch would join it), under
    attempt_prefix. RPC passes no timeout: the one in the URL bounds the wait for the store."""
    query = dict(parse_qsl(urlparse(url).query))
    rank, world_size = int(query["rank"]), int(query["world_size"])
    timeout = timeout or timedelta(seconds=float(query["timeout_s"]))
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    yield dist.PrefixStore(attempt_prefix(), store), rank, world_size


def attempt_init_method(timeout_s: float) -> str:
    """Under torchrun, the init_method of RPC and of the process groups: this attempt's keys of torchrun's store."""
    try:
        dist.register_rendezvous_handler(ATTEMPT_SCHEME, _attempt_rendezvous)
    except RuntimeError:  # registered by an earlier cluster in this process
        pass
    return f"{ATTEMPT_SCHEME}://?timeout_s={timeout_s}"


def _finish_within(timeout_s: float, fn: Callable[[], None]) -> BaseException | None:
    """fn() on a thread of its own, waited for at most timeout_s: its exception (None once it returned), or a
    TimeoutError. Past the limit the thread is left behind: the process that cannot go on exits."""
    done, error = threading.Event(), []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            error.append(e)
        done.set()

    threading.Thread(target=run, name="pipegpt-join", daemon=True).start()
    if not done.wait(timeout_s):
        return TimeoutError()
    return error[0] if error else None


class TorchrunCluster(Cluster):
    """Under torchrun: every process is a worker; rank 0 also runs the driver."""

    def __init__(self, timeout_s: float):
        self.world_size, self.timeout_s = int(os.environ["WORLD_SIZE"]), timeout_s
        self.rank = int(os.environ["RANK"])
        bind_to_master_interface()  # before the agent and the process groups pick an address
        gc.freeze()  # as a local worker does (_local_worker_main): torch's modules live as long as the process
        # torchrun's agent serves the store at MASTER_PORT and makes every rank its client
        # (TORCHELASTIC_USE_AGENT_STORE): RPC and the process groups rendezvous there, on this attempt's keys.
        self.init_method = attempt_init_method(timeout_s)
        # Bounded here: init_rpc's own gloo group waits on its peers for weeks (DEFAULT_PROCESS_GROUP_TIMEOUT).
        error = _finish_within(timeout_s, lambda: rpc.init_rpc(
            f"worker{self.rank}", rank=self.rank, world_size=self.world_size,
            rpc_backend_options=_rpc_options(self.init_method, timeout_s)))
        if error is not None:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            why = f"within {timeout_s:.0f}s" if isinstance(error, TimeoutError) else f"({_last_line(error)})"
            raise WorkerFailure(self.rank, f"could not join the job's {self.world_size} ranks {why}; "
                                           f"torchrun restart {restart}")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        rpc.shutdown(graceful=True)
        gc.freeze()  # the process ends soon: its last collection need not walk what it made (_local_worker_main)

    def kill(self) -> None:
        rpc.shutdown(graceful=False)
