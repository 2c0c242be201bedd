"""GPU small-width matrix-vector kernel (kernels/quant_gemv.cu) against the NumPy twins, in float64.

Needs CuPy and a CUDA GPU; skipped (with the reason) anywhere else (tests/test_kernels_quant_gemv_sim.py runs the
same kernel source on the CPU). Outputs are poisoned with NaN first; the bound is ||y - x @ dequantize(W).T|| /
||ref|| < 2e-4: weights are dequantized exactly, x is rounded to int16 per group of 16 (<= 2^-16 of the group's
maximum) and sums are exact int32 / fp32, so the error left is ~1e-5 (v2's 2e-3 bound covers its fp16 weights).
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels import loader

_REASON = loader.unavailable_reason()  # the one check the engine uses too (CuPy, driver, a visible GPU)
if _REASON is not None:
    pytest.skip(f"GPU kernel tests skipped: {_REASON}", allow_module_level=True)

import cupy  # noqa: E402

from kernels import quant_gemv as qg  # noqa: E402
from kernels import quant_matmul as qm  # noqa: E402
from tests.quant_twins import NAMES, dequantize, random_weights, rel_error  # noqa: E402

pytestmark = pytest.mark.gpu



TYPES = (qm.Q4_K, qm.Q6_K, qm.Q8_0, qm.F16)
TOL = 2e-4


def run(W: qm.QuantMatrix, x: np.ndarray, y0: np.ndarray | None = None, **kw) -> np.ndarray:
    """W.matmul on the GPU into a NaN-poisoned (or y0-filled, for accumulate) output; returns it on the host."""
    tokens, n_out = x.shape[0], W.out_features
    out = cupy.array(y0) if y0 is not None else cupy.full((tokens, n_out), np.nan, dtype=cupy.float32)
    y = W.matmul(cupy.asarray(x), out=out, **kw)
    cupy.cuda.Device().synchronize()
    return cupy.asnumpy(y)


def check(W: qm.QuantMatrix, w64: np.ndarray, tokens: int, rng: np.random.Generator, label: str, **kw) -> np.ndarray:
    x = (rng.standard_normal((tokens, W.in_features)) * 0.5).astype(np.float16)
    y = run(W, x, **kw)
    bad = ~np.isfinite(y)
    assert not bad.any(), f"{label} T={tokens} {kw}: {int(bad.sum())} elements unwritten or not finite"
    err = rel_error(y, x.astype(np.float64) @ w64.T)
    assert err < TOL, f"{label} T={tokens} {kw}: relative error {err:.3e} >= {TOL}"
    return y


SHAPES = {
    qm.Q4_K: (77, 768),  # rows not a multiple of 16
    qm.Q6_K: (50, 1024),
    qm.Q8_0: (45, 1248),  # K % 256 == 224: a tail chunk of seven 32-value blocks
    qm.F16: (33, 800),  # K % 256 == 32
}


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_matches_twin_at_every_width(qtype: int) -> None:
    rng = np.random.default_rng(500 + qtype)
    shape = SHAPES[qtype]
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} {shape}")
    w64 = dequantize(qtype, raw, *shape)
    for tokens in range(1, qg.MAX_TOKENS + 1):
        check(W, w64, tokens, rng, W.name, kernel="gemv")


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_k_warps_variants_and_determinism(qtype: int) -> None:
    rng = np.random.default_rng(600 + qtype)
    shape = (64, 2304) if qtype != qm.Q8_0 else (64, 2336)  # Q8_0: a tail chunk of 32 values
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} k_warps")
    w64 = dequantize(qtype, raw, *shape)
    for kw in (1, 3, 8):
        cfg = qg.GemvConfig(k_warps=kw)
        for tokens in (1, 2, 5):
            check(W, w64, tokens, rng, f"{W.name} {cfg}", kernel="gemv", config=cfg)
    # no atomics: the warps add in a fixed order, so two runs are bitwise equal
    x = (rng.standard_normal((3, shape[1])) * 0.5).astype(np.float16)
    cfg = qg.GemvConfig(k_warps=5)
    assert np.array_equal(run(W, x, kernel="gemv", config=cfg), run(W, x, kernel="gemv", config=cfg))


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_accumulate_adds_into_out(qtype: int) -> None:
    rng = np.random.default_rng(700 + qtype)
    shape = SHAPES[qtype]
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape)
    w64 = dequantize(qtype, raw, *shape)
    for tokens, kw in ((1, 1), (4, 3)):
        x = (rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16)
        y0 = rng.standard_normal((tokens, shape[0])).astype(np.float32)
        y = run(W, x, y0, kernel="gemv", config=qg.GemvConfig(k_warps=kw), accumulate=True)
        ref = x.astype(np.float64) @ w64.T
        assert rel_error(y - y0, ref) < TOL
        plain = run(W, x, kernel="gemv", config=qg.GemvConfig(k_warps=kw))
        assert np.array_equal(y, (y0 + plain).astype(np.float32))  # the same sums, then one add


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_portable_fallback_path(qtype: int) -> None:
    # compiled with -DSPECSPLIT_PORTABLE: no inline PTX (software fp16 conversion, C++ dp2a)
    rng = np.random.default_rng(800 + qtype)
    shape = SHAPES[qtype]
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape)
    w64 = dequantize(qtype, raw, *shape)
    for tokens in (1, 3):
        check(W, w64, tokens, rng, f"portable {NAMES[qtype]}", kernel="gemv", portable=True)


@pytest.mark.parametrize(
    "qtype,shape", [(qm.Q4_K, (5120, 17408)), (qm.Q6_K, (17408, 5120)), (qm.Q8_0, (5120, 17408))], ids=str
)
def test_large_shape_and_dispatch(qtype: int, shape: tuple[int, int]) -> None:
    # Qwen3.6-27B ffn shapes; matmul() takes gemv up to the crossover width, v2 above
    rng = np.random.default_rng(900 + qtype + shape[0])
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} {shape}")
    w64 = dequantize(qtype, raw, *shape)
    for tokens in (1, 2):
        if qg.prefer_gemv(qtype, shape[1], tokens):
            x = (rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16)
            auto, forced = run(W, x), run(W, x, kernel="gemv")
            assert np.array_equal(auto, forced)
            assert rel_error(auto, x.astype(np.float64) @ w64.T) < TOL
    wide = qg.CROSSOVER[qtype] + 1
    x = (rng.standard_normal((wide, shape[1])) * 0.5).astype(np.float16)
    assert np.array_equal(run(W, x), run(W, x, kernel="v2"))
    check(W, w64, 1, rng, W.name, kernel="gemv", config=qg.GemvConfig(k_warps=1))


PERSIST_CONFIGS = (
    qg.GemvConfig(k_warps=4, persistent=True, blocks_per_sm=1, prefetch=2),
    qg.GemvConfig(k_warps=3, persistent=True, blocks_per_sm=0, prefetch=1),
    qg.GemvConfig(k_warps=1, persistent=True, blocks_per_sm=1, prefetch=2),
)


@pytest.mark.parametrize("qtype", (qm.Q4_K, qm.Q6_K, qm.Q8_0), ids=NAMES.get)
def test_persistent_variant_matches_twin_and_per_tile(qtype: int) -> None:
    # blocks walking several tiles (one block per SM over 2000+ rows), both prefetch depths, KW 1 / 3 / 4: the same
    # sums in the same order as one block per tile, so bitwise equal to it at the same KW
    rng = np.random.default_rng(1000 + qtype)
    shape = (4200, 1024) if qtype != qm.Q8_0 else (4200, 1248)
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} persistent")
    w64 = dequantize(qtype, raw, *shape)
    for cfg in PERSIST_CONFIGS:
        for tokens in (1, 2, 5):
            check(W, w64, tokens, rng, f"{W.name} {cfg}", kernel="gemv", config=cfg)
            x = (rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16)
            tile = qg.GemvConfig(k_warps=cfg.k_warps, persistent=False)
            assert np.array_equal(run(W, x, kernel="gemv", config=cfg), run(W, x, kernel="gemv", config=tile))


@pytest.mark.parametrize("qtype,shape", [(qm.Q4_K, (5120, 17408)), (qm.Q6_K, (17408, 5120))], ids=str)
def test_persistent_variant_at_27b_shapes(qtype: int, shape: tuple[int, int]) -> None:
    # the default launch (blocks per SM by registers, prefetch PREFETCH, KW = choose_k_warps) on ffn matrices: bitwise
    # equal to the per-tile kernel, which test_large_shape_and_dispatch checks against the twin at these shapes
    rng = np.random.default_rng(1100 + qtype)
    W = qm.QuantMatrix(qtype, random_weights(qtype, *shape, rng), shape, name=f"{NAMES[qtype]} {shape}")
    pers = qg.GemvConfig(persistent=True)
    for tokens in (1, 2):
        x = (rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16)
        y0 = rng.standard_normal((tokens, shape[0])).astype(np.float32)
        y = run(W, x, kernel="gemv", config=pers)
        assert np.isfinite(y).all()
        assert np.array_equal(y, run(W, x, kernel="gemv", config=qg.GemvConfig(persistent=False)))
        acc = run(W, x, y0, kernel="gemv", config=pers, accumulate=True)
        assert np.array_equal(acc, (y0 + y).astype(np.float32))
    F = qm.QuantMatrix(qm.F16, random_weights(qm.F16, 32, 256, rng), (32, 256))
    with pytest.raises(ValueError, match="persistent"):
        F.matmul(cupy.zeros((1, 256), dtype=cupy.float16), kernel="gemv", config=pers)


def test_packed_x_shared_and_float32_input() -> None:
    # one pack_activations result feeds several matrices; float32 x is rounded to fp16 by the pack
    rng = np.random.default_rng(11)
    k = 1024
    mats = []
    for qtype, n_out in ((qm.Q4_K, 96), (qm.Q6_K, 40), (qm.Q8_0, 70)):
        raw = random_weights(qtype, n_out, k, rng)
        mats.append((qm.QuantMatrix(qtype, raw, (n_out, k)), dequantize(qtype, raw, n_out, k)))
    x = rng.standard_normal((2, k)).astype(np.float32)
    packed = qm.pack_activations(cupy.asarray(x))
    x16 = x.astype(np.float16).astype(np.float64)
    for W, w64 in mats:
        out = cupy.full((2, W.out_features), np.nan, dtype=cupy.float32)
        y = cupy.asnumpy(W.matmul(packed, out=out, kernel="gemv"))
        assert rel_error(y, x16 @ w64.T) < TOL


def test_errors() -> None:
    rng = np.random.default_rng(12)
    raw = random_weights(qm.Q4_K, 32, 256, rng)
    x = cupy.asarray((rng.standard_normal((2, 256))).astype(np.float16))
    v1 = qm.QuantMatrix(qm.Q4_K, raw, (32, 256), kernel="v1")
    with pytest.raises(ValueError, match="layout"):
        v1.matmul(x, kernel="gemv")
    W = qm.QuantMatrix(qm.Q4_K, raw, (32, 256))
    with pytest.raises(ValueError, match="1..16 tokens"):
        W.matmul(cupy.zeros((17, 256), dtype=cupy.float16), kernel="gemv")
    with pytest.raises(ValueError, match="missing"):
        W.matmul(x, kernel="gemv", accumulate=True)
    with pytest.raises(ValueError, match="v2 kernel"):
        W.matmul(x, kernel="gemv", splits=2)


@pytest.mark.parametrize("qtype", [qm.Q4_K, qm.Q6_K])
def test_strided_out_per_tile_and_persistent(qtype: int) -> None:
    """Into a column slice of wider rows (row stride > N), plain and accumulating, per-tile and persistent: bitwise
    what a contiguous out gets, the columns beside it untouched."""
    rng = np.random.default_rng(70 + qtype)
    n_out, k = SHAPES[qtype]
    raw = random_weights(qtype, n_out, k, rng)
    W = qm.QuantMatrix(qtype, raw, (n_out, k))
    for tokens in (1, 3):
        px = qm.pack_activations(cupy.asarray((rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)))
        y0 = cupy.asarray(rng.standard_normal((tokens, n_out)).astype(np.float32))
        for persistent in (False, True):
            cfg = qg.GemvConfig(persistent=persistent)
            for accumulate in (False, True):
                flat = y0.copy() if accumulate else cupy.full((tokens, n_out), np.nan, cupy.float32)
                W.matmul(px, out=flat, accumulate=accumulate, kernel="gemv", config=cfg)
                wide = cupy.full((tokens, n_out + 40), 7.25, cupy.float32)
                view = wide[:, 11:11 + n_out]
                view[...] = y0 if accumulate else cupy.nan
                W.matmul(px, out=view, accumulate=accumulate, kernel="gemv", config=cfg)
                assert cupy.array_equal(view, flat), f"T={tokens} persistent={persistent} accumulate={accumulate}"
                host = cupy.asnumpy(wide)
                assert (host[:, :11] == 7.25).all() and (host[:, 11 + n_out:] == 7.25).all()
