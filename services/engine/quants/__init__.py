"""NumPy reference ("twin") codecs for the ggml storage types specsplit reads from model files.

dequantize() turns raw ggml blocks into float32; quantize() produces raw blocks for the types tests and
caches need to write. Both are bit-exact with ggml's reference C code.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import UnsupportedModelError
from . import float as _float
from . import iquants, kquants, legacy

Q = GGMLQuantizationType

# Each decoder maps (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32.
_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    Q.F32: _float.dequantize_f32,
    Q.F16: _float.dequantize_f16,
    Q.BF16: _float.dequantize_bf16,
    Q.Q4_0: legacy.dequantize_q4_0,
    Q.Q8_0: legacy.dequantize_q8_0,
    Q.Q3_K: kquants.dequantize_q3_k,
    Q.Q4_K: kquants.dequantize_q4_k,
    Q.Q5_K: kquants.dequantize_q5_k,
    Q.Q6_K: kquants.dequantize_q6_k,
    Q.IQ4_NL: iquants.dequantize_iq4_nl,
    Q.IQ4_XS: iquants.dequantize_iq4_xs,
}

# Each encoder maps (n_blocks, block_size) float32 -> (n_blocks, type_size) uint8.
_QUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    Q.F32: _float.quantize_f32,
    Q.F16: _float.quantize_f16,
    Q.BF16: _float.quantize_bf16,
    Q.Q4_0: legacy.quantize_q4_0,
    Q.Q8_0: legacy.quantize_q8_0,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DEQUANTIZERS)
QUANTIZABLE_TYPES: frozenset[GGMLQuantizationType] = frozenset(_QUANTIZERS)

# qtype -> (values per block, bytes per block), for the supported types.
BLOCK_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {t: GGML_QUANT_SIZES[t] for t in SUPPORTED_TYPES}


def type_name(qtype: int) -> str:
    """'Q4_K' for a known id, 'type id 99' otherwise."""
    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return f"type id {int(qtype)}"


def _known(qtype: int) -> GGMLQuantizationType:
    try:
        qt = GGMLQuantizationType(int(qtype))
    except ValueError:
        raise UnsupportedModelError(f"unknown ggml type id {int(qtype)}") from None
    if qt not in GGML_QUANT_SIZES:
        raise UnsupportedModelError(f"ggml type {qt.name} has no known block size")
    return qt


def row_bytes(qtype: int, n_cols: int) -> int:
    """Bytes one row of n_cols values takes; works for every ggml type with a known block size."""
    qt = _known(qtype)
    block, size = GGML_QUANT_SIZES[qt]
    if n_cols % block:
        raise ValueError(f"a {qt.name} row must hold a multiple of {block} values, not {n_cols}")
    return n_cols // block * size


def _as_bytes(data: np.ndarray) -> np.ndarray:
    # Storage arrives as uint8 blocks, typed float arrays or uint16 bf16 views; the codecs want bytes.
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


DEQUANT_CHUNK_VALUES = 1 << 20     # values decoded at a time (4 MB of float32)


def dequantize(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw storage of a tensor -> float32 array of `shape` (numpy order: rows first, ggml ne reversed).

    For F32 the result may be a read-only view of `data` (e.g. of a memory-mapped file).
    Raises UnsupportedModelError for a type without a decoder, ValueError when sizes do not fit.
    """
    qt = _known(qtype)
    decode = _DEQUANTIZERS.get(qt)
    if decode is None:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedModelError(f"quant type {qt.name} is not supported (supported: {supported})")
    shape = tuple(int(s) for s in shape)
    n_values = math.prod(shape)
    n_cols = shape[-1] if shape else 1
    block, size = GGML_QUANT_SIZES[qt]
    need = row_bytes(qt, n_cols) * (n_values // n_cols if n_cols else 0)
    raw = _as_bytes(data)
    if raw.size != need:
        raise ValueError(f"{qt.name} data for shape {shape} must be {need} bytes, found {raw.size} bytes")
    blocks = raw.reshape(-1, size)
    step = max(1, DEQUANT_CHUNK_VALUES // block)
    if qt == GGMLQuantizationType.F32 or len(blocks) <= step:
        return decode(blocks).reshape(shape)
    # A big tensor in cache-sized pieces: the decoders' temporaries are several times their output, which for a
    # 27B's LM head would be gigabytes each, and 3-4x the time of the same work in pieces.
    out = np.empty((len(blocks), block), dtype=np.float32)
    for i in range(0, len(blocks), step):
        out[i : i + step] = decode(blocks[i : i + step]).reshape(-1, block)
    return out.reshape(shape)


def quantize(values: np.ndarray, qtype: int) -> np.ndarray:
    """float values (last axis = one row) -> uint8 raw blocks of shape (*values.shape[:-1], row_bytes).

    Supports F32, F16, BF16, Q8_0 and Q4_0; the bytes are identical to gguf.quants.quantize / ggml.
    """
    qt = _known(qtype)
    encode = _QUANTIZERS.get(qt)
    if encode is None:
        supported = ", ".join(sorted(t.name for t in QUANTIZABLE_TYPES))
        raise UnsupportedModelError(f"quantizing to {qt.name} is not supported (supported: {supported})")
    x = np.asarray(values, dtype=np.float32)
    if x.ndim == 0:
        x = x.reshape(1)
    block, _ = GGML_QUANT_SIZES[qt]
    out_cols = row_bytes(qt, x.shape[-1])
    blocks = encode(np.ascontiguousarray(x).reshape(-1, block))
    return blocks.reshape(*x.shape[:-1], out_cols)
