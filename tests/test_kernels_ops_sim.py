"""kernels/norm_rope.cu, attention.cu and sampling.cu run on the CPU against their NumPy twins.

No GPU is needed: tests/cuda_sim_ops.cpp compiles each source as C++ (its portable path: software fp16,
warp-shuffle mma emulation, synchronous copies) and runs every thread block with its threads as fibers
(tests/cuda_sim.h block mode), so barriers, shared memory, fragment layouts, swizzles, tree masks, split-K
merging and the two-pass reductions are all exercised. Inline-PTX leaves are left to tests/test_kernels_ops.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels import attention as attn_mod
from services.engine import kvcache, layers
from services.engine.ddtree import topk_logprobs
from services.engine.quants import legacy, tq3
from tests.quant_twins import q16_twin
from tests.tq3_check import check_tq3_bytes

ROOT = Path(__file__).resolve().parents[1]
HARNESS = Path(__file__).resolve().parent / "cuda_sim_ops.cpp"
FAMILIES = {"norm_rope": 1, "attention": 2, "sampling": 3, "quant_matmul": 4, "deltanet": 5}
OPS = ("norm_rope", "attention", "sampling")  # the `libs` fixture; 4 and 5 (fused pieces) are built on demand
P = ctypes.c_void_p
I, LL, F = ctypes.c_int, ctypes.c_longlong, ctypes.c_float

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not sys.platform.startswith("linux"),
    reason="the CPU simulation of the CUDA kernels needs g++ on Linux (ucontext fibers)",
)

SIGNATURES = {
    "sim_rms_norm": [I, I, I, P, P, P, P, P, I, I, F],
    "sim_head_norm": [I, I, I, I, P, LL, LL, I, P, P, P, LL, LL, I, P, P, I, P, P, P, I, F],
    "sim_silu_mul": [I, I, P, LL, P, LL, P, I, I, I],
    "sim_gate_mul": [I, I, I, P, P, LL, LL, P, I, I, I, I],
    "sim_kv_store": [I, I, I, P, P, P, P, P, I, I, I, LL],
    "sim_kv_move_rows": [P, P, I, I, LL, P, P, P, I],
    "sim_attn_partial": [I, I, I, I, I, I, P, P, P, P, P, I, I, I, I, LL, F, P, P, I, I],
    "sim_attn_decode": [I, I, I, I, I, P, LL, P, LL, P, P, LL, P, P, P, P, I, F, P, P, P, LL, F, P, P, P, P, P, I,
                        I, I],
    "sim_attn_combine": [I, I, I, P, P, I, I, I, I, I, P, LL, LL, P, P],
    "sim_deq_tile": [I, I, P, P, P, I, I],
    "sim_argmax": [I, P, LL, I, I, I, I, P, P, P, P, P, P, P],
    "sim_topk": [I, I, P, LL, I, I, I, I, F, P, P, P, P, P],
    "sim_topk_partial20": [P, LL, I, I, I, I, F, P, P, P],
    "sim_topk_token_final20": [I, P, P, P, I, P, P, P, LL, P, F, P],
    "sim_conv_rows": [I, P, LL, P, P, P, I, I, P, LL, P, LL, I],
}


def build_family(name: str, tmp_dir: Path):
    """Compile kernels/<name>.cu with tests/cuda_sim_ops.cpp's entries for it; the loaded library."""
    source = ROOT / "kernels" / f"{name}.cu"
    parts = (source, *sorted(source.parent.glob("*.cuh")), HARNESS,
             HARNESS.with_name("cuda_sim.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()[:16]
    lib_path = tmp_dir / f"sim_{name}_{digest}.so"
    cmd = [
        "g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w", f"-DOPS_FAMILY={FAMILIES[name]}",
        f'-DOPS_SOURCE="{source}"', f"-I{HARNESS.parent}", "-o", str(lib_path), str(HARNESS),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"g++ failed:\n{done.stderr[-4000:]}"
    lib = ctypes.CDLL(str(lib_path))
    for fn, args in SIGNATURES.items():
        if hasattr(lib, fn):
            getattr(lib, fn).restype = ctypes.c_int
            getattr(lib, fn).argtypes = args
    return lib


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cuda_sim_ops")
    return {name: build_family(name, tmp) for name in OPS}


def ptr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def encode(x: np.ndarray, code: int) -> np.ndarray:
    return [x.astype(np.float32), x.astype(np.float16), to_bf16(x)][code].copy()


def decode(y: np.ndarray, code: int) -> np.ndarray:
    return y.astype(np.float64) if code < 2 else from_bf16(y).astype(np.float64)


def empty(shape, code: int) -> np.ndarray:
    a = np.empty(shape, dtype=(np.float32, np.float16, np.uint16)[code])
    a.view(np.uint8)[:] = 0xFF  # NaN in every type: unwritten elements fail
    return a


OUT_TOL = {0: 2e-6, 1: 1e-3, 2: 8e-3}  # one rounding of the output type (relative), f32 math inside


def rel(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


# -- norm_rope.cu ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("ti,to,res", [(0, 0, 0), (0, 0, 1), (0, 1, 1), (1, 1, 0), (2, 0, 1), (0, 2, 0)])
def test_rms_norm(libs, ti: int, to: int, res: int) -> None:
    rng = np.random.default_rng(10 * ti + to + res)
    rows, n, eps = 3, 1000, 1e-6
    x = encode(rng.standard_normal((rows, n)).astype(np.float32) * 2, ti)
    r = encode(rng.standard_normal((rows, n)).astype(np.float32), ti)
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    s = empty((rows, n), ti)
    y = empty((rows, n), to)
    err = libs["norm_rope"].sim_rms_norm(ti, to, res, ptr(x), ptr(r), ptr(s), ptr(w), ptr(y), rows, n, eps)
    assert err == 0
    xs = decode(x, ti) + (decode(r, ti) if res else 0)
    ref = layers.rms_norm(xs, w.astype(np.float64), eps)
    assert rel(decode(y, to), ref) < OUT_TOL[to] + (2e-3 if ti == 1 and res else 0)
    if res:
        assert rel(decode(s, ti), xs) < OUT_TOL[ti]


def test_rms_norm_without_weight(libs) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 300)).astype(np.float32)
    y = empty((2, 300), 0)
    assert libs["norm_rope"].sim_rms_norm(0, 0, 0, ptr(x), ptr(x), ptr(x), None, ptr(y), 2, 300, 1e-5) == 0
    assert rel(y, layers.rms_norm(x.astype(np.float64), None, 1e-5)) < 2e-6


@pytest.mark.parametrize(
    "ti,to,D,n_rot", [(0, 0, 256, 64), (0, 0, 64, 64), (0, 0, 128, 0), (1, 1, 256, 64), (0, 1, 96, 32)]
)
def test_qk_norm_rope(libs, ti: int, to: int, D: int, n_rot: int) -> None:
    # q read in place from the interleaved q|gate projection [T, H, 2D]; k contiguous [T, Hkv, D]
    rng = np.random.default_rng(D + n_rot + ti)
    T, H, Hkv, eps, theta = 5, 3, 2, 1e-6, 1.0e7
    qg = encode(rng.standard_normal((T, H, 2 * D)).astype(np.float32), ti)
    k = encode(rng.standard_normal((T, Hkv, D)).astype(np.float32), ti)
    wq = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    wk = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    pos = np.array([0, 1, 7, 4095, 32771], dtype=np.int32)
    inv = attn_inv_freq(n_rot, theta)
    yq, yk = empty((T, H, D), to), empty((T, Hkv, D), to)
    item = qg.itemsize
    err = libs["norm_rope"].sim_head_norm(
        ti, to, D, 0, ptr(qg), qg.strides[0] // item, qg.strides[1] // item, H, ptr(wq), ptr(yq),
        ptr(k), k.strides[0] // item, k.strides[1] // item, Hkv, ptr(wk), ptr(yk), T, None, ptr(pos), ptr(inv),
        n_rot, eps,
    )  # fmt: skip
    assert err == 0
    q = decode(qg, ti)[..., :D].astype(np.float32)
    ref_q = layers.rope_neox(layers.rms_norm(q, wq, eps), pos, n_rot, theta) if n_rot else layers.rms_norm(q, wq, eps)
    kk = decode(k, ti).astype(np.float32)
    ref_k = layers.rope_neox(layers.rms_norm(kk, wk, eps), pos, n_rot, theta) if n_rot else layers.rms_norm(kk, wk, eps)
    tol = OUT_TOL[to] + 2e-5  # f32 math: cos/sin of angles up to ~3e4 rad
    assert rel(decode(yq, to), ref_q) < tol
    assert rel(decode(yk, to), ref_k) < tol


def attn_inv_freq(n_rot: int, theta: float) -> np.ndarray:
    from kernels.norm_rope import _inv_freq_host

    return _inv_freq_host(n_rot, theta) if n_rot else np.zeros(1, np.float32)


@pytest.mark.parametrize("ti,to,D", [(0, 0, 128), (1, 0, 64)])
def test_norm_gate(libs, ti: int, to: int, D: int) -> None:
    rng = np.random.default_rng(D)
    T, H, eps = 4, 3, 1e-6
    o = encode(rng.standard_normal((T, H, D)).astype(np.float32), ti)
    z = encode(rng.standard_normal((T, H, D)).astype(np.float32) * 2, ti)
    w = (1 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    y = empty((T, H, D), to)
    err = libs["norm_rope"].sim_head_norm(
        ti, to, D, 1, ptr(o), H * D, D, H, ptr(w), ptr(y), ptr(o), 0, 0, 0, None, ptr(y), T, ptr(z), None, None, 0, eps
    )
    assert err == 0
    ref = layers.rms_norm(decode(o, ti), w, eps) * layers.silu(decode(z, ti))
    assert rel(decode(y, to), ref) < OUT_TOL[to] + (1e-3 if ti else 0)


@pytest.mark.parametrize("code", [0, 1])
def test_silu_mul_and_gate_mul(libs, code: int) -> None:
    rng = np.random.default_rng(code)
    T, n = 3, 700
    gu = encode(rng.standard_normal((T, 2 * n)).astype(np.float32) * 3, code)  # gate | up halves of one array
    y = empty((T, n), code)
    lib = libs["norm_rope"]
    assert lib.sim_silu_mul(code, code, ptr(gu), 2 * n, ptr(gu[:, n:]), 2 * n, ptr(y), T, n, 5) == 0
    g, u = decode(gu, code)[:, :n], decode(gu, code)[:, n:]
    assert rel(decode(y, code), layers.silu(g) * u) < OUT_TOL[code]

    H, D = 4, 64
    x = encode(rng.standard_normal((T, H, D)).astype(np.float32), code)
    qg = rng.standard_normal((T, H, 2 * D)).astype(np.float32)  # gate = second half of each head, strided
    out = empty((T, H, D), code)
    assert lib.sim_gate_mul(code, 0, code, ptr(x), ptr(qg[..., D:]), H * 2 * D, 2 * D, ptr(out), T, H, D, 4) == 0
    assert rel(decode(out, code), decode(x, code) * layers.sigmoid(qg[..., D:].astype(np.float64))) < OUT_TOL[code]


# -- attention.cu ---------------------------------------------------------------------------------------

KV_NAMES = {0: "f16", 1: "q8_0", 2: "tq3_0"}


def twin_store(kind: str, raw: np.ndarray, n: int, Hkv: int, D: int) -> kvcache.KVStore:
    """services/engine/kvcache.py's store over the device's bytes [n, Hkv, row bytes]."""
    if kind == "f16":
        data = raw.reshape(-1).view(np.float16).reshape(n, Hkv, D)
    else:
        data = raw.reshape(n, Hkv, D // 32, 34 if kind == "q8_0" else 14)
    return kvcache.KVStore(kind, n, Hkv, D, _data=np.ascontiguousarray(data))


def commit_moves(path: list[int], base: int) -> tuple[np.ndarray, np.ndarray]:
    """The KV rows a commit of `path` (node indices of a step whose rows start at `base`) moves, as
    GpuSequenceState.commit lists them: from the first node off the prefix 0, 1, 2, ... on."""
    first = next((d for d, i in enumerate(path) if i != d), len(path))
    return (np.arange(base + first, base + len(path), dtype=np.int64),
            np.array([base + i for i in path[first:]], dtype=np.int64))


@pytest.mark.parametrize("threads", [32, 256])
@pytest.mark.parametrize("path", [[0, 2, 3], [0, 1, 5, 6, 9], [0, 3], list(range(0, 80, 2)), [0] + list(range(2, 65))])
def test_kv_move_rows(libs, path: list[int], threads: int) -> None:
    # rows of every kind's width (f16, Q8_0 and TQ3_0 at head_dim 64 / 256) move as the twin's gather-then-scatter
    # moves them, in every head and buffer, rows off the path untouched; past 32 entries the kernel goes in chunks
    rng = np.random.default_rng(len(path) + threads)
    Hkv, ctx, base = 3, 160, 7
    widths = [attn_mod.row_bytes(k, d) for k in ("f16", "q8_0", "tq3_0") for d in (64, 256)]
    bufs = [rng.integers(0, 256, (Hkv, ctx, rb), dtype=np.uint8) for rb in widths]
    orig = [b.copy() for b in bufs]
    want = [b.copy() for b in bufs]
    dst, src = commit_moves(path, base)
    attn_mod.kv_move_rows_twin(want, dst, src, len(dst))
    bases = np.array([b.ctypes.data for b in bufs], dtype=np.uint64)
    units = np.array([rb // 4 for rb in widths], dtype=np.int32)
    count = np.array([len(dst)], dtype=np.int32)
    lib = libs["attention"]
    assert lib.sim_kv_move_rows(ptr(bases), ptr(units), len(bufs), Hkv, ctx, ptr(dst), ptr(src), ptr(count),
                                threads) == 0
    for got, ref in zip(bufs, want):
        np.testing.assert_array_equal(got, ref)
    # a commit's compaction: row base + i holds the path's i-th node, every other row what it held
    for got, before in zip(bufs, orig):
        np.testing.assert_array_equal(got[:, base:base + len(path)], before[:, [base + i for i in path]])
        np.testing.assert_array_equal(got[:, base + len(path):], before[:, base + len(path):])
        np.testing.assert_array_equal(got[:, :base], before[:, :base])


def test_kv_move_rows_count_zero_and_in_order(libs) -> None:
    # count 0 moves nothing; an entry that moves a row a later entry reads first (path [0, 2, 3]: row 2 -> 1,
    # row 3 -> 2) must read before it is overwritten, which a naive per-entry copy in parallel would get wrong
    Hkv, ctx, rb = 2, 64, 512
    rows = np.arange(ctx, dtype=np.uint32)[None, :, None] * np.ones((Hkv, 1, rb // 4), np.uint32)
    buf = rows.view(np.uint8).reshape(Hkv, ctx, rb).copy()
    bases = np.array([buf.ctypes.data], dtype=np.uint64)
    units = np.array([rb // 4], dtype=np.int32)
    dst, src = commit_moves([0, 2, 3, 5], 10)
    lib = libs["attention"]
    zero = np.zeros(1, np.int32)
    assert lib.sim_kv_move_rows(ptr(bases), ptr(units), 1, Hkv, ctx, ptr(dst), ptr(src), ptr(zero), 64) == 0
    np.testing.assert_array_equal(buf.view(np.uint32)[..., 0], rows[..., 0])
    count = np.array([len(dst)], np.int32)
    assert lib.sim_kv_move_rows(ptr(bases), ptr(units), 1, Hkv, ctx, ptr(dst), ptr(src), ptr(count), 64) == 0
    got = buf.view(np.uint32)[..., 0]
    assert list(got[0, 10:14]) == [10, 12, 13, 15] and list(got[1, 10:14]) == [10, 12, 13, 15]
    assert list(got[0, 14:17]) == [14, 15, 16]      # rows past the path keep what they held


def run_attention(lib, kv, D: int, tq: int, T: int, G: int, Hkv: int, S: int, parents, splits: int,
                  rng, gate_f16: bool = False, ti_new: int | None = None, kw: int | None = None,
                  k_ramp: float = 0.0, window: int = 0, ds: int | None = None):  # fmt: skip
    """kv: one kind code for K and V, or a (K, V) pair. Stores S committed rows (f32 input) and T new rows
    (f16 input when ti_new is 1), checks the stored bytes, runs attention; returns (y, twin). tq: q as f32, f16
    or bf16 (0, 1, 2); kw: warps per m16 tile (None: the launcher's choice); k_ramp: key row j scaled by
    1 + k_ramp * j, so later tiles hold larger scores (the running max moves tile after tile); window > 0: new token
    t sees committed row j only from S - (window - 1) + t on (a sliding layer past its window)."""
    kk, kv = (kv, kv) if isinstance(kv, int) else kv
    H = G * Hkv
    ctx = 32 * math.ceil((S + T + 5) / 32)
    rbk, rbv = attn_mod.row_bytes(KV_NAMES[kk], D), attn_mod.row_bytes(KV_NAMES[kv], D)
    kc = np.full(Hkv * ctx * rbk, 0xFF, np.uint8)  # stale bytes (NaN halves) past the written rows
    vc = np.full(Hkv * ctx * rbv, 0xFF, np.uint8)
    k_all = rng.standard_normal((S + T, Hkv, D)).astype(np.float32)
    v_all = rng.standard_normal((S + T, Hkv, D)).astype(np.float32)
    k_all *= (1.0 + k_ramp * np.arange(S + T, dtype=np.float32))[:, None, None]
    if ti_new is None:
        ti_new = 1 if kk == kv == 0 else 0
    if ti_new:
        k_all[S:] = k_all[S:].astype(np.float16)
        v_all[S:] = v_all[S:].astype(np.float16)
    zero = np.zeros(1, np.int32)
    assert lib.sim_kv_store(kk, kv, 0, ptr(k_all[:S]), ptr(v_all[:S]), ptr(kc), ptr(vc), ptr(zero), S, Hkv, D,
                            ctx) == 0  # fmt: skip
    s_len = np.array([S], np.int32)
    k_new = k_all[S:].astype(np.float16) if ti_new else k_all[S:].copy()
    v_new = v_all[S:].astype(np.float16) if ti_new else v_all[S:].copy()
    err = lib.sim_kv_store(kk, kv, ti_new, ptr(k_new), ptr(v_new), ptr(kc), ptr(vc), ptr(s_len), T, Hkv, D, ctx)
    assert err == 0, f"simulation error (or no store instance for {kk}, {kv}, {ti_new})"

    def stored(buf, rb):
        return np.ascontiguousarray(buf.reshape(Hkv, ctx, rb)[:, : S + T].transpose(1, 0, 2))

    # stored bytes: f16 casts, exactly ggml's Q8_0 blocks, or tq3.quantize_tq3_0's blocks
    for buf, rb, kind, src in ((kc, rbk, kk, k_all), (vc, rbv, kv, v_all)):
        raw = stored(buf, rb)
        if kind == 0:
            assert np.array_equal(raw.reshape(-1).view(np.float16), src.astype(np.float16).reshape(-1))
        elif kind == 1:
            assert np.array_equal(raw, legacy.quantize_q8_0(src.reshape(-1, 32)).reshape(S + T, Hkv, rb))
        else:
            check_tq3_bytes(raw, src, tq3)

    q = rng.standard_normal((T, H, D)).astype(np.float32) * 1.5
    qx = q.astype(np.float16) if tq == 1 else to_bf16(q) if tq == 2 else q
    mask = attn_mod.tree_mask(parents)
    gx, kw = attn_mod.grid_rows(H, Hkv, T, kw)
    ds = attn_mod.dim_split(kw) if ds is None else ds
    parts = splits  # the key slices of a split are merged inside its block
    ws_o = np.full((parts, H * T, D), np.nan, np.float32)
    ws_ml = np.full((parts, H * T, 2), np.nan, np.float32)
    scale = np.float32(1.0 / math.sqrt(D) / math.log(2.0))
    err = lib.sim_attn_partial(kk, kv, D, tq, kw, ds, ptr(qx), ptr(kc), ptr(vc), ptr(s_len), ptr(mask), window, T, H,
                               Hkv, ctx, scale, ptr(ws_o), ptr(ws_ml), gx, splits)  # fmt: skip
    assert err == 0, f"simulation error (or no instance for K={kk} V={kv} D={D} tq={tq} KW={kw})"
    rg = attn_mod.tq3_group(D) if kv == 2 else 0
    # where the shapes allow, the combine also writes the output projection's int16 staging of o (every word)
    q16 = np.full(H * D // 256 * T * 160, 0xDEADBEEF, np.uint32) if D % 32 == 0 and H * D % 256 == 0 else None
    if gate_f16:
        gate = rng.standard_normal((T, H, 2 * D)).astype(np.float16)
        out = empty((T, H, D), 1)
        err = lib.sim_attn_combine(1, 1, rg, ptr(ws_o), ptr(ws_ml), parts, T, H, Hkv, D, ptr(gate[..., D:]),
                                   H * 2 * D, 2 * D, ptr(out), ptr(q16))  # fmt: skip
    else:
        out = empty((T, H, D), 0)
        err = lib.sim_attn_combine(0, 0, rg, ptr(ws_o), ptr(ws_ml), parts, T, H, Hkv, D, None, 0, 0, ptr(out),
                                   ptr(q16))  # fmt: skip
    assert err == 0
    if q16 is not None:  # bitwise the pack's staging of the output (pack_x_kernel rounds it to fp16 first)
        assert np.array_equal(q16, q16_twin(out.reshape(T, H * D).astype(np.float16)))
    seen = np.ones((T, S), bool)
    if window > 0:
        seen = np.arange(S)[None, :] >= S - (window - 1) + np.arange(T)[:, None]
    visible = np.concatenate([seen, layers.ancestor_matrix(np.asarray(parents))], axis=1)
    twin = kvcache.KVCache(twin_store(KV_NAMES[kk], stored(kc, rbk), S + T, Hkv, D),
                           twin_store(KV_NAMES[kv], stored(vc, rbv), S + T, Hkv, D))  # fmt: skip
    ref = twin.attend(decode(qx, tq).astype(np.float32), S + T, visible).astype(np.float64)
    if gate_f16:
        ref = ref * layers.sigmoid(gate[..., D:].astype(np.float64))
    return out.astype(np.float64), ref


def random_tree(T: int, rng) -> list[int]:
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, T)]


ATTN_CASES = [
    # kv, D, tq, T, G, Hkv, S, tree, splits
    (0, 64, 0, 1, 6, 2, 70, False, 2),
    (1, 64, 0, 5, 3, 2, 33, True, 1),
    (0, 64, 1, 23, 3, 1, 100, True, 3),  # 5 m-tiles: a second block with 3 idle warps
    (0, 128, 0, 3, 2, 2, 0, False, 2),  # no committed context; the second split has no tile
    (1, 128, 0, 16, 4, 1, 50, True, 2),
    (0, 64, 0, 64, 1, 1, 10, True, 2),  # 64 tokens: the mask's top bit
    (0, 256, 0, 2, 6, 1, 40, False, 1),
    (0, 64, 0, 5, 6, 1, 45, True, 2),  # 2 m-tiles: two warps per tile (KW = 2)
    (1, 256, 0, 6, 6, 1, 20, True, 1),  # Qwen3.6 group size, 3 m-tiles in one block (one idle warp)
]


@pytest.mark.parametrize("kv,D,tq,T,G,Hkv,S,tree,splits", ATTN_CASES)
def test_attention(libs, kv, D, tq, T, G, Hkv, S, tree, splits) -> None:
    rng = np.random.default_rng(T * 1000 + S + D + kv)
    parents = random_tree(T, rng) if tree else list(range(-1, T - 1))
    y, ref = run_attention(libs["attention"], kv, D, tq, T, G, Hkv, S, parents, splits, rng)
    assert np.isfinite(y).all()
    assert rel(y, ref) < 3e-3  # fp16 q (pre-scaled) and softmax weights; K/V exact in their stored form


WINDOW_CASES = [
    # kv, D, tq, T, G, Hkv, S, tree, splits, window
    (0, 64, 1, 23, 3, 1, 100, False, 3, 30),  # the first visible key mid-tile; a split of hidden tiles only
    (1, 128, 0, 16, 4, 1, 150, False, 2, 40),  # the drafter's 16-token block, q8_0 K / V
    (0, 64, 0, 1, 6, 2, 70, False, 2, 10),  # one token: the last 9 committed rows
    (0, 64, 0, 5, 6, 1, 45, True, 2, 100),  # a window wider than the context: every committed row
]


@pytest.mark.parametrize("kv,D,tq,T,G,Hkv,S,tree,splits,window", WINDOW_CASES)
def test_attention_window(libs, kv, D, tq, T, G, Hkv, S, tree, splits, window) -> None:
    """A sliding layer past its window (the DFlash drafter's): token t sees committed rows from S - (W-1) + t on."""
    rng = np.random.default_rng(S + window)
    parents = random_tree(T, rng) if tree else list(range(-1, T - 1))
    y, ref = run_attention(libs["attention"], kv, D, tq, T, G, Hkv, S, parents, splits, rng, window=window)
    assert np.isfinite(y).all()
    assert rel(y, ref) < 3e-3


TQ3_CASES = [
    # (K, V), D, tq, T, G, Hkv, S, tree, splits, ti_new
    ((2, 2), 64, 0, 1, 6, 2, 45, False, 2, 0),  # decode, 64-value groups, KW = 4
    ((2, 2), 128, 0, 23, 3, 1, 40, True, 2, 1),  # tree of 23, KW = 1 (5 m-tiles), f16 input rows
    ((2, 2), 256, 0, 16, 2, 1, 20, True, 1, 0),  # 2 m-tiles: KW = 2
    ((1, 2), 256, 1, 1, 6, 1, 70, False, 3, 0),  # the 6:1 default: K q8_0 + V tq3_0, decode
    ((1, 2), 256, 1, 41, 1, 1, 30, True, 2, 0),  # K q8_0 + V tq3_0, a 41-token tree
    ((2, 0), 64, 1, 23, 1, 2, 33, True, 2, 0),  # K tq3_0 + V f16
    ((0, 2), 128, 0, 5, 6, 1, 35, True, 1, 1),  # K f16 + V tq3_0
]


@pytest.mark.parametrize("kinds,D,tq,T,G,Hkv,S,tree,splits,ti_new", TQ3_CASES)
def test_attention_tq3_0(libs, kinds, D, tq, T, G, Hkv, S, tree, splits, ti_new) -> None:
    rng = np.random.default_rng(T * 100 + S + D + 7 * kinds[0] + kinds[1])
    parents = random_tree(T, rng) if tree else list(range(-1, T - 1))
    y, ref = run_attention(libs["attention"], kinds, D, tq, T, G, Hkv, S, parents, splits, rng, ti_new=ti_new)
    assert np.isfinite(y).all()
    assert rel(y, ref) < 3e-3  # the twin reads the same TQ3_0 bytes: fp16 q / weights / dequantized K, V


@pytest.mark.parametrize("D,splits", [(64, 1), (64, 150), (128, 37), (128, 64), (256, 3), (256, 99), (256, 130)])
def test_attn_combine_many_splits(libs, D: int, splits: int) -> None:
    """The combine's O sum over hundreds of splits (a decode token's long-context launch), in the kernel's rounds of
    several loads a slice and its remainder: the merged softmax of the splits' (m, l, O); a split without keys (l = 0)
    holds garbage O that must not leak in."""
    rng = np.random.default_rng(D + splits)
    T, H, Hkv = 2, 4, 2
    rows = H * T
    ws_o = rng.standard_normal((splits, rows, D)).astype(np.float32)
    ws_ml = np.stack([rng.uniform(-6.0, 6.0, (splits, rows)), rng.uniform(0.5, 40.0, (splits, rows))], -1)
    ws_ml = ws_ml.astype(np.float32)
    empty_split = rng.random((splits, rows)) < 0.2
    empty_split[0] = False  # every row keeps one split with keys
    ws_ml[..., 1][empty_split] = 0.0
    ws_o[empty_split] = np.nan
    out = empty((T, H, D), 0)
    assert libs["attention"].sim_attn_combine(0, 0, 0, ptr(ws_o), ptr(ws_ml), splits, T, H, Hkv, D, None, 0, 0,
                                              ptr(out), None) == 0  # fmt: skip
    m, ln = ws_ml[..., 0].astype(np.float64), ws_ml[..., 1].astype(np.float64)
    w = np.where(ln > 0, np.exp2(m - np.where(ln > 0, m, -np.inf).max(0)), 0.0)
    o = np.where(empty_split[..., None], 0.0, ws_o.astype(np.float64))
    ref = (w[..., None] * o).sum(0) / (w * ln).sum(0)[:, None]  # kernel row order: (kvh, t, head in group)
    G = H // Hkv
    ref = ref.reshape(Hkv, T, G, D).transpose(1, 0, 2, 3).reshape(T, H, D)
    assert np.isfinite(out).all()
    assert rel(out.astype(np.float64), ref) < 1e-5


DECODE_CASES = [
    # K, V, D, ti (q/k/v type), G, Hkv, S, blocks a query head
    (1, 2, 256, 0, 6, 2, 70, 3),  # the 27B's shape and default KV: 2 splits of 2 / 1 tiles, the third block exits
    (1, 2, 256, 0, 6, 1, 0, 2),  # no committed rows: only row S (block 0), block 1 empty
    (0, 0, 128, 0, 2, 2, 100, 1),  # one block: no workspace, four tiles (the double buffer refilled)
    (0, 0, 128, 0, 2, 1, 40, 3),  # two tiles: one split takes them (blocks 1, 2 exit), no workspace
    (2, 2, 64, 1, 4, 2, 200, 4),  # f16 projection, TQ3_0 K (rotated q) and V, 64-value groups, 4 splits of 2 / 1 tiles
    (2, 0, 128, 0, 3, 1, 33, 2),  # TQ3_0 K, f16 V
    (0, 1, 256, 1, 1, 3, 64, 2),  # Q8_0 V, one query head a KV head, S on a tile boundary
]


@pytest.mark.parametrize("kk,kv,D,ti,G,Hkv,S,ns", DECODE_CASES)
def test_attn_decode_is_the_chain_of_norm_store_and_attention(libs, kk, kv, D, ti, G, Hkv, S, ns) -> None:
    """attn_decode_kernel (one token's q/k norm + RoPE, KV store and attention in one launch) against the twins:
    the new k / v rows stored as KVCacheLayer.store stores the head-normed rows (f16, Q8_0 bit for bit; TQ3_0 as
    check_tq3_bytes allows), o against kvcache.KVCache.attend over the stored rows times sigmoid(gate), o's int16
    staging bit for bit the pack's, the same bits whichever block combines, and the arrival counters back at 0."""
    lib, nr_lib = libs["attention"], libs["norm_rope"]
    rng = np.random.default_rng(S * 7 + D + 31 * kk + kv + G)
    H, eps, theta, n_rot = G * Hkv, 1e-6, 10000.0, D // 4
    ctx = 32 * math.ceil((S + 6) / 32)
    names = [KV_NAMES[kk], KV_NAMES[kv]]
    rbk, rbv = attn_mod.row_bytes(names[0], D), attn_mod.row_bytes(names[1], D)
    kc0 = np.full(Hkv * ctx * rbk, 0xFF, np.uint8)
    vc0 = np.full(Hkv * ctx * rbv, 0xFF, np.uint8)
    if S:
        k_old = rng.standard_normal((S, Hkv, D)).astype(np.float32)
        v_old = rng.standard_normal((S, Hkv, D)).astype(np.float32)
        assert lib.sim_kv_store(kk, kv, 0, ptr(k_old), ptr(v_old), ptr(kc0), ptr(vc0), ptr(np.zeros(1, np.int32)), S,
                                Hkv, D, ctx) == 0  # fmt: skip
    # the attention layer's projection row: q|gate per head, then k, then v (ti's type)
    row = rng.standard_normal((2 * H + 2 * Hkv) * D).astype(np.float32) * 1.3
    row = encode(row, ti)
    item = row.itemsize
    base = row.ctypes.data
    q_w = (1.0 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    k_w = (1.0 + 0.2 * rng.standard_normal(D)).astype(np.float32)
    pos = np.array([S + 3], np.int32)
    inv_freq = attn_mod.norm_rope._inv_freq_host(n_rot, theta)
    s_len = np.array([S], np.int32)
    scale = np.float32(1.0 / math.sqrt(D) / math.log(2.0))
    results = []
    for order in (0, 1, 2):
        kc, vc = kc0.copy(), vc0.copy()
        ws_o = np.full((ns, H, D), np.nan, np.float32)
        ws_ml = np.full((ns, H, 2), np.nan, np.float32)
        counters = np.zeros(H, np.uint32)
        out = empty((1, H, D), 0)
        q16 = np.full(H * D // 256 * 160, 0xDEADBEEF, np.uint32) if H * D % 256 == 0 else None
        err = lib.sim_attn_decode(kk, kv, D, ti, G, base, 2 * D, base + D * item, 2 * D, base + 2 * H * D * item,
                                  base + (2 * H + Hkv) * D * item, D, ptr(q_w), ptr(k_w), ptr(pos), ptr(inv_freq),
                                  n_rot, eps, ptr(kc), ptr(vc), ptr(s_len), ctx, scale, ptr(ws_o), ptr(ws_ml),
                                  ptr(counters), ptr(out), ptr(q16), ns, Hkv, order)  # fmt: skip
        assert err == 0, f"simulation error (or no instance for {kk}, {kv}, {D}, {ti}, {G})"
        assert (counters == 0).all()  # self-resetting: the next launch (a graph replay) starts from 0
        results.append((out.copy(), kc, vc, q16))
    for out, kc, vc, q16 in results[1:]:  # whichever block arrives last, the same bits
        assert np.array_equal(out, results[0][0]) and np.array_equal(kc, results[0][1])
        assert np.array_equal(vc, results[0][2])
        assert q16 is None or np.array_equal(q16, results[0][3])
    out, kc, vc, q16 = results[0]
    assert np.isfinite(out).all()
    kc3, vc3 = kc.reshape(Hkv, ctx, rbk), vc.reshape(Hkv, ctx, rbv)
    assert np.array_equal(kc3[:, :S], kc0.reshape(Hkv, ctx, rbk)[:, :S])   # committed rows untouched
    assert np.array_equal(vc3[:, :S], vc0.reshape(Hkv, ctx, rbv)[:, :S])
    assert (kc3[:, S + 1:] == 0xFF).all() and (vc3[:, S + 1:] == 0xFF).all()  # nothing past row S

    vals = decode(row, ti).astype(np.float32)
    qg = vals[: 2 * H * D].reshape(1, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    k = vals[2 * H * D:(2 * H + Hkv) * D].reshape(1, Hkv, D)
    v = vals[(2 * H + Hkv) * D:].reshape(1, Hkv, D)
    if ti == 0:  # head_norm_kernel's rows, then store(): the same stored bytes (TQ3_0 up to its sums' order)
        qn, kn = empty((1, H, D), 0), empty((1, Hkv, D), 0)
        assert nr_lib.sim_head_norm(0, 0, D, 0, ptr(np.ascontiguousarray(q)), 0, D, H, ptr(q_w), ptr(qn),
                                    ptr(k), 0, D, Hkv, ptr(k_w), ptr(kn), 1, None, ptr(pos), ptr(inv_freq), n_rot,
                                    eps) == 0  # fmt: skip
        kc_w, vc_w = kc0.copy(), vc0.copy()
        assert lib.sim_kv_store(kk, kv, 0, ptr(kn), ptr(np.ascontiguousarray(v)), ptr(kc_w), ptr(vc_w), ptr(s_len),
                                1, Hkv, D, ctx) == 0  # fmt: skip
        for kind, got, want in ((kk, kc3, kc_w.reshape(Hkv, ctx, rbk)), (kv, vc3, vc_w.reshape(Hkv, ctx, rbv))):
            if kind < 2:
                assert np.array_equal(got[:, S], want[:, S])
        q_ref = qn
    else:
        q_ref = layers.rope_neox(layers.rms_norm(q, q_w, eps), pos, n_rot, theta).astype(np.float32)
        kn = layers.rope_neox(layers.rms_norm(k, k_w, eps), pos, n_rot, theta).astype(np.float32)
    for kind, got, src in ((kk, kc3, kn), (kv, vc3, v)):
        if kind == 2:
            check_tq3_bytes(np.ascontiguousarray(got[:, S:S + 1].transpose(1, 0, 2)), np.asarray(src, np.float32), tq3)
    twin = kvcache.KVCache(twin_store(names[0], np.ascontiguousarray(kc3[:, :S + 1].transpose(1, 0, 2)), S + 1, Hkv, D),
                           twin_store(names[1], np.ascontiguousarray(vc3[:, :S + 1].transpose(1, 0, 2)), S + 1, Hkv, D))
    ref = twin.attend(np.asarray(q_ref, np.float32), S + 1, np.ones((1, S + 1), bool)).astype(np.float64)
    ref = ref * layers.sigmoid(gate.astype(np.float64))
    assert rel(out.astype(np.float64), ref) < 1e-4  # f32 throughout; K and V exact in their stored form
    if q16 is not None:
        assert np.array_equal(q16, q16_twin(out.reshape(1, H * D).astype(np.float16)))


WIDTH_KINDS = [(0, 0), (1, 1), (2, 2), (1, 2)]
# T, S (around the 32-key tile boundaries: the tile holding S is the first to need the tree mask), splits
WIDTHS = [(1, 31, 2), (16, 32, 3), (23, 33, 2), (41, 63, 2), (64, 64, 3)]


@pytest.mark.parametrize("kinds", WIDTH_KINDS)
@pytest.mark.parametrize("T,S,splits", WIDTHS)
def test_attention_verify_widths(libs, kinds, T: int, S: int, splits: int) -> None:
    # every KV kind at the verify widths; G = 1 keeps the simulation short (KW 4, 4, 2, 1, 1 by the m16 tiles)
    rng = np.random.default_rng(1000 * T + S + 10 * kinds[0] + kinds[1])
    parents = random_tree(T, rng)
    y, ref = run_attention(libs["attention"], kinds, 64, 0, T, 1, 1, S, parents, splits, rng)
    assert np.isfinite(y).all()
    assert rel(y, ref) < 3e-3


@pytest.mark.parametrize("kinds,kw", [((0, 0), 2), ((0, 0), 4), ((1, 2), 2), ((0, 0), 1)])
def test_attention_block_shapes(libs, kinds, kw: int) -> None:
    # the launcher's kw override: 23 tokens x 6 heads (9 m16 tiles) in blocks of 1, 2 or 4 m16 tiles
    rng = np.random.default_rng(50 + kw + kinds[1])
    y, ref = run_attention(libs["attention"], kinds, 64, 1, 23, 6, 1, 40, random_tree(23, rng), 2, rng, kw=kw)
    assert rel(y, ref) < 3e-3


WARP_SPLIT_CASES = [
    # (K, V), D, tq, T, G, Hkv, S, kw: one token (KW 4) and a few (KW 2), every kind, TQ3_0 V's groups (64 / 128
    # values) against a warp's dims (16 .. 128), the 27B's head, S past a few tiles and inside the first
    ((1, 2), 256, 1, 1, 6, 1, 70, 4),
    ((0, 0), 256, 0, 2, 6, 1, 40, 4),
    ((1, 2), 256, 1, 4, 6, 1, 40, 2),
    ((2, 2), 64, 0, 1, 4, 2, 90, 4),
    ((2, 2), 128, 0, 3, 4, 1, 20, 4),
    ((0, 2), 128, 0, 5, 3, 1, 45, 2),
    ((1, 1), 64, 0, 2, 3, 2, 33, 2),
]


@pytest.mark.parametrize("ds", [0, 1])
@pytest.mark.parametrize("kinds,D,tq,T,G,Hkv,S,kw", WARP_SPLIT_CASES)
def test_attention_warp_splits(libs, kinds, D, tq, T, G, Hkv, S, kw, ds: int) -> None:
    """A query tile's KW warps on their own keys of each tile (ds 0: slices merged at the block's end) or on their
    own output dims of every key (ds 1): both the twin's attention, with the growing-score tiles that rescale O."""
    rng = np.random.default_rng(D + S + 10 * T + ds)
    y, ref = run_attention(libs["attention"], kinds, D, tq, T, G, Hkv, S, list(range(-1, T - 1)), 2, rng, kw=kw,
                           k_ramp=0.02, ds=ds)  # fmt: skip
    assert np.isfinite(y).all()
    assert rel(y, ref) < 3e-3


@pytest.mark.parametrize("kinds,D,tq,ramp", [((0, 0), 128, 0, 0.15), ((1, 2), 128, 1, 0.03), ((2, 2), 64, 2, 0.05)])
def test_attention_growing_scores(libs, kinds, D: int, tq: int, ramp: float) -> None:
    # keys scaled up along the context: the running max rises by more than 8 (log2) on some tiles (O rescaled)
    # and by less on others (kept, weights up to 2^8); q as f32, f16 or bf16
    rng = np.random.default_rng(77 + D + tq)
    y, ref = run_attention(libs["attention"], kinds, D, tq, 5, 2, 1, 150, [-1, 0, 1, 1, 3], 2, rng, k_ramp=ramp)
    assert np.isfinite(y).all()
    assert rel(y, ref) < 3e-3


def test_attention_tq3_0_with_output_gate(libs) -> None:
    rng = np.random.default_rng(300)  # the gate multiplies after the inverse rotation
    y, ref = run_attention(libs["attention"], 2, 128, 0, 4, 2, 1, 21, [-1, 0, 1, 1], 1, rng, gate_f16=True)
    assert rel(y, ref) < 3e-3


def test_tq3_host_decode_matches_twin() -> None:
    rng = np.random.default_rng(5)
    for D in (64, 128, 256):
        x = rng.standard_normal((3, 2, D)).astype(np.float32)
        blocks = tq3.quantize_tq3_0(x)
        raw = blocks.reshape(3, 2, -1)
        assert np.array_equal(attn_mod.tq3_decode(raw, D, rotated=True), tq3.dequantize_tq3_0(blocks, rotated=True))
        assert np.allclose(attn_mod.tq3_decode(raw, D), tq3.dequantize_tq3_0(blocks), atol=1e-6)
    assert attn_mod.row_bytes("tq3_0", 256) == tq3.row_bytes(256) == 112


@pytest.mark.parametrize("kind", [1, 2])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("valid", [32, 19])
def test_deq_tile_bits(libs, kind: int, D: int, valid: int) -> None:
    """The partial kernel's tile decode, bit for bit: every Q8_0 value fp16(d q) (rows past n zeros) and every TQ3_0
    value its bare centroid in fp16 with the group norms beside (0 past n), in the swizzled [key][dim] layout; random
    bytes, so every low-bit and sign pattern of a pair and both block alignments (blocks start mid-word every other
    one) occur."""
    rng = np.random.default_rng(1000 * kind + D + valid)
    KT, nb = 32, D // 32
    if kind == 1:
        d = (rng.standard_normal((KT, nb)) * 0.02).astype(np.float16)
        q = rng.integers(-128, 128, size=(KT, nb, 32)).astype(np.int8)
        blocks = np.concatenate([d.view(np.uint8).reshape(KT, nb, 2), q.view(np.uint8)], axis=2)
        want = (d.astype(np.float32)[..., None] * q.astype(np.float32)).astype(np.float16).reshape(KT, D)
        want[valid:] = 0
    else:
        blocks = rng.integers(0, 256, size=(KT, nb, tq3.BLOCK_BYTES), dtype=np.uint8)
        norms = (rng.random((KT, nb)) + 0.5).astype(np.float16)
        blocks[..., :2] = norms.view(np.uint8).reshape(KT, nb, 2)
        bare = blocks.copy()
        bare[..., :2] = np.array([1.0], np.float16).view(np.uint8)  # norm 1: the bare centroids
        want = tq3.dequantize_tq3_0(bare, rotated=True).astype(np.float16).reshape(KT, D)
    raw = np.zeros(KT * nb * blocks.shape[-1] + 16, np.uint8)
    raw[:blocks.size] = blocks.reshape(-1)
    out = np.full(KT * D, 0xFFFF, np.uint16)
    gr = attn_mod.tq3_group(D)
    nrm = np.full(KT * (D // gr), np.nan, np.float32)
    key0 = 64
    assert libs["attention"].sim_deq_tile(kind, D, ptr(raw), ptr(out), ptr(nrm), key0, key0 + valid) == 0
    keys, dims = np.meshgrid(np.arange(KT), np.arange(D), indexing="ij")
    swz = keys * D + (((dims >> 3) ^ (keys & 7)) << 3) + (dims & 7)
    assert np.array_equal(out[swz], want.view(np.uint16))
    if kind == 2:
        nw = norms.astype(np.float32)[:, :: gr // 32].copy()
        nw[valid:] = 0
        assert np.array_equal(nrm.reshape(KT, D // gr), nw)


def test_attention_q8_0_head_dim_256_with_output_gate(libs) -> None:
    rng = np.random.default_rng(256)
    y, ref = run_attention(libs["attention"], 1, 256, 1, 4, 6, 1, 30, [-1, 0, 0, 1], 2, rng, gate_f16=True)
    assert rel(y, ref) < 3e-3


def test_tree_mask() -> None:
    m = attn_mod.tree_mask([-1, 0, 0, 2])
    assert m.tolist() == [0b1, 0b11, 0b101, 0b1101]
    chain = attn_mod.tree_mask(list(range(-1, 63)))
    assert int(chain[63]) == 2**64 - 1
    with pytest.raises(ValueError, match="topologically"):
        attn_mod.tree_mask([-1, 1])
    with pytest.raises(ValueError, match="1..64"):
        attn_mod.tree_mask(list(range(-1, 64)))


# -- sampling.cu ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 1])
def test_argmax(libs, code: int) -> None:
    rng = np.random.default_rng(code)
    rows, n, chunks = 3, 5000, 4
    chunk = math.ceil(n / chunks)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[0, [4000, 1300]] = 9.0  # a tie across chunks: the lower id wins
    x[1, :] = -3.0  # all equal: id 0
    x[2, n - 1] = 50.0  # the very last element
    xs = encode(x, code)
    part = np.zeros((rows, chunks), np.uint64)
    idx = np.full(rows, -5, np.int32)
    val = np.full(rows, np.nan, np.float32)
    err = libs["sampling"].sim_argmax(code, ptr(xs), n, rows, n, chunks, chunk, ptr(part), ptr(idx), ptr(val),
                                      None, None, None, None)  # fmt: skip
    assert err == 0
    ref = np.argmax(decode(xs, code), axis=-1)
    assert idx.tolist() == ref.tolist() == [1300, 0, n - 1]
    assert np.array_equal(val, decode(xs, code).max(axis=-1).astype(np.float32))


@pytest.mark.parametrize("with_swap", [True, False])
def test_argmax_feeds_the_next_decode_step(libs, with_swap: bool) -> None:
    """argmax(feed=): the last row's argmax becomes the next step's token, S and its position advance by one and the
    DeltaNet half flips (kernels.sampling.advance_twin); nothing else of the step values moves."""
    from kernels.sampling import advance_twin

    rng = np.random.default_rng(9)
    rows, n, chunks = 1, 3000, 3
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[0, 2222] = 7.0
    part = np.zeros((rows, chunks), np.uint64)
    idx, val = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
    vals = {k: np.array([v, -9], np.int32) for k, v in (("tok", 5), ("pos", 40), ("s", 40), ("swap", 1))}
    want = {k: v.copy() for k, v in vals.items()}
    advance_twin(np.argmax(x, axis=-1), want["tok"], want["pos"], want["s"], want["swap"] if with_swap else None)
    err = libs["sampling"].sim_argmax(0, ptr(x), n, rows, n, chunks, -(-n // chunks), ptr(part), ptr(idx), ptr(val),
                                      ptr(vals["tok"]), ptr(vals["pos"]), ptr(vals["s"]),
                                      ptr(vals["swap"]) if with_swap else None)  # fmt: skip
    assert err == 0 and idx[0] == 2222
    assert {k: v.tolist() for k, v in vals.items()} == {k: v.tolist() for k, v in want.items()}
    assert want["tok"].tolist() == [2222, -9] and want["s"].tolist() == want["pos"].tolist() == [41, -9]
    assert want["swap"].tolist() == ([0, -9] if with_swap else [1, -9])


@pytest.mark.parametrize("code,k,temp", [(0, 1, 1.0), (0, 3, 0.7), (0, 8, 1.0), (1, 4, 1.3)])
def test_topk_logprobs(libs, code: int, k: int, temp: float) -> None:
    rng = np.random.default_rng(k)
    rows, n, chunks = 2, 3000, 3
    chunk = math.ceil(n / chunks)
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    x[0, [2500, 10, 1200]] = 12.0  # ties in the top group, across chunks
    x[1, 2999] = 15.0
    xs = encode(x, code)
    ms = np.full((rows, chunks, 2), np.nan, np.float32)
    pv = np.full((rows, chunks, k), np.nan, np.float32)
    pi = np.full((rows, chunks, k), -7, np.int32)
    logp = np.full((rows, k), np.nan, np.float32)
    ids = np.full((rows, k), -7, np.int32)
    err = libs["sampling"].sim_topk(code, k, ptr(xs), n, rows, n, chunks, chunk, np.float32(1.0 / temp), ptr(ms),
                                    ptr(pv), ptr(pi), ptr(logp), ptr(ids))  # fmt: skip
    assert err == 0
    ref_ids, ref_logp = topk_logprobs(decode(xs, code), k, temp)
    # ids: best first, lowest id among equal values, also across the k-th place (the twin's argpartition
    # picks an arbitrary member of a tie there, so the full stable order is the reference for ids)
    full = np.stack([np.lexsort((np.arange(n), -decode(xs, code)[r]))[:k] for r in range(rows)])
    assert ids.tolist() == full.tolist()
    assert np.abs(logp - ref_logp).max() < 1e-4


def test_token_logprobs(libs) -> None:
    """token_logprobs' kernels (a generated token's OpenAI logprobs) against logprobs.logprobs_of_row."""
    from services.engine.logprobs import logprobs_of_row

    rng = np.random.default_rng(3)
    rows, n, chunks, k = 3, 5000, 4, 20
    chunk = math.ceil(n / chunks)
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    x[0, [4000, 7, 2100]] = 11.0                 # ties among the best, across chunks
    x[1, rng.choice(n, 30, replace=False)] = 9.0  # a tie across the 20th place
    tok = np.array([7, 4999, 0], np.int32)
    ms = np.full((rows, chunks, 2), np.nan, np.float32)
    pv = np.full((rows, chunks, k), np.nan, np.float32)
    pi = np.full((rows, chunks, k), -7, np.int32)
    logp = np.full((rows, k), np.nan, np.float32)
    ids = np.full((rows, k), -7, np.int32)
    out = np.full(rows, np.nan, np.float32)
    lib = libs["sampling"]
    assert lib.sim_topk_partial20(ptr(x), n, rows, n, chunks, chunk, 1.0, ptr(ms), ptr(pv), ptr(pi)) == 0
    assert lib.sim_topk_token_final20(rows, ptr(ms), ptr(pv), ptr(pi), chunks, ptr(logp), ptr(ids), ptr(x), n,
                                      ptr(tok), 1.0, ptr(out)) == 0
    for r in range(rows):
        want = logprobs_of_row(x[r], int(tok[r]), k)
        assert abs(out[r] - want.logprob) < 1e-4
        assert ids[r].tolist() == [i for i, _ in want.top]
        assert np.abs(logp[r] - [v for _, v in want.top]).max() < 1e-4


# -- deltanet.cu: the conv that keeps its raw rows ------------------------------------------------------------


@pytest.fixture(scope="module")
def dn_lib(tmp_path_factory):
    return build_family("deltanet", tmp_path_factory.mktemp("cuda_sim_dn"))


@pytest.mark.parametrize("f16,parents", [(0, None), (1, [-1, 0, 0, 2, 1])])
def test_conv_rows_writes_the_raw_rows(dn_lib, f16: int, parents) -> None:
    lib = dn_lib
    rng = np.random.default_rng(5 + f16)
    T, C, K = 5, 200, 4
    proj = rng.standard_normal((T, C + 56)).astype(np.float16 if f16 else np.float32)  # raw: first C columns
    window = rng.standard_normal((K - 1, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    par = np.arange(-1, T - 1, dtype=np.int32) if parents is None else np.asarray(parents, np.int32)
    out = empty((T, C), 0)
    rows = empty((T, C), 0)
    err = lib.sim_conv_rows(f16, ptr(proj), C + 56, ptr(window), ptr(w), None if parents is None else ptr(par), T, C,
                            ptr(out), C, ptr(rows), C, f16)  # fmt: skip (early with f16: both orders run)
    assert err == 0
    assert np.array_equal(rows, proj[:, :C].astype(np.float32))  # exactly the rows, as float32
    raw = proj[:, :C].astype(np.float64)
    ref = layers.causal_conv(window.astype(np.float64), raw, w.astype(np.float64), layers.conv_window_ids(par, K))
    assert rel(out, ref) < 1e-5


def test_which_head_shapes_stage_the_output() -> None:
    """attention(q16=)'s rule (the model asks it before giving the combine a staging buffer): whole warps per head
    and whole 256-value chunks of the heads together."""
    assert attn_mod.stages_output(24, 256)        # the 27B's gated attention
    assert attn_mod.stages_output(4, 128) and attn_mod.stages_output(8, 32)
    assert not attn_mod.stages_output(2, 64)      # 128 values: half a chunk
    assert not attn_mod.stages_output(16, 48)     # a head is not whole warps


def test_attention_default_warps_a_tile() -> None:
    """attention()'s warps per m16 tile when none is given (default_kw): 4 for one tile (decode), 2 for two, 2 for 5..12
    tiles over at most SHORT_KW_ROWS cache rows (the engine's graph buckets up to 2048; 4096 with f16 K and V), else 1.
    No GPU: the rule."""
    from kernels import attention as at

    H, Hkv = 24, 4  # 6 query heads a KV head: ceil(6 T / 16) tiles
    assert [at.default_kw(H, Hkv, T, 512) for T in (1, 2, 3, 5, 6, 10, 11, 23, 32, 33, 41, 64)] == [
        4, 4, 2, 2, 1, 1, 2, 2, 2, 1, 1, 1]
    assert at.default_kw(H, Hkv, 23, 2048) == 2 and at.default_kw(H, Hkv, 23, 2049) == 1
    assert at.default_kw(H, Hkv, 16, 4096) == at.grid_rows(H, Hkv, 16)[1] == 1
    # f16 K and V: 2 up to SHORT_KW_ROWS_F16 rows
    assert at.default_kw(H, Hkv, 23, 4096, f16=True) == 2 and at.default_kw(H, Hkv, 23, 4097, f16=True) == 1
    assert at.default_kw(H, Hkv, 3, 1 << 20) == 2   # two tiles: grid_rows's 2 at any context


def test_staging_buffer_checks_are_shared_by_both_attention_launchers() -> None:
    """attention(q16=) and decode_attention(q16=) refuse the same way (kernels.attention._check_q16, host only): a
    head shape or output type that cannot write o's staging, a buffer of the wrong size."""
    attn_mod._check_q16(np.zeros(24 * 160, np.uint32), 24, 256, 1, np.float32)
    attn_mod._check_q16(np.zeros(24 * 3 * 160, np.uint32), 24, 256, 3, np.float16)
    with pytest.raises(ValueError, match="H D of 256"):
        attn_mod._check_q16(np.zeros(160, np.uint32), 2, 64, 1, np.float32)
    with pytest.raises(ValueError, match="f32 / f16 output"):
        attn_mod._check_q16(np.zeros(24 * 160, np.uint32), 24, 256, 1, np.uint16)
    with pytest.raises(ValueError, match="3840 words"):
        attn_mod._check_q16(np.zeros(100, np.uint32), 24, 256, 1, np.float32)
