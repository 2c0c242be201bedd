"""What the GPU matmul tests share: valid random GGUF-packed weights, their NumPy-twin dequantization, and the
run-and-check of a product on the GPU against the float64 twin (`gpu_matmul`, `check_matmul`).

The twins (services.engine.quants) are loaded by path when the package cannot import (no gguf on a GPU box).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from kernels import quant_matmul as qm


def _load_twins():
    try:
        from services.engine.quants import iquants, kquants, legacy

        return kquants, legacy, iquants
    except ImportError:
        base = Path(__file__).resolve().parents[1] / "services" / "engine" / "quants"
        mods = []
        for name in ("kquants", "legacy", "iquants"):
            spec = importlib.util.spec_from_file_location(f"_specsplit_twin_{name}", base / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mods.append(mod)
        return tuple(mods)


kquants, legacy, iquants = _load_twins()

# values, bytes a block; the fp16 scales' offsets in a block
BLOCK = {qm.F16: (1, 2), qm.Q8_0: (32, 34), qm.Q4_K: (256, 144), qm.Q5_K: (256, 176), qm.Q6_K: (256, 210),
         qm.IQ4_XS: (256, 136), qm.Q3_K: (256, 110), qm.Q4_0: (32, 18), qm.IQ4_NL: (32, 18)}
FP16_FIELDS = {qm.Q8_0: (0,), qm.Q4_K: (0, 2), qm.Q5_K: (0, 2), qm.Q6_K: (208,), qm.IQ4_XS: (0,), qm.Q3_K: (108,),
               qm.Q4_0: (0,), qm.IQ4_NL: (0,)}
NAMES = {qm.F16: "F16", qm.Q8_0: "Q8_0", qm.Q4_K: "Q4_K", qm.Q5_K: "Q5_K", qm.Q6_K: "Q6_K", qm.IQ4_XS: "IQ4_XS",
         qm.Q3_K: "Q3_K", qm.Q4_0: "Q4_0", qm.IQ4_NL: "IQ4_NL"}

# (storage type, (out, in)) the GPU matmul kernels are checked on: every type at three shapes (rows not a multiple of
# 16 among them), and the F16 / Q8_0 tail chunks
MATMUL_CASES = [
    (qtype, shape) for qtype in (qm.Q4_K, qm.Q6_K, qm.Q8_0, qm.F16) for shape in ((256, 512), (1024, 2048), (77, 768))
] + [
    (qm.Q8_0, (200, 544)),  # K % 256 == 32: a one-pair tail chunk
    (qm.Q8_0, (45, 1248)),  # K % 256 == 224: a seven-pair tail chunk
    (qm.F16, (130, 288)),
]


def case_id(value) -> str:
    """pytest id of a storage type or a shape."""
    return NAMES[value] if isinstance(value, int) else "x".join(map(str, value))


def random_weights(qtype: int, n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid packed storage (n_out, row_bytes): random bytes with small finite fp16 scales."""
    per, size = BLOCK[qtype]
    n_blocks = n_out * k // per
    if qtype == qm.F16:
        raw = (rng.standard_normal(n_out * k) * 0.5).astype(np.float16).view(np.uint8).reshape(n_blocks, size)
    else:
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        for start in FP16_FIELDS[qtype]:
            scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
            raw[:, start : start + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_out, -1)


