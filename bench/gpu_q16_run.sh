#!/bin/bash
# One GPU-machine call for the gemv kernel fed from the pack's int16 staging (PackedX.q16): builds the kernels, runs the
# GPU tests of gemv / quant_matmul, then bench/gemv_ab.py per matrix and on the synthetic Qwen3.6-27B Q4_K_M's
# decode step (written in the background meanwhile). Logs and JSON under $OUT (default ./out).
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source bench/device_env.sh || exit 1
t0=$(date +%s)
M=/tmp/syn/qwen3.6-27b-q4_k_m.synthetic.gguf
if [ ! -f $M ]; then
    (python3 -m services make-synthetic --shape qwen3.6-27b --quant q4_k_m --out /tmp/syn --no-draft > $OUT/syn.log 2>&1) &
fi
python3 bench/roofline.py --precompile-only --kernels gemv,v2,wide,auto --widths 1,2,16,23,41 > $OUT/precompile.log 2>&1
echo "precompile $(( $(date +%s) - t0 )) s"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_quant_gemv.py tests/test_kernels_quant_matmul.py \
    2>&1 | tee $OUT/tests.log | tail -3
echo "tests $(( $(date +%s) - t0 )) s"
timeout 150 python3 bench/gemv_ab.py --json $OUT/q16_matrices.json 2>&1 | tee $OUT/q16_matrices.log
wait
timeout 200 python3 bench/gemv_ab.py --no-matrices --model $M --json $OUT/q16_step.json 2>&1 | tee $OUT/q16_step.log
echo "total $(( $(date +%s) - t0 )) s"
