"""AdamW's kernel (pipegpt.train.optim): fused on CUDA, foreach elsewhere, and a resumed `step` where the kernel
keeps it. The choice runs here on stand-ins; the fused update itself only on a GPU (skipped without one)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipegpt.config import OptimizerConfig
from pipegpt.train.optim import adamw_kernel, make_optimizer, step_tensor


def on(device: str, floating: bool = True):
    return SimpleNamespace(device=torch.device(device), is_floating_point=lambda: floating)


def test_fused_only_where_every_parameter_is_a_floating_cuda_tensor():
    assert adamw_kernel([on("cuda"), on("cuda")]) == {"fused": True}
    assert adamw_kernel([on("cpu"), on("cpu")]) == {"foreach": True}
    assert adamw_kernel([on("cuda"), on("cpu")]) == {"foreach": True}  # fused needs them all on the GPU
    assert adamw_kernel([on("cuda", floating=False)]) == {"foreach": True}
    assert adamw_kernel([]) == {"foreach": True}


def test_on_cpu_the_optimizer_stays_foreach_and_its_step_a_cpu_scalar():
    w = torch.nn.Parameter(torch.ones(2, 2))
    group = make_optimizer([("w", w)], OptimizerConfig()).param_groups[0]
    assert group["foreach"] is True and not group["fused"]
    assert step_tensor(4, w, group).device.type == "cpu"


def test_a_resumed_step_goes_where_fused_keeps_it():
    p = torch.empty(3, device="meta")  # stands for a GPU parameter: the step must go to its device
    for group in ({"fused": True}, {"capturable": True}):
        step = step_tensor(7, p, group)
        assert (step.device, step.dtype, step.shape) == (p.device, torch.float32, torch.Size([]))
    assert step_tensor(7, p, {"fused": None, "foreach": True}).device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused AdamW runs on a GPU")
def test_on_a_gpu_fused_adamw_matches_foreach_and_resumes():
    g = torch.Generator().manual_seed(0)
    values = {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g)}
    grads = [{n: torch.randn(v.shape, generator=g) for n, v in values.items()} for _ in range(3)]

    def train(kernel: dict | None, resume_at: int | None = None):
        named = [(n, torch.nn.Parameter(v.clone().cuda())) for n, v in values.items()]
        optimizer = make_optimizer(named, OptimizerConfig(lr=1e-2))
        if kernel is not None:  # the reference: the same groups, foreach
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
            optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), **kernel)
        for i, step_grads in enumerate(grads):
            if i == resume_at:  # as Worker.load: moments and step set in the state directly
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        state = optimizer.state[p]
                        optimizer.state[p] = {"step": step_tensor(i, p, group), "exp_avg": state["exp_avg"].clone(),
                                              "exp_avg_sq": state["exp_avg_sq"].clone()}
            for n, p in named:
                p.grad = step_grads[n].cuda()
            optimizer.step()
        return optimizer, {n: p.detach().cpu() for n, p in named}

    fused, got = train(None)
    assert all(group["fused"] for group in fused.param_groups)
    _, want = train({"foreach": True})
    _, resumed = train(None, resume_at=2)
    for n in values:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(resumed[n], got[n], rtol=0, atol=0)
