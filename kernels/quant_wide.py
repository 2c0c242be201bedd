"""Wide-token GPU matrix products (speculative verify: ~9..64 tokens per launch) on the v2 weight layout.

The kernel is quant_matmul.cu's `qmw_kernel` (it shares v2's dequantization, so its numerics are v2's); this module
is its launcher: `wide(W, packed, out)` for a QuantMatrix in the v2 layout and a PackedX. The warps of a block own
different row tiles and walk the same K chunks; per chunk the block stages x for all tokens in shared memory once,
next to the weight tiles, so x is read from L2 once per block instead of once per warp; the (row block, chunk) work
is split evenly over the blocks (stream-K), and row blocks shared by several blocks are added up in a fixed order
through the split scratch of kernels/quant_gemv.py: deterministic. `QuantMatrix.matmul` takes this kernel from
`CROSSOVER[qtype]` tokens (`DEEP_CROSSOVER` on deep, `TALL_CROSSOVER` on very tall, `HIGH_CROSSOVER` on other high
matrices: prefer_wide). `wide_swiglu(W, packed)` runs a stacked [gate | up] as the SwiGLU launch, whose writers put
fp16(silu(g) u) straight into the down product's packed x. Design and numbers: docs/gpu_quant_matmul.md ("wide").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import loader, quant_gemv
from . import quant_matmul as qm  # attributes are read at call time (quant_matmul imports this module too)

SOURCE = "quant_matmul.cu"
MAX_TOKENS = 64  # NT = 1..8 token tiles of 8
MAX_WARPS = 8  # computing warps per block (the launch bound, 288 threads, leaves room for a producer warp)
TILE_ROWS = 16
CHUNK = 256
SMEM_LIMIT = 227 * 1024
SMEM_PER_SM = 228 * 1024
BARRIER_BYTES = 16  # per stage: the full and empty mbarriers

# Dispatch and default launch shape, from the first H100 run (2026-11-26, commit d4f48fc, bench/gpu_wide_check.sh
# kernels: gemv / v2 / wide at widths 1..64 and the wide launch-shape sweep at 16 / 23 / 41 / 64 tokens on the 27B
# matrices; us, v2 vs the best swept wide shape). A kernel's time depends on the token tiles (TPAD = 8 ceil(T / 8)),
# so 16 stands for 9..16 and 23 for 17..24.
#   Q4_K ffn_up   17408x5120   16: 30.3 vs 30.6   23: 34.4 vs 33.6   41: 83.7 vs 41.8
#   Q4_K ssm_out   5120x6144   16: 14.7 vs 16.9   23: 16.6 vs 17.3   41: 32.0 vs 21.1
#   Q6_K ffn_up   17408x5120   16: 37.0 vs 41.5   23: 42.1 vs 43.4   41: 104  vs 47.4
#   Q4_K ffn_down  5120x17408  16: 34.9 vs 31.4   23: 36.8 vs 34.1   41: 80.8 vs 42.6
#   Q6_K ffn_down  5120x17408  16: 46.5 vs 41.3   23: 47.2 vs 43.6   41: 92.2 vs 47.3
#   Q6_K output  248320x5120   16: 538  vs 408    23: 609  vs 468    41: 761  vs 583
# (F16 / Q8_0, default shape (2, 8, 3) only: F16 ffn_up / ffn_down at 23 77.0 / 90.5 vs 70.9 / 72.2, at 16 67.4 /
# 73.2 vs 70.2 / 72.9; Q8_0 at 23 45.7 / 50.0 vs 47.7 / 50.9, at 32 68.4 / 61.8 vs 49.1 / 52.1.)
# v2 holds its own up to 24 tokens on matrices of moderate height and depth (ffn_up, the 5120x6144 projections), and
# falls behind from the first width of 4 token tiles everywhere; on deep matrices (k >= 2 n_out: ffn_down, whose 320
# row tiles leave v2 a few row groups per SM walking 68 chunks each) and very tall ones (the output matrix) the
# stream-K split wins from 9 tokens. So: the wide kernel from CROSSOVER[qtype] tokens, from DEEP_CROSSOVER[qtype] on
# deep matrices and TALL_CROSSOVER[qtype] on tall ones (a type missing there: CROSSOVER); gemv keeps the widths up to
# quant_gemv.CROSSOVER. (Those sweeps predate v2's address fix: DEEP_CROSSOVER was re-measured after it, below.)
# F16, Q8_0, Q4_K, Q6_K; Q5_K and IQ4_XS (v2's frag2 takes them; their GPU tests passed in session 40), Q4_0, IQ4_NL
# and Q3_K (session 41) as Q4_K here and in the tables below, but Q3_K on deep and high matrices from 2 tokens where
# x has no int16 staging for the ring (quant_gemv.RING_UP_TO): there the wide kernel beats v2 and the per-tile gemv
# (H200, 2 tokens: ffn_up 26.2 vs 29.4 / 28.8 us, ffn_down 26.7 vs 32.6 / 40.3; docs/benchmarks.md "Session 41")
CROSSOVER = {1: 17, 8: 25, 12: 25, 13: 25, 14: 25, 23: 25, 2: 25, 20: 25, 11: 25}
# the types the kernel has: those above (a type without a CROSSOVER entry: prefer_wide never picks the kernel for it,
# kernel="wide" runs it)
WIDE_QTYPES = frozenset((1, 2, 8, 11, 12, 13, 14, 20, 23))
# Deep: since v2 lost its per-load index math (ceea517) it is level with or ahead of the wide kernel on ffn_down up to
# 16-23 tokens (H100: Q4_K 31.3 vs 34.4 us at 16, 33.2 vs 33.0 at 23; Q6_K 41.2 vs 43.2 at 16, 44.2 vs 41.3 at 23);
# in the 27B step (graph replay, interleaved) these crossovers beat 9 everywhere: -0.4 / -1.0 / -0.9 / -0.8 % at 12 /
# 16 / 20 / 23 tokens (17 for both: -0.5 / -1.1 / +0.1 / 0.0 %). Tall (the output matrix): still from 9 (v2 592 vs
# wide 441 us at 23).
# With the bulk reduce-adds (BULK_ADDS) the wide kernel's accumulating ffn_down pulls ahead of v2's at 17..24 tokens on
# Q4_K too (23 tokens: 31.7 vs 34.6 us); step replays (bench/gemv_ab.py --step-ab deepq4, H100, 2026-11-27, three
# rounds) with Q4_K from 17 against 24: 0.9972 / 0.9976 / 0.9977 at widths 17 / 20 / 23 (from 20: 0.9996 / 0.9979 /
# 0.9976).
# Session 24 (H100, the step with the bulk adds and the peek: bench/gemv_ab.py --step-ab wide9, three rounds): the
# high and deep K-quant matrices from 9 against 17: 0.9975 / 0.9975 / 0.9971 at widths 9 / 12 / 16 (from 13: 1.0002 /
# 1.0003 / 0.9970); every other K-quant matrix from 17 instead of 25 lost (--step-ab xover17: 1.0039 / 1.0046 / 1.0047
# at 17 / 20 / 23; again in session 30, after the wide kernel's later changes: 1.0159 / 1.0196 / 1.022).
# Session 25 (the wide kernel under PDL, PDL above): the high and deep K-quant matrices from 4 against 9 (bench/
# gemv_ab.py --step-ab wide4, H100, three rounds): 0.932 / 0.927 / 0.931 at widths 4 / 6 / 8; every K-quant matrix
# from 4 (--step-ab all4) 1.032 / 1.033 / 1.040 / 1.037 of that at 4 / 8 / 12 / 16, the LM head from 4 too (tall4)
# 1.001-1.002: neither taken.
DEEP_CROSSOVER = {12: 4, 13: 4, 14: 4, 23: 4, 2: 4, 20: 4, 11: 2}  # (F16 / Q8_0: no sweep yet)
TALL_CROSSOVER = {12: 9, 13: 9, 14: 9, 23: 9, 2: 9, 20: 9, 11: 9}  # tall matrices (a type missing: DEEP_CROSSOVER)
TALL_ROWS = 65536  # a matrix of this many rows or more is "tall"
# A deep matrix of fewer rows keeps CROSSOVER. The 27B's attn_v (1024 x 5120, its own product where its type differs
# from q / k's) runs the wide kernel at 1.6x v2's time from 4 to 16 tokens (H200, Q4_K: 11.1 vs 6.9 us at 8;
# bench/roofline.py, session 40): 64 row tiles leave most of the wide kernel's stream-K blocks idle. The 27B Q4_K_M
# step on v2 there (bench/gemv_ab.py --step-ab smalldeep, H200, three rounds): 0.9972 / 0.9967 / 0.9967 / 1.0007 of
# the step before (0: every deep matrix from DEEP_CROSSOVER) at widths 4 / 8 / 16 / 23
DEEP_MIN_ROWS = 2048
# High (HIGH_ROWS rows or more, neither deep nor tall: the 27B's stacked ffn_gate|up of 34816 rows and the DeltaNet
# input stack of 16480) from 17 tokens, since the wide kernel's bookkeeping and split fences went (3c57947): Q4_K
# ffn_up 30.6 vs v2 31.1 us at 23 tokens (29.3 vs 28.8 at 16), and the 27B step (graph replay, H100, 2026-11-27)
# -2.5 / -2.3 / -2.4 % at widths 17 / 20 / 23; Q4_K's deep matrices from 17 as well gave back a third of that.
# (a type missing: CROSSOVER; from 9 in session 24, from 4 in 25: DEEP_CROSSOVER)
HIGH_CROSSOVER = {12: 4, 13: 4, 14: 4, 23: 4, 2: 4, 20: 4, 11: 2}
HIGH_ROWS = 16384
# Mid-high (MID_ROWS..HIGH_ROWS - 1 rows, neither deep nor tall: the attention's q|k|v and q|k stacks of 14336 / 13312
# rows, the DeltaNet attn_qkv of 10240 rows that the more-bits layers keep apart as Q6_K) from 17 tokens. Session 27
# (H100; scratch/s27_v2sweep.py, graph replays over weight copies): at 23 tokens Q4_K 14336 x 5120 wide 23.6 us vs v2
# 30.2, Q6_K 10240 x 5120 22.9 vs 27.0; at 16 22.0 vs 22.8 and 22.7 vs 24.0. The 27B step (bench/gemv_ab.py --step-ab
# high, three rounds) with the high rule from 10240 rows at every width: 1.0076 / 1.0076 / 1.0049 / 0.9919 at widths 4
# / 8 / 16 / 23 (from 6144 rows, the DeltaNet gate stack of 6240 too: 1.0079 / 1.0076 / 1.0071 / 0.9955), so these from
# 17 only; the 5120 x 6144 projections and the 6240-row gate stack keep v2 (at 23: 15.6 vs 15.3 us, 14.7 vs 13.7).
# Session 30 (--step-ab mid): this rule's step 0.9862 / 0.9869 / 0.9924 of v2 up to 24 at 17 / 20 / 23.
MID_CROSSOVER = {12: 17, 13: 17, 14: 17, 23: 17, 2: 17, 20: 17, 11: 17}  # (a type missing: CROSSOVER)
MID_ROWS = 10240
# x in the wgmma order (PackedX.order 1): the wide kernel from these widths on every matrix of the type (a type missing:
# the shape's crossover). Empty: a pack takes that order only for products the dispatch puts on the wide kernel anyway
# (wg_pack). Session 36 (H200, bench/gemv_ab.py --step-ab wgpack): with {Q4_K: 17, Q6_K: 17} (the 5120 x 6144
# projections on the wgmma build at 17..24 instead of v2 in the mma order; raw x in the mma order) the step ran
# 1/0.9949 and 1/0.9927 of the shipped one's time at 17 / 23 tokens (below, WG_FROM)
WG_CROSSOVER: dict[int, int] = {}
# Default launch shape (choose_config): m16 tiles per warp, warps per block, copy stages by token tiles, with as
# many blocks per SM as fit. The sweep's best shapes were nearly all 1 tile x 4 warps (64 rows per block): more,
# smaller blocks per SM hide the dequantization of one behind another's copies better than 8 warps x 2 tiles (the
# first estimate, 5-20% slower: Q4_K ffn_up 37.9 / 47.9 us at 23 / 41 tokens vs 33.9 / 41.8). Stages (each setting
# with all blocks that fit: fewer, deeper blocks at 3): 3 at 3 token tiles (Q4_K ffn_down 34.1 vs 37.8 us, ssm_out
# 17.3 vs 18.9, ffn_up 34.6 vs 33.9; Q6_K 43.4-43.6 either way), and for Q6_K at 2 tiles too (ffn_down 42.1 vs 47.8,
# ffn_up 42.1 vs 42.6; Q4_K there: ffn_up / ffn_down 32.5 / 32.5 vs 30.6 / 31.4 with 2); 2 from 4 tiles (Q4_K
# ffn_up at 41: 41.8 with 2, 45.2 with 3 at 2 blocks per SM). Tall matrices: 8 warps, 2 stages (Q6_K output 468 / 583
# us at 23 / 41 vs 492 / 620 with 4 warps; 3 stages are not among its best three at any width).
# With the producer warp (below), the sweep (H100, 2026-11-27) moved two of these: at 6 token tiles (41..48 tokens)
# Q4_K / Q6_K take 3 stages (2 blocks a SM either way, registers decide): ffn_up 36.6 / 43.8 us vs 37.4 / 44.9,
# Q6_K ffn_down 44.9 vs 45.6; and a K-quant tall matrix takes 2 tiles a warp, 4 warps at 3 / 4 token tiles and 8 at
# 6 / 8 (TALL_SHAPES): Q6_K output 403.6 vs 470.0 us at 23 tokens, 412.3 vs 499.9 at 32, 519.2 vs 544.1 at 41, 617.0
# vs 655.7 at 64 (at 16: 387.0 vs 390.0, not taken). The 27B step with both at 3 and 6 tiles (graph replays, widths
# 17 / 23 / 41 / 48): 0.995 / 0.995 / 0.990 / 0.991; the 4 and 8 tile entries are the sweep's alone.
M_TILES = 1
WARPS = 4
# token tiles at which a type takes 3 stages (2 at the others; a type missing: (3,))
# Session 27 (the sweep again, scratch/s27_widesweep.py): 3 stages at 4 token tiles too (32 tokens: Q4_K 5120 x 6144
# 15.9 vs 16.6 us, ffn_down 31.0 vs 31.8, the DeltaNet input 28.0 vs 28.7, Q6_K ffn_down 37.4 vs 39.0); the step
# (--step-ab wstages, with ACC_TILE_STAGES) 0.9847 at width 32 (41 / 48, which take 6 tiles: unchanged).
# Session 30: 5 token tiles (33..40 tokens), which no sweep had covered, too (--step-ab w5tiles, three rounds, with the
# tall shape at 5 below): the step 0.9643 / 0.9623 at widths 36 / 40 (the tall shape alone 0.9946 / 0.995); at 7 and 8
# tiles 3 stages lose (--step-ab w78tiles: 1.0115 / 1.0689 at 56 / 64).
STAGES3_TILES = {12: (3, 4, 5, 6), 13: (3, 4, 5, 6), 14: (2, 3, 4, 5, 6), 23: (3, 4, 5, 6), 2: (3, 4, 5, 6),
                 20: (3, 4, 5, 6), 11: (3, 4, 5, 6)}
# per type, token tiles -> (m16 tiles per warp, warps) of a matrix of VERY_HIGH_ROWS rows or more that is neither deep
# nor tall (the 27B's stacked gate|up of 34816 rows); elsewhere M_TILES, WARPS. Session 27 (H100): at 6 token tiles 8
# warps x 2 tiles (256 rows a block, one block a SM: x staged once for 4x the rows), Q4_K gate|up at 41 tokens 60.3 vs
# 63.6 us (scratch/s27_widesweep.py); the 27B step (bench/gemv_ab.py --step-ab veryhigh, three rounds) 0.9878 / 0.9882
# at widths 41 / 48 (4 warps x 2 tiles: 1.018 / 1.014). The DeltaNet input stack of 16480 rows kept 4 x 1 in the sweep.
# Q4_K only: no Q6_K matrix of the 27B is that high (and 3 of its stages would not fit in shared memory). Session 31
# (H200, --step-ab w7tiles): at 7 tiles too (with the tall shape there: 0.9824 / 0.974 at 52 / 56, against 0.997 /
# 0.990 for the tall shape alone; a second run 0.9888 / 0.9898 against 0.9985 / 1.0007); where the SwiGLU launch
# runs (SWIGLU_TILES) it stands in for this product.
VERY_HIGH_SHAPES: dict[int, dict[int, tuple[int, int]]] = {12: {6: (2, 8), 7: (2, 8)}}
VERY_HIGH_ROWS = 32768
TALL_WARPS, TALL_STAGES = 8, 2
# per type, token tiles -> (m16 tiles per warp, warps) of a tall matrix (elsewhere: M_TILES, TALL_WARPS); 5 tiles
# as 4 since session 30 (above); 7 as 6 and 8 since session 31 (H200, the 27B step with 2 x 8 at 7 tiles, --step-ab
# w7tiles, three rounds: 0.997 / 0.990 at widths 52 / 56). (Q6_K at 2 tiles a warp spills at 5 / 6 / 7 token tiles,
# 56 / 52 / 216 bytes of stores at the 168-register cap, nvcc 13 sm_90, and still wins there.)
TALL_SHAPES = {q: {3: (2, 4), 4: (2, 4), 5: (2, 4), 6: (2, 8), 7: (2, 8), 8: (2, 8)} for q in (12, 14)}
# A producer warp beside the computing warps (sm_90 bulk copies only: the kernel ignores it elsewhere) issues every
# copy, so no computing warp waits for a stage to empty before it computes. It holds a computing warp's registers,
# which can cost a block per SM (41 tokens: 3 blocks of 4 warps, 2 of 5); the grid counts it (H100 step replays,
# synthetic Q4_K_M, widths 17 / 23 / 32 / 41 / 64: 0.977 / 0.981 / 0.975 / 0.988 / 0.967 of the launches without
# it; taking it only where it keeps the blocks per SM: 0.974 / 0.977 / 0.996 / 0.998 / 0.966).
PRODUCER = True
# An accumulating launch (y += x @ W^T: the residual adds of ffn_down and the mixers' output projections) adds its
# sums into y by bulk reduce-adds from a shared-memory tile a warp (kernels/bulk.cuh) instead of a load-add-store,
# whose load stalled the writing warps while the memory system streamed weights (bench probe, H100, 23 tokens, per
# launch: Q4_K 34816x5120 60.8 -> 51.4 us, Q4_K 5120x17408 36.2 -> 31.5, Q6_K 5120x17408 43.4 -> 39.9; the same bits).
BULK_ADDS = True
# An accumulating launch whose default stages leave no room for the y tile of the bulk adds at the same grid takes
# fewer stages with the tile instead (its config's stages not given): session 27 (H100, scratch/s27_widesweep.py) Q6_K
# ffn_down 5120 x 17408 accumulating at 41 tokens: 3 stages and the load-add-store 51.0 us, 2 stages and the bulk adds
# 43.6 (its 3 stages of 38 KB and the 12 KB tile no longer fit two blocks a SM). The 27B step (bench/gemv_ab.py
# --step-ab wstages, three rounds): 0.9997 / 0.9835 / 0.9804 at widths 32 / 41 / 48.
ACC_TILE_STAGES = True
# A block's last row block, shared with one other block (the stream-K split of a matrix of more chunks a block than a
# row block has), is added up by its warps at once when the other block's pieces have arrived (it took that row
# block's last chunks as its first items), without storing this block's pieces, counting in and reading them back.
PEEK = True
# Programmatic dependent launch (kernels/pdl.cuh, loader.get_function's pdl) inside captured steps: the producer warp
# fills every stage with its item's weights before the grid dependency wait, so a launch's first weights stream while
# the pack ahead of it still runs, and it lets the next kernel launch early. H100, synthetic 27B Q4_K_M, step graph
# replays (bench/gemv_ab.py --step-ab widepdl, three rounds, 2026-11-27): 0.9706 / 0.9708 / 0.9825 / 0.9862 of the
# step without it at widths 9 / 16 / 23 / 41 (v2 the same way, quant_matmul.V2_PDL, gave back 0.7-4.5 %: off).
PDL = True
# A writer of a split row block (the last of its blocks to count in) loads the pieces two at a time before adding them
# in block order (the same sums), one round trip to L2 per two pieces; where the kernel's registers allow it (Q4_K at
# 17..24 tokens: quant_matmul.cu QmwPieceGroup). False: one at a time everywhere.
PIECE_GROUP = True
# ... at these token tiles by type, one m16 tile a warp (the source's default, SS_QMW_PG2_Q4K / _Q6K: Q4_K at 3). 4
# and 5 tiles cost no block a SM nor a spill (quant_matmul.cu), and gain nothing: the 27B step with both types at 4-5
# tiles (--step-ab pieces45, H200, session 31) 1.0006 / 0.9966 / 1.0008 / 0.9996 at widths 28 / 32 / 36 / 40.
PIECE_GROUP_TILES: dict[int, tuple[int, ...]] = {12: (3,), 14: ()}
_PG2_MACROS = {12: ("SS_QMW_PG2_Q4K", 1 << 3), 14: ("SS_QMW_PG2_Q6K", 0)}  # (macro, the source's default mask)
WARP_CHOICES = (8, 4, 2, 1)  # what choose_config falls back through when a shape does not fit (or a small matrix)
STAGE_CHOICES = (4, 3, 2)

_configured: dict[tuple, int] = {}


@dataclass(frozen=True)
class WideConfig:
    """Launch shape of qmw_kernel; 0 = choose_config's value. m_tiles: m16 tiles per warp (1, 2); warps: warps per
    block (1..8), each its own rows; stages: copy stages (2..4); blocks_per_sm: blocks the grid puts on each SM (0: as
    many as fit at once); blocks: the grid itself (0: from blocks_per_sm; any count >= 1 is correct)."""

    m_tiles: int = 0
    warps: int = 0
    stages: int = 0
    blocks_per_sm: int = 0
    blocks: int = 0


def chunk_block_bytes(qtype: int) -> int:
    """Bytes of one 16-row tile block of a full 256-value chunk in the v2 layout."""
    main, side = qm._CHUNK_ROW_BYTES[int(qtype)]
    return TILE_ROWS * (main + side)


def smem_bytes(qtype: int, n_tiles: int, m_tiles: int, warps: int, stages: int, ytile: bool = False,
               wg: bool = False) -> int:  # fmt: skip
    """Dynamic shared memory of one block: per stage a chunk of packed x for 8 n_tiles tokens and the block's
    warps x m_tiles tile blocks, plus the stage's two mbarriers; ytile: and the tile a warp through which an
    accumulating launch adds its sums into y (bulk reduce-adds, sm_90); wg (the wgmma build): stages rounded up to
    whole 512-byte swizzle atoms."""
    tile = warps * m_tiles * TILE_ROWS * 8 * n_tiles * 4 if ytile else 0
    stage = 512 * 8 * n_tiles + warps * m_tiles * chunk_block_bytes(qtype)
    if wg:
        stage = -(-stage // 512) * 512
    return stages * (stage + BARRIER_BYTES) + tile


def row_blocks(n_out: int, m_tiles: int, warps: int) -> int:
    tiles = -(-n_out // TILE_ROWS)
    return -(-tiles // (m_tiles * warps))


def scratch_floats(blocks: int, n_tiles: int, m_tiles: int, warps: int) -> int:
    """Partial-sum scratch a launch needs: two slots per block (its first and last row block), each warps x
    (m_tiles 16 rows x 8 n_tiles tokens) floats."""
    return 2 * blocks * warps * m_tiles * TILE_ROWS * 8 * n_tiles


def prefer_wide(qtype: int, tokens: int, n_out: int = 0, k: int = 0, order: int = 0) -> bool:
    """matmul()'s choice for an n_out x k matrix in the v2 layout above gemv's widths: this kernel from
    CROSSOVER[qtype] tokens, from TALL_CROSSOVER[qtype] on a tall matrix (n_out >= TALL_ROWS), from
    DEEP_CROSSOVER[qtype] on a deep one (k >= 2 n_out) of DEEP_MIN_ROWS rows or more, from HIGH_CROSSOVER[qtype] on
    another of HIGH_ROWS rows or more, from MID_CROSSOVER[qtype] on one of MID_ROWS..HIGH_ROWS - 1 rows (shape
    unknown, 0: the CROSSOVER); x in the wgmma order (order 1): from WG_CROSSOVER[qtype] on any matrix where that
    comes first."""
    qtype = int(qtype)
    if order and WG_CROSSOVER.get(qtype, MAX_TOKENS + 1) <= tokens <= MAX_TOKENS:
        return True
    first = CROSSOVER.get(qtype, MAX_TOKENS + 1)
    if n_out > 0 and (k >= 2 * n_out or n_out >= TALL_ROWS):
        if n_out >= DEEP_MIN_ROWS:
            first = DEEP_CROSSOVER.get(qtype, first)
        if n_out >= TALL_ROWS:
            first = TALL_CROSSOVER.get(qtype, first)
    elif n_out >= HIGH_ROWS:
        first = HIGH_CROSSOVER.get(qtype, first)
    elif n_out >= MID_ROWS:
        first = MID_CROSSOVER.get(qtype, first)
    return first <= tokens <= MAX_TOKENS


def _defines(portable: bool) -> tuple[str, ...]:
    out = (("SPECSPLIT_PORTABLE",) if portable else ()) + (() if PIECE_GROUP else ("SPECSPLIT_QMW_PIECES_ONE",))
    out += qm.weight_defines()
    for qtype, (macro, default) in _PG2_MACROS.items():  # (only where they differ: the default build keeps its key)
        mask = sum(1 << t for t in PIECE_GROUP_TILES.get(qtype, ()))
        if PIECE_GROUP and mask != default:
            out += (f"{macro}={mask}",)
    return out


def wide_function(qtype: int, n_tiles: int, m_tiles: int, portable: bool = False, swiglu: bool = False,
                  wg: bool = False, order: int = 0) -> Any:  # fmt: skip
    """The compiled kernel for one storage type, token-tile count (1..8) and m16 tiles per warp (1, 2); swiglu: its
    SwiGLU instance (wide_swiglu; m_tiles 2); wg: its wgmma build (sm_90a; x in wg_order, the SwiGLU writer's too);
    order: else the PackedX.order it reads (and a SwiGLU instance writes): 1 its build with SPECSPLIT_XO_WG."""
    qtype = int(qtype)
    if qtype not in WIDE_QTYPES:
        raise ValueError(f"no GPU wide kernel for {qm.type_name(qtype)}")
    if not 1 <= n_tiles <= MAX_TOKENS // 8:
        raise ValueError(f"n_tiles must be 1..{MAX_TOKENS // 8}, not {n_tiles}")
    if m_tiles not in (1, 2) or (swiglu and m_tiles != 2):
        raise ValueError(f"m_tiles must be 1 or 2 (2 for SwiGLU), not {m_tiles}")
    if wg and portable:
        raise ValueError("the wgmma build has no portable form")
    defines = _defines(portable) + (("SPECSPLIT_QMW_WG",) if wg else ("SPECSPLIT_XO_WG",) if order else ())
    if wg and WG_DEPTH.get(qtype, 2) != 2:  # (the default build keeps its key)
        defines += (f"SS_WG_DEPTH={WG_DEPTH[qtype]}",)
    mt = f"{m_tiles}, 1" if swiglu else m_tiles
    fn = loader.get_function(SOURCE, f"qmw_kernel<{qtype}, {n_tiles}, {mt}>", defines, pdl=PDL and not portable)
    key = (SOURCE, qtype, n_tiles, m_tiles, bool(swiglu), defines, qm._device_id())
    if key not in _configured:
        fn.max_dynamic_shared_size_bytes = SMEM_LIMIT  # opt in above the 48 KiB default once
        _configured[key] = SMEM_LIMIT
    return fn


def warmup(qtypes=tuple(CROSSOVER), n_tiles=range(1, MAX_TOKENS // 8 + 1), m_tiles=(M_TILES,),
           portable: bool = False) -> None:  # fmt: skip
    """Compile the kernels up front (each is built on first use otherwise)."""
    for q in qtypes:
        for nt in n_tiles:
            for mt in m_tiles:
                wide_function(q, nt, mt, portable)


def choose_config(qtype: int, n_out: int, k: int, tokens: int, config: WideConfig | None = None) -> WideConfig:
    """The launch shape for a width with every 0 of `config` filled in: M_TILES tiles per warp, WARPS warps, 3 stages
    at STAGES3_TILES token tiles and 2 at the others (a tall matrix: TALL_SHAPES, TALL_STAGES), as many blocks per SM
    as fit; falling back through fewer warps (never more than the matrix has tile groups: a small matrix keeps its
    blocks' warps busy) and then fewer stages until the shape fits in shared memory."""
    cfg = config or WideConfig()
    n_tiles = (min(max(tokens, 1), MAX_TOKENS) + 7) // 8
    tall = n_out >= TALL_ROWS
    tall_mt, tall_w = TALL_SHAPES.get(int(qtype), {}).get(n_tiles, (M_TILES, TALL_WARPS))
    high = not tall and n_out >= VERY_HIGH_ROWS and k < 2 * n_out
    high_mt, high_w = VERY_HIGH_SHAPES.get(int(qtype), {}).get(n_tiles, (M_TILES, WARPS)) if high else (M_TILES, WARPS)
    mt = cfg.m_tiles or (tall_mt if tall else high_mt)
    tiles = -(-n_out // TILE_ROWS)
    want_w = tall_w if tall else high_w
    want_s = TALL_STAGES if tall else 3 if n_tiles in STAGES3_TILES.get(int(qtype), (3,)) else 2
    fits_rows = [w for w in WARP_CHOICES if w <= want_w and w * mt <= max(tiles, mt)] or [1]
    warp_choices = (cfg.warps,) if cfg.warps else tuple(fits_rows)
    stage_choices = (cfg.stages,) if cfg.stages else tuple(st for st in STAGE_CHOICES if st <= want_s)
    for w in warp_choices:
        for st in stage_choices:
            if smem_bytes(qtype, n_tiles, mt, w, st) <= SMEM_LIMIT:
                return WideConfig(mt, w, st, cfg.blocks_per_sm, cfg.blocks)
    return WideConfig(mt, warp_choices[-1], stage_choices[-1], cfg.blocks_per_sm, cfg.blocks)  # check() refuses it


def check(qtype: int, n_tiles: int, cfg: WideConfig) -> None:
    if cfg.m_tiles not in (1, 2):
        raise ValueError(f"m_tiles must be 1 or 2, not {cfg.m_tiles}")
    if not 1 <= cfg.warps <= MAX_WARPS:
        raise ValueError(f"warps must be 1..{MAX_WARPS}, not {cfg.warps}")
    if not 2 <= cfg.stages <= 4:
        raise ValueError(f"stages must be 2..4, not {cfg.stages}")
    if cfg.blocks < 0 or cfg.blocks_per_sm < 0:
        raise ValueError(f"blocks and blocks_per_sm must be >= 0: {cfg}")
    smem = smem_bytes(qtype, n_tiles, cfg.m_tiles, cfg.warps, cfg.stages)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{cfg} needs {smem} bytes of shared memory at {8 * n_tiles} tokens (limit {SMEM_LIMIT})")


def bulk_adds(portable: bool = False) -> bool:
    """Whether an accumulating launch may add into y by bulk reduce-adds (BULK_ADDS, sm_90+ CUDA, inline PTX allowed:
    the conditions under which the kernel is built with SS_BULK)."""
    if not BULK_ADDS or portable:
        return False
    cupy = loader.require()
    return not getattr(cupy.cuda.runtime, "is_hip", False) and loader.compute_capability() >= 90


def producer_warps(portable: bool = False) -> int:
    """1 where launches take the producer warp (PRODUCER, an sm_90+ CUDA device, inline PTX allowed), else 0. These
    are the conditions under which the kernel is built with SS_BULK (kernels/bulk.cuh); keep them in step: a
    kernel without it would count the extra warp as a computing one."""
    if not PRODUCER or portable:
        return 0
    cupy = loader.require()
    return int(not getattr(cupy.cuda.runtime, "is_hip", False) and loader.compute_capability() >= 90)


def blocks_per_sm(warps: int, regs: int, smem: int) -> int:
    """Blocks of `warps` warps of `regs` registers and `smem` bytes of shared memory one SM holds at once."""
    return loader.resident_blocks(warps, regs, smem, SMEM_PER_SM)


def grid(n_out: int, k: int, cfg: WideConfig, regs: int, smem: int, sms: int, producer: int = 0) -> int:
    """Blocks of a launch: cfg.blocks, else blocks_per_sm (cfg's, capped by what fits, or all that fit) on every SM, at
    most one per (row block, chunk) item."""
    items = row_blocks(n_out, cfg.m_tiles, cfg.warps) * -(-k // CHUNK)
    if cfg.blocks:
        return cfg.blocks
    fit = blocks_per_sm(cfg.warps + producer, regs, smem)
    per_sm = min(cfg.blocks_per_sm, fit) if cfg.blocks_per_sm else fit
    return max(1, min(items, per_sm * sms))


def tile_stages(cfg: WideConfig, config: WideConfig | None = None) -> tuple[int, ...]:
    """The stages an accumulating launch of resolved shape cfg tries with the bulk adds' y tile, in order: cfg's, then
    (ACC_TILE_STAGES, where the caller's config left the stages open) fewer, down to 2."""
    if ACC_TILE_STAGES and not (config is not None and config.stages):
        return tuple(range(cfg.stages, 1, -1))
    return (cfg.stages,)


def scratch_need(qtype: int, n_out: int, k: int, tokens: int, sms: int) -> tuple[int, int]:
    """(partial-sum floats, counters) of quant_gemv.split_scratch that a default launch at this width takes at most,
    without the compiled kernel: its grid with the register limit left out (registers only lower the blocks that fit;
    from 25 tokens shared memory already keeps one block per SM), and a SwiGLU launch's (wide_swiglu) where the
    matrix could be a [gate | up] stack. What the memory plan sizes the scratch by."""
    n_tiles = (min(max(tokens, 1), MAX_TOKENS) + 7) // 8
    cfg = choose_config(qtype, n_out, k, tokens)
    # (an accumulating launch may take fewer stages with the y tile, where that fits as many blocks or more)
    blocks = max(grid(n_out, k, replace(cfg, stages=st), 1, smem_bytes(qtype, n_tiles, cfg.m_tiles, cfg.warps, st,
                                                                       st != cfg.stages), sms)
                 for st in tile_stages(cfg))
    part = scratch_floats(blocks, n_tiles, cfg.m_tiles, cfg.warps)
    counters = row_blocks(n_out, cfg.m_tiles, cfg.warps) * cfg.warps
    if cfg.warps % 4:  # the wgmma build's whole warpgroups (launch_shape)
        wg = choose_config(qtype, n_out, k, tokens, WideConfig(warps=4))
        wg_blocks = grid(n_out, k, wg, 1, smem_bytes(qtype, n_tiles, wg.m_tiles, wg.warps, wg.stages, wg=True), sms)
        part = max(part, scratch_floats(wg_blocks, n_tiles, wg.m_tiles, wg.warps))
        counters = max(counters, row_blocks(n_out, wg.m_tiles, wg.warps) * wg.warps)
    if swiglu_stack(qtype, n_out) and swiglu_width(qtype, tokens):  # a [gate | up] stack's SwiGLU launch
        sw = choose_config(qtype, n_out, k, tokens, swiglu_config(qtype, tokens))
        sw_blocks = grid(n_out, k, sw, 1, smem_bytes(qtype, n_tiles, sw.m_tiles, sw.warps, sw.stages), sms)
        part = max(part, scratch_floats(sw_blocks, n_tiles, sw.m_tiles, sw.warps))
        counters = max(counters, row_blocks(n_out, sw.m_tiles, sw.warps) * sw.warps)
    return part, counters


def launch_shape(W: Any, tokens: int, config: WideConfig | None = None, portable: bool = False,
                 accumulate: bool = False, swiglu: bool = False, wg: bool = False, order: int = 0) -> dict:  # fmt: skip
    """What a launch of W at this width runs as: the resolved config, registers, shared memory, grid, row blocks, and
    whether an accumulating launch takes the y tile (bulk reduce-adds; not where the tile would not fit). swiglu: the
    SwiGLU instance's (wide_swiglu: config's m_tiles must be 2); wg: the wgmma build's (wg_usable); order: the x it
    reads (wide_function)."""
    n_out, k = W.shape
    n_tiles = (tokens + 7) // 8
    cfg = choose_config(W.qtype, n_out, k, tokens, config)
    if wg and cfg.warps % 4 and not (config is not None and config.warps):  # whole warpgroups, even on a small matrix
        cfg = choose_config(W.qtype, n_out, k, tokens, replace(config or WideConfig(), warps=4))
    check(W.qtype, n_tiles, cfg)
    if wg and not wg_usable(cfg):
        raise ValueError(f"the wgmma build needs whole warpgroups (warps a multiple of 4): {cfg}")
    kern = wide_function(W.qtype, n_tiles, cfg.m_tiles, portable, swiglu, wg, order)
    regs = int(getattr(kern, "num_regs", 0) or 255)
    prod = producer_warps(portable)
    smem = smem_bytes(W.qtype, n_tiles, cfg.m_tiles, cfg.warps, cfg.stages, wg=wg)
    blocks = grid(n_out, k, cfg, regs, smem, qm.sm_count(), prod)
    ytile = False
    if accumulate and bulk_adds(portable):  # the tile only where it keeps the blocks a SM (so the split) or adds some:
        for st in tile_stages(cfg, config):  # at cfg's stages, else (ACC_TILE_STAGES) at fewer
            c = replace(cfg, stages=st)
            tiled = smem_bytes(W.qtype, n_tiles, c.m_tiles, c.warps, st, True, wg)
            tiled_blocks = grid(n_out, k, c, regs, tiled, qm.sm_count(), prod) if tiled <= SMEM_LIMIT else 0
            if tiled_blocks >= blocks:
                cfg, ytile, smem, blocks = c, True, tiled, tiled_blocks
                break
    return {"config": cfg, "kernel": kern, "regs": regs, "smem": smem, "blocks": blocks, "producer": prod,
            "row_blocks": row_blocks(n_out, cfg.m_tiles, cfg.warps), "ytile": ytile}  # fmt: skip


def wide(
    W: Any,
    packed: Any,
    out: Any,
    *,
    accumulate: bool = False,
    config: WideConfig | None = None,
    portable: bool = False,
    wg: bool | None = None,
) -> Any:
    """out (+)= x @ W^T for a QuantMatrix W in the v2 layout and a PackedX of 1..64 tokens; returns out.

    out: float32 [T, W.out_features], rows contiguous and possibly strided (a column slice of a wider output:
    qm.check_out). accumulate=True adds into out (each value once, after its sum is complete). x in the wgmma order
    (PackedX.order 1) runs the wgmma build (sm_90a) where wg_takes says (wg None) or wg says, else the mma.sync build
    that reads that order; wg=True on x in the mma order is an error."""
    tokens = qm.check_v2_product(W, packed, out, "wide", MAX_TOKENS)
    if wg and packed.order != 1:
        raise ValueError(f"{W.name}: the wgmma build reads x in its own order (PackedX.order 1), "
                         f"not order {packed.order}")
    if wg is None:
        wg = packed.order == 1 and not portable and wg_takes(W.qtype, tokens)
    shape = launch_shape(W, tokens, config, portable, accumulate, wg=wg, order=packed.order)
    _launch(W, packed, out, shape, accumulate, qm.out_stride(out))
    return out


# The wgmma build (qmw_kernel with SPECSPLIT_QMW_WG, sm_90a): the same sums bit for bit as the mma.sync build (H200,
# session 35), 0.93-0.94 of its time on the 27B's Q4_K matrices at 17..32 tokens and 0.81-0.87 from 41 (Q6_K 1.03-1.07
# at 23..32, 0.96 at 41). A model whose every matrix can run it (wg_capable) packs x in its order from WG_FROM tokens;
# the products of those packs keep their dispatch, the wide ones on this build (WG_TYPES), v2 and the mma.sync build
# reading the order with four 32-bit loads a unit. The 27B step (bench/gemv_ab.py --step-ab wgmma): 0.962 / 0.927 at
# 32 / 41 tokens; from 17, 1.0085 at 23 (v2's extra loads cost what the wgmma products gain). Session 36 (H200,
# --step-ab wgmma17): from 17 with every K-quant product of the packs on the wide kernel (WG_CROSSOVER) 0.9913 /
# 0.9964 / 0.9959 at 17 / 20 / 23, and with Q6_K's on the mma.sync build 0.9878 / 0.9884 / 0.9895; then (--step-ab
# wg17) with Q6_K's on the wgmma build from 41, 0.9855 / 0.9883 / 1.0094 / 0.9954 of session 35's at 17 / 23 / 32 /
# 41: Q6_K from 25 (in the step its wgmma build wins at 32, alone it lost 1.03 there). So: from 17, each pack in the
# order where its products run the wide kernel (wg_pack). SPECSPLIT_WGMMA=0 (or WGMMA = False): never.
WGMMA = True
WG_FROM = 17
# per storage type, the width from which a product of x in the wgmma order runs the wgmma build (below it, or a type
# missing: the mma.sync build reading that order)
WG_TYPES: dict[int, int] = {1: 1, 8: 1, 12: 1, 13: 1, 14: 25, 23: 1, 2: 1, 20: 1, 11: 1}
# A-fragment register sets the wgmma build keeps in flight, per storage type (2..4, missing: 2; a word pair's
# dequantization overlaps the groups of depth - 1 pairs before it; SS_WG_DEPTH). 2 measured (session 35); 3 costs Q4_K
# at 3 token tiles 121 -> 148 registers (a block a SM fewer), Q6_K 128 -> 152 (its 2 blocks a SM are set by shared
# memory): prepared for the Q6_K question (docs/gpu_quant_matmul.md "wide on wgmma")
WG_DEPTH: dict[int, int] = {}


def wg_takes(qtype: int, tokens: int) -> bool:
    """Whether a product of x in the wgmma order takes the wgmma build (WG_TYPES) where the device has it."""
    return WG_TYPES.get(int(qtype), MAX_TOKENS + 1) <= tokens and loader.arch_specific_available()


def wg_pack(matrices: Any, tokens: int) -> bool:
    """Whether packed x of this many tokens that `matrices` (QuantMatrix, the products of one PackedX) read is written
    in the wgmma order: every product runs the wide kernel on it (the dispatch of x in that order: prefer_wide,
    WG_CROSSOVER) and one on the wgmma build at least (wg_takes). Elsewhere the mma order serves: v2 reads the wgmma
    order with four loads a unit, the mma.sync build too, and the fp16-x gemv not at all."""
    mats = list(matrices)
    q16 = tokens <= qm.Q16_TOKENS  # (a pack writes its int16 staging up to these widths)
    return bool(mats) and all(
        getattr(m, "kernel", None) == "v2" and not quant_gemv.prefer_gemv(m.qtype, m.shape[1], tokens, q16)
        and prefer_wide(m.qtype, tokens, *m.shape, order=1) for m in mats) and any(
        wg_takes(m.qtype, tokens) for m in mats)  # fmt: skip


def raw_wg_order(W: Any, tokens: int, kernel: str | None = None, config: Any = None, splits: int | None = None,
                 portable: bool = False) -> bool:
    """Whether QuantMatrix.matmul(wg_order=True) packs raw x of this many tokens in the wgmma order: where its
    dispatch (kernel, config, splits as matmul takes them) runs the product on the wgmma build (wg_pack for its own
    choice; a forced wide kernel or WideConfig of whole warpgroups where wg_takes)."""
    if getattr(W, "kernel", None) != "v2" or portable or splits is not None or kernel not in (None, "wide"):
        return False
    if config is not None:  # (a WideConfig forces the wide kernel; any other config another one)
        return isinstance(config, WideConfig) and wg_usable(config) and wg_takes(W.qtype, tokens)
    return wg_takes(W.qtype, tokens) if kernel == "wide" else wg_pack([W], tokens)


def wg_capable(matrices: Any) -> bool:
    """Whether a model's packs may take the wgmma order (PackedX.order 1, from WG_FROM tokens): WGMMA is on (and
    SPECSPLIT_WGMMA not 0), the device has the arch-specific sm_90a target, and every QuantMatrix of `matrices` can run
    that build (the v2 layout)."""
    import os

    if not WGMMA or os.environ.get("SPECSPLIT_WGMMA", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return loader.arch_specific_available() and all(getattr(m, "kernel", None) == "v2" for m in matrices)


def wg_usable(cfg: WideConfig) -> bool:
    """Whether a launch shape can run the wgmma build: whole warpgroups (any K: a F16 / Q8_0 tail chunk too)."""
    return cfg.warps % 4 == 0


def wg_order(data: Any, tokens_pad: int) -> Any:
    """Packed x (PackedX.data, TPAD = tokens_pad rows; NumPy or CuPy) in the wgmma build's
    order: in each 64-byte (chunk, unit pair p, token n) record, 16-byte chunk c ^ ((n >> 1) & 3) holds word c of
    every lane t's unit (t = 0..3), where packed x holds lane t's four words together (qmw_kernel's SS_WG notes)."""
    xp = loader.require() if not isinstance(data, np.ndarray) else np
    words = data.view(xp.uint32).reshape(-1, tokens_pad, 4, 4)  # [(chunk, p), n, lane t, word c] (a tail too)
    by_word = words.transpose(0, 1, 3, 2)  # [.., n, c, t]
    n = xp.arange(tokens_pad)
    src_c = xp.arange(4)[None, :] ^ ((n[:, None] >> 1) & 3)  # [n, c']: the chunk c stored at c'
    out = xp.take_along_axis(by_word, src_c[None, :, :, None], axis=2)
    return xp.ascontiguousarray(out).reshape(-1).view(data.dtype).reshape(data.shape)


def _launch(W: Any, packed: Any, y: Any, shape: dict, accumulate: bool = False, ldy: int = 0) -> None:
    """One qmw_kernel launch of a resolved launch_shape (wide, wide_swiglu): its split scratch, grid and arguments."""
    n_out, k = W.shape
    cfg, blocks = shape["config"], shape["blocks"]
    part, counters = quant_gemv.split_scratch(
        shape["row_blocks"] * cfg.warps, scratch_floats(blocks, packed.n_tiles, cfg.m_tiles, cfg.warps)
    )
    shape["kernel"](
        (blocks,),
        (32 * (cfg.warps + shape["producer"]),),
        (W.device_buffer, np.int64(W.row_bytes), np.int32(n_out), np.int32(k), packed.data, np.int32(packed.tokens),
         y, np.int32(cfg.stages), np.int32(bool(accumulate)), np.int64(ldy), part, counters,
         np.int32(shape["producer"]), np.int32(shape["ytile"]), np.int32(bool(PEEK))),
        shared_mem=shape["smem"],
    )  # fmt: skip


# SwiGLU in the gate|up launch (wide_swiglu): from quant_gemv's widths on (Q16_TOKENS + 1: the ring gemv stages its own
# below) wherever the gate|up stack runs on this kernel, its writers put fp16(silu(g) u) straight into ffn_down's
# packed x: no [T, 2 F] f32 output and no pack launch between the two products (the same values up to the rounding of
# split row blocks' sums, whose pieces fall elsewhere: wide_swiglu). m_tiles is 2: a warp's gate tile and its up tile.
SWIGLU_TYPES = frozenset((12, 14))  # Q4_K, Q6_K
# the token tiles (8 tokens each) at which steps take the SwiGLU launch; others the product and the pack. Registers
# (nvcc 13.0 sm_90 ptxas): Q4_K 108 / 121 / 128 / 152 / 168 at 1 / 2 / 3 / 4 / 5..7 tiles, 196 bytes of spills at 8;
# Q6_K 128 / 137 / 156 / 166 at 1..4, spills from 5. H100, the 27B's Q4_K gate|up 34816 x 5120 alone
# (scratch/s28_swiglu.py, graph replays over weight copies): the launch / the product + the pack 0.960 / 0.960 / 0.943
# / 0.943 at 8 / 16 / 23 / 32 tokens with 4 warps (2 warps: 0.986 / 0.995 / 1.138 / 1.577; 8 warps: 1.054 / 1.058 /
# 1.020 / 0.944), but 1.217 / 1.223 at 41 / 48 (8 warps 1.029 / 1.028: at 6 token tiles two tiles a warp leave one
# block a SM). The 27B step (bench/gemv_ab.py --step-ab wswiglu, graph replays, three rounds): 0.986 / 1.0137 / 0.9754 /
# 0.9939 at widths 8 / 16 / 23 / 32 with 4 warps (8 warps 1.0068 / 1.0059 / 0.994 / 0.9946); at 2 tiles (9..16
# tokens) with 3 stages instead of choose_config's 2 (--step-ab wswiglu2): 0.9703 / 0.9691 at 12 / 16 (alone 0.919 /
# 0.915; 2 warps x 3 stages 1.0103 / 1.0065, 2 x 4 1.0015 / 0.9972, 8 warps 1.0049 / 1.0024). Q6_K follows Q4_K (the
# 27B has no Q6_K gate|up to measure). Q4_K at 5 token tiles (33..40 tokens) with 8 pairs a row block and 3 stages
# (session 29, after the writer's SiLUs went ahead of its shuffles; --step-ab wswiglu6): 0.9863 of the product + the
# pack at 36; at 6 tiles 0.9989 / 0.9967 at 41 / 48 with accurate SiLUs (alone 1.009 / 1.007: 8 us over the product
# of the same shape, its writers' exponentials and divides), 0.9949 / 0.994 with hf::silu's fast ones: taken. At 7
# tiles (49..56 tokens; session 31, H200, --step-ab w7tiles, three rounds) with 8 pairs and 2 stages: the step 0.9685
# / 0.9634 at 52 / 56 of the shipped one before (the product there 1 x 4 and the pack), against 0.9824 / 0.974 for the
# product as 2 x 8 and the pack: taken (no spills: Q4_K <7 tiles, 2, SwiGLU> keeps to 168 registers); a second run,
# the before / shipped entry: 0.9774 / 0.98. Q6_K spills from 5 tiles.
SWIGLU_TILES = {12: (1, 2, 3, 4, 5, 6, 7), 14: (1, 2, 3, 4)}
# The launch shape: SWIGLU_SHAPES (type -> token tiles -> (warps, i.e. gate / up tile pairs a row block, and stages;
# 0: the default)), else SWIGLU_WARPS and choose_config's stages
SWIGLU_WARPS = 4
SWIGLU_SHAPES: dict[int, dict[int, tuple[int, int]]] = {12: {2: (4, 3), 5: (8, 3), 6: (8, 3), 7: (8, 2)},
                                                        14: {2: (4, 3)}}


def swiglu_stack(qtype: int, n_out: int) -> bool:
    """Whether a matrix of this type and row count can be a SwiGLU launch's [gate | up] stack: Q4_K / Q6_K, 2 F rows
    with F a multiple of 256 (whole chunks of the down product's K)."""
    return int(qtype) in SWIGLU_TYPES and n_out % (2 * CHUNK) == 0


def swiglu_width(qtype: int, tokens: int) -> bool:
    """Whether a step of this width takes the SwiGLU launch on a stack of this type (SWIGLU_TILES; above quant_gemv's
    ring widths, whose gate|up stages SwiGLU itself)."""
    return qm.Q16_TOKENS < tokens <= MAX_TOKENS and (tokens + 7) // 8 in SWIGLU_TILES.get(int(qtype), ())


def can_swiglu(gate_up: Any, down: Any, tokens: int, order: int = 0) -> bool:
    """Whether wide_swiglu can stand in for gate_up's product and the SwiGLU pack at this width: a stacked [gate | up]
    of 2 F rows in the v2 layout that the dispatch runs on this kernel (prefer_wide), F a multiple of 256 (whole
    chunks of down's K) and down's in-features, and a width down reads as packed fp16 x (above the ring gemv's) of
    SWIGLU_TILES' token tiles (swiglu_width)."""
    n_out, k = gate_up.shape
    return (getattr(gate_up, "kernel", None) == "v2" and swiglu_stack(gate_up.qtype, n_out)
            and down.shape[1] == n_out // 2 and swiglu_width(gate_up.qtype, tokens)
            and prefer_wide(gate_up.qtype, tokens, n_out, k, order))  # fmt: skip


def swiglu_config(qtype: int, tokens: int, config: WideConfig | None = None) -> WideConfig:
    """wide_swiglu's launch shape before choose_config fills it: m_tiles 2, SWIGLU_SHAPES' warps and stages (else
    SWIGLU_WARPS and choose_config's stages) where `config` leaves them 0."""
    cfg = config or WideConfig()
    if cfg.m_tiles not in (0, 2):
        raise ValueError(f"a SwiGLU launch runs 2 tiles a warp (a gate tile and its up tile), not {cfg.m_tiles}")
    n_tiles = (min(max(tokens, 1), MAX_TOKENS) + 7) // 8
    warps, stages = SWIGLU_SHAPES.get(int(qtype), {}).get(n_tiles, (0, 0))
    return replace(cfg, m_tiles=2, warps=cfg.warps or warps or SWIGLU_WARPS, stages=cfg.stages or stages)


def wide_swiglu(W: Any, packed: Any, *, out: Any = None, config: WideConfig | None = None,
                portable: bool = False) -> Any:  # fmt: skip
    """fp16(silu(g) * u) for [g | u] = x @ W^T, W a stacked [gate | up] QuantMatrix (2 F rows, v2 layout, F a
    multiple of 256), as a PackedX of F features for the down product (its fp16 data only): one launch, with
    quant_matmul.pack_activations(g, silu_up=u)'s arithmetic on the product's sums. Those are bitwise a plain launch's
    where one block covers each row block; split row blocks add their pieces in a fixed order (the same bits launch
    after launch), but where this launch's split puts them (its row blocks pair gate and up tiles), so the last bit
    may differ from the plain product's. out: a contiguous uint16 array of F x padded tokens halves to write (None: a
    new one)."""
    n_out = W.shape[0]
    f = n_out // 2
    tokens = qm.check_v2_product(W, packed, None, "wide", MAX_TOKENS)
    if packed.data is None:
        raise ValueError(f"{W.name}: the wide kernel reads packed fp16 x; this PackedX holds the int16 staging alone")
    if not swiglu_stack(W.qtype, n_out):
        raise ValueError(f"{W.name}: a SwiGLU launch takes a Q4_K / Q6_K [gate | up] stack of 2 F rows, F a multiple "
                         f"of {CHUNK}; not {qm.type_name(W.qtype)} with {n_out} rows")
    cupy = loader.require()
    size = f * packed.padded_tokens
    if out is None:
        out = cupy.empty(size, dtype=cupy.uint16)
    elif out.dtype != cupy.uint16 or out.size != size or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint16 array of {size} elements")
    wg = packed.order == 1 and not portable and wg_takes(W.qtype, tokens)
    shape = launch_shape(W, tokens, swiglu_config(W.qtype, tokens, config), portable, swiglu=True, wg=wg,
                         order=packed.order)
    _launch(W, packed, out, shape)
    return qm.PackedX(out, tokens, f, order=packed.order)  # (either build writes the order it reads)