def random_table(qtype: int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A token table's stored rows (rows, row bytes) uint8 for kernels.quant_matmul.embed_rows: F32 (qtype 0) values,
    or random_weights' blocks with a Q4_K table's d and dmin of either sign."""
    if qtype == 0:
        return rng.standard_normal((rows, k)).astype(np.float32).view(np.uint8)
    table = np.ascontiguousarray(random_weights(qtype, rows, k, rng))
    if qtype == qm.Q4_K:
        table.reshape(rows, -1, 144)[:, :, 0:4] = (
            rng.uniform(-0.02, 0.02, size=(rows, k // 256, 2)).astype(np.float16).view(np.uint8))
    return table


def dequantize(qtype: int, raw: np.ndarray, n_out: int, k: int) -> np.ndarray:
    """NumPy twin -> float64 [n_out, k]."""
    if qtype == qm.F16:
        return raw.reshape(-1).view(np.float16).astype(np.float64).reshape(n_out, k)
    blocks = raw.reshape(-1, BLOCK[qtype][1])
    decode = {qm.Q8_0: legacy.dequantize_q8_0, qm.Q4_K: kquants.dequantize_q4_k, qm.Q5_K: kquants.dequantize_q5_k,
              qm.Q6_K: kquants.dequantize_q6_k, qm.IQ4_XS: iquants.dequantize_iq4_xs, qm.Q3_K: kquants.dequantize_q3_k,
              qm.Q4_0: legacy.dequantize_q4_0, qm.IQ4_NL: iquants.dequantize_iq4_nl}
    return decode[qtype](blocks).astype(np.float64).reshape(n_out, k)


def rel_error(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref))


def gpu_matmul(W: qm.QuantMatrix, x, y0: np.ndarray | None = None, **kw) -> np.ndarray:
    """W.matmul on the GPU (x: host activations or a PackedX) into a NaN-poisoned output (or one holding y0, for
    accumulate=True), so unwritten elements show; returns the output on the host."""
    import cupy

    tokens = x.tokens if isinstance(x, qm.PackedX) else x.shape[0]
    out = cupy.array(y0) if y0 is not None else cupy.full((tokens, W.out_features), np.nan, dtype=cupy.float32)
    y = W.matmul(x if isinstance(x, qm.PackedX) else cupy.asarray(x), out=out, **kw)
    cupy.cuda.Device().synchronize()
    return cupy.asnumpy(y)


def check_matmul(W: qm.QuantMatrix, w64: np.ndarray, tokens: int, rng: np.random.Generator, label: str, tol: float,
                 **kw) -> np.ndarray:
    """x ~ N(0, 0.25) in fp16; every element written and finite, relative error against x @ w64.T below tol."""
    x = (rng.standard_normal((tokens, W.in_features)) * 0.5).astype(np.float16)
    y = gpu_matmul(W, x, **kw)
    assert y.shape == (tokens, W.out_features)
    bad = ~np.isfinite(y)
    assert not bad.any(), f"{label} T={tokens} {kw}: {int(bad.sum())} elements unwritten or not finite"
    err = rel_error(y, x.astype(np.float64) @ w64.T)
    assert err < tol, f"{label} T={tokens} {kw}: relative error {err:.3e} >= {tol}"
    return y


def q16_twin(x: np.ndarray) -> np.ndarray:
    """NumPy twin of PackedX.q16 (kernels/xq16.cuh) for fp16 x [T, K] (K a multiple of 32): per 256-value chunk and
    token, per 16-value group (a tail chunk's missing groups zero) int16 q = round-half-even of the exact product
    f * inv, inv = 32767 / max|f| in fp32; scale max|f| / 32767 and the group's fp32 sum (each half of 8 added in
    value order, then low + high); as the uint32 words of the buffer (units [nch][T][32] of 8 int16, then scales
    and sums [nch][T][16])."""
    t, k = x.shape
    nch = -(-k // 256)
    f = np.zeros((t, nch * 256), np.float32)
    f[:, :k] = x.astype(np.float32)
    g = f.reshape(t, nch, 16, 16).transpose(1, 0, 2, 3)  # [nch, T, group, value]
    amax = np.abs(g).max(axis=3)
    halves = []
    for h in range(2):  # each half of 8 values added in order, then low + high (the kernels' order)
        part = np.zeros(amax.shape, np.float32)
        for e in range(8 * h, 8 * h + 8):
            part = (part + g[..., e]).astype(np.float32)
        halves.append(part)
    total = (halves[0] + halves[1]).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(32767.0) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(g.astype(np.float64) * inv[..., None].astype(np.float64)).astype(np.int16)  # of the exact product
    scale = (amax * np.float32(1.0 / 32767.0)).astype(np.float32)
    return np.concatenate([q.reshape(-1).view(np.uint32), scale.reshape(-1).view(np.uint32),
                           total.reshape(-1).view(np.uint32)])


def _xor_tree(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis (a power of two, fp32) as an xor-shuffle butterfly leaves it in every lane: halves
    added pairwise, lane l with lane l ^ m for m = 1, 2, 4, ... (pairs of neighbours first)."""
    v = v.astype(np.float32)
    while v.shape[-1] > 1:
        v = (v[..., 0::2] + v[..., 1::2]).astype(np.float32)
    return v[..., 0]


def staged_norm_twin(s: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of a ring product's staged norm (kernels/quant_gemv.cu finish_ring): for the written stream s
    [T, N] (fp32, N a multiple of 256) and the next norm's weight w [N], (the int16 staging of z = s * w as
    PackedX.q16's uint32 words, per-tile sums of s^2 [T, N / 16]). Per 16-value group: q = round-half-even of
    z * (32767 / max|z|), scale max|z| / 32767, sum of z and of s^2 added in the 16 lanes' xor butterfly order."""
    t, n = s.shape
    nch = n // 256
    s = s.astype(np.float32)
    z = (s * w.astype(np.float32)[None, :]).astype(np.float32)
    g = z.reshape(t, nch, 16, 16).transpose(1, 0, 2, 3)  # [nch, T, group, value]
    amax = np.abs(g).max(axis=3)
    total = _xor_tree(g)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(32767.0) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(g.astype(np.float64) * inv[..., None].astype(np.float64)).astype(np.int16)
    scale = (amax * np.float32(1.0 / 32767.0)).astype(np.float32)
    words = np.concatenate([q.reshape(-1).view(np.uint32), scale.reshape(-1).view(np.uint32),
                            total.reshape(-1).view(np.uint32)])
    ssq = _xor_tree((s * s).astype(np.float32).reshape(t, n // 16, 16))
    return words, ssq


def staged_inv_twin(ssq: np.ndarray, k: int, eps: float) -> np.ndarray:
    """1 / rms per token from per-tile sums of squares [T, K / 16] as every warp of a ring consumer adds them
    (stage_inv: lane l adds tiles l, l + 32, ... in order, then a 32-lane xor butterfly): fp32 [T]."""
    t, tiles = ssq.shape
    lanes = np.zeros((t, 32), np.float32)
    for i in range(tiles):
        lanes[:, i % 32] = (lanes[:, i % 32] + ssq[:, i]).astype(np.float32)
    a = lanes
    while a.shape[1] > 1:  # m = 16, 8, ...: lane l with l ^ m, the upper half onto the lower
        h = a.shape[1] // 2
        a = (a[:, :h] + a[:, h:]).astype(np.float32)
    mean = (a[:, 0] / np.float32(k)).astype(np.float32)
    return (np.float32(1.0) / np.sqrt((mean + np.float32(eps)).astype(np.float32))).astype(np.float32)


def check_strided_out(W: qm.QuantMatrix, px: qm.PackedX, y0, label: str = "", **kw):
    """W.matmul(px, **kw) into a column slice of wider rows (row stride > out_features), plain and accumulating onto
    y0 (cupy [T, out]): bitwise what a contiguous output gets, the columns beside the slice untouched, and accumulate
    adding the finished sum once (bitwise y0 + the plain product). Returns the plain product (cupy)."""
    import cupy

    tokens, n_out = (int(s) for s in y0.shape)
    plain = cupy.full((tokens, n_out), np.nan, cupy.float32)
    W.matmul(px, out=plain, **kw)
    for accumulate in (False, True):
        flat = y0.copy() if accumulate else cupy.full((tokens, n_out), np.nan, cupy.float32)
        W.matmul(px, out=flat, accumulate=accumulate, **kw)
        wide = cupy.full((tokens, n_out + 40), 7.25, cupy.float32)
        view = wide[:, 11 : 11 + n_out]
        view[...] = y0 if accumulate else cupy.nan
        W.matmul(px, out=view, accumulate=accumulate, **kw)
        assert cupy.array_equal(view, flat), f"{label} accumulate={accumulate}"
        host = cupy.asnumpy(wide)
        assert (host[:, :11] == 7.25).all() and (host[:, 11 + n_out :] == 7.25).all()
        if accumulate:
            assert cupy.array_equal(flat, y0 + plain), f"{label}: not the same sums then one add"
    return plain
