"""One stage's flat buffers on one rank: its parameters are views into one flat parameter buffer, their gradients
views into one flat gradient buffer (Megatron's grad buffer), laid out by data_parallel.layout.

Autograd accumulates into an existing .grad in place, so a step's gradients land in the buffer where they are
reduced: no copy in or out. With ZeRO (zero >= 1) the rank also holds its shard of the gradients (what a
reduce-scatter gives it: at zero 1 in place, its own chunks of the full buffer, which lives through the run; at
zero 2 and 3 a buffer of its own, which outlives the full one) and the optimizer works on `pieces`: 1-D views of the rank's shard, one per parameter
part, each with its .grad. ZeRO-2 frees the full gradient buffer once reduced; ZeRO-3 keeps only the shard of
the parameters, and the full buffer exists between a gather (unshard) and a free (reshard): the parameters
then point at an empty tensor, so nothing can read a freed buffer by mistake.
"""
from __future__ import annotations

import torch

from pipegpt.data_parallel.buckets import BUCKET_BYTES
from pipegpt.data_parallel.layout import FlatLayout, Piece


class StageBuffers:
    def __init__(self, stage: int, params: list[torch.Tensor], zero: int, shards: int, index: int,
                 alone: frozenset = frozenset()):
        self.stage, self.params, self.zero, self.index = stage, params, zero, index
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"stage {stage}: one flat buffer needs one dtype, the parameters have "
                             f"{sorted(map(str, dtypes))}")
        self.dtype, self.device = params[0].dtype, params[0].device
        self.layout = FlatLayout([p.numel() for p in params], params[0].element_size(), BUCKET_BYTES,
                                 shards if zero else 1, frozenset(i for i, p in enumerate(params) if id(p) in alone))
        self.shapes = [p.shape for p in params]
        self.empty = torch.empty(0, dtype=self.dtype, device=self.device)  # what a resharded parameter points at
        full = torch.zeros(self.layout.total, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, view in zip(params, self._views(full)):
                view.copy_(p)
        self.grad_flat: torch.Tensor | None = None
        self.param_flat: torch.Tensor | None = None
        self._point_at(full)
        self.pieces: list[Piece] = self.layout.pieces(index) if zero else []
        self.param_shard = self.grad_shard = None
        if self.zero < 2:  # gradients live for the whole run
            self.grad_flat = torch.zeros_like(full)
        if zero == 1:  # reduce-scattered in place: the rank's chunks of the full buffer are its shard (no copy)
            self.grad_pieces = [self._param_piece(self.grad_flat, pc) for pc in self.pieces]
        elif zero:
            self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
            self.grad_pieces = [self.grad_shard[pc.shard_offset:pc.shard_offset + pc.numel] for pc in self.pieces]
        if zero >= 3:
            self.param_shard = torch.cat([self.chunk(full, b) for b in self.layout.buckets])
            self.param_pieces = [self.param_shard[pc.shard_offset:pc.shard_offset + pc.numel] for pc in self.pieces]
            self.reshard()
        elif zero:
            self.param_pieces = [self._param_piece(full, pc) for pc in self.pieces]
        if self.grad_flat is not None:
            self._attach_grads()

    # layout

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + n].view(shape) for o, n, shape in zip(self.layout.offsets, self.layout.numels, self.shapes)]

    def bucket_view(self, flat: torch.Tensor, b, padded: bool = True) -> torch.Tensor:
        return flat[b.offset:b.offset + (b.padded if padded else b.numel)]

    def chunk(self, flat: torch.Tensor, b) -> torch.Tensor:
        """This rank's chunk of bucket b of a full flat buffer."""
        c = self.layout.chunk(b)
        return flat[b.offset + self.index * c:b.offset + (self.index + 1) * c]

    def shard_chunk(self, shard: torch.Tensor, k: int) -> torch.Tensor:
        """Bucket k's chunk in a shard buffer (the chunks of every bucket, end to end)."""
        start = sum(self.layout.chunk(b) for b in self.layout.buckets[:k])
        return shard[start:start + self.layout.chunk(self.layout.buckets[k])]

    def _param_piece(self, flat: torch.Tensor, pc: Piece) -> torch.Tensor:
        start = self.layout.offsets[pc.param] + pc.start
        return flat[start:start + pc.numel]

    # parameters

    @property
    def gathered(self) -> bool:
        return self.param_flat is not None

    def _point_at(self, full: torch.Tensor) -> None:
        self.param_flat = full
        for p, view in zip(self.params, self._views(full)):
            p.data = view
        if self.grad_flat is not None:
            self._attach_grads()

    def new_full(self) -> torch.Tensor:
        """An uninitialised full parameter buffer for a gather to fill (ZeRO-3)."""
        return torch.empty(self.layout.total, dtype=self.dtype, device=self.device)

    def unsharded(self, full: torch.Tensor) -> None:
        """The parameters point into `full`, which a gather has filled."""
        self._point_at(full)

    def reshard(self) -> None:
        """ZeRO-3: drop the full parameters; the shard stays."""
        for p in self.params:
            p.data = self.empty
        self.param_flat = None

    # gradients

    def _attach_grads(self) -> None:
        for p, view in zip(self.params, self._views(self.grad_flat)):
            p.grad = view

    def zero_grad(self) -> None:
        """A step's gradients start at zero; ZeRO-2/3 allocate theirs at the stage's first backward (need_grads)."""
        if self.grad_flat is not None:
            self.grad_flat.zero_()

    def need_grads(self) -> None:
        """ZeRO-2/3: the full gradient buffer, zeroed, from the stage's first backward of a step until reduced."""
        if self.grad_flat is None:
            self.grad_flat = torch.zeros(self.layout.total, dtype=self.dtype, device=self.device)
            if self.gathered:  # ZeRO-3 attaches them at the stage's gather
                self._attach_grads()

    def free_grads(self) -> None:
        """ZeRO-2/3, once reduced: only the shard is kept."""
        if self.zero >= 2:
            for p in self.params:
                p.grad = None
            self.grad_flat = None

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The buffers this stage holds now by kind (pipegpt.observe.tensor_bytes): its own parameters (the flat
        buffer; with ZeRO-3 the shard), ZeRO-3's gathered full buffer, the gradients' buffers."""
        own = self.param_shard if self.zero >= 3 else self.param_flat
        gathered = self.param_flat if self.zero >= 3 else None
        return {"parameters": [t for t in (own,) if t is not None],
                "gathered": [t for t in (gathered,) if t is not None],
                "gradients": [t for t in (self.grad_flat, self.grad_shard) if t is not None]}

    def storage_bytes(self) -> dict[str, int]:
        """Bytes this stage holds now, counted from the storages (a view shares its buffer's)."""
        size = lambda t: 0 if t is None else t.untyped_storage().nbytes()  # noqa: E731
        return {"parameters": size(self.param_flat) + size(self.param_shard),
                "gradients": size(self.grad_flat) + size(self.grad_shard)}
