"""GPU fused dequantize + matmul (kernels/quant_matmul.cu) against the NumPy twins, in float64.

Needs CuPy and a CUDA GPU; skipped (with the reason) anywhere else. Every check draws fresh random
activations, poisons the output with NaN first (so an unwritten element fails), and compares
||y - x @ dequantize(W).T|| / ||ref|| < 2e-3 (fp16 activations and fp16-rounded weights give ~3e-4).
Both kernels are covered: v2 (the default, tiled layout, several launch shapes) and v1 (GGUF rows).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kernels import loader  # noqa: E402

_REASON = loader.unavailable_reason()     # the one check the engine uses too (CuPy, driver, a visible GPU)
if _REASON is not None:
    pytest.skip(f"GPU kernel tests skipped: {_REASON}", allow_module_level=True)

import cupy  # noqa: E402

from kernels import quant_matmul as qm  # noqa: E402
from tests.quant_twins import (  # noqa: E402
    MATMUL_CASES,
    NAMES,
    case_id,
    check_matmul,
    dequantize,
    gpu_matmul,
    legacy,
    random_weights,
    rel_error,
)
from tests.test_kernels_cpu_sim import unpack_numpy  # noqa: E402  (the packed layout's NumPy inverse)

pytestmark = pytest.mark.gpu



WIDTHS = (1, 2, 3, 8, 16, 23, 32, 41, 64)
TOL = 2e-3


def check(W: qm.QuantMatrix, w64: np.ndarray, tokens: int, rng: np.random.Generator, label: str, **kw) -> None:
    check_matmul(W, w64, tokens, rng, label, TOL, **kw)




@pytest.mark.parametrize("kernel", qm.KERNELS)
@pytest.mark.parametrize("qtype,shape", MATMUL_CASES, ids=case_id)
def test_matches_twin_at_every_width(qtype: int, shape: tuple[int, int], kernel: str) -> None:
    rng = np.random.default_rng(1000 * qtype + shape[0] + shape[1])
    n_out, k = shape
    raw = random_weights(qtype, n_out, k, rng)
    W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} {shape} {kernel}", kernel=kernel)
    w64 = dequantize(qtype, raw, n_out, k)
    for tokens in WIDTHS:
        check(W, w64, tokens, rng, W.name, splits=1)
        auto = W.choose_splits(tokens)
        if auto > 1:
            check(W, w64, tokens, rng, W.name)
    check(W, w64, 23, rng, W.name, splits=3)  # split-K with atomics even where it is not chosen


V2_SHAPES = [
    qm.QmvConfig(1, 1, 2, 1),
    qm.QmvConfig(2, 4, 3, 1),
    qm.QmvConfig(1, 8, 4, 1),
    qm.QmvConfig(2, 2, 4, 2),
]


@pytest.mark.parametrize("qtype", [qm.Q4_K, qm.Q6_K, qm.Q8_0, qm.F16], ids=NAMES.get)
def test_v2_launch_shapes_agree(qtype: int) -> None:
    # every launch shape computes the same function; with splits == 1 the warps add in a fixed order, so
    # two runs of one shape are bitwise equal
    rng = np.random.default_rng(31 + qtype)
    shape = (200, 2304) if qtype != qm.Q8_0 else (200, 2336)  # Q8_0: a tail chunk of 32 values
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} v2")
    w64 = dequantize(qtype, raw, *shape)
    for cfg in V2_SHAPES:
        for tokens in (1, 9, 41):
            if cfg.smem_bytes(qtype, (tokens + 7) // 8) <= qm.SMEM_LIMIT:
                check(W, w64, tokens, rng, f"{W.name} {cfg}", config=cfg)
    x = cupy.asarray((rng.standard_normal((5, shape[1])) * 0.5).astype(np.float16))
    cfg = qm.QmvConfig(2, 4, 3, 1)
    assert bool((W.matmul(x, config=cfg) == W.matmul(x, config=cfg)).all())


@pytest.mark.parametrize(
    "qtype,shape", [(qm.Q4_K, (5120, 17408)), (qm.Q6_K, (5120, 17408)), (qm.Q4_K, (17408, 5120))], ids=case_id
)
def test_large_shape(qtype: int, shape: tuple[int, int]) -> None:
    # Qwen3.6-27B ffn_down [5120 out, 17408 in] and ffn_up: K is split among warps (v2) or blocks (v1).
    rng = np.random.default_rng(7 + qtype + shape[0])
    raw = random_weights(qtype, *shape, rng)
    w64 = dequantize(qtype, raw, *shape)
    for kernel in qm.KERNELS:
        W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} {shape} {kernel}", kernel=kernel)
        if kernel == "v1":
            assert W.choose_splits() > 1
        else:
            assert W.choose_config().k_warps > 1
        for tokens in (1, 16, 23, 64):
            check(W, w64, tokens, rng, W.name)
        check(W, w64, 8, rng, W.name, splits=1)


@pytest.mark.parametrize("kernel", qm.KERNELS)
@pytest.mark.parametrize("qtype", [qm.Q4_K, qm.Q6_K, qm.Q8_0, qm.F16], ids=NAMES.get)
def test_portable_fallback_path(qtype: int, kernel: str) -> None:
    # The same kernels compiled with -DSPECSPLIT_PORTABLE: no inline PTX (software fp16, shuffle mma,
    # plain copies instead of cp.async / bulk copies).
    rng = np.random.default_rng(99 + qtype)
    shape = (256, 512) if qtype in (qm.Q4_K, qm.Q6_K) else (200, 544)
    raw = random_weights(qtype, *shape, rng)
    W = qm.QuantMatrix(qtype, raw, shape, kernel=kernel)
    w64 = dequantize(qtype, raw, *shape)
    for tokens in (1, 23):
        check(W, w64, tokens, rng, f"portable {NAMES[qtype]} {kernel}", splits=1, portable=True)


def test_q8_0_from_quantized_floats_and_float32_input() -> None:
    rng = np.random.default_rng(5)
    shape = (384, 1024)
    w = rng.standard_normal(shape).astype(np.float32)
    raw = legacy.quantize_q8_0(w.reshape(-1, 32)).reshape(shape[0], -1)
    W = qm.QuantMatrix(qm.Q8_0, raw, shape)
    w64 = dequantize(qm.Q8_0, raw, *shape)
    assert np.abs(w64 - w).max() <= 0.01 * np.abs(w).max()
    x = rng.standard_normal((13, shape[1])).astype(np.float32)
    y = cupy.asnumpy(W.matmul(cupy.asarray(x)))
    ref = x.astype(np.float16).astype(np.float64) @ w64.T  # the kernel rounds fp32 input to fp16
    assert rel_error(y, ref) < TOL


def test_shared_packed_activations_wide_batches_and_vectors() -> None:
    rng = np.random.default_rng(11)
    k = 512
    raws = {q: random_weights(q, 96, k, rng) for q in (qm.Q4_K, qm.Q6_K)}
    mats = {
        q: qm.QuantMatrix.from_raw(SimpleNamespace(name=f"w{q}", qtype=q, data=r, shape=(96, k)))
        for q, r in raws.items()
    }
    x = (rng.standard_normal((20, k)) * 0.5).astype(np.float16)
    packed = qm.pack_activations(cupy.asarray(x))
    for q, W in mats.items():
        ref = x.astype(np.float64) @ dequantize(q, raws[q], 96, k).T
        assert rel_error(cupy.asnumpy(W.matmul(packed)), ref) < TOL

    W = mats[qm.Q4_K]
    w64 = dequantize(qm.Q4_K, raws[qm.Q4_K], 96, k)
    xw = (rng.standard_normal((150, k)) * 0.5).astype(np.float16)  # > 64 tokens: several launches
    assert rel_error(cupy.asnumpy(W.matmul(cupy.asarray(xw))), xw.astype(np.float64) @ w64.T) < TOL
    v = xw[3]
    yv = W.matmul(cupy.asarray(v))
    assert yv.shape == (96,)
    assert rel_error(cupy.asnumpy(yv), v.astype(np.float64) @ w64.T) < TOL


def test_bad_inputs_are_refused() -> None:
    rng = np.random.default_rng(0)
    raw = random_weights(qm.Q4_K, 8, 256, rng)
    with pytest.raises(ValueError, match="bytes"):
        qm.QuantMatrix(qm.Q4_K, raw[:, :-1], (8, 256))
    with pytest.raises(ValueError, match="no GPU matmul"):
        qm.QuantMatrix(30, raw, (8, 256))  # BF16 has no kernel
    with pytest.raises(ValueError, match="kernel"):
        qm.QuantMatrix(qm.Q4_K, raw, (8, 256), kernel="v3")
    W = qm.QuantMatrix(qm.Q4_K, raw, (8, 256))
    with pytest.raises(ValueError, match="in_features"):
        W.matmul(cupy.zeros((2, 512), dtype=cupy.float16))
    x = cupy.zeros((2, 256), dtype=cupy.float16)
    with pytest.raises(ValueError, match="k_warps"):
        W.matmul(x, config=qm.QmvConfig(2, 9, 3, 1))
    with pytest.raises(ValueError, match="shared memory"):
        qm.QuantMatrix(qm.F16, np.zeros((8, 512), np.uint8), (8, 256)).matmul(x, config=qm.QmvConfig(2, 8, 4, 1))
    with pytest.raises(ValueError, match="v2 kernel only"):
        qm.QuantMatrix(qm.Q4_K, raw, (8, 256), kernel="v1").matmul(x, config=qm.QmvConfig())


# --- fused pack prologues (norm / residual / SwiGLU into the packed fp16 layout) and the accumulating epilogue ---


def _unpacked(px: qm.PackedX) -> np.ndarray:
    """The fp16 values a PackedX holds for its tokens, [T, K]: multiplied by an F16 identity matrix, which reads
    every value back exactly (fp32 sums of one product and zeros)."""
    k = px.in_features
    eye = qm.QuantMatrix(qm.F16, np.eye(k, dtype=np.float16).view(np.uint8), (k, k))
    return cupy.asnumpy(eye.matmul(px))


def _half_diff(a, b) -> tuple[int, float]:
    """(number of differing fp16 values, largest difference in units of the larger value's fp16 ulp)."""
    a = cupy.asnumpy(a.data).view(np.float16).astype(np.float64)
    b = cupy.asnumpy(b.data).view(np.float16).astype(np.float64)
    ulp = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float16)).astype(np.float64)
    return int((a != b).sum()), float((np.abs(a - b) / ulp).max())


