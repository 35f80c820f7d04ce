#!/bin/bash
# pipegpt on N machines without a scheduler: run this on every machine, the same HEAD on each (the address of
# the machine that keeps the rendezvous store; any of them), with a run directory that all of them see.
#
#   HEAD=10.0.0.1 NNODES=2 bash examples/torchrun/multinode.sh        # on each of the two machines
#
# Each machine's torchrun starts a worker per GPU; they meet by c10d rendezvous at HEAD:29500. A rank that
# fails restarts every worker from the latest checkpoint (--max_restarts, --resume auto).
set -euo pipefail
: "${HEAD:?the rendezvous machine address}" "${NNODES:?the number of machines}"

torchrun --nnodes "$NNODES" --nproc_per_node "${GPUS_PER_NODE:-8}" \
    --rdzv_backend c10d --rdzv_endpoint "$HEAD:${RDZV_PORT:-29500}" --rdzv_id "${RUN_ID:-pipegpt}" \
    --max_restarts 3 \
    -m pipegpt run --run-dir "${RUN_DIR:-runs/multinode}" --resume auto \
    --model gpt2 --tokenizer gpt2 --data "${DATA:-data/fineweb}" --dp 4 --microbatches 16 --batch-size 512 \
    --device cuda --precision bf16 --steps 19073 --save-every 500
