"""Small-width (T <= 16) GPU matrix-vector products on the v2 weight layout: kernels/quant_gemv.cu on CUDA cores.

The same uploaded weights as the v2 kernel (`quant_matmul.device_layout`) and the same packed x (`PackedX`), so
`QuantMatrix.matmul` picks this kernel for narrow inputs and v2 above (`prefer_gemv`); `gemv(W, packed, out)` is
the launcher. One thread block per 16-row tile; or (persistent variant, `GemvConfig(persistent=True)` or
`PERSISTENT_UP_TO`) a few blocks per SM each walking tiles; or (split-K variant, `GemvConfig(splits=S)` or
`choose_split`) S blocks per tile for matrices of few tiles; or (ring variant, the default for the quantized types up
to `RING_UP_TO` tokens when the pack wrote x's int16 staging) one block per tile whose warps stream their chunks
through rings of bulk copies. K is split among a block's warps (and blocks) and added
in warp order: deterministic. Quantized weights: int16 x (one scale per 16 values) times the exact quants in integer
dp2a, scales and offsets in fp32; F16: fp32 FMAs. NumPy twin: services.engine.quants.dequantize. Design and numbers:
docs/gpu_quant_matmul.md ("gemv").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import loader
from . import quant_matmul as qm  # attributes are read at call time (quant_matmul imports this module too)

SOURCE = "quant_gemv.cu"
MAX_TOKENS = 16  # widths one launch takes (NT is a template parameter: acc[4][NT] registers)
MAX_K_WARPS = 8  # warps per block (the kernel's launch bound is 256 threads)
TILE_ROWS = 16
CHUNK = 256
SMEM_PER_SM = 228 * 1024
SMEM_LIMIT = 227 * 1024

# the types this kernel has (F16, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, Q3_K, Q4_0, IQ4_NL). Q5_K and IQ4_XS (session 40:
# their GPU tests passed on an H200), Q3_K, Q4_0 and IQ4_NL (session 41) take Q4_K's dispatch below (the same chunk
# walk, a few more or fewer bytes a block). Q3_K's per-tile kernel is weak at 2 tokens (0.31 / 0.22 of the copy
# bandwidth on ffn_up / ffn_down, H200, where the wide kernel takes 26.2 / 26.7 us against its 28.8 / 40.3), but its
# ring is not: the Q3_K_M 27B step with the ring to 3 tokens against to 1, 0.825 / 0.898 at 2 / 3 (bench/gemv_ab.py
# --step-ab q3kring)
GEMV_QTYPES = frozenset({1, 2, 8, 11, 12, 13, 14, 20, 23})
_INT = frozenset({2, 8, 11, 12, 13, 14, 20, 23})  # x staged as int16 with an fp32 scale per 16 values
_SUMS = frozenset({12, 13, 14})  # and the fp32 sum of every 16 values (the K-quants' offsets)
# Widest T for which matmul() takes this kernel instead of v2, per storage type: the widest at which it beat v2 on
# every 27B matrix (bench/roofline.py --kernels gemv,v2,auto on an H100, docs/gpu_quant_matmul.md). Time stays
# monotone in T across the switch (v2 is flat up to 16 tokens and slower than gemv at the crossover width).
CROSSOVER = {1: 2, 8: 2, 12: 1, 13: 1, 14: 1, 23: 1, 2: 1, 20: 1, 11: 1}
# Widest T for which gemv() launches the persistent variant (gemv_persist_kernel) instead of one block per tile, per
# storage type (quantized types only); types not listed keep the per-tile kernel. Empty: on the H100 (docs/
# gpu_quant_matmul.md, "gemv: persistent blocks") it won only on the 1088-tile ffn_up at T=1 (3-6 %), lost on
# ffn_down, and its first default (prefetch 2) made the whole decode step 1.4 ms slower; shapes a general rule would
# switch (LM head, stacked gate+up) were not measured with the better launch shape yet.
PERSISTENT_UP_TO: dict[int, int] = {}
PERSISTENT_TYPES = frozenset(_INT)
# persistent: weight items each warp keeps in flight ahead of its arithmetic (1 or 2). 1: at the same grid depth 2
# gained 0-4 % but costs ~55 registers (184 vs 128 for Q4_K T=1), so fewer blocks fit; the best launch of every
# swept matrix and width used depth 1 with all blocks that fit.
PREFETCH = 1
# Split-K variant (gemv_splitk_kernel): widest T for which gemv() may split a tile's K over several blocks, per storage
# type, when choose_split finds it worth it. Empty: not dispatched. Measured on an H100 (docs/gpu_quant_matmul.md,
# "gemv: split-K"): per matrix at T=1 it gains 2-4 % on ffn_down 5120x17408 (Q4_K 28.1 -> 26.9 us, Q6_K 34.8 -> 34.2)
# and 9-15 % on the 64-tile attn_v 1024x5120 (Q6_K 7.2 -> 6.1), loses 5-7 % on 5120x6144 (ssm_out, attn_output: Q4_K
# 12.1 -> 12.7 at best); in the decode step (27B Q4_K_M, graph replay) splitting every matrix of few tiles cost 40-70
# us (9.61-9.64 -> 9.68 ms) and splitting attn_v alone changed nothing (9.61). At T=2 it gains 9-20 % per matrix
# (Q8_0 ffn_down 46.6 -> 41.9 us, Q6_K 53.0 -> 42.5), but there the Q4_K / Q6_K products run on v2 (CROSSOVER) and
# the rule below keeps the per-tile kernel (its 8 warps per block fill the SMs).
SPLIT_UP_TO: dict[int, int] = {}
# Ring variant (gemv_ring_kernel): widest T for which gemv() launches it, per quantized storage type, when the pack
# wrote x's int16 staging (PackedX.q16: up to quant_matmul.Q16_TOKENS tokens) and K is a multiple of 256; prefer_gemv
# then takes it over v2 too. RING_STAGES slots per warp, each a chunk's weights and x, kept in flight by bulk copies on
# sm_90. H100 (docs/gpu_quant_matmul.md, "gemv: a ring of bulk copies"): one token 0.79-0.91x the per-tile kernel on
# every 27B matrix (decode step 8.99 -> 8.16 ms), 4 warps x 2 stages the best or within 3 % (fewer, smaller slots let
# more blocks in); 2 / 3 tokens 0.67-0.94x / 0.78-0.92x v2's time; 4 tokens 0.93-1.13x (acc and x registers: 108-128
# a thread from two tokens), so v2 from there. Q8_0 (no 27B matrix) was measured at one token only.
RING_UP_TO: dict[int, int] = {8: 1, 12: 3, 13: 3, 14: 3, 23: 3, 2: 3, 20: 3, 11: 3}
RING_STAGES = 2
MAX_RING_STAGES = 32  # the kernel keeps one parity bit per slot in a 32-bit word
# Tall matrices (the LM head: 15520 tiles of 16 rows) stream best with more of each block in flight: H100, one
# token, 248320x5120 Q6_K: 4 warps x 2 stages 351.6 us (the per-tile kernel 348.3), 8 x 3 341.0 (0.97x). At three
# tokens a slot is 4224 bytes and 8 x 3 leaves room for two blocks a SM: 8 x 2 made the 27B's width-3 step 0.982x
# (and widths 1 / 2 1.002x, so they keep 8 x 3).
RING_TALL_TILES = 4096
RING_TALL_SHAPE = {1: (8, 3), 2: (8, 3), 3: (8, 2)}  # (k_warps, stages) by tokens
# One-token products of fewer than RING_FEW_TILES row tiles a SM (the 27B's 5120-row ffn_down, ssm_out and
# attn_output, its 6144-row DeltaNet gate: 320-384 tiles on 132 SMs, 2-3 blocks a SM) keep too few warps and bytes
# in flight at 4 warps x 2 stages. H100, 27B Q4_K_M step replay at width 1 (docs/gpu_quant_matmul.md, "gemv: few
# row tiles"): 8 x 2 0.956 of 4 x 2, 4 x 4 0.961, 4 x 3 0.998, 8 x 3 / 8 x 4 0.981 / 0.996; the same below 6 tiles a
# SM (also the 10240-row DeltaNet qkv) 0.960. Not below one tile a SM (bench/ring_back_to_back.py, 2048x5120 Q4_K,
# 128 tiles: 4 x 2 5.26 us, 8 x 2 5.55).
RING_FEW_TILES = 4
RING_FEW_SHAPE = (8, 2)
# The same launches on deep matrices (k >= 2 n_out: ffn_down 5120x17408, 68 chunks a tile), by type: Q4_K's warps run
# 8-9 chunks each and keep ahead with a third slot. H100, 40 launches back to back over cold copies
# (bench/ring_back_to_back.py): Q4_K 8 x 2 20.56 us, 8 x 3 18.31; Q6_K 27.39 / 30.07 (its slots are 1.4x larger:
# 8 x 2 kept). 27B Q4_K_M width-1 step replay 0.996 (6880 / 6885 -> 6856 / 6851 us); 8 x 3 on every few-tile Q4_K
# product (ssm_out, attn_output too) 1.007.
RING_FEW_DEEP_SHAPE = {12: (8, 3)}
# choose_split's knobs. The per-tile kernel keeps a matrix of at least one tile per SM whose warps run fewer than
# SPLIT_MIN_TILE_CHUNKS chunks each (5120x6144: 6; the split's arrival protocol, a fence, an atomic and a second L2
# round trip, costs more than it saves) or whose blocks fill at least SPLIT_FILL of the warps the SMs can hold
# (registers decide: ~16 warps of 117-128 registers). Otherwise S splits x KW warps per block (KW from SPLIT_WARPS)
# so that tiles x S blocks make as many warps as fit in SPLIT_WAVES waves, each warp keeping at least SPLIT_MIN_CHUNKS
# chunks of 256 values.
SPLIT_FILL = 0.75
SPLIT_MIN_TILE_CHUNKS = 8
SPLIT_WARPS = (4, 2)
SPLIT_MIN_CHUNKS = 1
SPLIT_WAVES = 1.0
MAX_SPLITS = 16

_configured: dict[tuple, int] = {}


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape. k_warps: warps per block splitting K (0: choose_k_warps, or choose_split's with splits).
    persistent: gemv_persist_kernel (None: PERSISTENT_UP_TO decides); then blocks_per_sm (0: as many as fit at once)
    and prefetch (0: PREFETCH). splits: blocks per tile of the split-K kernel gemv_splitk_kernel (0: choose_split
    decides when SPLIT_UP_TO allows; 1: one block per tile; >= 2: split-K with that many). ring: gemv_ring_kernel
    (None: RING_UP_TO decides where the ring can run: ring_usable) with `stages` slots per warp (0: RING_STAGES)."""

    k_warps: int = 0
    persistent: bool | None = None
    blocks_per_sm: int = 0
    prefetch: int = 0
    splits: int = 0
    ring: bool | None = None
    stages: int = 0


