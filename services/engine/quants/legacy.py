"""Dequantize and quantize the legacy 32-value block types Q4_0 and Q8_0.

Quantizers follow ggml's reference (quantize_row_q4_0_ref / quantize_row_q8_0_ref) operation for
operation, so their bytes equal llama.cpp's and gguf-py's.
"""

from __future__ import annotations

import numpy as np

QK = 32  # values per block


def _fp16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 scale at byte `start` of every block, as an (n_blocks, 1) float32 column."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    # layout: {f16 d; int8 qs[32]}
    d = _fp16_field(blocks, 0)
    qs = blocks[:, 2:].view(np.int8).astype(np.float32)
    return d * qs


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    # layout: {f16 d; u8 qs[16]}; low nibbles are values 0..15, high nibbles values 16..31
    d = _fp16_field(blocks, 0)
    qs = blocks[:, 2:]
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C roundf(): ties away from zero (np.round would round ties to even)."""
    a = np.abs(x)
    whole = np.floor(a)
    # a - whole is exact for |a| < 2**23, so this tie test is exact, unlike floor(a + 0.5).
    return np.sign(x) * (whole + (a - whole >= np.float32(0.5)).astype(np.float32))


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
    """(n_blocks, 32) float32 -> (n_blocks, 34) uint8."""
    x = np.asarray(values, dtype=np.float32).reshape(-1, QK)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    qs = _round_half_away(x * inv_d).astype(np.int8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), qs.view(np.uint8)], axis=1)


def quantize_q4_0(values: np.ndarray) -> np.ndarray:
    """(n_blocks, 32) float32 -> (n_blocks, 18) uint8."""
    x = np.asarray(values, dtype=np.float32).reshape(-1, QK)
    # ggml keeps the signed value of largest magnitude (first one on ties) and maps it to -8 exactly.
    imax = np.abs(x).argmax(axis=1)[:, None]
    d = np.take_along_axis(x, imax, axis=1) / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    # (int8)(x*id + 8.5f) truncates; the sum is >= 0.5 for finite scales, so only the top needs a clamp.
    # Cast before clamping, as gguf-py does, so even inf/NaN from subnormal blocks give the same bytes.
    with np.errstate(invalid="ignore"):
        q = np.trunc(x * inv_d + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    packed = q[:, : QK // 2] | (q[:, QK // 2 :] << np.uint8(4))
    return np.concatenate([d.astype(np.float16).view(np.uint8), packed], axis=1)
