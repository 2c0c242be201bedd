"""GPU wide-token kernel (quant_matmul.cu's qmw_kernel, launched by kernels/quant_wide.py) against the NumPy twins.

Needs CuPy and a CUDA GPU; skipped (with the reason) anywhere else (tests/test_kernels_quant_wide_sim.py runs the
same kernel source on the CPU). Outputs are poisoned with NaN first; the bound is v2's, ||y - x @ dequantize(W).T|| /
||ref|| < 2e-3 (fp16 x and fp16-rounded weights: ~3e-4), in float64. Also: launch shapes and stream-K splits, row
blocks one block covers bitwise equal to v2 with one K-warp, bitwise reproducibility across launches and CUDA-graph
replays (the split scratch's counters reset themselves), strided / accumulating outputs, the portable build, the
automatic dispatch.
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
    MATMUL_CASES,
    NAMES,
    case_id,
    check_matmul,
    check_strided_out,
    dequantize,
    gpu_matmul,
    random_weights,
    rel_error,
)

pytestmark = pytest.mark.gpu

TYPES = (qm.Q4_K, qm.Q5_K, qm.IQ4_XS, qm.Q3_K, qm.Q6_K, qm.Q8_0, qm.F16, qm.Q4_0, qm.IQ4_NL)
BLOCKS32 = (qm.Q8_0, qm.Q4_0, qm.IQ4_NL)  # the 32-value block types: K need not be whole super-blocks
TOL = 2e-3
WIDTHS = (1, 5, 8, 9, 13, 16, 17, 23, 31, 32, 33, 41, 47, 48, 57, 64)


def run(W: qm.QuantMatrix, x, y0: np.ndarray | None = None, **kw) -> np.ndarray:
    return gpu_matmul(W, x, y0, **kw)


def check(W: qm.QuantMatrix, w64: np.ndarray, tokens: int, rng: np.random.Generator, label: str, **kw) -> np.ndarray:
    return check_matmul(W, w64, tokens, rng, label, TOL, **kw)




def _matrix(qtype: int, shape: tuple[int, int], rng: np.random.Generator) -> tuple[qm.QuantMatrix, np.ndarray]:
    raw = random_weights(qtype, *shape, rng)
    return qm.QuantMatrix(qtype, raw, shape, name=f"{NAMES[qtype]} {shape}"), dequantize(qtype, raw, *shape)


@pytest.mark.parametrize("qtype,shape", MATMUL_CASES, ids=case_id)
def test_matches_twin_at_every_width(qtype: int, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(2000 * qtype + shape[0] + shape[1])
    W, w64 = _matrix(qtype, shape, rng)
    for tokens in WIDTHS:
        check(W, w64, tokens, rng, W.name, kernel="wide")


SHAPES = [
    qw.WideConfig(),  # the default for the width
    qw.WideConfig(2, 8, 3),
    qw.WideConfig(1, 4, 2),
    qw.WideConfig(2, 2, 4),
    qw.WideConfig(1, 8, 3, blocks_per_sm=1),
    qw.WideConfig(2, 4, 2, blocks_per_sm=2),
    qw.WideConfig(2, 4, 3, blocks=1),  # one block walks every row block whole
    qw.WideConfig(2, 1, 2, blocks=7),  # row blocks shared by uneven pieces
    qw.WideConfig(1, 2, 2, blocks=1000),  # more blocks than items: most have nothing to do
]


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_launch_shapes_agree(qtype: int) -> None:
    rng = np.random.default_rng(41 + qtype)
    shape = (200, 2304) if qtype not in BLOCKS32 else (200, 2336)  # Q8_0, Q4_0, IQ4_NL: a tail chunk of 32 values
    W, w64 = _matrix(qtype, shape, rng)
    for cfg in SHAPES:
        for tokens in (9, 36, 41, 52, 64):  # (36: 5 token tiles, 3 stages and the tall 2 x 4 since session 30; 52: 7)
            full = qw.choose_config(qtype, *shape, tokens, cfg)
            if qw.smem_bytes(qtype, (tokens + 7) // 8, full.m_tiles, full.warps, full.stages) <= qw.SMEM_LIMIT:
                check(W, w64, tokens, rng, f"{W.name} {cfg}", config=cfg)
                # a launch that left a counter nonzero would break the next one on this stream (first seen as the
                # next test's failure): name the launch that did it
                assert not qg.split_scratch(0, 0)[1].any(), f"{W.name} {cfg} T={tokens}: counters left nonzero"


@pytest.mark.parametrize("qtype,shape,mt,warps", [(qm.Q4_K, (1000, 2048), 2, 4), (qm.Q6_K, (300, 1536), 1, 8),
                                                  (qm.Q8_0, (250, 1248), 2, 2), (qm.F16, (130, 800), 1, 4),
                                                  (qm.IQ4_NL, (250, 1248), 2, 2), (qm.Q4_0, (130, 800), 1, 4)],
                         ids=str)  # fmt: skip
def test_whole_row_blocks_equal_v2_bitwise(qtype: int, shape: tuple[int, int], mt: int, warps: int) -> None:
    """One block per row block: every row block is one block's sequential sum over the chunks, with v2's
    dequantization and mma order, so the output is bitwise v2's with one K-warp (and no K split)."""
    rng = np.random.default_rng(77 + qtype)
    W, w64 = _matrix(qtype, shape, rng)
    cfg = qw.WideConfig(mt, warps, 2, blocks=qw.row_blocks(shape[0], mt, warps))
    for tokens in (9, 23, 64):
        x = cupy.asarray((rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16))
        px = qm.pack_activations(x)
        wide = run(W, px, kernel="wide", config=cfg)
        v2 = run(W, px, kernel="v2", config=qm.QmvConfig(mt, 1, 2, 1))
        assert np.array_equal(wide, v2), f"T={tokens}"
        assert rel_error(wide, cupy.asnumpy(x).astype(np.float64) @ w64.T) < TOL


