"""Dequantize and quantize the plain float storage types: F32, F16 and BF16.

Every function works on raw blocks: a (n_blocks, type_size) uint8 array, where a "block" is one value.
"""

from __future__ import annotations

import numpy as np


def dequantize_f32(blocks: np.ndarray) -> np.ndarray:
    # A view, not a copy: F32 weights straight off a memory-mapped file cost no extra memory.
    return blocks.view(np.float32)


def dequantize_f16(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16).astype(np.float32)


def dequantize_bf16(blocks: np.ndarray) -> np.ndarray:
    # bf16 is the upper half of an f32, so widening is a shift, exact for every bit pattern (NaN included).
    return (blocks.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def quantize_f32(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint8)


def quantize_f16(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float16).view(np.uint8)


def quantize_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even like ggml_compute_fp32_to_bf16, so bytes match ggml and gguf-py."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    # Truncating a NaN's mantissa could leave all-zero low bits (= infinity); force it quiet instead.
    is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    bits = np.where(is_nan, (bits & np.uint32(0xFFFF0000)) | np.uint32(0x00400000), bits)
    # Widen first: adding the rounding bias to values near 0xFFFFFFFF must not wrap around.
    rounded = (bits.astype(np.uint64) + (np.uint64(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> 16
    return rounded.astype(np.uint16).view(np.uint8)
