"""Data parallelism: flat per-stage parameter and gradient buffers, their reductions, and ZeRO 1-3's shards."""
from .layout import FlatLayout, Piece
from .families import DataParallelFamilies
from .replicas import DataParallel
from .shard_ops import ONE_RANK, choose_shard_ops

__all__ = ["DataParallel", "DataParallelFamilies", "FlatLayout", "ONE_RANK", "Piece", "choose_shard_ops"]
