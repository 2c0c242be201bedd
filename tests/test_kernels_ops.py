"""GPU norms / RoPE / gates, tree attention over f16 / Q8_0 / TQ3_0 KV caches, argmax, top-k, against NumPy twins.

Needs CuPy and a CUDA GPU; skipped (with the reason) anywhere else (tests/test_kernels_ops_sim.py runs the
same kernel sources on the CPU). Outputs are poisoned with NaN first, so an unwritten element fails.
Tolerances (relative Frobenius error against the f64 twin): f32 in/out 2e-6 for the norms (f32 math),
one output rounding for f16 (1e-3) / bf16 (8e-3); attention 3e-3 (q, softmax weights and V in fp16 on the
tensor cores, f32 accumulation); argmax and top-k ids exact, log-probabilities within 1e-4 absolute.
TQ3_0: the stored blocks against tq3.quantize_tq3_0 (equal but for values within float32 rounding of a
centroid midpoint), attention against services/engine/kvcache.py over the same bytes (needs gguf, which
services.engine.quants imports: those tests skip without it).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from kernels import loader  # noqa: E402

_REASON = loader.unavailable_reason()     # the one check the engine uses too (CuPy, driver, a visible GPU)
if _REASON is not None:
    pytest.skip(f"GPU kernel tests skipped: {_REASON}", allow_module_level=True)

import cupy  # noqa: E402

from kernels import attention as at  # noqa: E402
from kernels import norm_rope as nr  # noqa: E402
from kernels import sampling as sp  # noqa: E402
from tests.quant_twins import q16_twin  # noqa: E402
from tests.tq3_check import check_tq3_bytes  # noqa: E402

pytestmark = pytest.mark.gpu


def _load(rel: str, name: str):
    """A twin module by path: services.engine.quants imports gguf, which the GPU machine may lack."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


layers = _load("services/engine/layers.py", "_twin_layers")
legacy = _load("services/engine/quants/legacy.py", "_twin_legacy")
tq3 = _load("services/engine/quants/tq3.py", "_twin_tq3")
ddtree = _load("services/engine/ddtree.py", "_twin_ddtree")

OUT_TOL = {np.float32: 2e-6, np.float16: 1e-3, "bfloat16": 8e-3}
ATTN_TOL = 3e-3


