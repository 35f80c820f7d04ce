"""Data parallelism over more than one group at once: each family of a stage's parameters over the ranks that hold
the same values (with experts over ep: the dense parameters over dp x cp, the experts over edp, their sum divided
by dp x cp). One object with DataParallel's interface, so the plan's collectives, the optimizer's pieces, ZeRO's
gathers and the checkpoint's see one data parallelism; each family its own flat buffers, shards and collectives."""
from __future__ import annotations

import contextlib

import torch

from pipegpt.data_parallel.replicas import DataParallel, HeldPiece


class DataParallelFamilies:
    def __init__(self, families: list[DataParallel]):
        self.families = families
        self.zero = families[0].zero
        # describe() counts the buffers' layouts (ZeRO-3): every family's, under keys of their own
        self.buffers = {(i, s): buf for i, dp in enumerate(families) for s, buf in dp.buffers.items()}

    def _each(self, method: str, *args) -> None:
        for dp in self.families:
            getattr(dp, method)(*args)

    def reduce_grad(self, stage: int) -> None:
        self._each("reduce_grad", stage)

    def unshard(self, stage: int) -> None:
        self._each("unshard", stage)

    def ready(self, stage: int, backward: bool = False) -> None:
        self._each("ready", stage, backward)

    def reshard(self, stage: int) -> None:
        self._each("reshard", stage)

    def zero_grad(self) -> None:
        self._each("zero_grad")

    def finish(self) -> None:
        self._each("finish")

    def after_update(self) -> None:
        self._each("after_update")

    def pieces(self) -> list[HeldPiece]:
        return [piece for dp in self.families for piece in dp.pieces()]

    def gather_pieces(self, values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {k: v for dp in self.families for k, v in dp.gather_pieces(values).items()}

    @contextlib.contextmanager
    def whole(self):
        with contextlib.ExitStack() as stack:
            for dp in self.families:
                stack.enter_context(dp.whole())
            yield

    def full_grads(self) -> dict[int, torch.Tensor]:
        return {k: v for dp in self.families for k, v in dp.full_grads().items()}

    def storage_bytes(self) -> dict[str, int]:
        totals = {"parameters": 0, "gradients": 0}
        for dp in self.families:
            for key, n in dp.storage_bytes().items():
                totals[key] += n
        return totals
