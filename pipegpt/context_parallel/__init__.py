"""Context parallelism: every sequence cut over cp ranks of one stage, attention seeing the others' keys and values.

    chunks.py     which positions a cp rank holds (load-balanced: chunks r and 2cp-1-r of 2cp), cutting and joining
    attention.py  attention across the cp group: a ring of K/V blocks, or one all-gather; autograd Functions
    kernels.py    one block's attention with its log-sum-exp, and its backward (fused kernel or plain torch)
    layers.py     shard_for_cp: a GPT slice's attention and positions made one rank's of a cp group
"""
