"""kernels/quant_gemv.cu run on the CPU: its portable path compiled as C++ by g++ (tests/cuda_sim_gemv.cpp).

No GPU is needed. The simulation runs the real kernel source (x staging as int16 with group scales and sums, the
lane -> row / value mapping, swizzled F16 / Q8_0 units, K-quant scale unpacking, dp2a sums, tail chunks, warps
splitting K and adding in shared memory, the accumulate epilogue, row masking) with every thread of a block a
fiber (tests/cuda_sim.h block mode), against the NumPy twins; x is packed by quant_matmul.cu's pack_x_kernel. The
persistent variant too (blocks walking several tiles, prefetch depth 1 / 2 across tile ends, two partial-sum
buffers), bitwise against the per-tile kernel; the ring variant (each warp's chunks and x through a ring of
shared-memory slots, copied by its lanes on this path), bitwise against the per-tile kernel too. Also the launcher's
pure-Python parts (shared-memory size, k_warps choice, persistent grid, dispatch rule).

The ring tests run twice: on the portable path and on the sm_90 path the H100 runs (-DSPECSPLIT_SIM_BULK:
kernels/bulk.cuh simulates the bulk copies and mbarriers; a copy lands when issued or, at random, only when its
mbarrier is waited for, so a warp that reads its slot before waiting sees stale bytes). The cluster pair kernel is not
simulated.
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

from kernels import loader
from kernels import quant_gemv as qg
from kernels import quant_matmul as qm
from services.engine import quants
from tests.quant_twins import q16_twin, random_weights, staged_inv_twin, staged_norm_twin

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "kernels" / "quant_gemv.cu"
QMM_SOURCE = ROOT / "kernels" / "quant_matmul.cu"
HARNESS = Path(__file__).resolve().parent / "cuda_sim_gemv.cpp"

F16, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, Q4_0, IQ4_NL = 1, 8, 11, 12, 13, 14, 23, 2, 20
PAD = 1024
TOL = 2e-4

needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None or not sys.platform.startswith("linux"),
    reason="the CPU simulation of the CUDA kernels needs g++ on Linux (ucontext fibers)",
)


def build_sim(tmp_path_factory, bulk: bool = False) -> ctypes.CDLL:
    """The simulation library: the kernels' portable path, or (bulk) the ring kernel's sm_90 path with kernels/
    bulk.cuh's bulk copies and mbarriers simulated (-DSPECSPLIT_SIM_BULK)."""
    parts = (SOURCE, QMM_SOURCE, *sorted(SOURCE.parent.glob("*.cuh")), HARNESS,
             HARNESS.with_name("cuda_sim.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()[:16]
    name = f"cuda_sim_gemv_{'bulk_' if bulk else ''}{digest}.so"
    lib_path = tmp_path_factory.mktemp("cuda_sim_gemv") / name
    cmd = [
        "g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w", *(["-DSPECSPLIT_SIM_BULK"] if bulk else []),
        f'-DGEMV_SOURCE="{SOURCE}"', f'-DQMM_SOURCE="{QMM_SOURCE}"', "-o", str(lib_path), str(HARNESS),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"g++ failed:\n{done.stderr[-4000:]}"
    lib = ctypes.CDLL(str(lib_path))
    lib.sim_bulk.restype = ctypes.c_int
    assert lib.sim_bulk() == int(bulk)
    lib.sim_gemv.restype = ctypes.c_int
    lib.sim_gemv.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
        ctypes.c_void_p,
    ]  # fmt: skip
    lib.sim_gemv_ring.restype = ctypes.c_int
    lib.sim_gemv_ring.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    lib.sim_pack.restype = None
    lib.sim_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                             ctypes.c_void_p]
    lib.sim_gemv_ring_swiglu.restype = ctypes.c_int
    lib.sim_gemv_ring_swiglu.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
    ]  # fmt: skip
    lib.sim_pack_silu.restype = None
    lib.sim_pack_silu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


@pytest.fixture(scope="session")
def sim(tmp_path_factory) -> ctypes.CDLL:
    return build_sim(tmp_path_factory)


@pytest.fixture(scope="session")
def sim_bulk(tmp_path_factory) -> ctypes.CDLL:
    return build_sim(tmp_path_factory, bulk=True)


@pytest.fixture(params=["portable", "bulk"])
def ring_sim(request) -> ctypes.CDLL:
    """The ring tests' library: both builds (the ring kernel's portable path and the sm_90 one the H100 runs)."""
    return request.getfixturevalue("sim" if request.param == "portable" else "sim_bulk")


def aligned_zeros(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off : off + nbytes]


SENTINEL = np.float32(7.25)  # columns of a wider output beside the product's slice must keep it


