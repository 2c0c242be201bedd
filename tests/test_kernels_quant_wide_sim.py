"""quant_matmul.cu's wide-token kernel (qmw_kernel) run on the CPU: its portable path compiled as C++ by g++
(tests/cuda_sim_wide.cpp), against the NumPy twins.

No GPU is needed. The simulation runs the real kernel source with every thread of a block a fiber (tests/cuda_sim.h
block mode): the staging of x and weight tiles per chunk through the stage ring with real __syncthreads, the warps'
row tiles, v2's dequantization and fragment order with B read from shared memory, F16 / Q8_0 tail chunks, partial
row blocks past the last tile, the stream-K split of (row block, chunk) items over the blocks with the per-warp
arrival counters and the last warp adding the pieces (blocks run in grid order and in permutations, so any piece can
arrive last), accumulate, a strided output. Plus the launcher's pure-Python parts (kernels/quant_wide.py).

Every test of the `sim` fixture runs twice: on the portable path, and on the sm_90 bulk-copy path that GPUs of compute
capability 9.0 run (-DSPECSPLIT_SIM_BULK: kernels/bulk.cuh simulates cp.async.bulk, the mbarriers' arrival and
transaction counts and phases, and the bulk reduce-adds on the fibers; each copy or add lands when issued or, at
random, only when its mbarrier or its thread's bulk group is waited for), so the producer warp (its weights ahead of
the grid dependency wait, x after), the stage ring's full / empty barriers and the y tile of accumulating launches are
checked without a GPU. What the simulation cannot show: timing and programmatic dependent launch itself (no kernel
runs before this one).
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

from kernels import quant_gemv as qg
from kernels import quant_matmul as qm
from kernels import quant_wide as qw
from services.engine import quants
from tests.quant_twins import random_weights

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "kernels" / "quant_matmul.cu"
HARNESS = Path(__file__).resolve().parent / "cuda_sim_wide.cpp"

F16, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, Q4_0, IQ4_NL = 1, 8, 11, 12, 13, 14, 23, 2, 20
PAD = 1024
TOL = 2e-3  # v2's numerics: fp16 x and fp16-rounded weights (~3e-4)
SMEM_CANARY = 0xA5  # the harness fills shared memory with it before every block

needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None or not sys.platform.startswith("linux"),
    reason="the CPU simulation of the CUDA kernels needs g++ on Linux (ucontext fibers)",
)


@pytest.fixture(scope="session", params=["portable", "bulk"])
def sim(request, tmp_path_factory) -> ctypes.CDLL:
    """The simulation library: the kernels' portable path, or (bulk) their sm_90 path with kernels/bulk.cuh's bulk
    copies, mbarriers and reduce-adds simulated (-DSPECSPLIT_SIM_BULK: qmw_kernel with its producer warp, v2 with its
    per-warp mbarrier rings, accumulating launches through the y tile)."""
    return build_sim(tmp_path_factory, request.param)


_BUILT: dict[tuple[str, str], ctypes.CDLL] = {}  # one g++ build (~30 s) a variant and set of defines, per session


def build_sim(tmp_path_factory, variant: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """sim's library for a variant ("portable" / "bulk"), with extra -D defines (the kernels' compile-time knobs); a
    build asked for again (the sim fixture's by test_wgmma_build_on_cpu) is the same library."""
    parts = (SOURCE, *sorted(SOURCE.parent.glob("*.cuh")), HARNESS,
             HARNESS.with_name("cuda_sim.h"), HARNESS.with_name("cuda_sim_pack.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts) + repr(defines).encode()).hexdigest()[:16]
    if (variant, digest) in _BUILT:
        return _BUILT[variant, digest]
    lib_path = tmp_path_factory.mktemp("cuda_sim_wide") / f"cuda_sim_wide_{variant}_{digest}.so"
    bulk = ["-DSPECSPLIT_SIM_BULK"] if variant == "bulk" else []
    cmd = [
        "g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w", *bulk, *(f"-D{d}" for d in defines),
        f'-DQMM_SOURCE="{SOURCE}"', "-o", str(lib_path), str(HARNESS),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"g++ failed:\n{done.stderr[-4000:]}"
    lib = ctypes.CDLL(str(lib_path))
    I, LL, P, ULL = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_ulonglong
    lib.sim_qmw.restype = I
    lib.sim_qmw.argtypes = [I, I, I, I, I, P, LL, I, I, P, I, P, I, LL, P, P, I, ULL, I]
    lib.sim_wide_peek.restype = None
    lib.sim_wide_peek.argtypes = [I]
    lib.sim_v2_ytile_set.restype = None
    lib.sim_v2_ytile_set.argtypes = [I]
    lib.sim_qmv.restype = I
    lib.sim_qmv.argtypes = [I, I, I, I, I, P, LL, I, I, P, I, P, I, LL, I]
    lib.sim_pack.restype = None
    lib.sim_pack.argtypes = [I, P, LL, I, I, I, P]
    lib.sim_pack_silu.restype = None
    lib.sim_pack_silu.argtypes = [P, LL, P, LL, I, I, I, P]
    lib.sim_wide_swiglu.restype = None
    lib.sim_wide_swiglu.argtypes = [I]
    lib.smem = np.ctypeslib.as_array((ctypes.c_uint8 * (232 * 1024)).in_dll(lib, "ss_smem"))
    lib.sim_bulk.restype = I
    lib.bulk = bool(lib.sim_bulk())
    assert lib.bulk == (variant == "bulk")
    _BUILT[variant, digest] = lib
    return lib


def aligned_zeros(nbytes: int) -> np.ndarray:
    raw = np.zeros(nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off : off + nbytes]


class Problem:
    """One matrix in the v2 layout (16-byte aligned, with the launcher's slack) and x packed by pack_x_kernel."""

    def __init__(self, lib, qtype: int, n_out: int, k: int, tokens: int, seed: int, f32: bool = False,
                 x_scale: float = 0.5):  # fmt: skip
        rng = np.random.default_rng(seed)
        self.lib, self.qtype, self.n_out, self.k, self.tokens = lib, qtype, n_out, k, tokens
        self.raw = random_weights(qtype, n_out, k, rng)
        laid = qm.device_layout(qtype, self.raw)
        self.w = aligned_zeros(laid.nbytes + PAD)
        self.w[: laid.nbytes] = laid
        self.nt = (tokens + 7) // 8
        self.tpad = 8 * self.nt
        x = rng.standard_normal((tokens, k)) * x_scale
        self.x = x.astype(np.float32 if f32 else np.float16)
        self.xp = aligned_zeros(k * self.tpad * 2)
        lib.sim_pack(int(f32), self.x.ctypes.data, k, tokens, k, self.tpad, self.xp.ctypes.data)
        self.rng = rng

    def reference(self) -> np.ndarray:
        w64 = quants.dequantize(self.raw, self.qtype, (self.n_out, self.k)).astype(np.float64)
        return self.x.astype(np.float16).astype(np.float64) @ w64.T

    def wide(self, mt: int, warps: int, stages: int, blocks: int, *, seed: int = 0, y=None, accumulate: bool = False,
             ld: int = 0, scratch=None, resident: int = 1, wg: bool = False) -> tuple[np.ndarray, tuple]:  # fmt: skip
        """One simulated launch; returns y and the scratch (part, counters) it used (counters checked zero after).
        resident > 1: that many blocks in flight at once, interleaved (seeded by seed). wg: a wgmma build's library
        (its stages' shared memory)."""
        if y is None:
            y = np.full((self.tokens, self.n_out), np.nan, np.float32)  # poison: unwritten elements stay NaN
        if scratch is None:
            nrb = qw.row_blocks(self.n_out, mt, warps)
            part = np.full(qw.scratch_floats(blocks, self.nt, mt, warps), np.nan, np.float32)
            scratch = (part, np.zeros(nrb * warps, np.uint32))
        part, counters = scratch
        # (the bulk path adds an accumulating launch's sums into y through a tile a warp after the stages)
        smem = qw.smem_bytes(self.qtype, self.nt, mt, warps, stages, ytile=self.lib.bulk and accumulate, wg=wg)
        err = self.lib.sim_qmw(self.qtype, self.nt, mt, warps, stages, self.w.ctypes.data, self.raw.shape[1],
                               self.n_out, self.k, self.xp.ctypes.data, self.tokens, y.ctypes.data, int(accumulate),
                               ld, part.ctypes.data, counters.ctypes.data, blocks, seed, resident)  # fmt: skip
        assert err == 0, "simulation error (divergent warp or deadlock)"
        assert not counters.any(), "the arrival counters must be left zero"
        # the kernel stays inside the shared memory the launcher reserves (last block run)
        assert (self.lib.smem[smem:] == SMEM_CANARY).all(), "shared memory written past smem_bytes()"
        return y, scratch

    def v2(self, mt: int, kw: int = 1, y0: np.ndarray | None = None, groups: int = 0) -> np.ndarray:
        """v2 (qmv_kernel) with `groups` persistent blocks (0: a row group each); y0: accumulate into a copy of it."""
        y = np.full((self.tokens, self.n_out), np.nan, np.float32) if y0 is None else y0.copy()
        groups = groups or -(-self.n_out // (16 * mt))
        err = self.lib.sim_qmv(self.qtype, self.nt, mt, kw, 2, self.w.ctypes.data, self.raw.shape[1], self.n_out,
                               self.k, self.xp.ctypes.data, self.tokens, y.ctypes.data, int(y0 is not None), 0,
                               groups)  # fmt: skip
        assert err == 0
        return y


def check_twin(p: Problem, y: np.ndarray) -> None:
    bad = ~np.isfinite(y)
    assert not bad.any(), f"{int(bad.sum())} outputs unwritten"
    ref = p.reference()
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < TOL, f"relative error {rel:.3e}"


def pieces(n_out: int, k: int, mt: int, warps: int, blocks: int) -> list[int]:
    """Blocks sharing each row block under the kernel's stream-K split (NumPy restatement of its arithmetic)."""
    nch = -(-k // 256)
    total = qw.row_blocks(n_out, mt, warps) * nch
    start = [b * total // blocks for b in range(blocks + 1)]
    return [sum(1 for b in range(blocks) if start[b] < (rb + 1) * nch and start[b + 1] > rb * nch)
            for rb in range(total // nch)]  # fmt: skip


CASES = [
    # qtype, n_out, k, tokens, (m_tiles, warps, stages, blocks)
    (Q4_K, 64, 1024, 16, (2, 2, 3, 1)),  # one block walks both row blocks whole
    (Q4_K, 100, 1280, 23, (2, 4, 2, 3)),  # a partial row block (100 rows), 5 chunks split 3 ways
    (Q4_K, 48, 768, 41, (1, 3, 4, 2)),  # 3 warps, 4 stages
    (Q4_K, 37, 512, 9, (2, 1, 2, 5)),  # one warp per block, more blocks than row blocks
    (Q6_K, 80, 768, 64, (2, 2, 2, 4)),  # all 8 token tiles
    (Q6_K, 20, 1024, 31, (1, 2, 3, 3)),  # 2 tiles, the second partial
    (Q6_K, 130, 512, 5, (1, 8, 2, 2)),  # 8 warps, 9 tiles: one row block of 8 plus one of 1
    (Q8_0, 33, 1248, 17, (2, 2, 3, 4)),  # tail chunk of 224 values
    (Q8_0, 45, 544, 48, (1, 2, 2, 3)),  # tail of 32 values
    (Q8_0, 20, 32, 12, (2, 1, 2, 1)),  # only a tail chunk
    (F16, 50, 800, 27, (2, 2, 2, 3)),  # tail of 32 values
    (F16, 40, 256, 2, (1, 2, 3, 7)),  # 2 items over 7 blocks: five blocks have nothing to do
    # more blocks than items, row blocks of 9 chunks: the split is over the first 63 blocks only, so no block without
    # items sits between the sharers of a row block (H100, 2026-11-26: before the fix no warp became the writer, the
    # output stayed unwritten and the counters nonzero for the next launch)
    (Q4_K, 200, 2304, 9, (1, 2, 2, 1000)),
]


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,cfg", CASES)
def test_wide_kernel_matches_twin_on_cpu(sim, qtype, n_out, k, tokens, cfg) -> None:
    p = Problem(sim, qtype, n_out, k, tokens, seed=qtype * 131 + n_out + k + tokens)
    y, _ = p.wide(*cfg)
    check_twin(p, y)


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,mt,warps", [(Q4_K, 70, 1024, 19, 2, 2), (Q6_K, 48, 512, 40, 1, 3),
                                                           (Q8_0, 33, 1248, 9, 2, 2), (F16, 40, 544, 64, 1, 2)])
def test_whole_row_blocks_equal_v2_bitwise_on_cpu(sim, qtype, n_out, k, tokens, mt, warps) -> None:
    """With one block per row block (every row block a single piece) each output is summed exactly as v2 with one
    K-warp sums it: same dequantization, same mma step order, chunks in order."""
    p = Problem(sim, qtype, n_out, k, tokens, seed=n_out * 7 + k)
    blocks = qw.row_blocks(n_out, mt, warps)
    assert max(pieces(n_out, k, mt, warps, blocks)) == 1
    y, _ = p.wide(mt, warps, 2, blocks, seed=3)
    ref = p.v2(mt, kw=1)
    assert np.array_equal(y, ref)
    assert np.array_equal(y, p.v2(3 - mt, kw=1))  # v2's m_tiles does not change a sum either
    check_twin(p, y)


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,cfg", [(Q4_K, 100, 2048, 23, (2, 2, 3, 7)),
                                                      (Q6_K, 40, 1280, 33, (1, 3, 2, 4)),
                                                      (F16, 64, 800, 9, (2, 1, 2, 5)),
                                                      (Q4_K, 64, 4096, 23, (1, 4, 3, 7)),
                                                      (Q4_K, 128, 2048, 20, (1, 4, 2, 6))])
def test_split_row_blocks_are_deterministic_on_cpu(sim, qtype, n_out, k, tokens, cfg) -> None:
    """Row blocks shared by several blocks: the last warp to arrive adds the pieces in block order, so the output is
    bitwise the same whichever piece arrives last (grid order and permutations), and a second launch on the same
    scratch (counters left zero) repeats it. (Q4_K at 17..24 tokens, one m16 tile a warp: the writer loads the pieces
    two at a time, QmwPieceGroup; 7 and 3-4 pieces a row block.)"""
    mt, warps, stages, blocks = cfg
    assert max(pieces(n_out, k, mt, warps, blocks)) >= 2
    p = Problem(sim, qtype, n_out, k, tokens, seed=k + tokens)
    y0, scratch = p.wide(*cfg)
    check_twin(p, y0)
    for seed in (1, 2, 0xBEEF):
        y, scratch = p.wide(*cfg, seed=seed, scratch=scratch)
        assert np.array_equal(y, y0), f"block order {seed}"
    # the same sum in float64 terms: pieces added in block order (within rounding of the v2 single-warp sum, whose
    # absolute size follows the outputs': fp32 sums of terms up to ~max |y|)
    np.testing.assert_allclose(y0, p.v2(mt), rtol=1e-4, atol=1e-6 * max(100.0, float(np.abs(y0).max())))


@needs_gxx
def test_pieces_two_at_a_time_at_more_token_tiles_on_cpu(sim, tmp_path_factory) -> None:
    """The writer's pieces loaded two at a time at 4 and 5 token tiles too (quant_wide.PIECE_GROUP_TILES, the
    SS_QMW_PG2_* masks): bitwise the default build's output (one at a time there) on row blocks of 2..5 pieces,
    blocks one at a time and interleaved; on the portable path and the sm_90 bulk one alike."""
    pg = build_sim(tmp_path_factory, "bulk" if sim.bulk else "portable",
                   ("SS_QMW_PG2_Q4K=56", "SS_QMW_PG2_Q6K=48", "SS_SIM_BASE_TYPES"))
    for qtype, n_out, k, tokens, cfg in ((Q4_K, 64, 2048, 29, (1, 4, 3, 7)), (Q6_K, 48, 1536, 36, (1, 3, 3, 5)),
                                         (Q4_K, 96, 1280, 40, (1, 2, 2, 9))):  # fmt: skip
        assert max(pieces(n_out, k, *cfg[:2], cfg[3])) >= 3
        want, _ = Problem(sim, qtype, n_out, k, tokens, seed=k + tokens).wide(*cfg)
        p = Problem(pg, qtype, n_out, k, tokens, seed=k + tokens)
        got, scratch = p.wide(*cfg)
        assert np.array_equal(got, want), (qtype, tokens)
        got, _ = p.wide(*cfg, seed=5, scratch=scratch, resident=4)
        assert np.array_equal(got, want), (qtype, tokens, "interleaved")


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,cfg,resident", [(Q4_K, 100, 2048, 23, (2, 2, 3, 7), 4),
                                                               (Q6_K, 40, 1280, 33, (1, 3, 2, 4), 4),
                                                               (Q8_0, 45, 1248, 9, (1, 2, 2, 11), 3),
                                                               (F16, 64, 800, 9, (2, 1, 2, 5), 5),
                                                               (Q4_K, 200, 2304, 9, (1, 2, 2, 1000), 8),
                                                               (Q4_K, 128, 2048, 20, (1, 4, 2, 4), 4)])
def test_interleaved_blocks_on_cpu(sim, qtype, n_out, k, tokens, cfg, resident) -> None:
    """Blocks in flight together as on the GPU, interleaved at every barrier, atomic and fence (simb::run_grid): a
    block paused between storing its piece and counting itself in, or between counting in and reading the others'
    pieces, while other blocks store, count, add up and reset the counter. The output is bitwise the one-at-a-time
    output whatever the interleaving, and every launch leaves the counters zero for the next on the same scratch. The
    pieces are poisoned before each launch (a stale piece of the previous launch would hide a read before its store;
    storing after counting in, for one, fails here and passes one block at a time). The same with the peek
    (quant_wide.PEEK: a block's last row block added up at once when the one other sharer's pieces are in) on and
    off: the same bits whichever path each warp takes."""
    mt, warps, stages, blocks = cfg
    assert max(pieces(n_out, k, mt, warps, min(blocks, qw.row_blocks(n_out, mt, warps) * -(-k // 256)))) >= 2
    p = Problem(sim, qtype, n_out, k, tokens, seed=3 * k + tokens)
    y0, (part, counters) = p.wide(*cfg)
    check_twin(p, y0)
    try:
        for peek in (1, 0):
            sim.sim_wide_peek(peek)
            for seed in (1, 2, 3, 0xC0FFEE):
                part[:] = np.nan
                y, _ = p.wide(*cfg, seed=seed, scratch=(part, counters), resident=resident)
                assert np.array_equal(y, y0), f"interleaving {seed}, peek {peek}"
    finally:
        sim.sim_wide_peek(1)


@needs_gxx
@pytest.mark.parametrize("blocks,n_out", [(1, 72), (3, 72), (1, 264)])
def test_accumulate_and_strided_output_on_cpu(sim, blocks, n_out) -> None:
    """accumulate=True adds the finished sum once (bitwise y0 + the product, split or not); a product into a column
    slice of wider rows (row stride ldy) equals the contiguous one and leaves the other columns alone. (264 rows in
    one block: on the bulk path each warp adds through its y tile several times, so a tile rewritten before its
    earlier adds have read it would show.)"""
    k, tokens, cfg = 1024, 21, (2, 2, 2, blocks)
    p = Problem(sim, Q4_K, n_out, k, tokens, seed=blocks)
    plain, _ = p.wide(*cfg, seed=blocks)
    y0 = p.rng.standard_normal((tokens, n_out)).astype(np.float32)
    acc, _ = p.wide(*cfg, y=y0.copy(), accumulate=True)
    assert np.array_equal(acc, y0 + plain)
    ld, off = n_out + 19, 11
    for ref, flag in ((plain, False), (acc, True)):
        wide = np.full((tokens, ld), 7.25, np.float32)
        wide[:, off : off + n_out] = y0 if flag else np.nan
        p.wide(*cfg, y=wide[:, off:], accumulate=flag, ld=ld, seed=7)
        assert np.array_equal(wide[:, off : off + n_out], ref)
        assert (wide[:, :off] == 7.25).all() and (wide[:, off + n_out :] == 7.25).all()


@needs_gxx
@pytest.mark.parametrize("kw", [1, 2])
def test_v2_accumulates_through_its_y_tiles_on_cpu(sim, kw) -> None:
    """v2 adding into y through its warps' y tiles (bulk reduce-adds, the launcher's accumulating launches from two
    token tiles; the bulk build runs them, the portable one its load-add-store): bitwise y0 + the plain product, with
    persistent blocks walking several row groups, so each warp's tile is rewritten between adds."""
    p = Problem(sim, Q4_K, 160, 1024, 21, seed=40 + kw)
    plain = p.v2(1, kw, groups=3)
    y0 = p.rng.standard_normal((p.tokens, p.n_out)).astype(np.float32)
    sim.sim_v2_ytile_set(1)
    try:
        acc = p.v2(1, kw, y0=y0, groups=3)
    finally:
        sim.sim_v2_ytile_set(0)
    assert np.array_equal(acc, y0 + plain)


@needs_gxx
def test_float32_activations_are_rounded_to_fp16_on_cpu(sim) -> None:
    p = Problem(sim, Q6_K, 32, 768, 13, seed=5, f32=True)
    y, _ = p.wide(2, 1, 3, 2)
    check_twin(p, y)


# A launch over a matrix whose device layout (with the launcher's slack) ends right before a guard page: a read past
# it faults, so the launch runs in a child process (a fault is its exit status, not a crashed test run). kernel: "qmv"
# (v2; grid = its persistent blocks) or "qmw" (the wide kernel: warps = kw, stages 2, grid blocks, part / counters
# sized by the parent).
_GUARD_CHILD = r"""
import ctypes, mmap, sys
import numpy as np
lib_path, kernel, w_path, xp_path, y_path = sys.argv[1:6]
qt, nt, mt, kw, n, k, t, row_bytes, grid, part_floats, n_counters = (int(v) for v in sys.argv[6:17])
lib = ctypes.CDLL(lib_path)
I, LL, P, ULL = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_ulonglong
lib.sim_qmv.restype = I
lib.sim_qmv.argtypes = [I, I, I, I, I, P, LL, I, I, P, I, P, I, LL, I]
lib.sim_qmw.restype = I
lib.sim_qmw.argtypes = [I, I, I, I, I, P, LL, I, I, P, I, P, I, LL, P, P, I, ULL, I]
w, xp = np.load(w_path), np.load(xp_path)
page = mmap.PAGESIZE
size = -(-w.nbytes // page) * page
region = mmap.mmap(-1, size + page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
base = ctypes.addressof(ctypes.c_char.from_buffer(region))
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [P, ctypes.c_size_t, I]
assert libc.mprotect(base + size, page, 0) == 0  # PROT_NONE after the buffer
arr = np.frombuffer(region, dtype=np.uint8, count=size)
arr[size - w.nbytes :] = w  # the buffer ends where the guard page begins
y = np.full((t, n), np.nan, np.float32)
W = base + size - w.nbytes
if kernel == "qmv":
    err = lib.sim_qmv(qt, nt, mt, kw, 2, W, row_bytes, n, k, xp.ctypes.data, t, y.ctypes.data, 0, 0, grid)
else:
    part = np.full(part_floats, np.nan, np.float32)
    counters = np.zeros(n_counters, np.uint32)
    err = lib.sim_qmw(qt, nt, mt, kw, 2, W, row_bytes, n, k, xp.ctypes.data, t, y.ctypes.data, 0, 0,
                      part.ctypes.data, counters.ctypes.data, grid, 0, 1)
np.save(y_path, y)
sys.exit(0 if err == 0 else 3)
"""


def _guarded(sim, tmp_path, p: Problem, kernel: str, mt: int, kw: int, grid: int, part_floats: int = 0,
             n_counters: int = 0) -> np.ndarray:
    for name, arr in (("w", p.w), ("xp", p.xp)):
        np.save(tmp_path / f"{name}.npy", arr)
    args = [sys.executable, "-c", _GUARD_CHILD, sim._name, kernel, str(tmp_path / "w.npy"), str(tmp_path / "xp.npy"),
            str(tmp_path / "y.npy"), *map(str, (p.qtype, p.nt, mt, kw, p.n_out, p.k, p.tokens, p.raw.shape[1], grid,
                                                part_floats, n_counters))]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the launch read past the matrix (exit {done.returncode}): {done.stderr[-2000:]}"
    return np.load(tmp_path / "y.npy")


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k", [(Q4_K, 77, 768), (Q6_K, 48, 512)])
def test_v2_reads_no_tile_past_the_matrix(sim, tmp_path, qtype: int, n_out: int, k: int) -> None:
    """With two m16 tiles a warp, the last row group of a matrix of an odd tile count has one tile: v2 copies that
    one only. (It copied both, reading up to a tile block past the layout and its 1 KiB of slack: harmless where
    the allocation had readable memory after it, an illegal address where it did not.)"""
    p = Problem(sim, qtype, n_out, k, 32, seed=n_out + k)
    assert (-(-n_out // 16)) % 2 == 1
    y = _guarded(sim, tmp_path, p, "qmv", 2, 1, -(-n_out // 32))
    assert np.array_equal(y, p.v2(2)), "the guarded launch differs from the same launch with slack after the matrix"
    check_twin(p, y)


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,mt,warps,blocks", [(Q4_K, 77, 768, 23, 1, 4, 5),
                                                                  (Q6_K, 48, 512, 41, 2, 2, 3),
                                                                  (Q8_0, 45, 1248, 9, 2, 4, 2)])
def test_wide_reads_nothing_past_the_matrix(sim, tmp_path, qtype, n_out, k, tokens, mt, warps, blocks) -> None:
    """The wide kernel's partial last row block (fewer tiles than the block's warps own) and split pieces, the layout
    ending right before a guard page: it copies the row block's tiles that exist, nothing past them."""
    p = Problem(sim, qtype, n_out, k, tokens, seed=n_out + tokens)
    assert (-(-n_out // 16)) % (mt * warps) != 0  # a partial last row block
    part = qw.scratch_floats(blocks, p.nt, mt, warps)
    counters = qw.row_blocks(n_out, mt, warps) * warps
    y = _guarded(sim, tmp_path, p, "qmw", mt, warps, blocks, part, counters)
    assert np.array_equal(y, p.wide(mt, warps, 2, blocks)[0])
    check_twin(p, y)


# --- the launcher's pure-Python parts ---------------------------------------------------------------------------


def test_shared_memory_and_scratch_sizes() -> None:
    # per stage: 512 bytes of packed x per token of the padded width, one tile block per (warp, m tile), 2 mbarriers
    assert qw.smem_bytes(Q4_K, 8, 2, 8, 3) == 3 * (512 * 64 + 16 * 2304 + 16)
    assert qw.smem_bytes(Q6_K, 3, 1, 4, 2) == 2 * (512 * 24 + 4 * 16 * 210 + 16)
    assert qw.chunk_block_bytes(Q8_0) == 16 * 272 and qw.chunk_block_bytes(F16) == 16 * 512
    assert qw.row_blocks(17408, 2, 8) == 68 and qw.row_blocks(5120, 2, 8) == 20 and qw.row_blocks(100, 2, 4) == 1
    assert qw.scratch_floats(132, 8, 2, 8) == 2 * 132 * 256 * 64


@pytest.mark.parametrize("qtype", [F16, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, Q3_K])
@pytest.mark.parametrize("tokens", [1, 9, 23, 41, 64])
def test_default_config_fits(qtype, tokens) -> None:
    for shape in ((17408, 5120), (5120, 17408), (248320, 5120), (48, 5120)):
        cfg = qw.choose_config(qtype, *shape, tokens)
        qw.check(qtype, (tokens + 7) // 8, cfg)
        tall_mt = qw.TALL_SHAPES.get(qtype, {}).get((tokens + 7) // 8, (qw.M_TILES,))[0]
        assert cfg.m_tiles == (tall_mt if shape[0] >= qw.TALL_ROWS else qw.M_TILES)
        assert cfg.blocks_per_sm == 0 and cfg.blocks == 0
        assert cfg.warps * cfg.m_tiles <= max(cfg.m_tiles, -(-shape[0] // 16))  # no block of mostly idle warps


def test_default_config_rules() -> None:
    # the swept H100 defaults: 1 tile x 4 warps, 3 stages at 3 token tiles (17..24 tokens; Q6_K from 9; Q4_K / Q6_K
    # at 25..48 too: 25..32 since session 27, 33..40 since session 30), 2 otherwise; tall matrices 2 stages, 1 tile x 8
    # warps (K-quants: 2 x 4 at 17..40 tokens, 2 x 8 at 41..64)
    for q in (F16, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS):
        s2 = 3 if q == Q6_K else 2
        s46 = 3 if q in (Q4_K, Q5_K, Q6_K, IQ4_XS) else 2  # Q5_K, IQ4_XS as Q4_K (session 40)
        for tokens, stages in ((8, 2), (9, s2), (16, s2), (17, 3), (23, 3), (24, 3), (25, s46), (32, s46), (33, s46),
                               (40, s46), (41, s46), (48, s46), (49, 2), (56, 2), (64, 2)):  # fmt: skip
            assert qw.choose_config(q, 17408, 5120, tokens) == qw.WideConfig(1, 4, stages)
            assert qw.choose_config(q, 5120, 17408, tokens) == qw.WideConfig(1, 4, stages)
            tall = {3: (2, 4), 4: (2, 4), 5: (2, 4), 6: (2, 8), 7: (2, 8), 8: (2, 8)}.get((tokens + 7) // 8, (1, 8))
            tall = tall if q in (Q4_K, Q6_K) else (1, 8)
            assert qw.choose_config(q, 248320, 5120, tokens) == qw.WideConfig(*tall, 2)
            assert qw.choose_config(q, 248320, 5120, tokens, qw.WideConfig(1)).m_tiles == 1  # an override kept
    # the stacked Q4_K gate|up (34816 rows: VERY_HIGH_ROWS) at 6 and 7 token tiles: 2 tiles x 8 warps (sessions 27,
    # 31); the 16480-row DeltaNet input stack, the other widths and types the default
    for tokens, stages in ((41, 3), (48, 3), (49, 2), (56, 2)):
        assert qw.choose_config(Q4_K, 34816, 5120, tokens) == qw.WideConfig(2, 8, stages)
        assert qw.choose_config(Q4_K, 16480, 5120, tokens) == qw.WideConfig(1, 4, stages)
        assert qw.choose_config(Q6_K, 34816, 5120, tokens) == qw.WideConfig(1, 4, stages)
    for tokens in (23, 32, 64):
        assert qw.choose_config(Q4_K, 34816, 5120, tokens).m_tiles == 1
    # a small matrix: no more warps than it has row tiles; overrides kept, the rest filled in
    assert qw.choose_config(Q4_K, 40, 512, 23) == qw.WideConfig(1, 2, 3)
    assert qw.choose_config(Q4_K, 17408, 5120, 64, qw.WideConfig(warps=8, stages=4)) == qw.WideConfig(1, 8, 4)
    assert qw.choose_config(Q4_K, 17408, 5120, 23, qw.WideConfig(2, blocks=9)) == qw.WideConfig(2, 4, 3, 0, 9)
    # an explicit warp count that does not fit at 4 stages falls back through fewer stages
    assert qw.choose_config(F16, 17408, 5120, 64, qw.WideConfig(2, 8)) == qw.WideConfig(2, 8, 2)


def test_grid_and_residency() -> None:
    # 8 warps of 187 registers: one block per SM; 4 warps of 121 registers and 60 KB: three
    assert qw.blocks_per_sm(8, 187, 200_000) == 1
    assert qw.blocks_per_sm(4, 121, 60_000) == 3
    cfg = qw.WideConfig(2, 8, 3)
    assert qw.grid(17408, 5120, cfg, 187, 200_000, 132) == 132
    assert qw.grid(256, 512, cfg, 187, 200_000, 132) == 2  # at most one block per item
    assert qw.grid(17408, 5120, qw.WideConfig(2, 4, 2, blocks_per_sm=2), 121, 60_000, 132) == 264
    assert qw.grid(17408, 5120, qw.WideConfig(2, 4, 2, blocks=77), 121, 60_000, 132) == 77
    # the default at 23 tokens of Q4_K: 4 warps of 81 registers, 3 stages of 21.5 KB: three blocks per SM
    assert qw.blocks_per_sm(4, 81, qw.smem_bytes(Q4_K, 3, 1, 4, 3)) == 3


@pytest.mark.parametrize("tokens", [41, 48])
def test_accumulating_launch_takes_fewer_stages_for_the_y_tile(monkeypatch, tokens: int) -> None:
    """Q6_K ffn_down at 6 token tiles: 3 stages of 38 KB and the 12 KB y tile do not fit two blocks a SM, so an
    accumulating launch takes 2 stages with the tile (ACC_TILE_STAGES); a plain one keeps 3; a config that names its
    stages, or the knob off, keeps them without the tile. The memory plan's scratch_need covers each grid."""

    class _Kernel:
        num_regs = 133

    class _W:
        qtype, shape = Q6_K, (5120, 17408)

    monkeypatch.setattr(qw, "wide_function", lambda *a, **kw: _Kernel())
    monkeypatch.setattr(qm, "sm_count", lambda: 132)
    monkeypatch.setattr(qw, "bulk_adds", lambda portable=False: True)
    monkeypatch.setattr(qw, "producer_warps", lambda portable=False: 1)
    plain = qw.launch_shape(_W(), tokens)
    acc = qw.launch_shape(_W(), tokens, accumulate=True)
    assert plain["config"].stages == 3 and not plain["ytile"]
    assert acc["config"].stages == 2 and acc["ytile"] and acc["blocks"] >= plain["blocks"] == 264
    assert acc["smem"] == qw.smem_bytes(Q6_K, 6, 1, 4, 2, ytile=True)
    forced = qw.launch_shape(_W(), tokens, qw.WideConfig(stages=3), accumulate=True)
    assert forced["config"].stages == 3 and not forced["ytile"]
    part, _ = qw.scratch_need(Q6_K, 5120, 17408, tokens, 132)
    for shape in (plain, acc, forced):
        assert part >= qw.scratch_floats(shape["blocks"], 6, 1, 4)
    monkeypatch.setattr(qw, "ACC_TILE_STAGES", False)
    off = qw.launch_shape(_W(), tokens, accumulate=True)
    assert off["config"].stages == 3 and not off["ytile"]
    # Q4_K's 3 stages leave room for the tile: unchanged
    _W.qtype = Q4_K
    monkeypatch.setattr(qw, "ACC_TILE_STAGES", True)
    q4 = qw.launch_shape(_W(), tokens, accumulate=True)
    assert q4["config"].stages == 3 and q4["ytile"]


def test_residency_counts_sub_partitions() -> None:
    # 136 registers (4352 a warp): 3 warps per 16384-register sub-partition, 12 per SM: 3 blocks of 4 warps, but 2 of
    # 5 (a 65536-register pool would have fit 3 of 5, one block of which then waits for a second wave)
    assert qw.blocks_per_sm(4, 136, 60_000) == 3 and qw.blocks_per_sm(5, 136, 60_000) == 2
    assert qw.blocks_per_sm(9, 108, 60_000) == 1 and qw.blocks_per_sm(8, 108, 60_000) == 2
    assert qw.blocks_per_sm(1, 32, 0) == 32  # the block limit


@pytest.mark.parametrize("regs,tokens,fit", [(134, 41, 2), (148, 64, 2), (96, 23, 3), (85, 16, 4)])
def test_grid_counts_the_producer_warp(monkeypatch, regs: int, tokens: int, fit: int) -> None:
    """The producer warp holds a computing warp's registers: the grid is what one SM holds of blocks with it (at 41
    tokens 134 registers fit 3 blocks of 4 warps but 2 of 5; at 16, 85 registers 5 of 4 but 4 of 5; at 23 and 64
    shared memory decides)."""

    class _Kernel:
        num_regs = regs

    class _W:
        qtype, shape = Q4_K, (17408, 5120)

    monkeypatch.setattr(qw, "wide_function", lambda *a, **kw: _Kernel())
    monkeypatch.setattr(qm, "sm_count", lambda: 132)
    for producer in (1, 0):
        monkeypatch.setattr(qw, "producer_warps", lambda portable=False, p=producer: p)
        shape = qw.launch_shape(_W(), tokens)
        assert shape["producer"] == producer and shape["config"].warps == 4
        assert shape["blocks"] == 132 * qw.blocks_per_sm(4 + producer, regs, shape["smem"])
        if producer:
            assert shape["blocks"] == 132 * fit


def test_dispatch_widths() -> None:
    for q in (F16, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, Q3_K, Q4_0, IQ4_NL):
        assert qw.CROSSOVER[q] > qg.CROSSOVER[q]  # gemv keeps its widths
        assert not qw.prefer_wide(q, qw.CROSSOVER[q] - 1) and qw.prefer_wide(q, qw.CROSSOVER[q])
        assert qw.prefer_wide(q, 64) and not qw.prefer_wide(q, 65)
        deep_first = qw.DEEP_CROSSOVER.get(q, qw.CROSSOVER[q])
        for shape, first in (((5120, 17408), deep_first), ((248320, 5120), qw.TALL_CROSSOVER.get(q, deep_first))):
            assert qg.CROSSOVER[q] < first <= qw.CROSSOVER[q]  # deep from DEEP_CROSSOVER, tall from TALL_CROSSOVER
            assert not qw.prefer_wide(q, first - 1, *shape) and qw.prefer_wide(q, first, *shape)
        # the projections and small deep matrices (attn_v 1024 x 5120: DEEP_MIN_ROWS): CROSSOVER
        for shape in ((5120, 6144), (6240, 5120), (10239, 5120), (8192, 16383), (1024, 5120), (2047, 5120)):
            assert not qw.prefer_wide(q, qw.CROSSOVER[q] - 1, *shape) and qw.prefer_wide(q, qw.CROSSOVER[q], *shape)
        mid_first = qw.MID_CROSSOVER.get(q, qw.CROSSOVER[q])
        assert qg.CROSSOVER[q] < mid_first <= qw.CROSSOVER[q]
        for shape in ((10240, 5120), (13312, 5120), (14336, 5120), (16383, 5120)):  # q|k|v, q|k, attn_qkv: MID_
            assert not qw.prefer_wide(q, mid_first - 1, *shape) and qw.prefer_wide(q, mid_first, *shape)
        high_first = qw.HIGH_CROSSOVER.get(q, qw.CROSSOVER[q])
        assert qg.CROSSOVER[q] < high_first <= qw.CROSSOVER[q]
        for shape in ((34816, 5120), (17408, 5120), (16384, 5120), (65535, 5120)):  # gate|up, ffn_up: HIGH_CROSSOVER
            assert not qw.prefer_wide(q, high_first - 1, *shape) and qw.prefer_wide(q, high_first, *shape)
    # H100 2026-11-26: v2 up to 24 tokens on ffn_up / ssm_out; the wide kernel from 9 on the K-quants' output matrix;
    # on ffn_down from 24 (Q4_K) / 17 (Q6_K) since v2 lost its per-load index math (from 9 before); F16 from 17;
    # 2026-11-27 (bulk reduce-adds): Q4_K's ffn_down from 17 as well
    assert qw.CROSSOVER[Q4_K] == qw.CROSSOVER[Q6_K] == 25 and qw.TALL_CROSSOVER[Q4_K] == qw.TALL_CROSSOVER[Q6_K] == 9
    # 2026-11-27: high matrices (the stacked gate|up, the DeltaNet input stack) from 17 on the K-quants; session 24:
    # the deep and high ones from 9; session 25 (the wide kernel under PDL): from 4, past the ring's widths
    assert (qw.DEEP_CROSSOVER[Q4_K], qw.DEEP_CROSSOVER[Q6_K]) == (4, 4)
    assert qw.HIGH_CROSSOVER[Q4_K] == qw.HIGH_CROSSOVER[Q6_K] == 4 and qw.HIGH_ROWS == 16384
    assert qw.DEEP_MIN_ROWS == 2048  # session 40: attn_v on v2 up to 24 tokens
    # session 27: the 10240..16383-row stacks (the attention's q|k|v, the DeltaNet attn_qkv kept apart) from 17
    assert qw.MID_CROSSOVER[Q4_K] == qw.MID_CROSSOVER[Q6_K] == 17 and qw.MID_ROWS == 10240
    assert all(qw.HIGH_CROSSOVER[q] > qg.RING_UP_TO[q] for q in (Q4_K, Q5_K, Q6_K, IQ4_XS))
    # session 40: Q5_K and IQ4_XS (their kernels' GPU tests passed) take Q4_K's widths in every table; session 41:
    # Q4_0, IQ4_NL and Q3_K too, but Q3_K's deep and high matrices from 2 tokens (where no int16 staging feeds the
    # ring, the wide kernel beat v2 and its per-tile gemv there)
    tables = (qg.CROSSOVER, qg.RING_UP_TO, qw.CROSSOVER, qw.DEEP_CROSSOVER, qw.TALL_CROSSOVER, qw.HIGH_CROSSOVER,
              qw.MID_CROSSOVER, qw.STAGES3_TILES, qw.WG_TYPES)
    assert all(t[Q5_K] == t[IQ4_XS] == t[Q4_0] == t[IQ4_NL] == t[Q4_K] for t in tables)
    assert all(t[Q3_K] == t[Q4_K] for t in (qg.CROSSOVER, qg.RING_UP_TO, qw.CROSSOVER, qw.TALL_CROSSOVER,
                                           qw.MID_CROSSOVER, qw.STAGES3_TILES, qw.WG_TYPES))
    assert qw.DEEP_CROSSOVER[Q3_K] == qw.HIGH_CROSSOVER[Q3_K] == 2


def test_dispatch_in_the_wgmma_order(monkeypatch) -> None:
    """A pack takes the wgmma order where every product reading it runs the wide kernel and one the wgmma build
    (wg_pack; raw x through matmul's wg_order likewise, raw_wg_order); WG_CROSSOVER moves a type's products of x in
    that order to the wide kernel, and the memory plan's split scratch covers the widths either order dispatches."""
    from types import SimpleNamespace

    from services.engine import memory_plan

    # session 36 (H200): packs in the order from 17 tokens where their products are wide, Q6_K's on the wgmma build
    # from 25, no type moved to the wide kernel by the order
    assert qw.WG_FROM == 17 and qw.WG_TYPES[Q6_K] == 25 and qw.WG_TYPES[Q4_K] == 1 and qw.WG_CROSSOVER == {}
    monkeypatch.setattr(qw.loader, "arch_specific_available", lambda: True)  # (this machine has no GPU)

    def mat(q, rows, k, kernel="v2"):
        return SimpleNamespace(kernel=kernel, qtype=q, shape=(rows, k))

    proj, up, down, head = mat(Q4_K, 5120, 6144), mat(Q4_K, 34816, 5120), mat(Q4_K, 5120, 17408), mat(Q6_K, 248320,
                                                                                                      5120)
    qkv6 = mat(Q6_K, 10240, 5120)
    for m in (proj, up, down, head, qkv6):
        first = max(next(t for t in range(1, 65) if qw.prefer_wide(m.qtype, t, *m.shape)), qw.WG_TYPES[m.qtype])
        assert [t for t in range(1, 65) if qw.wg_pack([m], t)] == list(range(first, 65)), m
        assert [t for t in range(1, 65) if qw.raw_wg_order(m, t)] == list(range(first, 65)), m
    assert not qw.wg_pack([proj], 24) and qw.wg_pack([proj], 25)  # the 5120 x 6144 projection: v2 up to 24
    assert qw.wg_pack([up, down], 4) and not qw.wg_pack([up, proj], 17) and not qw.wg_pack([], 17)
    assert qw.wg_pack([qkv6, up], 17) and not qw.wg_pack([qkv6], 17)  # one product on the wgmma build suffices
    assert not qw.wg_pack([mat(Q4_K, 34816, 5120, "v1")], 23) and not qw.wg_pack([up], 1)  # (gemv's width)
    assert qw.raw_wg_order(proj, 23, kernel="wide") and qw.raw_wg_order(proj, 5, kernel="wide")
    assert qw.raw_wg_order(proj, 23, config=qw.WideConfig(1, 4, 2)) and qw.raw_wg_order(proj, 23,
                                                                                         config=qw.WideConfig())
    for kw in ({"kernel": "v2"}, {"kernel": "gemv"}, {"splits": 2}, {"portable": True},
               {"config": qw.WideConfig(1, 2, 2)}, {"config": qm.QmvConfig(1, 4, 2, 1)}):
        assert not qw.raw_wg_order(up, 23, **kw), kw
    assert not qw.raw_wg_order(mat(Q4_K, 34816, 5120, "v1"), 23)

    # WG_CROSSOVER: x in the order takes the wide kernel from there on any matrix of the type
    monkeypatch.setattr(qw, "WG_CROSSOVER", {Q4_K: 17})
    for shape in ((5120, 6144), (6240, 5120), (10240, 5120), (34816, 5120), (5120, 17408), (248320, 5120)):
        own = next(t for t in range(1, 65) if qw.prefer_wide(Q4_K, t, *shape))
        assert qw.prefer_wide(Q4_K, min(own, 17), *shape, order=1)
        assert not qw.prefer_wide(Q4_K, min(own, 17) - 1, *shape, order=1)
        assert not qw.prefer_wide(Q4_K, 65, *shape, order=1)
        assert [t for t in range(1, 65) if qw.prefer_wide(Q4_K, t, *shape)] == list(range(own, 65))  # (the mma order)
    assert qw.wg_pack([proj], 17) and not qw.prefer_wide(Q6_K, 24, 5120, 6144, order=1)
    assert qw.can_swiglu(SimpleNamespace(kernel="v2", qtype=Q4_K, shape=(2048, 1024)), mat(Q4_K, 1024, 1024), 17, 1)
    assert not qw.can_swiglu(SimpleNamespace(kernel="v2", qtype=Q4_K, shape=(2048, 1024)), mat(Q4_K, 1024, 1024), 17)
    monkeypatch.setattr(qw, "WG_TYPES", {F16: 1, Q8_0: 1})
    assert not qw.wg_pack([proj], 23) and not qw.raw_wg_order(proj, 23)
    monkeypatch.setattr(qw.loader, "arch_specific_available", lambda: False)
    assert not qw.wg_takes(Q8_0, 23) and not qw.wg_pack([mat(Q8_0, 34816, 5120)], 40)

    # the split scratch: a product only the wgmma order puts on the wide kernel is planned for
    memory_plan._split_need.cache_clear()
    monkeypatch.setattr(qw, "CROSSOVER", {**qw.CROSSOVER, Q4_K: 65})  # (the mma order: never wide on this shape)
    monkeypatch.setattr(qw, "WG_CROSSOVER", {})
    without = memory_plan.split_scratch_need([(Q4_K, 5120, 6144)], 132)
    assert without == qg.split_scratch_need(132)
    monkeypatch.setattr(qw, "WG_CROSSOVER", {Q4_K: 17})
    memory_plan._split_need.cache_clear()
    needs = [without] + [qw.scratch_need(Q4_K, 5120, 6144, t, 132) for t in range(17, 65)]
    assert memory_plan.split_scratch_need([(Q4_K, 5120, 6144)], 132) == tuple(map(max, zip(*needs))) != without
    memory_plan._split_need.cache_clear()


def test_stream_k_split_restatement() -> None:
    # ffn_up 17408 rows at 256 rows per block: 68 row blocks x 20 chunks over 132 blocks -> 2 or 3 pieces each
    got = pieces(17408, 5120, 2, 8, 132)
    assert len(got) == 68 and set(got) <= {2, 3}
    assert pieces(17408, 5120, 2, 8, 68) == [1] * 68


def swiglu_launch(p: Problem, warps: int, stages: int, blocks: int, *, seed: int = 0, resident: int = 1,
                  wg: bool = False) -> np.ndarray:  # fmt: skip
    """qmw_kernel<QT, NT, 2, 1> on p's stacked [gate | up] (p.n_out = 2 F rows), simulated: the down product's packed
    x (uint16, F x TPAD halves), every half written (poisoned before), the counters left zero."""
    f = p.n_out // 2
    out = aligned_zeros(f * p.tpad * 2).view(np.uint16)
    out[:] = 0xFFFF  # a NaN no pack writes
    part = np.full(qw.scratch_floats(blocks, p.nt, 2, warps), np.nan, np.float32)
    counters = np.zeros(qw.row_blocks(p.n_out, 2, warps) * warps, np.uint32)
    p.lib.sim_wide_swiglu(1)
    try:
        err = p.lib.sim_qmw(p.qtype, p.nt, 2, warps, stages, p.w.ctypes.data, p.raw.shape[1], p.n_out, p.k,
                            p.xp.ctypes.data, p.tokens, out.ctypes.data, 0, 0, part.ctypes.data, counters.ctypes.data,
                            blocks, seed, resident)  # fmt: skip
    finally:
        p.lib.sim_wide_swiglu(0)
    assert err == 0, "simulation error (divergent warp or deadlock)"
    assert not counters.any(), "the arrival counters must be left zero"
    assert (p.lib.smem[qw.smem_bytes(p.qtype, p.nt, 2, warps, stages, wg=wg):] == SMEM_CANARY).all()
    assert (out != 0xFFFF).all(), f"{int((out == 0xFFFF).sum())} halves unwritten"
    return out


def product_then_pack(p: Problem, warps: int, stages: int) -> np.ndarray:
    """The same through the plain kernel (a block per row block: each tile's sums as any whole-row-block launch forms
    them) and pack_silu_kernel, both simulated."""
    f = p.n_out // 2
    y, _ = p.wide(2, warps, stages, qw.row_blocks(p.n_out, 2, warps))
    ref = aligned_zeros(f * p.tpad * 2).view(np.uint16)
    p.lib.sim_pack_silu(y.ctypes.data, p.n_out, y[:, f:].ctypes.data, p.n_out, p.tokens, f, p.tpad, ref.ctypes.data)
    return ref


def swiglu_twin(p: Problem) -> np.ndarray:
    """float64 silu(g) u [T, F] of the NumPy twin's product."""
    y = p.reference()
    f = p.n_out // 2
    g, u = y[:, :f], y[:, f:]
    return g / (1 + np.exp(-g)) * u


SWIGLU_X = 2e-3  # x's scale in the SwiGLU problems: silu(g) u of the random weights' products well inside fp16
SWIGLU_CASES = [
    # qtype, F, k, tokens, warps, stages
    (Q4_K, 256, 512, 23, 2, 3),  # 16 tile pairs, 8 row blocks
    (Q6_K, 256, 512, 41, 4, 2),  # 6 token tiles, 4 row blocks
    (Q4_K, 256, 256, 64, 3, 2),  # 8 token tiles; 16 pairs over row blocks of 3: the last warps past the last pair
    (Q4_K, 256, 256, 53, 8, 2),  # 7 token tiles (bench/gemv_ab.py w7tiles' shape), 2 row blocks of 8 pairs
    (Q4_K, 512, 512, 5, 1, 4),  # one token tile, 3 padding rows
]


@needs_gxx
@pytest.mark.parametrize("qtype,f,k,tokens,warps,stages", SWIGLU_CASES)
def test_swiglu_launch_is_product_then_pack_bitwise_on_cpu(sim, qtype, f, k, tokens, warps, stages) -> None:
    """Row blocks one block covers: the SwiGLU launch's packed x is bitwise the product's y through pack_silu_kernel
    (padding rows zero as the pack writes them), and within fp16 of the float64 twin."""
    from tests.test_kernels_cpu_sim import unpack_numpy

    p = Problem(sim, qtype, 2 * f, k, tokens, seed=7 * f + k + tokens, x_scale=SWIGLU_X)
    got = swiglu_launch(p, warps, stages, qw.row_blocks(p.n_out, 2, warps))
    assert np.array_equal(got, product_then_pack(p, warps, stages))
    x = unpack_numpy(got, f, p.tpad).astype(np.float64)
    assert (x[tokens:] == 0).all()
    ref = swiglu_twin(p)
    assert np.linalg.norm(x[:tokens] - ref) / np.linalg.norm(ref) < TOL


@needs_gxx
@pytest.mark.parametrize("qtype,f,k,tokens,warps,stages", SWIGLU_CASES[:3])
def test_swiglu_launch_split_is_deterministic_on_cpu(sim, qtype, f, k, tokens, warps, stages) -> None:
    """Row blocks shared by several blocks (pieces through the split scratch, the peek): the same bits whatever the
    order blocks run and arrive in (grid order, permutations, several resident at once), within fp16 of the twin."""
    from tests.test_kernels_cpu_sim import unpack_numpy

    p = Problem(sim, qtype, 2 * f, k, tokens, seed=3 * f + k + tokens, x_scale=SWIGLU_X)
    blocks = 3 * qw.row_blocks(p.n_out, 2, warps) + 1
    first = swiglu_launch(p, warps, stages, blocks)
    for seed, resident in ((5, 1), (13, 4)):
        assert np.array_equal(swiglu_launch(p, warps, stages, blocks, seed=seed, resident=resident), first), seed
    x = unpack_numpy(first, f, p.tpad).astype(np.float64)
    ref = swiglu_twin(p)
    assert (x[tokens:] == 0).all()
    assert np.linalg.norm(x[:tokens] - ref) / np.linalg.norm(ref) < TOL


class _SimKernel:
    """Stands in for the compiled qmw_kernel<QT, NT, MT>: checks each argument's type against the kernel's C
    signature, then runs the launch in the simulation."""

    SIGNATURE = ("ptr", np.int64, np.int32, np.int32, "ptr", np.int32, "ptr", np.int32, np.int32, np.int64, "ptr",
                 "ptr", np.int32, np.int32, np.int32)  # fmt: skip

    def __init__(self, lib, name: str, launches: list):
        qt, nt, mt, *sw = (int(v) for v in name[name.index("<") + 1 : -1].split(","))
        self.lib, self.qt, self.nt, self.mt, self.launches = lib, qt, nt, mt, launches
        self.swiglu = bool(sw and sw[0])
        self.num_regs = 128
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0):
        assert len(args) == len(self.SIGNATURE)
        for a, want in zip(args, self.SIGNATURE):
            assert isinstance(a, np.ndarray) if want == "ptr" else type(a) is want, (a, want)
        W, row_bytes, n, k, xp, tokens, y, stages, accumulate, ldy, part, counters, producer, ytile, peek = args
        assert peek == int(qw.PEEK)
        self.lib.sim_wide_peek(int(peek))
        assert producer == 0 and ytile == 0  # the portable path has no producer warp and no bulk reduce-adds
        (blocks,), (threads,) = grid, block
        self.launches.append({"blocks": blocks, "threads": threads, "smem": shared_mem, "part": part.size,
                              "swiglu": self.swiglu})  # fmt: skip
        assert threads % 32 == 0 and shared_mem <= qw.SMEM_LIMIT
        assert not (self.swiglu and (accumulate or ldy or y.dtype != np.uint16)), "a SwiGLU launch writes packed x"
        self.lib.sim_wide_swiglu(int(self.swiglu))
        try:
            err = self.lib.sim_qmw(self.qt, self.nt, self.mt, threads // 32, int(stages), W.ctypes.data,
                                   int(row_bytes), int(n), int(k), xp.ctypes.data, int(tokens), y.ctypes.data,
                                   int(accumulate), int(ldy), part.ctypes.data, counters.ctypes.data, blocks, 11, 1)
        finally:
            self.lib.sim_wide_swiglu(0)
        assert err == 0
        assert (self.lib.smem[shared_mem:] == SMEM_CANARY).all(), "the launch reserves too little shared memory"


@needs_gxx
@pytest.mark.parametrize("qtype,n_out,k,tokens,config", [(Q4_K, 300, 1536, 23, None), (Q6_K, 96, 1024, 64, None),
                                                          (Q8_0, 45, 1248, 9, qw.WideConfig(1, 2, 3, blocks=4)),
                                                          (F16, 70, 800, 41, qw.WideConfig(2, 2, 2))])
def test_launcher_end_to_end_on_cpu(sim, monkeypatch, qtype, n_out, k, tokens, config) -> None:
    """quant_wide.wide() as the engine calls it, its launch going to the simulation: argument order and types, grid,
    shared memory and scratch sizes, a strided accumulating output."""
    from kernels import loader

    launches: list = []
    monkeypatch.setattr(loader, "get_function", lambda src, name, defines=(), **kw: _SimKernel(sim, name, launches))
    monkeypatch.setattr(qm, "sm_count", lambda: 3)
    monkeypatch.setattr(qm, "_device_id", lambda: 0)
    monkeypatch.setattr(qw, "producer_warps", lambda portable=False: 0)  # the simulated path copies without one
    monkeypatch.setattr(qw, "bulk_adds", lambda portable=False: False)  # ... and adds into y itself
    nrb_max = qw.row_blocks(n_out, 1, 1)
    scratch = (np.full(1 << 22, np.nan, np.float32), np.zeros(nrb_max * 8, np.uint32))
    sizes = []
    monkeypatch.setattr(qg, "split_scratch", lambda tiles, floats: sizes.append((tiles, floats)) or scratch)
    p = Problem(sim, qtype, n_out, k, tokens, seed=k + tokens)
    W = type("W", (), {"shape": (n_out, k), "qtype": qtype, "kernel": "v2", "name": "w", "row_bytes": p.raw.shape[1],
                       "device_buffer": p.w})()  # fmt: skip
    packed = qm.PackedX(p.xp.view(np.uint16), tokens, k)
    y0 = p.rng.standard_normal((tokens, n_out)).astype(np.float32)
    wide = np.full((tokens, n_out + 9), 7.25, np.float32)
    wide[:, 5 : 5 + n_out] = y0
    qw.wide(W, packed, wide[:, 5 : 5 + n_out], accumulate=True, config=config)
    check_twin(p, wide[:, 5 : 5 + n_out] - y0)
    assert (wide[:, :5] == 7.25).all() and (wide[:, 5 + n_out :] == 7.25).all()
    (launch,) = launches
    cfg = qw.choose_config(qtype, n_out, k, tokens, config)
    assert launch["threads"] == 32 * cfg.warps
    assert launch["blocks"] == qw.grid(n_out, k, cfg, 128, launch["smem"], 3)
    assert launch["smem"] == qw.smem_bytes(qtype, (tokens + 7) // 8, cfg.m_tiles, cfg.warps, cfg.stages)
    assert sizes == [(qw.row_blocks(n_out, cfg.m_tiles, cfg.warps) * cfg.warps,
                      qw.scratch_floats(launch["blocks"], (tokens + 7) // 8, cfg.m_tiles, cfg.warps))]  # fmt: skip
    assert not scratch[1].any()


@needs_gxx
@pytest.mark.parametrize("qtype,f,k,tokens,config", [(Q4_K, 256, 512, 23, None), (Q6_K, 256, 512, 41, None),
                                                      (Q4_K, 256, 512, 9, qw.WideConfig(warps=2, stages=3, blocks=5))])
def test_swiglu_launcher_end_to_end_on_cpu(sim, monkeypatch, qtype, f, k, tokens, config) -> None:
    """quant_wide.wide_swiglu() and QuantMatrix.swiglu's wide path as the engine calls them, the launch going to the
    simulation: the SwiGLU kernel instance, its arguments, grid, shared memory and scratch; the packed x it returns
    within fp16 of the twin; its refusals."""
    from kernels import loader
    from tests.test_kernels_cpu_sim import unpack_numpy

    launches: list = []
    monkeypatch.setattr(loader, "get_function", lambda src, name, defines=(), **kw: _SimKernel(sim, name, launches))
    monkeypatch.setattr(loader, "require", lambda: np)
    monkeypatch.setattr(qm, "sm_count", lambda: 3)
    monkeypatch.setattr(qm, "_device_id", lambda: 0)
    monkeypatch.setattr(qw, "producer_warps", lambda portable=False: 0)
    scratch = (np.full(1 << 22, np.nan, np.float32), np.zeros(1 << 12, np.uint32))
    monkeypatch.setattr(qg, "split_scratch", lambda tiles, floats: scratch)
    p = Problem(sim, qtype, 2 * f, k, tokens, seed=f + k + tokens, x_scale=SWIGLU_X)
    W = type("W", (), {"shape": (2 * f, k), "qtype": qtype, "kernel": "v2", "name": "w", "row_bytes": p.raw.shape[1],
                       "device_buffer": p.w})()  # fmt: skip
    down = type("D", (), {"shape": (k, f)})()
    assert qw.can_swiglu(W, down, tokens) == (qw.prefer_wide(qtype, tokens, 2 * f, k)
                                              and (tokens + 7) // 8 in qw.SWIGLU_TILES[qtype])
    assert not qw.can_swiglu(W, down, 8 * max(qw.SWIGLU_TILES[qtype]) + 1)
    assert not qw.can_swiglu(W, down, qm.Q16_TOKENS)
    assert not qw.can_swiglu(W, type("D", (), {"shape": (k, f + 1)})(), 23)  # not the down product of this stack
    packed = qm.PackedX(p.xp.view(np.uint16), tokens, k)
    got = qw.wide_swiglu(W, packed, config=config)
    assert isinstance(got, qm.PackedX) and got.in_features == f and got.tokens == tokens and got.q16 is None
    x = unpack_numpy(got.data, f, p.tpad).astype(np.float64)
    ref = swiglu_twin(p)
    assert (x[tokens:] == 0).all() and np.linalg.norm(x[:tokens] - ref) / np.linalg.norm(ref) < TOL
    (launch,) = launches
    cfg = qw.choose_config(qtype, 2 * f, k, tokens, qw.swiglu_config(qtype, tokens, config))
    assert launch["swiglu"] and cfg.m_tiles == 2
    assert launch["threads"] == 32 * cfg.warps
    assert launch["smem"] == qw.smem_bytes(qtype, (tokens + 7) // 8, 2, cfg.warps, cfg.stages)
    assert not scratch[1].any()
    out = np.zeros(f * p.tpad, np.uint16)
    assert qw.wide_swiglu(W, packed, out=out, config=config).data is out and np.array_equal(out, got.data)
    with pytest.raises(ValueError, match="uint16"):
        qw.wide_swiglu(W, packed, out=np.zeros(f * p.tpad + 8, np.uint16))
    with pytest.raises(ValueError, match="2 tiles a warp"):
        qw.wide_swiglu(W, packed, config=qw.WideConfig(m_tiles=1))
    odd = type("W", (), {"shape": (2 * f + 32, k), "qtype": qtype, "kernel": "v2", "name": "odd"})()
    with pytest.raises(ValueError, match="gate \\| up"):
        qw.wide_swiglu(odd, packed)


def test_scratch_need_covers_the_swiglu_launch() -> None:
    """The memory plan sizes the split scratch by scratch_need: on a [gate | up] stack it bounds the SwiGLU launch's
    partials and counters too (2 tiles a warp: other row blocks and grids than the plain launch's)."""
    for qtype, n_out, k in ((Q4_K, 34816, 5120), (Q6_K, 2048, 1024), (Q4_K, 1024, 4096)):
        for tokens in (t for t in range(1, 65) if qw.swiglu_width(qtype, t)):
            part, counters = qw.scratch_need(qtype, n_out, k, tokens, 132)
            c = qw.choose_config(qtype, n_out, k, tokens, qw.swiglu_config(qtype, tokens))
            smem = qw.smem_bytes(qtype, (tokens + 7) // 8, 2, c.warps, c.stages)
            for regs in (64, 128, 168):
                blocks = qw.grid(n_out, k, c, regs, smem, 132)
                assert qw.scratch_floats(blocks, (tokens + 7) // 8, 2, c.warps) <= part, (n_out, tokens)
            assert qw.row_blocks(n_out, 2, c.warps) * c.warps <= counters


def test_backend_wide_swiglu_rule() -> None:
    """backend.can_wide_swiglu, which the qwen35 GPU step asks: quant_wide.can_swiglu on the uploaded matrices of a
    stacked [gate | up] GpuMatrix and its down GpuMatrix (the 27B's Q4_K shapes), never on anything else."""
    from services.engine.backend import GpuMatrix, can_wide_swiglu

    def gpu(shape: tuple[int, int]) -> GpuMatrix:
        m = GpuMatrix(Q4_K, np.zeros((1, 1), np.uint8), shape, "m")
        m.q = type("Q", (), {"shape": shape, "qtype": Q4_K, "kernel": "v2"})()  # (uploaded: upload() keeps it)
        return m

    gu, down = gpu((34816, 5120)), gpu((5120, 17408))
    # (Q4_K: 1..7 token tiles above the ring, i.e. 4..56 tokens)
    assert [t for t in range(1, 65) if can_wide_swiglu(gu, down, t)] == list(range(qm.Q16_TOKENS + 1, 57))
    assert not can_wide_swiglu(gu, gpu((5120, 17392)), 23)  # not this stack's down product
    assert not can_wide_swiglu(gu.q, down, 23) and not can_wide_swiglu(gu, down.q, 23)  # not GpuMatrix wrappers


def test_swiglu_refuses_a_staged_norm() -> None:
    """QuantMatrix.swiglu's wide path (a WideConfig, or a PackedX above the ring's widths) reads packed fp16 x: a
    StagedNorm (the ring gemv's input) is refused by name rather than packed as if it were activations."""
    fake = type("W", (), {"name": "blk.0.ffn_gate_up"})()
    staged = qm.StagedNorm.__new__(qm.StagedNorm)
    with pytest.raises(ValueError, match="blk.0.ffn_gate_up: a staged norm is read by the ring gemv only"):
        qm.QuantMatrix.swiglu(fake, staged, config=qw.WideConfig())


def test_swiglu_config(monkeypatch) -> None:
    """swiglu_config: 2 tiles a warp always; SWIGLU_SHAPES' warps and stages at their token tiles, else SWIGLU_WARPS
    and choose_config's stages; what the caller's config sets wins."""
    monkeypatch.setattr(qw, "SWIGLU_SHAPES", {Q4_K: {2: (2, 3), 3: (8, 0)}})
    assert qw.swiglu_config(Q4_K, 16) == qw.WideConfig(m_tiles=2, warps=2, stages=3)
    assert qw.swiglu_config(Q4_K, 23) == qw.WideConfig(m_tiles=2, warps=8, stages=0)
    assert qw.swiglu_config(Q4_K, 32) == qw.WideConfig(m_tiles=2, warps=qw.SWIGLU_WARPS, stages=0)
    assert qw.swiglu_config(Q6_K, 16) == qw.WideConfig(m_tiles=2, warps=qw.SWIGLU_WARPS, stages=0)
    assert qw.swiglu_config(Q4_K, 16, qw.WideConfig(warps=4, blocks=7)) == qw.WideConfig(2, 4, 3, blocks=7)
    cfg = qw.choose_config(Q4_K, 34816, 5120, 16, qw.swiglu_config(Q4_K, 16))
    assert (cfg.m_tiles, cfg.warps, cfg.stages) == (2, 2, 3)


@needs_gxx
def test_mma_kernels_read_the_wgmma_order_on_cpu(sim, tmp_path_factory) -> None:
    """Built with SPECSPLIT_XO_WG (quant_wide.wide_function / qm.qmv_function's order 1), the v2 and the mma.sync wide
    kernel read x in the wgmma build's order (quant_wide.wg_order of the pack; tail chunks too) and the SwiGLU launch
    writes its output in it: bit for bit the default build's sums, and its output in that order."""
    xo = build_sim(tmp_path_factory, "bulk" if sim.bulk else "portable", ("SPECSPLIT_XO_WG", "SS_SIM_BASE_TYPES"))
    for qtype, n_out, k, tokens, cfg in (CASES[1], CASES[4], CASES[7], CASES[10], (Q4_K, 64, 2048, 23, (1, 4, 3, 7))):
        seed = qtype * 131 + n_out + k + tokens
        want = Problem(sim, qtype, n_out, k, tokens, seed=seed)
        p = Problem(xo, qtype, n_out, k, tokens, seed=seed)
        p.xp[:] = qw.wg_order(p.xp, p.tpad)
        assert not np.array_equal(p.xp, want.xp)
        assert np.array_equal(p.wide(*cfg)[0], want.wide(*cfg)[0]), (qtype, n_out, k, tokens)
        assert np.array_equal(p.v2(cfg[0], kw=2), want.v2(cfg[0], kw=2)), (qtype, n_out, k, tokens)
    for qtype, f, k, tokens, warps, stages in SWIGLU_CASES[:2]:
        seed = 7 * f + k + tokens
        want = Problem(sim, qtype, 2 * f, k, tokens, seed=seed, x_scale=SWIGLU_X)
        p = Problem(xo, qtype, 2 * f, k, tokens, seed=seed, x_scale=SWIGLU_X)
        p.xp[:] = qw.wg_order(p.xp, p.tpad)
        blocks = qw.row_blocks(p.n_out, 2, warps)
        got = swiglu_launch(p, warps, stages, blocks)
        assert np.array_equal(got, qw.wg_order(swiglu_launch(want, warps, stages, blocks), p.tpad)), (qtype, tokens)


def test_wg_order_twin() -> None:
    """quant_wide.wg_order: per 64-byte (unit pair, token) record, chunk c ^ ((n >> 1) & 3) holds word c of lane t's
    unit at word t; a permutation of the words, tail records included."""
    tpad, records = 24, 11
    x = np.arange(records * tpad * 16, dtype=np.uint32)
    y = qw.wg_order(x.view(np.uint16), tpad).view(np.uint32).reshape(records, tpad, 4, 4)
    src = x.reshape(records, tpad, 4, 4)
    for n in range(tpad):
        for t in range(4):
            for c in range(4):
                assert (y[:, n, c ^ ((n >> 1) & 3), t] == src[:, n, t, c]).all()
    assert np.array_equal(np.sort(y.reshape(-1)), x)


@needs_gxx
def test_wgmma_build_on_cpu(tmp_path_factory) -> None:
    """The wgmma build (SPECSPLIT_QMW_WG) on the simulated sm_90 path: each warp's rows of a wgmma through the mma
    emulation with B read from the stage as its descriptor addresses it (64-byte swizzle, 8-token groups), on x in the
    wgmma order: bit for bit the default build's sums on the mma order, as on the GPU; K-quants (Q5_K, IQ4_XS, Q3_K
    too), tail chunks (Q4_0's and IQ4_NL's too), split row blocks, 4 and 8 warps, interleaved blocks, 3 register sets
    in flight; the SwiGLU launch writes the down product's x in the wgmma order."""
    base = build_sim(tmp_path_factory, "bulk")
    wg = build_sim(tmp_path_factory, "bulk", ("SPECSPLIT_QMW_WG",))
    for qtype, n_out, k, tokens, cfg in ((Q4_K, 100, 1280, 23, (1, 4, 2, 3)), (Q6_K, 80, 768, 64, (2, 4, 2, 4)),
                                         (Q8_0, 33, 1248, 17, (2, 4, 3, 4)), (F16, 50, 800, 27, (1, 8, 2, 3)),
                                         (Q4_K, 64, 2048, 41, (1, 4, 3, 7)), (Q8_0, 20, 32, 5, (1, 4, 2, 1)),
                                         (Q5_K, 100, 1280, 23, (1, 4, 2, 3)), (IQ4_XS, 64, 2048, 41, (1, 4, 3, 7)),
                                         (Q3_K, 100, 1280, 23, (1, 4, 2, 3)),
                                         (Q4_0, 33, 1248, 17, (2, 4, 3, 4)), (IQ4_NL, 45, 1312, 41, (1, 4, 2, 3))):
        seed = qtype * 131 + n_out + k + tokens
        want, _ = Problem(base, qtype, n_out, k, tokens, seed=seed).wide(*cfg)
        p = Problem(wg, qtype, n_out, k, tokens, seed=seed)
        p.xp[:] = qw.wg_order(p.xp, p.tpad)
        got, scratch = p.wide(*cfg, wg=True)
        assert np.array_equal(got, want), (qtype, n_out, k, tokens, cfg)
        got, _ = p.wide(*cfg, seed=5, scratch=scratch, resident=3, wg=True)
        assert np.array_equal(got, want), (qtype, n_out, k, tokens, cfg, "interleaved")
    for qtype, f, k, tokens, warps, stages in ((Q4_K, 256, 512, 23, 4, 3), (Q6_K, 256, 512, 41, 4, 2)):
        seed = 7 * f + k + tokens
        want = swiglu_launch(Problem(base, qtype, 2 * f, k, tokens, seed=seed, x_scale=SWIGLU_X), warps, stages, 4)
        p = Problem(wg, qtype, 2 * f, k, tokens, seed=seed, x_scale=SWIGLU_X)
        p.xp[:] = qw.wg_order(p.xp, p.tpad)
        assert np.array_equal(swiglu_launch(p, warps, stages, 4, wg=True), qw.wg_order(want, p.tpad)), (qtype, tokens)
    deep = build_sim(tmp_path_factory, "bulk", ("SPECSPLIT_QMW_WG", "SS_WG_DEPTH=3", "SS_SIM_BASE_TYPES"))  # WG_DEPTH
    for qtype, n_out, k, tokens, cfg in ((Q6_K, 80, 768, 64, (2, 4, 2, 4)), (Q4_K, 64, 2048, 41, (1, 4, 3, 7))):
        seed = qtype * 131 + n_out + k + tokens
        want, _ = Problem(base, qtype, n_out, k, tokens, seed=seed).wide(*cfg)
        p = Problem(deep, qtype, n_out, k, tokens, seed=seed)
        p.xp[:] = qw.wg_order(p.xp, p.tpad)
        assert np.array_equal(p.wide(*cfg, wg=True)[0], want), (qtype, "depth 3")
    p = Problem(wg, Q4_K, 64, 512, 9, seed=1)
    y = np.full((9, 64), np.nan, np.float32)
    part, counters = np.zeros(4096, np.float32), np.zeros(64, np.uint32)
    assert p.lib.sim_qmw(Q4_K, p.nt, 1, 2, 2, p.w.ctypes.data, p.raw.shape[1], 64, 512, p.xp.ctypes.data, 9,
                         y.ctypes.data, 0, 0, part.ctypes.data, counters.ctypes.data, 1, 0, 1) != 0, \
        "a wgmma launch of 2 warps (not a whole warpgroup) must fail, not compute"


@needs_gxx
@pytest.mark.parametrize("qtype", [Q5_K, IQ4_XS, Q3_K, Q4_0, IQ4_NL], ids=["Q5_K", "IQ4_XS", "Q3_K", "Q4_0", "IQ4_NL"])
def test_new_types_on_the_wide_kernel_on_cpu(sim, qtype) -> None:
    """Q5_K, IQ4_XS, Q3_K, Q4_0 and IQ4_NL through the wide kernel (its dequantization is v2's frag2 and tail_mma, which
    take them): the twin at split and whole row blocks, tail chunks of the 32-value block types, and bit for bit v2 with
    one row-block piece (the wgmma build: test_wgmma_build_on_cpu). The dispatch sends Q5_K and IQ4_XS there since
    their GPU run (session 40), Q3_K, Q4_0 and IQ4_NL since theirs (session 41; a type in UNPROVEN_QTYPES not yet); this
    holds the kernel ready."""
    small = qtype in (Q4_0, IQ4_NL)  # 32-value blocks: K need not be whole super-blocks
    cases = ((100, 1280, 23, (2, 4, 2, 3)), (48, 768, 41, (1, 3, 4, 2))) if not small else (
        (100, 1280, 23, (2, 4, 2, 3)), (45, 544, 41, (1, 3, 4, 2)))  # (a tail of 32 values)
    for n_out, k, tokens, cfg in cases:
        p = Problem(sim, qtype, n_out, k, tokens, seed=131 * qtype + n_out + k + tokens)
        y, _ = p.wide(*cfg)
        check_twin(p, y)
    p = Problem(sim, qtype, 70, 1248 if small else 1024, 19, seed=5)  # (a tail of 224 values)
    blocks = qw.row_blocks(70, 2, 2)
    y, _ = p.wide(2, 2, 2, blocks, seed=3)
    assert np.array_equal(y, p.v2(2, kw=1))


def test_weight_copies_policy_reaches_every_product_build(monkeypatch) -> None:
    """quant_matmul.WEIGHTS_EVICT_FIRST switches the evict-first L2 policy of the weight copies (kernels/bulk.cuh
    bulk_g2s_once_s) in every product kernel's build, the ring gemv's, v2's and the wide kernel's, so their modules'
    keys differ with it (bench/gemv_ab.py --step-ab evict compares two builds, not one)."""
    src = (Path(__file__).resolve().parents[1] / "kernels" / "bulk.cuh").read_text()
    assert "SPECSPLIT_WEIGHTS_EVICT_FIRST" in src and ".L2::cache_hint" in src
    for on in (True, False):
        monkeypatch.setattr(qm, "WEIGHTS_EVICT_FIRST", on)
        for defines in (qg._defines(False), qm._defines(False), qw._defines(False), qm._defines(True)):
            assert ("SPECSPLIT_WEIGHTS_EVICT_FIRST" in defines) == on
