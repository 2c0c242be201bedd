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
from kernels import quant_wide as qw  # noqa: E402
from tests.quant_twins import (  # noqa: E402
    NAMES,
    check_matmul,
    check_strided_out,
    dequantize,
    gpu_matmul,
    random_weights,
    rel_error,
    staged_inv_twin,
    staged_norm_twin,
)

pytestmark = pytest.mark.gpu

TYPES = (qm.Q4_K, qm.Q5_K, qm.IQ4_XS, qm.Q3_K, qm.Q6_K, qm.Q8_0, qm.F16, qm.Q4_0, qm.IQ4_NL)
BLOCKS32 = (qm.Q8_0, qm.Q4_0, qm.IQ4_NL)  # the 32-value block types: K need not be whole super-blocks
TOL = 2e-4


def run(W: qm.QuantMatrix, x, y0: np.ndarray | None = None, **kw) -> np.ndarray:
    return gpu_matmul(W, x, y0, **kw)


def check(W: qm.QuantMatrix, w64: np.ndarray, tokens: int, rng: np.random.Generator, label: str, **kw) -> np.ndarray:
    return check_matmul(W, w64, tokens, rng, label, TOL, **kw)


SHAPES = {
    qm.Q4_K: (77, 768),  # rows not a multiple of 16
    qm.Q5_K: (40, 1280),
    qm.IQ4_XS: (33, 768),
    qm.Q3_K: (37, 1280),
    qm.Q4_0: (77, 1248),  # a tail chunk of 224 values
    qm.IQ4_NL: (40, 1312),  # a tail of 32 values
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
    shape = (64, 2304) if qtype not in BLOCKS32 else (64, 2336)  # Q8_0, Q4_0, IQ4_NL: a tail chunk of 32 values
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
    # Qwen3.6-27B ffn shapes; matmul() takes gemv up to the crossover width (the ring up to RING_UP_TO), above it v2
    # or, on the high and deep matrices from their crossovers, the wide kernel (quant_wide.prefer_wide)
    rng = np.random.default_rng(900 + qtype + shape[0])
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} {shape}")
    w64 = dequantize(qtype, raw, *shape)
    for tokens in (1, 2, 3):
        if qg.prefer_gemv(qtype, shape[1], tokens, q16=tokens <= qm.Q16_TOKENS):
            x = (rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16)
            auto, forced = run(W, x), run(W, x, kernel="gemv")
            assert np.array_equal(auto, forced)
            assert rel_error(auto, x.astype(np.float64) @ w64.T) < TOL
    wide = max(qg.CROSSOVER[qtype], qg.RING_UP_TO.get(qtype, 0)) + 1
    x = (rng.standard_normal((wide, shape[1])) * 0.5).astype(np.float16)
    above = "wide" if qw.prefer_wide(qtype, wide, *shape) else "v2"
    assert above == ("v2" if qtype == qm.Q8_0 else "wide")  # ffn_down is deep, ffn_up high
    assert np.array_equal(run(W, x), run(W, x, kernel=above))
    check(W, w64, 1, rng, W.name, kernel="gemv", config=qg.GemvConfig(k_warps=1))


PERSIST_CONFIGS = (
    qg.GemvConfig(k_warps=4, persistent=True, blocks_per_sm=1, prefetch=2),
    qg.GemvConfig(k_warps=3, persistent=True, blocks_per_sm=0, prefetch=1),
    qg.GemvConfig(k_warps=1, persistent=True, blocks_per_sm=1, prefetch=2),
)


