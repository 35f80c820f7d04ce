"""--compile: each stage's module compiled on its own, and a line when dynamo gives up on one.

Dynamo keeps its compiled graphs per code object, and every stage on a rank runs the same one (GPT.forward):
each stage's shape (its blocks, embedding, head) and each mode (training, evaluation) is one more entry under
one limit (torch._dynamo.config.recompile_limit, 8), past which dynamo runs the code uncompiled, saying so only
in a log warning. Four virtual stages trained and evaluated reach it. Each stage's compile is therefore its own
region (torch.compile's isolate_recompiles): the limit counts one stage's graphs, and compiling costs what it
did (one graph per stage and mode). A torch without that option (2.11 has none) shares the limit instead: each
stage compiled on a rank raises it by the limit's first value. Should a stage still reach the limit, the worker
prints one line naming it.
"""
from __future__ import annotations

import inspect
import logging
import sys

import torch

DYNAMO_LOGGER = "torch._dynamo.convert_frame"  # where dynamo warns that it hit a recompile limit
LIMIT_HIT = "torch._dynamo hit config."  # the start of that warning


class RecompileLimitLine(logging.Filter):
    """Turns dynamo's recompile-limit warning into one pipegpt line on this process's stderr."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(LIMIT_HIT):
            return True
        limit, value, function, reason = (tuple(record.args or ()) + (None,) * 4)[:4]
        reason = str(reason).strip().splitlines()[0] if reason else "not given"  # its first line: one line in all
        print(f"pipegpt: rank {self.rank}: torch.compile reached dynamo's {limit} ({value}) in {function}, which "
              f"now runs uncompiled for inputs its graphs do not cover (last reason: {reason}); raise "
              f"torch._dynamo.config.{limit} if these recompilations are expected", file=sys.stderr, flush=True)
        return False


def compile_stage(module: torch.nn.Module, rank: int, **options) -> None:
    """torch.compile the stage's module in place, as a region of its own; options go to torch.compile."""
    logger = logging.getLogger(DYNAMO_LOGGER)
    for old in [f for f in logger.filters if isinstance(f, RecompileLimitLine)]:
        logger.removeFilter(old)
    logger.addFilter(RecompileLimitLine(rank))
    isolating = isolating_option()
    if not isolating:
        _share_the_limit()
    module.compile(**isolating, **options)


def isolating_option() -> dict:
    """isolate_recompiles=True where this torch's compile takes it, else nothing."""
    return {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


_shared_limit = {"stages": 0, "per_stage": None}  # this process's stages under one code object's limit


def _share_the_limit() -> None:
    """The recompile limit of the code object the stages share, raised to (stages compiled) x (its first value)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # the older name
    if _shared_limit["per_stage"] is None:
        _shared_limit["per_stage"] = getattr(config, name)
    _shared_limit["stages"] += 1
    setattr(config, name, max(getattr(config, name), _shared_limit["per_stage"] * _shared_limit["stages"]))
