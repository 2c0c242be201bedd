"""kernels/sampling.cu's exact sampler runs on the CPU (tests/cuda_sim_ops.cpp) against its NumPy twin.

The launches are the ones kernels/sampling.py makes (kernel_filters, select_passes, draw_lane, penalty_windows
are shared), run block by block with every thread a fiber, last-block tickets included (in three block orders).
Checked against services/engine/sampling.py: the kept set (exactly), each kept probability (float64 rounding),
the token for a given u (the inverse-CDF choice except within rounding of a CDF step), ties at every cut to the
lower ids, penalties over per-row windows, greedy after penalties, and the rows the twin rejects.
"""

from __future__ import annotations

import ctypes
import shutil
import sys

import numpy as np
import pytest

from kernels import sampling as ks
from services.engine.sampling import SamplingParams
from tests.sampling_twin import FILTERS, make_rows, near_boundary, twin_probs, twin_token

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not sys.platform.startswith("linux"),
    reason="the CPU simulation of the CUDA kernels needs g++ on Linux (ucontext fibers)",
)

P = ctypes.c_void_p
I, LL, D = ctypes.c_int, ctypes.c_longlong, ctypes.c_double
SIGNATURES = {
    "sim_sample_prep": [P, LL, P, I, I, P, D, D, D, P, LL, P, P, P, P, I],
    "sim_sample_select": [I, P, LL, I, P, I, I, I, D, I, D, P, P, P, P, P, P, I],
    "sim_sample_draw_sum": [P, LL, I, P, I, I, D, I, D, P, P, P, P, P, P, I],
    "sim_sample_draw_scan": [P, LL, I, P, I, I, D, I, D, P, P, P],
    "sim_sample_probs": [P, LL, I, P, I, I, D, I, D, P, P, P, P, LL],
    "sim_sample_state_bytes": [],
}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    from tests.test_kernels_ops_sim import build_family

    lib = build_family("sampling", tmp_path_factory.mktemp("cuda_sim_sampling"))
    for fn, args in SIGNATURES.items():
        getattr(lib, fn).restype = ctypes.c_int
        getattr(lib, fn).argtypes = args
    return lib


def ptr(a):
    return None if a is None else a.ctypes.data


class SimSampler:
    """kernels/sampling.py's `_enqueue` + scan / probs, on the simulated kernels (fresh buffers per call, so the
    zeroed-histogram invariant is checked too: they are reused across calls)."""

    def __init__(self, lib, max_rows: int, n: int):
        self.lib, self.n = lib, n
        self.nch = -(-n // ks.CHUNK)
        self.pm = np.zeros((max_rows, 2 * self.nch), np.uint32)
        self.st = np.zeros((max_rows, ks.STATE_BYTES), np.uint8)
        self.hcnt = np.zeros((max_rows, ks.NB), np.uint32)
        self.hlo = np.zeros((max_rows, ks.NB), np.uint64)
        self.hhi = np.zeros((max_rows, ks.NB), np.uint64)
        self.counters = np.zeros(max_rows, np.uint32)
        self.rmass = np.zeros((max_rows, self.nch), np.float64)
        self.rties = np.zeros((max_rows, self.nch), np.uint32)
        self.scratch = np.zeros((max_rows, n), np.float32)

    def run(self, x: np.ndarray, rows, us, params: SamplingParams, history=None, paths=None, order: int = 0):
        """(tokens int [len(rows)], probs float64 [len(rows), n]) for logits x [R, n] float32."""
        lib, n = self.lib, self.n
        x = np.ascontiguousarray(x, np.float32)
        rows = np.asarray(rows, np.int64)
        nr = len(rows)
        temp, k, p, mp = ks.kernel_filters(params.temperature, params.top_k, params.top_p, params.min_p, n)
        us = np.zeros(nr) if params.greedy else np.broadcast_to(np.asarray(us, np.float64), (nr,)).copy()
        pen = params.shifted
        rin, tok = ks.penalty_windows(rows, history, paths, params.repeat_last_n if params.penalized else 0)
        tok = tok if tok.size else np.zeros(1, np.int32)
        zs = self.scratch if pen else None
        z, ldz, zsel = (self.scratch, n, 0) if pen else (x, n, 1)
        b_ids = np.array([i for i, _ in params.logit_bias] or [0], np.int32)
        b_vals = np.array([v for _, v in params.logit_bias] or [0.0], np.float64)
        errs = lib.sim_sample_prep(ptr(x), n, ptr(rin), nr, n, ptr(tok), params.repetition_penalty,
                                   params.frequency_penalty, params.presence_penalty, ptr(zs), n, ptr(self.pm),
                                   ptr(self.st), ptr(b_ids), ptr(b_vals), len(params.logit_bias))  # fmt: skip
        common = (ptr(z), ldz, zsel, ptr(rin), nr, n)
        for lane, level in ks.select_passes(k, p):
            errs += lib.sim_sample_select(lane, *common, level, temp, k, p, ptr(self.pm), ptr(self.st),
                                          ptr(self.hcnt), ptr(self.hlo), ptr(self.hhi), ptr(self.counters), order)
        lane = ks.draw_lane(k, p)
        errs += lib.sim_sample_draw_sum(*common, temp, lane, mp, ptr(us), ptr(self.pm), ptr(self.st),
                                        ptr(self.rmass), ptr(self.rties), ptr(self.counters), order)
        toks = np.full(nr, -7, np.int32)
        errs += lib.sim_sample_draw_scan(*common, temp, lane, mp, ptr(self.pm), ptr(self.st), ptr(toks))
        w = np.full((nr, n), -3.0)
        errs += lib.sim_sample_probs(*common, temp, lane, mp, ptr(self.pm), ptr(self.st), ptr(self.rties), ptr(w), n)
        assert errs == 0, "simulation errors (divergent warps / deadlocks)"
        # every launch leaves these as it found them
        assert not self.hcnt.any() and not self.hlo.any() and not self.hhi.any() and not self.counters.any()
        with np.errstate(invalid="ignore"):
            probs = w / w.sum(axis=1, keepdims=True)
        return toks.astype(np.int64), probs


def params_of(t, k, p, m, **kw) -> SamplingParams:
    return SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, **kw)


