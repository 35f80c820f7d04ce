"""Data parallelism: flat per-stage parameter and gradient buffers, their reductions, and ZeRO 1-3's shards."""
from .layout import FlatLayout, Piece
from .replicas import DataParallel
from .shard_ops import choose_shard_ops

__all__ = ["DataParallel", "FlatLayout", "Piece", "choose_shard_ops"]
