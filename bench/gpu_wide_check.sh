#!/usr/bin/env bash
# One call on the GPU machine, from the repository root, for the wide-token kernel (qmw_kernel, kernels/quant_wide.py;
# docs/gpu_quant_matmul.md, "wide"):
#     bash bench/gpu_wide_check.sh          # kernels: build everything, the GPU tests of the wide kernel and of
#                                           # quant_matmul, then bench/roofline.py: gemv / v2 / wide / auto at widths
#                                           # 1..64 on the 27B matrices and the wide launch-shape sweep (~6 min)
#     bash bench/gpu_wide_check.sh step     # the synthetic Qwen3.6-27B Q4_K_M's step, graph replay, at widths 1..64
#                                           # with the wide dispatch off (v2) and on (~4 min)
# Logs and JSON under $OUT (default ./out): gpu_wide_<mode>.log, roofline.json. The last lines printed are the compact
# tables (per matrix: wide time over gemv's T=1 time at 16 / 23 / 41 / 64 tokens, issue 5's targets marked; step mode:
# the step replay times). The bench runs even when a test fails (its numbers are wanted either way); the exit status
# is the tests' (or the bench's) failure.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
export OUT
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
MODE="${1:-kernels}"
LOG="$OUT/gpu_wide_$MODE.log"
SYN_DIR=/tmp/syn
MODEL="$SYN_DIR/qwen3.6-27b-q4_k_m.synthetic.gguf"

{
    t0=$(date +%s)
    echo "== gpu_wide_check $MODE $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || true
    "$PY" -c "import cupy, sys; from cupy.cuda import runtime; print('python', sys.version.split()[0], 'cupy', \
cupy.__version__, 'runtime', runtime.runtimeGetVersion())" 2>&1 || true
    status=0
    case "$MODE" in
    step)
        if [ ! -f "$MODEL" ]; then
            ("$PY" -m services make-synthetic --shape qwen3.6-27b --quant q4_k_m --out "$SYN_DIR" --no-draft \
                > "$OUT/synthetic.log" 2>&1) &
            syn=$!
        fi
        "$PY" bench/roofline.py --precompile-only --kernels gemv,v2,wide,auto --widths 1,16,23,32,41,48,64 || true
        echo "precompiled: $(( $(date +%s) - t0 )) s"
        if [ -n "${syn:-}" ]; then
            wait "$syn" || { echo "make-synthetic failed:"; tail -20 "$OUT/synthetic.log"; exit 1; }
        fi
        echo "model ready: $(( $(date +%s) - t0 )) s"
        "$PY" bench/roofline.py --types none --wide-step "$MODEL" --context 512 \
            --step-widths "${STEP_WIDTHS:-1,16,23,32,41,48,64}" || status=$?
        ;;
    kernels)
        "$PY" bench/roofline.py --precompile-only || true
        echo "precompiled: $(( $(date +%s) - t0 )) s"
        "$PY" -m pytest -q -rs --maxfail=20 tests/test_kernels_quant_wide.py tests/test_kernels_quant_matmul.py \
            || status=$?
        echo "tests (status $status): $(( $(date +%s) - t0 )) s"
        # shellcheck disable=SC2086
        "$PY" bench/roofline.py --kernels gemv,v2,wide,auto --widths 1,8,16,23,32,41,48,64 --wide-sweep \
            ${ROOFLINE_ARGS:-} || status=$((status ? status : $?))
        ;;
    *)
        echo "unknown mode $MODE (kernels | step)"
        exit 2
        ;;
    esac
    echo "== gpu_wide_check $MODE exit status $status after $(( $(date +%s) - t0 )) s"
    exit "$status"
} 2>&1 | tee "$LOG"