def check_against_twin(probs_row, tok, ref, u, rtol: float = 1e-12) -> None:
    """rtol: 1e-12 (float64 on both sides), 1e-5 with penalties that are not exact in float32 (the device rounds
    penalised logits to float32)."""
    kept, want = np.flatnonzero(probs_row > 0), np.flatnonzero(ref > 0)
    assert kept.tolist() == want.tolist(), f"kept {len(kept)} ids, the twin {len(want)}"
    np.testing.assert_allclose(probs_row, ref, rtol=rtol, atol=1e-300)
    if not near_boundary(ref, u, max(rtol, 1e-12)):
        assert tok == twin_token(ref, u)
    assert ref[tok] > 0


def test_state_fits(lib):
    assert lib.sim_sample_state_bytes() <= ks.STATE_BYTES


N = 9000  # three chunks, the last one partial


@pytest.fixture(scope="module")
def rows9k():
    return make_rows(np.random.default_rng(7), N)


@pytest.mark.parametrize("t,k,p,m", FILTERS)
def test_every_filter_combination(lib, rows9k, t, k, p, m):
    params = params_of(t, k, p, m)
    us = np.random.default_rng(int(1000 * t) + k + int(100 * p)).random(len(rows9k))
    sim = SimSampler(lib, len(rows9k), N)
    toks, probs = sim.run(rows9k, np.arange(len(rows9k)), us, params)
    for r in range(len(rows9k)):
        check_against_twin(probs[r], toks[r], twin_probs(rows9k[r], params), us[r])


def test_ties_at_each_cut_go_to_the_lower_ids(lib):
    n = 10000
    x = np.full((3, n), -5.0, np.float32)
    x[0, [9000, 5, 4500, 8191, 4096, 77]] = 3.0   # top-k = 4 cuts a group of six equal values (three chunks)
    x[1, ::7] = 1.0                                 # top-p 0.3 ends inside a tie group of 1429
    x[1, 0] = 2.0
    x[2, :] = 0.25                                  # all equal: top-k = 5000 keeps ids 0..4999
    cases = [(0, params_of(1.0, 4, 1.0, 0.0), [5, 77, 4096, 4500]),
             (2, params_of(1.0, 5000, 1.0, 0.0), list(range(5000)))]
    sim = SimSampler(lib, 1, n)
    for r, params, want in cases:
        _, probs = sim.run(x[r:r + 1], [0], [0.5], params)
        assert np.flatnonzero(probs[0] > 0).tolist() == want
    params = params_of(1.0, 0, 0.3, 0.0)
    _, probs = sim.run(x[1:2], [0], [0.5], params)
    ref = twin_probs(x[1], params)
    kept = np.flatnonzero(probs[0] > 0)
    assert kept.tolist() == np.flatnonzero(ref > 0).tolist()
    assert kept[0] == 0 and np.all(np.diff(kept[1:]) == 7)  # a prefix of the tie group in id order


