#!/bin/bash
# One GPU-machine call for the gemv ring variant (gemv_ring_kernel): the GPU tests of gemv, then bench/gemv_ab.py per
# matrix (ring shapes swept against the per-tile kernel) and on the synthetic Qwen3.6-27B Q4_K_M's decode step (written
# in the background meanwhile). Logs and JSON under $OUT (default ./out).
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source bench/device_env.sh || exit 1
t0=$(date +%s)
M=/tmp/syn/qwen3.6-27b-q4_k_m.synthetic.gguf
if [ ! -f $M ]; then
    (python3 -m services make-synthetic --shape qwen3.6-27b --quant q4_k_m --out /tmp/syn --no-draft > $OUT/syn.log 2>&1) &
fi
timeout 300 python3 -m pytest -q -x -rA -p no:cacheprovider tests/test_kernels_quant_gemv.py > $OUT/tests.log 2>&1
echo "tests rc $? $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/tests.log)"
grep -E "FAILED|Error|assert" $OUT/tests.log | head -20
timeout 200 python3 bench/gemv_ab.py --json $OUT/ring_matrices.json 2>&1 | tee $OUT/ring_matrices.log
wait
timeout 200 python3 bench/gemv_ab.py --no-matrices --model $M --json $OUT/ring_step.json 2>&1 | tee $OUT/ring_step.log
echo "total $(( $(date +%s) - t0 )) s"