@pytest.mark.parametrize("qtype", (qm.Q4_K, qm.Q6_K, qm.Q8_0, qm.Q4_0, qm.IQ4_NL), ids=NAMES.get)
def test_persistent_variant_matches_twin_and_per_tile(qtype: int) -> None:
    # blocks walking several tiles (one block per SM over 2000+ rows), both prefetch depths, KW 1 / 3 / 4: the same
    # sums in the same order as one block per tile, so bitwise equal to it at the same KW
    rng = np.random.default_rng(1000 + qtype)
    shape = (4200, 1024) if qtype not in BLOCKS32 else (4200, 1248)
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
        tile = qg.GemvConfig(persistent=False, splits=1, ring=False)   # the per-tile kernel at the same k_warps
        assert np.array_equal(y, run(W, x, kernel="gemv", config=tile))
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
            check_strided_out(W, px, y0, f"T={tokens} persistent={persistent}", kernel="gemv",
                              config=qg.GemvConfig(persistent=persistent))


SPLIT_SHAPES = {
    qm.Q4_K: (200, 2560),  # 13 tiles, the last one partial; 10 chunks
    qm.Q6_K: (96, 3072),
    qm.Q5_K: (144, 2304),  # 9 tiles, 9 chunks
    qm.IQ4_XS: (200, 3072),
    qm.Q3_K: (112, 2816),  # 7 tiles, 11 chunks
    qm.Q8_0: (130, 2336),  # a tail chunk of 32 values
    qm.Q4_0: (200, 3040),  # a tail chunk of 224 values
    qm.IQ4_NL: (96, 2336),
    qm.F16: (64, 1312),  # a tail chunk of 32 values
}


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_split_k_matches_per_tile_kernel(qtype: int) -> None:
    """gemv_splitk_kernel against the twin and, bit for bit, against gemv_kernel with splits x k_warps warps (the same
    warp ranges, added in the same order whichever block of a tile arrives last); repeated launches bitwise equal."""
    rng = np.random.default_rng(1200 + qtype)
    shape = SPLIT_SHAPES[qtype]
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} split")
    w64 = dequantize(qtype, raw, *shape)
    for splits, kw in ((2, 4), (4, 2), (3, 1), (8, 1), (5, 2), (16, 4)):
        cfg = qg.GemvConfig(k_warps=kw, splits=splits)
        for tokens in (1, 2, 5):
            y = check(W, w64, tokens, rng, f"{W.name} {cfg}", kernel="gemv", config=cfg)
            x = (rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16)
            y = run(W, x, kernel="gemv", config=cfg)
            if splits * kw <= qg.MAX_K_WARPS:
                tile = qg.GemvConfig(k_warps=splits * kw, splits=1)
                assert np.array_equal(y, run(W, x, kernel="gemv", config=tile)), f"{cfg} T={tokens}"
            for _ in range(3):
                assert np.array_equal(y, run(W, x, kernel="gemv", config=cfg)), f"{cfg} T={tokens}: not reproducible"


@pytest.mark.parametrize("qtype", [qm.Q4_K, qm.Q6_K, qm.F16], ids=NAMES.get)
def test_split_k_strided_accumulate_and_portable(qtype: int) -> None:
    """Into a column slice of wider rows, plain and accumulating: bitwise what a contiguous out gets, the columns
    beside it untouched; the portable build (-DSPECSPLIT_PORTABLE) gives the same bits."""
    rng = np.random.default_rng(1300 + qtype)
    n_out, k = SPLIT_SHAPES[qtype]
    W = qm.QuantMatrix(qtype, random_weights(qtype, n_out, k, rng), (n_out, k))
    cfg = qg.GemvConfig(k_warps=2, splits=3)
    for tokens in (1, 2):
        px = qm.pack_activations(cupy.asarray((rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)))
        y0 = cupy.asarray(rng.standard_normal((tokens, n_out)).astype(np.float32))
        plain = check_strided_out(W, px, y0, f"T={tokens}", kernel="gemv", config=cfg)
        port = cupy.full((tokens, n_out), np.nan, cupy.float32)
        W.matmul(px, out=port, kernel="gemv", config=cfg, portable=True)
        assert cupy.array_equal(port, plain)


