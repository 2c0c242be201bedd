#!/bin/bash
# GPU machine: profile the products bench/ncu_probe.py launches with Nsight Compute (hardware counters; clocks left
# alone as the device notes ask). Report text in $OUT/ncu.txt (or ./ncu.txt). Usage: bash bench/ncu_run.sh [CASE ...]
source bench/device_env.sh || exit 1
OUTDIR=${OUT:-.}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
"$NCU" --clock-control none --kernel-name regex:'gemv|qmv|qmw|gdr_tree_walk|attn_' \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats \
    --metrics smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,dram__bytes_read.sum,lts__t_bytes.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
    python3 bench/ncu_probe.py "$@" > "$OUTDIR/ncu.txt" 2>&1
rc=$?
grep -E "case |gemv|qmv|qmw|gdr_tree_walk|attn_|DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Waves Per SM|Issued Warp|No Eligible|Stall|Warp Cycles Per Issued|Eligible Warps|Active Warps|stalled|dram__bytes|lts__t_bytes|hmma|inst_executed|warps_active" "$OUTDIR/ncu.txt" | head -300
exit $rc
