"""kernels/quant_matmul.cu run on the CPU: its portable path compiled as C++ by g++ (tests/cuda_sim.cpp).

No GPU is needed. The simulation runs the real kernel source (layouts, x re-layout, fragment indexing,
K-quant scale unpacking, tail chunks, split-K, row clamping, output masking) with the 32 lanes of each warp
in lockstep; only the inline-PTX leaf instructions are left to tests/test_kernels_quant_matmul.py on a GPU.
Both kernels: v1 (qmm_kernel, GGUF rows) and v2 (qmv_kernel, kernels.quant_matmul.device_layout, warps of a
block splitting K and meeting in shared memory, several copy stages).
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels import quant_matmul as qm
from services.engine import quants
from tests.quant_twins import q16_twin

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "kernels" / "quant_matmul.cu"
HARNESS = Path(__file__).resolve().parent / "cuda_sim.cpp"

F16, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, Q4_0, IQ4_NL = 1, 8, 11, 12, 13, 14, 23, 2, 20
BLOCK = {F16: (1, 2), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), IQ4_XS: (256, 136),
         Q3_K: (256, 110), Q4_0: (32, 18), IQ4_NL: (32, 18)}
FP16_FIELDS = {Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,), IQ4_XS: (0,), Q3_K: (108,), Q4_0: (0,),
               IQ4_NL: (0,)}
ROWS_PER_BLOCK = 128
PAD = 1024
TOL = 2e-3

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not sys.platform.startswith("linux"),
    reason="the CPU simulation of the CUDA kernels needs g++ on Linux (ucontext fibers)",
)


@pytest.fixture(scope="session")
def sim(tmp_path_factory):
    parts = (SOURCE, *sorted(SOURCE.parent.glob("*.cuh")), HARNESS, HARNESS.with_suffix(".h"),
             HARNESS.with_name("cuda_sim_pack.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()[:16]
    lib_path = tmp_path_factory.mktemp("cuda_sim") / f"cuda_sim_{digest}.so"
    cmd = [
        "g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w",
        f'-DQMM_SOURCE="{SOURCE}"', "-o", str(lib_path), str(HARNESS),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"g++ failed:\n{done.stderr[-4000:]}"
    lib = ctypes.CDLL(str(lib_path))
    lib.sim_qmm.restype = ctypes.c_int
    lib.sim_qmm.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
    ]  # fmt: skip
    lib.sim_qmv.restype = ctypes.c_int
    lib.sim_qmv.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong,
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.sim_pack.restype = None
    lib.sim_pack.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
    ]  # fmt: skip
    return lib


def aligned_zeros(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off : off + nbytes]


def random_weights(qtype: int, n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    per, size = BLOCK[qtype]
    n_blocks = n_out * k // per
    if qtype == F16:
        raw = (rng.standard_normal(n_out * k) * 0.5).astype(np.float16).view(np.uint8).reshape(n_blocks, size)
    else:
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        for start in FP16_FIELDS[qtype]:
            raw[:, start : start + 2] = (
                (rng.standard_normal(n_blocks) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
            )
    return raw.reshape(n_out, -1)


def run_sim(lib, qtype: int, raw: np.ndarray, n_out: int, k: int, x: np.ndarray, splits: int) -> tuple[np.ndarray, int]:
    tokens = x.shape[0]
    n_tiles = (tokens + 7) // 8
    tpad = 8 * n_tiles
    w = aligned_zeros(raw.nbytes + PAD)  # 16-byte aligned, with the readable slack the launcher adds
    w[: raw.nbytes] = raw.reshape(-1)
    xp = aligned_zeros(k * tpad * 2)
    x = np.ascontiguousarray(x)
    lib.sim_pack(int(x.dtype == np.float32), x.ctypes.data, k, tokens, k, tpad, xp.ctypes.data)
    y = np.full((tokens, n_out), np.nan, np.float32)  # poison
    if splits > 1:
        y[:] = 0.0  # the launcher zeroes y before split-K atomics
    err = lib.sim_qmm(
        qtype, n_tiles, w.ctypes.data, raw.shape[1], n_out, k, xp.ctypes.data, tokens, y.ctypes.data, splits
    )
    return y, err


def run_sim_v2(
    lib, qtype: int, raw: np.ndarray, n_out: int, k: int, x: np.ndarray, cfg: tuple
) -> tuple[np.ndarray, int]:
    mt, kw, stages, splits, grid_x = cfg
    tokens = x.shape[0]
    n_tiles = (tokens + 7) // 8
    tpad = 8 * n_tiles
    laid = qm.device_layout(qtype, raw)
    w = aligned_zeros(laid.nbytes + PAD)
    w[: laid.nbytes] = laid
    xp = aligned_zeros(k * tpad * 2)
    x = np.ascontiguousarray(x)
    lib.sim_pack(int(x.dtype == np.float32), x.ctypes.data, k, tokens, k, tpad, xp.ctypes.data)
    y = np.full((tokens, n_out), np.nan, np.float32)
    if splits > 1:
        y[:] = 0.0
    err = lib.sim_qmv(
        qtype, n_tiles, mt, kw, stages, w.ctypes.data, raw.shape[1], n_out, k, xp.ctypes.data, tokens, y.ctypes.data,
        splits, grid_x,
    )  # fmt: skip
    return y, err


def check_twin(y: np.ndarray, err: int, x: np.ndarray, raw: np.ndarray, qtype: int, n_out: int, k: int) -> None:
    assert err == 0, "a warp diverged at a warp-synchronous point"
    assert np.isfinite(y).all(), f"{int((~np.isfinite(y)).sum())} outputs unwritten"
    ref = x.astype(np.float64) @ quants.dequantize(raw, qtype, (n_out, k)).astype(np.float64).T
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < TOL, f"relative error {rel:.3e}"


V2_CASES = [
    # qtype, n_out, k, tokens, (m_tiles, k_warps, stages, splits, persistent blocks)
    (Q4_K, 64, 1024, 1, (2, 1, 3, 1, 2)),
    (Q4_K, 40, 1280, 8, (1, 3, 2, 1, 2)),  # rows not a multiple of 16, 3 warps over 5 chunks, 2 groups per block
    (Q4_K, 80, 768, 23, (2, 2, 4, 2, 1)),  # warps and blocks both split K; one block walks all 3 row groups
    (Q5_K, 64, 1024, 1, (2, 1, 3, 1, 2)),
    (Q5_K, 40, 1280, 9, (1, 3, 2, 1, 2)),  # rows not a multiple of 16
    (Q5_K, 48, 768, 41, (2, 2, 4, 2, 1)),
    (IQ4_XS, 64, 1024, 1, (2, 1, 3, 1, 2)),
    (IQ4_XS, 40, 1280, 9, (1, 3, 2, 1, 2)),  # rows not a multiple of 16
    (IQ4_XS, 48, 768, 41, (2, 2, 4, 2, 1)),
    (Q3_K, 64, 1024, 1, (1, 1, 3, 1, 2)),  # the narrow variant (its 64-register cap)
    (Q3_K, 40, 1280, 9, (1, 3, 2, 1, 2)),  # rows not a multiple of 16
    (Q3_K, 48, 768, 41, (2, 2, 4, 2, 1)),
    (Q4_0, 40, 1280, 9, (1, 3, 2, 1, 2)),  # rows not a multiple of 16 (the swizzled pieces of every row class)
    (Q4_0, 33, 1248, 41, (2, 2, 3, 2, 1)),  # tail chunk of 224 values; warps and blocks split K
    (Q4_0, 20, 32, 5, (2, 1, 2, 1, 1)),  # only a tail chunk
    (IQ4_NL, 64, 1024, 1, (2, 1, 3, 1, 2)),
    (IQ4_NL, 45, 544, 17, (1, 2, 4, 1, 2)),  # tail of 32 values
    (Q6_K, 37, 768, 3, (2, 2, 3, 1, 2)),
    (Q6_K, 64, 1024, 16, (1, 4, 2, 1, 3)),  # 4 groups over 3 blocks
    (Q6_K, 20, 512, 41, (2, 1, 2, 1, 1)),
    (Q8_0, 33, 1248, 9, (2, 2, 3, 1, 1)),  # tail chunk of 224 values
    (Q8_0, 45, 544, 64, (1, 1, 4, 2, 2)),  # tail of 32 values, all 8 token tiles
    (Q8_0, 20, 32, 5, (2, 1, 2, 1, 1)),  # only a tail chunk
    (F16, 50, 800, 17, (2, 3, 3, 1, 1)),
    (F16, 48, 256, 2, (1, 2, 2, 1, 2)),  # more warps than chunks: one warp has no work but still meets the others
]


@pytest.mark.parametrize("qtype,n_out,k,tokens,cfg", V2_CASES)
def test_v2_kernel_matches_twin_on_cpu(sim, qtype: int, n_out: int, k: int, tokens: int, cfg: tuple) -> None:
    rng = np.random.default_rng(qtype * 977 + n_out + k + tokens)
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    y, err = run_sim_v2(sim, qtype, raw, n_out, k, x, cfg)
    check_twin(y, err, x, raw, qtype, n_out, k)


def test_v2_reduction_is_deterministic_across_k_warps(sim) -> None:
    # the warps add their partial sums in a fixed order: two stage counts give bitwise equal results
    rng = np.random.default_rng(21)
    raw = random_weights(Q4_K, 32, 2048, rng)
    x = (rng.standard_normal((4, 2048)) * 0.5).astype(np.float16)
    y1, e1 = run_sim_v2(sim, Q4_K, raw, 32, 2048, x, (2, 4, 3, 1, 1))
    y2, e2 = run_sim_v2(sim, Q4_K, raw, 32, 2048, x, (2, 4, 2, 1, 1))
    assert e1 == e2 == 0
    assert np.array_equal(y1, y2)
    check_twin(y1, e1, x, raw, Q4_K, 32, 2048)


CASES = [
    # qtype, n_out, k, tokens, splits
    (Q4_K, 64, 512, 1, 1),
    (Q4_K, 40, 768, 8, 2),
    (Q4_K, 150, 256, 23, 1),
    (Q6_K, 64, 512, 3, 1),
    (Q6_K, 37, 768, 16, 3),
    (Q6_K, 130, 256, 41, 1),
    (Q8_0, 64, 512, 2, 1),
    (Q8_0, 45, 544, 9, 1),  # tail chunk of 32 values
    (Q8_0, 33, 1248, 64, 2),  # tail chunk of 224 values, all 8 token tiles
    (Q8_0, 20, 32, 5, 1),  # only a tail chunk
    (F16, 64, 512, 1, 1),
    (F16, 50, 288, 17, 2),
    (F16, 33, 224, 32, 1),
]


@pytest.mark.parametrize("qtype,n_out,k,tokens,splits", CASES)
def test_kernel_matches_twin_on_cpu(sim, qtype: int, n_out: int, k: int, tokens: int, splits: int) -> None:
    rng = np.random.default_rng(qtype * 1000 + n_out + k + tokens)
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    y, err = run_sim(sim, qtype, raw, n_out, k, x, splits)
    assert err == 0, "a warp diverged at a warp-synchronous point"
    assert np.isfinite(y).all(), f"{int((~np.isfinite(y)).sum())} outputs unwritten"
    ref = x.astype(np.float64) @ quants.dequantize(raw, qtype, (n_out, k)).astype(np.float64).T
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < TOL, f"relative error {rel:.3e}"


def test_float32_activations_are_rounded_to_fp16(sim) -> None:
    rng = np.random.default_rng(3)
    raw = random_weights(Q4_K, 64, 256, rng)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    y, err = run_sim(sim, Q4_K, raw, 64, 256, x, 1)
    assert err == 0
    ref = x.astype(np.float16).astype(np.float64) @ quants.dequantize(raw, Q4_K, (64, 256)).astype(np.float64).T
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < TOL


def test_kernels_report_availability_without_a_gpu() -> None:
    import kernels

    assert isinstance(kernels.available(), bool)
    if not kernels.available():
        assert "CuPy" in kernels.unavailable_reason() or "GPU" in kernels.unavailable_reason()


# --- fused pack prologues and the accumulating epilogue (tests/cuda_sim_ops.cpp, family 4) ---------------------

PERM = np.array([0, 2, 1, 3, 4, 6, 5, 7])  # halves of a 16-byte unit in mma order (pack_x_kernel)


@pytest.fixture(scope="module")
def fused_sim(tmp_path_factory):
    from tests.test_kernels_ops_sim import build_family

    C, P, I, LL, F = ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    lib = build_family("quant_matmul", tmp_path_factory.mktemp("cuda_sim_fused"))
    lib.sim_pack_fused.restype = C
    lib.sim_pack_fused.argtypes = [I, I, I, I, P, LL, P, P, P, LL, P, I, F, I, I, I, P, I, I, P]
    lib.sim_qmv_acc.restype = C
    lib.sim_qmv_acc.argtypes = [I, I, I, I, P, LL, I, I, P, I, P, I, I, I, LL]
    lib.sim_embed_rows.restype = C
    lib.sim_embed_rows.argtypes = [I, P, LL, I, P, I, I, P]
    lib.sim_smem_high.restype = LL
    lib.sim_smem_high.argtypes = [I]
    return lib


@pytest.mark.parametrize("qtype", [0, F16, Q8_0, Q4_K], ids=["F32", "F16", "Q8_0", "Q4_K"])
def test_embed_rows_equal_the_numpy_rows(fused_sim, qtype: int) -> None:
    """embed_rows_kernel decodes token-table rows bit for bit as the NumPy engine (NumpyBackend.embed: the
    services/engine/quants dequantizers); ids outside the table give zeros, repeated ids the same row."""
    from services.engine.backend import NumpyBackend
    from services.engine.formats import RawTensor
    from tests.quant_twins import random_table

    rng = np.random.default_rng(90 + qtype)
    rows, k = 37, 768
    raw = random_table(qtype, rows, k, rng)
    ids = np.array([5, 0, 36, 5, -1, 37, 1 << 30, 17], np.int32)
    out = np.full((len(ids), k), np.nan, np.float32)
    assert fused_sim.sim_embed_rows(qtype, raw.ctypes.data, raw.shape[1], rows, ids.ctypes.data, len(ids), k,
                                    out.ctypes.data) == 0
    table = RawTensor(name="token_embd.weight", qtype=qtype, shape=(rows, k),
                      data=raw.view(np.float32) if qtype == 0 else raw, source="test")
    valid = (ids >= 0) & (ids < rows)
    want = NumpyBackend().embed(table, ids[valid])
    assert np.array_equal(out[valid].view(np.uint32), want.view(np.uint32))
    assert (out[~valid] == 0).all()


def unpack_numpy(xp: np.ndarray, k: int, tpad: int) -> np.ndarray:
    """[tpad, k] float16 from pack_x_kernel's layout (NumPy inverse of the kernel's unit map)."""
    h = xp.view(np.uint16).reshape(-1, 8)[:, np.argsort(PERM)]
    out = np.zeros((tpad, k), np.uint16)
    for ch in range(-(-k // 256)):
        c = min(256, k - 256 * ch)
        for p in range(c // 32):
            for t in range(4):
                u = ch * 32 * tpad + p * 4 * tpad + 4 * np.arange(tpad) + t
                k0 = 256 * ch + t * (c // 4) + 8 * p
                out[:, k0 : k0 + 8] = h[u]
    return out.view(np.float16)


def rms_twin(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    v = x.astype(np.float64)
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w


def silu64(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def aligned_array(shape: tuple, dtype) -> np.ndarray:
    """An empty array whose data starts 64-byte aligned (pack_rms_kernel stages rows with 16-byte loads)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return aligned_zeros(nbytes).view(dtype).reshape(shape)


