"""GPU matrix products on GGUF-packed weights: `QuantMatrix(W).matmul(x) == x @ dequantize(W).T`.

The weights go to the GPU once, in their GGUF block layout, and are never expanded to full precision in
memory: kernels/quant_matmul.cu dequantizes each block in registers and multiplies it with every token of
x (up to 64 tokens per kernel launch, e.g. a speculative verify tree), so one call reads each weight byte
once whatever the width. NumPy twin: services.engine.quants.dequantize.

    W = QuantMatrix.from_raw(model_file.require("blk.0.ffn_up.weight"))   # or QuantMatrix(qtype, bytes, shape)
    y = W.matmul(x)            # x: cupy [T, in] float16 (or float32) -> y: cupy [T, out] float32

Supported storage types: F16, Q8_0, Q4_K, Q6_K (what a Qwen3.6 Q4_K_M file holds in its matrices), Q5_K (a Q5_K_M /
Q5_K_S file's), IQ4_XS, Q3_K (a Q3_K_M file's), Q4_0 and IQ4_NL; every kernel here and in quant_gemv / quant_wide
dequantizes each of them.
Activations: fp16 is the native input; float32 input is rounded to fp16 by the packing kernel. Products
accumulate in fp32 on the tensor cores (mma.sync m16n8k16), and the weights are dequantized to fp16 on the
way (so results carry fp16 rounding of x and of each dequantized weight: relative error ~3e-4).

Several matrices that read the same x (q/k/v, gate/up) can share one `pack_activations(x)` result. The packing
can also compute x (RMSNorm with an optional residual add, per-head norm * silu(gate), SwiGLU) in the same launch,
and `matmul(..., out=y, accumulate=True)` adds the product into y (the residual add after an output projection).

Two kernels (docs/gpu_quant_matmul.md): "v2" (qmv_kernel, the default) keeps the weights in a tiled device
layout (`device_layout`: per 16 rows and 256 columns one contiguous block, so one bulk copy feeds a warp)
and splits K among the warps of a thread block, which add their partial sums in shared memory in a fixed
order: the output is bitwise reproducible. "v1" (qmm_kernel, the first version, kept for comparison) keeps
the GGUF row layout. Both can also split K across thread blocks (`splits > 1`, fp32 atomics into a zeroed
y; then the last bits can differ between runs); v2 does so only for matrices with very few rows.
Two more kernels read the v2 layout, and `matmul` picks them by launch width: "gemv" (kernels/quant_gemv.py,
CUDA cores, the narrowest widths) and "wide" (qmw_kernel in this .cu, launched by kernels/quant_wide.py: x staged
once per block for many row tiles, for speculative verify widths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import loader, quant_gemv, quant_wide

SOURCE = "quant_matmul.cu"

# ggml type ids (gguf.GGMLQuantizationType values)
F16 = 1
Q4_0 = 2
Q8_0 = 8
Q3_K = 11
Q4_K = 12
Q5_K = 13
Q6_K = 14
IQ4_XS = 23
IQ4_NL = 20

# qtype -> (name, values per block, bytes per block, shared-memory bytes per row slot)
_TYPES: dict[int, tuple[str, int, int, int]] = {
    F16: ("F16", 1, 2, 528),
    Q8_0: ("Q8_0", 32, 34, 304),
    Q3_K: ("Q3_K", 256, 110, 110),
    Q4_K: ("Q4_K", 256, 144, 144),
    Q5_K: ("Q5_K", 256, 176, 176),
    Q6_K: ("Q6_K", 256, 210, 240),
    IQ4_XS: ("IQ4_XS", 256, 136, 136),
    Q4_0: ("Q4_0", 32, 18, 144),
    IQ4_NL: ("IQ4_NL", 32, 18, 144),
}
# types whose v2 dequantization has run in the CPU simulation only: QuantMatrix takes them (the GPU tests do), the
# engine and the memory plan keep them as F16 until a GPU run of tests/test_kernels_quant_matmul.py passes (IQ4_XS
# passed on an H200 in session 40; Q3_K, Q4_0 and IQ4_NL in session 41); a new type starts here
UNPROVEN_QTYPES: frozenset[int] = frozenset()
SUPPORTED_QTYPES = frozenset(_TYPES) - UNPROVEN_QTYPES
# the v1 kernel's types (not Q3_K, Q5_K, IQ4_XS, Q4_0, IQ4_NL: v2 and the kernels on its layout)
V1_QTYPES = frozenset((F16, Q8_0, Q4_K, Q6_K))

KERNELS = ("v2", "v1")
WARPS = 4  # v1: warps per thread block (kernel constant ss::WARPS)
ROWS_PER_WARP = 32  # ss::ROWS_PER_WARP
ROWS_PER_BLOCK = WARPS * ROWS_PER_WARP
STAGES = 2  # ss::STAGES
CHUNK = 256  # ss::CHUNK
THREADS = 32 * WARPS
MAX_TOKENS = 64  # tokens per kernel launch; matmul() loops over wider inputs
PAD_BYTES = 1024  # readable slack after the last weight row (the v1 kernel's 16-byte copies overrun by < 512)
WARPS_PER_SM = 16  # v2: warps in flight per SM the launch shape aims for
STAGES_V2 = 2  # v2: shared-memory stages per warp (the H200 sweep: 3 or 4 were never faster)

_smem_configured: set[tuple] = set()
_smem_configured_max: dict[tuple, int] = {}
_sm_count: dict[int, int] = {}


def type_name(qtype: int) -> str:
    entry = _TYPES.get(int(qtype))
    return entry[0] if entry else f"type id {int(qtype)}"


def smem_bytes(qtype: int) -> int:
    """Dynamic shared memory one thread block of the v1 kernel for `qtype` uses."""
    return WARPS * STAGES * ROWS_PER_WARP * _TYPES[int(qtype)][3]


# v2 (qmv_kernel): bytes per row of a full 256-value chunk in the tiled layout (quants + side data), and
# whether the quants' 16-byte units are swizzled (kernel constants ss::Lay<QT>)
_CHUNK_ROW_BYTES = {F16: (512, 0), Q8_0: (256, 16), Q4_K: (144, 0), Q5_K: (176, 0), Q6_K: (192, 18),
                    IQ4_XS: (128, 8), Q3_K: (96, 14), Q4_0: (128, 16), IQ4_NL: (128, 16)}
_SWIZZLED = frozenset({F16, Q8_0})
# Q4_0 / IQ4_NL full chunks: the quants' 8-byte pieces swizzled instead (piece s of row r at s ^ 5 (r & 3): ss::Lay<2>)
_PIECE_SWIZZLED = frozenset({Q4_0, IQ4_NL})
# Q3_K's side bytes in the v2 layout: scales 0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11 then d. A gemv lane's two runs take
# sub-blocks whose scale bytes are 2 apart (their low nibbles in scales[c], [c + 2], top bits in [8 + p], [10 + p]):
# so each pair is one aligned 16-bit word (side rows are 14 bytes, 2-byte aligned), two loads instead of four.
Q3K_SIDE = (0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 13)
TILE_ROWS = 16  # rows per layout tile (one m16 mma tile)
SMEM_LIMIT = 227 * 1024  # dynamic shared memory one block may opt into (sm_80 / sm_90)
SMEM_PER_SM = 228 * 1024  # shared memory per SM (each block also reserves 1 KiB)


@dataclass(frozen=True)
class QmvConfig:
    """Launch shape of the v2 kernel: m16 tiles per warp, warps per block splitting K, copy stages, K splits
    across blocks (> 1: fp32 atomics into a zeroed y)."""

    m_tiles: int = 2
    k_warps: int = 1
    stages: int = 3
    splits: int = 1

    def smem_bytes(self, qtype: int, n_tiles: int = MAX_TOKENS // 8, ytile: bool = False) -> int:
        """Dynamic shared memory of one block (copy stages, partial-sum buffers, mbarriers) for n_tiles; ytile: and,
        16-byte aligned after them, the tile a warp through which an accumulating launch adds into y (sm_90 bulk
        reduce-adds, quant_wide.bulk_adds)."""
        main, side = _CHUNK_ROW_BYTES[int(qtype)]
        ring = self.k_warps * self.stages
        reduce = 2 * self.k_warps * self.m_tiles * n_tiles * 4 * 32 * 4 if self.k_warps > 1 else 0
        base = ring * self.m_tiles * TILE_ROWS * (main + side) + reduce + 8 * ring
        if not ytile:
            return base
        return -(-base // 16) * 16 + self.k_warps * self.m_tiles * TILE_ROWS * 8 * n_tiles * 4

    def check(self, qtype: int, n_tiles: int = MAX_TOKENS // 8) -> None:
        if self.m_tiles not in (1, 2):
            raise ValueError(f"m_tiles must be 1 or 2, not {self.m_tiles}")
        if not 1 <= self.k_warps <= 8:
            raise ValueError(f"k_warps must be 1..8, not {self.k_warps}")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"stages must be 2..4, not {self.stages}")
        if self.splits < 1:
            raise ValueError(f"splits must be >= 1, not {self.splits}")
        if self.smem_bytes(qtype, n_tiles) > SMEM_LIMIT:
            smem = self.smem_bytes(qtype, n_tiles)
            raise ValueError(f"{self} needs {smem} bytes of shared memory (limit {SMEM_LIMIT})")


def device_layout(qtype: int, raw: Any) -> Any:
    """The v2 kernel's tiled layout of packed GGUF rows `raw` [n_out, row_bytes] (numpy or cupy uint8).

    Rows are padded with zeros to a multiple of 16. For each 16-row tile and each 256-value chunk of K one
    contiguous block follows: the 16 rows' quants, then the 16 rows' side data (Q8_0, Q4_0, IQ4_NL: qs | d; Q6_K:
    ql+qh | scales+d; IQ4_XS: qs | d, scales_h, scales_l; Q4_K, Q5_K and F16: whole, no side data); a shorter last
    chunk (F16 and the 32-value block types when K % 256 != 0) comes last the same way. Every block starts 16-byte
    aligned and no byte is added or dropped per row. In full chunks of F16 and Q8_0 the 16-byte units of tile row r's
    quants are permuted (unit u stored at u ^ ((r + 2 (u >> 3)) & 7)), in those of Q4_0 and IQ4_NL their 8-byte pieces
    (piece s at s ^ 5 (r & 3)), so that the lanes' shared-memory reads fall in distinct banks.
    Q3_K splits like Q6_K: hmask+qs (96 bytes) | scales+d (14), its scale bytes in the order Q3K_SIDE.
    Returns a flat uint8 array of ceil(n_out / 16) * 16 * row_bytes bytes.
    """
    qtype = int(qtype)
    xp = _array_module(raw)
    n, rb = (int(v) for v in raw.shape)
    _, per, bb, _ = _TYPES[qtype]
    k = rb // bb * per
    npad = -(-n // TILE_ROWS) * TILE_ROWS
    if npad != n:
        raw = xp.concatenate([raw, xp.zeros((npad - n, rb), dtype=xp.uint8)])
    tiles = npad // TILE_ROWS
    nfull, tail = divmod(k, CHUNK)
    main_b, side_b = _CHUNK_ROW_BYTES[qtype]
    t_main = t_side = None
    if qtype == F16:
        main = raw[:, : 512 * nfull].reshape(npad, nfull, 512)
        side = None
        t_main = raw[:, 512 * nfull :]
    elif qtype in (Q4_K, Q5_K):
        main, side = raw.reshape(npad, nfull, bb), None
    elif qtype == IQ4_XS:
        blocks = raw.reshape(npad, nfull, 136)
        main, side = blocks[:, :, 8:], blocks[:, :, :8]
    elif qtype == Q6_K:
        blocks = raw.reshape(npad, nfull, 210)
        main, side = blocks[:, :, :192], blocks[:, :, 192:]
    elif qtype == Q3_K:
        blocks = raw.reshape(npad, nfull, 110)
        main, side = blocks[:, :, :96], blocks[:, :, 96:][:, :, xp.asarray(Q3K_SIDE)]
    else:  # Q8_0, Q4_0, IQ4_NL: {f16 d; qs}
        blocks = raw.reshape(npad, k // 32, bb)
        qs, d = blocks[:, :, 2:], blocks[:, :, :2]
        main = qs[:, : 8 * nfull].reshape(npad, nfull, main_b)
        side = d[:, : 8 * nfull].reshape(npad, nfull, 16)
        t_main = qs[:, 8 * nfull :].reshape(npad, -1)
        t_side = d[:, 8 * nfull :].reshape(npad, -1)
    if qtype in _SWIZZLED and nfull:
        units = main_b // 16
        r = np.arange(TILE_ROWS)[:, None]
        p = np.arange(units)[None, :]
        src = p ^ ((r + 2 * (p >> 3)) & 7)  # stored unit p of row r holds unit src (the map is an involution)
        idx = xp.asarray(np.ascontiguousarray(src.reshape(1, TILE_ROWS, 1, units, 1)))
        m5 = main.reshape(tiles, TILE_ROWS, nfull, units, 16)
        main = xp.take_along_axis(m5, xp.broadcast_to(idx, m5.shape), axis=3)
    elif qtype in _PIECE_SWIZZLED and nfull:
        r = np.arange(TILE_ROWS)[:, None]
        src = np.arange(16)[None, :] ^ (5 * (r & 3))  # an involution too
        idx = xp.asarray(np.ascontiguousarray(src.reshape(1, TILE_ROWS, 1, 16, 1)))
        m5 = main.reshape(tiles, TILE_ROWS, nfull, 16, 8)
        main = xp.take_along_axis(m5, xp.broadcast_to(idx, m5.shape), axis=3)
    parts = []
    if nfull:
        blk = [main.reshape(tiles, TILE_ROWS, nfull, main_b).transpose(0, 2, 1, 3).reshape(tiles, nfull, -1)]
        if side is not None:
            blk.append(side.reshape(tiles, TILE_ROWS, nfull, side_b).transpose(0, 2, 1, 3).reshape(tiles, nfull, -1))
        parts.append(xp.concatenate(blk, axis=2).reshape(tiles, -1) if len(blk) > 1 else blk[0].reshape(tiles, -1))
    if tail:
        parts.append(t_main.reshape(tiles, -1))
        if t_side is not None:
            parts.append(t_side.reshape(tiles, -1))
    out = xp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    return xp.ascontiguousarray(out).reshape(-1)


def _array_module(a: Any):
    if isinstance(a, np.ndarray):
        return np
    return loader.require()


# Products' weight copies marked evict-first in the L2 cache (kernels/bulk.cuh bulk_g2s_once_s: a step reads each
# weight byte once, and most of the rest again soon), on the sm_90 bulk-copy paths of the ring gemv, v2 and the wide
# kernel. The synthetic 27B's step on an H200: 0.998 / 0.992 / 0.994 / 0.992 / 0.984 of the time without
# at 1 / 4 / 16 / 23 / 41 tokens (bench/gemv_ab.py --step-ab evict, session 44)
WEIGHTS_EVICT_FIRST = True


def weight_defines() -> tuple[str, ...]:
    """The defines every product kernel's build takes for its weight copies (WEIGHTS_EVICT_FIRST)."""
    return ("SPECSPLIT_WEIGHTS_EVICT_FIRST",) if WEIGHTS_EVICT_FIRST else ()


