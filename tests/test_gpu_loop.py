"""Host-side pieces of the GPU speculative loop (models/qwen35_gpu.py): the per-step tree shape (positions and the
attention's ancestor mask) computed without att.tree_mask's per-node loop, and the Q4_K token rows decoded on the
device (equal to the host dequantization bit for bit). The shape tests run anywhere; the device test skips without
CuPy and a CUDA GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import attention as att
from kernels import loader
from services.engine.models import qwen35_gpu as QG

_REASON = loader.unavailable_reason()
needs_gpu = pytest.mark.skipif(_REASON is not None, reason=f"GPU loop tests skipped: {_REASON}")


def _random_tree(rng: np.random.Generator, T: int) -> np.ndarray:
    return np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, T)], dtype=np.int64)


@pytest.mark.parametrize("T", [1, 2, 23, 64, 65])
def test_tree_shape_matches_tree_mask_and_depths(T):
    rng = np.random.default_rng(T)
    for par in (np.arange(-1, T - 1), _random_tree(rng, T), _random_tree(rng, T)):
        chain = bool(np.array_equal(par, np.arange(-1, T - 1)))
        depth, mask = QG._tree_shape(par, chain, T)
        want = np.zeros(T, np.int64)
        for i, p in enumerate(par):
            want[i] = 0 if p < 0 else want[p] + 1
        assert np.array_equal(depth, want)
        if T <= att.MAX_TOKENS:
            assert mask.dtype == np.uint64 and np.array_equal(mask, att.tree_mask(par))
        else:
            assert mask is None


@needs_gpu
def test_q4_k_rows_decoded_on_the_device_equal_the_host_rows():
    import cupy

    from services.engine.quants import dequantize

    rng = np.random.default_rng(5)
    rows, cols = 300, 512
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    # finite, varied scales: d and dmin as f16 of either sign
    blocks[:, :, 0:4] = rng.uniform(-0.02, 0.02, size=(rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    table = blocks.reshape(rows, -1)
    ids = rng.integers(0, rows, size=23)
    got = cupy.asnumpy(QG._embed_q4_k(cupy, cupy.asarray(table), cupy.asarray(ids.astype(np.int32))))
    want = dequantize(table[ids], QG.Q4_K, (len(ids), cols)).astype(np.float32)
    assert got.dtype == np.float32 and np.array_equal(got, want)
