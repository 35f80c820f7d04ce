"""What inference runs with: a checkpoint's model in a layout of workers on this machine, the device, how long a
wait may take and the microbatches of a scoring step. The inference job (pipegpt.infer.job) reads these, not a
training run's settings; the rank's engine is built from the engine_config they give.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipegpt.config import ConfigError, ModelConfig, TrainConfig
from pipegpt.data.hellaswag import ENDINGS


@dataclass(frozen=True)
class Layout:
    stages: int = 1
    tp: int = 1
    dp: int = 1
    ep: int = 1  # a mixture of experts' experts spread over ep of the dp replicas (as `pipegpt run --ep`)

    def describe(self) -> str:
        return (f"{self.stages} stage{'s' * (self.stages > 1)} x tp {self.tp} x dp {self.dp}"
                + (f" (ep {self.ep})" if self.ep > 1 else ""))


@dataclass(frozen=True)
class InferenceSettings:
    model: ModelConfig
    layout: Layout
    device: str = "auto"  # auto, cpu or cuda (pipegpt.engine.placement.resolve_device)
    timeout_s: float = 60.0  # the longest any wait may take before the job is brought down
    microbatches: int | None = None  # of a scoring step (HellaSwag: one example each); default 2 x stages

    @property
    def world_size(self) -> int:
        return self.layout.stages * self.layout.tp * self.layout.dp

    @property
    def step_microbatches(self) -> int:
        return self.microbatches or 2 * self.layout.stages

    def validate(self) -> InferenceSettings:
        """The layout's refusals, one line each: its sizes, stages against the layers (engine_config checks the
        rest: tp against the heads)."""
        layout = self.layout
        for name, value in (("stages", layout.stages), ("tp", layout.tp), ("dp", layout.dp), ("ep", layout.ep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name} {value!r} must be an integer >= 1")
        if layout.stages > self.model.n_layer:
            raise ConfigError(f"--stages {layout.stages} is more than the model's {self.model.n_layer} layers: use "
                              f"at most {self.model.n_layer} (every stage holds at least one block)")
        return self

    def engine_config(self) -> TrainConfig:
        """The settings the rank's engine is built from (pipegpt.engine.Engine reads a TrainConfig's model,
        parallel and runtime sections), validated: microbatches of HellaSwag's ENDINGS sequences each."""
        layout = self.layout
        cfg = TrainConfig.build(self.model, stages=layout.stages, tp=layout.tp, dp=layout.dp, ep=layout.ep,
                                microbatches=self.step_microbatches, microbatch_size=ENDINGS, device=self.device,
                                timeout_s=self.timeout_s)
        return cfg.validate()
