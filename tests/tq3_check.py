"""Shared check for the GPU TQ3_0 store (tests/test_kernels_ops.py on a GPU, tests/test_kernels_ops_sim.py on the
CPU simulation): the device's bytes against services.engine.quants.tq3 of the same float32 rows."""

from __future__ import annotations

from types import ModuleType

import numpy as np


def check_tq3_bytes(got: np.ndarray, src: np.ndarray, tq3: ModuleType) -> float:
    """Device TQ3_0 rows [n, Hkv, bytes] vs tq3.quantize_tq3_0(src) (`tq3`: services/engine/quants/tq3.py, passed
    in because the GPU test loads it without the package and its gguf import): equal, except codes of values within
    float32 rounding of a centroid midpoint (one code apart; the kernel rotates with a butterfly, the twin with a
    matrix product) and the norms of their groups. Returns the fraction of byte-identical groups."""
    want = tq3.quantize_tq3_0(src)
    got = got.reshape(want.shape)
    g = tq3.group_size(src.shape[-1])
    gb = g // 32
    same = (got.reshape(-1, gb * 14) == want.reshape(-1, gb * 14)).all(axis=1)
    assert same.mean() > 0.97, f"only {same.mean():.4f} of the groups are byte-identical"
    ig, iw = tq3.decode_indices(got).astype(int), tq3.decode_indices(want).astype(int)
    diff = ig != iw
    if diff.any():
        xg = src.reshape(-1, g).astype(np.float64)
        u = xg / np.maximum(np.linalg.norm(xg, axis=1, keepdims=True), 1e-30)
        y = (u @ tq3._rotation(g).T).reshape(ig.shape)
        near = np.abs(y[..., None] - tq3._MIDS[g].astype(np.float64)).min(axis=-1)
        assert (np.abs(ig - iw)[diff] == 1).all() and near[diff].max() < 2e-6, "a code differs away from a midpoint"
    ng, nw = tq3.block_norms(got).reshape(-1, gb), tq3.block_norms(want).reshape(-1, gb)
    assert (ng == ng[:, :1]).all(), "the blocks of one group must carry the same norm"
    code_same = ~diff.reshape(-1, g).any(axis=1)
    # equal codes: the norms differ at most by the fp16 rounding of a float32 sum taken in another order
    assert np.allclose(ng[code_same], nw[code_same], rtol=1e-3, atol=0)
    assert np.allclose(ng, nw, rtol=2e-2, atol=0)
    return float(same.mean())