def test_split_k_in_a_cuda_graph() -> None:
    """Captured on a fresh stream (its scratch is made and zeroed during the capture, no memset node), replayed
    several times: every replay bitwise equal to the eager launches, so the counters reset themselves; launches of
    two matrices of different tile counts alternate on the same scratch."""
    rng = np.random.default_rng(1400)
    mats = []
    for qtype, shape in ((qm.Q4_K, (5120, 6144)), (qm.Q6_K, (1024, 5120))):
        mats.append(qm.QuantMatrix(qtype, random_weights(qtype, *shape, rng), shape))
    cfgs = (qg.GemvConfig(k_warps=2, splits=3), qg.GemvConfig(k_warps=4, splits=5))
    x = cupy.asarray((rng.standard_normal((1, 6144)) * 0.5).astype(np.float16))
    x2 = cupy.asarray((rng.standard_normal((1, 5120)) * 0.5).astype(np.float16))
    px, px2 = qm.pack_activations(x), qm.pack_activations(x2)
    y0 = cupy.asarray(rng.standard_normal((1, 5120)).astype(np.float32))
    eager_a = mats[0].matmul(px, kernel="gemv", config=cfgs[0])
    eager_b = mats[1].matmul(px2, kernel="gemv", config=cfgs[1])
    eager_c = y0.copy()
    mats[0].matmul(px, out=eager_c, accumulate=True, kernel="gemv", config=cfgs[0])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        outs = [cupy.full((1, 5120), np.nan, cupy.float32), cupy.full((1, 1024), np.nan, cupy.float32),
                cupy.empty((1, 5120), cupy.float32)]  # fmt: skip
        stream.synchronize()
        stream.begin_capture()
        try:
            mats[0].matmul(px, out=outs[0], kernel="gemv", config=cfgs[0])
            mats[1].matmul(px2, out=outs[1], kernel="gemv", config=cfgs[1])
            outs[2][...] = y0
            mats[0].matmul(px, out=outs[2], accumulate=True, kernel="gemv", config=cfgs[0])
        finally:
            graph = stream.end_capture()
        for _ in range(4):
            outs[0].fill(np.nan)
            outs[1].fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            assert cupy.array_equal(outs[0], eager_a)
            assert cupy.array_equal(outs[1], eager_b)
            assert cupy.array_equal(outs[2], eager_c)
    assert cupy.array_equal(mats[0].matmul(px, kernel="gemv", config=cfgs[0]), eager_a)  # eager again after


@pytest.mark.parametrize("qtype,shape", [(qm.Q4_K, (5120, 6144)), (qm.Q6_K, (5120, 17408)), (qm.Q8_0, (1024, 5120))],
                         ids=str)  # fmt: skip
def test_split_k_auto_at_27b_shapes(qtype: int, shape: tuple[int, int], monkeypatch) -> None:
    """The automatic choice (choose_split with the compiled kernels' registers, dispatch turned on) on 27B matrices of
    few tiles: what matmul() runs at T = 1, 2 equals the per-tile kernel to fp32 summation order and the twin to TOL."""
    monkeypatch.setattr(qg, "SPLIT_UP_TO", {qtype: 2})
    rng = np.random.default_rng(1500 + qtype)
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} {shape}")
    w64 = dequantize(qtype, raw, *shape)
    for tokens in (1, 2):
        splits, _ = qg.auto_split(qtype, shape[0], shape[1], tokens)
        x = (rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16)
        auto = run(W, x, kernel="gemv")
        tile = run(W, x, kernel="gemv", config=qg.GemvConfig(splits=1))
        assert np.isfinite(auto).all()
        assert rel_error(auto, tile) < 1e-6, f"T={tokens} splits={splits}"
        assert rel_error(auto, x.astype(np.float64) @ w64.T) < TOL
        assert np.array_equal(auto, run(W, x, kernel="gemv"))
    with pytest.raises(ValueError, match="exclusive"):
        W.matmul(cupy.asarray(x), kernel="gemv", config=qg.GemvConfig(persistent=True, splits=2))


