"""Wide-token GPU matrix products (speculative verify: ~9..64 tokens per launch) on the v2 weight layout.

The kernel is quant_matmul.cu's `qmw_kernel` (it shares v2's dequantization, so its numerics are v2's); this module
is its launcher: `wide(W, packed, out)` for a QuantMatrix in the v2 layout and a PackedX. The warps of a block own
different row tiles and walk the same K chunks; per chunk the block stages x for all tokens in shared memory once,
next to the weight tiles, so x is read from L2 once per block instead of once per warp; the (row block, chunk) work
is split evenly over the blocks (stream-K), and row blocks shared by several blocks are added up in a fixed order
through the split scratch of kernels/quant_gemv.py: deterministic. `QuantMatrix.matmul` takes this kernel from
`CROSSOVER[qtype]` tokens. Design and numbers: docs/gpu_quant_matmul.md ("wide").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import loader, quant_gemv
from . import quant_matmul as qm  # attributes are read at call time (quant_matmul imports this module too)

SOURCE = "quant_matmul.cu"
MAX_TOKENS = 64  # NT = 1..8 token tiles of 8
MAX_WARPS = 8  # warps per block (the kernel's launch bound is 256 threads)
TILE_ROWS = 16
CHUNK = 256
SMEM_LIMIT = 227 * 1024
SMEM_PER_SM = 228 * 1024
BARRIER_BYTES = 16  # per stage: the full and empty mbarriers

# Narrowest width for which QuantMatrix.matmul takes this kernel instead of v2, per storage type (gemv keeps the
# widths up to quant_gemv.CROSSOVER). H100, 2026-11-26 (bench/gpu_wide_check.sh, default launch shape): on the 27B
# ffn matrices v2 is as fast or faster up to 23 tokens (Q4_K ffn_up 34.4 vs 37.9 us at 23) and the wide kernel
# wins from 32 (41 vs 54 us; 41 tokens 47 vs 83, 64 tokens 56 vs 145); 5120x6144 matrices keep v2 at 23 too.
CROSSOVER = {1: 25, 8: 25, 12: 25, 14: 25}  # F16, Q8_0, Q4_K, Q6_K  # F16, Q8_0, Q4_K, Q6_K
# Default launch shape (choose_config): m16 tiles per warp, warps per block, copy stages; the first that fits in
# shared memory of (M_TILES, warps in WARP_CHOICES, stages in STAGE_CHOICES). ESTIMATE until the sweep: 8 warps x 2
# tiles = 256 rows per block keeps x's L2 reads below the weight bytes up to 64 tokens (2 TPAD / (256 bytes per
# weight): 0.9x at 64 tokens of Q4_K), and 3 stages keep two chunks of copies in flight.
M_TILES = 2
WARP_CHOICES = (8, 4, 2, 1)
STAGE_CHOICES = (3, 2)

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


def smem_bytes(qtype: int, n_tiles: int, m_tiles: int, warps: int, stages: int) -> int:
    """Dynamic shared memory of one block: per stage a chunk of packed x for 8 n_tiles tokens and the block's
    warps x m_tiles tile blocks, plus the stage's two mbarriers."""
    return stages * (512 * 8 * n_tiles + warps * m_tiles * chunk_block_bytes(qtype) + BARRIER_BYTES)