def _defines(portable: bool) -> tuple[str, ...]:
    return (("SPECSPLIT_PORTABLE",) if portable else ()) + weight_defines()


def _check_kernel_args(qtype: int, n_tiles: int) -> int:
    qtype = int(qtype)
    if qtype not in _TYPES:
        raise ValueError(f"no GPU matmul kernel for {type_name(qtype)}")
    if not 1 <= n_tiles <= MAX_TOKENS // 8:
        raise ValueError(f"n_tiles must be 1..{MAX_TOKENS // 8}, not {n_tiles}")
    return qtype


def qmm_function(qtype: int, n_tiles: int, portable: bool = False) -> Any:
    """The compiled kernel for one storage type and one token-tile count (1..8 tiles of 8 tokens)."""
    qtype = _check_kernel_args(qtype, n_tiles)
    if qtype not in V1_QTYPES:
        raise ValueError(f"no v1 GPU matmul kernel for {type_name(qtype)} (the v2 kernel, the default, takes it)")
    defines = _defines(portable)
    fn = loader.get_function(SOURCE, f"qmm_kernel<{qtype}, {n_tiles}>", defines)
    smem = smem_bytes(qtype)
    key = (SOURCE, qtype, n_tiles, defines, _device_id())
    if smem > 48 * 1024 and key not in _smem_configured:
        fn.max_dynamic_shared_size_bytes = smem  # opt in above the 48 KiB default
        _smem_configured.add(key)
    return fn