RING_SHAPES = [(qm.Q4_K, (17408, 5120)), (qm.Q4_K, (5120, 17408)), (qm.Q5_K, (5120, 6144)), (qm.Q5_K, (77, 768)),
               (qm.IQ4_XS, (5120, 6144)), (qm.IQ4_XS, (77, 768)), (qm.Q3_K, (5120, 6144)), (qm.Q3_K, (77, 768)),
               (qm.Q4_0, (5120, 6144)), (qm.Q4_0, (77, 768)), (qm.IQ4_NL, (5120, 6144)), (qm.IQ4_NL, (77, 768)),
               (qm.Q6_K, (5120, 17408)), (qm.Q6_K, (77, 768)),
               (qm.Q8_0, (1040, 1280)), (qm.Q4_K, (48, 5120)),
               (qm.Q6_K, (65536, 512))]   # tall: the default launch takes RING_TALL_SHAPE (as the LM head)


@pytest.mark.parametrize("qtype,shape", RING_SHAPES, ids=str)
def test_ring_variant_is_bitwise_the_per_tile_kernel(qtype: int, shape: tuple[int, int]) -> None:
    """gemv_ring_kernel (bulk copies into per-warp rings of shared memory on sm_90) against the per-tile kernel at the
    same k_warps, x from the same PackedX.q16: bitwise equal for 1..8 stages and 1 / 3 / 4 / 8 warps, one and two
    tokens, plain, accumulating and into a column slice; and within the twin's bound through the dispatch."""
    rng = np.random.default_rng(1300 + qtype + shape[0])
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, cupy.asarray(raw), shape, name=f"{NAMES[qtype]} {shape}")
    n_out, k = shape
    for tokens in (1, 2):
        x = cupy.asarray((rng.standard_normal((tokens, k)) * 0.5).astype(np.float32))
        px = qm.pack_activations(x, q16=True)
        y0 = cupy.asarray(rng.standard_normal((tokens, n_out)).astype(np.float32))
        for kw, stages in ((4, 4), (1, 2), (3, 1), (8, 3), (4, 8)):
            tile = cupy.full((tokens, n_out), np.nan, cupy.float32)
            qg.gemv(W, px, tile, config=qg.GemvConfig(k_warps=kw, ring=False, splits=1))
            ring = cupy.full((tokens, n_out), np.nan, cupy.float32)
            cfg = qg.GemvConfig(k_warps=kw, ring=True, stages=stages)
            qg.gemv(W, px, ring, config=cfg)
            assert cupy.array_equal(tile, ring), f"T={tokens} {cfg}"
        # the last pair above ran 4 warps: the same sums, so the same bits, at other stages
        acc = y0.copy()
        qg.gemv(W, px, acc, accumulate=True, config=qg.GemvConfig(k_warps=4, ring=True))
        assert cupy.array_equal(acc, y0 + tile)
        wide = cupy.full((tokens, n_out + 24), 7.25, cupy.float32)
        qg.gemv(W, px, wide[:, 24:], config=qg.GemvConfig(k_warps=4, ring=True, stages=3))
        assert cupy.array_equal(wide[:, 24:], ring) and bool((wide[:, :24] == 7.25).all())
    w64 = dequantize(qtype, raw, *shape)
    check(W, w64, 1, rng, W.name, kernel="gemv", config=qg.GemvConfig(ring=True))


