"""Dequantize the k-quant super-block types Q3_K, Q4_K, Q5_K and Q6_K (256 values per block).

Byte layouts and bit orders follow ggml-quants.c (dequantize_row_q*_K); float operations are done in
the same order as there, so results are bit-identical to llama.cpp and gguf-py.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # values per super block


def _fp16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as an (n_blocks, 1) float32 column."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _shifts(bits: list[int]) -> np.ndarray:
    """Shift amounts shaped to broadcast over a new axis in front of a trailing lane axis."""
    return np.array(bits, dtype=np.uint8)[:, None]


def dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    # layout: {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = _fp16_field(blocks, 108)

    # 16 six-bit scales: low nibbles from bytes 0-7 (scales 0-7 low halves, 8-15 high halves),
    # 2-bit tops from bytes 8-11 (scale j takes bits 2*(j//4) of byte 8 + j%4).
    low = np.concatenate([scales[:, 0:8] & np.uint8(0x0F), scales[:, 0:8] >> np.uint8(4)], axis=1)
    high = (scales[:, None, 8:12] >> _shifts([0, 2, 4, 6])) & np.uint8(3)  # (n, 4, 4): [j//4, j%4]
    sc = (low | (high.reshape(n, 16) << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = (d * sc.astype(np.float32))[:, :, None]  # (n, 16 sub-blocks, 1)

    # Value 128*h + 32*s + l takes bits 2s of qs[32h + l] and bit (4h + s) of hmask[l].
    q2 = (qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6])) & np.uint8(3)  # (n, h, s, l)
    hbit = (hmask[:, None, :] >> _shifts(list(range(8)))) & np.uint8(1)  # (n, 4h + s, l)
    # A set hmask bit means "no -4 offset" (the high bit is stored inverted).
    offset = ((np.uint8(1) - hbit.reshape(n, 256)) << np.uint8(2)).astype(np.int8)
    q = q2.reshape(n, 256).astype(np.int8) - offset
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 for all 8 sub-blocks at once: 6-bit scales and mins packed in 12 bytes."""
    # Sub-blocks 0-3 keep their 6 bits in bytes 0-7; sub-blocks 4-7 take 4 low bits from bytes 8-11 and
    # their 2 top bits from the otherwise unused tops of bytes 0-7.
    first, second, third = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    low6, low4, u4, u6 = np.uint8(63), np.uint8(0x0F), np.uint8(4), np.uint8(6)
    sc = np.concatenate([first & low6, (third & low4) | ((first >> u6) << u4)], axis=1)
    mn = np.concatenate([second & low6, (third >> u4) | ((second >> u6) << u4)], axis=1)
    return sc, mn


def _nibbles_by_subblock(qs: np.ndarray) -> np.ndarray:
    """(n, 128) packed nibbles -> (n, 8, 32): chunk c gives sub-block 2c (low nibbles), 2c+1 (high)."""
    n = qs.shape[0]
    chunks = qs.reshape(n, 4, 1, 32)
    return np.concatenate([chunks & np.uint8(0x0F), chunks >> np.uint8(4)], axis=2).reshape(n, 8, 32)


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    # layout: {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}
    n = blocks.shape[0]
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    q = _nibbles_by_subblock(blocks[:, 16:144]).astype(np.float32)
    d1 = (d * sc.astype(np.float32))[:, :, None]
    m1 = (dmin * mn.astype(np.float32))[:, :, None]
    return (d1 * q - m1).reshape(n, QK_K)


def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    # layout: {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
    n = blocks.shape[0]
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    qh = blocks[:, 16:48]
    # Bit b of qh[l] is the fifth bit of lane l in sub-block b.
    high = (qh[:, None, :] >> _shifts(list(range(8)))) & np.uint8(1)  # (n, 8, 32)
    q = (_nibbles_by_subblock(blocks[:, 48:176]) | (high << np.uint8(4))).astype(np.float32)
    d1 = (d * sc.astype(np.float32))[:, :, None]
    m1 = (dmin * mn.astype(np.float32))[:, :, None]
    return (d1 * q - m1).reshape(n, QK_K)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    # layout: {u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d}  (d comes last)
    n = blocks.shape[0]
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    sc = blocks[:, 192:208].view(np.int8)
    d = _fp16_field(blocks, 208)

    # Value 128*h + 64*k + j: nibble k (0 low, 1 high) of ql[64h + j]; equivalently value
    # 128*h + 32*s + l takes its 2 high bits from bits 2s of qh[32h + l].
    halves = ql.reshape(n, 2, 1, 64)
    low4 = np.concatenate([halves & np.uint8(0x0F), halves >> np.uint8(4)], axis=2).reshape(n, 256)
    high2 = (qh.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6])) & np.uint8(3)
    q = (low4 | (high2.reshape(n, 256) << np.uint8(4))).astype(np.int8) - np.int8(32)
    # Sub-block of 16 values i uses scale i.
    ds = (d * sc.astype(np.float32))[:, :, None]
    return (ds * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)
