#!/usr/bin/env bash
# What a lent GPU machine (one GPU, a 16-core host; its python3 holds torch) runs, in one call of about 10 minutes:
#   1. bench_gpu.py: the gpu tests, GPT-2 124M bf16 eager and compiled (tokens/s, MFU), the planner's memory beside
#      max_memory_allocated;
#   2. one profiled eager run of the same model (py-spy per rank over the traced steps, and the trace): is the host
#      or are the kernels the limit;
#   3. bench_plan_order.py on two of the host's cores (taskset): the calibrated planner's measured / predicted on a
#      machine other than the 2-core VMs, whose speed moves more than the band it is held to.
# Each part has its own timeout and the next runs whatever the last did. Everything lands under $OUT:
#     bash benchmarks/device_checks.sh        # from the repository root; OUT defaults to /tmp/device-checks
set -u
OUT=${OUT:-/tmp/device-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
    || { echo "install failed: $OUT/install.log"; tail -5 "$OUT/install.log"; exit 1; }

echo "== bench_gpu.py ($(date +%T))"
timeout 330 python3 benchmarks/bench_gpu.py --json "$OUT/gpu.json" > "$OUT/gpu.log" 2>&1
echo "rc=$?"; tail -25 "$OUT/gpu.log"

echo "== a profiled eager run ($(date +%T))"
timeout 120 pipegpt run --model gpt2 --pad-vocab --precision bf16 --stages 1 --microbatches 4 \
    --microbatch-size 16 --steps 12 --trace-steps 10,11,12 --profile --no-save-final \
    --run-dir "$OUT/profile" > "$OUT/profile.log" 2>&1
echo "rc=$?"; tail -4 "$OUT/profile.log"

echo "== bench_plan_order.py on cores 0,1 ($(date +%T))"
timeout 300 taskset -c 0,1 python3 benchmarks/bench_plan_order.py --rounds 3 > "$OUT/plan_order.log" 2>&1
echo "rc=$?"; tail -22 "$OUT/plan_order.log"
echo "== done ($(date +%T))"
