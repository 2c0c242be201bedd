"""Dequantize the non-linear 4-bit types IQ4_NL (32-value blocks) and IQ4_XS (256-value super blocks).

Both map each 4-bit index through the same 16-entry codebook instead of using it as an integer.
"""

from __future__ import annotations

import numpy as np

# kvalues_iq4nl from ggml-common.h
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


def _fp16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as an (n_blocks, 1) float32 column."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _unpack_16(qs: np.ndarray) -> np.ndarray:
    """(..., 16) packed bytes -> (..., 32) indices: low nibbles are lanes 0-15, high nibbles 16-31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    # layout: {f16 d; u8 qs[16]}
    d = _fp16_field(blocks, 0)
    return d * KVALUES_IQ4NL[_unpack_16(blocks[:, 2:18])]


def dequantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    # layout: {f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}
    n = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view("<u2")  # (n, 1)
    scales_l = blocks[:, 4:8]
    # 6-bit scale of sub-block b: low nibble from scales_l[b // 2] (b even: low half), top 2 bits from
    # bits 2b of scales_h; stored with a +32 bias.
    low = np.stack([scales_l & np.uint8(0x0F), scales_l >> np.uint8(4)], axis=2).reshape(n, 8)
    high = ((scales_h >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)).astype(np.uint8)
    ls = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = (d * ls.astype(np.float32))[:, :, None]
    idx = _unpack_16(blocks[:, 8:136].reshape(n, 8, 16))  # (n, 8, 32)
    return (dl * KVALUES_IQ4NL[idx]).reshape(n, 256)