@pytest.mark.parametrize("order", [0, 1, 2])
def test_block_order_does_not_matter(lib, rows9k, order):
    params = params_of(0.9, 300, 0.9, 0.01)
    us = np.linspace(0.05, 0.95, len(rows9k))
    sim = SimSampler(lib, len(rows9k), N)
    toks, probs = sim.run(rows9k, np.arange(len(rows9k)), us, params, order=order)
    ref_toks, ref_probs = sim.run(rows9k, np.arange(len(rows9k)), us, params, order=0)
    assert toks.tolist() == ref_toks.tolist()
    assert np.array_equal(probs, ref_probs)  # bitwise: deterministic sums


def test_many_uniforms_pick_the_inverse_cdf_token(lib, rows9k):
    """One row drawn with 96 uniforms at once (a batch of draws of the same row), against the twin's choice."""
    params = params_of(1.0, 0, 0.95, 0.0)
    us = np.random.default_rng(3).random(64)
    us[:4] = [0.0, 1.0 - 2**-53, 0.5, 0.25]
    sim = SimSampler(lib, len(us), N)
    for r in (0, 1):
        toks, probs = sim.run(rows9k, np.full(len(us), r), us, params)
        ref = twin_probs(rows9k[r], params)
        near = 0
        for i, u in enumerate(us):
            if near_boundary(ref, u):
                near += 1
                continue
            assert toks[i] == twin_token(ref, u), (r, i, u)
        assert near <= 1   # u within 1e-12 of a CDF step: rare


def test_uniform_exactly_on_a_cdf_step(lib):
    """u = the CDF at id i: the twin takes i or i + 1 as its float64 sums round; so may the device, never
    another id."""
    x = np.log(np.array([1, 1, 2, 4] * 1000, np.float32))
    params = params_of(1.0, 0, 1.0, 0.0)
    ref = twin_probs(x, params)
    cdf = np.cumsum(ref)
    steps = (0, 1, 2, 5, 1000, 2999)
    us = np.array([cdf[i] for i in steps])
    sim = SimSampler(lib, len(us), len(x))
    toks, _ = sim.run(x[None], np.zeros(len(us), int), us, params)
    for i, u, tok in zip(steps, us, toks):
        assert twin_token(ref, u) in (i, i + 1)
        assert tok in (i, i + 1)


def test_penalties_per_row_windows(lib, rows9k):
    """Two tree nodes' windows (shared history + own path), values exact in float32, so the kept sets and
    probabilities equal the twin's; then arbitrary penalty values (rounded to float32 on the device)."""
    x = (np.round(rows9k[0] * 64) / 64).astype(np.float32)
    hist = [5, 9, 9, 17, 8000, int(np.argmax(x)), 3, 3, 3]
    paths = [[], [int(np.argsort(x)[-2]), 9], [4096, 4096, 8999]]
    for extra in ({"repetition_penalty": 2.0, "presence_penalty": 0.25, "frequency_penalty": 0.5},
                  {"repetition_penalty": 1.3, "presence_penalty": 0.3, "frequency_penalty": -0.7}):
        for last_n in (-1, 6):
            params = params_of(0.8, 40, 0.9, 0.0, repeat_last_n=last_n, **extra)
            us = [0.3, 0.6, 0.9]
            sim = SimSampler(lib, 3, N)
            toks, probs = sim.run(x[None], [0, 0, 0], us, params, history=hist, paths=paths)
            for i, path in enumerate(paths):
                ref = twin_probs(x, params, hist + path)
                kept, want = np.flatnonzero(probs[i] > 0), np.flatnonzero(ref > 0)
                assert kept.tolist() == want.tolist()
                tol = 1e-12 if extra["repetition_penalty"] == 2.0 else 1e-5  # float32 rounding of penalised logits
                np.testing.assert_allclose(probs[i], ref, rtol=tol, atol=1e-300)
                if not near_boundary(ref, us[i], 1e-5):
                    assert toks[i] == twin_token(ref, us[i])


