#!/bin/bash
# One GPU-machine call for the gemv ring kernel and programmatic dependent launch (kernels/pdl.cuh): the PDL and gemv
# GPU tests plus the GPU engine tests against NumPy, bench/gemv_ab.py per matrix (ring shapes against the per-tile
# kernel) and on the synthetic Qwen3.6-27B Q4_K_M (decode step and a width-23 verify: per-tile, ring, ring + PDL), then
# bench/decode.py. Logs and JSON under $OUT (default ./out). (Session 7 ran its two halves as gpu_ring_run.sh and
# gpu_pdl_run.sh.)
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source bench/device_env.sh || exit 1
t0=$(date +%s)
(python3 -m services make-synthetic --shape qwen3.6-27b --quant q4_k_m --out /tmp/syn > $OUT/syn.log 2>&1) &
timeout 170 python3 -m pytest -q -x -rA -p no:cacheprovider tests/test_pdl.py tests/test_kernels_quant_gemv.py \
    tests/test_gpu_backend.py > $OUT/tests.log 2>&1
echo "tests rc $? $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/tests.log)"
grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
timeout 200 python3 bench/gemv_ab.py --json $OUT/ring_matrices.json 2>&1 | tee $OUT/ring_matrices.log | grep "^gemv"
wait
M=$(ls /tmp/syn/*q4_k_m*.gguf | grep -v draft | head -1); D=$(ls /tmp/syn/*draft*.gguf | head -1)
timeout 160 python3 bench/gemv_ab.py --no-matrices --model $M --json $OUT/ring_step.json 2>&1 | tee $OUT/ring_step.log | tail -2
timeout 170 python3 bench/decode.py --model $M --draft $D --widths 1 4 16 23 32 41 64 --reps 3 --spec-steps 4 \
    --long-context 2600 --deadline-s 150 --precompile 0 --json $OUT/decode.json 2>&1 | tee $OUT/decode.log | tail -16
echo "total $(( $(date +%s) - t0 )) s"
