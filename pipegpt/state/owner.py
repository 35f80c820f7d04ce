"""Who owns a run: one driver process per run directory, known by an identity that outlives execve.

The driver locks the run directory itself (flock, advisory) before it writes anything there and holds the lock
until it ends; the kernel drops it when the process dies, however it dies. The directory, not a file in it:
a refused run leaves nothing behind, and --overwrite's move aside cannot carry the lock away. A restart
(pipegpt.train.restart) replaces the process with os.execve: the locked descriptor is kept open across it (its
number in PIPEGPT_RUN_DIR_LOCK), so the directory is never free in between.

A process's identity, (pid, start time in clock ticks since boot), is unchanged by execve and never shared by
two live processes: what a restarted driver recognises as its own (restart.json, snapshots).

Torch-free.
"""
from __future__ import annotations

import errno
import fcntl
import os

LOCK_FD_ENV = "PIPEGPT_RUN_DIR_LOCK"

_held: dict[str, int] = {}  # run directory (real path) -> the locked descriptor


class RunDirBusy(Exception):
    """Another live process holds the run directory's lock; pid: which, where it can be told (else None)."""

    def __init__(self, pid: int | None):
        super().__init__(pid)
        self.pid = pid


def process_identity(pid: int | None = None) -> list:
    """[pid, start time in clock ticks since boot] (start None where /proc cannot tell)."""
    pid = os.getpid() if pid is None else pid
    return [pid, _stat(pid)[1]]


def is_alive(identity) -> bool:
    """Whether the process `identity` names still runs: not a zombie, not another process under a reused pid."""
    pid, start = identity
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    state, now = _stat(pid)
    return state != "Z" and (start is None or now is None or now == start)


def _stat(pid: int) -> tuple[str | None, int | None]:
    """(state letter, start time) from /proc/<pid>/stat; (None, None) where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None, None


def lock_run_dir(run_dir) -> str | None:
    """Hold run_dir's lock from now until this process ends (or release()); RunDirBusy where another process
    holds it. Returns None once held, else why the directory cannot be locked (a file system without locks,
    a directory that cannot be opened): the run then goes on unguarded."""
    key = os.path.realpath(run_dir)
    if key in _held:
        return None
    fd = _inherited(key)
    if fd is None:
        try:
            fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            return e.strerror or str(e)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunDirBusy(lock_holder(key)) from None
            return e.strerror or str(e)
    _held[key] = fd
    return None


def _inherited(key: str) -> int | None:
    """The descriptor of key's lock that this process held before it replaced itself (a restart), if any."""
    value = os.environ.pop(LOCK_FD_ENV, None)  # popped: the workers this process starts must not see it
    if value is None:
        return None
    try:
        fd = int(value)
        held, here = os.fstat(fd), os.stat(key)
    except (ValueError, OSError):
        return None
    if (held.st_dev, held.st_ino) != (here.st_dev, here.st_ino):
        return None
    os.set_inheritable(fd, False)
    return fd


def keep_across_exec(env: dict) -> None:
    """Before os.execve(..., env): the run directory locks this process holds stay held by the new image."""
    for fd in _held.values():
        os.set_inheritable(fd, True)
        env[LOCK_FD_ENV] = str(fd)  # a driver holds one run directory


def release(run_dir) -> None:
    """Give run_dir's lock up (a run that ends inside a process that goes on: tests, a caller of launch)."""
    fd = _held.pop(os.path.realpath(run_dir), None)
    if fd is not None:
        os.close(fd)  # the only descriptor of its open file description: the lock goes with it


def lock_holder(path) -> int | None:
    """The pid holding an flock on `path`, from Linux's /proc/locks; None where it cannot be told."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 6776 fe:00:2203693 0 EOF" (a waiter's has "->" after "1:")
        fields = line.split()
        if "FLOCK" not in fields or "->" in fields:
            continue
        i = fields.index("FLOCK")
        if len(fields) > i + 4 and fields[i + 4] == where and fields[i + 3].lstrip("-").isdigit():
            pid = int(fields[i + 3])
            return pid if pid > 0 else None
    return None