def rel(y, ref) -> float:
    y = np.asarray(y, dtype=np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def host(a, dt=None) -> np.ndarray:
    """Device result -> float64 NumPy (bf16 bits decoded)."""
    h = cupy.asnumpy(a)
    if dt == "bfloat16":
        h = (h.astype(np.uint32) << 16).view(np.float32)
    return h.astype(np.float64)


def bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# -- norm_rope ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_dt", [np.float32, np.float16])
@pytest.mark.parametrize("out_dt", [np.float32, np.float16, "bfloat16"])
def test_rms_norm_with_residual(in_dt, out_dt) -> None:
    rng = np.random.default_rng(1)
    T, n, eps = 23, 5120, 1e-6
    x = (rng.standard_normal((T, n)) * 2).astype(in_dt)
    r = rng.standard_normal((T, n)).astype(in_dt)
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    y, s = nr.rms_norm(cupy.asarray(x), w, eps, residual=cupy.asarray(r), out_dtype=out_dt)
    xs = x.astype(np.float64) + r.astype(np.float64)
    tol = OUT_TOL[out_dt] + (2e-3 if in_dt == np.float16 else 0)  # the f16 sum s is rounded, y uses the f32 sum
    assert rel(host(y, out_dt), layers.rms_norm(xs, w, eps)) < tol
    assert rel(host(s), xs) < OUT_TOL[in_dt]
    y1 = nr.rms_norm(cupy.asarray(x[:1]), None, eps)  # one row, no weight, no residual
    assert rel(host(y1), layers.rms_norm(x[:1].astype(np.float64), None, eps)) < OUT_TOL[in_dt] + 1e-6


@pytest.mark.parametrize("D,n_rot,dt", [(256, 64, np.float32), (256, 64, np.float16), (128, 128, np.float32),
                                        (64, 0, np.float32), (96, 32, np.float16)])  # fmt: skip
def test_qk_norm_rope_in_place_q_view(D: int, n_rot: int, dt) -> None:
    rng = np.random.default_rng(D + n_rot)
    T, H, Hkv, eps, theta = 23, 24, 4, 1e-6, 1.0e7
    qg = rng.standard_normal((T, H, 2 * D)).astype(dt)  # q | gate interleaved per head (Qwen3.5 attn_q)
    k = rng.standard_normal((T, Hkv, D)).astype(dt)
    wq = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    wk = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    pos = (4000 + rng.integers(0, 30000, T)).astype(np.int32)
    qg_d = cupy.asarray(qg)
    qn, kn = nr.qk_norm_rope(qg_d[..., :D], cupy.asarray(k), wq, wk, cupy.asarray(pos), n_rot, theta, eps)

    def twin(x, w):
        y = layers.rms_norm(x.astype(np.float32), w, eps)
        return layers.rope_neox(y, pos, n_rot, theta) if n_rot else y

    tol = OUT_TOL[dt] + 2e-5
    assert rel(host(qn), twin(qg[..., :D], wq)) < tol
    assert rel(host(kn), twin(k, wk)) < tol
    # positions are read from the device buffer at run time
    pos_d = cupy.asarray(pos)
    out_q = cupy.full((T, H, D), np.nan, dtype=dt)
    nr.qk_norm_rope(qg_d[..., :D], None, wq, None, pos_d, n_rot, theta, eps, q_out=out_q)
    pos2 = pos + 17
    pos_d.set(pos2)
    nr.qk_norm_rope(qg_d[..., :D], None, wq, None, pos_d, n_rot, theta, eps, q_out=out_q)
    y = layers.rms_norm(qg[..., :D].astype(np.float32), wq, eps)
    ref = layers.rope_neox(y, pos2, n_rot, theta) if n_rot else y
    assert rel(host(out_q), ref) < tol


def test_gates() -> None:
    rng = np.random.default_rng(2)
    T, n = 23, 17408
    gu = (rng.standard_normal((T, 2 * n)) * 3).astype(np.float32)
    gu_d = cupy.asarray(gu)
    h = nr.silu_mul(gu_d[:, :n], gu_d[:, n:], out_dtype=np.float16)
    assert rel(host(h), layers.silu(gu[:, :n].astype(np.float64)) * gu[:, n:]) < 1e-3

    H, D = 24, 256
    qg = rng.standard_normal((T, H, 2 * D)).astype(np.float32)
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    o = nr.gate_mul(cupy.asarray(x), cupy.asarray(qg)[..., D:])
    assert rel(host(o), x * layers.sigmoid(qg[..., D:].astype(np.float64))) < 2e-6

    Hv, dv = 48, 128  # Qwen3.6-27B DeltaNet value heads
    od = rng.standard_normal((T, Hv, dv)).astype(np.float32)
    z = rng.standard_normal((T, Hv, dv)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    y = nr.norm_gate(cupy.asarray(od), cupy.asarray(z), w, 1e-6, out_dtype=np.float16)
    assert rel(host(y), layers.rms_norm(od.astype(np.float64), w, 1e-6) * layers.silu(z.astype(np.float64))) < 1e-3


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        nr.qk_norm_rope(cupy.zeros((2, 3, 40), cupy.float32), None, None, None, cupy.zeros(2, cupy.int32), 0, 1e4, 1e-6)
    with pytest.raises(ValueError, match="positions"):
        nr.qk_norm_rope(cupy.zeros((2, 3, 64), cupy.float32), None, None, None, cupy.zeros(3, cupy.int32), 8, 1e4, 1e-6)
    with pytest.raises(ValueError, match="element type"):
        nr.rms_norm(cupy.zeros((2, 8), cupy.int32), None, 1e-6)
    with pytest.raises(ValueError, match="KV cache type"):
        at.KVCacheLayer(4, 256, 64, kind="q4_0")
    with pytest.raises(ValueError, match="head_dim"):
        at.KVCacheLayer(4, 80, 64)
    with pytest.raises(ValueError, match="k must be"):
        sp.topk_logprobs(cupy.zeros((2, 100), cupy.float32), 9)


# -- attention ------------------------------------------------------------------------------------------


def random_tree(T: int, rng) -> list[int]:
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, T)]


def make_cache(kind: str, Hkv: int, D: int, S: int, T: int, rng, max_ctx: int | None = None, kind_v=None,
               ramp: float = 0.0):  # fmt: skip
    """ramp: key row j scaled by 1 + ramp * j (scores grow along the context)."""
    cache = at.KVCacheLayer(Hkv, D, max_ctx or S + T + 40, kind, kind_v, decode_counters=True)
    cache.k.fill(0xFF)  # stale NaN bytes past the written rows must not leak into the result
    cache.v.fill(0xFF)
    k = rng.standard_normal((S + T, Hkv, D)).astype(np.float32)
    k *= (1.0 + ramp * np.arange(S + T, dtype=np.float32))[:, None, None]
    v = rng.standard_normal((S + T, Hkv, D)).astype(np.float32)
    if S:
        cache.store(k[:S], v[:S], 0)
    cache.store(cupy.asarray(k[S:]).astype(cupy.float16), cupy.asarray(v[S:]).astype(cupy.float16), S)
    return cache, k, v


