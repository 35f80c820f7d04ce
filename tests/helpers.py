"""What many test files share: the `pipegpt` executable, a clean environment for it, the one-line
error check and a one-thread context.

Plain names, imported as `from helpers import ...` (tests/ is on sys.path: pytest puts the folder of
tests/conftest.py there). Fixtures built on these live in tests/conftest.py. This module imports no
torch and no pipegpt at import time, so conftest stays cheap.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
PIPEGPT = str(Path(sys.executable).with_name("pipegpt"))  # the console script of this environment

# Set by torchrun (and its elastic agent) in the processes it starts: an inherited one would make
# `pipegpt run` believe it runs under torchrun.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_USE_AGENT_STORE")
SCRUBBED = TORCHRUN_VARS + ("PIPEGPT_FAULT",)  # ... and an inherited fault


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without torchrun's variables or PIPEGPT_FAULT, then `extra`: for a child."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env.update(extra)
    return env


def scrub_environ(monkeypatch) -> None:
    """clean_env for this process (a command run in-process by `invoke`), undone after the test.

    `pipegpt run` sets TORCH_CPP_LOG_LEVEL; setting it here first puts it back afterwards."""
    for var in SCRUBBED:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")


def run_pipegpt(*args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd=ROOT,
                **kwargs) -> subprocess.CompletedProcess:
    """`pipegpt ARGS` in a process of its own (clean_env() unless env is given); output captured as text.

    In a test session with a shared preload server (tests/conftest.py) the process is forked from that server,
    which has torch imported, as a local run's workers are: the console script would import it again, seconds of
    CPU for each of the suite's many runs. The command runs as the console script runs it (pipegpt.cli.main with
    sys.argv), in its own process with the given environment, directory and output. Where the server refuses (an
    environment that differs in what torch reads at import) or keyword arguments ask for more, the console
    script runs as before; PIPEGPT_TEST_FORK=0 asks for it always."""
    argv = [str(a) for a in args]
    env = clean_env() if env is None else env
    done = None if kwargs or os.environ.get("PIPEGPT_TEST_FORK") == "0" else _forked(argv, env, timeout, cwd)
    if done is not None:
        return done
    return subprocess.run([PIPEGPT, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def console(argv: list[str]) -> None:
    """The forked command's target: the console script's main, as it runs in a process of its own."""
    import multiprocessing

    multiprocessing.current_process().daemon = False  # a driver may start processes of its own
    sys.argv = [PIPEGPT, *argv]
    from pipegpt.cli import main

    main()


def _forked(argv: list[str], env: dict[str, str], timeout: float, cwd) -> subprocess.CompletedProcess | None:
    """run_pipegpt in a process forked from the session's preload server; None where there is none or it refused."""
    import threading
    import time

    from pipegpt.comm.preload import SHARED_ADDRESS, Preloader  # torch-free

    address = os.environ.get(SHARED_ADDRESS)
    if not address:
        return None
    preloader = Preloader.connect(address)
    if preloader is None:
        return None
    pipes = [os.pipe(), os.pipe()]
    try:
        forked = preloader.fork(f"{__name__}:console", [(argv,)], ["pipegpt"], 60, env=env, cwd=os.fspath(cwd),
                                streams={1: pipes[0][1], 2: pipes[1][1]})
    finally:
        for _, write in pipes:
            os.close(write)
    if isinstance(forked, str):  # refused: the console script instead
        preloader.close()
        for read, _ in pipes:
            os.close(read)
        return None
    chunks: list[list[bytes]] = [[], []]

    def drain(fd: int, into: list[bytes]) -> None:
        with os.fdopen(fd, "rb") as f:
            into.extend(iter(lambda: f.read(65536), b""))

    readers = [threading.Thread(target=drain, args=(read, into), daemon=True)
               for (read, _), into in zip(pipes, chunks)]
    for t in readers:
        t.start()
    command, (driver,) = [PIPEGPT, *argv], forked
    deadline = time.monotonic() + timeout
    driver.join(timeout)
    for t in readers:  # until every process holding the pipes is gone, as subprocess.run reads, within timeout
        t.join(max(0.0, deadline - time.monotonic()))
    timed_out = driver.exitcode is None or any(t.is_alive() for t in readers)
    if timed_out:
        driver.kill()
        driver.join(10)
    preloader.close()  # its server ends, and with it what the driver left
    out, err = (b"".join(c).decode(errors="replace").replace("\r\n", "\n") for c in chunks)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, out, err)
    return subprocess.CompletedProcess(command, driver.exitcode, out, err)


def invoke(*args):
    """`pipegpt ARGS` run in this process by click's CliRunner: a click.testing.Result (stdout and stderr apart)."""
    from click.testing import CliRunner

    from pipegpt.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, *fragments: str) -> str:
    """A refusal as the user sees it: exit status 2, exactly one line on stderr that starts with "Error: "
    and holds every fragment, and no traceback anywhere. `result` is a click Result or a
    subprocess.CompletedProcess. Returns the line."""
    code = result.returncode if isinstance(result, subprocess.CompletedProcess) else result.exit_code
    report = f"exit {code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert code == 2, report
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), report
    for fragment in fragments:
        assert str(fragment) in lines[0], (fragment, lines[0])
    assert "Traceback" not in result.stdout + result.stderr, report
    return lines[0]


@contextmanager
def one_thread():
    """torch on one intra-op thread inside, as the workers run: tiny matmuls only contend for threads
    (30x slower on a busy 2-core machine), and the thread count changes reduction order."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class NoWorkers:
    """Stands in for the clusters (the `no_workers` fixture): a refused configuration must never get this far."""

    started: list = []

    def __init__(self, *args, **kwargs):
        NoWorkers.started.append(args)
        raise AssertionError("a cluster was started for a configuration that should have been refused")


@contextmanager
def read_only(path):
    """The directory `path` made unwritable for this process inside: the immutable attribute as root (who
    ignores permission bits), mode 0555 otherwise. Skips the test where neither takes."""
    import pytest

    root = os.geteuid() == 0
    if root:
        made = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    else:
        os.chmod(path, 0o555)
        made = True
    try:
        probe = Path(path) / ".probe"
        try:
            probe.write_text("")
            probe.unlink()
            writable = True
        except OSError:
            writable = False
        if not made or writable:
            pytest.skip(f"cannot make {path} read-only here")
        yield path
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        else:
            os.chmod(path, 0o755)


@contextmanager
def lock_held_elsewhere(directory):
    """`directory` locked (flock on the directory itself) by a helper process, as a live `pipegpt run` holds its
    run directory; yields the helper's pid. The helper is killed on the way out, and the kernel frees the lock."""
    holder = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
              "print('held', flush=True)\ntime.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", holder, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def proc_cmdline(pid: int) -> str:
    """A process's command line from /proc ("?" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


TEXT = "the pipeline sends activations forward and gradients back. " * 20


def make_tokenizer_json(path) -> str:
    """A small byte-level BPE trained here (no download), with an end-of-text token (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path))
    return str(path)
