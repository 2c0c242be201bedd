#!/bin/bash
# Every GPU test of the repository in one device call (or in parts, GPU_TESTS_PART), from the repository root: builds
# the kernels in parallel first (CuPy's disk cache then serves the tests), then runs the test files that need a GPU
# (they skip elsewhere).
# Log under $OUT (default ./out): gpu_tests.log. Wheels in .whl/ (gguf, opentelemetry, grpcio-health, ...) are
# installed first when present. The whole suite takes ~700 s on an H200, more than one device call may: GPU_TESTS_PART
# = k/n runs the k-th of n parts (the files dealt round-robin, in order), GPU_TEST_FILES a list of its own.
# GPU_TESTS_JOBS = j runs the files as j pytest processes at once, job i on visible GPU i % (GPUs) (j may exceed the
# GPUs: processes share a GPU then); each job's log is gpu_tests.<i>.log. Tests marked gpus2 (two GPUs) skip in
# those jobs, which see one GPU each, and run afterwards in one process that sees them all.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source bench/device_env.sh || exit 1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 bench/roofline.py --precompile-only > "$OUT/precompile.log" 2>&1
python3 bench/gpu_deltanet_check.py --precompile-only --precompile 12 >> "$OUT/precompile.log" 2>&1
echo "precompiled $(( $(date +%s) - t0 )) s"
FILES=${GPU_TEST_FILES:-$(grep -l "unavailable_reason\|needs_gpu\|mark\.gpu\b" tests/test_*.py | grep -v "_sim.py")}
if [ -n "$GPU_TESTS_PART" ]; then
    k=${GPU_TESTS_PART%/*}; n=${GPU_TESTS_PART#*/}
    if ! [[ "$k" =~ ^[0-9]+$ && "$n" =~ ^[0-9]+$ ]] || [ "$k" -lt 1 ] || [ "$k" -gt "$n" ]; then
        echo "GPU_TESTS_PART must be k/n with 1 <= k <= n, not '$GPU_TESTS_PART'"; exit 2
    fi
    FILES=$(echo $FILES | tr ' ' '\n' | awk -v k="$k" -v n="$n" '(NR - 1) % n == k - 1')
fi
echo "test files: $(echo $FILES | tr '\n' ' ')"
JOBS=${GPU_TESTS_JOBS:-1}
if ! [[ "$JOBS" =~ ^[0-9]+$ ]] || [ "$JOBS" -lt 1 ]; then
    echo "GPU_TESTS_JOBS must be a count of 1 or more, not '$JOBS'"; exit 2
fi
PYTEST="python3 -m pytest -q -rfEs -p no:cacheprovider --durations=5"
if [ "$JOBS" -eq 1 ]; then
    timeout "${GPU_TESTS_LIMIT:-520}" $PYTEST $FILES > "$OUT/gpu_tests.log" 2>&1
    rc=$?
    LOGS="$OUT/gpu_tests.log"
else
    GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
    [ "$GPUS" -ge 1 ] || { echo "GPU_TESTS_JOBS: nvidia-smi lists no GPU"; exit 2; }
    pids=(); LOGS=""
    for ((i = 0; i < JOBS; i++)); do
        part=$(echo $FILES | tr ' ' '\n' | awk -v k="$i" -v n="$JOBS" '(NR - 1) % n == k')
        [ -n "$part" ] || continue
        CUDA_VISIBLE_DEVICES=$(( i % GPUS )) timeout "${GPU_TESTS_LIMIT:-520}" $PYTEST -m "not gpus2" $part \
            > "$OUT/gpu_tests.$i.log" 2>&1 &
        pids+=($!); LOGS="$LOGS $OUT/gpu_tests.$i.log"
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    if [ "$GPUS" -ge 2 ]; then
        timeout "${GPU_TESTS_LIMIT:-520}" $PYTEST -m gpus2 $FILES > "$OUT/gpu_tests.gpus2.log" 2>&1
        r=$?; [ "$r" -eq 5 ] && r=0               # 5: no test carries the mark in these files
        [ "$r" -ne 0 ] && rc=$r
        LOGS="$LOGS $OUT/gpu_tests.gpus2.log"
    fi
fi
for f in $LOGS; do
    echo "== $(basename "$f")"
    grep -E "^(FAILED|ERROR)" "$f" | head -30
    tail -6 "$f"
done
echo "gpu tests rc $rc after $(( $(date +%s) - t0 )) s"
exit $rc