def qmv_function(qtype: int, n_tiles: int, m_tiles: int, smem: int, portable: bool = False, pdl: bool = False,
                 order: int = 0) -> Any:  # fmt: skip
    """The compiled v2 kernel for one storage type, token-tile count (1..8) and m16 tiles per warp (1, 2); pdl: its
    launches may use programmatic dependent launch (V2_PDL; a launch without K splits, whose y no memset zeroes);
    order: the PackedX.order of the x it reads (1: its build with SPECSPLIT_XO_WG)."""
    qtype = _check_kernel_args(qtype, n_tiles)
    defines = _defines(portable) + (("SPECSPLIT_XO_WG",) if order else ())
    fn = loader.get_function(SOURCE, f"qmv_kernel<{qtype}, {n_tiles}, {m_tiles}>", defines,
                             pdl=pdl and V2_PDL and not portable)
    key = (SOURCE, "qmv", qtype, n_tiles, m_tiles, defines, _device_id())
    if smem > 48 * 1024 and _smem_configured_max.get(key, 0) < smem:
        fn.max_dynamic_shared_size_bytes = SMEM_LIMIT
        _smem_configured_max[key] = SMEM_LIMIT
    return fn


# Programmatic dependent launch (kernels/pdl.cuh, loader.get_function's pdl) for the packs that write the one-token
# staging (PackedX.q16): their consumer, the gemv ring kernel, requests its first weights before it waits for them.
# H100, 27B decode step (bench/gemv_ab.py): 8.16 -> 7.92 ms. (Never with `portable`: that build compiles the grid
# dependency wait out, kernels/pdl.cuh.) Session 7, while v2 took every verify width: the wider packs under PDL made
# the step 0.8 % slower, and every kernel of the step launched that way 2.8 % (width 1) / 9.6 % (width 23).
# Session 25: the packs of wider steps (no staging) under PDL, by kind ("x", "rms", "silu") from the width given,
# beside the wide kernel's (quant_wide.PDL: its first weights stream before its grid dependency wait). Step replays
# against the wide kernel's alone (bench/gemv_ab.py --step-ab packpdl, H100, three rounds) at widths 9 / 16 / 23 /
# 32 / 41 / 64: the SwiGLU pack 1.0109 / 1.0116 / 0.9875 / 0.9948 / 0.9956 / 0.9959; the norm packs 1.0013 / 1.0004 /
# 1.0124 / 0.9720 / 0.9762 / 0.9916; all 1.0137 / 1.0164 / 1.0021 / 0.9681 / 0.9711 / 0.9871. With a norm pack's
# block holding its slice's weights alone (27 KB of shared memory at the 27B's rows instead of 40 KB), the norm packs
# from 4 against 25 (--step-ab rmspdl): 0.9908 / 0.9965 / 0.9982 / 1.0188 at widths 4 / 9 / 16 / 23: kept at 25
# (session 30, with the wide kernel's later changes: 1.0022 / 1.0032 / 1.0041 / 1.0023).
PACK_PDL_WIDE: dict[str, int] = {"silu": 17, "rms": 25, "x": 25}
# v2 under PDL: its warps request their first stages' weights before the grid dependency wait (widepdl: 1.0274 of
# the step without any at width 23 against the wide kernel's alone 0.9825)
V2_PDL = False


def _pack_pdl(kind: str, tokens: int) -> bool:
    """Whether a pack of this kind at this width (above the staging's) launches under PDL (PACK_PDL_WIDE)."""
    return tokens >= PACK_PDL_WIDE.get(kind, MAX_TOKENS + 1)


def pack_function(in_f32: bool, portable: bool = False, pdl: bool = False) -> Any:
    return loader.get_function(SOURCE, f"pack_x_kernel<{1 if in_f32 else 0}>", _defines(portable),
                               pdl=pdl and not portable)


