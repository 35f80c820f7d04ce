"""Where each parameter of a stage lives in its flat buffers, and which elements each data-parallel rank owns.

Torch-free arithmetic over element counts. A stage's parameters are laid end to end in buckets (about
bucket_bytes each: pipegpt.data_parallel.buckets.BUCKET_BYTES; a tensor named `alone` in a bucket of its own);
each bucket is padded to a multiple of the shard count and cut into that many equal chunks, chunk i owned
by rank i of the group (ZeRO's shard). One
reduce-scatter or all-gather per bucket then moves whole chunks, and the chunk boundaries of equal-shaped
buffers agree across ranks (tensor-parallel peers; the tied embedding's copies, each alone in its bucket),
so a sum over such ranks can act on shards as on whole gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

@dataclass(frozen=True)
class Bucket:
    offset: int  # its first element in the flat buffer
    numel: int  # the parameters' elements
    padded: int  # numel rounded up to a multiple of the shard count
    first: int  # index of its first parameter
    end: int  # index past its last parameter


@dataclass(frozen=True)
class Piece:
    """The part of parameter `param` (elements [start, stop) of it, flattened) in one rank's shard, at
    `shard_offset` in that rank's shard buffer (its chunks of every bucket, end to end)."""

    param: int
    start: int
    stop: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class FlatLayout:
    """Offsets, buckets and shards of a stage's parameters (given as element counts, in order)."""

    def __init__(self, numels: Sequence[int], element_size: int, bucket_bytes: int, shards: int = 1,
                 alone: frozenset = frozenset()):
        if shards < 1:
            raise ValueError(f"shards={shards} must be >= 1")
        self.numels, self.shards = list(numels), shards
        self.offsets: list[int] = []
        buckets, first, size, offset = [], 0, 0, 0

        def close(end: int) -> None:
            nonlocal first, size, offset
            if end > first:
                padded = -(-size // shards) * shards
                buckets.append(Bucket(offset, size, padded, first, end))
                offset += padded
            first, size = end, 0

        for i, n in enumerate(self.numels):
            if i in alone:
                close(i)
            self.offsets.append(offset + size)
            size += n
            if i in alone or size * element_size >= bucket_bytes:
                close(i + 1)
        close(len(self.numels))
        self.buckets: list[Bucket] = buckets
        self.total = offset  # elements of a flat buffer, padding included

    @property
    def shard_numel(self) -> int:
        return self.total // self.shards

    def chunk(self, bucket: Bucket) -> int:
        return bucket.padded // self.shards

    def pieces(self, index: int) -> list[Piece]:
        """The parts of parameters that shard `index` holds, in shard-buffer order."""
        out, shard_offset = [], 0
        for b in self.buckets:
            c = self.chunk(b)
            lo, hi = b.offset + index * c, b.offset + (index + 1) * c
            for i in range(b.first, b.end):
                start, stop = max(lo, self.offsets[i]), min(hi, self.offsets[i] + self.numels[i])
                if start < stop:
                    out.append(Piece(i, start - self.offsets[i], stop - self.offsets[i],
                                     shard_offset + start - lo))
            shard_offset += c
        return out
