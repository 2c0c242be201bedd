"""Sampled speculative decoding (DFlash drafter, chain and DDTree) follows the target's distribution exactly.

On a 12-token vocabulary the exact joint distribution of the first three generated tokens is computed
from the target; thousands of speculative samples (fixed seeds, so the test is deterministic) are
compared with it by a chi-square test.
"""

import itertools

import numpy as np
import pytest

from services.engine.generate import GenerationResult
from services.engine.loader import load_target
from services.engine.models.dflash import load_drafter
from services.engine.sampling import SamplingParams, target_distribution
from services.engine.speculative import LocalProposer, SpecConfig, speculative_stream
from tests.dflash_models import make_zlab_drafter
from tests.hf_models import make_hf_model

V = 12
N_TOKENS = 3
PROMPT = [3, 7, 1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("sampled")
    make_hf_model("qwen35", d / "t", seed=4, vocab_size=V, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    target = load_target(str(d / "t"), with_tokenizer=False).model
    make_zlab_drafter(d / "d", target.cfg, n_layer=1, block_size=4, target_layer_ids=[0, 1], seed=5,
                      mask_token_id=V - 1)
    return target, load_drafter(str(d / "d"), target)


def exact_joint(target, params):
    """P(t1, t2, t3 | prompt) under the target's processed distribution, by enumerating prefixes."""
    probs = {}

    def dist(prefix):
        st = target.new_state(16)
        out = target.forward(st, PROMPT + list(prefix), logits="last")
        return target_distribution(out.logits[-1], params)

    p1 = dist(())
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = dist((a,))
        for b in range(V):
            if p2[b] == 0:
                continue
            p3 = dist((a, b))
            for c in range(V):
                probs[(a, b, c)] = p1[a] * p2[b] * p3[c]
    return probs


def chi_square_pvalue(observed: dict, expected_p: dict, n: int) -> float:
    from math import erf, sqrt

    cells = sorted(expected_p, key=lambda k: -expected_p[k])
    # merge the tail so every bin expects at least 5 samples
    bins, cur_e, cur_o = [], 0.0, 0
    for c in cells:
        cur_e += expected_p[c] * n
        cur_o += observed.get(c, 0)
        if cur_e >= 5:
            bins.append((cur_o, cur_e))
            cur_e, cur_o = 0.0, 0
    if cur_e > 0:
        o, e = bins.pop()
        bins.append((o + cur_o, e + cur_e))
    assert sum(o for o, _ in bins) == n
    stat = sum((o - e) ** 2 / e for o, e in bins)
    k = len(bins) - 1
    # Wilson-Hilferty normal approximation of the chi-square upper tail
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / sqrt(2 / (9 * k))
    return 0.5 * (1 - erf(z / sqrt(2)))


@pytest.mark.parametrize("params,spec", [
    (SamplingParams(temperature=0.7), SpecConfig(budget=None)),
    (SamplingParams(temperature=1.0, top_p=0.9), SpecConfig(budget=6)),
    (SamplingParams(temperature=1.0, top_p=0.9, top_k=8), SpecConfig(budget=2)),
])
def test_sampled_distribution_matches_target(pair, params, spec):
    target, drafter = pair
    expected = exact_joint(target, params)
    n = 5000
    observed: dict = {}
    accepted = 0
    for i in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": 1000 + i})
        res = GenerationResult()
        for _ in speculative_stream(target, LocalProposer(drafter), PROMPT, N_TOKENS, p, spec, result=res):
            pass
        key = tuple(res.token_ids)
        observed[key] = observed.get(key, 0) + 1
        accepted += res.spec["accepted"]
    assert accepted > n * 0.1, "the test must exercise accepted drafts, not only bonus tokens"
    pval = chi_square_pvalue(observed, expected, n)
    assert pval > 1e-3, f"chi-square p-value {pval:.2e}"


def test_chi_square_detects_a_biased_sampler(pair):
    """The statistic has power: samples from a slightly wrong distribution fail it."""
    target, _ = pair
    params = SamplingParams(temperature=1.0)
    expected = exact_joint(target, params)
    wrong = exact_joint(target, SamplingParams(temperature=0.8))
    rng = np.random.default_rng(0)
    keys = list(wrong)
    draws = rng.choice(len(keys), size=6000, p=np.array([wrong[k] for k in keys]) / sum(wrong.values()))
    observed: dict = {}
    for d in draws:
        observed[keys[d]] = observed.get(keys[d], 0) + 1
    assert chi_square_pvalue(observed, expected, 6000) < 1e-3
    assert list(itertools.islice(expected, 1))
