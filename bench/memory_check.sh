#!/bin/bash
# GPU memory against the start-up memory plan (issue 5, item 4), one device command: bench/memory_check.py on the
# embedded default pair (two slots, budget auto: widths up to 64) and on the synthetic Qwen3.6-27B Q4_K_M written
# meanwhile (no drafter; planned as for a remote one: budget 63, 5 captured layers; decode + verify steps at widths
# 1..64), then the GPU tests of the engine and services (the memory ones first) in the time left of ~9.5 minutes.
# Test summary, then the two tables last; JSON and logs under $OUT (default ./out). Wheels in .whl/ are installed
# first when present.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source bench/device_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
(python3 -m services make-synthetic --shape qwen3.6-27b --quant q4_k_m --out /tmp/syn --no-draft > "$OUT/syn.log" 2>&1) &
SYN=$!
timeout 150 python3 bench/memory_check.py --default-model --max-ctx 2048 --slots 2 --budget auto --requests 14 \
    --json "$OUT/memory_pair.json" > "$OUT/memory_pair.log" 2>&1; PAIR=$?
echo "pair rc $PAIR ($(( $(date +%s) - t0 )) s)"
wait $SYN; tail -1 "$OUT/syn.log" | cut -c1-160
M=$(ls /tmp/syn/*.gguf | grep -v draft | head -1)
timeout 240 python3 bench/memory_check.py --model "$M" --remote-drafter --budget 63 --max-ctx 8192 --requests 6 \
    --widths 1-64 --json "$OUT/memory_27b.json" > "$OUT/memory_27b.log" 2>&1; BIG=$?
echo "27b rc $BIG ($(( $(date +%s) - t0 )) s)"
rm -rf /tmp/syn
left=$(( 570 - ($(date +%s) - t0) ))
[ $left -lt 60 ] && left=60
timeout $left python3 -m pytest -q -rfEs --durations=8 tests/test_gpu_memory.py tests/test_gpu_backend.py \
    tests/test_gpu_drafter.py tests/test_gpu_services.py tests/test_gpu_loop.py > "$OUT/tests.log" 2>&1
echo "tests rc $? (limit ${left} s; $(( $(date +%s) - t0 )) s in all)"
grep -E "^(FAILED|ERROR)|passed|failed|^[0-9.]+s (call|setup)" "$OUT/tests.log" | tail -16
echo "--- embedded pair (rc $PAIR)"
tail -14 "$OUT/memory_pair.log"
echo "--- synthetic 27B (rc $BIG)"
tail -14 "$OUT/memory_27b.log"