def row_blocks(n_out: int, m_tiles: int, warps: int) -> int:
    tiles = -(-n_out // TILE_ROWS)
    return -(-tiles // (m_tiles * warps))


def scratch_floats(blocks: int, n_tiles: int, m_tiles: int, warps: int) -> int:
    """Partial-sum scratch a launch needs: two slots per block (its first and last row block), each warps x
    (m_tiles 16 rows x 8 n_tiles tokens) floats."""
    return 2 * blocks * warps * m_tiles * TILE_ROWS * 8 * n_tiles


def prefer_wide(qtype: int, tokens: int) -> bool:
    """matmul()'s choice for a matrix in the v2 layout above gemv's widths: this kernel from CROSSOVER[qtype]."""
    return CROSSOVER.get(int(qtype), MAX_TOKENS + 1) <= tokens <= MAX_TOKENS


def _defines(portable: bool) -> tuple[str, ...]:
    return ("SPECSPLIT_PORTABLE",) if portable else ()


def wide_function(qtype: int, n_tiles: int, m_tiles: int, portable: bool = False) -> Any:
    """The compiled kernel for one storage type, token-tile count (1..8) and m16 tiles per warp (1, 2)."""
    qtype = int(qtype)
    if qtype not in qm.SUPPORTED_QTYPES:
        raise ValueError(f"no GPU wide kernel for {qm.type_name(qtype)}")
    if not 1 <= n_tiles <= MAX_TOKENS // 8:
        raise ValueError(f"n_tiles must be 1..{MAX_TOKENS // 8}, not {n_tiles}")
    if m_tiles not in (1, 2):
        raise ValueError(f"m_tiles must be 1 or 2, not {m_tiles}")
    defines = _defines(portable)
    fn = loader.get_function(SOURCE, f"qmw_kernel<{qtype}, {n_tiles}, {m_tiles}>", defines)
    key = (qtype, n_tiles, m_tiles, defines, qm._device_id())
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
    """The launch shape for a width with every 0 of `config` filled in: M_TILES tiles per warp, then the first
    (warps, stages) of WARP_CHOICES x STAGE_CHOICES that fits in shared memory, with no more warps than the matrix
    has tile groups (a small matrix keeps its blocks' warps busy)."""
    cfg = config or WideConfig()
    n_tiles = (min(max(tokens, 1), MAX_TOKENS) + 7) // 8
    mt = cfg.m_tiles or M_TILES
    tiles = -(-n_out // TILE_ROWS)
    warp_choices = (cfg.warps,) if cfg.warps else tuple(w for w in WARP_CHOICES if w * mt <= max(tiles, mt)) or (1,)
    stage_choices = (cfg.stages,) if cfg.stages else STAGE_CHOICES
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


def blocks_per_sm(warps: int, regs: int, smem: int) -> int:
    """Blocks of `warps` warps of `regs` registers and `smem` bytes of shared memory one SM holds at once."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return max(1, min(32, 64 // warps, 65536 // (warps * regs_per_warp), SMEM_PER_SM // (smem + 1024)))


def grid(n_out: int, k: int, cfg: WideConfig, regs: int, smem: int, sms: int) -> int:
    """Blocks of a launch: cfg.blocks, else blocks_per_sm (cfg's, capped by what fits, or all that fit) on every SM, at
    most one per (row block, chunk) item."""
    items = row_blocks(n_out, cfg.m_tiles, cfg.warps) * -(-k // CHUNK)
    if cfg.blocks:
        return cfg.blocks
    fit = blocks_per_sm(cfg.warps, regs, smem)
    per_sm = min(cfg.blocks_per_sm, fit) if cfg.blocks_per_sm else fit
    return max(1, min(items, per_sm * sms))


def scratch_need(qtype: int, n_out: int, k: int, tokens: int, sms: int) -> tuple[int, int]:
    """(partial-sum floats, counters) of quant_gemv.split_scratch that a default launch at this width takes at most,
    without the compiled kernel: its grid with the register limit left out (registers only lower the blocks that fit;
    from 25 tokens shared memory already keeps one block per SM). What the memory plan sizes the scratch by."""
    n_tiles = (min(max(tokens, 1), MAX_TOKENS) + 7) // 8
    cfg = choose_config(qtype, n_out, k, tokens)
    smem = smem_bytes(qtype, n_tiles, cfg.m_tiles, cfg.warps, cfg.stages)
    blocks = grid(n_out, k, cfg, 1, smem, sms)
    counters = row_blocks(n_out, cfg.m_tiles, cfg.warps) * cfg.warps
    return scratch_floats(blocks, n_tiles, cfg.m_tiles, cfg.warps), counters


def launch_shape(W: Any, tokens: int, config: WideConfig | None = None, portable: bool = False) -> dict:
    """What a launch of W at this width runs as: the resolved config, registers, shared memory, grid, row blocks."""
    n_out, k = W.shape
    n_tiles = (tokens + 7) // 8
    cfg = choose_config(W.qtype, n_out, k, tokens, config)
    check(W.qtype, n_tiles, cfg)
    kern = wide_function(W.qtype, n_tiles, cfg.m_tiles, portable)
    regs = int(getattr(kern, "num_regs", 0) or 255)
    smem = smem_bytes(W.qtype, n_tiles, cfg.m_tiles, cfg.warps, cfg.stages)
    blocks = grid(n_out, k, cfg, regs, smem, qm.sm_count())
    return {"config": cfg, "kernel": kern, "regs": regs, "smem": smem, "blocks": blocks,
            "row_blocks": row_blocks(n_out, cfg.m_tiles, cfg.warps)}  # fmt: skip


def wide(
    W: Any,
    packed: Any,
    out: Any,
    *,
    accumulate: bool = False,
    config: WideConfig | None = None,
    portable: bool = False,
) -> Any:
    """out (+)= x @ W^T for a QuantMatrix W in the v2 layout and a PackedX of 1..64 tokens; returns out.

    out: float32 [T, W.out_features], rows contiguous and possibly strided (a column slice of a wider output:
    qm.check_out). accumulate=True adds into out (each value once, after its sum is complete)."""
    n_out, k = W.shape
    if W.kernel != "v2":
        raise ValueError(f"{W.name}: the wide kernel reads the v2 device layout; this matrix holds GGUF rows (v1)")
    if packed.in_features != k:
        raise ValueError(f"{W.name}: activations have {packed.in_features} features, the matrix takes {k}")
    tokens = packed.tokens
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"{W.name}: the wide kernel takes 1..{MAX_TOKENS} tokens, not {tokens}")
    qm.check_out(out, tokens, n_out, W.name)
    shape = launch_shape(W, tokens, config, portable)
    cfg, blocks = shape["config"], shape["blocks"]
    part, counters = quant_gemv.split_scratch(
        shape["row_blocks"] * cfg.warps, scratch_floats(blocks, packed.n_tiles, cfg.m_tiles, cfg.warps)
    )
    shape["kernel"](
        (blocks,),
        (32 * cfg.warps,),
        (W.device_buffer, np.int64(W.row_bytes), np.int32(n_out), np.int32(k), packed.data, np.int32(tokens), out,
         np.int32(cfg.stages), np.int32(bool(accumulate)), np.int64(qm.out_stride(out)), part, counters),
        shared_mem=shape["smem"],
    )  # fmt: skip
    return out
