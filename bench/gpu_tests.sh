#!/bin/bash
# Every GPU test of the repository in one device call, from the repository root: builds the kernels in parallel
# first (CuPy's disk cache then serves the tests), then runs the test files that need a GPU (they skip elsewhere).
# Log under $OUT (default ./out): gpu_tests.log. Wheels in .whl/ (gguf, opentelemetry, grpcio-health, ...) are
# installed first when present.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source bench/device_env.sh || exit 1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 bench/roofline.py --precompile-only > "$OUT/precompile.log" 2>&1
python3 bench/gpu_deltanet_check.py --precompile-only --precompile 12 >> "$OUT/precompile.log" 2>&1
echo "precompiled $(( $(date +%s) - t0 )) s"
FILES=$(grep -l "unavailable_reason\|needs_gpu\|mark.gpu" tests/test_*.py | grep -v "_sim.py")
timeout "${GPU_TESTS_LIMIT:-520}" python3 -m pytest -q -rs -p no:cacheprovider --durations=5 $FILES \
    > "$OUT/gpu_tests.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -30
tail -12 "$OUT/gpu_tests.log"
echo "gpu tests rc $rc after $(( $(date +%s) - t0 )) s"
exit $rc
