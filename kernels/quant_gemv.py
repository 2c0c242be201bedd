"""Small-width (T <= 16) GPU matrix-vector products on the v2 weight layout: kernels/quant_gemv.cu on CUDA cores.

The same uploaded weights as the v2 kernel (`quant_matmul.device_layout`) and the same packed x (`PackedX`), so
`QuantMatrix.matmul` picks this kernel for narrow inputs and v2 above (`prefer_gemv`); `gemv(W, packed, out)` is
the launcher. One thread block per 16-row tile, or (persistent variant, `GemvConfig(persistent=True)` or
`PERSISTENT_UP_TO`) a few blocks per SM each walking tiles; K is split among a block's warps and added in warp
order: deterministic. Quantized weights: int16 x (one scale per 16 values) times the exact quants in integer dp2a,
scales and offsets in fp32; F16: fp32 FMAs. NumPy twin: services.engine.quants.dequantize. Design and numbers:
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

_INT = frozenset({8, 12, 14})  # x staged as int16 with an fp32 scale per 16 values
_SUMS = frozenset({12, 14})  # and the fp32 sum of every 16 values (the K-quants' offsets)
# Widest T for which matmul() takes this kernel instead of v2, per storage type: the widest at which it beat v2 on
# every 27B matrix (bench/roofline.py --kernels gemv,v2,auto on an H100, docs/gpu_quant_matmul.md). Time stays
# monotone in T across the switch (v2 is flat up to 16 tokens and slower than gemv at the crossover width).
CROSSOVER = {1: 2, 8: 2, 12: 1, 14: 1}
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

_configured: dict[tuple, int] = {}


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape. k_warps: warps per block splitting K (0: choose_k_warps). persistent: gemv_persist_kernel
    (None: PERSISTENT_UP_TO decides); then blocks_per_sm (0: as many as fit at once) and prefetch (0: PREFETCH)."""

    k_warps: int = 0
    persistent: bool | None = None
    blocks_per_sm: int = 0
    prefetch: int = 0


def smem_bytes(qtype: int, k: int, tokens: int, k_warps: int, persistent: bool = False) -> int:
    """Dynamic shared memory of one block: staged x (fp16 / int16), group scales and sums, partial sums (two
    buffers of them in the persistent variant)."""
    nch = -(-k // CHUNK)
    size = nch * tokens * 512
    size += nch * tokens * 64 * ((int(qtype) in _INT) + (int(qtype) in _SUMS))
    if k_warps > 1:
        size += k_warps * TILE_ROWS * tokens * 4 * (2 if persistent else 1)
    return size


def fits(qtype: int, k: int, tokens: int) -> bool:
    """Whether a launch for this width fits in shared memory with room for two blocks per SM."""
    return 1 <= tokens <= MAX_TOKENS and smem_bytes(qtype, k, tokens, MAX_K_WARPS) + 1024 <= SMEM_PER_SM // 2


def prefer_gemv(qtype: int, k: int, tokens: int) -> bool:
    """matmul()'s choice for a matrix in the v2 layout: this kernel up to the measured crossover width."""
    return tokens <= CROSSOVER.get(int(qtype), 0) and fits(qtype, k, tokens)


def prefer_persistent(qtype: int, tokens: int) -> bool:
    """gemv()'s default variant: persistent blocks up to PERSISTENT_UP_TO[qtype] tokens."""
    return int(qtype) in PERSISTENT_TYPES and tokens <= PERSISTENT_UP_TO.get(int(qtype), 0)


def _defines(portable: bool) -> tuple[str, ...]:
    return ("SPECSPLIT_PORTABLE",) if portable else ()


def gemv_function(qtype: int, tokens: int, portable: bool = False) -> Any:
    """The compiled kernel for one storage type and width (1..16 tokens)."""
    qtype = int(qtype)
    if qtype not in qm.SUPPORTED_QTYPES:
        raise ValueError(f"no GPU gemv kernel for {qm.type_name(qtype)}")
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"gemv takes 1..{MAX_TOKENS} tokens, not {tokens}")
    defines = _defines(portable)
    fn = loader.get_function(SOURCE, f"gemv_kernel<{qtype}, {tokens}>", defines)
    key = (qtype, tokens, defines, qm._device_id())
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
    key = ("persist", qtype, tokens, prefetch, defines, qm._device_id())
    if key not in _configured:
        fn.max_dynamic_shared_size_bytes = SMEM_LIMIT
        _configured[key] = SMEM_LIMIT
    return fn


def warmup(qtypes=(1, 8, 12, 14), widths=range(1, MAX_TOKENS + 1), portable: bool = False) -> None:
    """Compile the kernels up front (each is built on first use otherwise): per-tile ones, and the persistent ones
    for the types and widths PERSISTENT_UP_TO selects."""
    for q in qtypes:
        for t in widths:
            gemv_function(q, t, portable)
            if prefer_persistent(q, t):
                persist_function(q, t, PREFETCH, portable)


def persist_grid(n_out: int, k_warps: int, smem: int, regs: int, sms: int, blocks_per_sm: int = 0) -> int:
    """Blocks of a persistent launch: blocks_per_sm per SM (0: as many as registers, threads and shared memory let
    one SM hold), at most one per tile, sized so that every block walks the same number of tiles to within one
    (the block with one more sets the time) unless that idles a quarter of the slots."""
    tiles = -(-n_out // TILE_ROWS)
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    fit = min(32, 2048 // (32 * k_warps), 65536 // (k_warps * regs_per_warp), SMEM_PER_SM // (smem + 1024))
    per_sm = max(1, min(blocks_per_sm, fit) if blocks_per_sm > 0 else fit)
    slots = per_sm * sms
    if tiles <= slots:
        return tiles
    balanced = -(-tiles // -(-tiles // slots))
    return balanced if 4 * balanced >= 3 * slots else slots


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


def gemv(
    W: Any,
    packed: Any,
    out: Any,
    *,
    accumulate: bool = False,
    config: GemvConfig | None = None,
    portable: bool = False,
) -> Any:
    """out (+)= x @ W^T for a QuantMatrix W in the v2 layout and a PackedX of 1..16 tokens; returns out.

    out: float32 [T, W.out_features], rows contiguous and possibly strided (a column slice of a wider output:
    qm.check_out). accumulate=True adds into out (e.g. the residual stream)."""
    n_out, k = W.shape
    if W.kernel == "v1":
        raise ValueError(f"{W.name}: the gemv kernel reads the v2 device layout; this matrix holds GGUF rows (v1)")
    if packed.in_features != k:
        raise ValueError(f"{W.name}: activations have {packed.in_features} features, the matrix takes {k}")
    tokens = packed.tokens
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"{W.name}: gemv takes 1..{MAX_TOKENS} tokens, not {tokens}")
    qm.check_out(out, tokens, n_out, W.name)
    cfg = config if config is not None else GemvConfig()
    persistent = cfg.persistent if cfg.persistent is not None else prefer_persistent(W.qtype, tokens)
    if persistent and int(W.qtype) not in PERSISTENT_TYPES:
        raise ValueError(f"{W.name}: the persistent gemv variant takes Q8_0, Q4_K and Q6_K, not {W.type_name}")
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
        (
            W.device_buffer,
            np.int64(W.row_bytes),
            np.int32(n_out),
            np.int32(k),
            packed.data,
            np.int32(packed.padded_tokens),
            out,
            np.int32(bool(accumulate)),
            np.int64(qm.out_stride(out)),
        ),
        shared_mem=smem,
    )
    return out
