"""TQ3_0 (TurboQuant, 3.5 bits per value): NumPy reference quantizer, dequantizer and the rotation helpers.

Sources (see ../shared/reference/lucebox.md section 2):
- Block layout, from Lucebox's ggml fork (Luce-Org/llama.cpp-dflash-ggml, ggml-common.h `block_tq3_0`,
  QK_TQ3_0 = 32, QK_TQ3_0_GROUP = 128): 14 bytes per 32 values,
  `{ fp16 norm; u8 qs[8]; u8 signs[4]; }`; value j of a block has index
  `idx = ((qs[j/4] >> 2*(j%4)) & 3) | (((signs[j/8] >> (j%8)) & 1) << 2)` and decodes to
  `centroid[idx] * norm`. The 4 blocks of one 128-value group carry the same norm.
- Quantizer, from the same fork's CUDA path (ggml-cuda/cpy-utils.cuh `quantize_f32_tq3_0_group`,
  tq3-quant.cuh): per 128-value group, n = ||x||, u = x / n (0 when n <= 1e-10), y = D2 H D1 u / sqrt(128)
  (randomized Walsh-Hadamard: sign vector 1, natural-order FWHT, sign vector 2), idx = nearest centroid by
  the midpoints (`val < mid[i]` picks the lower side, so a value on a midpoint goes up), stored norm =
  n / ||centroid[idx]||_2 over the group ("corrected norm", so a decoded group has exactly norm n), fp16.
- Centroids (Lloyd-Max for N(0, 1/128)), midpoints and the seed-42 sign vectors: tq3-quant.cuh
  `d_tq3_centroids`, `d_tq3_mids`, `d_tq3_wht_signs1/2`, identical to TheTom's turbo3
  (TheTom/llama-cpp-turboquant ggml-cuda/turbo-quant.cuh `TURBO_CENTROIDS_3BIT`, `TURBO_WHT_SIGNS1/2`).

Choices the published layout leaves open, made here:
- Where the groups lie: along one attention head's row (head_dim values), never across heads, so the query
  of each head can be rotated on its own. Lucebox only runs head_dim 256 (2 groups), where this is the same.
- head_dim a multiple of 64 but not of 128 (e.g. the embedded default model, 64): 64-value groups, rotated
  with the first 64 entries of both sign vectors and a 64-point FWHT (TheTom's `TURBO_WHT_SIGNS1_64`, turbo3
  group size 64). TheTom keeps the N(0, 1/128) midpoints there; a unit 64-vector has N(0, 1/64)
  coordinates, so this quantizer compares against midpoints scaled by sqrt(2) (the Lloyd-Max levels for
  N(0, 1/64)). The stored bytes keep the same centroid table: the corrected norm makes a group's decode
  independent of the table's scale, so the dequantizer is the same for both group sizes.
- The rotation is computed as a float32 product with the explicit rotation matrix rather than an in-place
  butterfly; both are the same orthogonal map up to float32 rounding, so a value within rounding of a
  midpoint may get the neighbouring code on another implementation. Decoding is exact either way.
- TQ3_0 is not a gguf-py type (Lucebox's GGML_TYPE_TQ3_0 = 42 is a fork-private id), so it is not in the
  `quants` registry; only the KV cache (services/engine/kvcache.py) uses it.
"""

from __future__ import annotations

import numpy as np

QK = 32                 # values per block
GROUP = 128             # values per rotation group (one norm)
BLOCK_BYTES = 14        # fp16 norm + 8 bytes of low index bits + 4 bytes of high index bits

CENTROIDS = np.array([-0.190685, -0.117832, -0.065717, -0.021460,
                      0.021460, 0.065717, 0.117832, 0.190685], dtype=np.float32)
MIDPOINTS = np.array([-0.154259, -0.091775, -0.043589, 0.0, 0.043589, 0.091775, 0.154259], dtype=np.float32)