def test_logit_bias_alone_and_before_penalties(lib, rows9k):
    """OpenAI logit_bias: added in float64 before the penalties, as the twin does; values on a 1/64 grid stay exact in
    float32, so kept sets and probabilities equal the twin's; a bias of +100 makes its token the greedy one, -100
    takes the argmax out."""
    x = (np.round(rows9k[0] * 64) / 64).astype(np.float32)
    top = int(np.argmax(x))
    bias = ((3, 2.5), (top, -100.0), (4500, 0.75), (8999, -1.25))
    hist = [5, 9, 4500, 3]
    for extra in ({}, {"repetition_penalty": 2.0, "presence_penalty": 0.25, "repeat_last_n": -1}):
        params = params_of(0.8, 40, 0.9, 0.0, logit_bias=bias, **extra)
        us = [0.2, 0.7]
        toks, probs = SimSampler(lib, 2, N).run(x[None], [0, 0], us, params, history=hist, paths=[[], [3]])
        for i, path in enumerate(([], [3])):
            ref = twin_probs(x, params, hist + path)
            assert np.flatnonzero(probs[i] > 0).tolist() == np.flatnonzero(ref > 0).tolist()
            np.testing.assert_allclose(probs[i], ref, rtol=1e-12, atol=1e-300)
            assert probs[i][top] == 0.0
            if not near_boundary(ref, us[i]):
                assert toks[i] == twin_token(ref, us[i])
    greedy = params_of(0.0, 0, 1.0, 0.0, logit_bias=((1234, 100.0),))
    toks, _ = SimSampler(lib, 1, N).run(x[None], [0], [0.5], greedy)
    assert toks.tolist() == [1234]


def test_greedy_after_penalties(lib, rows9k):
    x = rows9k[0]
    top = np.argsort(-x)[:3]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, repeat_last_n=4)
    hist = [1, 2, int(top[0]), int(top[0])]
    sim = SimSampler(lib, 2, N)
    toks, _ = sim.run(x[None], [0, 0], [0.9, 0.9], params, history=hist, paths=[[], [int(top[1])]])
    from services.engine.sampling import apply_penalties

    for i, path in enumerate(([], [int(top[1])])):
        w = (hist + path)[-4:]
        assert toks[i] == int(np.argmax(apply_penalties(x, w, params).astype(np.float32)))
    ties = np.zeros((1, N), np.float32)
    toks, _ = sim.run(ties, [0], [0.0], SamplingParams(temperature=0.0, presence_penalty=1.0), history=[0, 1])
    assert toks[0] == 2   # the first id not penalised, of all-equal values


def test_rows_the_twin_rejects(lib):
    n = 5000
    x = np.random.default_rng(1).standard_normal((4, n)).astype(np.float32)
    x[0, 4321] = np.nan
    x[1, 17] = np.inf
    x[2, :] = -np.inf
    x[3, 100] = np.float32(-np.nan)  # a negative NaN (its sign bit set) too
    params = params_of(1.0, 5, 0.9, 0.0)
    sim = SimSampler(lib, 4, n)
    toks, probs = sim.run(x, np.arange(4), [0.5] * 4, params)
    assert toks.tolist() == [-1, -1, -1, -1]
    assert np.isnan(probs).all()
    for r in range(4):
        with pytest.raises(ValueError, match="no finite maximum"):
            twin_probs(x[r], params)


def test_full_qwen_vocabulary_one_row(lib):
    n = 248320
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(n) * 2.5).astype(np.float32)
    x[rng.choice(n, 30, replace=False)] += np.float32(8.0)
    params = params_of(0.7, 20, 0.95, 0.0)
    sim = SimSampler(lib, 1, n)
    toks, probs = sim.run(x[None], [0], [0.37], params)
    check_against_twin(probs[0], toks[0], twin_probs(x, params), 0.37)