@pytest.mark.parametrize(
    "dtype,tokens,k,group,res,gate,pad_blocks,slices",
    [
        (np.float32, 1, 1280, 1280, 0, 0, 1, 3),  # a norm over the whole row (the layer's input norm), 3 slices
        (np.float32, 3, 1248, 1248, 1, 0, 2, 2),  # + residual, K with a 224-value tail chunk; 2 padding blocks
        (np.float16, 9, 512, 512, 1, 0, 7, 1),  # fp16 stream, two token tiles; a padding block per padding row
        (np.float32, 5, 1024, 128, 0, 1, 1, 4),  # per head of 128 times silu(z) (DeltaNet output), z strided
        (np.float16, 2, 256, 64, 0, 1, 3, 1),
        (np.float32, 1, 8448, 8448, 1, 0, 1, 1),  # 2112 16-byte vectors per row: two staging rounds (1536 + 576)
        (np.float16, 8, 96, 6, 1, 1, 0, 1),  # heads of 6 values (w staged value by value), no padding rows
        (np.float32, 2, 1536, 384, 1, 1, 1, 4),  # heads straddling the slices' chunk ranges
        (np.float32, 1, 768, 12, 0, 0, 1, 3),  # heads of 12 (a unit spans two heads) across slices
    ],
)
def test_fused_norm_pack_matches_twin_on_cpu(fused_sim, dtype, tokens, k, group, res, gate, pad_blocks,
                                             slices) -> None:  # fmt: skip
    rng = np.random.default_rng(tokens * 31 + k + group)
    tpad = 8 * ((tokens + 7) // 8)
    x = aligned_array((tokens, k), dtype)
    x[...] = rng.standard_normal((tokens, k)) * 2
    r = aligned_array((tokens, k), dtype)
    r[...] = rng.standard_normal((tokens, k))
    zs = aligned_array((tokens, 2 * k), dtype)  # z: the second half of wider rows (row stride 2k)
    zs[...] = rng.standard_normal((tokens, 2 * k))
    w = (1 + 0.1 * rng.standard_normal(group)).astype(np.float32)
    s = aligned_array((tokens, k), dtype)
    s[...] = np.nan
    xp = aligned_zeros(k * tpad * 2)
    xp.view(np.uint16)[:] = 0x7E00  # NaN poison: every unit, padding included, must be written
    xq = aligned_zeros(4 * qm.q16_words(k, tokens)).view(np.uint32)
    xq[:] = 0xDEADBEEF
    fused_sim.sim_smem_high(1)
    err = fused_sim.sim_pack_fused(0, int(dtype == np.float32), res, gate, x.ctypes.data, k, r.ctypes.data,
                                   s.ctypes.data, zs[:, k:].ctypes.data, 2 * k, w.ctypes.data, group, 1e-6, tokens,
                                   k, tpad, xp.ctypes.data, tokens * slices + pad_blocks, slices,
                                   xq.ctypes.data)  # fmt: skip
    high = fused_sim.sim_smem_high(0)
    assert err == 0
    # every block stays within the launcher's reservation (a row norm's weights: its slice's alone; a slice's weights
    # stored at their row positions write past it)
    assert 0 < high <= qm.pack_rms_smem_bytes(k, group, bool(gate), slices)
    got = unpack_numpy(xp, k, tpad)
    assert not got[tokens:].any(), "padding tokens must be zero"
    assert np.array_equal(xq, q16_twin(got[:tokens])), "the gemv staging (PackedX.q16) of the packed values"
    v = x.astype(np.float64) + (r if res else 0)
    if res:  # the new residual stream: x + r rounded once to the stream's type
        assert np.array_equal(s, v.astype(dtype))
        v = s.astype(np.float64)
    ref = rms_twin(v.reshape(tokens, k // group, group), w, 1e-6).reshape(tokens, k)
    if gate:
        ref = ref * silu64(zs[:, k:].astype(np.float64))
    np.testing.assert_allclose(got[:tokens].astype(np.float64), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype,tokens,k,res", [(np.float32, 1, 5120, 0), (np.float32, 3, 1248, 1),
                                                (np.float16, 2, 2304, 1), (np.float32, 9, 8448, 1)])
def test_fused_norm_pack_equals_rms_norm_kernel_then_pack_on_cpu(fused_sim, sim, tmp_path_factory, dtype, tokens, k,
                                                                 res) -> None:
    """The fused pack is bit-identical to the two-launch path: norm_rope.cu's rms_norm_kernel (output in x's
    type), then pack_x_kernel; and its residual stream to rms_norm_kernel's."""
    from tests.test_kernels_ops_sim import build_family

    nr_lib = build_family("norm_rope", tmp_path_factory.mktemp("cuda_sim_nr"))
    rng = np.random.default_rng(k + tokens)
    tpad = 8 * ((tokens + 7) // 8)
    code = int(dtype == np.float16)
    x, r, s_f, s_u = (aligned_array((tokens, k), dtype) for _ in range(4))
    x[...] = rng.standard_normal((tokens, k)) * 3
    r[...] = rng.standard_normal((tokens, k))
    w = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    y = aligned_array((tokens, k), dtype)
    assert nr_lib.sim_rms_norm(code, code, res, x.ctypes.data, r.ctypes.data, s_u.ctypes.data, w.ctypes.data,
                               y.ctypes.data, tokens, k, 1e-6) == 0  # fmt: skip
    unfused = aligned_zeros(k * tpad * 2)
    sim.sim_pack(int(dtype == np.float32), y.ctypes.data, k, tokens, k, tpad, unfused.ctypes.data)
    # one token takes more slices (qm.PACK_RMS_ONE_TOKEN_SCALE): a block a chunk of the 27B's rows
    assert qm.pack_rms_slices(5120, 5120, 1) == 4 * qm.pack_rms_slices(5120, 5120, 2) == 4 * 3
    assert qm.pack_rms_slices(6144, 128, 1) == 24 and qm.pack_rms_slices(512, 512, 1) == 2
    for slices in {1, 2, qm.pack_rms_slices(k, k, 2), qm.pack_rms_slices(k, k, 1)}:  # the same sums whatever the slices
        fused = aligned_zeros(k * tpad * 2)
        fused.view(np.uint16)[:] = 0x7E00
        s_f[...] = np.nan
        assert fused_sim.sim_pack_fused(0, int(dtype == np.float32), res, 0, x.ctypes.data, k, r.ctypes.data,
                                        s_f.ctypes.data, None, k, w.ctypes.data, k, 1e-6, tokens, k, tpad,
                                        fused.ctypes.data, 0, slices, None) == 0  # fmt: skip
        assert np.array_equal(fused, unfused), f"{slices} slices"
        if res:
            assert np.array_equal(s_f.view(np.uint8), s_u.view(np.uint8))


@pytest.mark.parametrize("dtype,tokens,k,shift", [(np.float32, 1, 2304, 0), (np.float32, 12, 544, 0),
                                                  (np.float16, 4, 256, 0), (np.float32, 3, 288, 1)])
def test_fused_silu_pack_matches_twin_on_cpu(fused_sim, dtype, tokens, k, shift) -> None:
    """shift: rows start one value past 16-byte alignment (the kernel's value-by-value path)."""
    rng = np.random.default_rng(tokens + k)
    tpad = 8 * ((tokens + 7) // 8)
    buf = aligned_array((tokens * 2 * k + 8,), dtype)
    gu = buf[shift : shift + tokens * 2 * k].reshape(tokens, 2 * k)  # gate | up halves of one product
    gu[...] = rng.standard_normal((tokens, 2 * k)) * 2
    xp = aligned_zeros(k * tpad * 2)
    xp.view(np.uint16)[:] = 0x7E00
    xq = aligned_zeros(4 * qm.q16_words(k, tokens)).view(np.uint32)
    xq[:] = 0xDEADBEEF
    err = fused_sim.sim_pack_fused(1, int(dtype == np.float32), 0, 0, gu.ctypes.data, 2 * k, gu[:, k:].ctypes.data,
                                   None, None, 2 * k, None, 0, 0.0, tokens, k, tpad, xp.ctypes.data, 3, 1,
                                   xq.ctypes.data)  # fmt: skip
    assert err == 0
    got = unpack_numpy(xp, k, tpad)
    assert not got[tokens:].any()
    assert np.array_equal(xq, q16_twin(got[:tokens]))
    g, u = gu[:, :k].astype(np.float64), gu[:, k:].astype(np.float64)
    np.testing.assert_allclose(got[:tokens].astype(np.float64), silu64(g) * u, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("qtype,n_out,k,tokens,nt,mt,kw,splits", [(Q4_K, 48, 1024, 1, 1, 1, 4, 1),
                                                                    (Q8_0, 40, 800, 11, 2, 2, 2, 2)])
def test_v2_accumulate_adds_into_y_on_cpu(fused_sim, sim, qtype, n_out, k, tokens, nt, mt, kw, splits) -> None:
    rng = np.random.default_rng(n_out + k)
    raw = random_weights(qtype, n_out, k, rng)
    laid = qm.device_layout(qtype, raw)
    wbuf = aligned_zeros(laid.nbytes + PAD)
    wbuf[: laid.nbytes] = laid
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    tpad = 8 * nt
    xp = aligned_zeros(k * tpad * 2)
    sim.sim_pack(0, x.ctypes.data, k, tokens, k, tpad, xp.ctypes.data)
    y0 = rng.standard_normal((tokens, n_out)).astype(np.float32)  # the residual stream
    plain = np.zeros((tokens, n_out), np.float32)
    acc = y0.copy()
    for y, flag in ((plain, 0), (acc, 1)):
        assert fused_sim.sim_qmv_acc(qtype, nt, mt, kw, wbuf.ctypes.data, raw.shape[1], n_out, k, xp.ctypes.data,
                                     tokens, y.ctypes.data, splits, 2, flag, 0) == 0  # fmt: skip
    check_twin(plain, 0, x, raw, qtype, n_out, k)
    if splits == 1:  # one plain add of the finished sum: exactly y0 + (x @ W^T)
        assert np.array_equal(acc, y0 + plain)
    else:  # K splits add their partial sums into y0 with atomics
        np.testing.assert_allclose(acc, y0 + plain, rtol=1e-5, atol=1e-5)
    # the same products into a column slice of wider rows (row stride ldy): equal, the other columns untouched
    ld, off = n_out + 21, 13
    for ref, flag in ((plain, 0), (acc, 1)):
        wide = np.full((tokens, ld), 7.25, np.float32)
        wide[:, off : off + n_out] = y0 if flag else 0.0  # splits add into a zeroed / the given slice
        assert fused_sim.sim_qmv_acc(qtype, nt, mt, kw, wbuf.ctypes.data, raw.shape[1], n_out, k, xp.ctypes.data,
                                     tokens, wide[:, off:].ctypes.data, splits, 2, flag, ld) == 0  # fmt: skip
        if splits == 1:
            assert np.array_equal(wide[:, off : off + n_out], ref)
        else:
            np.testing.assert_allclose(wide[:, off : off + n_out], ref, rtol=1e-5, atol=1e-5)
        assert (wide[:, :off] == 7.25).all() and (wide[:, off + n_out :] == 7.25).all()
