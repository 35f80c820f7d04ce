"""Host a LocalCluster's driver in a child process, so one pytest process can use several clusters.

torch.distributed.rpc can be initialised once per process; the oracle tests need
clusters of 2 and 4 ranks. The child runs commands sent over a pipe.
"""
from __future__ import annotations

import multiprocessing as mp


def _one_process_name(name: str, cfg) -> str:
    # The last stage's copy of a tied embedding is the one-process wte.weight.
    return "wte.weight" if name == "lm_head.weight" and cfg.model.tie_embeddings else name


def serve(conn, make_job, commands: dict) -> None:
    """In the child: make and start the job, then run the commands the pipe brings until "stop"."""
    job = None
    try:
        job = make_job()
        job.start()
        conn.send(("ok", None))
        while True:
            command, args = conn.recv()
            if command == "stop":
                break
            try:
                conn.send(("ok", commands[command](job, *args)))
            except Exception as e:  # report, keep serving the next case
                conn.send(("error", f"{type(e).__name__}: {e}"))
        job.close()
    except BaseException as e:
        if job is not None:
            job.kill()
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _serve(conn, cfg) -> None:
    from pipegpt.train.driver import Job

    serve(conn, lambda: Job(cfg, threads_per_worker=1), COMMANDS)


def _one_process_tensors(per_rank: list[dict], cfg) -> list[tuple[str, object]]:
    """(one-process name, full tensor) per pipeline copy: tensor-parallel shards gathered to full shape.

    Data-parallel replicas (and context-parallel ranks) must hold identical values: replica 0's are returned, the
    others checked.
    """
    import torch

    from pipegpt.tensor_parallel import gather_full

    from pipegpt.parallelisms import expert_param

    layout, dims = cfg.parallel, cfg.parallel.dims
    shards: dict[tuple[str, int], dict[int, object]] = {}
    replicas: dict[tuple[str, int, int], object] = {}
    experts: dict[tuple[str, int], dict[int, object]] = {}  # with ep: each ep rank's slice, from edp index 0
    for rank, tensors in enumerate(per_rank):
        at = dims.coords(rank)
        d, p, t = at.dp, at.pp, at.tp
        for name, value in tensors.items():
            key = (_one_process_name(name, cfg), p)
            if layout.ep > 1 and expert_param(name):
                if dims.index(rank, "edp") == 0:
                    experts.setdefault(key, {})[dims.index(rank, "ep")] = value
                else:
                    replicas[(*key, -1 - dims.index(rank, "ep"))] = value
            elif d == 0 and at.cp == 0:  # context-parallel ranks hold the same weights, as replicas do
                shards.setdefault(key, {})[t] = value
            else:
                replicas[(*key, t)] = value
    for key, slices in experts.items():
        shards[key] = dict.fromkeys(range(layout.tp), torch.cat([slices[e] for e in range(layout.ep)]))  # whole
    for (name, p, t), value in replicas.items():
        held = experts[(name, p)][-1 - t] if t < 0 else shards[(name, p)][t]
        assert torch.equal(value, held), f"data-parallel replicas differ in {name}"
    kv = cfg.model.kv_heads  # Llama's k and v: split by kv head
    return [(name, gather_full(name, [parts[t] for t in range(layout.tp)], kv) if layout.tp > 1 else parts[0])
            for (name, _), parts in shards.items()]


def _run(job, cfg, steps: int):
    """Loss and grads of step 0, and parameters after `steps` steps, by one-process name."""
    job.build(cfg)
    results = job.step(0)
    losses = [loss for r in results for loss in r.losses]
    # tensor-parallel ranks of the last stage report the same losses: the mean is unchanged
    grads = _one_process_tensors(job.call("named_grads"), cfg)
    for step in range(1, steps):
        job.step(step)
    params = _one_process_tensors(job.call("named_parameters"), cfg)
    return sum(losses) / len(losses), grads, params


def _gathered(per_rank: list[dict], cfg) -> dict[str, object]:
    """{"<kind>/<one-process name>": full tensor} from every rank's {"<kind>/<name>": shard}; a key held
    by several data-parallel replicas (or by only one, with ZeRO-1) counts once."""
    from pipegpt.tensor_parallel import gather_full

    import torch

    from pipegpt.parallelisms import expert_param

    layout, dims = cfg.parallel, cfg.parallel.dims
    shards: dict[str, dict[int, object]] = {}
    experts: dict[str, dict[int, object]] = {}  # with ep: each ep rank's slice of the stacked experts
    for rank, tensors in enumerate(per_rank):
        t = dims.coords(rank).tp
        for key, value in tensors.items():
            if layout.ep > 1 and expert_param(key):
                experts.setdefault(key, {})[dims.index(rank, "ep")] = value
            else:
                shards.setdefault(key, {})[t] = value
    out = {key: torch.cat([slices[e] for e in range(layout.ep)]) for key, slices in experts.items()}
    for key, parts in shards.items():
        kind, name = key.split("/", 1)
        out[key] = (gather_full(name, [parts[t] for t in range(layout.tp)], cfg.model.kv_heads) if layout.tp > 1
                    else parts[0])
    return out