@pytest.mark.parametrize("qtype", (qm.Q4_K, qm.Q6_K), ids=NAMES.get)
def test_staged_norm_between_two_ring_products(qtype: int) -> None:
    """27B-like shapes: a 5120-row product accumulating into the stream stages rms_norm(stream) * w for a 5120-column
    product (quant_matmul.StagedNorm). The stream is bitwise the unstaged launch's, the staging and per-tile sums
    bitwise their NumPy twin, the consumer's output bitwise its unscaled output times the twin's 1 / rms, and the
    chain within the bound of rms_norm(s) * w @ W2^T in float64; also inside a CUDA graph, and the same as eager."""
    rng = np.random.default_rng(1500 + qtype)
    d, k0, n2 = 5120, 6144, 1024
    W1 = qm.QuantMatrix(qtype, cupy.asarray(random_weights(qtype, d, k0, rng)), (d, k0), name="producer")
    raw2 = random_weights(qtype, n2, d, rng)
    W2 = qm.QuantMatrix(qtype, cupy.asarray(raw2), (n2, d), name="consumer")
    nw = cupy.asarray((1.0 + 0.25 * rng.standard_normal(d)).astype(np.float32))
    for tokens in (1, 2, 3):
        assert qm.can_stage_norm(W1, W2, tokens)
        x = cupy.asarray((rng.standard_normal((tokens, k0)) * 0.5).astype(np.float32))
        px = qm.pack_activations(x, q16=True)
        s0 = cupy.asarray((rng.standard_normal((tokens, d)) * 2.0).astype(np.float32))
        plain = s0.copy()
        W1.matmul(px, out=plain, accumulate=True)
        s = s0.copy()
        st = qm.staged_norm(s, nw, 1e-6)
        W1.matmul(px, out=s, accumulate=True, stage=st)
        assert cupy.array_equal(s, plain)
        words, sums = staged_norm_twin(cupy.asnumpy(s), cupy.asnumpy(nw))
        assert np.array_equal(cupy.asnumpy(st.q16), words)
        assert np.array_equal(cupy.asnumpy(st.ssq), sums)
        y = W2.matmul(st)
        unscaled = cupy.asnumpy(qg.gemv(W2, qm.PackedX(px.data, tokens, d, q16=st.q16),
                                        cupy.empty((tokens, n2), cupy.float32), config=qg.GemvConfig(ring=True)))
        inv = staged_inv_twin(sums, d, 1e-6)
        assert np.array_equal(cupy.asnumpy(y), (unscaled * inv[:, None]).astype(np.float32))
        s64 = cupy.asnumpy(s).astype(np.float64)
        h = s64 / np.sqrt((s64 * s64).mean(axis=1, keepdims=True) + 1e-6) * cupy.asnumpy(nw)
        ref = h @ dequantize(qtype, raw2, n2, d).T
        assert rel_error(cupy.asnumpy(y), ref) < TOL
        # captured and replayed: the same bits
        s2 = s0.copy()
        st2 = qm.staged_norm(s2, nw, 1e-6)
        y2 = cupy.empty((tokens, n2), cupy.float32)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            W1.matmul(px, out=s2, accumulate=True, stage=st2)
            W2.matmul(st2, out=y2)
            graph = stream.end_capture()
            graph.launch(stream)
        stream.synchronize()
        assert cupy.array_equal(s2, plain) and cupy.array_equal(y2, y)


def test_staged_norm_refusals() -> None:
    rng = np.random.default_rng(1600)
    W = qm.QuantMatrix(qm.Q4_K, random_weights(qm.Q4_K, 512, 512, rng), (512, 512), name="q4k")
    F = qm.QuantMatrix(qm.F16, random_weights(qm.F16, 512, 512, rng), (512, 512), name="f16")
    one = qm.QuantMatrix(qm.Q4_K, random_weights(qm.Q4_K, 512, 256, rng), (512, 256), name="one chunk")
    x = cupy.asarray(rng.standard_normal((1, 512)).astype(np.float32))
    s = cupy.zeros((1, 512), cupy.float32)
    st = qm.staged_norm(s, cupy.ones(512, cupy.float32), 1e-6)
    assert not qm.can_stage_norm(W, F, 1) and not qm.can_stage_norm(F, W, 1) and not qm.can_stage_norm(W, W, 4)
    assert not qm.can_stage_norm(one, W, 1)  # K of one chunk: one warp a block, nothing to stage with
    with pytest.raises(ValueError, match="ring"):
        W.matmul(x, out=s, accumulate=True, stage=st, kernel="v2")
    with pytest.raises(ValueError, match="ring"):
        F.matmul(st)
    with pytest.raises(ValueError, match="warps"):
        one.matmul(cupy.ones((1, 256), cupy.float32), out=s, stage=st)
    with pytest.raises(ValueError, match="another stream"):
        W.matmul(x, out=s.copy(), stage=st)
    with pytest.raises(ValueError, match="staged norm takes"):
        qm.staged_norm(cupy.zeros((4, 512), cupy.float32), cupy.ones(512, cupy.float32), 1e-6)


