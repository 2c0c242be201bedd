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
        """A matrix (out, in) or vector ready for `linear`/elementwise use.

        Matrices are kept in Fortran order, i.e. stored as (in, out): `x @ w.T` then hands BLAS a
        row-major (in, out) operand, which its small-M sgemm kernels run ~1.5x faster at verify widths.
        """
        a = t.dequantize() if isinstance(t, RawTensor) else t
        if np.ndim(a) == 2:
            return np.asfortranarray(a, dtype=np.float32)
        return np.ascontiguousarray(a, dtype=np.float32)

    def stack(self, mats: list[np.ndarray]) -> np.ndarray:
        """Several matrices that read the same input as one (their output rows concatenated): one product."""
        return np.asfortranarray(np.concatenate([np.asarray(m) for m in mats], axis=0), dtype=np.float32)

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
