#!/bin/bash
# One GPU-machine run for the Gated DeltaNet tree walk + commit by replay (issue 5, docs/gpu_deltanet.md), from the
# repository root:
#     bash bench/gpu_gdr_run.sh
# Writes the synthetic Qwen3.6-27B Q4_K_M in the background while the kernels compile (deltanet and matmul, in
# parallel processes: CuPy's disk cache then serves the rest), runs the GPU tests of the deltanet kernels, the GPU
# engine and the GPU loop, times the tree walk + commit by replay at T = 1, 16, 23, 41, 64 and the other deltanet
# kernels (bench/gpu_deltanet_check.py; the per-node checkpoint path it replaced is gone, its numbers are in
# docs/gpu_deltanet.md), profiles the 27B step at widths 1, 23, 41
# (bench/step_profile.py: eager kernel times and graph replay), and prints a short table last. Everything is
# logged under $OUT (default ./out): tests.log, gpu_deltanet.log + deltanet_bench.json, step_profile.log + .json.
set -o pipefail
OUT=${OUT:-out}
export OUT
mkdir -p "$OUT"
source bench/device_env.sh || exit 1
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
git log -1 --format='commit %h %s' 2>/dev/null
(python3 -m services make-synthetic --shape qwen3.6-27b --quant q4_k_m --out /tmp/syn --no-draft > "$OUT/syn.log" 2>&1) &
SYN=$!
python3 bench/gpu_deltanet_check.py --precompile-only --precompile 12 > "$OUT/precompile.log" 2>&1
stamp "$(tail -1 "$OUT/precompile.log")"
python3 bench/roofline.py --precompile-only > "$OUT/precompile_matmul.log" 2>&1
stamp "$(tail -1 "$OUT/precompile_matmul.log")"

timeout 270 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_deltanet.py tests/test_gpu_backend.py \
    tests/test_gpu_loop.py > "$OUT/tests.log" 2>&1
TESTS=$?
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
stamp "tests exit $TESTS: $(tail -1 "$OUT/tests.log")"

timeout 180 python3 bench/gpu_deltanet_check.py --skip-tests > "$OUT/deltanet_check.out" 2>&1
BENCH=$?
stamp "gpu_deltanet_check exit $BENCH"

wait $SYN
M=$(ls /tmp/syn/*q4_k_m*.gguf 2>/dev/null | grep -v draft | head -1)
PROF=1
if [ -n "$M" ]; then
    timeout 200 python3 bench/step_profile.py --model "$M" --context 512 --tree-widths 23 41 \
        --json "$OUT/step_profile.json" > "$OUT/step_profile.log" 2>&1
    PROF=$?
else
    tail -3 "$OUT/syn.log"
fi
stamp "step_profile exit $PROF"

python3 - "$OUT" "$TESTS" "$BENCH" "$PROF" <<'PYEOF'
import json, os, sys
out, tests, bench, prof = sys.argv[1], *sys.argv[2:]
print(f"\n== summary: tests exit {tests}, gpu_deltanet_check exit {bench}, step_profile exit {prof}")
try:
    rows = json.load(open(os.path.join(out, "deltanet_bench.json")))["tree_steps"]
    print("48 DeltaNet layers, verify step (walk + plan) + commit of the deepest node by replay, ms (graph replay; "
          "ac764f9 on an H100: 0.963 + 0.176 at T = 23, 1.591 + 0.259 at T = 41)")
    print(f"{'T':>4}{'path':>6}{'step':>10}{'commit':>10}{'total':>10}")
    for r in rows:
        print(f"{r['T']:>4}{r['path']:>6}{r['step_ms']:>10.3f}{r['commit_ms']:>10.3f}{r['total_ms']:>10.3f}")
except Exception as e:  # noqa: BLE001
    print(f"(no deltanet timings: {type(e).__name__}: {e})")
try:
    rep = json.load(open(os.path.join(out, "step_profile.json")))
    steps = rep["steps"]
    base = steps[0].get("replay_us") or float("nan")
    print(f"\nstep_profile on {rep.get('device')} ({rep.get('model', '?').split('/')[-1]}, context 512): graph replay "
          f"ms, ratio to width 1 (issue 5: width 23 <= 1.3, width 41 <= 1.6; main on an H100: 9.36 / 15.62 / 31.6 ms)")
    for s in steps:
        k = {r["group"]: r["us"] for r in s["by_kernel"]}
        dn_us = sum(v for g, v in k.items() if g.startswith("gdr_"))
        rp = s.get("replay_us") or float("nan")
        print(f"   {s['label']:<24} replay {rp / 1e3:7.2f} ms  x{rp / base:5.2f}   eager gdr_* kernels "
              f"{dn_us / 1e3:6.3f} ms (main: 0.35 / 2.67 / 4.60)")
except Exception as e:  # noqa: BLE001
    print(f"(no step profile: {type(e).__name__}: {e})")
PYEOF
stamp "done"
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ] && [ "$PROF" -eq 0 ]
