"""The exact sampler on the GPU (kernels/sampling.py `sample` / `distribution`) against its NumPy twin, and sampled
decoding on the GPU engine (models/qwen35_gpu.py DeviceLogits.sample_rows) against the target's distribution.

Needs CuPy and a CUDA GPU; skipped (with the reason) anywhere else: tests/test_kernels_sampling_sim.py runs the same
kernels on the CPU, tests/test_device_walk.py the engine's use of them with a NumPy stand-in. Tolerances: kept sets
exact; probabilities 1e-12 relative (float64 exp on either side, sums in another order); the token for u equals the
twin's inverse-CDF choice unless u * total is within 1e-12 of a CDF step (counted, and rare).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kernels import loader

_REASON = loader.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"GPU sampling tests skipped: {_REASON}", allow_module_level=True)

import cupy  # noqa: E402

from kernels import sampling as ks  # noqa: E402
from services.engine.sampling import SamplingParams  # noqa: E402
from tests.sampling_twin import FILTERS, make_rows, near_boundary, twin_probs, twin_token  # noqa: E402

pytestmark = pytest.mark.gpu
VOCAB = 248320


def kwargs(params: SamplingParams) -> dict:
    return dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                last_n=params.repeat_last_n if params.penalized else 0)


@functools.cache
def rows_of(n: int, seed: int = 7) -> np.ndarray:
    return make_rows(np.random.default_rng(seed), n)


def check(probs_row: np.ndarray, tok: int, ref: np.ndarray, u: float) -> bool:
    """Asserts the kept set and probabilities; returns whether u was near a CDF step (token not compared)."""
    kept, want = np.flatnonzero(probs_row > 0), np.flatnonzero(ref > 0)
    assert kept.tolist() == want.tolist(), f"kept {len(kept)} ids, the twin {len(want)}"
    np.testing.assert_allclose(probs_row, ref, rtol=1e-12, atol=1e-300)
    assert ref[tok] > 0
    if near_boundary(ref, u):
        return True
    assert tok == twin_token(ref, u)
    return False


@pytest.mark.parametrize("n", [50000, VOCAB])
@pytest.mark.parametrize("t,k,p,m", FILTERS)
def test_against_the_twin(n, t, k, p, m):
    x = rows_of(n)
    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    us = np.random.default_rng(k + int(100 * p)).random(len(x))
    dev = cupy.asarray(x)
    rows = np.arange(len(x))
    probs = cupy.asnumpy(ks.distribution(dev, rows, **kwargs(params)))
    toks = ks.sample(dev, rows, us, **kwargs(params))
    near = sum(check(probs[r], int(toks[r]), twin_probs(x[r], params), us[r]) for r in range(len(x)))
    assert near <= 1


def test_many_uniforms_of_one_row():
    x = rows_of(VOCAB)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    us = np.random.default_rng(3).random(512)
    dev = cupy.asarray(x)
    for r in (0, 1):
        toks = ks.sample(dev, np.full(len(us), r), us, **kwargs(params))
        ref = twin_probs(x[r], params)
        near = 0
        for i, u in enumerate(us):
            if near_boundary(ref, u):
                near += 1
            else:
                assert toks[i] == twin_token(ref, u)
        assert near <= 2


def test_penalties_greedy_and_rejected_rows():
    n = 50000
    x = (np.round(rows_of(n)[0] * 64) / 64).astype(np.float32)
    hist = [5, 9, 9, 17, 8000, int(np.argmax(x)), 3, 3, 3]
    paths = [[], [int(np.argsort(x)[-2]), 9], [4096, 4096, n - 1]]
    dev = cupy.asarray(x[None])
    for last_n in (-1, 6):
        params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=2.0, presence_penalty=0.25,
                                frequency_penalty=0.5, repeat_last_n=last_n)
        us = [0.3, 0.6, 0.9]
        probs = cupy.asnumpy(ks.distribution(dev, [0, 0, 0], history=hist, paths=paths, **kwargs(params)))
        toks = ks.sample(dev, [0, 0, 0], us, history=hist, paths=paths, **kwargs(params))
        for i, path in enumerate(paths):
            check(probs[i], int(toks[i]), twin_probs(x, params, hist + path), us[i])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, repeat_last_n=4)
    from services.engine.sampling import apply_penalties

    toks = ks.sample(dev, [0, 0], [0.5, 0.5], history=hist, paths=paths[:2], **kwargs(greedy))
    for i, path in enumerate(paths[:2]):
        want = int(np.argmax(apply_penalties(x, (hist + path)[-4:], greedy).astype(np.float32)))
        assert toks[i] == want
    bad = np.random.default_rng(1).standard_normal((3, n)).astype(np.float32)
    bad[0, 4321], bad[1, 17], bad[2, :] = np.nan, np.inf, -np.inf
    toks = ks.sample(cupy.asarray(bad), [0, 1, 2], [0.5] * 3, **kwargs(SamplingParams(temperature=1.0, top_p=0.9)))
    assert toks.tolist() == [-1, -1, -1]


def test_deterministic_and_workspace_reuse():
    """Bitwise equal results call after call, with other shapes and filters in between (state left clean)."""
    x = rows_of(VOCAB)
    dev = cupy.asarray(x)
    params = SamplingParams(temperature=0.9, top_k=300, top_p=0.9, min_p=0.01)
    us = np.linspace(0.05, 0.95, len(x))
    first = cupy.asnumpy(ks.distribution(dev, np.arange(len(x)), **kwargs(params)))
    t1 = ks.sample(dev, np.arange(len(x)), us, **kwargs(params))
    ks.sample(dev, [1] * 40, np.linspace(0, 0.99, 40), **kwargs(SamplingParams(temperature=1.3, top_p=0.5)))
    ks.sample(dev[:, :1000], [2], [0.5], **kwargs(SamplingParams(temperature=0.5, top_k=7)))
    assert np.array_equal(cupy.asnumpy(ks.distribution(dev, np.arange(len(x)), **kwargs(params))), first)
    assert ks.sample(dev, np.arange(len(x)), us, **kwargs(params)).tolist() == t1.tolist()


# -- the GPU engine ---------------------------------------------------------------------------------------------

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
N_TOKENS = 3


@functools.lru_cache(maxsize=1)
def engine():
    """(GPU target, prompt ids, drafter path) of the embedded default model (vocabulary 4096)."""
    from services.engine.default_model import default_model_paths
    from services.engine.loader import load_target
    from services.engine.models.qwen35_gpu import load_gpu_target

    target_path, draft_path = default_model_paths()
    ids = load_target(target_path).tokenizer.encode(PROMPT)
    gpu = load_gpu_target(target_path, 0, with_tokenizer=False).model
    return gpu, ids, draft_path


OTHER = ("other",)


def expected_joint(target, prompt, params, width: int = 12):
    """P(t1, t2, t3 | prompt) under the target's processed distribution (its own GPU logits, fetched) for t1, t2,
    t3 each among the `width` most likely at its step; everything else is one cell, OTHER. Float noise between
    this single-sequence forward and a verify's tree forward (tests/test_gpu_backend.py PATH_TOL) moves these by
    well under what 2000 samples resolve; the filters below cut where tokens are rare, so a cut moved by that noise
    moves only OTHER's mass."""
    from services.engine.sampling import target_distribution

    def dist(prefix):
        st = target.acquire_state(len(prompt) + 8)   # pooled: one state (and its graphs) for every prefix
        try:
            row = np.asarray(target.forward(st, list(prompt) + list(prefix), logits="last").logits[-1])
        finally:
            target.release_state(st)
        return target_distribution(row, params, list(prompt) + list(prefix))

    def top(p):
        ids = np.argsort(-p, kind="stable")[:width]
        return [int(i) for i in ids if p[i] > 0]

    probs = {}
    p1 = dist(())
    for a in top(p1):
        p2 = dist((a,))
        for b in top(p2):
            p3 = dist((a, b))
            for c in top(p3):
                probs[(a, b, c)] = p1[a] * p2[b] * p3[c]
    probs[OTHER] = max(0.0, 1.0 - sum(probs.values()))
    return probs