SIGNS1 = np.array([
    -1, 1, 1, -1, -1, 1, -1, 1, -1, -1, 1, 1, 1, 1, 1, 1, 1, -1, 1, -1, 1, -1, -1, 1, 1, 1, -1, 1, 1, -1, -1, -1,
    -1, 1, 1, -1, 1, 1, -1, 1, -1, 1, 1, -1, -1, 1, -1, 1, 1, 1, 1, -1, -1, -1, -1, -1, 1, -1, 1, 1, 1, 1, -1, 1,
    -1, -1, 1, -1, -1, -1, 1, -1, -1, -1, 1, -1, -1, -1, 1, 1, 1, -1, -1, 1, 1, 1, -1, -1, 1, 1, -1, 1, 1, -1, 1, -1,
    -1, 1, 1, -1, 1, -1, 1, -1, 1, 1, 1, 1, -1, 1, -1, 1, 1, -1, 1, 1, -1, -1, -1, -1, -1, 1, 1, -1, 1, 1, -1, 1,
], dtype=np.float32)
SIGNS2 = np.array([
    1, 1, 1, 1, -1, 1, 1, -1, 1, -1, -1, -1, 1, -1, -1, -1, 1, 1, -1, -1, 1, -1, 1, -1, 1, -1, -1, 1, -1, 1, 1, 1,
    1, 1, -1, -1, -1, 1, -1, -1, -1, -1, -1, -1, 1, 1, 1, -1, 1, -1, 1, 1, 1, -1, -1, 1, -1, -1, -1, -1, -1, -1, 1, 1,
    1, -1, 1, -1, -1, -1, -1, 1, -1, 1, -1, 1, -1, -1, 1, 1, -1, 1, -1, 1, 1, -1, 1, -1, -1, -1, -1, 1, -1, -1, 1, -1,
    1, -1, 1, 1, 1, -1, -1, 1, -1, 1, -1, 1, 1, -1, -1, 1, -1, 1, -1, 1, 1, -1, 1, -1, 1, -1, -1, -1, -1, -1, 1, -1,
], dtype=np.float32)


def _hadamard(n: int) -> np.ndarray:
    """Natural-order (Sylvester) Hadamard matrix: what the in-place butterfly `x[j]=a+b; x[j+h]=a-b` computes."""
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _rotation(g: int) -> np.ndarray:
    """R = diag(signs2) H diag(signs1) / sqrt(g), as float64 (g = 64 uses the first 64 signs)."""
    return (SIGNS2[:g, None] * _hadamard(g) * SIGNS1[None, :g]) / np.sqrt(g)