@pytest.mark.parametrize("qtype,f,k", [(qm.Q4_K, 17408, 5120), (qm.Q6_K, 1024, 2048), (qm.Q8_0, 512, 1280)],
                         ids=str)
def test_swiglu_ring_is_bitwise_the_product_and_its_pack(qtype: int, f: int, k: int) -> None:
    """QuantMatrix.swiglu (gate|up's ring staging fp16(silu(g) u) for the down product, gemv_ring_kernel<QT, NT, 1>):
    bitwise the staging pack_activations(g, silu_up=u) writes from the ring's own [g | u] product, at 1..3 tokens,
    from a packed x and from a staged norm, at the default shape and others; the down product from it bitwise the
    one from the pack; inside a CUDA graph the same bits. The same for its cluster pairs (gemv_ring_pair_kernel, sm_90:
    gate|up's own launch shape, pair=True). The 27B's gate|up shape first (1088 tile pairs)."""
    rng = np.random.default_rng(1700 + qtype + f)
    W = qm.QuantMatrix(qtype, cupy.asarray(random_weights(qtype, 2 * f, k, rng)), (2 * f, k), name="gate|up")
    D = qm.QuantMatrix(qtype, cupy.asarray(random_weights(qtype, 256, f, rng)), (256, f), name="down")
    nw = cupy.asarray((0.01 + 0.0025 * rng.standard_normal(k)).astype(np.float32))
    pairs = qg.clusters_available()
    for tokens in (1, 2, 3):
        fuses = qm.can_fuse_swiglu(W, D, tokens)
        assert fuses == (tokens <= qg.RING_UP_TO[qtype])   # (Q8_0 takes the ring at one token only)
        x = cupy.asarray((rng.standard_normal((tokens, k)) * 0.005).astype(np.float32))  # silu(g) u inside fp16
        s = cupy.asarray((rng.standard_normal((tokens, k)) * 2.0).astype(np.float32))
        st = qm.staged_norm(s, nw, 1e-6)
        P = qm.QuantMatrix(qtype, cupy.asarray(random_weights(qtype, k, 512, rng)), (k, 512), name="producer")
        P.matmul(qm.pack_activations(cupy.zeros((tokens, 512), cupy.float32), q16=True), out=s, accumulate=True,
                 stage=st)  # s unchanged (x = 0): st now stages rms_norm(s) * nw
        for px in (qm.pack_activations(x, q16=True), st):
            gu = W.matmul(px, kernel="gemv", config=qg.GemvConfig(ring=True))
            want = qm.pack_activations(gu[:, :f], silu_up=gu[:, f:])
            got = W.swiglu(px)
            assert got.data is None and got.tokens == tokens and got.in_features == f
            assert cupy.array_equal(got.q16, want.q16), (tokens, type(px).__name__)
            if pairs:
                assert qm.can_fuse_swiglu(W, D, tokens, pair=True) == fuses
                got = W.swiglu(px, pair=True)
                assert got.data is None and cupy.array_equal(got.q16, want.q16), (tokens, type(px).__name__, "pair")
            if fuses:
                assert cupy.array_equal(D.matmul(got), D.matmul(want))
            for kw, stages in ((8, 2), (4, 3)):
                if qg._stages_with(f, kw, tokens):
                    cfg = qg.GemvConfig(k_warps=kw, stages=stages)
                    gu = W.matmul(px, kernel="gemv", config=qg.GemvConfig(k_warps=kw, stages=stages, ring=True))
                    want = qm.pack_activations(gu[:, :f], silu_up=gu[:, f:])
                    assert cupy.array_equal(qg.gemv_swiglu(W, px, config=cfg), want.q16), (tokens, cfg)
                    if pairs:
                        assert cupy.array_equal(qg.gemv_swiglu(W, px, config=cfg, pair=True), want.q16), (tokens, cfg)
        out = cupy.empty(qm.q16_words(f, tokens), cupy.uint32)
        px = qm.pack_activations(x, q16=True)
        stream = cupy.cuda.Stream(non_blocking=True)
        for pair in (False, True) if pairs else (False,):
            out[:] = 0
            with stream:
                stream.begin_capture()
                qg.gemv_swiglu(W, px, out, pair=pair)
                graph = stream.end_capture()
                graph.launch(stream)
            stream.synchronize()
            assert cupy.array_equal(out, W.swiglu(px).q16), pair


