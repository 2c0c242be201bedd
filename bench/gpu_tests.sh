#!/bin/bash
# Every GPU test of the repository in one device call (or in parts, GPU_TESTS_PART), from the repository root: builds
# the kernels in parallel first (CuPy's disk cache then serves the tests), then runs the test files that need a GPU
# (they skip elsewhere).
# Log under $OUT (default ./out): gpu_tests.log. Wheels in .whl/ (gguf, opentelemetry, grpcio-health, ...) are
# installed first when present. The whole suite takes ~480 s on an H200, more than one device call may: GPU_TESTS_PART
# = k/n runs the k-th of n parts (the files dealt round-robin, in order), GPU_TEST_FILES a list of its own.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source bench/device_env.sh || exit 1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 bench/roofline.py --precompile-only > "$OUT/precompile.log" 2>&1
python3 bench/gpu_deltanet_check.py --precompile-only --precompile 12 >> "$OUT/precompile.log" 2>&1
echo "precompiled $(( $(date +%s) - t0 )) s"
FILES=${GPU_TEST_FILES:-$(grep -l "unavailable_reason\|needs_gpu\|mark.gpu" tests/test_*.py | grep -v "_sim.py")}
if [ -n "$GPU_TESTS_PART" ]; then
    k=${GPU_TESTS_PART%/*}; n=${GPU_TESTS_PART#*/}
    if ! [[ "$k" =~ ^[0-9]+$ && "$n" =~ ^[0-9]+$ ]] || [ "$k" -lt 1 ] || [ "$k" -gt "$n" ]; then
        echo "GPU_TESTS_PART must be k/n with 1 <= k <= n, not '$GPU_TESTS_PART'"; exit 2
    fi
    FILES=$(echo $FILES | tr ' ' '\n' | awk -v k="$k" -v n="$n" '(NR - 1) % n == k - 1')
fi
echo "test files: $(echo $FILES | tr '\n' ' ')"
timeout "${GPU_TESTS_LIMIT:-520}" python3 -m pytest -q -rs -p no:cacheprovider --durations=5 $FILES \
    > "$OUT/gpu_tests.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -30
tail -12 "$OUT/gpu_tests.log"
echo "gpu tests rc $rc after $(( $(date +%s) - t0 )) s"
exit $rc