@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_silu_pack_staging_only_is_the_full_packs_staging(tokens: int) -> None:
    """pack_activations(silu_up=, staging_only=True): no fp16 x (PackedX.data None), a launch over the real rows
    only, and the int16 staging bit for bit the full pack's; refused where it cannot stand alone."""
    rng = np.random.default_rng(tokens)
    k = 17408
    gu = cupy.asarray(rng.standard_normal((tokens, 2 * k)).astype(np.float32) * 2)
    full = qm.pack_activations(gu[:, :k], silu_up=gu[:, k:], q16=True)
    only = qm.pack_activations(gu[:, :k], silu_up=gu[:, k:], staging_only=True)
    assert only.data is None and only.q16 is not None
    assert cupy.array_equal(only.q16, full.q16)
    with pytest.raises(ValueError, match="staging_only"):
        qm.pack_activations(gu[:, :k], staging_only=True)
    with pytest.raises(ValueError, match="staging_only"):
        qm.pack_activations(gu[:, :k], silu_up=gu[:, k:], staging_only=True, q16=False)


@pytest.mark.parametrize("tokens,k,dtype", [(1, 5120, np.float32), (5, 1248, np.float32), (23, 512, np.float16),
                                            (64, 1024, np.float32)])
def test_fused_packs_equal_the_separate_launches(tokens: int, k: int, dtype) -> None:
    from kernels import norm_rope as nr

    rng = np.random.default_rng(tokens + k)
    x = cupy.asarray((rng.standard_normal((tokens, k)) * 2).astype(dtype))
    r = cupy.asarray(rng.standard_normal((tokens, k)).astype(dtype))
    w = cupy.asarray((1 + 0.1 * rng.standard_normal(k)).astype(np.float32))
    eps = 1e-6
    cases = {}
    cases["rms"] = (qm.pack_activations(x, rms_weight=w, eps=eps), qm.pack_activations(nr.rms_norm(x, w, eps)))
    fused = qm.pack_activations(x, rms_weight=w, eps=eps, residual=r)
    y, s = nr.rms_norm(x, w, eps, residual=r)
    cases["rms+residual"] = (fused, qm.pack_activations(y))
    assert cupy.array_equal(fused.residual, s), "the new residual stream differs from rms_norm(residual=)'s"
    d = 128 if k % 128 == 0 else 32
    wh = w[:d]
    gu = cupy.asarray(rng.standard_normal((tokens, 2 * k)).astype(dtype))  # z (or gate | up): halves, strided rows
    gated = nr.norm_gate(x.reshape(tokens, k // d, d), cupy.ascontiguousarray(gu[:, k:]).reshape(tokens, k // d, d),
                         wh, eps)  # fmt: skip
    cases["head norm gate"] = (qm.pack_activations(x, rms_weight=wh, eps=eps, gate=gu[:, k:]),
                               qm.pack_activations(gated.reshape(tokens, k)))  # fmt: skip
    cases["silu"] = (qm.pack_activations(gu[:, :k], silu_up=gu[:, k:]),
                     qm.pack_activations(nr.silu_mul(gu[:, :k], gu[:, k:])))  # fmt: skip
    for name, (a, b) in cases.items():
        n_diff, ulps = _half_diff(a, b)
        print(f"fused pack {name} T={tokens} K={k} {np.dtype(dtype).name}: {n_diff} of {a.data.size} halves differ")
        assert ulps <= 1 and n_diff <= a.data.size // 1000, f"{name}: {n_diff} values differ, up to {ulps} ulp"
    # and against the f64 NumPy twin, through the layout's inverse
    xh = cupy.asnumpy(x).astype(np.float64) + cupy.asnumpy(r).astype(np.float64)
    ref = layers_rms(xh, cupy.asnumpy(w).astype(np.float64), eps)
    assert rel_error(_unpacked(cases["rms+residual"][0]), ref) < 1e-3


def layers_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("qtype,n_out,k,tokens,splits", [(qm.Q4_K, 5120, 1024, 1, None), (qm.Q6_K, 300, 512, 23, 1),
                                                          (qm.Q8_0, 96, 2048, 3, 4), (qm.Q4_K, 64, 512, 64, None)])
def test_accumulate_adds_the_product_into_out(qtype: int, n_out: int, k: int, tokens: int, splits) -> None:
    rng = np.random.default_rng(n_out + tokens)
    raw = random_weights(qtype, n_out, k, rng)
    W = qm.QuantMatrix(qtype, raw, (n_out, k))
    x = cupy.asarray((rng.standard_normal((tokens, k)) * 0.5).astype(np.float16))
    y0 = cupy.asarray(rng.standard_normal((tokens, n_out)).astype(np.float32))
    plain = W.matmul(x, splits=splits)
    y = y0.copy()
    assert W.matmul(qm.pack_activations(x), out=y, splits=splits, accumulate=True) is y
    s = W.choose_config(tokens).splits if splits is None else splits
    if s == 1:  # one add of the finished sum: exactly y0 + x @ W^T, and the same again on a second call
        assert cupy.array_equal(y, y0 + plain)
        y2 = y0.copy()
        W.matmul(x, out=y2, splits=splits, accumulate=True)
        assert cupy.array_equal(y, y2)
    else:  # K split across blocks: the partial sums land in y0 with atomics
        np.testing.assert_allclose(cupy.asnumpy(y), cupy.asnumpy(y0 + plain), rtol=1e-5, atol=1e-4)
    ref = cupy.asnumpy(y0).astype(np.float64) + cupy.asnumpy(x).astype(np.float64) @ dequantize(qtype, raw, n_out, k).T
    assert rel_error(cupy.asnumpy(y), ref) < TOL
    if tokens == 23:  # v1 has no such epilogue: a product, then one add (one case: each width is a new build)
        y1 = y0.copy()
        qm.QuantMatrix(qtype, raw, (n_out, k), kernel="v1").matmul(x, out=y1, accumulate=True)
        assert rel_error(cupy.asnumpy(y1), ref) < TOL
    with pytest.raises(ValueError, match="accumulate"):
        W.matmul(x, accumulate=True)


@pytest.mark.parametrize("tokens", [9, 23, 41])
def test_v2_accumulate_by_bulk_adds_same_bits(monkeypatch, tokens: int) -> None:
    """On sm_90 an accumulating v2 launch (two token tiles or more, no K splits) adds its sums into y by bulk
    reduce-adds from a shared-memory tile: bitwise the load-add-store's y, with K-warps reducing in the block, in an
    aligned column slice and an unaligned one (which takes the load-add-store), the columns beside untouched."""
    from kernels import quant_wide as qw

    if not qw.bulk_adds():
        pytest.skip("no bulk reduce-adds on this device (sm_90 bulk copies only)")
    rng = np.random.default_rng(77 + tokens)
    for qtype, (n_out, k), cfg in ((qm.Q4_K, (5120, 6144), None), (qm.Q6_K, (1024, 5120), None),
                                   (qm.Q4_K, (640, 4096), qm.QmvConfig(1, 4, 2)), (qm.Q8_0, (96, 2048), None)):
        raw = random_weights(qtype, n_out, k, rng)
        W = qm.QuantMatrix(qtype, raw, (n_out, k))
        x = cupy.asarray((rng.standard_normal((tokens, k)) * 0.5).astype(np.float16))
        px = qm.pack_activations(x)
        y0 = cupy.asarray(rng.standard_normal((tokens, n_out)).astype(np.float32))
        outs = {}
        for bulk in (True, False):
            monkeypatch.setattr(qw, "BULK_ADDS", bulk)
            for off in (0, 4, 1):
                wide = cupy.full((tokens, n_out + 8), SENTINEL, cupy.float32)
                view = wide[:, off : off + n_out]
                view[...] = y0
                W.matmul(px, out=view, accumulate=True, kernel="v2", config=cfg)
                host = cupy.asnumpy(wide)
                assert (host[:, :off] == SENTINEL).all() and (host[:, off + n_out :] == SENTINEL).all()
                outs[bulk, off] = view.copy()
        for key, out in outs.items():
            assert cupy.array_equal(out, outs[False, 0]), f"{NAMES[qtype]} {n_out}x{k} T={tokens}: {key} differs"
        ref = cupy.asnumpy(y0).astype(np.float64) + cupy.asnumpy(x).astype(np.float64) @ dequantize(
            qtype, raw, n_out, k).T
        assert rel_error(cupy.asnumpy(outs[True, 4]), ref) < TOL


# --- products into a column slice of a wider output (row stride ldy: the stacked projections) --------------------

SENTINEL = 7.25  # the columns beside the slice must keep it


@pytest.mark.parametrize("kernel,qtype,n_out,k,tokens,splits", [
    ("v2", qm.Q4_K, 77, 768, 3, None), ("v2", qm.Q6_K, 300, 512, 23, 1), ("v2", qm.Q8_0, 48, 2048, 1, 4),
    ("gemv", qm.Q4_K, 77, 768, 1, None), ("gemv", qm.F16, 33, 800, 2, None), ("v1", qm.Q6_K, 50, 1024, 5, None),
])  # fmt: skip
def test_strided_out_and_accumulate(kernel: str, qtype: int, n_out: int, k: int, tokens: int, splits) -> None:
    """matmul(out=wide[:, off:off + n]) writes (or with accumulate adds) exactly what a contiguous out gets, and
    nothing beside it; v2 with K splits zeroes only its own columns first."""
    rng = np.random.default_rng(n_out + tokens + k)
    raw = random_weights(qtype, n_out, k, rng)
    W = qm.QuantMatrix(qtype, raw, (n_out, k), kernel="v1" if kernel == "v1" else "v2")
    xh = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    px = qm.pack_activations(cupy.asarray(xh))
    kw = {} if kernel == "v1" else {"kernel": kernel}
    if splits is not None:
        kw["splits"] = splits
    y0 = cupy.asarray(rng.standard_normal((tokens, n_out)).astype(np.float32))
    flat = W.matmul(px, **kw)
    flat_acc = y0.copy()
    W.matmul(px, out=flat_acc, accumulate=True, **kw)
    off, ld = 19, n_out + 45
    for accumulate, ref in ((False, flat), (True, flat_acc)):
        wide = cupy.full((tokens, ld), SENTINEL, cupy.float32)
        view = wide[:, off:off + n_out]
        view[...] = y0 if accumulate else cupy.nan
        assert W.matmul(px, out=view, accumulate=accumulate, **kw) is view
        got, want = cupy.asnumpy(view), cupy.asnumpy(ref)
        if splits is not None and splits > 1:  # atomics: the partial sums land in another order
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert np.array_equal(got, want), f"{kernel} accumulate={accumulate}: slice differs from contiguous out"
        rest = cupy.asnumpy(wide)
        assert (rest[:, :off] == SENTINEL).all() and (rest[:, off + n_out:] == SENTINEL).all()
    assert rel_error(cupy.asnumpy(flat), xh.astype(np.float64) @ dequantize(qtype, raw, n_out, k).T) < TOL
    bad = cupy.zeros((1, 2 * n_out), cupy.float32)[:, ::2]  # columns 8 bytes apart
    with pytest.raises(ValueError, match="contiguous rows"):
        W.matmul(px, out=bad) if tokens == 1 else W.matmul(px, out=cupy.zeros((n_out, tokens), cupy.float32).T)


@pytest.mark.parametrize("tokens,k,group,res,gate,dtype", [
    (1, 5120, 5120, 0, 0, np.float32), (1, 5120, 5120, 1, 0, np.float32), (1, 6144, 128, 0, 1, np.float32),
    (3, 1248, 1248, 1, 0, np.float16), (23, 5120, 5120, 1, 0, np.float32), (64, 1024, 64, 0, 1, np.float32),
    (1, 17408, 17408, 0, 1, np.float32),
])  # fmt: skip
def test_pack_rms_matches_numpy(tokens: int, k: int, group: int, res: int, gate: int, dtype) -> None:
    """pack_rms_kernel against the float64 twin (norm [+ residual] [* silu(z)] per row or per head), padding token
    rows zero in a poisoned buffer, the residual stream x + r; a misaligned x (copied by the launcher) too."""
    rng = np.random.default_rng(tokens * 7 + k + group)
    xh = (rng.standard_normal((tokens, k)) * 2).astype(dtype)
    rh = rng.standard_normal((tokens, k)).astype(dtype)
    zh = rng.standard_normal((tokens, 2 * k)).astype(dtype)
    wh = (1 + 0.1 * rng.standard_normal(group)).astype(np.float32)
    tpad = 8 * ((tokens + 7) // 8)
    for misaligned in (False, True):
        if misaligned:  # x one value past 16-byte alignment
            buf = cupy.zeros(tokens * k + 1, dtype)
            x = buf[1:].reshape(tokens, k)
            x[...] = cupy.asarray(xh)
        else:
            x = cupy.asarray(xh)
        out = cupy.full(k * tpad, 0x7E00, cupy.uint16)  # NaN poison
        px = qm.pack_activations(x, rms_weight=cupy.asarray(wh), eps=1e-6, residual=cupy.asarray(rh) if res else None,
                                 gate=cupy.asarray(zh)[:, k:] if gate else None, out=out)  # fmt: skip
        units = cupy.asnumpy(px.data).reshape(-1, 8)
        pad = (np.arange(units.shape[0]) % (4 * tpad)) // 4 >= tokens  # unit u holds token (u mod 4 tpad) // 4
        assert not units[pad].any(), "padding token rows must be zero"
        v = xh.astype(np.float64) + (rh.astype(np.float64) if res else 0)
        if res:
            assert np.array_equal(cupy.asnumpy(px.residual), (xh + rh) if dtype == np.float32 else v.astype(dtype))
        g = v.reshape(tokens, k // group, group)
        ref = (g / np.sqrt((g * g).mean(-1, keepdims=True) + 1e-6) * wh).reshape(tokens, k)
        if gate:
            zz = zh[:, k:].astype(np.float64)
            ref = ref * zz / (1 + np.exp(-zz))
        got = unpack_numpy(cupy.asnumpy(px.data), k, tpad)[:tokens].astype(np.float64)
        assert rel_error(got, ref) < 1e-3


NEWER_SHAPES = [(256, 512), (77, 768), (1024, 2048), (5120, 6144)]
NEWER_CASES = [(q, s) for q in (qm.Q5_K, qm.IQ4_XS, qm.Q3_K) for s in NEWER_SHAPES] + [
    (q, s) for q in (qm.Q4_0, qm.IQ4_NL) for s in NEWER_SHAPES + [(200, 544), (45, 1248)]]  # (tails of 32 / 224)


@pytest.mark.parametrize("qtype,shape", NEWER_CASES, ids=case_id)
def test_newer_types_on_v2_at_every_width(qtype: int, shape: tuple[int, int]) -> None:
    """Q5_K (a Q5_K_M file's matrices: the fifth bit from qh in both nibbles' paths), IQ4_XS (the codebook looked up
    by byte permutes, the 6-bit scales from scales_l and scales_h), Q3_K (two qs bits and an hmask bit, less 4 unless
    it is set), Q4_0 and IQ4_NL (32-value blocks: swizzled 8-byte pieces of qs, tail chunks) on the v2 kernel at every
    width: launch shapes, K split across blocks, the portable build, an accumulating launch; v1 refuses them at
    construction; and matmul()'s own choice at each width (Q4_K's dispatch: gemv, ring, wide; v2 for a type still in
    UNPROVEN_QTYPES) against the same twin."""
    from kernels import quant_gemv as qg
    from kernels import quant_wide as qw

    rng = np.random.default_rng(5 + qtype + shape[0] + shape[1])
    raw = random_weights(qtype, *shape, rng)
    w64 = dequantize(qtype, raw, *shape)
    W = qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} {shape}")
    if qtype in qm.UNPROVEN_QTYPES:  # the dispatch tables leave it out: matmul() keeps it on v2
        assert not any(qg.prefer_gemv(qtype, shape[1], t, q16=True) for t in range(1, qg.MAX_TOKENS + 1))
        assert not any(qw.prefer_wide(qtype, t, *shape, order=o) for t in WIDTHS for o in (0, 1))
    for tokens in WIDTHS:
        check(W, w64, tokens, rng, W.name, kernel="v2")
        check(W, w64, tokens, rng, f"{W.name} dispatched")
    check(W, w64, 23, rng, W.name, kernel="v2", splits=3)
    for cfg in V2_SHAPES:
        check(W, w64, 9, rng, f"{W.name} {cfg}", kernel="v2", config=cfg)
    check(W, w64, 5, rng, f"portable {W.name}", kernel="v2", splits=1, portable=True)
    x = (rng.standard_normal((7, shape[1])) * 0.5).astype(np.float16)
    y0 = rng.standard_normal((7, shape[0])).astype(np.float32)
    y = gpu_matmul(W, x, y0, kernel="v2", accumulate=True)
    assert rel_error(y - y0, x.astype(np.float64) @ w64.T) < TOL
    with pytest.raises(ValueError, match=f"no v1 GPU matmul for {NAMES[qtype]}"):
        qm.QuantMatrix(qtype, raw, shape, kernel="v1")