def test_swiglu_ring_refusals() -> None:
    rng = np.random.default_rng(1800)
    W = qm.QuantMatrix(qm.Q4_K, cupy.asarray(random_weights(qm.Q4_K, 1024, 512, rng)), (1024, 512), name="gate|up")
    x = cupy.asarray(rng.standard_normal((1, 512)).astype(np.float32))
    got = W.swiglu(x)   # plain activations: packed with their staging first
    with pytest.raises(ValueError, match="staging only"):
        qm.QuantMatrix(qm.Q4_K, cupy.asarray(random_weights(qm.Q4_K, 64, 512, rng)), (64, 512),
                       name="down").matmul(got, kernel="v2")
    with pytest.raises(ValueError, match="staging only"):  # 4 tokens: v2 would read the missing fp16 pack
        qm.QuantMatrix(qm.Q4_K, cupy.asarray(random_weights(qm.Q4_K, 64, 512, rng)), (64, 512),
                       name="down").matmul(qm.PackedX(None, 4, 512, q16=got.q16))
    odd = qm.QuantMatrix(qm.Q4_K, cupy.asarray(random_weights(qm.Q4_K, 2 * 272, 512, rng)), (544, 512), name="odd")
    with pytest.raises(ValueError, match="SwiGLU ring"):   # gate rows not a multiple of 256
        odd.swiglu(x)
    with pytest.raises(ValueError, match="SwiGLU ring"):   # 4 tokens: no staging is read there
        W.swiglu(cupy.ones((4, 512), cupy.float32))
    with pytest.raises(ValueError, match="warps"):
        qg.gemv_swiglu(W, qm.pack_activations(x, q16=True), config=qg.GemvConfig(k_warps=1))
    with pytest.raises(ValueError, match="uint32"):
        qg.gemv_swiglu(W, qm.pack_activations(x, q16=True), cupy.empty(7, cupy.uint32))
    with pytest.raises(ValueError, match="clusters"):  # the portable build has none
        qg.gemv_swiglu(W, qm.pack_activations(x, q16=True), portable=True, pair=True)


def test_ring_variant_refuses_what_it_cannot_take() -> None:
    rng = np.random.default_rng(1400)
    W = qm.QuantMatrix(qm.Q4_K, random_weights(qm.Q4_K, 32, 512, rng), (32, 512), name="q4k")
    x = cupy.asarray(rng.standard_normal((1, 512)).astype(np.float32))
    out = cupy.zeros((1, 32), cupy.float32)
    with pytest.raises(ValueError, match="PackedX.q16"):  # no int16 staging written
        qg.gemv(W, qm.pack_activations(x, q16=False), out, config=qg.GemvConfig(ring=True))
    with pytest.raises(ValueError, match="stages"):
        qg.gemv(W, qm.pack_activations(x), out, config=qg.GemvConfig(ring=True, stages=qg.MAX_RING_STAGES + 1))
    with pytest.raises(ValueError, match="shared memory"):
        qg.gemv(W, qm.pack_activations(x), out, config=qg.GemvConfig(ring=True, k_warps=8, stages=16))
    F = qm.QuantMatrix(qm.F16, random_weights(qm.F16, 32, 512, rng), (32, 512), name="f16")
    with pytest.raises(ValueError, match="ring"):
        qg.gemv(F, qm.pack_activations(x), out, config=qg.GemvConfig(ring=True))