# -- kernels/sampling.py's launcher and the engine's device path, on the simulated kernels ----------------------------


class _Stream:
    def record(self):
        return self

    def synchronize(self) -> None:
        pass


def _fake_cupy():
    """The part of CuPy kernels/sampling.py and DeviceLogits use, on NumPy arrays."""
    import types

    cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        alloc_pinned_memory=lambda n: bytearray(n),
        get_current_stream=lambda: _Stream(),
    )

    def asnumpy(a, out=None, blocking=True):
        if out is None:
            return np.array(a)
        out[...] = a
        return out

    return types.SimpleNamespace(
        cuda=cuda, asarray=np.asarray, ascontiguousarray=np.ascontiguousarray, asnumpy=asnumpy, zeros=np.zeros,
        empty=np.empty, uint8=np.uint8, uint32=np.uint32, uint64=np.uint64, int32=np.int32, float32=np.float32,
        float64=np.float64,
    )


def _sim_function(lib, order: int):
    """loader.get_function for kernels/sampling.py's sampler kernels: each launch runs the simulated kernel with
    the launcher's own argument tuple (pointers from the arrays; np.uint64(0) a null pointer)."""

    def conv(a):
        if isinstance(a, np.ndarray):
            return a.ctypes.data
        if isinstance(a, np.uint64) and int(a) == 0:
            return None
        return a.item() if isinstance(a, np.generic) else a

    def get_function(source, name, defines=(), pdl=False):
        assert source == ks.SOURCE

        def launch(grid, block, args):
            assert tuple(block) == (ks.THREADS,)
            a = [conv(v) for v in args]
            if name == "topk_partial_kernel<0, 20>":        # token_logprobs
                return lib.sim_topk_partial20(a[0], a[1], grid[1], a[2], grid[0], *a[3:])
            if name == "topk_token_final_kernel<20>":
                return lib.sim_topk_token_final20(grid[0], *a)
            if name == "sample_draw_scan_kernel":
                return lib.sim_sample_draw_scan(*a[:4], grid[0], *a[4:])
            nch, rows = grid
            assert nch == -(-a[3 if name == "sample_prep_kernel" else 4] // ks.CHUNK)
            if name == "sample_prep_kernel":
                return lib.sim_sample_prep(*a[:3], rows, *a[3:])
            if name.startswith("sample_select_kernel<"):
                lane = int(name[len("sample_select_kernel<"):-1])
                return lib.sim_sample_select(lane, *a[:4], rows, *a[4:], order)
            if name == "sample_draw_sum_kernel":
                return lib.sim_sample_draw_sum(*a[:4], rows, *a[4:], order)
            if name == "sample_probs_kernel":
                return lib.sim_sample_probs(*a[:4], rows, *a[4:])
            raise AssertionError(f"unexpected kernel {name}")

        return launch

    return get_function


@pytest.fixture
def sim_device(lib, monkeypatch):
    """kernels/sampling.py (and everything above it) running the simulated kernels on NumPy stand-ins."""
    import threading

    from kernels import loader

    monkeypatch.setattr(loader, "require", _fake_cupy)
    monkeypatch.setattr(loader, "get_function", _sim_function(lib, order=2))
    monkeypatch.setattr(ks, "_local", threading.local())


def test_launcher_against_the_twin(sim_device, rows9k):
    x = rows9k
    for params in (SamplingParams(temperature=0.9, top_k=300, top_p=0.9, min_p=0.01),
                   SamplingParams(temperature=1.3),
                   SamplingParams(temperature=0.7, top_p=0.35, repetition_penalty=1.3, presence_penalty=0.4,
                                  repeat_last_n=5),
                   SamplingParams(temperature=0.0, frequency_penalty=1.0, repeat_last_n=-1),
                   SamplingParams(temperature=0.9, top_p=0.95, logit_bias=((7, 3.0), (4500, -100.0)))):
        hist = [int(np.argmax(x[0])), 17, 17, 4500]
        paths = [[], [int(np.argmax(x[1]))], [8999, 3], []]
        us = [0.1, 0.5, 0.77, 0.99]
        kw = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                  repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
                  frequency_penalty=params.frequency_penalty,
                  last_n=params.repeat_last_n if params.penalized else 0, logit_bias=params.logit_bias)
        rows = [3, 1, 0, 2]
        toks = ks.sample(x, rows, us, history=hist, paths=paths, **kw)
        probs = ks.distribution(x, rows, history=hist, paths=paths, **kw)
        for i, r in enumerate(rows):
            ref = twin_probs(x[r], params, hist + paths[i])
            check_against_twin(probs[i], toks[i], ref, us[i], 1e-5 if params.shifted else 1e-12)
    bad = x.copy()
    bad[2, 5] = np.nan
    assert ks.sample(bad, [2, 0], [0.5, 0.5], temperature=1.0).tolist()[0] == -1


