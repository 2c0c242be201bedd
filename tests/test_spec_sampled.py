"""Sampled speculative decoding (DFlash drafter, chain and DDTree) follows the target's distribution exactly.

On a 12-token vocabulary the exact joint distribution of the first three generated tokens is computed
from the target; thousands of speculative samples (fixed seeds, so the test is deterministic) are
compared with it by a chi-square test.
"""

import itertools

import numpy as np
import pytest

from services.engine.generate import GenerationResult
from services.engine.sampling import SamplingParams, target_distribution
from services.engine.speculative import LocalProposer, SpecConfig, speculative_stream
from tests.conftest import SMALL_VOCAB

V = SMALL_VOCAB
N_TOKENS = 3
PROMPT = [3, 7, 1]


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
    # a logit bias shapes the target's distribution; the drafter does not know it (token 5 banned, 2 favoured)
    (SamplingParams(temperature=1.0, logit_bias=((2, 1.5), (5, -100.0))), SpecConfig(budget=4)),
])
def test_sampled_distribution_matches_target(small_vocab_pair, params, spec):
    target, drafter = small_vocab_pair
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


def test_chi_square_detects_a_biased_sampler(small_vocab_pair):
    """The statistic has power: samples from a slightly wrong distribution fail it."""
    target, _ = small_vocab_pair
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