def _resume(job, cfg, path: str):
    """Load a checkpoint into this grid: every parameter and optimizer moment by one-process name, then
    the loss of the step after it."""
    job.build(cfg)
    step = job.call("load", path, False)[0]
    params = _gathered([{f"param/{_one_process_name(n, cfg)}": v for n, v in r.items()}
                        for r in job.call("named_parameters")], cfg)
    moments = _gathered(job.call("named_optimizer_state"), cfg)
    losses = [loss for r in job.step(step) for loss in r.losses]
    return params, moments, sum(losses) / len(losses)


def _save(job, cfg, root: str, steps: int):
    """Train cfg's freshly built model `steps` steps, save a checkpoint after them under root, then take one more
    step: (the checkpoint's path, that step's loss)."""
    from pathlib import Path

    job.build(cfg)
    for step in range(steps):
        job.step(step)
    path = job.save(Path(root), steps)
    losses = [loss for r in job.step(steps) for loss in r.losses]
    return str(path), sum(losses) / len(losses)


def _evaluate(job, cfg):
    """The validation loss of cfg's freshly built model."""
    job.build(cfg)
    return job.evaluate()


def _hellaswag(job, cfg, path: str):
    """HellaSwag's (acc, acc_norm) of cfg's model holding a checkpoint's weights, as the training loop scores it."""
    job.build(cfg)
    job.call("load", path, True)
    return job.hellaswag()


def _build(job, cfg):
    """Every worker's describe() after building for cfg."""
    return job.build(cfg)


def _described(job, cfg, steps: int):
    """Every worker's describe() after building for cfg and taking `steps` steps."""
    job.build(cfg)
    for step in range(steps):
        job.step(step)
    return job.call("describe")


def _buffers(job, cfg):
    """The MoE router biases now (after the last run), by one-process name."""
    return _one_process_tensors(job.call("named_buffers"), cfg)


COMMANDS = {"buffers": _buffers, "run": _run, "resume": _resume, "save": _save, "evaluate": _evaluate, "build": _build,
            "hellaswag": _hellaswag, "described": _described}


class ChildHost:
    """A child process serving a job (`target(conn, *args)`, which calls serve()), and the pipe to it."""

    def __init__(self, target, *args):
        self.conn, child = mp.get_context("spawn").Pipe()
        # Not a daemon: it starts the worker processes itself.
        self.proc = mp.get_context("spawn").Process(target=target, args=(child, *args))
        self.proc.start()
        self._answer(180)

    def _answer(self, timeout: float):
        waited = 0.0
        while not self.conn.poll(1.0):
            waited += 1.0
            if not self.proc.is_alive() or waited > timeout:
                self.proc.kill()
                raise RuntimeError(f"cluster host {'died' if waited <= timeout else 'did not answer'}")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        self.conn.send(("stop", None))
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


class ClusterHost(ChildHost):
    def __init__(self, cfg):
        """Workers for cfg's dp x pp x tp grid; later runs may change anything but the grid."""
        super().__init__(_serve, cfg)

    def run(self, cfg, steps: int):
        self.conn.send(("run", (cfg, steps)))
        return self._answer(300)

    def buffers(self, cfg):
        self.conn.send(("buffers", (cfg,)))
        return self._answer(300)

    def resume(self, cfg, path):
        """Load the checkpoint at path into this grid: (params, optimizer moments, next step's loss)."""
        self.conn.send(("resume", (cfg, str(path))))
        return self._answer(300)

    def save(self, cfg, root, steps: int):
        """Train `steps` steps, save under root, step once more: (the checkpoint's path, that step's loss)."""
        self.conn.send(("save", (cfg, str(root), steps)))
        return self._answer(300)

    def evaluate(self, cfg) -> float:
        self.conn.send(("evaluate", (cfg,)))
        return self._answer(300)

    def hellaswag(self, cfg, path) -> tuple[float, float]:
        self.conn.send(("hellaswag", (cfg, str(path))))
        return self._answer(300)

    def build(self, cfg) -> list[dict]:
        self.conn.send(("build", (cfg,)))
        return self._answer(300)

    def described(self, cfg, steps: int) -> list[dict]:
        self.conn.send(("described", (cfg, steps)))
        return self._answer(300)