def test_engine_walk_and_plain_draws_on_simulated_kernels(sim_device):
    """DeviceLogits.sample_rows (models/qwen35_gpu.py) on the simulated kernels: walk_tree and sample_row equal the
    host path over the same rows with the same seeds, and a NaN row is handed to the NumPy path (which raises)."""
    from services.engine.ddtree import build_ddtree
    from services.engine.models.qwen35_gpu import DeviceLogits
    from services.engine.speculative import walk_tree

    rng = np.random.default_rng(4)
    V, L, K = 5000, 5, 3
    top_ids = np.stack([rng.choice(V, K, replace=False) for _ in range(L)])
    top_logp = np.sort(np.log(rng.dirichlet(np.ones(K), size=L)), axis=1)[:, ::-1]
    tree = build_ddtree(top_ids, top_logp, 8)
    x = (rng.standard_normal((len(tree) + 1, V)) * 2).astype(np.float32)
    for i, ch in enumerate(tree.children()):
        for t in ch:
            x[i, t] += 14.0
    lg = DeviceLogits(x, np.argmax(x, axis=-1).astype(np.int32))
    hist = [int(t) for t in rng.integers(0, V, size=12)]
    deep = 0
    for params in (SamplingParams(temperature=0.9, top_p=0.9),
                   SamplingParams(temperature=1.1, top_k=4, presence_penalty=0.5, repeat_last_n=8),
                   SamplingParams(temperature=0.0, repetition_penalty=3.0, repeat_last_n=-1),
                   SamplingParams(temperature=0.0, logit_bias=((11, 60.0),))):
        for seed in range(6):
            a, b = np.random.default_rng(seed), np.random.default_rng(seed)
            got = walk_tree(tree, lg, params, a, hist)
            assert got == walk_tree(tree, x, params, b, hist)
            assert a.random() == b.random()
            deep += len(got[0]) > 2
            from services.engine.sampling import sample_row

            assert sample_row(lg, -1, params, a, hist) == sample_row(x, -1, params, b, hist)
    assert deep >= 4
    x[0, 7] = np.inf
    with pytest.raises(ValueError, match="no finite maximum"):
        walk_tree(tree, DeviceLogits(x, np.zeros(len(x), np.int32)), SamplingParams(temperature=1.0),
                  np.random.default_rng(0), hist)


def test_device_logprobs_on_simulated_kernels(sim_device, monkeypatch):
    """DeviceLogits.logprobs (the OpenAI logprobs of a GPU step's rows) on the simulated kernels equals the NumPy
    path over the same rows: runs of rows (sliced) and scattered ones (gathered), each with its own token."""
    from services.engine.logprobs import row_logprobs
    from services.engine.models.qwen35_gpu import DeviceLogits

    monkeypatch.setitem(ks._sm_count, 0, 3)
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((6, 4000)) * 3).astype(np.float32)
    x[2, [5, 3000]] = 10.0
    lg = DeviceLogits(x, np.argmax(x, axis=-1).astype(np.int32))
    for rows, n in (([0, 1, 2], 5), ([4, 1, 5, 2], 20), ([-1], 0), ([3], 1)):
        toks = [int(t) for t in rng.integers(0, 4000, len(rows))]
        got, want = row_logprobs(lg, rows, toks, n), row_logprobs(x, rows, toks, n)
        for g, w in zip(got, want):
            assert g.token == w.token and abs(g.logprob - w.logprob) < 1e-4
            assert [i for i, _ in g.top] == [i for i, _ in w.top]
            assert np.allclose([v for _, v in g.top], [v for _, v in w.top], atol=1e-4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lg.logprobs([0], [4000], 1)