@pytest.mark.parametrize("params,spec_budget", [
    (SamplingParams(temperature=0.9), None),
    (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.2, repeat_last_n=16), 6),
])
def test_speculative_sampling_on_the_gpu_matches_the_target(params, spec_budget):
    from services.engine.backend import NumpyBackend
    from services.engine.generate import GenerationResult
    from services.engine.models.dflash import load_drafter
    from services.engine.speculative import LocalProposer, SpecConfig, speculative_stream
    from tests.test_spec_sampled import chi_square_pvalue

    gpu, ids, draft_path = engine()
    expected = expected_joint(gpu, ids, params)
    drafter = load_drafter(draft_path, gpu.host_head(), NumpyBackend())
    n, observed, accepted = 2000, {}, 0
    for i in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": 5000 + i})
        res = GenerationResult()
        for _ in speculative_stream(gpu, LocalProposer(drafter), ids, N_TOKENS, p, SpecConfig(budget=spec_budget),
                                    result=res):
            pass
        key = tuple(res.token_ids)
        key = key if key in expected else OTHER
        observed[key] = observed.get(key, 0) + 1
        accepted += res.spec["accepted"]
    assert accepted > n * 0.1, "the test must exercise accepted drafts, not only bonus tokens"
    pval = chi_square_pvalue(observed, expected, n)
    assert pval > 1e-3, f"chi-square p-value {pval:.2e}"


