"""Megatron-style tensor parallelism, in four modules:

    layout       which parameter is split how, by one-process name (REPLICATED, DIM0, DIM1,
                 QKV_DIM0, KV_DIM0, tp_shard_spec, kv_replicas, shard/gather of tensors and state
                 dicts); torch-free at import, needs neither torch.distributed nor the model.
                 Re-exported here.
    collectives  the paired autograd collectives (copy_to_tp, reduce_from_tp, the sequence
                 scatter/gather/reduce-scatter, vocab_parallel_cross_entropy).
    layers       the parallel layers and shard_for_tp, the module replacement on a GPT slice
                 (its docstring explains the scheme).
    rng          a tp rank's own dropout masks in sharded regions (Megatron's RNG tracker idea).
"""
from pipegpt.tensor_parallel.layout import (DIM0, DIM1, KV_DIM0, QKV_DIM0, REPLICATED, gather_full,
                                            gather_state_dicts, kv_replicas, shard_state_dict, shard_tensor,
                                            tp_shard_spec)

__all__ = ["DIM0", "DIM1", "KV_DIM0", "QKV_DIM0", "REPLICATED", "gather_full", "gather_state_dicts", "kv_replicas",
           "shard_state_dict", "shard_tensor", "tp_shard_spec"]
