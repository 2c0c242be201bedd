"""The array-backend seam: how model code turns stored tensors into arrays and multiplies by them.

NumPy is the reference backend (CPU, float32); the CuPy backend (GPU, quantized weights kept packed)
implements the same methods with fused kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .formats import RawTensor
from .quants import dequantize


class NumpyBackend:
    """Float32 NumPy: weights are dequantized once at load, products go through BLAS."""

    name = "numpy"
    xp = np

    def weight(self, t: RawTensor | np.ndarray) -> np.ndarray:
        """A matrix (out, in) or vector ready for `linear`/elementwise use."""
        if isinstance(t, RawTensor):
            return np.ascontiguousarray(t.dequantize(), dtype=np.float32)
        return np.ascontiguousarray(t, dtype=np.float32)

    def embedding(self, t: RawTensor | np.ndarray) -> Any:
        # Embedding tables stay packed; rows are dequantized on lookup (a 27B table is 1.3 B values).
        return t

    def embed(self, table: Any, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if isinstance(table, RawTensor):
            rows, cols = table.shape
            data = table.data.reshape(rows, -1)[ids]
            return dequantize(data, table.qtype, (len(ids), cols)).astype(np.float32)
        return np.asarray(table[ids], dtype=np.float32)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x (T, in) @ w(out, in).T -> (T, out)."""
        return x @ w.T

    def to_host(self, a: Any) -> np.ndarray:
        return np.asarray(a)


def default_backend() -> NumpyBackend:
    return NumpyBackend()
