"""Inference's driver: workers started on this machine in a layout (dp x pp x tp; pipegpt.infer.settings), a
checkpoint's model loaded into them slice by slice, then HellaSwag scored or text generated there. Nothing of the
model comes to this process: the workers answer per-candidate loss sums (HellaSwag) or the tokens they chose
(generation).

    with InferenceJob(path, Layout(stages=2, tp=2)) as job:
        job.start()
        new_tokens, seconds = job.generate(prompts, settings, batch=16)
"""
from __future__ import annotations

import itertools
import sys
import time
from typing import Callable

from pipegpt.comm.rpc import ClusterJob, LocalCluster
from pipegpt.config import ConfigError
from pipegpt.data.hellaswag import combine_scores, count_correct
from pipegpt.engine.placement import default_threads, local_world_size, resolve_device
from pipegpt.infer.sampling import SamplingSettings
from pipegpt.infer.settings import InferenceSettings, Layout
from pipegpt.infer.worker import InferenceWorker
from pipegpt.observe.crowding import crowding
from pipegpt.schedule import lower, schedule_spec, validate
from pipegpt.schedule.generators import decode_plan
from pipegpt.state import checkpoint


class InferenceJob(ClusterJob):
    """Workers of a layout holding a checkpoint's model, from start to close."""

    def __init__(self, path, layout: Layout, device: str = "auto", timeout_s: float = 60.0,
                 microbatches: int | None = None, warn: Callable[[str], None] | None = None,
                 threads_per_worker: int | None = None):
        self.layout, self.timeout_s, self.microbatches, self.requested_device = layout, timeout_s, microbatches, device
        self.threads = threads_per_worker  # intra-op threads of each worker (default: this machine's cores / ranks)
        self._check(path)
        self.device = resolve_device(self.settings.device, self.settings.world_size)
        if self.device == "cuda":
            import torch

            have, local = torch.cuda.device_count(), local_world_size(self.settings.world_size)
            if have < local:
                raise ConfigError(f"device=cuda needs one GPU per rank ({local}), but {have} are visible: use "
                                  f"--device cpu or fewer ranks")
        warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        crowded = crowding(self.settings, self.device)
        if crowded:
            warn(crowded)
        self.cluster = None

    def _check(self, path) -> None:
        """Read and check a checkpoint (every file's checksum, its tensors' shapes) and its model against the
        layout: the settings, the engine's config and the evaluation plan of a build."""
        self.found = checkpoint.resolve(path)
        self.manifest = checkpoint.read_manifest(self.found)
        self.model = checkpoint.model_config(self.found, self.manifest)
        checkpoint.check_tensors(self.found, self.model)
        self.settings = InferenceSettings(self.model, self.layout, self.requested_device, self.timeout_s,
                                          self.microbatches).validate()
        self.cfg = self.settings.engine_config()  # what each rank's engine is built from
        # the evaluation plan: a step of the forward-only plan carries one HellaSwag example per microbatch
        stages, microbatches = self.layout.stages, self.settings.step_microbatches
        self.plan = validate(lower(schedule_spec("gpipe").build(stages, microbatches, None).forward_only()))

    def load(self, path) -> list[dict]:
        """Another checkpoint (any model the layout fits) into the started workers: stages rebuilt, slices loaded."""
        self._check(path)
        described = self.cluster.call("build", self.cfg, self.plan)
        self.cluster.call("load", str(self.found))
        return described

    def start(self) -> list[dict]:
        """Start one worker per rank, build each one's stages and load the checkpoint's slices into them."""
        import os
        import warnings

        # TensorPipe reports each connection a stopping job closes; failures reach us as WorkerFailure.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        warnings.filterwarnings("ignore", category=UserWarning)
        world = self.settings.world_size
        threads = self.threads or default_threads(world)
        self.cluster = LocalCluster(world, self.timeout_s, threads)
        self.cluster.spawn(InferenceWorker, lambda r: (r, self.cfg, self.cluster.group_init_method))
        described = self.cluster.call("start", self.plan)
        self.cluster.call("load", str(self.found))
        return described

    def hellaswag(self, examples: list, rendered: list) -> tuple[int, int]:
        """(correct by summed ending loss, correct by mean ending loss), scored on the workers."""
        return count_correct(examples, self.scores(rendered))

    def scores(self, rendered: list) -> dict[int, list[list[float]]]:
        """Every example's per-candidate [sum of its ending tokens' losses, their count], from the workers."""
        steps = -(-len(rendered) // (self.settings.step_microbatches * self.layout.dp))
        return combine_scores(self.cluster.call("hellaswag", rendered, timeout_s=self.timeout_s * (steps + 2)))

    def generate(self, prompts: list[list[int]], settings: SamplingSettings,
                 batch: int | None = None) -> tuple[list[list[int]], float]:
        """Each prompt's new tokens, `batch` prompts at a time (default all), and the seconds the workers took.
        A batch's prompts go round-robin to the replicas; a replica's are cut into at most `stages` groups."""
        new: list[list[int]] = [[] for _ in prompts]
        if settings.max_new_tokens == 0 or not prompts:
            return new, 0.0
        batch = batch or len(prompts)
        S, dp, seconds = self.layout.stages, self.layout.dp, 0.0
        for start in range(0, len(prompts), batch):
            indices = range(start, min(start + batch, len(prompts)))
            by_replica = [[(i, prompts[i]) for i in indices if (i - start) % dp == d] for d in range(dp)]
            if self.layout.ep > 1:
                by_replica = _even(by_replica, len(prompts))
            plans = [decode_plan(S, min(S, len(mine)), settings.max_new_tokens) if mine else None
                     for mine in by_replica]
            t0 = time.perf_counter()
            answers = self.cluster.call("generate", plans, by_replica, settings,
                                        timeout_s=self.timeout_s * (settings.max_new_tokens + 2))
            seconds += time.perf_counter() - t0
            for answer in answers:
                for i, tokens in (answer or {}).items():
                    if i < len(prompts):  # not a stand-in (_even)
                        new[i] = tokens
        return new, seconds


def _even(by_replica: list[list], first_index: int) -> list[list]:
    """With experts over ep, every replica's MoE layers exchange tokens with the other replicas' at each forward,
    so every replica runs the same decode plan: those with fewer prompts get stand-ins (one token, indices from
    first_index on, their tokens dropped), and all as many groups."""
    most, spare = max(map(len, by_replica)), itertools.count(first_index)
    return [mine + [(next(spare), [0]) for _ in range(most - len(mine))] for mine in by_replica]