_R = {g: _rotation(g).astype(np.float32) for g in (64, GROUP)}
_RT = {g: np.ascontiguousarray(r.T) for g, r in _R.items()}
# Lloyd-Max midpoints for the coordinates of a rotated unit g-vector, ~N(0, 1/g).
_MIDS = {GROUP: MIDPOINTS, 64: (MIDPOINTS.astype(np.float64) * np.sqrt(2.0)).astype(np.float32)}
# byte -> its four 2-bit fields, lowest first
_LOW2 = ((np.arange(256, dtype=np.uint8)[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).astype(np.uint8)
# (qs byte | the matching nibble of high bits << 8) -> the 4 centroids it encodes: one gather per 4 values
_KEY = np.arange(4096)
_LUT4 = CENTROIDS[_LOW2[_KEY & 255] | (((_KEY[:, None] >> 8) >> np.arange(4)) & 1).astype(np.uint8) << 2]


def group_size(n: int) -> int:
    """Rotation group for a row of n values (one attention head): 128 when n allows, else 64."""
    if n > 0 and n % GROUP == 0:
        return GROUP
    if n > 0 and n % 64 == 0:
        return 64
    raise ValueError(f"TQ3_0 needs rows of a multiple of 64 values (one attention head), got {n}")


def rotate(x: np.ndarray) -> np.ndarray:
    """Forward randomized Hadamard rotation of every group of the last axis: y = D2 H D1 x / sqrt(g)."""
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    g = group_size(n)
    return (x.reshape(*x.shape[:-1], n // g, g) @ _RT[g]).reshape(x.shape)


def inverse_rotate(y: np.ndarray) -> np.ndarray:
    """Inverse of `rotate` (its transpose: D1 H D2 y / sqrt(g))."""
    y = np.asarray(y, dtype=np.float32)
    n = y.shape[-1]
    g = group_size(n)
    return (y.reshape(*y.shape[:-1], n // g, g) @ _R[g]).reshape(y.shape)


def quantize_tq3_0(x: np.ndarray) -> np.ndarray:
    """(..., n) float -> (..., n // 32, 14) uint8 TQ3_0 blocks; n is one head's row (a multiple of 64)."""
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    g = group_size(n)
    lead = x.shape[:-1]
    xg = x.reshape(-1, g)
    norm = np.sqrt(np.einsum("ij,ij->i", xg, xg, dtype=np.float32))
    inv = np.where(norm > np.float32(1e-10), np.float32(1) / np.maximum(norm, np.float32(1e-30)), np.float32(0))
    y = (xg * inv[:, None]) @ _RT[g]
    idx = np.searchsorted(_MIDS[g], y, side="right").astype(np.uint8)    # = count of midpoints <= value
    c = CENTROIDS[idx]
    recon = np.sqrt(np.einsum("ij,ij->i", c, c, dtype=np.float32))
    stored = np.where(recon > np.float32(1e-10), norm / np.maximum(recon, np.float32(1e-30)), norm)

    idx = idx.reshape(-1, QK)                                             # one row per block
    low = (idx & 3).reshape(-1, 8, 4)
    qs = (low[..., 0] | (low[..., 1] << 2) | (low[..., 2] << 4) | (low[..., 3] << 6)).astype(np.uint8)
    signs = np.packbits((idx >> 2).astype(np.uint8), axis=1, bitorder="little")
    d = np.repeat(stored.astype(np.float16), g // QK).view(np.uint8).reshape(-1, 2)
    return np.concatenate([d, qs, signs], axis=1).reshape(*lead, n // QK, BLOCK_BYTES)


def decode_indices(blocks: np.ndarray) -> np.ndarray:
    """(..., 14) uint8 blocks -> (..., 32) uint8 centroid indices."""
    b = np.asarray(blocks, dtype=np.uint8)
    low = np.take(_LOW2, b[..., 2:10], axis=0).reshape(*b.shape[:-1], QK)
    high = np.unpackbits(b[..., 10:14], axis=-1, bitorder="little")
    return low | (high << 2)


def block_norms(blocks: np.ndarray) -> np.ndarray:
    """(..., 14) uint8 blocks -> (...,) float32 stored (corrected) norms."""
    b = np.ascontiguousarray(np.asarray(blocks, dtype=np.uint8)[..., 0:2])
    return b.view(np.float16)[..., 0].astype(np.float32)


def dequantize_tq3_0(blocks: np.ndarray, rotated: bool = False) -> np.ndarray:
    """(..., n // 32, 14) uint8 -> (..., n) float32.

    rotated=True returns the values as stored, centroid * norm in the rotated domain (what attention reads:
    the query is rotated instead); rotated=False also applies the inverse rotation (the original vector).
    """
    b = np.asarray(blocks, dtype=np.uint8)
    if b.ndim < 2 or b.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"TQ3_0 blocks must have shape (..., n_blocks, {BLOCK_BYTES}), got {b.shape}")
    signs = b[..., 10:14]
    nib = np.stack([signs & 15, signs >> 4], axis=-1).reshape(*b.shape[:-1], 8)
    key = b[..., 2:10].astype(np.uint16) | (nib.astype(np.uint16) << 8)
    # np.take, not fancy indexing: the same gather, about 10x faster on multi-dimensional keys
    vals = np.take(_LUT4, key, axis=0).reshape(*b.shape[:-1], QK) * block_norms(b)[..., None]
    vals = vals.reshape(*b.shape[:-2], b.shape[-2] * QK)
    return vals if rotated else inverse_rotate(vals)


def row_bytes(n: int) -> int:
    """Bytes of one TQ3_0 row of n values."""
    group_size(n)
    return n // QK * BLOCK_BYTES
