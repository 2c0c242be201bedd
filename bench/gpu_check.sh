#!/usr/bin/env bash
# One call on the GPU machine, from the repository root:
#     bash bench/gpu_check.sh
# builds every kernel in parallel (CuPy's disk cache then serves the tests), runs the GPU kernel tests, then
# (if they pass) the roofline bench with $ROOFLINE_ARGS (default: both kernels, the v2 launch-shape sweep and
# the launch-overhead probe); everything is logged to $OUT/gpu_check.log and the bench writes
# $OUT/roofline.json. Set GPU_CHECK_BENCH_ALWAYS=1 to run the bench even when a test fails. Without pytest on the machine: a wheel in .whl/ is installed if there is
# one, else the tests run through bench/mini_pytest.py (same tests, minimal runner).
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
export OUT
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
PY="${PYTHON:-python}"

{
    echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1 || true
    "$PY" - <<'PYEOF' 2>&1 || true
import sys
print("python", sys.version.split()[0])
try:
    import cupy
    from cupy.cuda import nvrtc, runtime
    print("cupy", cupy.__version__, "runtime", runtime.runtimeGetVersion(), "driver", runtime.driverGetVersion(),
          "nvrtc", nvrtc.getVersion(), "devices", runtime.getDeviceCount())
except Exception as e:
    print("cupy unavailable:", type(e).__name__, e)
PYEOF
    if ! "$PY" -c "import pytest" 2>/dev/null && ls .whl/pytest-*.whl >/dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-index --find-links .whl pytest 2>&1 || true
    fi
    status=0
    "$PY" bench/roofline.py --precompile-only || true
    if "$PY" -c "import pytest" 2>/dev/null; then
        "$PY" -m pytest -q -rs tests/test_kernels_quant_matmul.py tests/test_kernels_quant_wide.py || status=$?
    else
        echo "(pytest is not installed: running the tests with bench/mini_pytest.py)"
        "$PY" bench/mini_pytest.py tests/test_kernels_quant_matmul.py tests/test_kernels_quant_wide.py || status=$?
    fi
    if [ "$status" -eq 0 ] || [ "${GPU_CHECK_BENCH_ALWAYS:-0}" = "1" ]; then
        # shellcheck disable=SC2086
        "$PY" bench/roofline.py ${ROOFLINE_ARGS:---kernels v2,v1 --sweep --launch} || status=$((status ? status : $?))
    fi
    echo "== gpu_check exit status $status"
    exit "$status"
} 2>&1 | tee "$LOG"