def test_walk_on_device_rows_equals_the_host_walk():
    """walk_tree on DeviceLogits over fixed random rows (no model noise) against the host walk over the same rows,
    400 seeds: same path and bonus, same generator state after."""
    from services.engine.ddtree import build_ddtree
    from services.engine.models.qwen35_gpu import DeviceLogits
    from services.engine.speculative import walk_tree

    rng = np.random.default_rng(2)
    V, L, K = 5000, 8, 3
    top_ids = np.stack([rng.choice(V, K, replace=False) for _ in range(L)])
    top_logp = np.sort(np.log(rng.dirichlet(np.ones(K), size=L)), axis=1)[:, ::-1]
    tree = build_ddtree(top_ids, top_logp, 16)
    x = (rng.standard_normal((len(tree) + 1, V)) * 2).astype(np.float32)
    for i, ch in enumerate(tree.children()):
        for t in ch:
            x[i, t] += 14.0
    lg = DeviceLogits(cupy.asarray(x), np.argmax(x, axis=-1).astype(np.int32))
    hist = [int(t) for t in rng.integers(0, V, size=20)]
    deep = 0
    for params in (SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=1.1, top_k=4, min_p=0.02,
                                                                               presence_penalty=0.5, repeat_last_n=8)):
        for seed in range(200):
            a, b = np.random.default_rng(seed), np.random.default_rng(seed)
            got = walk_tree(tree, lg, params, a, hist)
            assert got == walk_tree(tree, x, params, b, hist)
            assert a.random() == b.random()
            deep += len(got[0]) > 2
    assert deep > 50


def test_seeded_gpu_requests_repeat_and_match_host_draws(monkeypatch):
    """Same seed, same tokens run to run (speculative and plain), and the same tokens as the NumPy draws from the
    same GPU rows (sample_rows taken away: every visited row fetched): the generator is used the same way. A first
    run captures the CUDA graphs (eager launches round differently from replays: test_gpu_backend GRAPH_TOL)."""
    from services.engine.backend import NumpyBackend
    from services.engine.generate import generate
    from services.engine.models.dflash import load_drafter
    from services.engine.models.qwen35_gpu import DeviceLogits
    from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

    gpu, ids, draft_path = engine()
    drafter = load_drafter(draft_path, gpu.host_head(), NumpyBackend())
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=11)

    def runs():
        spec = speculative_generate(gpu, LocalProposer(drafter), ids, 48, params, spec=SpecConfig(budget=22))
        plain = generate(gpu, ids, 24, params)
        return spec.token_ids, plain.token_ids

    runs()
    first, again = runs(), runs()
    assert first == again
    monkeypatch.delattr(DeviceLogits, "sample_rows")
    host = runs()
    assert host == first


def test_token_logprobs_against_the_twin():
    """kernels/sampling.py token_logprobs (generated tokens' OpenAI logprobs) on a Qwen-sized vocabulary against
    logprobs.logprobs_of_row: the token's value and the 20 best, ties to the lower ids; a strided run of rows."""
    from services.engine.logprobs import logprobs_of_row

    x = rows_of(VOCAB)[:3].copy()
    x[0, [7, 200000, 99]] = x[0].max() + 1.0           # ties at the top
    toks = np.array([7, int(np.argmin(x[1])), 123456], np.int32)
    dev = cupy.asarray(np.concatenate([x, x]))          # rows 0..2 of a taller array: a view with its own rows
    tok_lp, ids, lp = ks.token_logprobs(dev[:3], cupy.asarray(toks))
    tok_lp, ids, lp = cupy.asnumpy(tok_lp), cupy.asnumpy(ids), cupy.asnumpy(lp)
    for r in range(3):
        want = logprobs_of_row(x[r], int(toks[r]), ks.LOGPROB_K)
        assert abs(tok_lp[r] - want.logprob) < 1e-4
        assert ids[r].tolist() == [i for i, _ in want.top]
        assert np.abs(lp[r] - [v for _, v in want.top]).max() < 1e-4


def test_gpu_logprobs_equal_the_numpy_engines():
    """Greedy decoding with top_logprobs on the GPU engine, speculative (the verify's rows along the path) and
    plain: the same tokens as the NumPy engine, and log-probabilities within the GPU's logit noise of the NumPy
    engine's."""
    from services.engine.backend import NumpyBackend
    from services.engine.default_model import default_model_paths
    from services.engine.generate import generate
    from services.engine.loader import load_target
    from services.engine.models.dflash import load_drafter
    from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

    gpu, ids, draft_path = engine()
    cpu = load_target(default_model_paths()[0], with_tokenizer=False).model
    want = generate(cpu, ids, 24, top_logprobs=5)
    drafter = load_drafter(draft_path, gpu.host_head(), NumpyBackend())
    spec = speculative_generate(gpu, LocalProposer(drafter), ids, 24, spec=SpecConfig(budget=22), top_logprobs=5)
    plain = generate(gpu, ids, 24, top_logprobs=5)
    assert spec.spec["accepted"] > 0
    for got in (spec, plain):
        assert got.token_ids == want.token_ids
        assert len(got.logprobs) == 24
        for g, w in zip(got.logprobs, want.logprobs):
            # a log-probability is a logit less logZ: at most twice the logits' noise (test_gpu_backend LOGIT_TOL)
            assert g.token == w.token and abs(g.logprob - w.logprob) < 0.1
            assert g.top[0][0] == w.top[0][0] == g.token and len(g.top) == 5
            assert np.allclose([v for _, v in g.top], [v for _, v in w.top], atol=0.1)


