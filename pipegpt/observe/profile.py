"""py-spy flame graphs of a worker, taken by the worker itself (`pipegpt run --profile`).

Each worker starts py-spy on its own pid at the first traced step and stops it after the last one, so the
same code works for a local launch and under torchrun (where the driver knows no worker's pid). Two
`py-spy record --nonblocking` samplers run side by side, one per output format (py-spy writes one format per
run): a flame graph (`rank-N.svg`) and speedscope JSON (`rank-N.speedscope.json`). Non-blocking: py-spy reads
the worker's memory without pausing it, so the two samplers do not contend for ptrace and training is not
stopped for each sample. py-spy writes its file when it exits; SIGINT makes it finish.

py-spy is looked up beside the running interpreter first (a virtualenv's bin directory, where `pip install
py-spy` puts it, is not on PATH when pipegpt is run by its path), then on PATH. Where it is missing, or may
not attach (ptrace refused), start() returns the reason in one line and the caller goes on without a profile.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

FORMATS = (("flamegraph", "svg"), ("speedscope", "speedscope.json"))  # py-spy --format, file suffix
RATE_HZ = 100  # py-spy's default sampling rate
# py-spy leaves out threads that wait; a rank that mostly waited through short profiled steps may give it none.
NO_SAMPLES = ("py-spy took no sample of a running thread in the profiled steps (one every {interval_ms:g} ms): "
              "profile more or longer steps (--trace-steps)")


def output_paths(directory, rank: int) -> list[Path]:
    """Where rank's profiles go: DIRECTORY/rank-N.svg and DIRECTORY/rank-N.speedscope.json."""
    return [Path(directory) / f"rank-{rank}.{suffix}" for _, suffix in FORMATS]


def find_py_spy() -> str | None:
    """py-spy beside this interpreter (the same environment's), else on PATH; None if neither has it."""
    beside = shutil.which("py-spy", path=str(Path(sys.executable).parent)) if sys.executable else None
    return beside or shutil.which("py-spy")


def _allow_tracing_by_children() -> None:
    """Under Yama's ptrace_scope=1 (Ubuntu's default) only ancestors may read a process, and py-spy here
    is the worker's child: allow it (PR_SET_PTRACER_ANY, for this process's life). Root needs nothing."""
    try:
        if os.geteuid() == 0 or Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip() != "1":
            return
        import ctypes

        PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, -1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux, no Yama: py-spy says what it can't do
        pass


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """py-spy's output until it says 'Sampling process ...' (attached), exits (its error) or timeout_s passes."""
    fd, out, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout_s
    while b"Sampling" not in out:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if not select.select([fd], [], [], min(left, 0.1))[0]:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:  # end of output: py-spy exited
            break
        out += chunk
    return out.decode(errors="replace")


def _reason(text: str) -> str:
    """py-spy's error in one line: 'Error: X' and its first cause, else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    error = next((i for i, ln in enumerate(lines) if ln.startswith("Error:")), None)
    if error is None:
        return lines[-1].removeprefix("py-spy> ") if lines else "no output"
    cause = next((ln.split(":", 1)[1].strip() for ln in lines[error + 1:] if ln.startswith("0:")), None)
    return lines[error].removeprefix("Error:").strip() + (f" ({cause})" if cause else "")


class Profiler:
    """py-spy recording this process (or `pid`) into directory/rank-N.{svg,speedscope.json}."""

    def __init__(self, directory, rank: int, pid: int | None = None, rate_hz: int = RATE_HZ):
        self.directory, self.rank, self.pid, self.rate_hz = Path(directory), rank, pid or os.getpid(), rate_hz
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout_s: float = 20.0) -> str | None:
        """Start sampling; returns None once py-spy is attached, else one line saying why not."""
        exe = find_py_spy()
        if exe is None:
            return (f"py-spy is neither beside {sys.executable} nor on PATH (pip install py-spy into this "
                    f"environment)")
        self.directory.mkdir(parents=True, exist_ok=True)
        _allow_tracing_by_children()
        for (fmt, _), path in zip(FORMATS, output_paths(self.directory, self.rank)):
            path.unlink(missing_ok=True)  # an earlier run's (a resumed run goes on in its directory)
            try:
                self.procs.append(subprocess.Popen(
                    [exe, "record", "--pid", str(self.pid), "--format", fmt, "--output", str(path),
                     "--rate", str(self.rate_hz), "--nonblocking"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            except OSError as e:
                self.kill()
                return f"cannot start py-spy ({e.strerror or e})"
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            said = _first_line(proc, deadline - time.monotonic())
            if "Sampling" not in said:
                if proc.poll() is None:
                    said += f"\nnot attached after {timeout_s:.0f}s"
                self.kill()
                return f"py-spy cannot profile pid {self.pid}: {_reason(said)}"
        return None

    def stop(self, timeout_s: float = 60.0) -> tuple[list[str], str | None]:
        """SIGINT py-spy and wait for it to write its files: (the files written, None or why some were not)."""
        if not self.procs:  # never started, or start() said why not
            return [], None
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        problem, deadline = None, time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                out = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))[0] or b""
            except subprocess.TimeoutExpired:
                proc.kill()
                out = proc.communicate()[0] or b""
                problem = problem or f"py-spy did not finish writing within {timeout_s:.0f}s"
            if proc.returncode != 0 and problem is None:
                text = out.decode(errors="replace")
                problem = (NO_SAMPLES.format(interval_ms=1000 / self.rate_hz) if "No stack counts found" in text
                           else f"py-spy exited with status {proc.returncode}: {_reason(text)}")
        self.procs = []
        written = [str(p) for p in output_paths(self.directory, self.rank) if p.is_file() and p.stat().st_size]
        if problem is None and len(written) < len(FORMATS):
            problem = "py-spy wrote no profile (no samples?)"
        return written, problem

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        self.procs = []


def problem_line(problems: list[str | None], outcome: str) -> str | None:
    """One line for the ranks' problems (problems[rank]: None where all went well), or None if there were none."""
    failed = [r for r, p in enumerate(problems) if p]
    if not failed:
        return None
    who = "every rank" if len(failed) == len(problems) else "rank " + ", ".join(map(str, failed))
    return f"pipegpt: --profile: {problems[failed[0]]}; {outcome} ({who})"
