#!/bin/bash
# One GPU-machine run of the engine's numbers (docs/benchmarks.md): writes the synthetic Qwen3.6-27B Q4_K_M (and its
# DFlash drafter) while the kernels compile, runs the GPU tests of the speculative loop and services, the embedded pair
# on the GPU (bench/spec_cpu.py, after a warm-up run), bench/decode.py (width curve, plain decode, drafter, the
# speculative loop at forced acceptance) and bench/step_profile.py (per-kernel times at widths 1, 16, 23, 41).
# Results under $OUT (default ./out). Needs CuPy and pytest; wheels in .whl/ are installed first when present.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source bench/device_env.sh || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
(python3 -m services make-synthetic --shape qwen3.6-27b --quant q4_k_m --out /tmp/syn > $OUT/syn.log 2>&1) &
SYN=$!
python3 bench/roofline.py --precompile-only > $OUT/precompile.log 2>&1
python3 bench/gpu_deltanet_check.py --precompile-only --precompile 12 >> $OUT/precompile.log 2>&1
echo "precompile $(( $(date +%s) - t0 )) s"
timeout 150 python3 -m pytest -q -x -rs tests/test_gpu_loop.py tests/test_gpu_services.py tests/test_device_walk.py \
    2>&1 | tee $OUT/tests.log | tail -3
echo "tests $(( $(date +%s) - t0 )) s"
timeout 100 python3 bench/spec_cpu.py --device cuda:0 --n-prompts 8 --max-tokens 64 --budgets chain,22,auto > /dev/null 2>&1
timeout 100 python3 bench/spec_cpu.py --device cuda:0 --n-prompts 8 --max-tokens 64 --budgets chain,22,auto 2>&1 \
    | tee $OUT/spec_pair.log | tail -8
echo "pair $(( $(date +%s) - t0 )) s"
wait $SYN; tail -1 $OUT/syn.log
M=$(ls /tmp/syn/*q4_k_m*.gguf | grep -v draft | head -1); D=$(ls /tmp/syn/*draft*.gguf | head -1)
timeout 200 python3 bench/decode.py --model $M --draft $D --widths 1 4 16 23 32 41 64 --reps 3 --spec-steps 4 \
    --long-context 2600 --deadline-s 170 --precompile 0 --json $OUT/decode.json 2>&1 | tee $OUT/decode.log | tail -22
echo "decode $(( $(date +%s) - t0 )) s"
timeout 150 python3 bench/step_profile.py --model $M --context 512 --tree-widths 16 23 41 \
    --json $OUT/step_profile.json > $OUT/step_profile.log 2>&1
grep "^== " $OUT/step_profile.log
echo "total $(( $(date +%s) - t0 )) s"