@pytest.mark.parametrize("qtype,shape", [(qm.Q4_K, (17408, 5120)), (qm.Q4_K, (5120, 17408)), (qm.Q6_K, (5120, 17408)),
                                         (qm.Q6_K, (5120, 6144))], ids=case_id)  # fmt: skip
def test_27b_shapes(qtype: int, shape: tuple[int, int]) -> None:
    """Qwen3.6-27B ffn_up / ffn_down / ssm_out at verify widths with the default launch (stream-K pieces)."""
    rng = np.random.default_rng(7 + qtype + shape[0])
    W, w64 = _matrix(qtype, shape, rng)
    for tokens in (9, 16, 23, 41, 64):
        check(W, w64, tokens, rng, W.name, kernel="wide")


def test_residency_matches_the_driver() -> None:
    """quant_wide.blocks_per_sm (loader.resident_blocks: registers per sub-partition) against the driver's own
    occupancy calculator, for the compiled kernels at the block sizes the launcher uses (a producer warp included)."""
    occupancy = getattr(cupy.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor", None)
    if occupancy is None:
        pytest.skip("this CuPy has no cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor")
    for qtype in (qm.Q4_K, qm.Q6_K):
        for n_tiles in (2, 3, 6, 8):
            kern = qw.wide_function(qtype, n_tiles, 1)
            ptr = getattr(kern, "kernel", kern).ptr  # (a RawKernel's cupy.cuda.Function)
            for warps in (2, 4, 5, 8, 9):
                for smem in (0, qw.smem_bytes(qtype, n_tiles, 1, min(warps, 8), 2)):
                    want = occupancy(ptr, 32 * warps, smem)
                    assert qw.blocks_per_sm(warps, kern.num_regs, smem) == max(1, want), (qtype, n_tiles, warps, smem)


@pytest.mark.parametrize("tokens", [16, 23, 41, 64])
def test_producer_warp_same_bits(monkeypatch, tokens: int) -> None:
    """The producer warp only issues the copies: with the grid fixed, the sums are bitwise those of a launch
    without it."""
    if not qw.producer_warps():
        pytest.skip("no producer warp on this device (sm_90 bulk copies only)")
    rng = np.random.default_rng(3 + tokens)
    W, w64 = _matrix(qm.Q4_K, (5120, 6144), rng)
    x = cupy.asarray((rng.standard_normal((tokens, 6144)) * 0.5).astype(np.float16))
    px = qm.pack_activations(x)
    cfg = qw.WideConfig(blocks=200)  # stream-K pieces shared between blocks, the same for both launches
    assert qw.launch_shape(W, tokens, cfg)["producer"] == 1
    with_producer = run(W, px, kernel="wide", config=cfg)
    monkeypatch.setattr(qw, "PRODUCER", False)
    assert qw.launch_shape(W, tokens, cfg)["producer"] == 0
    assert np.array_equal(run(W, px, kernel="wide", config=cfg), with_producer)
    assert rel_error(with_producer, cupy.asnumpy(x).astype(np.float64) @ w64.T) < TOL


def switch_same_bits(monkeypatch, switch: str, tokens: int, seed: int, shapes) -> dict:
    """Launches of Q4_K matrices of `shapes` at this width, plain and accumulating, with quant_wide's `switch` on and
    off: the same bits either way (and the product within TOL of the float64 one); the counters left zero. Returns
    the launch shapes by switch value."""
    rng = np.random.default_rng(seed)
    launches = {}
    for shape in shapes:
        W, w64 = _matrix(qm.Q4_K, shape, rng)
        x = cupy.asarray((rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16))
        px = qm.pack_activations(x)
        y0 = rng.standard_normal((tokens, shape[0])).astype(np.float32)
        got = {}
        for on in (True, False):
            monkeypatch.setattr(qw, switch, on)
            launches[shape, on] = qw.launch_shape(W, tokens)
            got[on] = (run(W, px, kernel="wide"), run(W, px, y0, kernel="wide", accumulate=True))
        assert np.array_equal(got[True][0], got[False][0]) and np.array_equal(got[True][1], got[False][1]), shape
        assert rel_error(got[True][0], cupy.asnumpy(x).astype(np.float64) @ w64.T) < TOL
    for sc in qg._scratch.values():
        assert not bool(sc.counters.any()), "the arrival counters must be left zero"
    return launches


@pytest.mark.parametrize("tokens", [17, 23, 41])
def test_peek_same_bits(monkeypatch, tokens: int) -> None:
    """A block's last row block added up at once when its one other sharer's pieces are in (quant_wide.PEEK): the
    same bits as storing, counting in and reading back, for 2-sharer splits (gate|up-like) and many-sharer ones
    (ffn_down-like), plain and accumulating; the counters left zero."""
    switch_same_bits(monkeypatch, "PEEK", tokens, 61 + tokens, ((34816, 5120), (5120, 17408)))


@pytest.mark.parametrize("tokens", [17, 23, 32, 36])
def test_pieces_two_at_a_time_same_bits(monkeypatch, tokens: int) -> None:
    """A writer loading its row block's pieces two at a time (quant_wide.PIECE_GROUP: Q4_K at 17..24 tokens; at 32
    and 36 with PIECE_GROUP_TILES' 4 and 5 token tiles too) adds them in the same block order as one at a time: the
    same bits on ffn_down's pieces a row block and gate|up's, plain and accumulating, with the same grid."""
    if tokens > 24:
        monkeypatch.setattr(qw, "PIECE_GROUP_TILES", {qm.Q4_K: (3, 4, 5), qm.Q6_K: (4, 5)})
    shapes = ((5120, 17408), (34816, 5120))
    launches = switch_same_bits(monkeypatch, "PIECE_GROUP", tokens, 91 + tokens, shapes)
    for shape in shapes:
        assert launches[shape, True]["blocks"] == launches[shape, False]["blocks"], shape


@pytest.mark.parametrize("tokens,kernel,order", [(1, "gemv", 0), (8, "v2", 0), (23, "wide", 0), (41, "wide", 1)])
def test_weights_evict_first_same_bits(monkeypatch, tokens: int, kernel: str, order: int) -> None:
    """The weight copies' evict-first L2 policy (quant_matmul.WEIGHTS_EVICT_FIRST) decides what stays cached, never a
    value: the ring gemv, v2 and the wide kernel (at 41 tokens x in the wgmma order: its wgmma build where the device
    has one), plain and accumulating, give the same bits from the builds with and without it."""
    if order and not _WG:
        order = 0
    rng = np.random.default_rng(300 + tokens)
    W, w64 = _matrix(qm.Q4_K, (5120, 6144), rng)
    x = (rng.standard_normal((tokens, 6144)) * 0.5).astype(np.float16)
    px = qm.pack_activations(cupy.asarray(x), q16=tokens == 1, order=order)
    y0 = rng.standard_normal((tokens, 5120)).astype(np.float32)
    kw = {"config": qg.GemvConfig(ring=True)} if kernel == "gemv" else {}
    got = {}
    for on in (True, False):
        monkeypatch.setattr(qm, "WEIGHTS_EVICT_FIRST", on)
        got[on] = (run(W, px, kernel=kernel, **kw), run(W, px, y0, kernel=kernel, accumulate=True, **kw))
    assert np.array_equal(got[True][0], got[False][0]) and np.array_equal(got[True][1], got[False][1])
    assert rel_error(got[True][0], x.astype(np.float64) @ w64.T) < TOL


def test_reproducible_and_counters_left_zero() -> None:
    rng = np.random.default_rng(5)
    W, _ = _matrix(qm.Q4_K, (5120, 6144), rng)
    x = cupy.asarray((rng.standard_normal((41, 6144)) * 0.5).astype(np.float16))
    px = qm.pack_activations(x)
    shape = qw.launch_shape(W, 41)
    assert max(1, shape["blocks"]) > shape["row_blocks"]  # the default split shares row blocks between blocks
    first = run(W, px, kernel="wide")
    for _ in range(3):
        assert np.array_equal(run(W, px, kernel="wide"), first)
    for sc in qg._scratch.values():
        assert not bool(sc.counters.any()), "the arrival counters must be left zero"


def test_wide_in_a_cuda_graph() -> None:
    """Captured on a fresh stream (its scratch is made during the capture), replayed several times: every replay
    bitwise equal to the eager launches; two matrices of different shapes and an accumulating launch share the
    scratch."""
    rng = np.random.default_rng(1500)
    (A, _), (B, _) = _matrix(qm.Q4_K, (5120, 6144), rng), _matrix(qm.Q6_K, (1024, 5120), rng)
    xa = qm.pack_activations(cupy.asarray((rng.standard_normal((23, 6144)) * 0.5).astype(np.float16)))
    xb = qm.pack_activations(cupy.asarray((rng.standard_normal((23, 5120)) * 0.5).astype(np.float16)))
    y0 = cupy.asarray(rng.standard_normal((23, 5120)).astype(np.float32))
    eager_a = A.matmul(xa, kernel="wide")
    eager_b = B.matmul(xb, kernel="wide")
    eager_c = y0.copy()
    A.matmul(xa, out=eager_c, accumulate=True, kernel="wide")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        outs = [cupy.full((23, 5120), np.nan, cupy.float32), cupy.full((23, 1024), np.nan, cupy.float32),
                cupy.empty((23, 5120), cupy.float32)]  # fmt: skip
        stream.synchronize()
        stream.begin_capture()
        try:
            A.matmul(xa, out=outs[0], kernel="wide")
            B.matmul(xb, out=outs[1], kernel="wide")
            outs[2][...] = y0
            A.matmul(xa, out=outs[2], accumulate=True, kernel="wide")
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
    assert cupy.array_equal(A.matmul(xa, kernel="wide"), eager_a)  # eager again after


@pytest.mark.parametrize("cfg", [qw.WideConfig(2, 4, 2, blocks=1), qw.WideConfig(2, 4, 2, blocks=9), None], ids=str)
def test_strided_out_and_accumulate(cfg) -> None:
    """A column slice of wider rows (row stride ldy) gets what a contiguous output gets, its neighbours untouched;
    accumulate adds the finished sum once: bitwise y0 + the product."""
    rng = np.random.default_rng(9)
    n_out, k, tokens = 300, 2048, 37
    W, _ = _matrix(qm.Q6_K, (n_out, k), rng)
    px = qm.pack_activations(cupy.asarray((rng.standard_normal((tokens, k)) * 0.5).astype(np.float16)))
    y0 = cupy.asarray(rng.standard_normal((tokens, n_out)).astype(np.float32))
    check_strided_out(W, px, y0, str(cfg), kernel="wide", config=cfg)


@pytest.mark.parametrize("tokens", [17, 23, 41, 64])
def test_accumulate_by_bulk_adds_same_bits(monkeypatch, tokens: int) -> None:
    """On sm_90 an accumulating launch adds its sums into y by bulk reduce-adds from a shared-memory tile: bitwise
    the load-add-store's y (the path taken without bulk copies, or where y's rows are not 16-byte aligned), split
    row blocks and a column slice included, the columns beside it untouched. The tile is taken only where it keeps
    the grid (the stream-K split, so the order of the sums): Q6_K 1024 x 5120 from 33 tokens would lose a block a
    SM to it and adds the old way."""
    if not qw.bulk_adds():
        pytest.skip("no bulk reduce-adds on this device (sm_90 bulk copies only)")
    rng = np.random.default_rng(31 + tokens)
    for qtype, shape in ((qm.Q4_K, (5120, 6144)), (qm.Q6_K, (1024, 5120))):
        W, w64 = _matrix(qtype, shape, rng)
        n_out, k = shape
        x = cupy.asarray((rng.standard_normal((tokens, k)) * 0.5).astype(np.float16))
        px = qm.pack_activations(x)
        y0 = cupy.asarray(rng.standard_normal((tokens, n_out)).astype(np.float32))
        for cfg in (None, qw.WideConfig(blocks=200)):
            outs = {}
            shapes = {}
            for bulk in (True, False):
                monkeypatch.setattr(qw, "BULK_ADDS", bulk)
                shapes[bulk] = qw.launch_shape(W, tokens, cfg, accumulate=True)
                for off in (0, 4, 1):  # 1: rows not 16-byte aligned, the kernel adds the old way
                    wide = cupy.full((tokens, n_out + 8), 7.25, cupy.float32)
                    view = wide[:, off : off + n_out]
                    view[...] = y0
                    W.matmul(px, out=view, accumulate=True, kernel="wide", config=cfg)
                    host = cupy.asnumpy(wide)
                    assert (host[:, :off] == 7.25).all() and (host[:, off + n_out :] == 7.25).all()
                    outs[bulk, off] = view.copy()
            label = f"{NAMES[qtype]} {shape} tokens={tokens} {cfg}"
            assert shapes[True]["blocks"] == shapes[False]["blocks"] and not shapes[False]["ytile"], label
            assert shapes[True]["ytile"] or (qtype == qm.Q6_K and tokens > 32 and cfg is None), label
            for key, out in outs.items():
                assert cupy.array_equal(out, outs[False, 0]), f"{label}: {key} differs from the load-add-store"
            got = cupy.asnumpy(outs[True, 4] - y0).astype(np.float64)
            assert rel_error(got, cupy.asnumpy(x).astype(np.float64) @ w64.T) < TOL, label


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_portable_fallback_path(qtype: int) -> None:
    """Compiled with -DSPECSPLIT_PORTABLE: software fp16 and mma, cp.async replaced by plain copies, the
    __syncthreads pipeline instead of bulk copies and mbarriers."""
    rng = np.random.default_rng(99 + qtype)
    shape = (200, 544) if qtype in (*BLOCKS32, qm.F16) else (256, 512)   # (a tail chunk where the type has one)
    W, w64 = _matrix(qtype, shape, rng)
    for tokens in (9, 23):
        check(W, w64, tokens, rng, f"portable {NAMES[qtype]}", kernel="wide", portable=True,
              config=qw.WideConfig(2, 2, 2, blocks=3))  # fmt: skip


def test_float32_input_and_dispatch(monkeypatch) -> None:
    rng = np.random.default_rng(12)
    shape = (640, 1024)
    W, w64 = _matrix(qm.Q4_K, shape, rng)
    x = rng.standard_normal((29, shape[1])).astype(np.float32)
    y = run(W, x, kernel="wide")
    assert rel_error(y, x.astype(np.float16).astype(np.float64) @ w64.T) < TOL  # fp32 input is rounded to fp16
    # matmul() picks the wide kernel from its crossover width, v2 below it (above gemv's widths, the ring's at most); a
    # deep matrix (k >= 2 n_out) from DEEP_CROSSOVER, one of fewer than DEEP_MIN_ROWS rows (here 256) from CROSSOVER
    monkeypatch.setattr(qw, "DEEP_MIN_ROWS", 256)
    px = qm.pack_activations(cupy.asarray(x))
    assert np.array_equal(run(W, px), run(W, px, kernel="wide"))
    deep, _ = _matrix(qm.Q4_K, (384, 1024), rng)
    small_deep, _ = _matrix(qm.Q4_K, (160, 1024), rng)
    for M, first in ((W, qw.CROSSOVER[qm.Q4_K]), (deep, qw.DEEP_CROSSOVER[qm.Q4_K]),
                     (small_deep, qw.CROSSOVER[qm.Q4_K])):
        assert qw.prefer_wide(qm.Q4_K, first, *M.shape) and not qw.prefer_wide(qm.Q4_K, first - 1, *M.shape)
        pf = qm.pack_activations(cupy.asarray(x[:first]))
        assert np.array_equal(run(M, pf), run(M, pf, kernel="wide"))
        if first - 1 > qg.CROSSOVER[qm.Q4_K]:  # below: v2, or the gemv ring up to its widths (x with its staging)
            pn = qm.pack_activations(cupy.asarray(x[: first - 1]))
            below = "gemv" if first - 1 <= qg.RING_UP_TO.get(qm.Q4_K, 0) else "v2"
            assert np.array_equal(run(M, pn), run(M, pn, kernel=below))
    with pytest.raises(ValueError):
        W.matmul(px, kernel="wide", splits=2)
    with pytest.raises(ValueError):
        W.matmul(px, kernel="wide", config=qm.QmvConfig(2, 4, 2, 1))
    v1 = qm.QuantMatrix(qm.Q4_K, random_weights(qm.Q4_K, *shape, rng), shape, kernel="v1")
    with pytest.raises(ValueError):
        v1.matmul(px, kernel="wide")


def _unpacked(px: qm.PackedX) -> np.ndarray:
    """[padded tokens, K] float16 of a PackedX's data (the inverse of pack_x_kernel's unit map)."""
    from tests.test_kernels_cpu_sim import unpack_numpy

    return unpack_numpy(cupy.asnumpy(px.data), px.in_features, px.padded_tokens)


@pytest.mark.parametrize("qtype,f,k", [(qm.Q4_K, 1024, 2048), (qm.Q6_K, 512, 1536)], ids=str)
def test_swiglu_launch(qtype: int, f: int, k: int) -> None:
    """quant_wide.wide_swiglu (QuantMatrix.swiglu above the ring's widths) on a stacked [gate | up]: with one block a
    row block, bitwise the plain launch's product (the same whole-row-block sums) through pack_activations' SwiGLU
    pack; with the default split, within fp16 of that, the same bits launch after launch and in a CUDA graph, padding
    rows zero, and within the bound of the float64 twin."""
    rng = np.random.default_rng(300 + qtype)
    W, w64 = _matrix(qtype, (2 * f, k), rng)
    for tokens in (4, 9, 23, 36, 41, 52, 64):
        x = cupy.asarray((rng.standard_normal((tokens, k)) * 0.005).astype(np.float16))  # silu(g) u inside fp16
        px = qm.pack_activations(x)
        nrb = qw.row_blocks(2 * f, 2, 4)
        whole = qw.WideConfig(2, 4, 2, blocks=nrb)
        fused = qw.wide_swiglu(W, px, config=whole)
        gu = W.matmul(px, kernel="wide", config=whole)
        packed = qm.pack_activations(gu[:, :f], silu_up=gu[:, f:])
        assert cupy.array_equal(fused.data, packed.data), f"T={tokens}"
        got = W.swiglu(px)  # the default launch (stream-K pieces)
        assert got.q16 is None and got.in_features == f and got.tokens == tokens
        for _ in range(2):
            assert cupy.array_equal(W.swiglu(px).data, got.data), f"T={tokens}: not reproducible"
        h = _unpacked(got).astype(np.float64)
        assert (h[tokens:] == 0).all()
        y = cupy.asnumpy(x).astype(np.float64) @ w64.T
        ref = y[:, :f] / (1 + np.exp(-y[:, :f])) * y[:, f:]
        assert rel_error(h[:tokens], ref) < TOL, f"T={tokens}"
        assert rel_error(h[:tokens], _unpacked(packed).astype(np.float64)[:tokens]) < TOL
    for sc in qg._scratch.values():
        assert not bool(sc.counters.any()), "the arrival counters must be left zero"
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = cupy.full(f * px.padded_tokens, 0xFFFF, cupy.uint16)
        stream.synchronize()
        stream.begin_capture()
        try:
            qw.wide_swiglu(W, px, out=out)
        finally:
            graph = stream.end_capture()
        for _ in range(3):
            out.fill(0xFFFF)
            graph.launch(stream)
            stream.synchronize()
            assert cupy.array_equal(out, got.data)


# The wgmma build (SPECSPLIT_QMW_WG, sm_90a) and the packs' wgmma order (PackedX.order 1)
_WG = loader.arch_specific_available()
needs_wg = pytest.mark.skipif(not _WG, reason="the wgmma build needs an sm_90 CUDA device (the sm_90a target)")


def test_wg_order_is_quant_wide_twin() -> None:
    """pack_activations(order=1) writes quant_wide.wg_order of the mma-order pack, bit for bit, for every pack kind
    (plain fp16 / f32, the norm with residual, the gated group norm, SwiGLU; a tail chunk among them); the int16
    staging is the same in both."""
    rng = np.random.default_rng(11)
    for tokens, k in ((3, 2336), (17, 1024), (23, 768), (64, 512)):
        x = cupy.asarray(rng.standard_normal((tokens, k)).astype(np.float32))
        r = cupy.asarray(rng.standard_normal((tokens, k)).astype(np.float32))
        w = cupy.asarray(rng.standard_normal(k).astype(np.float32))
        wg = cupy.asarray(rng.standard_normal(32).astype(np.float32))
        for kw in ({}, {"q16": True}, {"rms_weight": w, "residual": r}, {"rms_weight": wg, "gate": r},
                   {"silu_up": r}):
            kw = {**kw, **({"residual_out": cupy.empty_like(r)} if "residual" in kw else {})}
            a = qm.pack_activations(x.astype(np.float16) if not kw else x, **kw)
            kw2 = {**kw, **({"residual_out": cupy.empty_like(r)} if "residual" in kw else {})}
            b = qm.pack_activations(x.astype(np.float16) if not kw else x, order=1, **kw2)
            assert b.order == 1 and a.order == 0
            assert cupy.array_equal(b.data, qw.wg_order(a.data, a.padded_tokens)), f"T={tokens} K={k} {list(kw)}"
            if a.q16 is not None:
                assert cupy.array_equal(a.q16, b.q16)
    with pytest.raises(ValueError, match="order"):
        qm.pack_activations(x, order=2)


@needs_wg
@pytest.mark.parametrize("qtype,shape", [(qm.Q4_K, (1024, 2048)), (qm.Q6_K, (1000, 1536)), (qm.Q8_0, (200, 2336)),
                                         (qm.F16, (130, 800)), (qm.Q4_K, (77, 768)), (qm.Q5_K, (300, 1536)),
                                         (qm.IQ4_XS, (300, 1536)), (qm.Q3_K, (300, 1536)), (qm.Q4_0, (200, 2336)),
                                         (qm.IQ4_NL, (300, 1312))], ids=case_id)  # fmt: skip
def test_wgmma_build_same_bits_as_mma(qtype: int, shape: tuple[int, int], monkeypatch) -> None:
    """x in the wgmma order through QuantMatrix.matmul runs the wgmma build, whose sums equal the mma.sync build's bit
    for bit at the same launch shape (its HGMMA steps accumulate as HMMA's, in the same k order), F16 / Q8_0 / Q4_0 /
    IQ4_NL tail chunks included, and stay within the float64 twin's bound; accumulating and in a CUDA graph too. A type
    the dispatch leaves off the wgmma build (no quant_wide.WG_TYPES entry before its GPU run) is put on it here from one
    token, else x in that order would run the mma.sync build reading it, and this would compare that build with
    itself."""
    monkeypatch.setitem(qw.WG_TYPES, qtype, qw.WG_TYPES.get(qtype, 1))
    rng = np.random.default_rng(500 + qtype + shape[0])
    W, w64 = _matrix(qtype, shape, rng)
    cfgs = (qw.WideConfig(1, 4, 2), qw.WideConfig(2, 8, 3), qw.WideConfig(1, 4, 3, blocks=3),
            qw.WideConfig(2, 4, 2, blocks=1000))
    for tokens in (1, 9, 17, 23, 41, 64):
        x = cupy.asarray((rng.standard_normal((tokens, shape[1])) * 0.5).astype(np.float16))
        px, pw = qm.pack_activations(x), qm.pack_activations(x, order=1)
        for cfg in cfgs:
            n_tiles = (tokens + 7) // 8
            if qw.smem_bytes(qtype, n_tiles, cfg.m_tiles, cfg.warps, cfg.stages, wg=True) > qw.SMEM_LIMIT:
                continue
            a = run(W, px, kernel="wide", config=cfg)
            b = run(W, pw, kernel="wide", config=cfg)
            assert np.array_equal(a, b), f"{W.name} T={tokens} {cfg}"
            assert rel_error(b, cupy.asnumpy(x).astype(np.float64) @ w64.T) < TOL
        y0 = rng.standard_normal((tokens, shape[0])).astype(np.float32)
        assert np.array_equal(run(W, px, y0, kernel="wide", config=cfgs[0], accumulate=True),
                              run(W, pw, y0, kernel="wide", config=cfgs[0], accumulate=True)), f"{W.name} T={tokens}"
    for sc in qg._scratch.values():
        assert not bool(sc.counters.any()), "the arrival counters must be left zero"
    out = cupy.full((23, shape[0]), np.nan, cupy.float32)
    pw = qm.pack_activations(cupy.asarray(rng.standard_normal((23, shape[1])).astype(np.float16)), order=1)
    want = run(W, pw, kernel="wide")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            W.matmul(pw, out=out, kernel="wide")
        finally:
            graph = stream.end_capture()
        for _ in range(2):
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            assert np.array_equal(cupy.asnumpy(out), want)


@needs_wg
def test_wgmma_order_everywhere_and_refusals() -> None:
    """x in the wgmma order is read by every v2-layout product: the v2 kernel and the wide kernel's mma.sync build
    (built with SPECSPLIT_XO_WG; portable too) give the mma order's sums bit for bit; the SwiGLU launch on either
    build writes the down product's x in that order (the mma order's output reordered, bit for bit); the gemv
    variants that read the fp16 x refuse it."""
    rng = np.random.default_rng(9)
    W, _ = _matrix(qm.Q4_K, (2048, 1024), rng)
    for tokens in (9, 17, 23, 41, 64):
        x = cupy.asarray((rng.standard_normal((tokens, 1024)) * 0.005).astype(np.float16))
        px, pw = qm.pack_activations(x), qm.pack_activations(x, order=1)
        for kw in ({"kernel": "v2"}, {"kernel": "v2", "portable": True}, {"kernel": "wide", "portable": True}):
            assert np.array_equal(run(W, pw, **kw), run(W, px, **kw)), f"T={tokens} {kw}"
        cfg = qw.WideConfig(1, 4, 2)
        out = cupy.full((tokens, 2048), np.nan, cupy.float32)
        assert np.array_equal(cupy.asnumpy(qw.wide(W, pw, out, config=cfg, wg=False)), run(W, px, kernel="wide",
                                                                                          config=cfg))
        cfg = qw.WideConfig(2, 4, 2)
        a = qw.wide_swiglu(W, px, config=cfg)
        b = W.swiglu(pw, config=cfg)  # the wgmma build (quant_wide.WG_TYPES)
        assert b.order == 1 and cupy.array_equal(b.data, qw.wg_order(a.data, a.padded_tokens)), f"T={tokens}"
        for wg_types in ({}, qw.WG_TYPES):  # the mma.sync build's SwiGLU writer too
            saved = dict(qw.WG_TYPES)
            qw.WG_TYPES.clear()
            qw.WG_TYPES.update(wg_types or {})
            try:
                c = W.swiglu(pw, config=cfg)
            finally:
                qw.WG_TYPES.clear()
                qw.WG_TYPES.update(saved)
            assert cupy.array_equal(c.data, b.data), f"T={tokens} {wg_types}"
    pw = qm.pack_activations(cupy.asarray(rng.standard_normal((5, 1024)).astype(np.float16)), order=1, q16=False)
    with pytest.raises(ValueError, match="wgmma order"):
        W.matmul(pw, kernel="gemv")
    with pytest.raises(ValueError, match="its own order"):
        qw.wide(W, qm.pack_activations(cupy.asarray(rng.standard_normal((23, 1024)).astype(np.float16))),
                cupy.empty((23, 2048), cupy.float32), wg=True)


@needs_wg
def test_raw_x_packed_in_the_wgmma_order_where_it_runs_that_build(monkeypatch) -> None:
    """QuantMatrix.matmul(wg_order=True) on raw x packs it in the wgmma order exactly where the dispatch then runs the
    wgmma build (quant_wide.raw_wg_order: where the product is wide, from WG_TYPES' width; counted), in the mma order
    elsewhere, with the sums of matmul on x packed in the order it chose, bit for bit, within the float64 twin's
    bound; a slice of a longer x too."""
    rng = np.random.default_rng(36)
    calls = []
    real = qw.launch_shape
    monkeypatch.setattr(qw, "launch_shape", lambda *a, **kw: calls.append(bool(kw.get("wg"))) or real(*a, **kw))
    for qtype, shape in ((qm.Q4_K, (2048, 1024)), (qm.Q6_K, (70000, 256))):
        W, w64 = _matrix(qtype, shape, rng)
        wide_from = next(t for t in range(1, 65) if qw.prefer_wide(qtype, t, *shape, order=1))
        first = max(wide_from, qw.WG_TYPES[qtype])
        assert [t for t in range(1, 65) if qw.raw_wg_order(W, t)] == list(range(first, 65))
        for tokens in (1, 9, 17, 23, 24, 25, 40, 41, 64, 81):
            calls.clear()
            got = check(W, w64, tokens, np.random.default_rng(tokens), W.name, wg_order=True)
            slices = [(s, min(64, tokens - s)) for s in range(0, tokens, 64)]
            orders = [int(qw.raw_wg_order(W, t)) for _, t in slices]
            assert calls.count(True) == sum(orders) and (sum(orders) > 0) == (tokens >= first), f"T={tokens} {calls}"
            x = cupy.asarray((np.random.default_rng(tokens).standard_normal((tokens, shape[1])) * 0.5)
                             .astype(np.float16))  # (check's x)
            want = [run(W, qm.pack_activations(x[s:s + t], order=o)) for (s, t), o in zip(slices, orders)]
            assert np.array_equal(got, np.concatenate(want)), f"{W.name} T={tokens}"