def warmup(
    qtypes=tuple(_TYPES), n_tiles=range(1, MAX_TOKENS // 8 + 1), portable: bool = False, kernel: str = "v2"
) -> None:
    """Compile the kernels up front (each is built on first use otherwise)."""
    for q in qtypes:
        for nt in n_tiles:
            if kernel == "v1":
                qmm_function(q, nt, portable)
            else:
                for mt in (1, 2):
                    qmv_function(q, nt, mt, 0, portable)
    pack_function(False, portable)
    pack_function(True, portable)


def default_m_tiles(n_tiles: int, out_features: int = 0) -> int:
    """m16 tiles per warp of the v2 kernel for a token-tile count and matrix height (see choose_config)."""
    return 1 if n_tiles <= 3 and out_features <= 65536 else 2


def _device_id() -> int:
    cupy = loader.require()
    return int(cupy.cuda.runtime.getDevice())


def sm_count() -> int:
    dev = _device_id()
    if dev not in _sm_count:
        cupy = loader.require()
        _sm_count[dev] = int(cupy.cuda.Device(dev).attributes["MultiProcessorCount"])
    return _sm_count[dev]


@dataclass(frozen=True)
class PackedX:
    """Activations re-laid out for the kernel (see pack_x_kernel): fp16, tokens padded to a multiple of 8.
    `residual`: the new residual stream x + residual when pack_activations normalised a sum (else None)."""

    data: Any  # cupy uint16 array of in_features * padded_tokens halves (None: q16 only, QuantMatrix.swiglu's)
    tokens: int
    in_features: int
    residual: Any = None
    # the gemv kernel's int16 staging of the same fp16 values (kernels/xq16.cuh), written by the same pack launch for
    # narrow inputs (Q16_TOKENS) so that no gemv block quantizes x itself: cupy uint32 [q16_words(K, T)] or None
    q16: Any = None
    # 0: the mma lanes' order every kernel reads; 1: the wide kernel's wgmma build's (quant_wide.wg_order), which only
    # that build reads (matmul sends such x there)
    order: int = 0

    @property
    def n_tiles(self) -> int:
        return (self.tokens + 7) // 8

    @property
    def padded_tokens(self) -> int:
        return 8 * self.n_tiles


@dataclass(frozen=True)
class StagedNorm:
    """x = rms_norm(s) * w for a ring gemv, staged by the product that wrote the residual stream s instead of packed
    by a launch of its own (kernels/quant_gemv.cu, NormStage): the int16 staging of s * w (PackedX.q16's layout)
    and per-16-row sums of s^2, from which the consumer scales its sums by 1 / sqrt(mean(s^2) + eps). Made by
    staged_norm; written by `producer.matmul(..., out=s, accumulate=True, stage=it)`; read by `consumer.matmul(it)`
    (can_stage_norm says when both launch the ring). NumPy twin: rms_norm(s, w, eps) (tests/quant_twins.py has the
    staging's)."""

    q16: Any       # cupy uint32 [q16_words(K, T)]
    ssq: Any       # cupy float32 [T, K / 16]
    weight: Any    # cupy float32 [K], contiguous
    eps: float
    tokens: int
    in_features: int
    residual: Any = None  # the stream s (the producer's out), for the caller's convenience


def staged_norm(stream: Any, weight: Any, eps: float) -> StagedNorm:
    """Buffers of a staged norm of `stream` (cupy float32 [T, K], the residual stream a producer accumulates into)
    with the norm weight [K]."""
    cupy = loader.require()
    tokens, k = (int(v) for v in stream.shape)
    if k % 256 or not 1 <= tokens <= Q16_TOKENS:
        raise ValueError(f"a staged norm takes K a multiple of 256 and 1..{Q16_TOKENS} tokens, not [{tokens}, {k}]")
    w = cupy.ascontiguousarray(cupy.asarray(weight, dtype=cupy.float32).reshape(-1))
    if int(w.size) != k:
        raise ValueError(f"a staged norm's weight has {int(w.size)} values, the stream {k}")
    return StagedNorm(cupy.empty(q16_words(k, tokens), cupy.uint32), cupy.empty((tokens, k // 16), cupy.float32), w,
                      float(eps), tokens, k, stream)


def can_fuse_swiglu(gate_up: Any, down: Any, tokens: int, sms: int | None = None, pair: bool = False) -> bool:
    """Whether the stacked [gate | up] matrix can stage SwiGLU for `down` at this width (QuantMatrix.swiglu; pair: its
    cluster pairs): its SwiGLU ring can run (quant_gemv.swiglu_shape) and down launches the ring gemv from x's int16
    staging."""
    if gate_up.kernel != "v2" or down.kernel != "v2":
        return False
    n, k = gate_up.shape
    return (down.in_features * 2 == n
            and quant_gemv.swiglu_shape(gate_up.qtype, n, k, tokens, sms, pair=pair) is not None
            and quant_gemv.ring_takes(down.qtype, n // 2, tokens, True))


def can_stage_norm(producer: Any, consumer: Any, tokens: int, sms: int | None = None) -> bool:
    """Whether `producer` (writing the stream) can stage the norm `consumer` reads at this width: both launch the
    ring gemv by default from x's int16 staging (quant_gemv.ring_takes), the stream has whole 256-value chunks, and
    the producer's ring blocks have the warps to stage (quant_gemv.ring_can_stage; sms: the device's SM count, None:
    the current device's)."""
    if producer.kernel != "v2" or consumer.kernel != "v2" or tokens > Q16_TOKENS:
        return False
    n, k = producer.shape
    return (consumer.in_features == n and n % 256 == 0
            and quant_gemv.ring_takes(producer.qtype, k, tokens, True)
            and quant_gemv.ring_takes(consumer.qtype, n, tokens, True)
            and quant_gemv.ring_can_stage(producer.qtype, n, k, tokens, sms))


# Widths whose packs also write PackedX.q16 unless told (pack_activations(q16=)): the widths at which the gemv ring
# kernel takes the K-quant matrices (quant_gemv.RING_UP_TO; it copies x's staging, it never quantizes x itself). Above
# them nothing reads it: writing it at two tokens when v2 took those products cost the 27B Q4_K_M's two-token step
# 0.7 % (H100, docs/gpu_quant_matmul.md "gemv: x staged once by the pack").
Q16_TOKENS = 3


def q16_words(k: int, tokens: int) -> int:
    """32-bit words of a PackedX.q16 buffer: per 256-value chunk and token 32 int16 units of 16 bytes, 16 scales
    and 16 sums."""
    return -(-k // 256) * tokens * (32 * 4 + 16 + 16)


# pack_rms_slices' count times this at one token: a one-token pack's blocks each redo the row's sum of squares, and
# more of them finish its writes sooner. H100, 27B width-1 step (bench/gemv_ab.py --step-ab packslices): x2 0.995,
# x4 0.990, x8 0.990; at 23 tokens x2 / x4 1.012 / 1.034, so one token only.
PACK_RMS_ONE_TOKEN_SCALE = 4
PACK_RMS_STATIC_SMEM = 2048  # pack_rms_kernel's static shared memory (1056 bytes: red[8], inv_g[256]), rounded up


def pack_rms_function(in_f32: bool, residual: bool, gate: bool, portable: bool = False, smem: int = 0,
                      pdl: bool = False) -> Any:
    """The fused norm pack for one input type and residual / gate choice; smem: dynamic shared memory the launch
    will use (opted into once above the 48 KiB default); pdl: as pack_function."""
    defines = _defines(portable)
    fn = loader.get_function(SOURCE, f"pack_rms_kernel<{int(in_f32)}, {int(residual)}, {int(gate)}>", defines,
                             pdl=pdl and not portable)
    key = (SOURCE, "pack_rms", int(in_f32), int(residual), int(gate), defines, _device_id())
    if smem > 48 * 1024 and _smem_configured_max.get(key, 0) < smem:
        want = SMEM_LIMIT - PACK_RMS_STATIC_SMEM  # static + dynamic must fit the block's limit
        fn.max_dynamic_shared_size_bytes = want
        _smem_configured_max[key] = want
    return fn


def pack_silu_function(in_f32: bool, portable: bool = False, pdl: bool = False) -> Any:
    return loader.get_function(SOURCE, f"pack_silu_kernel<{int(in_f32)}>", _defines(portable),
                               pdl=pdl and not portable)


def _rows_2d(a: Any, name: str) -> Any:
    """A [T, K] / [K] float16 / float32 cupy array whose rows are contiguous (row stride free)."""
    cupy = loader.require()
    a = cupy.asarray(a)
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if a.ndim != 2:
        raise ValueError(f"{name} must be [tokens, features], not shape {tuple(a.shape)}")
    if a.dtype not in (np.float16, np.float32):
        a = a.astype(np.float32)
    item = a.dtype.itemsize
    if a.strides[1] != item or a.strides[0] % item or (a.shape[0] > 1 and a.strides[0] < a.shape[1] * item):
        a = cupy.ascontiguousarray(a)
    return a


def pack_activations(
    x: Any,
    *,
    rms_weight: Any = None,
    eps: float = 1e-6,
    residual: Any = None,
    residual_out: Any = None,
    gate: Any = None,
    silu_up: Any = None,
    portable: bool = False,
    out: Any = None,
    q16: bool | None = None,
    staging_only: bool = False,
    order: int = 0,
) -> PackedX:
    """x: cupy (or numpy) [T, K] or [K] float16/float32, T <= 64, K a multiple of 32 -> PackedX (one launch).

    What is packed (NumPy twins: services.engine.layers rms_norm / silu, then a round to fp16):
      * default: x;
      * rms_weight [K]: rms_norm(x, rms_weight, eps); rms_weight [D] with D | K, D < K: the same per group of D
        values (per head); with `gate` (like x): times silu(gate) (the DeltaNet output norm, nr.norm_gate);
      * residual (like x, with rms_weight): rms_norm(x + residual) and the sum is written to `residual_out`
        (allocated when None; may be `residual` itself) and returned as PackedX.residual (nr.rms_norm(residual=));
      * silu_up (like x): silu(x) * silu_up (SwiGLU: x the gate half, silu_up the up half; row strides free).
    Arithmetic matches kernels/norm_rope.cu, so the result equals packing that module's output bit for bit.
    q16: also write the gemv kernel's int16 staging (PackedX.q16); None: for up to Q16_TOKENS tokens.
    staging_only (silu_up only): the staging and no fp16 x (PackedX.data None: for a product that reads the staging
    alone, a ring gemv: backend.reads_staging), the same staging bits from a launch over the real rows only.
    order: PackedX.order of the fp16 x (1: the wgmma build's, quant_wide.wg_order; the staging is the same).
    """
    cupy = loader.require()
    x = _rows_2d(x, "activations")
    tokens, k = (int(s) for s in x.shape)
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"pack_activations takes 1..{MAX_TOKENS} tokens, not {tokens}")
    if k % 32:
        raise ValueError(f"in_features must be a multiple of 32, not {k}")
    if rms_weight is None and (residual is not None or gate is not None):
        raise ValueError("residual and gate apply to a normalised pack (rms_weight)")
    if rms_weight is not None and silu_up is not None:
        raise ValueError("pack_activations fuses either a norm (rms_weight) or silu(x) * up, not both")
    if order not in (0, 1):
        raise ValueError(f"order must be 0 (mma lanes) or 1 (wgmma), not {order}")
    if staging_only and (silu_up is None or q16 is False or out is not None):
        raise ValueError("staging_only packs SwiGLU (silu_up) into the int16 staging alone (no q16=False, no out)")
    f32 = x.dtype == np.float32
    item = x.dtype.itemsize
    ldx = x.strides[0] // item if tokens > 1 else k
    padded = 8 * ((tokens + 7) // 8)
    size = k * padded
    if staging_only:
        pass
    elif out is None:
        out = cupy.empty(size, dtype=cupy.uint16)
    elif out.dtype != cupy.uint16 or out.size != size or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint16 array of {size} elements")
    # pack_x / pack_silu: one thread per 16-byte unit (tail chunks padded to 32), of the real rows only without x
    units = -(-k // 256) * (tokens if staging_only else padded) * 32
    blocks = max(1, min((units + 255) // 256, 8192))
    if q16 is None:
        q16 = staging_only or tokens <= Q16_TOKENS
    xq = cupy.empty(q16_words(k, tokens), dtype=cupy.uint32) if q16 else None
    xq_arg = xq if xq is not None else np.uint64(0)

    def like_x(a: Any, name: str, contiguous: bool = True) -> Any:
        a = _rows_2d(a, name)
        if a.shape != x.shape or a.dtype != x.dtype:
            raise ValueError(f"{name} {a.dtype}{tuple(a.shape)} must match x {x.dtype}{tuple(x.shape)}")
        return cupy.ascontiguousarray(a) if contiguous else a

    if silu_up is not None:
        up = like_x(silu_up, "silu_up", contiguous=False)
        ldu = up.strides[0] // item if tokens > 1 else k
        kern = pack_silu_function(f32, portable, q16 or _pack_pdl("silu", tokens))
        kern((blocks,), (256,), (x, np.int64(ldx), up, np.int64(ldu), np.int32(tokens), np.int32(k), np.int32(padded),
                                 out if not staging_only else np.uint64(0), xq_arg, np.int32(order)))  # fmt: skip
        return PackedX(None if staging_only else out, tokens, k, q16=xq, order=order)
    if rms_weight is None:
        kern = pack_function(f32, portable, q16 or _pack_pdl("x", tokens))
        kern((blocks,), (256,), (x, np.int64(ldx), np.int32(tokens), np.int32(k), np.int32(padded), out,
                                 xq_arg, np.int32(order)))  # fmt: skip
        return PackedX(out, tokens, k, q16=xq, order=order)

    w = cupy.asarray(rms_weight, dtype=cupy.float32).reshape(-1)
    group = int(w.size)
    if group < 1 or k % group or k // group > 256:
        raise ValueError(f"rms_weight has {group} values: K = {k} or a divisor of it (at most 256 groups)")
    w = _aligned16(cupy.ascontiguousarray(w), 0)
    x = _aligned16(x, ldx)
    ldx = x.strides[0] // item if tokens > 1 else k
    r = s = z = x
    ldz = ldx
    if residual is not None:
        r = _aligned16(like_x(residual, "residual"), k)
        if residual_out is None:
            residual_out = cupy.empty_like(r)
        elif residual_out.shape != r.shape or residual_out.dtype != r.dtype or not residual_out.flags.c_contiguous:
            raise ValueError(f"residual_out must be a contiguous {r.dtype} array of shape {tuple(r.shape)}")
        elif residual_out.data.ptr % 16:
            raise ValueError("residual_out must start 16-byte aligned")
        s = residual_out
    if gate is not None:
        z = like_x(gate, "gate", contiguous=False)
        ldz = z.strides[0] // item if tokens > 1 else k
        z = _aligned16(z, ldz)
        ldz = z.strides[0] // item if tokens > 1 else k
    gated = gate is not None
    slices = pack_rms_slices(k, group, tokens)
    smem = pack_rms_smem_bytes(k, group, gated, slices)
    if smem > SMEM_LIMIT - PACK_RMS_STATIC_SMEM:
        limit = SMEM_LIMIT - PACK_RMS_STATIC_SMEM
        raise ValueError(f"a fused norm over {k} values needs {smem} bytes of shared memory (limit {limit})")
    kern = pack_rms_function(f32, residual is not None, gated, portable, smem, pdl=q16 or _pack_pdl("rms", tokens))
    kern((pack_rms_grid(tokens, k, padded, slices),), (256,),
         (x, np.int64(ldx), r, s, z, np.int64(ldz), w, np.int32(group), np.float32(eps), np.int32(tokens),
          np.int32(k), np.int32(padded), out, np.int32(slices), xq_arg, np.int32(order)), shared_mem=smem)  # fmt: skip
    return PackedX(out, tokens, k, residual_out if residual is not None else None, q16=xq, order=order)


# token tables embed_rows decodes on the device (ggml ids): F32, F16, Q8_0, Q4_K (memory_plan.GPU_TABLE_TYPES: the
# tables the GPU engine keeps there; others, e.g. Q6_K, stay on the host and their rows are decoded there)
EMBED_TYPES = frozenset((0, F16, Q8_0, Q4_K))


def embed_rows(table: Any, qtype: int, n_embd: int, ids: Any, *, out: Any = None, portable: bool = False) -> Any:
    """float32 rows [T, n_embd] of a token table kept packed on the device (embed_rows_kernel, one launch): row
    ids[t] decoded with the float32 operations of services/engine/quants, so equal to NumpyBackend.embed bit for bit.

    table: cupy uint8 (rows, row bytes), the GGUF rows as stored; ids: cupy int32 (T,) (read when the kernel runs:
    a captured step's token buffer); an id outside the table gives zeros. out: float32 (T, n_embd) to write."""
    cupy = loader.require()
    qtype = int(qtype)
    if qtype not in EMBED_TYPES:
        raise ValueError(f"embed_rows decodes {sorted(EMBED_TYPES)} tables, not {type_name(qtype)}")
    if table.dtype != cupy.uint8 or table.ndim != 2 or not table.flags.c_contiguous:
        raise ValueError(f"table must be a contiguous uint8 (rows, row bytes) array, not {table.dtype}{table.shape}")
    rows, row_bytes = (int(v) for v in table.shape)
    per, nbytes = {0: (1, 4), F16: (1, 2), Q8_0: (32, 34), Q4_K: (256, 144)}[qtype]
    if n_embd % per or row_bytes != n_embd // per * nbytes:
        raise ValueError(f"a {type_name(qtype)} row of {n_embd} values is {n_embd // per * nbytes} bytes, not "
                         f"{row_bytes}")
    if ids.dtype != cupy.int32 or ids.ndim != 1 or not ids.flags.c_contiguous:
        raise ValueError(f"ids must be a contiguous int32 vector, not {ids.dtype}{ids.shape}")
    T = int(ids.shape[0])
    if out is None:
        out = cupy.empty((T, n_embd), cupy.float32)
    elif out.dtype != cupy.float32 or tuple(out.shape) != (T, n_embd) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous float32 array of shape {(T, n_embd)}")
    if T:
        fn = loader.get_function(SOURCE, f"embed_rows_kernel<{qtype}>", _defines(portable))
        fn(((n_embd + 255) // 256, T), (256,), (table, np.int64(row_bytes), np.int32(rows), ids, np.int32(n_embd),
                                                 out))  # fmt: skip
    return out


def pack_rms_smem_bytes(k: int, group: int, gate: bool, slices: int = 1) -> int:
    """Dynamic shared memory of pack_rms_kernel over `slices` blocks a row: the row (x [+ r]) as fp32, z with a gate,
    and the norm weight (a row norm's: the most values one slice packs; a per-head norm's: the group)."""
    nch = -(-k // 256)
    w_values = min(k, -(-nch // max(1, slices)) * 256) if group >= k else group
    return 4 * (k * (2 if gate else 1) + w_values)


def pack_rms_slices(k: int, group: int, tokens: int) -> int:
    """Blocks per token row of pack_rms_kernel for `tokens` rows (each packs a run of whole 256-value chunks): at most
    one 16-byte unit per thread (K = 5120: 3), and for a per-head norm at most one head per warp (the 27B DeltaNet
    output, 48 heads of 128: 6), so no block walks the row's arithmetic alone; PACK_RMS_ONE_TOKEN_SCALE times that
    for one token (K = 5120: 12); at most one per chunk."""
    nch = -(-k // 256)
    want = -(-(k // 8) // 256)
    if group < k:
        want = max(want, -(-(k // group) // 8))
    return max(1, min(nch, want * (PACK_RMS_ONE_TOKEN_SCALE if tokens == 1 else 1)))


def pack_rms_grid(tokens: int, k: int, padded: int, slices: int = 1) -> int:
    """pack_rms_kernel's blocks: `slices` per token row, plus enough to write the padding rows' zeros at about 8
    16-byte stores per thread (one block for T = 1 at K = 5120; they run beside the row blocks, off the critical
    path)."""
    rows = tokens * slices
    if padded == tokens:
        return rows
    return rows + max(1, min(padded - tokens, -(-(padded - tokens) * (k // 8) // (256 * 8))))


def _aligned16(a: Any, ld: int) -> Any:
    """`a` itself when its first row and its row stride (ld elements) are 16-byte aligned, else a contiguous copy
    (pack_rms_kernel stages rows with 16-byte loads)."""
    if a.data.ptr % 16 == 0 and (a.shape[0] <= 1 or (ld * a.dtype.itemsize) % 16 == 0):
        return a
    return a.copy()


class QuantMatrix:
    """A weight matrix [out_features, in_features] kept on the GPU in its GGUF block layout."""

    def __init__(self, qtype: int, data: Any, shape: tuple[int, ...], *, name: str = "weight", kernel: str = "v2"):
        cupy = loader.require()
        if kernel not in KERNELS:
            raise ValueError(f"{name}: kernel must be one of {KERNELS}, not {kernel!r}")
        self.kernel = kernel
        qtype = int(qtype)
        if qtype not in _TYPES:
            supported = ", ".join(v[0] for v in _TYPES.values())
            raise ValueError(f"{name}: no GPU matmul for {type_name(qtype)} (supported: {supported})")
        if kernel == "v1" and qtype not in V1_QTYPES:
            raise ValueError(f"{name}: no v1 GPU matmul for {type_name(qtype)} (the v2 kernel, the default, takes it)")
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2:
            raise ValueError(f"{name}: a weight matrix must be 2-D [out, in], not shape {shape}")
        n_out, k = shape
        _, per_block, block_bytes, _ = _TYPES[qtype]
        if n_out < 1 or k < 32 or k % per_block or k % 32:
            raise ValueError(
                f"{name}: in_features {k} must be a positive multiple of {max(per_block, 32)} for {type_name(qtype)}"
            )
        self.name = name
        self.qtype = qtype
        self.shape = shape
        self.row_bytes = k // per_block * block_bytes
        self.nbytes = n_out * self.row_bytes  # weight bytes (what one call streams)

        # The upload's device temporaries (the raw rows, device_layout's gathers) come from a pool of their own, freed
        # before returning: from CuPy's default pool, a later weight would be carved out of a freed temporary and
        # the rest of that block could never go back to the device (1.1 GB of a 27B model's 15.4 GB, measured), so
        # the default pool holds exactly the weights (services/engine/memory_plan.py counts them).
        staging = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(staging.malloc):
            if isinstance(data, cupy.ndarray):
                raw = cupy.ascontiguousarray(data).reshape(-1).view(cupy.uint8)
            else:
                raw = np.ascontiguousarray(np.asarray(data)).reshape(-1).view(np.uint8)
            if raw.size != self.nbytes:
                raise ValueError(
                    f"{name}: {type_name(qtype)} data for shape {shape} must be {self.nbytes} bytes, found {raw.size}"
                )
            if kernel == "v2":
                laid = device_layout(qtype, cupy.asarray(raw).reshape(n_out, self.row_bytes))
                size = int(laid.size)
            else:
                laid, size = raw, self.nbytes
        buf = cupy.empty(size + PAD_BYTES, dtype=cupy.uint8)
        buf[size:] = 0
        if isinstance(laid, cupy.ndarray):
            buf[:size] = laid
        else:
            buf[:size].set(laid)
        del laid, raw
        cupy.cuda.get_current_stream().synchronize()  # the copy has read the temporaries
        staging.free_all_blocks()
        if buf.data.ptr % 16:
            raise RuntimeError("device allocation is not 16-byte aligned")
        self._buf = buf

    @classmethod
    def from_raw(cls, tensor: Any, *, kernel: str = "v2") -> QuantMatrix:
        """From a services.engine.formats.RawTensor (qtype, shape in numpy order, raw storage)."""
        return cls(tensor.qtype, tensor.data, tensor.shape, name=getattr(tensor, "name", "weight"), kernel=kernel)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    @property
    def device_buffer(self) -> Any:
        """The weights on the GPU (v2: device_layout(); v1: the GGUF rows), plus PAD_BYTES of zeros."""
        return self._buf

    def n_chunks(self) -> int:
        return (self.in_features + CHUNK - 1) // CHUNK

    def grid_rows(self) -> int:
        return (self.out_features + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK

    def choose_splits(self, tokens: int = 1) -> int:
        """K splits across thread blocks: v1, about 4 blocks per SM with >= 4 chunks each; v2, see choose_config."""
        if self.kernel == "v2":
            return self.choose_config(tokens).splits
        want = round(4 * sm_count() / self.grid_rows())
        if want <= 1:
            return 1
        return max(1, min(want, self.n_chunks() // 4))

    def choose_config(self, tokens: int = 1) -> QmvConfig:
        """Launch shape of the v2 kernel for a width (from the H200 sweep in docs/gpu_quant_matmul.md).

        One m16 tile per warp up to 24 tokens unless the matrix is very tall, two above (each dequantized
        weight then feeds more mma). K is split among the warps of a block: at one token tile as many warps
        per row group as still fit every group on the GPU at once (a warp's speed is bound by its own latency
        there, so warps in flight pay, and a second wave would leave a tail); otherwise 4, or 8 for long rows
        up to 8 tokens, or 1 for very tall matrices from 41 tokens. Two copy stages (more only cost shared
        memory); K split across blocks only when rows are very few."""
        n_tiles = (min(tokens, MAX_TOKENS) + 7) // 8
        mt = default_m_tiles(n_tiles, self.out_features)
        groups = -(-self.out_features // (TILE_ROWS * mt))
        chunks = self.n_chunks()
        # 8 for long rows at one token tile; at two (9-16 tokens) 4 since the loop lost its index math (H100,
        # 2026-11-26: ffn_down at 16 tokens Q4_K 30.9 vs 31.5 us with 8, Q6_K 39.3 vs 40.7)
        kw = 8 if chunks >= 40 and n_tiles <= 1 else 4
        if n_tiles >= 6 and self.out_features > 65536:
            kw = 1  # the LM head from 41 tokens: enough row groups, and no reduction buffers (sweep: 625 vs 828 us)
        if n_tiles == 1 and mt == 1:
            fit = (self._warps_per_sm(n_tiles, mt) * sm_count()) // groups
            if fit >= 2:
                kw = min(8, fit)
        kw = max(1, min(kw, chunks // 2))
        splits = 1
        want = WARPS_PER_SM * sm_count()
        if groups * kw < want // 4 and chunks // kw >= 16:  # very few rows (e.g. a 48-row projection)
            splits = max(1, min(-(-want // (4 * groups * kw)), chunks // (8 * kw)))
        cfg = QmvConfig(mt, kw, STAGES_V2, splits)
        while cfg.smem_bytes(self.qtype, n_tiles) > SMEM_LIMIT and cfg.k_warps > 1:
            cfg = QmvConfig(mt, cfg.k_warps // 2, cfg.stages, splits)
        return cfg

    def _warps_per_sm(self, n_tiles: int, m_tiles: int) -> int:
        """Warps of the v2 kernel one SM holds, by its register use (the kernel is compiled to ask)."""
        regs = int(getattr(qmv_function(self.qtype, n_tiles, m_tiles, 0), "num_regs", 0) or 128)
        return max(1, loader.resident_warps(regs))

    def grid_v2(self, cfg: QmvConfig, kern: Any, smem: int) -> int:
        """Blocks of the persistent v2 launch: at most as many as fit on the GPU at once, sized so that each block
        walks the same number of row groups (a block with one group more than the others sets the time)."""
        groups = -(-self.out_features // (TILE_ROWS * cfg.m_tiles))
        regs = int(getattr(kern, "num_regs", 0) or 128)
        resident = loader.resident_blocks(cfg.k_warps, regs, smem, SMEM_PER_SM) * sm_count()
        if groups <= resident:
            return groups
        # several groups per block: give every block the same number (to within one), unless that idles a
        # quarter of the resident slots
        balanced = -(-groups // -(-groups // resident))
        return balanced if 4 * balanced >= 3 * resident else resident

    def matmul(
        self,
        x: Any,
        *,
        out: Any = None,
        splits: int | None = None,
        portable: bool = False,
        config: QmvConfig | None = None,
        accumulate: bool = False,
        kernel: str | None = None,
        stage: StagedNorm | None = None,
        wg_order: bool = False,
    ) -> Any:
        """y = x @ W^T as a cupy float32 array [T, out] ([out] for a 1-D x); accumulate=True: out += x @ W^T
        (the residual add after an output projection, in the v2 kernel's epilogue: one plain add per value,
        deterministic unless K is split across blocks; out is required).

        x: cupy/numpy [T, in] or [in] float16/float32 (any T; launches of <= 64 tokens), or a PackedX.
        out: optional float32 [T, out] to write into; its rows may be strided (a column slice of a wider output,
        e.g. one member of a stacked projection: out.strides[1] == 4, out.strides[0] >= 4 out).
        splits: K splits across thread blocks (None: automatic; v2: overrides config.splits).
        config: v2 launch shape (None: choose_config).
        portable: use the kernels built without inline PTX (the HIP / fallback path), for testing.
        kernel: None picks per launch width: "gemv" (kernels/quant_gemv.cu, CUDA cores) up to its measured
        crossover width on a v2-layout matrix, "wide" (qmw_kernel, kernels/quant_wide.py) from its crossover width,
        else the matrix's own kernel; "gemv" / "wide" / "v2" / "v1" force one (gemv, wide and v2 share the v2
        layout; config may then be a quant_gemv.GemvConfig / quant_wide.WideConfig).
        x may also be a StagedNorm (a ring gemv reads it); stage: a StagedNorm of `out` (the residual stream, usually
        accumulated into) this product writes for the next norm's product (ring gemv; can_stage_norm).
        wg_order: raw x is packed in the wgmma order (PackedX.order 1) for every launch the dispatch then runs on the
        wide kernel's wgmma build (quant_wide.raw_wg_order), in the mma order elsewhere; a PackedX keeps its own.
        """
        cupy = loader.require()
        n_out, k = self.shape
        squeeze = False
        if isinstance(x, StagedNorm) or stage is not None:
            return self._matmul_staged(x, out, accumulate, stage, portable, config, kernel, splits)
        if isinstance(x, PackedX):
            if x.in_features != k:
                raise ValueError(f"{self.name}: activations have {x.in_features} features, the matrix takes {k}")
            tokens = x.tokens
            if x.data is None and not (self.kernel == "v2" and kernel in (None, "gemv") and splits is None
                                       and quant_gemv.ring_takes(self.qtype, k, tokens, x.q16 is not None)):
                raise ValueError(f"{self.name}: these activations are int16 staging only (QuantMatrix.swiglu), which "
                                 f"only the ring gemv reads ({self.type_name}, K = {k}, {tokens} tokens)")
        else:
            x = cupy.asarray(x)
            if x.ndim == 1:
                squeeze = True
                x = x.reshape(1, -1)
            if x.ndim != 2 or int(x.shape[1]) != k:
                raise ValueError(f"{self.name}: activations of shape {tuple(x.shape)} do not fit in_features {k}")
            tokens = int(x.shape[0])
        if tokens < 1:
            raise ValueError(f"{self.name}: no tokens to multiply")
        if out is None:
            if accumulate:
                raise ValueError(f"{self.name}: accumulate=True adds into `out`, which is missing")
            out = cupy.empty((tokens, n_out), dtype=cupy.float32)
        else:
            check_out(out, tokens, n_out, self.name)

        if config is not None and self.kernel != "v2":
            raise ValueError(f"{self.name}: config applies to the v2 kernel only")
        if isinstance(x, PackedX) and x.order and self.kernel != "v2":
            raise ValueError(f"{self.name}: x in the wgmma order (PackedX.order 1) is read by the v2-layout kernels "
                             f"(gemv, v2, wide), not this matrix's {self.kernel}")
        if isinstance(x, PackedX):
            self._launcher(kernel, tokens, config, splits, x.q16 is not None, x.order)(x, out, splits, portable,
                                                                                      config, accumulate)
        else:
            for start in range(0, tokens, MAX_TOKENS):
                stop = min(tokens, start + MAX_TOKENS)
                order = int(wg_order and quant_wide.raw_wg_order(self, stop - start, kernel, config, splits, portable))
                packed = pack_activations(x[start:stop], portable=portable, order=order)
                launch = self._launcher(kernel, stop - start, config, splits, packed.q16 is not None, order)
                launch(packed, out[start:stop], splits, portable, config, accumulate)
        return out.reshape(n_out) if squeeze else out

    def swiglu(self, x: Any, *, portable: bool = False, config: Any = None, pair: bool = False) -> PackedX:
        """silu(g) * u for [g | u] = x @ W^T, this matrix a stacked [gate | up] (2 F rows), as the activations of the
        down product: a PackedX holding only the int16 staging (q16; data None), which the ring gemv reads. One ring
        launch (quant_gemv.gemv_swiglu; pair: its cluster pairs), bitwise the product followed by
        pack_activations(g, silu_up=u)'s staging. x: a PackedX with its staging or a StagedNorm (1..Q16_TOKENS
        tokens; can_fuse_swiglu says when both sides can); config: a quant_gemv.GemvConfig.
        Wider (x a PackedX of fp16 data and more than Q16_TOKENS tokens, or config a WideConfig): one wide launch
        (quant_wide.wide_swiglu; quant_wide.can_swiglu says when), a PackedX of fp16 data alone: pack_activations(g,
        silu_up=u) of the launch's sums (deterministic; its split row blocks' pieces fall where its own split puts
        them)."""
        if isinstance(config, quant_wide.WideConfig) or (
                isinstance(x, PackedX) and x.data is not None and x.tokens > Q16_TOKENS):
            if isinstance(x, StagedNorm):
                raise ValueError(f"{self.name}: a staged norm is read by the ring gemv only, not the wide kernel")
            if not isinstance(x, PackedX):
                x = pack_activations(x, portable=portable)
            return quant_wide.wide_swiglu(self, x, config=config, portable=portable)
        if not isinstance(x, (PackedX, StagedNorm)):
            x = pack_activations(x, portable=portable, q16=True)
        q16 = quant_gemv.gemv_swiglu(self, x, config=config, portable=portable, pair=pair)
        return PackedX(None, x.tokens, self.out_features // 2, q16=q16)

    def _matmul_staged(self, x: Any, out: Any, accumulate: bool, stage: StagedNorm | None, portable: bool,
                       config: Any, kernel: str | None, splits: int | None) -> Any:
        """matmul reading a StagedNorm and / or writing one: the ring gemv only (anything else is refused)."""
        if kernel not in (None, "gemv") or splits is not None or not (
                config is None or isinstance(config, quant_gemv.GemvConfig)):
            raise ValueError(f"{self.name}: a staged norm is read and written by the ring gemv kernel only")
        if not isinstance(x, (PackedX, StagedNorm)):
            x = pack_activations(x, portable=portable, q16=True)
        if out is None:
            if stage is not None or accumulate:
                raise ValueError(f"{self.name}: staging the next norm or accumulating writes into `out`, missing")
            out = loader.require().empty((x.tokens, self.out_features), np.float32)
        quant_gemv.gemv(self, x, out, accumulate=accumulate, config=config, portable=portable, stage=stage)
        return out

    def _launcher(self, kernel: str | None, tokens: int, config: Any, splits: int | None, q16: bool = False,
                  order: int = 0):
        """The launch method for one width (see matmul's `kernel`); q16: x comes with PackedX.q16; order: its
        PackedX.order (the wide kernel's crossover in the wgmma order)."""
        if kernel is None:
            if isinstance(config, quant_gemv.GemvConfig):
                kernel = "gemv"
            elif isinstance(config, quant_wide.WideConfig):
                kernel = "wide"
            elif self.kernel == "v2" and config is None and splits is None:
                if quant_gemv.prefer_gemv(self.qtype, self.in_features, tokens, q16):
                    kernel = "gemv"
                elif quant_wide.prefer_wide(self.qtype, tokens, *self.shape, order=order):
                    kernel = "wide"
                else:
                    kernel = "v2"
            else:
                kernel = self.kernel
        if kernel == "gemv" and self.kernel == "v2":
            return self._launch_gemv
        if kernel == "wide" and self.kernel == "v2":
            return self._launch_wide
        if kernel != self.kernel:
            raise ValueError(f"{self.name}: kernel {kernel!r} does not read this matrix's {self.kernel} layout")
        if isinstance(config, (quant_gemv.GemvConfig, quant_wide.WideConfig)):
            raise ValueError(f"{self.name}: a {type(config).__name__} applies to the {kernel} kernel only")
        return self._launch_v2 if kernel == "v2" else self._launch

    def _launch_gemv(
        self, packed: PackedX, out: Any, splits: int | None, portable: bool, config: Any, accumulate: bool = False
    ) -> None:
        if splits is not None or isinstance(config, QmvConfig):
            raise ValueError(f"{self.name}: splits / QmvConfig apply to the v2 kernel, not gemv")
        quant_gemv.gemv(self, packed, out, accumulate=accumulate, config=config, portable=portable)

    def _launch_wide(
        self, packed: PackedX, out: Any, splits: int | None, portable: bool, config: Any, accumulate: bool = False
    ) -> None:
        if splits is not None or (config is not None and not isinstance(config, quant_wide.WideConfig)):
            raise ValueError(f"{self.name}: splits / {type(config).__name__} do not apply to the wide kernel")
        quant_wide.wide(self, packed, out, accumulate=accumulate, config=config, portable=portable)

    def _launch_v2(
        self, packed: PackedX, out: Any, splits: int | None, portable: bool, config: QmvConfig | None,
        accumulate: bool = False,
    ) -> None:
        cupy = loader.require()
        n_out, k = self.shape
        cfg = self.choose_config(packed.tokens) if config is None else config
        if splits is not None:
            cfg = QmvConfig(cfg.m_tiles, cfg.k_warps, cfg.stages, int(splits))
        cfg.check(self.qtype, packed.n_tiles)
        s = max(1, min(cfg.splits, self.n_chunks()))
        smem = cfg.smem_bytes(self.qtype, packed.n_tiles)
        pdl = s == 1  # (K splits: a memset zeroes y before the launch)
        kern = qmv_function(self.qtype, packed.n_tiles, cfg.m_tiles, smem, portable, pdl, packed.order)
        grid_x = self.grid_v2(cfg, kern, smem)
        # an accumulating launch without K splits adds into y by bulk reduce-adds where they exist and the tile keeps
        # the grid (the blocks a SM)
        ytile = False
        if accumulate and s == 1 and packed.n_tiles >= 2 and quant_wide.bulk_adds(portable):
            tiled = cfg.smem_bytes(self.qtype, packed.n_tiles, True)
            ytile = tiled <= SMEM_LIMIT and self.grid_v2(cfg, kern, tiled) == grid_x
            if ytile:
                smem = tiled
                kern = qmv_function(self.qtype, packed.n_tiles, cfg.m_tiles, smem, portable, pdl, packed.order)
        if s > 1 and not accumulate:  # the splits add into y with atomics (accumulate: into y as it is)
            if out.flags.c_contiguous:
                stream = cupy.cuda.get_current_stream()
                cupy.cuda.runtime.memsetAsync(out.data.ptr, 0, out.nbytes, stream.ptr)
            else:  # a column slice: only its own columns
                out.fill(0)
        kern(
            (grid_x, s),
            (32 * cfg.k_warps,),
            (
                self._buf,
                np.int64(self.row_bytes),
                np.int32(n_out),
                np.int32(k),
                packed.data,
                np.int32(packed.tokens),
                out,
                np.int32(cfg.stages),
                np.int32(bool(accumulate)),
                np.int64(out_stride(out)),
                np.int32(ytile),
            ),
            shared_mem=smem,
        )

    def _launch(
        self, packed: PackedX, out: Any, splits: int | None, portable: bool, config: Any = None,
        accumulate: bool = False,
    ) -> None:
        cupy = loader.require()
        if accumulate or not out.flags.c_contiguous:
            # v1 has no accumulating epilogue and writes contiguous rows only: a product, then one add / copy
            y = cupy.empty(out.shape, cupy.float32)
            self._launch(packed, y, splits, portable, config)
            if accumulate:
                out += y
            else:
                out[...] = y
            return
        n_out, k = self.shape
        s = self.choose_splits(packed.tokens) if splits is None else int(splits)
        s = max(1, min(s, self.n_chunks()))
        kern = qmm_function(self.qtype, packed.n_tiles, portable)
        if s > 1:  # the splits add into y with atomics
            stream = cupy.cuda.get_current_stream()
            cupy.cuda.runtime.memsetAsync(out.data.ptr, 0, out.nbytes, stream.ptr)
        kern(
            (self.grid_rows(), s),
            (THREADS,),
            (
                self._buf,
                np.int64(self.row_bytes),
                np.int32(n_out),
                np.int32(k),
                packed.data,
                np.int32(packed.tokens),
                out,
            ),
            shared_mem=smem_bytes(self.qtype),
        )

    def __repr__(self) -> str:
        return (
            f"QuantMatrix({self.name!r}, {self.type_name}, shape={self.shape}, {self.nbytes / 2**20:.1f} MiB, "
            f"{self.kernel})"
        )


def check_v2_product(W: Any, packed: Any, out: Any, kernel: str, max_tokens: int) -> int:
    """The checks a kernel on the v2 device layout makes of its operands (gemv, wide): W holds that layout, x has
    W's in-features and 1..max_tokens tokens, `out` fits (check_out; None: the launch writes no y). Returns the token
    count."""
    n_out, k = W.shape
    if W.kernel != "v2":
        raise ValueError(f"{W.name}: the {kernel} kernel reads the v2 device layout; this matrix holds GGUF rows (v1)")
    if packed.in_features != k:
        raise ValueError(f"{W.name}: activations have {packed.in_features} features, the matrix takes {k}")
    tokens = packed.tokens
    if not 1 <= tokens <= max_tokens:
        raise ValueError(f"{W.name}: the {kernel} kernel takes 1..{max_tokens} tokens, not {tokens}")
    if out is not None:
        check_out(out, tokens, n_out, W.name)
    return tokens


def check_out(out: Any, tokens: int, n_out: int, name: str = "weight") -> None:
    """Raise unless `out` is a float32 [tokens, n_out] array with contiguous rows spaced >= n_out floats apart
    (what the kernels' row stride takes: a contiguous array or a column slice of a wider one)."""
    ok = out.dtype == np.float32 and tuple(out.shape) == (tokens, n_out) and out.strides[1] == 4
    if ok and tokens > 1:
        ok = out.strides[0] % 4 == 0 and out.strides[0] >= 4 * n_out
    if not ok:
        raise ValueError(
            f"{name}: out must be float32 of shape {(tokens, n_out)} with contiguous rows (row stride >= {n_out}), "
            f"not {out.dtype}{tuple(out.shape)} strides {tuple(out.strides)}"
        )


def out_stride(out: Any) -> int:
    """Row stride of a [T, N] float32 output in floats (N for one row, whatever its nominal stride)."""
    return int(out.strides[0]) // 4 if out.shape[0] > 1 else int(out.shape[1])


def flops(tokens: int, shape: tuple[int, int]) -> int:
    return 2 * tokens * shape[0] * shape[1]


def bytes_per_weight(qtype: int) -> float:
    _, per_block, block_bytes, _ = _TYPES[int(qtype)]
    return block_bytes / per_block


def block_geometry(qtype: int) -> tuple[int, int]:
    """(values, bytes) of one GGUF block of a storage type this module takes."""
    _, per_block, block_bytes, _ = _TYPES[int(qtype)]
    return per_block, block_bytes