@pytest.mark.parametrize("qtype", (qm.Q4_K, qm.Q6_K, qm.Q8_0), ids=NAMES.get)
@pytest.mark.parametrize("tokens", (1, 2))
def test_pack_staging_is_bitwise_and_matches_twin(qtype: int, tokens: int) -> None:
    """Every pack kind writes PackedX.q16 for one token and when asked (the NumPy twin of the int16 staging, of the
    fp16 values it packed); the per-tile, persistent and split-K kernels that copy it give bitwise what staging x in
    every block gives; and a product fed from it through the auto dispatch stays within the twin's bound."""
    from tests.quant_twins import q16_twin
    from tests.test_kernels_cpu_sim import unpack_numpy

    rng = np.random.default_rng(qtype * 11 + tokens)
    n_out, k = 200, 2048 if qtype != qm.Q8_0 else 1248
    raw = random_weights(qtype, n_out, k, rng)
    W = qm.QuantMatrix(qtype, cupy.asarray(raw), (n_out, k))
    w64 = dequantize(qtype, raw, n_out, k)
    x = cupy.asarray((rng.standard_normal((tokens, k)) * 2).astype(np.float32))
    gu = cupy.asarray(rng.standard_normal((tokens, 2 * k)).astype(np.float32))
    w = cupy.asarray((1 + 0.1 * rng.standard_normal(k)).astype(np.float32))
    q16 = True if tokens > qm.Q16_TOKENS else None  # None: the default for narrow inputs
    packs = {
        "x f32": qm.pack_activations(x, q16=q16),
        "x f16": qm.pack_activations(x.astype(cupy.float16), q16=q16),
        "rms+residual": qm.pack_activations(x, rms_weight=w, residual=gu[:, k:].copy(), q16=q16),
        "head norm gate": qm.pack_activations(x, rms_weight=w[:32], gate=gu[:, k:], q16=q16),
        "silu": qm.pack_activations(gu[:, :k], silu_up=gu[:, k:], q16=q16),
    }
    for name, px in packs.items():
        assert px.q16 is not None, name
        xh = unpack_numpy(cupy.asnumpy(px.data), k, px.padded_tokens)[:tokens]
        assert np.array_equal(cupy.asnumpy(px.q16), q16_twin(xh)), f"{name}: q16 differs from its twin"
        plain = qm.PackedX(px.data, tokens, k)  # the same fp16 pack, no staging copy
        for cfg in (qg.GemvConfig(k_warps=4), qg.GemvConfig(k_warps=2, persistent=True), qg.GemvConfig(splits=3)):
            a = cupy.full((tokens, n_out), np.nan, cupy.float32)
            b = cupy.full((tokens, n_out), np.nan, cupy.float32)
            qg.gemv(W, px, a, config=cfg)
            qg.gemv(W, plain, b, config=cfg)
            assert cupy.array_equal(a, b), f"{name} {cfg}: copying q16 changed the product"
        y = cupy.asnumpy(W.matmul(px))
        assert rel_error(y, xh.astype(np.float64) @ w64.T) < (TOL if tokens <= qg.CROSSOVER[qtype] else 2e-3), name
    assert qm.pack_activations(x, q16=False).q16 is None
    assert qm.pack_activations(cupy.zeros((qm.Q16_TOKENS + 1, k), cupy.float32)).q16 is None
