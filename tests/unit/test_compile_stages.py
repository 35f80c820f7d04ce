"""--compile (pipegpt.engine.compiling): the stages of a rank share GPT.forward's code object, so under one dynamo
cache their graphs add up to its recompile limit, past which dynamo runs them uncompiled. Each stage compiled on
its own keeps every stage compiled (or, on a torch without isolate_recompiles, a limit raised per stage); a stage
that still reaches the limit is said in one line. Dynamo's eager backend counts the graphs (what is compiled, not
how), with the limit scaled down from 8 to 2."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from pipegpt.config import ModelConfig
from pipegpt.engine import compiling
from pipegpt.engine.compiling import compile_stage
from pipegpt.model.gpt import GPT

CFG = ModelConfig(vocab_size=32, seq_len=4, n_layer=3, n_head=2, n_embd=8)
# three stages of one rank (interleaved: a V's, or virtual stages), each its own shape
STAGES = [dict(layers=range(0, 1), embed=True, head=False), dict(layers=range(1, 2), embed=False, head=False),
          dict(layers=range(2, 3), embed=False, head=True)]


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):  # stands for the default 8: 3 stages > 2
        yield
    torch._dynamo.reset()


def run(stage: int, module) -> None:
    x = torch.randint(0, CFG.vocab_size, (1, CFG.seq_len)) if stage == 0 else torch.randn(1, CFG.seq_len, 8)
    module(x)


@pytest.mark.parametrize("torch_has_isolation", [True, False])
def test_every_stage_of_a_rank_stays_compiled(dynamo, monkeypatch, torch_has_isolation):
    if not torch_has_isolation:  # as torch 2.11, whose compile() has no isolate_recompiles
        monkeypatch.setattr(compiling, "isolating_option", lambda: {})
        monkeypatch.setattr(compiling, "_shared_limit", {"stages": 0, "per_stage": None})
    elif not compiling.isolating_option():
        pytest.skip("this torch's compile() has no isolate_recompiles")
    counter = CompileCounter()
    modules = [GPT(CFG, init_seed=0, **kw) for kw in STAGES]
    for module in modules:
        compile_stage(module, rank=0, backend=counter)
    for stage, module in enumerate(modules):
        run(stage, module)
    assert counter.frame_count == len(STAGES), "a stage fell back to eager: its graph was never compiled"
    for stage, module in enumerate(modules):  # and each runs its compiled graph from then on
        run(stage, module)
    assert counter.frame_count == len(STAGES)


def test_a_stage_that_reaches_the_limit_is_said_in_one_line(dynamo, capsys):
    module = GPT(CFG, init_seed=0, **STAGES[1])
    compile_stage(module, rank=3, backend=CompileCounter())
    with torch._dynamo.config.patch(recompile_limit=1):
        run(1, module)
        module.eval()  # training -> evaluation: a second graph, past a limit of 1
        run(1, module)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "pipegpt: rank 3: torch.compile reached dynamo's recompile_limit (1) in 'forward' ("), lines