def smem_bytes(qtype: int, k: int, tokens: int, k_warps: int, persistent: bool = False) -> int:
    """Dynamic shared memory of one block: staged x (fp16 / int16), group scales and sums, partial sums (two
    buffers of them in the persistent variant)."""
    nch = -(-k // CHUNK)
    size = nch * tokens * 512
    size += nch * tokens * 64 * ((int(qtype) in _INT) + (int(qtype) in _SUMS))
    if k_warps > 1:
        size += k_warps * TILE_ROWS * tokens * 4 * (2 if persistent else 1)
    return size


def ring_slot_bytes(qtype: int, tokens: int) -> int:
    """One ring slot: a 16-row tile's chunk block of weights and the chunk's x (int16 units, scales, sums)."""
    return TILE_ROWS * sum(qm._CHUNK_ROW_BYTES[int(qtype)]) + tokens * (512 + 64 * (1 + (int(qtype) in _SUMS)))


def ring_smem_bytes(qtype: int, tokens: int, k_warps: int, stages: int, swiglu: bool = False) -> int:
    """Dynamic shared memory of one ring block: every warp's slots, the partial sums (KW > 1; a gate|up pair's two
    tiles with swiglu), one mbarrier per slot, and 16 bytes for a staged input norm's 1 / rms (quant_matmul.StagedNorm:
    up to 4 tokens)."""
    size = k_warps * stages * ring_slot_bytes(qtype, tokens)
    if k_warps > 1:
        size += k_warps * TILE_ROWS * tokens * 4 * (2 if swiglu else 1)
    return size + 8 * k_warps * stages + 16


def ring_shape(qtype: int, n_out: int, k: int, tokens: int, sms: int) -> tuple[int, int]:
    """(k_warps, stages) of a ring launch: RING_TALL_SHAPE for matrices of at least RING_TALL_TILES row tiles (where
    it fits in shared memory), RING_FEW_SHAPE for one token over 1 to RING_FEW_TILES row tiles a SM
    (RING_FEW_DEEP_SHAPE's on a deep matrix of its types), else choose_k_warps' warps and RING_STAGES."""
    kw, st = RING_TALL_SHAPE.get(tokens, (8, 2))
    tiles = -(-n_out // TILE_ROWS)
    if tiles >= RING_TALL_TILES and ring_smem_bytes(qtype, tokens, kw, st) <= SMEM_LIMIT:
        return min(kw, -(-k // CHUNK)), st
    kw, st = RING_FEW_DEEP_SHAPE.get(qtype, RING_FEW_SHAPE) if k >= 2 * n_out else RING_FEW_SHAPE
    if tokens == 1 and sms <= tiles < RING_FEW_TILES * sms and ring_smem_bytes(qtype, tokens, kw, st) <= SMEM_LIMIT:
        return min(kw, -(-k // CHUNK)), st
    return choose_k_warps(qtype, n_out, k, tokens, sms), RING_STAGES


def ring_usable(qtype: int, k: int, q16: bool) -> bool:
    """Whether the ring kernel can take this product: a quantized type, K a multiple of 256 (no tail chunk) and x's
    int16 staging written by the pack (q16: PackedX.q16 is there; the ring copies it, it never quantizes x itself)."""
    return bool(q16) and int(qtype) in _INT and k % CHUNK == 0


def ring_can_stage(qtype: int, n_out: int, k: int, tokens: int, sms: int | None = None) -> bool:
    """Whether a default ring launch of this product can stage the next norm from its output (quant_matmul.
    StagedNorm): whole 256-row chunks of output and blocks of at least two warps holding a thread per (row, token)
    of the tile (finish_ring's shuffles). sms: the device's SM count (None: the current device's)."""
    if k % CHUNK:
        return False
    return _stages_with(n_out, ring_shape(qtype, n_out, k, tokens, qm.sm_count() if sms is None else sms)[0], tokens)


def _stages_with(n_out: int, k_warps: int, tokens: int) -> bool:
    """Whether a ring launch of k_warps warps a block can stage a norm of its n_out outputs (finish_ring)."""
    return n_out % CHUNK == 0 and k_warps > 1 and TILE_ROWS * tokens <= 32 * k_warps


def prefer_ring(qtype: int, tokens: int) -> bool:
    """gemv()'s default for a product the ring can take: up to RING_UP_TO[qtype] tokens."""
    return tokens <= RING_UP_TO.get(int(qtype), 0)


def ring_takes(qtype: int, k: int, tokens: int, q16: bool) -> bool:
    """Whether gemv() launches the ring for this product by default (prefer_ring and ring_usable)."""
    return prefer_ring(qtype, tokens) and ring_usable(qtype, k, q16)


def split_chunks(k: int, splits: int) -> int:
    """Most chunks of K one block of the split-K kernel stages (blocks take [s nch / S, (s + 1) nch / S))."""
    nch = -(-k // CHUNK)
    return -(-nch // max(1, splits))


def smem_split_bytes(qtype: int, k: int, tokens: int, splits: int) -> int:
    """Dynamic shared memory of one split-K block: the last-arrival flag (16 bytes), then staged x, group scales and
    sums of its chunks (partial sums go to the global scratch)."""
    nch = split_chunks(k, splits)
    return 16 + nch * tokens * (512 + 64 * ((int(qtype) in _INT) + (int(qtype) in _SUMS)))


def fits(qtype: int, k: int, tokens: int) -> bool:
    """Whether a launch for this width fits in shared memory with room for two blocks per SM."""
    return 1 <= tokens <= MAX_TOKENS and smem_bytes(qtype, k, tokens, MAX_K_WARPS) + 1024 <= SMEM_PER_SM // 2


def prefer_gemv(qtype: int, k: int, tokens: int, q16: bool = False) -> bool:
    """matmul()'s choice for a matrix in the v2 layout: this kernel up to the measured crossover width, or, when x
    comes with its int16 staging (q16: PackedX.q16), up to the ring variant's (RING_UP_TO, K a multiple of 256)."""
    return ring_takes(qtype, k, tokens, q16) or (tokens <= CROSSOVER.get(int(qtype), 0) and fits(qtype, k, tokens))


def prefer_persistent(qtype: int, tokens: int) -> bool:
    """gemv()'s default variant: persistent blocks up to PERSISTENT_UP_TO[qtype] tokens."""
    return int(qtype) in PERSISTENT_TYPES and tokens <= PERSISTENT_UP_TO.get(int(qtype), 0)


def _defines(portable: bool) -> tuple[str, ...]:
    return (("SPECSPLIT_PORTABLE",) if portable else ()) + qm.weight_defines()


def gemv_function(qtype: int, tokens: int, portable: bool = False) -> Any:
    """The compiled kernel for one storage type and width (1..16 tokens)."""
    qtype = int(qtype)
    if qtype not in GEMV_QTYPES:
        raise ValueError(f"no GPU gemv kernel for {qm.type_name(qtype)}")
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"gemv takes 1..{MAX_TOKENS} tokens, not {tokens}")
    defines = _defines(portable)
    fn = loader.get_function(SOURCE, f"gemv_kernel<{qtype}, {tokens}>", defines)
    key = (SOURCE, qtype, tokens, defines, qm._device_id())
    if key not in _configured:
        fn.max_dynamic_shared_size_bytes = SMEM_LIMIT  # opt in above the 48 KiB default once
        _configured[key] = SMEM_LIMIT
    return fn


def persist_function(qtype: int, tokens: int, prefetch: int = PREFETCH, portable: bool = False) -> Any:
    """The compiled persistent kernel for one quantized storage type, width (1..16) and prefetch depth (1, 2)."""
    qtype = int(qtype)
    if qtype not in PERSISTENT_TYPES:
        raise ValueError(f"no persistent gemv kernel for {qm.type_name(qtype)} (Q8_0, Q4_K, Q6_K only)")
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"gemv takes 1..{MAX_TOKENS} tokens, not {tokens}")
    if prefetch not in (1, 2):
        raise ValueError(f"prefetch depth must be 1 or 2, not {prefetch}")
    defines = _defines(portable)
    fn = loader.get_function(SOURCE, f"gemv_persist_kernel<{qtype}, {tokens}, {prefetch}>", defines)
    key = (SOURCE, "persist", qtype, tokens, prefetch, defines, qm._device_id())
    if key not in _configured:
        fn.max_dynamic_shared_size_bytes = SMEM_LIMIT
        _configured[key] = SMEM_LIMIT
    return fn


def ring_function(qtype: int, tokens: int, portable: bool = False, swiglu: bool = False) -> Any:
    """The compiled ring kernel for one quantized storage type and width (1..16 tokens); swiglu: its gate|up variant
    that stages SwiGLU for the down product (gemv_swiglu)."""
    qtype = int(qtype)
    if qtype not in _INT:
        raise ValueError(f"no ring gemv kernel for {qm.type_name(qtype)} (Q8_0, Q4_K, Q6_K only)")
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"gemv takes 1..{MAX_TOKENS} tokens, not {tokens}")
    defines = _defines(portable)
    # PDL only where the grid dependency wait is compiled in (kernels/pdl.cuh: not on the portable path)
    sw = int(bool(swiglu))
    fn = loader.get_function(SOURCE, f"gemv_ring_kernel<{qtype}, {tokens}, {sw}>", defines, pdl=not portable)
    key = (SOURCE, "ring", qtype, tokens, bool(swiglu), defines, qm._device_id())
    if key not in _configured:
        fn.max_dynamic_shared_size_bytes = SMEM_LIMIT
        _configured[key] = SMEM_LIMIT
    return fn


def clusters_available(portable: bool = False) -> bool:
    """Whether thread block clusters can run (gemv_ring_pair_kernel): CUDA on sm_90 or later, not the portable
    build."""
    cupy = loader.require()
    return not portable and not getattr(cupy.cuda.runtime, "is_hip", False) and loader.compute_capability() >= 90


def pair_function(qtype: int, tokens: int, portable: bool = False) -> Any:
    """The compiled SwiGLU ring of cluster pairs (gemv_ring_pair_kernel) for one quantized type and width (sm_90; the
    portable build has no clusters and is refused)."""
    qtype = int(qtype)
    if qtype not in _INT:
        raise ValueError(f"no ring gemv kernel for {qm.type_name(qtype)} (Q8_0, Q4_K, Q6_K only)")
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"gemv takes 1..{MAX_TOKENS} tokens, not {tokens}")
    if not clusters_available(portable):
        raise ValueError("the SwiGLU ring of cluster pairs needs CUDA thread block clusters (sm_90, not the portable "
                         "build)")
    defines = qm.weight_defines()
    fn = loader.get_function(SOURCE, f"gemv_ring_pair_kernel<{qtype}, {tokens}>", defines, pdl=not portable)
    key = (SOURCE, "pair", qtype, tokens, defines, qm._device_id())
    if key not in _configured:
        fn.max_dynamic_shared_size_bytes = SMEM_LIMIT
        _configured[key] = SMEM_LIMIT
    return fn


def split_function(qtype: int, tokens: int, portable: bool = False) -> Any:
    """The compiled split-K kernel for one storage type and width (1..16 tokens)."""
    qtype = int(qtype)
    if qtype not in GEMV_QTYPES:
        raise ValueError(f"no GPU gemv kernel for {qm.type_name(qtype)}")
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"gemv takes 1..{MAX_TOKENS} tokens, not {tokens}")
    defines = _defines(portable)
    fn = loader.get_function(SOURCE, f"gemv_splitk_kernel<{qtype}, {tokens}>", defines)
    key = (SOURCE, "split", qtype, tokens, defines, qm._device_id())
    if key not in _configured:
        fn.max_dynamic_shared_size_bytes = SMEM_LIMIT
        _configured[key] = SMEM_LIMIT
    return fn


def warmup(qtypes=(1, 8, 12, 14), widths=range(1, MAX_TOKENS + 1), portable: bool = False) -> None:
    """Compile the kernels up front (each is built on first use otherwise): per-tile ones, the persistent ones for
    the types and widths PERSISTENT_UP_TO selects, the split-K ones for those SPLIT_UP_TO allows and the ring ones for
    those RING_UP_TO selects."""
    for q in qtypes:
        for t in widths:
            gemv_function(q, t, portable)
            if prefer_persistent(q, t):
                persist_function(q, t, PREFETCH, portable)
            if t <= SPLIT_UP_TO.get(int(q), 0):
                split_function(q, t, portable)
            if int(q) in _INT and prefer_ring(q, t):
                ring_function(q, t, portable)


def persist_grid(n_out: int, k_warps: int, smem: int, regs: int, sms: int, blocks_per_sm: int = 0) -> int:
    """Blocks of a persistent launch: blocks_per_sm per SM (0: as many as registers, threads and shared memory let
    one SM hold), at most one per tile, sized so that every block walks the same number of tiles to within one
    (the block with one more sets the time) unless that idles a quarter of the slots."""
    tiles = -(-n_out // TILE_ROWS)
    fit = loader.resident_blocks(k_warps, regs, smem, SMEM_PER_SM)
    per_sm = max(1, min(blocks_per_sm, fit) if blocks_per_sm > 0 else fit)
    slots = per_sm * sms
    if tiles <= slots:
        return tiles
    balanced = -(-tiles // -(-tiles // slots))
    return balanced if 4 * balanced >= 3 * slots else slots


def choose_split(qtype: int, n_out: int, k: int, tokens: int, sms: int, regs: int, tile_regs: int = 0,
                 tile_k_warps: int = 0) -> tuple[int, int]:
    """(splits, k_warps) of the split-K kernel for this matrix and width, or (1, 0): keep one block per tile.

    A gemv warp is bound by its own latency chain, so the time is set by warps in flight per SM (docs/
    gpu_quant_matmul.md). With at least one tile per SM the per-tile kernel stays when its warps (KW = tile_k_warps or
    choose_k_warps) run fewer than SPLIT_MIN_TILE_CHUNKS chunks each, or its tiles x KW warps (tile_regs registers
    each) fill at least SPLIT_FILL of what the SMs hold. Otherwise, for each KW in SPLIT_WARPS: the blocks of KW warps
    (`regs` registers each, the split kernel's) that fit in SPLIT_WAVES waves, divided among the tiles, gives S,
    capped so that every warp keeps SPLIT_MIN_CHUNKS chunks; the (S, KW) with the most warps wins (ties: the larger
    KW, fewer blocks to stage x). H100 sweep at T=1 (docs/gpu_quant_matmul.md): it picks (3, 2) for ffn_down
    5120x17408, within 1 % of the best of 15 shapes, keeps 5120x6144 on the per-tile kernel (the fastest) and picks
    (5, 4) for attn_v 1024x5120 (measured neighbours (4, 4) / (6, 4): 6.1 / 6.3 us against 7.2 per tile, Q6_K)."""
    if tokens > SPLIT_UP_TO.get(int(qtype), 0):
        return 1, 0
    tiles = -(-n_out // TILE_ROWS)
    nch = -(-k // CHUNK)
    tkw = tile_k_warps or choose_k_warps(qtype, n_out, k, tokens, sms)
    cap = sms * loader.resident_warps(tile_regs or regs)
    if tiles >= sms and (nch < SPLIT_MIN_TILE_CHUNKS * tkw or min(tiles * tkw, cap) >= SPLIT_FILL * cap):
        return 1, 0
    best = (0, 0, 1)  # (warps, k_warps, splits)
    for kw in SPLIT_WARPS:
        cap_s = min(MAX_SPLITS, nch // max(1, kw * SPLIT_MIN_CHUNKS))
        for splits in range(cap_s, 1, -1):
            smem = smem_split_bytes(qtype, k, tokens, splits)
            fit = min(32, loader.resident_warps(regs) // kw, SMEM_PER_SM // (smem + 1024))
            if tiles * splits <= SPLIT_WAVES * sms * fit:
                best = max(best, (tiles * splits * kw, kw, splits))
                break
    return (best[2], best[1]) if best[0] else (1, 0)


def choose_k_warps(qtype: int, n_out: int, k: int, tokens: int, sms: int) -> int:
    """Warps per block: 4, or 8 from two tokens when there are fewer than 4 row tiles per SM; at most one per chunk of
    K, and fewer where shared memory would not hold the block.

    From the H100 k_warps sweep (docs/gpu_quant_matmul.md): at one token 4 is within 4% of the best of 1..8 on every
    27B matrix (the LM head included: 352 us against 384 with 1); a warp is bound by its own latency, so 4 beats
    2 on ffn_up even though 1088 blocks of 4 warps take several waves. Wider inputs with few row tiles (ffn_down,
    320 tiles) gain from 8."""
    tiles = -(-n_out // TILE_ROWS)
    kw = 8 if tokens > 1 and tiles < 4 * sms else 4
    kw = min(kw, -(-k // CHUNK))
    while kw > 1 and smem_bytes(qtype, k, tokens, kw) > SMEM_LIMIT:
        kw //= 2
    return kw


def _launch_args(W: Any, n_out: int, k: int, packed: Any, out: Any, accumulate: bool) -> tuple:
    """The arguments every gemv kernel takes first (the split-K kernel adds its scratch after them)."""
    return (W.device_buffer, np.int64(W.row_bytes), np.int32(n_out), np.int32(k), packed.data,
            np.int32(packed.padded_tokens), out, np.int32(bool(accumulate)), np.int64(qm.out_stride(out)))


def gemv(
    W: Any,
    packed: Any,
    out: Any,
    *,
    accumulate: bool = False,
    config: GemvConfig | None = None,
    portable: bool = False,
    stage: Any = None,
) -> Any:
    """out (+)= x @ W^T for a QuantMatrix W in the v2 layout and a PackedX of 1..16 tokens; returns out.

    out: float32 [T, W.out_features], rows contiguous and possibly strided (a column slice of a wider output:
    qm.check_out). accumulate=True adds into out (e.g. the residual stream). packed may be a quant_matmul.StagedNorm
    and `stage` one this launch writes from out (both the ring variant only)."""
    n_out, k = W.shape
    tokens = qm.check_v2_product(W, packed, out, "gemv", MAX_TOKENS)
    cfg = config if config is not None else GemvConfig()
    if isinstance(packed, qm.StagedNorm) or stage is not None:
        return _launch_staged(W, packed, out, accumulate, cfg, portable, stage)
    persistent = cfg.persistent if cfg.persistent is not None else prefer_persistent(W.qtype, tokens)
    if persistent and int(W.qtype) not in PERSISTENT_TYPES:
        raise ValueError(f"{W.name}: the persistent gemv variant takes Q8_0, Q4_K and Q6_K, not {W.type_name}")
    if cfg.splits < 0 or cfg.splits > MAX_SPLITS:
        raise ValueError(f"splits must be 0..{MAX_SPLITS}, not {cfg.splits}")
    if persistent and cfg.splits > 1:
        raise ValueError(f"{W.name}: the persistent and the split-K gemv variants are exclusive")
    if cfg.ring or (cfg.ring is None and not persistent and cfg.splits <= 1
                    and ring_takes(W.qtype, k, tokens, packed.q16 is not None)):
        if persistent or cfg.splits > 1:
            raise ValueError(f"{W.name}: the ring gemv variant excludes the persistent and the split-K ones")
        return _launch_ring(W, packed, out, accumulate, cfg, portable)
    if packed.data is None:
        raise ValueError(f"{W.name}: x is int16 staging only (QuantMatrix.swiglu): the ring variant reads it, not "
                         f"this one")
    if getattr(packed, "order", 0):
        raise ValueError(f"{W.name}: x in the wgmma order (PackedX.order 1) is read by the ring gemv (its staging), "
                         f"the v2 and the wide kernel, not this gemv variant")
    splits, split_kw = cfg.splits, 0
    if splits == 0:
        splits = 1
        if not persistent and cfg.k_warps == 0 and tokens <= SPLIT_UP_TO.get(int(W.qtype), 0):
            splits, split_kw = auto_split(W.qtype, n_out, k, tokens, portable)
    if splits > 1:
        return _launch_split(W, packed, out, accumulate, splits, cfg.k_warps or split_kw or 4, portable)
    kw = cfg.k_warps or choose_k_warps(W.qtype, n_out, k, tokens, qm.sm_count())
    if not 1 <= kw <= MAX_K_WARPS:
        raise ValueError(f"k_warps must be 1..{MAX_K_WARPS}, not {kw}")
    smem = smem_bytes(W.qtype, k, tokens, kw, persistent)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{W.name}: {tokens} tokens of {k} features need {smem} bytes of shared memory")
    if persistent:
        kern = persist_function(W.qtype, tokens, cfg.prefetch or PREFETCH, portable)
        regs = int(getattr(kern, "num_regs", 0) or 255)
        grid = persist_grid(n_out, kw, smem, regs, qm.sm_count(), cfg.blocks_per_sm)
    else:
        kern = gemv_function(W.qtype, tokens, portable)
        grid = -(-n_out // TILE_ROWS)
    kern(
        (grid,),
        (32 * kw,),
        _launch_args(W, n_out, k, packed, out, accumulate) + (_xq(packed),),
        shared_mem=smem,
    )
    return out


def _launch_staged(W: Any, packed: Any, out: Any, accumulate: bool, cfg: GemvConfig, portable: bool,
                   stage: Any) -> Any:
    """A ring launch reading a staged norm (packed: quant_matmul.StagedNorm) and / or staging the next one."""
    n_out, k = W.shape
    tokens = packed.tokens
    if cfg.persistent or cfg.splits > 1 or cfg.ring is False:
        raise ValueError(f"{W.name}: a staged norm is read and written by the ring gemv variant only")
    if packed.q16 is None:
        raise ValueError(f"{W.name}: staging the next norm needs x with its int16 staging (PackedX.q16)")
    if isinstance(packed, qm.StagedNorm) and tokens > 4:
        raise ValueError(f"{W.name}: a staged norm holds at most 4 tokens, not {tokens}")
    if stage is not None:
        if stage.tokens != tokens or stage.in_features != n_out:
            raise ValueError(f"{W.name}: the stage is for [{stage.tokens}, {stage.in_features}], this product writes "
                             f"[{tokens}, {n_out}]")
        if stage.residual is not None and stage.residual is not out:
            raise ValueError(f"{W.name}: the stage is of another stream than this product's out")
        kw = cfg.k_warps or ring_shape(W.qtype, n_out, k, tokens, qm.sm_count())[0]
        if not _stages_with(n_out, kw, tokens):
            raise ValueError(f"{W.name}: a ring launch stages a norm only with N a multiple of {CHUNK} and blocks of "
                             f">= 2 warps holding a thread per (row, token) of a tile; here N = {n_out}, {kw} warps, "
                             f"{tokens} tokens")
    return _launch_ring(W, packed, out, accumulate, cfg, portable, stage)


def _launch_ring(W: Any, packed: Any, out: Any, accumulate: bool, cfg: GemvConfig, portable: bool,
                 stage: Any = None) -> Any:
    n_out, k = W.shape
    tokens = packed.tokens
    if not ring_usable(W.qtype, k, packed.q16 is not None):
        raise ValueError(f"{W.name}: the ring gemv variant takes Q8_0, Q4_K or Q6_K with K a multiple of {CHUNK} and "
                         f"x packed with its int16 staging (PackedX.q16); got {W.type_name}, K = {k}")
    kw_auto, stages_auto = ring_shape(W.qtype, n_out, k, tokens, qm.sm_count())
    stages = cfg.stages or stages_auto
    if not 1 <= stages <= MAX_RING_STAGES:
        raise ValueError(f"ring stages must be 1..{MAX_RING_STAGES}, not {stages}")
    kw = cfg.k_warps or kw_auto
    if not 1 <= kw <= MAX_K_WARPS:
        raise ValueError(f"k_warps must be 1..{MAX_K_WARPS}, not {kw}")
    smem = ring_smem_bytes(W.qtype, tokens, kw, stages)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{W.name}: {kw} warps x {stages} ring stages need {smem} bytes of shared memory")
    ring_function(W.qtype, tokens, portable)(
        (-(-n_out // TILE_ROWS),),
        (32 * kw,),
        (W.device_buffer, np.int64(W.row_bytes), np.int32(n_out), np.int32(k), out, np.int32(bool(accumulate)),
         np.int64(qm.out_stride(out)), packed.q16, np.int32(stages)) + _stage_args(packed, stage),
        shared_mem=smem,
    )
    return out


# (k_warps, stages) of gemv_swiglu by tokens (not its cluster pairs); absent (or 0): gate|up's own ring shape's. Each
# block runs two tiles back to back through one ring. Stages do not change the sums; other warps do (then g and u are
# not bitwise gate|up's ring launch, only within its rounding).
SWIGLU_SHAPE: dict[int, tuple[int, int]] = {1: (0, 3), 2: (0, 3)}


def swiglu_shape(qtype: int, n_out: int, k: int, tokens: int, sms: int | None = None,
                 pair: bool = False) -> tuple[int, int] | None:
    """(k_warps, stages) of gemv_swiglu on a stacked [gate | up] matrix of n_out rows, or None where it cannot run:
    gate|up's own ring launch's (ring_shape: so gate and up are bitwise what that launch writes) unless SWIGLU_SHAPE
    says (not for the cluster pairs, pair=True: their blocks run one tile each, as gate|up's launch does); the warps
    must stage a 16-value group per (row, token) of a tile (_stages_with's rule on the F = n_out / 2 outputs), and x
    comes with its int16 staging (up to quant_matmul.Q16_TOKENS tokens). sms: the device's SM count (None: the
    current device's)."""
    if n_out % 2 or not ring_usable(qtype, k, True) or not 1 <= tokens <= qm.Q16_TOKENS:
        return None
    kw, stages = ring_shape(qtype, n_out, k, tokens, qm.sm_count() if sms is None else sms)
    want = (0, 0) if pair else SWIGLU_SHAPE.get(tokens, (0, 0))
    kw, stages = min(want[0] or kw, -(-k // CHUNK)), want[1] or stages
    return (kw, stages) if _stages_with(n_out // 2, kw, tokens) else None


def gemv_swiglu(W: Any, packed: Any, q16_out: Any = None, *, config: GemvConfig | None = None,
                portable: bool = False, pair: bool = False) -> Any:
    """fp16(silu(g) * u) for [g | u] = x @ W^T, W a stacked [gate | up] QuantMatrix (2 F rows, v2 layout), as the int16
    staging (PackedX.q16 layout, F / 256 chunks x T tokens) a ring gemv of the down product reads, in one ring launch:
    no gate|up output, no pack launch. packed: a PackedX with its q16 staging or a quant_matmul.StagedNorm (1..3
    tokens). Bitwise the ring's gate|up product followed by the SwiGLU pack's staging (pack_activations(silu_up=)).
    pair: gate|up's own launch (a block per tile, its shape) with each gate tile's block and its up tile's block a
    cluster of two that meets at the end (gemv_ring_pair_kernel, sm_90: clusters_available); else each block runs a
    gate tile and then its up tile. q16_out: the uint32 buffer to write (q16_words(F, T); None: a new one). Returns
    q16_out."""
    cupy = loader.require()
    n_out, k = W.shape
    tokens = qm.check_v2_product(W, packed, None, "gemv", MAX_TOKENS)
    f = n_out // 2
    if pair and not clusters_available(portable):
        raise ValueError(f"{W.name}: the SwiGLU ring of cluster pairs needs CUDA thread block clusters (sm_90, not "
                         f"the portable build)")
    shape = swiglu_shape(W.qtype, n_out, k, tokens, pair=pair)
    if packed.q16 is None or shape is None:
        raise ValueError(f"{W.name}: the SwiGLU ring takes a stacked [gate | up] {qm.type_name(W.qtype)} matrix of "
                         f"Q8_0 / Q4_K / Q6_K with K a multiple of {CHUNK}, gate rows a multiple of {CHUNK}, 1.."
                         f"{qm.Q16_TOKENS} tokens with x's int16 staging, and ring blocks of >= 2 warps holding a "
                         f"thread per (row, token) of a tile; here {n_out} rows, K = {k}, {tokens} tokens")
    cfg = config if config is not None else GemvConfig()
    if cfg.persistent or cfg.splits > 1 or cfg.ring is False:
        raise ValueError(f"{W.name}: the SwiGLU staging is written by the ring gemv variant only")
    kw, stages = cfg.k_warps or shape[0], cfg.stages or shape[1]
    if not (_stages_with(f, kw, tokens) and 1 <= kw <= MAX_K_WARPS and 1 <= stages <= MAX_RING_STAGES):
        raise ValueError(f"{W.name}: the SwiGLU ring needs 2..{MAX_K_WARPS} warps holding a thread per (row, token) "
                         f"of a tile and 1..{MAX_RING_STAGES} stages, not {kw} x {stages}")
    smem = ring_smem_bytes(W.qtype, tokens, kw, stages, swiglu=True)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{W.name}: {kw} warps x {stages} ring stages need {smem} bytes of shared memory")
    words = qm.q16_words(f, tokens)
    if q16_out is None:
        q16_out = cupy.empty(words, cupy.uint32)
    elif q16_out.dtype != np.uint32 or int(q16_out.size) != words or not q16_out.flags.c_contiguous:
        raise ValueError(f"{W.name}: q16_out must be a contiguous uint32 array of {words} words")
    null = np.uint64(0)
    staged_in = isinstance(packed, qm.StagedNorm)
    if pair:
        pair_function(W.qtype, tokens)(
            (n_out // TILE_ROWS,),
            (32 * kw,),
            (W.device_buffer, np.int64(W.row_bytes), np.int32(f), np.int32(k), packed.q16, np.int32(stages),
             packed.ssq if staged_in else null, np.float32(packed.eps if staged_in else 0.0), q16_out),
            shared_mem=smem,
        )
        return q16_out
    ring_function(W.qtype, tokens, portable, swiglu=True)(
        (f // TILE_ROWS,),
        (32 * kw,),
        (W.device_buffer, np.int64(W.row_bytes), np.int32(f), np.int32(k), null, np.int32(0), np.int64(0),
         packed.q16, np.int32(stages), packed.ssq if staged_in else null,
         np.float32(packed.eps if staged_in else 0.0), null, q16_out, null),
        shared_mem=smem,
    )
    return q16_out


def _stage_args(packed: Any, stage: Any) -> tuple:
    """The ring kernel's staged-norm arguments: (in_ssq, eps) of a StagedNorm x, (weight, q16, ssq) of a stage to
    write; null pointers for neither."""
    null = np.uint64(0)
    staged_in = isinstance(packed, qm.StagedNorm)
    return ((packed.ssq if staged_in else null), np.float32(packed.eps if staged_in else 0.0),
            *((stage.weight, stage.q16, stage.ssq) if stage is not None else (null, null, null)))


def _xq(packed: Any) -> Any:
    """The kernels' last argument: the pack's int16 staging of x (PackedX.q16), or a null pointer (the kernel
    quantizes x itself)."""
    q16 = getattr(packed, "q16", None)
    return q16 if q16 is not None else np.uint64(0)


_auto_split: dict[tuple, tuple[int, int]] = {}


def auto_split(qtype: int, n_out: int, k: int, tokens: int, portable: bool = False) -> tuple[int, int]:
    """choose_split with the compiled kernels' register counts (cached per shape, width and device; the knobs are part
    of the key so a bench can change them)."""
    key = (int(qtype), n_out, k, tokens, portable, qm._device_id(), SPLIT_FILL, SPLIT_WARPS, SPLIT_MIN_CHUNKS,
           SPLIT_WAVES, SPLIT_UP_TO.get(int(qtype), 0), SPLIT_MIN_TILE_CHUNKS)  # fmt: skip
    got = _auto_split.get(key)
    if got is None:
        regs = int(getattr(split_function(qtype, tokens, portable), "num_regs", 0) or 128)
        tile_regs = int(getattr(gemv_function(qtype, tokens, portable), "num_regs", 0) or 128)
        got = choose_split(qtype, n_out, k, tokens, qm.sm_count(), regs, tile_regs)
        _auto_split[key] = got
    return got


class _Scratch:
    """One stream's split-K scratch: partial sums (fp32) and per-tile arrival counters (u32, zero between launches)."""

    def __init__(self, cupy: Any, part_floats: int, counters: int):
        self.mem = cupy.cuda.Memory(4 * (part_floats + counters))  # cudaMalloc: not the caller's allocator (a
        # graph capture's arena would hand the bytes to later temporaries while the counters must live on)
        base = cupy.cuda.MemoryPointer(self.mem, 0)
        self.counters = cupy.ndarray((counters,), cupy.uint32, base)
        self.part = cupy.ndarray((part_floats,), cupy.float32, base + 4 * counters)
        # zero the counters once, synchronously on a side stream: this works eagerly and inside a (relaxed) graph
        # capture alike, and no memset node lands in a captured graph; the kernels leave them zero after every launch
        dev = qm._device_id()
        if dev not in _side_streams:
            _side_streams[dev] = cupy.cuda.Stream(non_blocking=True)
        side = _side_streams[dev]
        cupy.cuda.runtime.memsetAsync(self.counters.data.ptr, 0, 4 * counters, side.ptr)
        side.synchronize()


_side_streams: dict[int, Any] = {}


_scratch: dict[tuple[int, int], _Scratch] = {}
_retired: list[_Scratch] = []  # outgrown buffers: graphs captured earlier still hold their addresses
SCRATCH_FIRST = (1 << 19, 1 << 14)  # (partial floats, counters) a stream's scratch holds at least
_reserved = [0, 0]                  # (partial floats, counters) a new scratch is made with (reserve_split_scratch)


def reserve_split_scratch(part_floats: int, counters: int) -> None:
    """Make every stream's scratch big enough, when it is first made, for launches of up to these needs (the memory
    plan's bound, set at start-up): then no scratch grows while serving and a stream holds exactly one buffer."""
    _reserved[0] = max(_reserved[0], int(part_floats))
    _reserved[1] = max(_reserved[1], int(counters))


def split_scratch(tiles: int, part_floats: int) -> tuple[Any, Any]:
    """(partial sums, counters) for a split-K (or wide) launch on the current stream of the current device: cached
    per (device, stream), made at least SCRATCH_FIRST and the reserved size, grown (never freed) when a launch needs
    more. Launches on one stream run one after another, so they share it safely; a CUDA graph keeps the buffer of
    the stream it was captured on (replay graphs captured on one stream one at a time)."""
    cupy = loader.require()
    key = (qm._device_id(), int(cupy.cuda.get_current_stream().ptr))
    sc = _scratch.get(key)
    if sc is None or sc.part.size < part_floats or sc.counters.size < tiles:
        if sc is not None:
            _retired.append(sc)
            old_p, old_c = sc.part.size, sc.counters.size
            sc = _Scratch(cupy, max(part_floats, 2 * old_p), max(tiles, 2 * old_c))
        else:
            sc = _Scratch(cupy, max(part_floats, SCRATCH_FIRST[0], _reserved[0]),
                          max(tiles, SCRATCH_FIRST[1], _reserved[1]))
        _scratch[key] = sc
    return sc.part, sc.counters


def split_scratch_bytes() -> int:
    """Device bytes held by split-K scratch buffers (current and outgrown) on every device and stream."""
    return sum(4 * (sc.part.size + sc.counters.size) for sc in (*_scratch.values(), *_retired))


def split_scratch_need(sms: int) -> tuple[int, int]:
    """(partial floats, counters) the split-K gemv launches gemv() dispatches can take at most: (0, 0) while
    SPLIT_UP_TO dispatches no type. choose_split keeps tiles x splits within SPLIT_WAVES waves of at most 32 blocks
    per SM, with at most max(SPLIT_WARPS) warps of TILE_ROWS rows each per block; a launch takes at most the widest
    SPLIT_UP_TO tokens; counters are one per tile."""
    if not SPLIT_UP_TO:
        return 0, 0
    blocks = int(SPLIT_WAVES * sms * 32)
    return blocks * max(SPLIT_WARPS) * TILE_ROWS * max(SPLIT_UP_TO.values()), blocks


def _launch_split(W: Any, packed: Any, out: Any, accumulate: bool, splits: int, kw: int, portable: bool) -> Any:
    n_out, k = W.shape
    tokens = packed.tokens
    if not 1 <= kw <= MAX_K_WARPS:
        raise ValueError(f"k_warps must be 1..{MAX_K_WARPS}, not {kw}")
    tiles = -(-n_out // TILE_ROWS)
    smem = smem_split_bytes(W.qtype, k, tokens, splits)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{W.name}: {tokens} tokens of {k} features need {smem} bytes of shared memory")
    part, counters = split_scratch(tiles, tiles * splits * kw * TILE_ROWS * tokens)
    kern = split_function(W.qtype, tokens, portable)
    kern(
        (tiles * splits,),
        (32 * kw,),
        _launch_args(W, n_out, k, packed, out, accumulate) + (np.int32(splits), part, counters, _xq(packed)),
        shared_mem=smem,
    )
    return out