def sim_pack(lib, x: np.ndarray, q16: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """pack_x_kernel on the CPU: (packed fp16 x, and with q16 the gemv staging buffer PackedX.q16, else None)."""
    tokens, k = x.shape
    tpad = 8 * ((tokens + 7) // 8)
    xp = aligned_zeros(k * tpad * 2)
    xq = aligned_zeros(4 * qm.q16_words(k, tokens)).view(np.uint32) if q16 else None
    if xq is not None:
        xq[...] = 0xDEADBEEF  # every word must be written
    x = np.ascontiguousarray(x, dtype=np.float16)
    lib.sim_pack(x.ctypes.data, tokens, k, tpad, xp.ctypes.data, None if xq is None else xq.ctypes.data)
    return xp, xq


def run_sim(
    lib, qtype: int, raw: np.ndarray, n_out: int, k: int, x: np.ndarray, kw: int, y0=None, pd: int = 0, grid: int = 0,
    ld: int = 0, q16: bool = False, xq_edit=None,
) -> np.ndarray:
    """One simulated launch; y0 given: accumulate into a copy of it, else into a NaN-poisoned output. pd = 0: the
    per-tile kernel; 1 / 2: the persistent one with that prefetch depth and `grid` blocks (0: one per tile).
    ld > n_out: the output is the last n_out columns of [T, ld] rows (a stacked projection's slice); the others
    must be left alone. q16: x staged from the pack's int16 copy (PackedX.q16) instead of quantized by the kernel."""
    tokens = x.shape[0]
    tpad = 8 * ((tokens + 7) // 8)
    laid = qm.device_layout(qtype, raw)
    w = aligned_zeros(laid.nbytes + PAD)  # 16-byte aligned, with the slack the launcher adds
    w[: laid.nbytes] = laid
    xp, xq = sim_pack(lib, x, q16)
    if xq_edit is not None:
        xq_edit(xq)
    ld = ld or n_out
    full = np.full((tokens, ld), SENTINEL, np.float32)
    y = full[:, ld - n_out :]
    y[...] = np.nan if y0 is None else y0
    err = lib.sim_gemv(
        qtype, tokens, w.ctypes.data, raw.shape[1], n_out, k, xp.ctypes.data, tpad, y.ctypes.data, int(y0 is not None),
        kw, pd, grid, ld, None if xq is None else xq.ctypes.data,
    )  # fmt: skip
    assert err == 0, "the simulation reported a divergent warp or a deadlock"
    assert (full[:, : ld - n_out] == SENTINEL).all(), "a column outside the output slice was written"
    return y.copy()


def check_twin(y: np.ndarray, x: np.ndarray, raw: np.ndarray, qtype: int, n_out: int, k: int, y0=None) -> None:
    assert np.isfinite(y).all(), f"{int((~np.isfinite(y)).sum())} outputs unwritten"
    ref = x.astype(np.float64) @ quants.dequantize(raw, qtype, (n_out, k)).astype(np.float64).T
    if y0 is not None:
        ref = ref + y0
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < TOL, f"relative error {rel:.3e}"


CASES = [
    # qtype, n_out, k, tokens, k_warps
    (Q4_K, 16, 256, 1, 1),
    (Q4_K, 40, 1280, 3, 3),  # rows not a multiple of 16, 3 warps over 5 chunks
    (Q4_K, 33, 512, 16, 2),
    (Q5_K, 40, 1280, 3, 3),
    (Q5_K, 33, 512, 16, 2),
    (IQ4_XS, 40, 1280, 1, 3),
    (IQ4_XS, 33, 512, 11, 2),
    (Q3_K, 40, 1280, 3, 3),
    (Q3_K, 33, 512, 16, 2),
    (Q4_0, 40, 1280, 3, 3),  # (the harness holds Q4_0 / IQ4_NL at 1..3 tokens)
    (Q4_0, 33, 1248, 2, 2),  # a tail chunk of 224 values
    (IQ4_NL, 33, 768, 1, 2),
    (IQ4_NL, 45, 544, 2, 3),  # a tail of 32 values, owned by the last warp alone
    (Q6_K, 37, 768, 2, 2),
    (Q6_K, 64, 1024, 8, 4),
    (Q6_K, 20, 512, 11, 8),  # more warps than chunks: idle warps still stage x and meet the others
    (Q8_0, 33, 1248, 5, 2),  # a tail chunk of 224 values
    (Q8_0, 45, 544, 1, 3),  # a tail of 32 values, owned by the last warp alone
    (Q8_0, 20, 32, 4, 1),  # only a tail chunk
    (F16, 50, 800, 4, 3),
    (F16, 48, 256, 16, 2),
    (F16, 17, 288, 1, 1),
]


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,kw", CASES)
def test_gemv_matches_twin_on_cpu(sim, qtype: int, n_out: int, k: int, tokens: int, kw: int) -> None:
    rng = np.random.default_rng(qtype * 977 + n_out + k + tokens)
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    y = run_sim(sim, qtype, raw, n_out, k, x, kw)
    check_twin(y, x, raw, qtype, n_out, k)


@needs_gxx
@pytest.mark.parametrize("k,tokens", [(256, 1), (1248, 2), (544, 3), (32, 1), (800, 2)])
def test_pack_writes_the_gemv_staging(sim, k: int, tokens: int) -> None:
    """pack_x_kernel's PackedX.q16 (every word written) equals the NumPy twin of the gemv kernel's own int16 staging,
    tail chunks (224 / 32 / 64 values: missing groups zero) and all-zero groups included; the fp16 pack is unchanged."""
    rng = np.random.default_rng(k + tokens)
    x = (rng.standard_normal((tokens, k)) * 3).astype(np.float16)
    x[0, :16] = 0  # an all-zero group: scale 0
    x[-1, 16:32] = np.float16(-2.5)  # ties of the int16 rounding at the group maximum
    xp, xq = sim_pack(sim, x, q16=True)
    assert np.array_equal(xq, q16_twin(x))
    assert np.array_equal(xp, sim_pack(sim, x)[0])


Q16_CASES = [case for case in CASES if case[0] != F16]


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,kw", Q16_CASES)
def test_gemv_from_the_pack_staging_is_bitwise(sim, qtype: int, n_out: int, k: int, tokens: int, kw: int) -> None:
    """x copied from PackedX.q16 instead of quantized in every block: the same output bit for bit, per-tile and
    persistent (quantized types; F16 ignores it)."""
    rng = np.random.default_rng(qtype * 31 + n_out + k + tokens)
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    y = run_sim(sim, qtype, raw, n_out, k, x, kw)
    assert np.array_equal(y, run_sim(sim, qtype, raw, n_out, k, x, kw, q16=True))

    def doubled(xq: np.ndarray) -> None:  # scales and sums x 2: every term doubles exactly, so must y
        units = -(-k // 256) * tokens * 32 * 4
        xq[units:] = (xq[units:].view(np.float32) * 2).view(np.uint32)

    assert np.array_equal(2 * y, run_sim(sim, qtype, raw, n_out, k, x, kw, q16=True, xq_edit=doubled))
    y0 = rng.standard_normal((tokens, n_out)).astype(np.float32)
    grid = max(1, -(-n_out // 32))
    assert np.array_equal(run_sim(sim, qtype, raw, n_out, k, x, kw, y0, pd=1, grid=grid),
                          run_sim(sim, qtype, raw, n_out, k, x, kw, y0, pd=1, grid=grid, q16=True))


@needs_gxx
@pytest.mark.parametrize("qtype", [Q4_K, Q6_K, Q8_0, F16])
def test_accumulate_and_determinism_on_cpu(sim, qtype: int) -> None:
    rng = np.random.default_rng(40 + qtype)
    n_out, k = 24, 768 if qtype != Q8_0 else 800
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((5, k)) * 0.5).astype(np.float16)
    y0 = rng.standard_normal((5, n_out)).astype(np.float32)
    lib = sim
    y = run_sim(lib, qtype, raw, n_out, k, x, 3, y0)
    check_twin(y, x, raw, qtype, n_out, k, y0)
    plain = run_sim(lib, qtype, raw, n_out, k, x, 3)
    assert np.array_equal(y, y0 + plain)  # the same sums, then one fp32 add
    assert np.array_equal(plain, run_sim(lib, qtype, raw, n_out, k, x, 3))  # bitwise reproducible


@needs_gxx
@pytest.mark.parametrize("qtype,tokens,kw,pd,grid", [(Q4_K, 3, 2, 0, 0), (Q6_K, 1, 4, 0, 0), (F16, 2, 1, 0, 0),
                                                    (Q4_K, 2, 3, 1, 2), (Q8_0, 1, 2, 2, 1)])
def test_strided_output_on_cpu(sim, qtype: int, tokens: int, kw: int, pd: int, grid: int) -> None:
    """A product into a column slice of wider rows (ldy > N), plain and accumulating, per-tile and persistent:
    bitwise what a contiguous output gets, the other columns untouched."""
    rng = np.random.default_rng(qtype + 7 * tokens + pd)
    n_out, k = 37, 800 if qtype == Q8_0 else 768
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    y0 = rng.standard_normal((tokens, n_out)).astype(np.float32)
    for acc in (None, y0):
        flat = run_sim(sim, qtype, raw, n_out, k, x, kw, acc, pd=pd, grid=grid)
        wide = run_sim(sim, qtype, raw, n_out, k, x, kw, acc, pd=pd, grid=grid, ld=n_out + 29)
        assert np.array_equal(flat, wide)
    check_twin(flat, x, raw, qtype, n_out, k, y0)


PERSIST_CASES = [
    # qtype, n_out, k, tokens, k_warps, prefetch depth, grid: blocks walk ceil / floor(tiles / grid) tiles
    (Q4_K, 77, 768, 1, 1, 2, 2),  # 5 tiles over 2 blocks (3 and 2), odd rows, no shared-memory reduction
    (Q4_K, 64, 1280, 2, 3, 2, 3),  # 4 tiles over 3 blocks, 3 warps over 5 chunks: both partial-sum buffers
    (Q4_K, 40, 512, 3, 4, 1, 1),  # depth 1; one block, 3 tiles; more warps than chunks
    (Q5_K, 64, 1280, 2, 3, 2, 3),
    (IQ4_XS, 77, 768, 1, 1, 2, 2),
    (Q3_K, 64, 1280, 2, 3, 2, 3),
    (Q4_0, 45, 1248, 2, 2, 2, 2),  # a tail chunk of 224 values per tile
    (IQ4_NL, 64, 1280, 1, 3, 1, 3),
    (Q6_K, 50, 1024, 1, 4, 2, 2),
    (Q6_K, 48, 512, 5, 2, 1, 2),
    (Q8_0, 45, 1248, 2, 2, 2, 2),  # a tail chunk of 224 values per tile
    (Q8_0, 33, 544, 1, 3, 1, 1),  # a tail of 32 values, owned by the last warp alone
]


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,kw,pd,grid", PERSIST_CASES)
def test_persistent_matches_twin_and_per_tile_kernel(
    sim, qtype: int, n_out: int, k: int, tokens: int, kw: int, pd: int, grid: int
) -> None:
    rng = np.random.default_rng(qtype * 131 + n_out + k + tokens + pd)
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    y = run_sim(sim, qtype, raw, n_out, k, x, kw, pd=pd, grid=grid)
    check_twin(y, x, raw, qtype, n_out, k)
    # the same sums in the same order as one block per tile: bitwise equal
    assert np.array_equal(y, run_sim(sim, qtype, raw, n_out, k, x, kw))
    y0 = rng.standard_normal((tokens, n_out)).astype(np.float32)
    acc = run_sim(sim, qtype, raw, n_out, k, x, kw, y0, pd=pd, grid=grid)
    assert np.array_equal(acc, y0 + y)


def run_ring(lib, qtype: int, raw: np.ndarray, n_out: int, k: int, x: np.ndarray, kw: int, stages: int, y0=None,
             ld: int = 0, seed: int = 0) -> np.ndarray:
    """One simulated ring launch (x from the pack's PackedX.q16), blocks in the order of `seed`; as run_sim."""
    tokens = x.shape[0]
    laid = qm.device_layout(qtype, raw)
    w = aligned_zeros(laid.nbytes + PAD)
    w[: laid.nbytes] = laid
    _, xq = sim_pack(lib, x, q16=True)
    ld = ld or n_out
    full = np.full((tokens, ld), SENTINEL, np.float32)
    y = full[:, ld - n_out :]
    y[...] = np.nan if y0 is None else y0
    err = lib.sim_gemv_ring(qtype, tokens, w.ctypes.data, raw.shape[1], n_out, k, y.ctypes.data, int(y0 is not None),
                            kw, stages, ld, seed, xq.ctypes.data, None, 0.0, None, None, None)
    assert err == 0, "the simulation reported a divergent warp or a deadlock"
    assert (full[:, : ld - n_out] == SENTINEL).all(), "a column outside the output slice was written"
    return y.copy()


RING_CASES = [
    # qtype, n_out, k, tokens, k_warps, stages
    (Q4_K, 40, 1280, 1, 2, 2),  # 5 chunks over 2 warps (2 and 3), slots refilled; rows not a multiple of 16
    (Q4_K, 33, 768, 2, 1, 4),  # more slots than chunks: all issued up front
    (Q4_K, 20, 512, 1, 4, 1),  # one slot; more warps than chunks: idle warps still meet the others
    (Q5_K, 40, 1280, 1, 2, 2),
    (Q5_K, 16, 2048, 3, 2, 3),
    (IQ4_XS, 40, 1280, 1, 2, 2),
    (IQ4_XS, 16, 2048, 2, 2, 3),
    (Q3_K, 40, 1280, 1, 2, 2),
    (Q3_K, 16, 2048, 3, 2, 3),
    (Q4_0, 40, 1280, 1, 2, 2),
    (Q4_0, 16, 2048, 3, 2, 3),
    (IQ4_NL, 37, 1024, 2, 3, 2),
    (Q6_K, 37, 1024, 1, 3, 2),
    (Q6_K, 16, 2048, 3, 2, 3),  # 4 chunks per warp through 3 slots: the ring wraps
    (Q8_0, 45, 1280, 1, 2, 2),
    (Q8_0, 24, 768, 2, 3, 1),
]


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,kw,stages", RING_CASES)
def test_ring_matches_twin_and_per_tile_kernel(ring_sim, qtype: int, n_out: int, k: int, tokens: int, kw: int,
                                               stages: int) -> None:
    """The ring kernel: the per-tile kernel's output bit for bit at the same k_warps (same sums in the same order),
    within the twin's tolerance; accumulating and into a column slice of wider rows; any block order."""
    sim = ring_sim
    rng = np.random.default_rng(qtype * 53 + n_out + k + tokens + stages)
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    y = run_ring(sim, qtype, raw, n_out, k, x, kw, stages, seed=stages)
    check_twin(y, x, raw, qtype, n_out, k)
    assert np.array_equal(y, run_sim(sim, qtype, raw, n_out, k, x, kw, q16=True))
    y0 = rng.standard_normal((tokens, n_out)).astype(np.float32)
    acc = run_ring(sim, qtype, raw, n_out, k, x, kw, stages, y0, ld=n_out + 13, seed=7)
    assert np.array_equal(acc, y0 + y)


def run_ring_staged(lib, qtype: int, raw: np.ndarray, n_out: int, k: int, xq: np.ndarray, tokens: int, kw: int,
                    stages: int, y0=None, in_ssq=None, eps: float = 1e-6, stage_w=None, seed: int = 0):
    """One simulated ring launch from a given staging xq (uint32 words), optionally a staged norm's input (in_ssq
    [T, K / 16]) and / or staging this product's output for the next norm (stage_w [n_out]). Returns (y, the
    staging words, the per-tile sums) with the last two None without stage_w."""
    laid = qm.device_layout(qtype, raw)
    w = aligned_zeros(laid.nbytes + PAD)
    w[: laid.nbytes] = laid
    y = np.full((tokens, n_out), np.nan, np.float32) if y0 is None else y0.astype(np.float32).copy()
    xq = np.ascontiguousarray(xq, np.uint32)
    sq16 = ssq = None
    if stage_w is not None:
        stage_w = np.ascontiguousarray(stage_w, np.float32)
        sq16 = aligned_zeros(4 * qm.q16_words(n_out, tokens)).view(np.uint32)
        sq16[...] = 0xDEADBEEF  # every word must be written
        ssq = np.full((tokens, n_out // 16), np.nan, np.float32)
    in_ssq = None if in_ssq is None else np.ascontiguousarray(in_ssq, np.float32)
    err = lib.sim_gemv_ring(qtype, tokens, w.ctypes.data, raw.shape[1], n_out, k, y.ctypes.data, int(y0 is not None),
                            kw, stages, n_out, seed, xq.ctypes.data,
                            None if in_ssq is None else in_ssq.ctypes.data, eps,
                            None if stage_w is None else stage_w.ctypes.data,
                            None if sq16 is None else sq16.ctypes.data, None if ssq is None else ssq.ctypes.data)
    assert err == 0, "the simulation reported a divergent warp or a deadlock"
    return y, sq16, ssq


STAGE_CASES = [
    # qtype, n_out, k, tokens, k_warps, stages
    (Q4_K, 256, 512, 1, 2, 2),
    (Q6_K, 512, 768, 2, 3, 2),
    (Q8_0, 256, 1024, 3, 4, 1),  # 48 (row, token) values: two warps shuffle, the second half idle
    (Q4_K, 768, 256, 3, 1, 2),  # K of one chunk: one warp
    (Q4_K, 256, 8704, 1, 8, 3),  # a deep one-token product at RING_FEW_DEEP_SHAPE (the 27B's ffn_down): 4-5 chunks a
                                 # warp through 3 slots
]


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,kw,stages", STAGE_CASES)
def test_ring_stages_the_next_norm(ring_sim, qtype: int, n_out: int, k: int, tokens: int, kw: int, stages: int) -> None:
    """A ring product accumulating into the residual stream writes the next norm's staging of what it wrote: the
    stream itself bitwise the unstaged launch's, the int16 staging of stream * w and the per-tile sums of squares
    bitwise their NumPy twin (tests/quant_twins.py staged_norm_twin). One warp (K of one chunk) cannot stage: its
    launch leaves the buffers alone (the launcher refuses it)."""
    sim = ring_sim
    rng = np.random.default_rng(qtype + n_out + k + tokens)
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    _, xq = sim_pack(sim, x, q16=True)
    y0 = rng.standard_normal((tokens, n_out)).astype(np.float32)
    nw = (1.0 + 0.25 * rng.standard_normal(n_out)).astype(np.float32)
    plain, _, _ = run_ring_staged(sim, qtype, raw, n_out, k, xq, tokens, kw, stages, y0)
    y, sq16, ssq = run_ring_staged(sim, qtype, raw, n_out, k, xq, tokens, kw, stages, y0, stage_w=nw, seed=3)
    assert np.array_equal(y, plain)
    if kw == 1:
        assert (sq16 == 0xDEADBEEF).all() and np.isnan(ssq).all()
        return
    words, sums = staged_norm_twin(y, nw)
    assert np.array_equal(sq16, words)
    assert np.array_equal(ssq, sums)


@needs_gxx
@pytest.mark.parametrize("qtype,kw,stages,tokens", [(Q4_K, 4, 2, 1), (Q6_K, 2, 3, 2), (Q8_0, 3, 2, 3),
                                                    (Q4_K, 1, 2, 2)])
def test_ring_reads_a_staged_norm(ring_sim, qtype: int, kw: int, stages: int, tokens: int) -> None:
    """Producer -> consumer through a staged norm: a ring product accumulating into the stream s stages rms_norm(s) * w
    for the next ring product, which scales its sums by 1 / rms from the per-tile sums of squares. The consumer's
    output is its unscaled output (from the same staging) times staged_inv_twin bitwise, and the chain matches
    rms_norm(s) * w @ W2^T in float64 within the ring's tolerance."""
    sim = ring_sim
    rng = np.random.default_rng(qtype * 7 + kw + tokens)
    d, k0, n2 = 512, 768, 48
    raw1 = random_weights(qtype, d, k0, rng)
    raw2 = random_weights(qtype, n2, d, rng)
    x = (rng.standard_normal((tokens, k0)) * 0.5).astype(np.float16)
    _, xq = sim_pack(sim, x, q16=True)
    stream = (rng.standard_normal((tokens, d)) * 2.0).astype(np.float32)
    nw = (1.0 + 0.25 * rng.standard_normal(d)).astype(np.float32)
    eps = 1e-6
    s, sq16, ssq = run_ring_staged(sim, qtype, raw1, d, k0, xq, tokens, 2, 2, stream, stage_w=nw)
    y, _, _ = run_ring_staged(sim, qtype, raw2, n2, d, sq16, tokens, kw, stages, in_ssq=ssq, eps=eps, seed=5)
    unscaled, _, _ = run_ring_staged(sim, qtype, raw2, n2, d, sq16, tokens, kw, stages)
    inv = staged_inv_twin(ssq, d, eps)
    assert np.array_equal(y, (unscaled * inv[:, None]).astype(np.float32))
    s64 = s.astype(np.float64)
    h = s64 / np.sqrt((s64 * s64).mean(axis=1, keepdims=True) + eps) * nw
    ref = h @ quants.dequantize(raw2, qtype, (n2, d)).astype(np.float64).T
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < TOL, f"relative error {rel:.3e}"


def run_ring_swiglu(lib, qtype: int, raw: np.ndarray, k: int, xq: np.ndarray, tokens: int, kw: int, stages: int,
                    in_ssq=None, eps: float = 1e-6, seed: int = 0) -> np.ndarray:
    """One simulated SwiGLU ring launch over a stacked [gate | up] matrix raw (2 F rows): the down product's staging
    words (q16_words(F, T))."""
    f = raw.shape[0] // 2
    laid = qm.device_layout(qtype, raw)
    w = aligned_zeros(laid.nbytes + PAD)
    w[: laid.nbytes] = laid
    out = aligned_zeros(4 * qm.q16_words(f, tokens)).view(np.uint32)
    out[...] = 0xDEADBEEF  # every word must be written
    xq = np.ascontiguousarray(xq, np.uint32)
    in_ssq = None if in_ssq is None else np.ascontiguousarray(in_ssq, np.float32)
    err = lib.sim_gemv_ring_swiglu(qtype, tokens, w.ctypes.data, raw.shape[1], f, k, kw, stages, seed,
                                   xq.ctypes.data, None if in_ssq is None else in_ssq.ctypes.data, eps,
                                   out.ctypes.data)
    assert err == 0, "the simulation reported a divergent warp or a deadlock"
    return out


def sim_pack_silu(lib, g: np.ndarray, u: np.ndarray, staging_only: bool = False) -> np.ndarray:
    """pack_silu_kernel on the CPU from fp32 g, u [T, F]: its gemv staging words (staging_only: xp null, as
    pack_activations(staging_only=True) launches it)."""
    tokens, f = g.shape
    gu = np.ascontiguousarray(np.concatenate([g, u], axis=1), np.float32)
    xp = aligned_zeros(f * 8 * ((tokens + 7) // 8) * 2)
    out = aligned_zeros(4 * qm.q16_words(f, tokens)).view(np.uint32)
    out[...] = 0xDEADBEEF
    lib.sim_pack_silu(gu.ctypes.data, gu[:, f:].ctypes.data, 2 * f, tokens, f, 8 * ((tokens + 7) // 8),
                      None if staging_only else xp.ctypes.data, out.ctypes.data)
    return out


@pytest.mark.parametrize("tokens,f", [(1, 512), (2, 768), (3, 1280)])
def test_pack_silu_staging_only_writes_the_same_staging(sim, tokens: int, f: int) -> None:
    """pack_silu_kernel without its fp16 x (xp null: a grid over the real rows only) writes every staging word, with
    the bits of the full pack's."""
    rng = np.random.default_rng(tokens * 7 + f)
    g = rng.standard_normal((tokens, f)).astype(np.float32) * 2
    u = rng.standard_normal((tokens, f)).astype(np.float32)
    full, only = sim_pack_silu(sim, g, u), sim_pack_silu(sim, g, u, staging_only=True)
    assert not (only == 0xDEADBEEF).any() and np.array_equal(only, full)


def q16_values(words: np.ndarray, k: int, tokens: int) -> np.ndarray:
    """The values a PackedX.q16 buffer stands for (int16 times its group's scale), [T, K] float64."""
    nch = k // 256
    units = words[: nch * tokens * 128].view(np.int16).reshape(nch, tokens, 16, 16).astype(np.float64)
    scale = words[nch * tokens * 128: nch * tokens * 144].view(np.float32).reshape(nch, tokens, 16, 1)
    return (units * scale).transpose(1, 0, 2, 3).reshape(tokens, k)


SWIGLU_CASES = [
    # qtype, F, k, tokens, k_warps, stages, staged input norm
    (Q4_K, 256, 512, 1, 2, 2, False),
    (Q6_K, 512, 768, 2, 3, 2, False),  # 3 chunks over 3 warps: the up tile's first chunk goes out in the gate's ring
    (Q8_0, 256, 1280, 3, 4, 3, False),  # 48 (row, token) values: the second warp's shuffles half idle
    (Q4_K, 256, 1024, 2, 2, 1, True),  # one slot: every refill waits; x a staged norm (1 / rms on g and u)
    (Q6_K, 256, 512, 3, 2, 4, True),  # more slots than a warp's chunks of one tile
]


@needs_gxx
@pytest.mark.parametrize("qtype,f,k,tokens,kw,stages,staged", SWIGLU_CASES)
def test_ring_stages_swiglu_bitwise(ring_sim, qtype: int, f: int, k: int, tokens: int, kw: int, stages: int,
                                    staged: bool) -> None:
    """gate|up's ring with the SwiGLU staging (gemv_ring_kernel<QT, NT, 1>): bitwise the plain ring launch of the
    same [gate | up] matrix at the same warps followed by pack_silu_kernel's staging of its two halves, whatever the
    block order, from a packed x or a staged norm; and within the ring's tolerance of float64 silu(x W_g) (x W_u)."""
    sim = ring_sim
    rng = np.random.default_rng(qtype * 11 + f + k + tokens + stages)
    raw = random_weights(qtype, 2 * f, k, rng)
    eps, in_ssq = 1e-6, None
    # (x small enough that silu(g) u stays inside fp16: the random weights' rows are large)
    if staged:  # x = rms_norm(s) * w staged by a product before (its per-tile sums of s^2)
        s = (rng.standard_normal((tokens, k)) * 2.0).astype(np.float32)
        nw = (0.01 + 0.0025 * rng.standard_normal(k)).astype(np.float32)
        xq, in_ssq = staged_norm_twin(s, nw)
        s64 = s.astype(np.float64)
        x64 = s64 / np.sqrt((s64 * s64).mean(axis=1, keepdims=True) + eps) * nw
    else:
        x = (rng.standard_normal((tokens, k)) * 0.005).astype(np.float16)
        _, xq = sim_pack(sim, x, q16=True)
        x64 = x.astype(np.float64)
    gu, _, _ = run_ring_staged(sim, qtype, raw, 2 * f, k, xq, tokens, kw, stages, in_ssq=in_ssq, eps=eps)
    want = sim_pack_silu(sim, gu[:, :f], gu[:, f:])
    for seed in (0, 7):
        got = run_ring_swiglu(sim, qtype, raw, k, xq, tokens, kw, stages, in_ssq=in_ssq, eps=eps, seed=seed)
        assert np.array_equal(got, want), seed
    ref = x64 @ quants.dequantize(raw, qtype, (2 * f, k)).astype(np.float64).T
    g64, u64 = ref[:, :f], ref[:, f:]
    h64 = g64 / (1.0 + np.exp(-g64)) * u64
    assert np.abs(h64).max() < 6e4
    rel = np.linalg.norm(q16_values(got, f, tokens) - h64) / np.linalg.norm(h64)
    assert rel < 2 * TOL, f"relative error {rel:.3e}"


@needs_gxx
def test_ring_refuses_what_it_cannot_take(ring_sim) -> None:
    """No staging (x must come from PackedX.q16), F16, zero stages: the harness's launch is refused, not run."""
    sim = ring_sim
    raw = random_weights(Q4_K, 16, 256, np.random.default_rng(0))
    laid = qm.device_layout(Q4_K, raw)
    y = np.zeros((1, 16), np.float32)
    assert sim.sim_gemv_ring(Q4_K, 1, laid.ctypes.data, raw.shape[1], 16, 256, y.ctypes.data, 0, 1, 2, 16, 0,
                             None, None, 0.0, None, None, None) == -1
    assert sim.sim_gemv_ring(F16, 1, laid.ctypes.data, raw.shape[1], 16, 256, y.ctypes.data, 0, 1, 2, 16, 0,
                             laid.ctypes.data, None, 0.0, None, None, None) == -1
    assert sim.sim_gemv_ring(Q4_K, 1, laid.ctypes.data, raw.shape[1], 16, 256, y.ctypes.data, 0, 1, 0, 16, 0,
                             laid.ctypes.data, None, 0.0, None, None, None) == -1


def test_ring_shared_memory_and_choice() -> None:
    # slots: a tile's chunk block (Q4_K 16 x 144, Q6_K 16 x 210, Q8_0 16 x 272) + x units, scales (and sums)
    assert qg.ring_slot_bytes(Q4_K, 1) == 2304 + 512 + 128
    assert qg.ring_slot_bytes(Q6_K, 2) == 3360 + 2 * (512 + 128)
    assert qg.ring_slot_bytes(Q8_0, 1) == 4352 + 512 + 64
    assert qg.ring_smem_bytes(Q4_K, 1, 4, 3) == 4 * 3 * 2944 + 4 * 16 * 4 + 8 * 12 + 16  # + a staged norm's 1 / rms
    assert qg.ring_smem_bytes(Q4_K, 1, 1, 2) == 2 * 2944 + 8 * 2 + 16  # one warp: no partial-sum buffer
    # the LM head (15520 tiles) gets the tall shape; ffn matrices choose_k_warps' warps and RING_STAGES
    assert qg.ring_shape(Q6_K, 248320, 5120, 1, 132) == qg.RING_TALL_SHAPE[1] == (8, 3)
    assert qg.ring_shape(Q6_K, 248320, 5120, 3, 132) == (8, 2)
    assert qg.ring_shape(Q4_K, 34816, 5120, 1, 132) == (qg.choose_k_warps(Q4_K, 34816, 5120, 1, 132), qg.RING_STAGES)
    # one token over 1-4 row tiles a SM (ffn_down, ssm_out: 320 tiles on 132 SMs) takes RING_FEW_SHAPE; two tokens
    # keep choose_k_warps' (8 warps there already); a K of few chunks caps the warps
    assert qg.ring_shape(Q6_K, 5120, 17408, 1, 132) == qg.RING_FEW_SHAPE == (8, 2)
    assert qg.ring_shape(Q4_K, 5120, 6144, 1, 132) == (8, 2)
    assert qg.ring_shape(Q4_K, 5120, 17408, 1, 132) == qg.RING_FEW_DEEP_SHAPE[Q4_K] == (8, 3)   # deep: a third slot
    assert qg.ring_shape(Q4_K, 5120, 17408, 2, 132) == (qg.choose_k_warps(Q4_K, 5120, 17408, 2, 132), qg.RING_STAGES)
    assert qg.ring_shape(Q6_K, 5120, 6144, 1, 132) == (8, 2)
    assert qg.ring_shape(Q6_K, 10240, 5120, 1, 132) == (4, qg.RING_STAGES)   # 640 tiles: 4.8 a SM
    assert qg.ring_shape(Q4_K, 5120, 6144, 2, 132) == (qg.choose_k_warps(Q4_K, 5120, 6144, 2, 132), qg.RING_STAGES)
    assert qg.ring_shape(Q4_K, 5120, 1024, 1, 132) == (4, 2)   # 4 chunks of K: a warp each
    assert qg.ring_shape(Q4_K, 2048, 5120, 1, 132) == (4, 2)   # fewer tiles than SMs

    assert qg.ring_usable(Q4_K, 5120, True)
    assert not qg.ring_usable(Q4_K, 5120, False)  # the pack wrote no staging
    # Q5_K, IQ4_XS (session 40), Q3_K, Q4_0 and IQ4_NL (session 41) take Q4_K's dispatch: the ring up to 3 tokens with
    # the staging, the per-tile kernel at 1 without
    assert qg.ring_usable(Q5_K, 5120, True) and qg.ring_slot_bytes(Q5_K, 1) == 16 * 176 + 512 + 128
    assert qg.ring_usable(Q3_K, 5120, True) and qg.ring_slot_bytes(Q3_K, 1) == 16 * 110 + 512 + 64
    for q in (Q5_K, IQ4_XS, Q3_K, Q4_0, IQ4_NL):
        assert [qg.prefer_gemv(q, 5120, t, q16=True) for t in range(1, 6)] == [True] * 3 + [False] * 2
        assert [qg.prefer_gemv(q, 5120, t, q16=False) for t in range(1, 3)] == [True, False]
    assert not qg.ring_usable(Q4_0, 5120 + 32, True)  # a tail chunk
    assert not qg.ring_usable(Q8_0, 5120 + 32, True)  # a tail chunk
    assert not qg.ring_usable(F16, 5120, True)
    for qtype in (Q8_0, Q4_K, Q6_K):
        assert qg.prefer_ring(qtype, 1) == (qg.RING_UP_TO.get(qtype, 0) >= 1)
        assert not qg.prefer_ring(qtype, qg.MAX_TOKENS + 1)


def test_which_products_stage_a_norm() -> None:
    """quant_matmul.can_stage_norm (the model's staged-norm plan asks it per boundary), on the 27B's shapes and
    the cases it refuses; no GPU: the matrices are stand-ins with the attributes it reads."""
    from types import SimpleNamespace

    def mat(qtype: int, n: int, k: int, kernel: str = "v2") -> SimpleNamespace:
        return SimpleNamespace(qtype=qtype, shape=(n, k), in_features=k, kernel=kernel)

    down, out_proj = mat(Q4_K, 5120, 17408), mat(Q6_K, 5120, 6144)
    gate_up, qkv, head = mat(Q4_K, 34816, 5120), mat(Q6_K, 10240, 5120), mat(Q6_K, 248320, 5120)
    for tokens in (1, 2, 3):   # the ring takes every one of them up to 3 tokens (RING_UP_TO)
        for producer, consumer in ((down, qkv), (down, head), (out_proj, gate_up)):
            assert qm.can_stage_norm(producer, consumer, tokens, sms=132), (producer.shape, consumer.shape, tokens)
    assert not qm.can_stage_norm(down, qkv, 4, sms=132)                        # v2 from 4 tokens: packs
    assert not qm.can_stage_norm(down, mat(Q4_K, 64, 4096), 1, sms=132)        # widths differ
    assert not qm.can_stage_norm(mat(Q4_K, 5120 + 16, 4096), mat(Q4_K, 64, 5120 + 16), 1, sms=132)  # a part chunk
    assert not qm.can_stage_norm(mat(Q4_K, 512, 256), mat(Q4_K, 64, 512), 1, sms=132)   # K of one chunk: one warp
    assert not qm.can_stage_norm(down, mat(F16, 64, 5120), 1, sms=132)         # F16 keeps the per-tile kernel
    assert not qm.can_stage_norm(mat(Q4_K, 5120, 4096, "v1"), qkv, 1, sms=132)  # GGUF rows: no ring
    assert qg.ring_can_stage(Q4_K, 512, 512, 3, sms=132)       # 2 warps hold the 48 (row, token) values
    assert not qg.ring_can_stage(Q4_K, 512, 512, 5, sms=132)   # 80 would need 3


def test_which_products_fuse_swiglu() -> None:
    """quant_matmul.can_fuse_swiglu / quant_gemv.swiglu_shape (the model's plan asks per layer) on the 27B's shapes
    and what they refuse; the SwiGLU ring's shared memory (both tiles' partial sums). No GPU: stand-in matrices."""
    from types import SimpleNamespace

    def mat(qtype: int, n: int, k: int, kernel: str = "v2") -> SimpleNamespace:
        return SimpleNamespace(qtype=qtype, shape=(n, k), in_features=k, kernel=kernel)

    gate_up, down = mat(Q4_K, 34816, 5120), mat(Q4_K, 5120, 17408)
    for tokens in (1, 2, 3):
        assert qm.can_fuse_swiglu(gate_up, down, tokens, sms=132), tokens
        assert qm.can_fuse_swiglu(gate_up, mat(Q6_K, 5120, 17408), tokens, sms=132), tokens  # Q6_K down layers
        # the warps are gate|up's own ring launch's (so g and u are bitwise that launch's), the stages SWIGLU_SHAPE's
        kw, stages = qg.ring_shape(Q4_K, 34816, 5120, tokens, 132)
        assert qg.swiglu_shape(Q4_K, 34816, 5120, tokens, 132) == (kw, qg.SWIGLU_SHAPE.get(tokens, (0, stages))[1])
        # the cluster pairs run gate|up's own launch, SWIGLU_SHAPE or not
        assert qg.swiglu_shape(Q4_K, 34816, 5120, tokens, 132, pair=True) == (kw, stages)
        assert qm.can_fuse_swiglu(gate_up, down, tokens, sms=132, pair=True), tokens
    assert not qm.can_fuse_swiglu(gate_up, down, 4, sms=132)                     # no int16 staging from 4 tokens
    assert not qm.can_fuse_swiglu(gate_up, mat(Q4_K, 5120, 17400), 1, sms=132)   # down does not read F values
    assert not qm.can_fuse_swiglu(mat(Q4_K, 2 * 272, 512), mat(Q4_K, 64, 272), 1, sms=132)  # F % 256: part chunks
    assert not qm.can_fuse_swiglu(mat(Q4_K, 1024, 256), mat(Q4_K, 64, 512), 1, sms=132)     # K of one chunk: 1 warp
    assert not qm.can_fuse_swiglu(mat(F16, 34816, 5120), down, 1, sms=132)        # F16 keeps the per-tile kernel
    assert not qm.can_fuse_swiglu(gate_up, mat(Q8_0, 5120, 17408), 2, sms=132)   # Q8_0 down: v2 from 2 tokens
    assert not qm.can_fuse_swiglu(mat(Q4_K, 34816, 5120, "v1"), down, 1, sms=132)
    assert qg.swiglu_shape(Q4_K, 34816, 5120, 4, 132) is None
    kw, st = 4, 2
    assert (qg.ring_smem_bytes(Q4_K, 1, kw, st, swiglu=True) - qg.ring_smem_bytes(Q4_K, 1, kw, st)
            == kw * 16 * 4)


def test_persistent_grid_and_choice() -> None:
    sms = 132
    # Q4_K ffn_up at T=1, 4 warps of 184 registers: 2 blocks per SM fit (264 slots); 1088 tiles need 5 per block
    # somewhere, so 218 blocks of 5 (the last 3) rather than 264 of 4 or 5
    smem = qg.smem_bytes(Q4_K, 5120, 1, 4, persistent=True)
    assert smem == qg.smem_bytes(Q4_K, 5120, 1, 4) + 4 * 16 * 4
    assert qg.persist_grid(17408, 4, smem, 184, sms) == 218
    assert qg.persist_grid(17408, 4, smem, 184, sms, blocks_per_sm=1) == 121  # 9 tiles each
    # 128 registers: 4 per SM; 363 blocks of 3 would idle more than a quarter of 528 slots: 528 of 2 or 3
    assert qg.persist_grid(17408, 4, smem, 128, sms) == 528
    assert qg.persist_grid(5120, 4, smem, 184, sms) == 264  # 320 tiles: 160 blocks of 2 idle 104 slots
    assert qg.persist_grid(64, 4, smem, 184, sms) == 4  # fewer tiles than slots: one per block
    assert qg.persist_grid(16000, 4, smem, 184, sms) == 250  # 1000 tiles: 250 blocks of 4
    assert not qg.prefer_persistent(F16, 1)
    for qtype in (Q8_0, Q4_K, Q6_K):
        assert qg.prefer_persistent(qtype, 1) == (qg.PERSISTENT_UP_TO.get(qtype, 0) >= 1)
        assert not qg.prefer_persistent(qtype, qg.MAX_TOKENS + 1)


def test_shared_memory_size_and_fit() -> None:
    # staged x (fp16 / int16) + group scales and sums (fp32 per 16 values) + partial sums of the warps
    assert qg.smem_bytes(Q4_K, 5120, 1, 1) == 20 * 512 + 2 * 20 * 64
    assert qg.smem_bytes(Q8_0, 5120, 1, 1) == 20 * 512 + 20 * 64
    assert qg.smem_bytes(F16, 800, 2, 4) == 4 * 2 * 512 + 4 * 16 * 2 * 4
    assert qg.fits(Q4_K, 17408, 2) and not qg.fits(Q4_K, 17408, 3)
    assert qg.fits(Q4_K, 5120, 8) and not qg.fits(Q4_K, 5120, 17)
    assert qg.prefer_gemv(Q4_K, 5120, 1)
    assert not qg.prefer_gemv(Q4_K, 5120, qg.CROSSOVER[Q4_K] + 1)
    # with x's int16 staging the ring takes K-quant products up to RING_UP_TO tokens (K a multiple of 256)
    ring = qg.RING_UP_TO[Q4_K]
    assert ring > qg.CROSSOVER[Q4_K]
    assert qg.prefer_gemv(Q4_K, 5120, ring, q16=True) and not qg.prefer_gemv(Q4_K, 5120, ring + 1, q16=True)
    assert not qg.prefer_gemv(Q4_K, 5120, ring)  # no staging: v2
    assert qm.Q16_TOKENS >= max(qg.RING_UP_TO.values())  # the packs write what the ring reads


def test_k_warps_choice() -> None:
    # 4 warps per block at one token (the LM head too); 8 for wider inputs on matrices of few row tiles
    sms = 132
    assert qg.choose_k_warps(Q6_K, 248320, 5120, 1, sms) == 4
    assert qg.choose_k_warps(Q4_K, 17408, 5120, 1, sms) == 4
    assert qg.choose_k_warps(Q4_K, 17408, 5120, 2, sms) == 4
    assert qg.choose_k_warps(Q4_K, 5120, 17408, 1, sms) == 4
    assert qg.choose_k_warps(Q4_K, 5120, 17408, 2, sms) == 8
    assert qg.choose_k_warps(Q4_K, 16, 256, 1, sms) == 1  # one chunk: one warp
    assert qg.choose_k_warps(Q4_K, 16, 5632, 16, sms) == 4  # with 8, 16 tokens of x and partial sums overflow


def run_split(
    lib, qtype: int, raw: np.ndarray, n_out: int, k: int, x: np.ndarray, kw: int, splits: int, y0=None, ld: int = 0,
    seed: int = 0, scratch=None, q16: bool = False,
) -> np.ndarray:
    """One simulated split-K launch (blocks in grid order, seed = 0, or a permutation seeded with it), into a
    NaN-poisoned output or accumulating into y0, optionally a column slice of [T, ld] rows. scratch: (partial sums,
    counters) to reuse across launches (the launcher's per-stream cache); a fresh NaN-poisoned one otherwise. The
    counters must come back zero (the kernel resets them for the next launch)."""
    tokens = x.shape[0]
    tpad = 8 * ((tokens + 7) // 8)
    laid = qm.device_layout(qtype, raw)
    w = aligned_zeros(laid.nbytes + PAD)
    w[: laid.nbytes] = laid
    xp, xq = sim_pack(lib, x, q16)
    tiles = -(-n_out // 16)
    if scratch is None:
        scratch = (np.full(tiles * splits * kw * 16 * tokens, np.nan, np.float32), np.zeros(tiles, np.uint32))
    part, counters = scratch
    assert part.size >= tiles * splits * kw * 16 * tokens and counters.size >= tiles and not counters.any()
    ld = ld or n_out
    full = np.full((tokens, ld), SENTINEL, np.float32)
    y = full[:, ld - n_out :]
    y[...] = np.nan if y0 is None else y0
    err = lib.sim_gemv_split(
        qtype, tokens, w.ctypes.data, raw.shape[1], n_out, k, xp.ctypes.data, tpad, y.ctypes.data, int(y0 is not None),
        kw, splits, ld, part.ctypes.data, counters.ctypes.data, seed, None if xq is None else xq.ctypes.data,
    )  # fmt: skip
    assert err == 0, "the simulation reported a divergent warp or a deadlock"
    assert not counters.any(), "the arrival counters were not reset for the next launch"
    assert (full[:, : ld - n_out] == SENTINEL).all(), "a column outside the output slice was written"
    return y.copy()


@pytest.fixture(scope="module")
def split_lib(sim) -> ctypes.CDLL:
    sim.sim_gemv_split.restype = ctypes.c_int
    sim.sim_gemv_split.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p,
    ]  # fmt: skip
    return sim


SPLIT_CASES = [
    # qtype, n_out, k, tokens, k_warps, splits: split-K warps = splits x k_warps (<= 8, so gemv_kernel can match it)
    (Q4_K, 77, 1536, 1, 2, 3),  # 5 tiles (the last one partial), 6 chunks over 6 warps
    (Q4_K, 40, 2560, 2, 2, 4),  # 10 chunks over 8 warps: uneven ranges, blocks of 2 or 3 staged chunks
    (Q4_K, 33, 512, 3, 3, 2),  # more warps than chunks: idle warps publish zeros
    (Q5_K, 77, 1536, 1, 2, 3),
    (IQ4_XS, 40, 2560, 2, 2, 4),
    (Q3_K, 77, 1536, 1, 2, 3),
    (Q4_0, 77, 1536, 1, 2, 3),
    (IQ4_NL, 45, 1248, 2, 2, 3),  # a tail chunk of 224 values
    (Q6_K, 50, 1792, 1, 4, 2),
    (Q6_K, 20, 1024, 5, 1, 8),  # one warp per block, more blocks than chunks
    (Q8_0, 45, 1248, 2, 2, 3),  # a tail chunk of 224 values, owned by the last split's last warp
    (Q8_0, 33, 544, 1, 1, 3),  # a tail of 32 values
    (F16, 50, 800, 1, 2, 2),  # F16 with a tail of 32 values
    (F16, 17, 1536, 2, 3, 2),
]


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,kw,splits", SPLIT_CASES)
def test_split_k_matches_twin_and_per_tile_kernel(
    split_lib, qtype: int, n_out: int, k: int, tokens: int, kw: int, splits: int
) -> None:
    """The split-K kernel against the twin and, bit for bit, against gemv_kernel with splits x k_warps warps (the same
    warp ranges and the same addition order), whichever block of a tile arrives last: grid order and two
    permutations; then accumulate and a strided output, and a second launch on the same (reset) scratch."""
    lib = split_lib
    rng = np.random.default_rng(qtype * 71 + n_out + k + tokens + splits)
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    y = run_split(lib, qtype, raw, n_out, k, x, kw, splits)
    check_twin(y, x, raw, qtype, n_out, k)
    assert np.array_equal(y, run_sim(lib, qtype, raw, n_out, k, x, kw * splits))
    for seed in (1, 12345):
        assert np.array_equal(y, run_split(lib, qtype, raw, n_out, k, x, kw, splits, seed=seed))
    y0 = rng.standard_normal((tokens, n_out)).astype(np.float32)
    tiles = -(-n_out // 16)
    scratch = (np.full(tiles * splits * kw * 16 * tokens + 7, np.nan, np.float32), np.zeros(tiles + 3, np.uint32))
    for launch in range(2):  # the counters the first launch leaves behind serve the second
        acc = run_split(lib, qtype, raw, n_out, k, x, kw, splits, y0, ld=n_out + 13, seed=launch * 7, scratch=scratch)
        assert np.array_equal(acc, y0 + y)


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,kw,splits", [c for c in SPLIT_CASES if c[0] != F16][::2])
def test_split_k_from_the_pack_staging_is_bitwise(
    split_lib, qtype: int, n_out: int, k: int, tokens: int, kw: int, splits: int
) -> None:
    """The split-K kernel's blocks copy their chunks of PackedX.q16: bitwise what staging x itself gives."""
    rng = np.random.default_rng(qtype * 17 + n_out + k + tokens + splits)
    raw = random_weights(qtype, n_out, k, rng)
    x = (rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)
    y = run_split(split_lib, qtype, raw, n_out, k, x, kw, splits)
    assert np.array_equal(y, run_split(split_lib, qtype, raw, n_out, k, x, kw, splits, seed=3, q16=True))


def test_split_choice(monkeypatch) -> None:
    sms = 132
    # registers are allocated within each of 4 sub-partitions (cuda_occupancy.h): 117 -> 120 registers, 3840 a warp,
    # 4 warps per 16384-register sub-partition, 16 warps (not 65536 // 3840 = 17)
    assert loader.resident_warps(117) == 16 and loader.resident_warps(128) == 16 and loader.resident_warps(255) == 8
    assert loader.resident_warps(136) == 12 and loader.resident_warps(32) == 64 and loader.resident_warps(1) == 64
    if not qg.SPLIT_UP_TO:  # not dispatched (the H100 decode step was not faster): gemv() keeps one block per tile
        assert qg.choose_split(Q4_K, 5120, 17408, 1, sms, 120, 117) == (1, 0)
    monkeypatch.setattr(qg, "SPLIT_UP_TO", {Q4_K: 2, Q6_K: 2, Q8_0: 2, F16: 2})
    # ffn_down 5120x17408 at one token: 320 tiles of 4 warps (17 chunks each) fill ~61 % of 132 SMs x 16 warps
    # (117-128 registers): split; 2 warps per block fit 8 blocks per SM, 1056 slots, 3 splits (1920 warps)
    assert qg.choose_split(Q4_K, 5120, 17408, 1, sms, 120, 117) == (3, 2)
    assert qg.choose_split(Q6_K, 5120, 17408, 1, sms, 128, 128) == (3, 2)
    # 5120x6144 (ssm_out, attn_output): per-tile warps run 6 chunks, too short to pay for the arrival protocol
    assert qg.choose_split(Q4_K, 5120, 6144, 1, sms, 120, 117) == (1, 0)
    # many tiles: the per-tile kernel already fills the GPU
    assert qg.choose_split(Q4_K, 34816, 5120, 1, sms, 120, 117) == (1, 0)
    assert qg.choose_split(Q6_K, 248320, 5120, 1, sms, 120, 117) == (1, 0)
    # 64 tiles (attn_v 1024x5120): fewer tiles than SMs: 5 splits of 4 warps (1280 warps, as many as 10 x 2)
    assert qg.choose_split(Q6_K, 1024, 5120, 1, sms, 120, 117) == (5, 4)
    # T=2 on ffn_down: the per-tile kernel's 8 warps per block fill the SMs
    assert qg.choose_split(Q8_0, 5120, 17408, 2, sms, 120, 117) == (1, 0)
    # one chunk per tile: nothing to split; wider than SPLIT_UP_TO: never
    assert qg.choose_split(Q4_K, 64, 256, 1, sms, 120, 117) == (1, 0)
    assert qg.choose_split(Q4_K, 1024, 5120, 3, sms, 120, 117) == (1, 0)
    # staged x per block: only its own chunks (plus the 16-byte flag)
    assert qg.split_chunks(6144, 3) == 8 and qg.split_chunks(1248, 3) == 2
    assert qg.smem_split_bytes(Q4_K, 6144, 1, 3) == 16 + 8 * (512 + 128)
    assert qg.smem_split_bytes(F16, 800, 2, 2) == 16 + 2 * 2 * 512
