"""The inference role on one rank: the rank's engine (device, mesh, model stages, point-to-point, the forward-only
runtime) holding a checkpoint's slice, scoring HellaSwag with the evaluation plan and generating with a decode plan.
No optimizer, no loader: the driver (pipegpt.infer.job) ships the plans and the tokens; only numbers and chosen
tokens come back.
"""
from __future__ import annotations

import torch

from pipegpt.config import TrainConfig
from pipegpt.data.hellaswag import score_on_engine
from pipegpt.engine.actor import Role, actor_method
from pipegpt.engine.placement import name_process
from pipegpt.infer.generation import PipelineLink, decode, make_groups
from pipegpt.infer.sampling import SamplingSettings
from pipegpt.schedule import Plan
from pipegpt.schedule.generators import DECODE_GROUPS
from pipegpt.state.checkpoint import CheckpointReader


class InferenceWorker(Role):
    @actor_method
    def start(self, plan: Plan) -> dict:
        """Take this rank's device, join the process groups, build this rank's stages for the forward-only plan."""
        self.engine.start(self.cfg)
        return self._build(self.cfg, plan)

    @actor_method
    def build(self, cfg: TrainConfig, plan: Plan) -> dict:
        """Stages for another model (or plan) on the same grid."""
        return self._build(cfg, plan)

    def _build(self, cfg: TrainConfig, plan: Plan) -> dict:
        self.cfg, engine = cfg, self.engine
        engine.build(cfg, plan, plan)
        engine.eval_mode(True)
        for _, p in engine.named_params:
            p.requires_grad_(False)
        name_process(f"pipegpt: inference rank {self.rank} stage {','.join(map(str, sorted(engine.stages)))}")
        return engine.describe()

    @actor_method
    def load(self, path: str) -> None:
        """This rank's parameters from a checkpoint written under any layout (its checksums checked by the driver)."""
        engine = self.engine
        reader = CheckpointReader(path, verify=False)
        tp_rank, tp = engine.mesh.tp_index, self.cfg.parallel.tp
        layout, ep_rank = engine.parallelism, getattr(engine.mesh, "ep_index", 0)
        with torch.no_grad():
            for _, p in engine.named_params:
                name = engine.full_names[id(p)]
                value = reader.shard(f"param/{name}", name, tp_rank, tp)
                experts = layout.expert_slice(name, self.cfg.model.n_experts, ep_rank)  # with ep: this rank's
                p.copy_(value if experts is None else value[experts])
            # a mixture of experts' router biases: state, not parameters, and they choose the experts
            for _, stage in sorted(engine.stages.items()):
                for name, bias in stage.module.state_dict(keep_vars=True).items():
                    if name.endswith("expert_bias") and reader.has(f"param/{name}"):
                        bias.copy_(reader.full(f"param/{name}", name))

    @actor_method
    def hellaswag(self, rendered: list) -> list | None:
        """This rank's part of HellaSwag (pipegpt.data.hellaswag.score_on_engine): the last stage's per-candidate
        loss sums."""
        return score_on_engine(self.engine, rendered)

    @actor_method
    def generate(self, plans: list[Plan | None], prompts: list[list[tuple[int, list[int]]]],
                 settings: SamplingSettings) -> dict[int, list[int]] | None:
        """This replica's prompts (prompts[dp index]) through its decode plan: on the last stage's rank of tp
        index 0, each prompt's new tokens by index; None on every other rank (and a replica without prompts)."""
        engine = self.engine
        mesh = engine.mesh
        plan, mine = plans[mesh.dp_index], prompts[mesh.dp_index]
        if plan is None:
            return None
        (stage,) = plan.stages_of(mesh.pp_index)
        link = PipelineLink(engine.p2p, mesh.members["pp"], engine.runtime.message_dtype, engine.device)
        new = decode(plan, mesh.pp_index, engine.stages[stage].module, make_groups(mine, plan.meta[DECODE_GROUPS]),
                     settings, link, mesh.group("tp"))
        engine.synchronize()
        return new if stage == plan.num_stages - 1 and mesh.tp_index == 0 else None

    @actor_method
    def describe(self) -> dict:
        return self.engine.describe()
