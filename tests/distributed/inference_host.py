"""Host an InferenceJob (pipegpt.infer.job) in a child process, so one pytest process can use several layouts
(torch.distributed.rpc is initialised once per process). The workers stay up between commands, and a command for
another checkpoint loads it first (another model on the same grid)."""
from __future__ import annotations

from cluster_host import ChildHost, serve


def _serve(conn, path, layout, timeout_s, runtime) -> None:
    from pipegpt.infer.job import InferenceJob

    def make():
        job = InferenceJob(path, layout, device="cpu", timeout_s=timeout_s, warn=lambda line: None)
        job.cfg = job.cfg.replace(**runtime)  # the engines' settings, for this checkpoint (a load makes them anew)
        return job

    serve(conn, make, COMMANDS)


def _use(job, path) -> None:
    from pipegpt.state import checkpoint

    if job.found != checkpoint.resolve(path):
        job.load(path)


def _generate(job, path, prompts, settings, batch):
    _use(job, path)
    return job.generate(prompts, settings, batch)[0]


def _hellaswag(job, path, examples, rendered):
    """(correct, correct_norm) and every example's per-candidate [sum, count] as the workers reported them."""
    _use(job, path)
    return job.hellaswag(examples, rendered), job.scores(rendered)


COMMANDS = {"generate": _generate, "hellaswag": _hellaswag}


class InferenceHost(ChildHost):
    def __init__(self, path, layout, timeout_s: float = 60.0, runtime: dict | None = None):
        super().__init__(_serve, str(path), layout, timeout_s, runtime or {})

    def generate(self, path, prompts, settings, batch=None) -> list[list[int]]:
        self.conn.send(("generate", (str(path), prompts, settings, batch)))
        return self._answer(300)

    def hellaswag(self, path, examples, rendered):
        self.conn.send(("hellaswag", (str(path), examples, rendered)))
        return self._answer(300)