def twin_attention(q, cache, S: int, T: int, parents):
    kd, vd = cache.rows(S + T)
    visible = np.concatenate([np.ones((T, S), bool), layers.ancestor_matrix(np.asarray(parents))], axis=1)
    return layers.masked_attention(q.astype(np.float64), kd.astype(np.float64), vd.astype(np.float64), visible)


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("T", [1, 2, 16, 23, 41, 64])
def test_attention_qwen36_shape(kind: str, T: int) -> None:
    rng = np.random.default_rng(T + len(kind))
    H, Hkv, D, S = 24, 4, 256, 517
    cache, k, v = make_cache(kind, Hkv, D, S, T, rng)
    kd, vd = cache.rows(S + T)
    if kind == "q8_0":  # the stored blocks are ggml's quantize_row_q8_0_ref of the input (k: f32, new rows f16)
        src = np.concatenate([k[:S], k[S:].astype(np.float16).astype(np.float32)])
        want = legacy.dequantize_q8_0(legacy.quantize_q8_0(src.reshape(-1, 32))).reshape(S + T, Hkv, D)
        assert np.array_equal(kd, want)
    else:
        assert np.array_equal(kd, k.astype(np.float16).astype(np.float32))
    parents = random_tree(T, rng)
    q = rng.standard_normal((T, H, D)).astype(np.float16)
    ref = twin_attention(q, cache, S, T, parents)
    mask = cupy.asarray(at.tree_mask(parents))
    for splits in (None, 1, 5):
        out = cupy.full((T, H, D), np.nan, cupy.float32)
        q16 = cupy.full(H * D // 256 * T * 160, 0xDEADBEEF, cupy.uint32)
        at.attention(cupy.asarray(q), cache, S, mask, splits=splits, out=out, q16=q16)
        assert rel(host(out), ref) < ATTN_TOL, f"splits={splits}"
        # the output projection's int16 staging, bitwise the pack's (of the fp16-rounded output)
        assert np.array_equal(host(q16), q16_twin(host(out).reshape(T, H * D).astype(np.float16)))


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("S,window", [(2600, 2048), (517, 100), (300, 2048)])
def test_attention_window_reads_the_window_in_place(kind: str, S: int, window: int) -> None:
    """A sliding layer past its window (the DFlash drafter's block of 16, causal): token t sees committed rows from
    S - (window - 1) + t on; a window wider than the context hides nothing (bitwise the plain launch); a device S
    inside a graph replays with a new length."""
    rng = np.random.default_rng(S + window)
    H, Hkv, D, T = 32, 8, 128, 16
    cache, _, _ = make_cache(kind, Hkv, D, S, T, rng, max_ctx=S + T + 64)
    q = cupy.asarray(rng.standard_normal((T, H, D)).astype(np.float16))
    parents = list(range(-1, T - 1))
    mask = cupy.asarray(at.tree_mask(parents))
    kd, vd = cache.rows(S + T)
    seen = np.arange(S)[None, :] >= S - (window - 1) + np.arange(T)[:, None]
    visible = np.concatenate([seen, layers.ancestor_matrix(np.asarray(parents))], axis=1)
    ref = layers.masked_attention(host(q).astype(np.float64), kd.astype(np.float64), vd.astype(np.float64), visible)
    for splits in (None, 1, 3):
        out = at.attention(q, cache, S, mask, splits=splits, window=window)
        assert rel(host(out), ref) < ATTN_TOL, f"splits={splits}"
    if S + T <= window:
        assert np.array_equal(host(at.attention(q, cache, S, mask, splits=3, window=window)),
                              host(at.attention(q, cache, S, mask, splits=3)))
    s_dev = cupy.full(1, S - 7, cupy.int32)   # a graph captured at S - 7, replayed at S
    ws = at.make_workspace(H, T, D, 4)
    out = cupy.empty((T, H, D), cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        at.attention(q, cache, s_dev, mask, splits=4, window=window, out=out, workspace=ws)  # kernels built
        stream.begin_capture()
        at.attention(q, cache, s_dev, mask, splits=4, window=window, out=out, workspace=ws)
        graph = stream.end_capture()
        s_dev.fill(S)
        graph.launch(stream)
    stream.synchronize()
    assert rel(host(out), ref) < ATTN_TOL
    with pytest.raises(ValueError, match="window"):
        at.attention(q, cache, S, mask, window=-1)


def test_attention_staging_refusals() -> None:
    rng = np.random.default_rng(3)
    cache, _, _ = make_cache("f16", 1, 64, 20, 1, rng)
    q = cupy.asarray(rng.standard_normal((1, 2, 64)).astype(np.float32))
    with pytest.raises(ValueError, match="H D of 256"):   # 2 heads of 64: half a chunk
        at.attention(q, cache, 20, at.tree_mask([-1]), q16=cupy.empty(160, cupy.uint32))
    cache, _, _ = make_cache("f16", 1, 128, 20, 1, rng)
    q = cupy.asarray(rng.standard_normal((1, 2, 128)).astype(np.float32))
    with pytest.raises(ValueError, match="160 words"):
        at.attention(q, cache, 20, at.tree_mask([-1]), q16=cupy.empty(100, cupy.uint32))


@pytest.mark.parametrize("kind,D,G,Hkv", [("f16", 64, 2, 2), ("q8_0", 128, 8, 1), ("f16", 128, 3, 2)])
def test_attention_other_head_dims_and_gate(kind: str, D: int, G: int, Hkv: int) -> None:
    rng = np.random.default_rng(D + G)
    T, S, H = 9, 77, G * Hkv
    cache, _, _ = make_cache(kind, Hkv, D, S, T, rng)
    parents = random_tree(T, rng)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    qg = rng.standard_normal((T, H, 2 * D)).astype(np.float16)
    ref = twin_attention(q, cache, S, T, parents) * layers.sigmoid(qg[..., D:].astype(np.float64))
    o = at.attention(q, cache, S, at.tree_mask(parents), gate=cupy.asarray(qg)[..., D:], out_dtype=np.float16)
    assert o.dtype == np.float16
    assert rel(host(o), ref) < ATTN_TOL + 1e-3


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_attention_portable_build(kind: str) -> None:
    rng = np.random.default_rng(7)
    T, S, H, Hkv, D = 5, 100, 12, 2, 256
    cache, _, _ = make_cache(kind, Hkv, D, S, T, rng)
    parents = random_tree(T, rng)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    o = at.attention(q, cache, S, at.tree_mask(parents), portable=True)
    assert rel(host(o), twin_attention(q, cache, S, T, parents)) < ATTN_TOL


def test_attention_graph_replay_with_new_length_and_tree() -> None:
    # S and the tree live in device buffers: one captured graph serves successive steps.
    rng = np.random.default_rng(11)
    T, H, Hkv, D, kind = 16, 24, 4, 256, "q8_0"
    cache, _, _ = make_cache(kind, Hkv, D, 900, 0 + T, rng, max_ctx=2048)
    q_d = cupy.asarray(rng.standard_normal((T, H, D)).astype(np.float16))
    s_d = cupy.asarray([300], dtype=cupy.int32)
    m_d = cupy.asarray(at.tree_mask(list(range(-1, T - 1))))
    splits = at.choose_splits(H, Hkv, D, T, 2048, kind)
    ws = at.make_workspace(H, T, D, splits)
    out = cupy.empty((T, H, D), cupy.float32)
    idx, val = cupy.empty(T, cupy.int32), cupy.empty(T, cupy.float32)
    flat = out.reshape(T, H * D)
    nch = sp.chunks_for(T, H * D)
    chunk = math.ceil(H * D / nch)
    part = sp.make_argmax_workspace(T, math.ceil(H * D / chunk))

    def step():
        at.attention(q_d, cache, s_d, m_d, splits=splits, workspace=ws, out=out)
        sp.argmax(flat, chunks=nch, workspace=part, out=(idx, val))

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()  # compile and set attributes outside the capture
        stream.synchronize()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        for S, parents in ((300, list(range(-1, T - 1))), (884, random_tree(T, rng)), (17, random_tree(T, rng))):
            s_d.set(np.array([S], np.int32))
            m_d.set(at.tree_mask(parents))
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            # the new rows of this step are cache rows S..S+T-1 (whatever was stored there)
            kd, vd = cache.rows(S + T)
            visible = np.concatenate([np.ones((T, S), bool), layers.ancestor_matrix(np.asarray(parents))], axis=1)
            ref = layers.masked_attention(cupy.asnumpy(q_d).astype(np.float64), kd.astype(np.float64),
                                          vd.astype(np.float64), visible)  # fmt: skip
            assert rel(host(out), ref) < ATTN_TOL, f"S={S}"
            assert cupy.asnumpy(idx).tolist() == np.argmax(cupy.asnumpy(flat), axis=1).tolist()


DECODE_KINDS = [("q8_0", "tq3_0"), ("f16", "f16"), ("q8_0", "q8_0"), ("tq3_0", "tq3_0"), ("tq3_0", "f16")]


def _decode_chain(q, k, v, gate, cache, S, pos, q_w, k_w, n_rot, theta, eps):
    """What decode_attention replaces: qk_norm_rope, store, attention (f32 throughout until the tensor cores)."""
    qn, kn = nr.qk_norm_rope(q, k, q_w, k_w, pos, n_rot, theta, eps)
    cache.store(kn, v, S)
    return at.attention(qn, cache, S, at.tree_mask([-1]), gate=gate), kn


@pytest.mark.parametrize("kinds", DECODE_KINDS)
@pytest.mark.parametrize("S", [0, 45, 700])
def test_decode_attention_is_the_chain_at_the_27b_shape(kinds, S: int) -> None:
    """One token's q/k norm + RoPE, store and attention in one launch (attn_decode_kernel) against the four launches
    it replaces on a copy of the same cache: row S stored with the same bytes (TQ3_0: as check_tq3_bytes allows),
    o within the chain's fp16 tolerance (the one launch is f32 throughout), o's int16 staging the pack's, for one
    block a query head, the launcher's split and more blocks than rows."""
    rng = np.random.default_rng(S + 10 * len(kinds[0]) + len(kinds[1]))
    H, Hkv, D, n_rot, theta, eps = 24, 4, 256, 64, 1e7, 1e-6
    cache, _, _ = make_cache(kinds[0], Hkv, D, S, 0, rng, max_ctx=S + 40, kind_v=kinds[1])
    qkv = cupy.asarray(rng.standard_normal((1, (2 * H + 2 * Hkv) * D)).astype(np.float32) * 1.5)
    qg = qkv[:, :2 * H * D].reshape(1, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    k = qkv[:, 2 * H * D:(2 * H + Hkv) * D].reshape(1, Hkv, D)
    v = qkv[:, (2 * H + Hkv) * D:].reshape(1, Hkv, D)
    q_w = cupy.asarray((1 + 0.2 * rng.standard_normal(D)).astype(np.float32))
    k_w = cupy.asarray((1 + 0.2 * rng.standard_normal(D)).astype(np.float32))
    pos = cupy.asarray([S + 5], dtype=cupy.int32)
    chain_cache = at.KVCacheLayer(Hkv, D, S + 40, *kinds)
    chain_cache.k[...] = cache.k
    chain_cache.v[...] = cache.v
    want, kn = _decode_chain(q, k, v, gate, chain_cache, S, pos, q_w, k_w, n_rot, theta, eps)
    want = host(want)
    for splits in (1, None, 7):
        cache.k[...] = chain_cache.k  # rows < S as they were; row S rewritten below
        out = cupy.full((1, H, D), np.nan, cupy.float32)
        q16 = cupy.full(H * D // 256 * 160, 0xDEADBEEF, cupy.uint32)
        at.decode_attention(q, k, v, cache, cupy.asarray([S], cupy.int32), pos, q_w, k_w, n_rot, theta, eps, gate=gate,
                            splits=splits, out=out, q16=q16)
        assert rel(host(out), want) < ATTN_TOL, f"splits={splits}"
        assert np.array_equal(host(q16), q16_twin(host(out).reshape(1, H * D).astype(np.float16)))
        assert (host(cache.counters) == 0).all()
        for side, kind, src in ((0, kinds[0], kn), (1, kinds[1], v)):
            got, ref = cache.raw_rows(S + 1)[side], chain_cache.raw_rows(S + 1)[side]
            assert np.array_equal(got[:S], ref[:S])
            if kind == "tq3_0":
                check_tq3_bytes(got[S:], host(src), tq3)
            else:
                assert np.array_equal(got[S], ref[S]), f"{kind} row S"


def test_decode_attention_graph_replays_new_lengths_and_refuses_bad_shapes() -> None:
    # S and the position live in device buffers: one captured launch serves successive tokens (each stores its row
    # S and attends to it), with the splits fixed by s_hint; bad shapes are refused before any launch
    rng = np.random.default_rng(21)
    H, Hkv, D, n_rot, theta, eps = 24, 4, 256, 64, 1e7, 1e-6
    cache, _, _ = make_cache("q8_0", Hkv, D, 600, 0, rng, max_ctx=1024, kind_v="tq3_0")
    qkv = cupy.asarray(rng.standard_normal((1, (2 * H + 2 * Hkv) * D)).astype(np.float32))
    qg = qkv[:, :2 * H * D].reshape(1, H, 2 * D)
    k = qkv[:, 2 * H * D:(2 * H + Hkv) * D].reshape(1, Hkv, D)
    v = qkv[:, (2 * H + Hkv) * D:].reshape(1, Hkv, D)
    q_w, k_w = cupy.ones(D, cupy.float32), cupy.ones(D, cupy.float32)
    s_d, p_d = cupy.asarray([0], cupy.int32), cupy.asarray([0], cupy.int32)
    out = cupy.empty((1, H, D), cupy.float32)
    splits = at.decode_splits(H, 1000)
    assert splits > 1   # the partials meet through the workspace, made before the capture (it outlives it)
    ws = at.make_decode_workspace(H, D, splits)

    def step():
        at.decode_attention(qg[..., :D], k, v, cache, s_d, p_d, q_w, k_w, n_rot, theta, eps, gate=qg[..., D:],
                            s_hint=1000, out=out, workspace=ws)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()
        stream.synchronize()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        for S in (600, 17, 601, 0):
            s_d.set(np.array([S], np.int32))
            p_d.set(np.array([S], np.int32))
            graph.launch(stream)
            stream.synchronize()
            got = host(out)
            ref_cache = at.KVCacheLayer(Hkv, D, 1024, "q8_0", "tq3_0")
            ref_cache.k[...] = cache.k
            ref_cache.v[...] = cache.v
            want, _ = _decode_chain(qg[..., :D], k, v, qg[..., D:], ref_cache, S, p_d, q_w, k_w, n_rot, theta, eps)
            assert rel(got, host(want)) < ATTN_TOL, f"S={S}"
    with pytest.raises(ValueError, match="one token"):
        at.decode_attention(cupy.zeros((2, H, D), cupy.float32), k, v, cache, 0, [0], q_w, k_w, n_rot, theta, eps)
    with pytest.raises(ValueError, match="do not fit"):
        at.decode_attention(qg[..., :D], k[:, :2], v, cache, 0, [0], q_w, k_w, n_rot, theta, eps)
    with pytest.raises(ValueError, match="exceed"):
        at.decode_attention(qg[..., :D], k, v, cache, 1024, [0], q_w, k_w, n_rot, theta, eps)
    bare = at.KVCacheLayer(Hkv, D, 1024, "q8_0", "tq3_0")   # a drafter's caches keep no counters
    assert bare.counters is None and not at.decode_supported(bare, H, 100) and at.decode_supported(cache, H, 100)
    with pytest.raises(ValueError, match="decode_counters"):
        at.decode_attention(qg[..., :D], k, v, bare, 0, [0], q_w, k_w, n_rot, theta, eps)
    with pytest.raises(ValueError, match="workspace does not fit"):
        at.decode_attention(qg[..., :D], k, v, cache, 0, [0], q_w, k_w, n_rot, theta, eps, splits=splits + 1,
                            workspace=ws)


def test_kv_row_mover_graph_replays_any_path() -> None:
    # a commit's KV compaction in every cache of a state, one captured launch: the rows and their number live in
    # device buffers, so one graph serves paths of any length (none, past the kernel's 32-row chunks, the widest)
    rng = np.random.default_rng(5)
    caches = [at.KVCacheLayer(4, 256, 300, "f16"), at.KVCacheLayer(4, 256, 300, "q8_0", "tq3_0"),
              at.KVCacheLayer(4, 256, 300, "tq3_0", "f16")]
    for c in caches:
        c.k[...] = cupy.asarray(rng.integers(0, 256, c.k.size, dtype=np.uint8))
        c.v[...] = cupy.asarray(rng.integers(0, 256, c.v.size, dtype=np.uint8))
    mover = at.KVRowMover(caches)
    dst, src = cupy.zeros(65, cupy.int64), cupy.zeros(65, cupy.int64)
    count = cupy.zeros(1, cupy.int32)

    def rows():   # each buffer as the twin takes it: [Hkv, ctx, row bytes]
        return [(b, (4, c.ctx, rb)) for c in caches for b, rb in ((c.k, c.row_bytes), (c.v, c.row_bytes_v))]

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        mover(dst, src, count)   # compile outside the capture
        stream.synchronize()
        stream.begin_capture()
        mover(dst, src, count)
        graph = stream.end_capture()
        base = 40
        for path in ([0], [0, 2, 3], [0, 1, 4, 9, 10], [0] + list(range(2, 65)), list(range(0, 130, 2))):
            first = next((d for d, i in enumerate(path) if i != d), len(path))
            d = np.arange(base + first, base + len(path), dtype=np.int64)
            sr = np.array([base + i for i in path[first:]], dtype=np.int64)
            want = [cupy.asnumpy(b).reshape(shape) for b, shape in rows()]
            at.kv_move_rows_twin(want, d, sr, len(d))
            dst[:len(d)].set(d)
            src[:len(d)].set(sr)
            count.set(np.array([len(d)], np.int32))
            graph.launch(stream)
            stream.synchronize()
            for (b, shape), ref in zip(rows(), want):
                np.testing.assert_array_equal(cupy.asnumpy(b).reshape(shape), ref, err_msg=str(path))


@pytest.mark.parametrize("kinds", [("f16", "f16"), ("q8_0", "tq3_0")])
@pytest.mark.parametrize("T,S", [(1, 31), (16, 32), (23, 33), (41, 511), (64, 480)])
def test_attention_verify_widths_graph_splits(kinds, T: int, S: int) -> None:
    # the splits a graph bucket gets (s_hint 1024 - T: many, most of them empty at these S), S just below / at /
    # above a 32-key tile boundary, the default block shape and 2 warps per m16 tile
    rng = np.random.default_rng(T + S)
    H, Hkv, D = 24, 4, 256
    cache, _, _ = make_cache(kinds[0], Hkv, D, S, T, rng, max_ctx=1024, kind_v=kinds[1])
    parents = random_tree(T, rng)
    q = rng.standard_normal((T, H, D)).astype(np.float16)
    ref = twin_attention(q, cache, S, T, parents)  # model-domain rows (TQ3_0 decoded and inverse-rotated)
    mask = cupy.asarray(at.tree_mask(parents))
    for kw in (None, 2):
        out = cupy.full((T, H, D), np.nan, cupy.float32)
        at.attention(cupy.asarray(q), cache, S, mask, s_hint=1024 - T, kw=kw, out=out)
        assert rel(host(out), ref) < ATTN_TOL, f"kw={kw}"


@pytest.mark.parametrize("kinds", [("f16", "f16"), ("q8_0", "tq3_0")])
def test_attention_growing_scores_bf16_q(kinds) -> None:
    # keys scaled up along the context: the running max moves by more than 8 (log2) on some tiles and by less on
    # others (kept: weights up to 2^8); q as bf16 bits
    rng = np.random.default_rng(3)
    H, Hkv, D, S, T = 24, 4, 256, 700, 23
    cache, _, _ = make_cache(kinds[0], Hkv, D, S, T, rng, kind_v=kinds[1], ramp=0.01)
    parents = random_tree(T, rng)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    bits = ((q.view(np.uint32).astype(np.uint64) + 0x7FFF + ((q.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
    qb = (bits.astype(np.uint32) << 16).view(np.float32)
    ref = twin_attention(qb, cache, S, T, parents)
    for splits in (None, 3):
        o = at.attention(cupy.asarray(bits), cache, S, at.tree_mask(parents), splits=splits)
        assert rel(host(o), ref) < ATTN_TOL, f"splits={splits}"


# -- TQ3_0 KV -------------------------------------------------------------------------------------------


def kv_twin(cache, n: int):
    """services/engine/kvcache.py KVCache over the device cache's first n rows (the same bytes)."""
    kvcache = pytest.importorskip("services.engine.kvcache", reason="the KV twin imports gguf (not installed)")
    stores = []
    for raw, kind in zip(cache.raw_rows(n), (cache.kind, cache.kind_v)):
        if kind == "f16":
            data = raw.reshape(-1).view(np.float16).reshape(n, cache.n_kv_heads, cache.head_dim)
        else:
            data = raw.reshape(n, cache.n_kv_heads, cache.head_dim // 32, -1)
        stores.append(kvcache.KVStore(kind, n, cache.n_kv_heads, cache.head_dim, _data=np.ascontiguousarray(data)))
    return kvcache.KVCache(*stores)


def twin_attention_kv(q, cache, S: int, T: int, parents) -> np.ndarray:
    visible = np.concatenate([np.ones((T, S), bool), layers.ancestor_matrix(np.asarray(parents))], axis=1)
    return kv_twin(cache, S + T).attend(np.asarray(q, np.float32), S + T, visible).astype(np.float64)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_tq3_store_matches_twin_quantizer(D: int) -> None:
    rng = np.random.default_rng(D)
    S, T, Hkv = 700, 5, 3
    x = (rng.standard_normal((S + T, Hkv, D)) * rng.uniform(0.1, 10, (S + T, Hkv, 1))).astype(np.float32)
    x[3, 1] = 0.0  # a zero row: norm 0, codes of the zero vector
    x[S:] = x[S:].astype(np.float16)
    cache = at.KVCacheLayer(Hkv, D, S + T, "tq3_0")
    cache.store(x[:S], x[:S] * -0.5, 0)
    cache.store(cupy.asarray(x[S:]).astype(cupy.float16), cupy.asarray(x[S:] * -0.5).astype(cupy.float16), S)
    kr, vr = cache.raw_rows(S + T)
    check_tq3_bytes(kr, x, tq3)
    check_tq3_bytes(vr, x * -0.5, tq3)
    assert cache.bytes_per_token == 2 * Hkv * tq3.row_bytes(D)
    kd, _ = cache.rows(S + T)
    assert np.allclose(kd, tq3.dequantize_tq3_0(kr.reshape(S + T, Hkv, D // 32, 14)), atol=1e-5)


@pytest.mark.parametrize("kinds", [("tq3_0", "tq3_0"), ("q8_0", "tq3_0")])
@pytest.mark.parametrize("T", [1, 16, 23, 41])
def test_attention_tq3_0_qwen36_shape(kinds, T: int) -> None:
    rng = np.random.default_rng(T + 100 * len(kinds[0]))
    H, Hkv, D, S = 24, 4, 256, 517
    cache, _, _ = make_cache(kinds[0], Hkv, D, S, T, rng, kind_v=kinds[1])
    parents = random_tree(T, rng)
    q = rng.standard_normal((T, H, D)).astype(np.float16)
    ref = twin_attention_kv(q, cache, S, T, parents)
    # the model-domain decode gives the same attention (the rotation is orthogonal)
    assert rel(twin_attention(q, cache, S, T, parents), ref) < 1e-4
    mask = cupy.asarray(at.tree_mask(parents))
    for splits in (None, 1, 5):
        out = cupy.full((T, H, D), np.nan, cupy.float32)
        q16 = cupy.full(H * D // 256 * T * 160, 0xDEADBEEF, cupy.uint32)
        at.attention(cupy.asarray(q), cache, S, mask, splits=splits, out=out, q16=q16)
        assert rel(host(out), ref) < ATTN_TOL, f"splits={splits}"
        # the output projection's int16 staging, bitwise the pack's (of the fp16-rounded output)
        assert np.array_equal(host(q16), q16_twin(host(out).reshape(T, H * D).astype(np.float16)))


TQ3_MIXED = [(("tq3_0", "tq3_0"), 64, 2, 2, 23), (("tq3_0", "f16"), 128, 3, 2, 16),
             (("f16", "tq3_0"), 64, 6, 1, 41), (("tq3_0", "q8_0"), 128, 8, 1, 1)]  # fmt: skip


@pytest.mark.parametrize("kinds,D,G,Hkv,T", TQ3_MIXED)
def test_attention_tq3_0_head_dims_kinds_and_gate(kinds, D: int, G: int, Hkv: int, T: int) -> None:
    rng = np.random.default_rng(D + G + T)
    S, H = 301, G * Hkv
    cache, _, _ = make_cache(kinds[0], Hkv, D, S, T, rng, kind_v=kinds[1])
    parents = random_tree(T, rng)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    qg = rng.standard_normal((T, H, 2 * D)).astype(np.float16)
    ref = twin_attention_kv(q, cache, S, T, parents) * layers.sigmoid(qg[..., D:].astype(np.float64))
    o = at.attention(q, cache, S, at.tree_mask(parents), gate=cupy.asarray(qg)[..., D:], out_dtype=np.float16)
    assert rel(host(o), ref) < ATTN_TOL + 1e-3
    o = at.attention(q, cache, S, at.tree_mask(parents), portable=True)
    assert rel(host(o), twin_attention_kv(q, cache, S, T, parents)) < ATTN_TOL


def test_attention_tq3_0_graph_replay() -> None:
    rng = np.random.default_rng(12)
    T, H, Hkv, D = 23, 24, 4, 256
    cache, _, _ = make_cache("q8_0", Hkv, D, 600, T, rng, max_ctx=1024, kind_v="tq3_0")
    q_d = cupy.asarray(rng.standard_normal((T, H, D)).astype(np.float16))
    s_d = cupy.asarray([100], dtype=cupy.int32)
    m_d = cupy.asarray(at.tree_mask(list(range(-1, T - 1))))
    splits = at.choose_splits(H, Hkv, D, T, 1024, cache.kind, cache.kind_v)
    ws = at.make_workspace(H, T, D, splits)
    out = cupy.empty((T, H, D), cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        at.attention(q_d, cache, s_d, m_d, splits=splits, workspace=ws, out=out)
        stream.synchronize()
        stream.begin_capture()
        at.attention(q_d, cache, s_d, m_d, splits=splits, workspace=ws, out=out)
        graph = stream.end_capture()
        for S, parents in ((100, list(range(-1, T - 1))), (577, random_tree(T, rng))):
            s_d.set(np.array([S], np.int32))
            m_d.set(at.tree_mask(parents))
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            assert rel(host(out), twin_attention_kv(cupy.asnumpy(q_d), cache, S, T, parents)) < ATTN_TOL, f"S={S}"


def test_tq3_0_bad_inputs() -> None:
    with pytest.raises(ValueError, match="KV cache type"):
        at.KVCacheLayer(4, 256, 64, kind="q8_0", kind_v="tq3")
    c = at.KVCacheLayer(2, 128, 40, "q8_0", "tq3_0")
    assert (c.kind, c.kind_k, c.kind_v) == ("q8_0", "q8_0", "tq3_0")
    assert c.k.nbytes == 2 * 64 * 136 and c.v.nbytes == 2 * 64 * 56


# -- sampling -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 23, 64])
def test_argmax_vocab(rows: int) -> None:
    rng = np.random.default_rng(rows)
    V = 248320
    x = rng.standard_normal((rows, V)).astype(np.float32)
    x[0, [200000, 5]] = 10.0  # tie: lowest id
    x_d = cupy.asarray(x)
    idx, val = sp.argmax(x_d)
    assert cupy.asnumpy(idx).tolist() == np.argmax(x, axis=1).tolist()
    assert np.array_equal(cupy.asnumpy(val), x.max(axis=1))
    idx16, _ = sp.argmax(x_d.astype(cupy.float16))
    assert cupy.asnumpy(idx16).tolist() == np.argmax(x.astype(np.float16), axis=1).tolist()


def test_argmax_feeds_the_next_decode_step() -> None:
    """argmax(feed=) on the device: advance_twin's values (the next step's token, S, position, DeltaNet half)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 248320)).astype(np.float32)
    vals = [np.array(v, np.int32) for v in ([7, 0], [100, 3], [100], [0])]
    want = [v.copy() for v in vals]
    sp.advance_twin(np.argmax(x, axis=1), *want)
    dev = [cupy.asarray(v) for v in vals]
    idx, _ = sp.argmax(cupy.asarray(x), feed=tuple(dev))
    assert cupy.asnumpy(idx).tolist() == np.argmax(x, axis=1).tolist()
    assert [cupy.asnumpy(d).tolist() for d in dev] == [w.tolist() for w in want]
    with pytest.raises(ValueError, match="int32 device arrays"):
        sp.argmax(cupy.asarray(x), feed=(dev[0].astype(cupy.int64), dev[1], dev[2], None))


@pytest.mark.parametrize("rows,k,temp", [(1, 8, 1.0), (16, 8, 0.8), (23, 4, 1.0), (3, 1, 1.5)])
def test_topk_logprobs_vocab(rows: int, k: int, temp: float) -> None:
    rng = np.random.default_rng(rows + k)
    V = 248320
    x = (rng.standard_normal((rows, V)) * 4).astype(np.float32)
    ids, logp = sp.topk_logprobs(cupy.asarray(x), k, temp)
    ref_ids, ref_logp = ddtree.topk_logprobs(x, k, temp)
    assert cupy.asnumpy(ids).tolist() == ref_ids.tolist()
    assert np.abs(cupy.asnumpy(logp) - ref_logp).max() < 1e-4


# -- deltanet.conv_silu keeping its raw rows (rows_out): the conv of the GPU step, one launch instead of two ----


@pytest.mark.parametrize("dtype,parents", [(np.float32, None), (np.float16, [-1, 0, 0, 2, 1, 4])])
def test_conv_rows_out_equals_copy_then_conv(dtype, parents) -> None:
    from kernels import deltanet as dn

    rng = np.random.default_rng(len(parents or ()))
    T, C, K = 6, 10240, 4
    proj = cupy.asarray(rng.standard_normal((T, C + 384)).astype(dtype))  # raw = the first C columns, strided rows
    window = cupy.asarray(rng.standard_normal((K - 1, C)).astype(np.float32))
    w = cupy.asarray(rng.standard_normal((C, K)).astype(np.float32))
    par = None if parents is None else cupy.asarray(np.asarray(parents, np.int32))
    rows = cupy.full((T, C), np.nan, cupy.float32)
    fused = dn.conv_silu(proj[:, :C], window, w, parents=par, rows_out=rows)
    plain = dn.conv_silu(cupy.ascontiguousarray(proj[:, :C]), window, w, parents=par)
    assert cupy.array_equal(rows, proj[:, :C].astype(cupy.float32))
    assert cupy.array_equal(fused, plain)
    p = np.arange(-1, T - 1) if parents is None else np.asarray(parents)
    ref = layers.causal_conv(cupy.asnumpy(window).astype(np.float64), cupy.asnumpy(proj[:, :C]).astype(np.float64),
                             cupy.asnumpy(w).astype(np.float64), layers.conv_window_ids(p, K))  # fmt: skip
    assert float(np.abs(cupy.asnumpy(fused) - ref).max()) < 1e-4
