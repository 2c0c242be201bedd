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
@pytest.mark.parametrize("qtype", [0, 1, 8, 12], ids=["F32", "F16", "Q8_0", "Q4_K"])
def test_table_rows_decoded_on_the_device_equal_the_host_rows(qtype: int):
    """quant_matmul.embed_rows (the step's token rows, one launch) bit for bit the NumPy engine's rows, with the
    device's own fp16 conversion and float32 rounding (the CPU simulation runs the portable path)."""
    import cupy

    from kernels import quant_matmul as qm
    from services.engine.quants import dequantize
    from tests.quant_twins import random_table

    rng = np.random.default_rng(5 + qtype)
    rows, cols = 300, 512
    table = random_table(qtype, rows, cols, rng)
    ids = rng.integers(0, rows, size=23)
    got = cupy.asnumpy(qm.embed_rows(cupy.asarray(table), qtype, cols, cupy.asarray(ids.astype(np.int32))))
    want = (table.view(np.float32)[ids] if qtype == 0
            else dequantize(table[ids], qtype, (len(ids), cols)).astype(np.float32))
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_gpu
def test_embed_rows_refusals():
    import cupy

    from kernels import quant_matmul as qm

    table = cupy.zeros((4, 144), cupy.uint8)
    ids = cupy.zeros(2, cupy.int32)
    with pytest.raises(ValueError, match="decodes"):
        qm.embed_rows(cupy.zeros((4, 210), cupy.uint8), qm.Q6_K, 256, ids)
    with pytest.raises(ValueError, match="is 288 bytes, not 144"):
        qm.embed_rows(table, qm.Q4_K, 512, ids)
    with pytest.raises(ValueError, match="int32"):
        qm.embed_rows(table, qm.Q4_K, 256, ids.astype(cupy.int64))
    out = qm.embed_rows(table, qm.Q4_K, 256, cupy.asarray(np.array([-1, 4], np.int32)))  # outside: zeros
    assert not cupy.asnumpy(out).any()