def test_gpu_prompt_logprobs_equal_the_numpy_engines():
    """A scored prompt (OpenAI echo) on the GPU engine: its chunks as prompt graph steps with every row kept (the
    last one padded), 150 tokens past two 64-token chunks, against the NumPy engine's within twice its logit noise."""
    from services.engine.default_model import default_model_paths
    from services.engine.generate import generate
    from services.engine.loader import load_target

    gpu, ids, _ = engine()
    cpu = load_target(default_model_paths()[0], with_tokenizer=False).model
    prompt = (list(ids) * 20)[:150]
    want = generate(cpu, prompt, 2, prompt_logprobs=3)
    for max_tokens in (0, 2):
        got = generate(gpu, prompt, max_tokens, prompt_logprobs=3)
        assert len(got.prompt_logprobs) == len(prompt) - 1
        assert got.token_ids == want.token_ids[:max_tokens]
        for g, w in zip(got.prompt_logprobs, want.prompt_logprobs):
            assert g.token == w.token and abs(g.logprob - w.logprob) < 0.1
            assert np.allclose([v for _, v in g.top], [v for _, v in w.top], atol=0.1)


def test_logit_bias_against_the_twin():
    """The sampler with an OpenAI logit bias (added before the penalties) on a Qwen-sized vocabulary: the
    distribution and the draws the twin gives; a +100 bias is the greedy token, -100 takes the argmax out."""
    x = (np.round(rows_of(VOCAB)[:2] * 64) / 64).astype(np.float32)
    top = int(np.argmax(x[0]))
    bias = ((3, 2.5), (top, -100.0), (200000, 0.75), (VOCAB - 1, -1.25))
    dev = cupy.asarray(x)
    for params in (SamplingParams(temperature=0.8, top_p=0.9, logit_bias=bias),
                   SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.5, repeat_last_n=-1,
                                  logit_bias=bias)):
        hist = [3, 9, 200000]
        kw = dict(kwargs(params), logit_bias=params.logit_bias)
        probs = cupy.asnumpy(ks.distribution(dev, [0, 1], history=hist, **kw))
        us = [0.25, 0.75]
        toks = ks.sample(dev, [0, 1], us, history=hist, **kw)
        for r in range(2):
            ref = twin_probs(x[r], params, hist)
            # a penalised value is rounded to float32 on the device (x + 2.5 on a 1/64 grid is exact; / 1.5 is not)
            np.testing.assert_allclose(probs[r], ref, rtol=1e-5 if params.penalized else 1e-12, atol=1e-300)
            if not near_boundary(ref, us[r], 1e-5):
                assert toks[r] == twin_token(ref, us[r])
        assert probs[0][top] == 0.0
    greedy = ks.sample(dev, [0, 1], [0.0, 0.0], temperature=0.0, logit_bias=((123456, 100.0),))
    assert greedy.tolist() == [123456, 123456]


def test_gpu_greedy_under_a_logit_bias_equals_the_numpy_engines():
    """Greedy decoding under a logit bias on the GPU engine (every draw through the sampler, not the step's argmax),
    speculative and plain, gives the NumPy engine's tokens."""
    from services.engine.backend import NumpyBackend
    from services.engine.default_model import default_model_paths
    from services.engine.generate import generate
    from services.engine.loader import load_target
    from services.engine.models.dflash import load_drafter
    from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

    gpu, ids, draft_path = engine()
    cpu = load_target(default_model_paths()[0], with_tokenizer=False).model
    plain = generate(cpu, ids, 16).token_ids
    params = SamplingParams(logit_bias=((plain[2], -100.0), (plain[5], -100.0), (13, 1.5)))
    want = generate(cpu, ids, 16, params).token_ids
    assert want != plain
    drafter = load_drafter(draft_path, gpu.host_head(), NumpyBackend())
    spec = speculative_generate(gpu, LocalProposer(drafter), ids, 16, params, spec=SpecConfig(budget=22))
    assert spec.token_ids == want and spec.spec["accepted"] > 0
    assert generate(gpu, ids, 16, params).token_ids == want
