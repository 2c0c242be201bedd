"""Sampling: filters on hand-made logits, determinism, one uniform per draw, empirical frequencies."""

from __future__ import annotations

import numpy as np
import pytest

from services.engine.errors import InvalidRequestError
from services.engine.sampling import (
    SamplingParams,
    make_rng,
    sample,
    sample_from,
    target_distribution,
    target_distributions,
)


def _softmax(x):
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


def test_greedy_is_argmax_lowest_on_ties():
    logits = np.array([0.5, 3.0, -1.0, 3.0], dtype=np.float32)
    p = SamplingParams()
    assert p.greedy
    assert sample(logits, p, make_rng(0)) == 1
    np.testing.assert_array_equal(target_distribution(logits, p), [0, 1, 0, 0])
    rng = make_rng(0)
    state = rng.bit_generator.state
    sample(logits, p, rng)
    assert rng.bit_generator.state == state  # greedy consumes no randomness


def test_temperature_only_is_scaled_softmax():
    logits = np.array([1.0, 2.0, 0.0, -3.0])
    got = target_distribution(logits, SamplingParams(temperature=0.7))
    np.testing.assert_allclose(got, _softmax(logits / 0.7), rtol=1e-12)
    assert got.dtype == np.float64 and got.sum() == pytest.approx(1.0, abs=1e-12)


def test_top_k():
    logits = np.array([1.0, 4.0, 3.0, 2.0, 0.0])
    got = target_distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    want = np.zeros(5)
    want[[1, 2]] = _softmax([4.0, 3.0])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # Ties at the cut keep the lower ids, exactly k of them.
    tied = np.array([1.0, 2.0, 2.0, 2.0, 0.0])
    got = target_distribution(tied, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(got, [0, 0.5, 0.5, 0, 0])
    # top_k >= vocab is no filter.
    np.testing.assert_allclose(
        target_distribution(logits, SamplingParams(temperature=1.0, top_k=50)), _softmax(logits), rtol=1e-12
    )


def test_top_p():
    probs = np.array([0.05, 0.5, 0.2, 0.15, 0.1])
    logits = np.log(probs)
    # Sorted: 0.5, 0.2, 0.15, 0.1, 0.05 -> cumulative 0.5, 0.7, 0.85, 0.95: top_p=0.8 keeps three.
    got = target_distribution(logits, SamplingParams(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(got, [0, 0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0], rtol=1e-12)
    # Reaching top_p exactly stops there; a tiny top_p keeps only the best token.
    got = target_distribution(logits, SamplingParams(temperature=1.0, top_p=0.5))
    np.testing.assert_allclose(got, [0, 1, 0, 0, 0], atol=1e-12)
    got = target_distribution(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    np.testing.assert_allclose(got, [0, 1, 0, 0, 0])


def test_top_p_large_vocab_uses_whole_head():
    # More than the first partial-sort window (256) is needed to reach top_p on a flat distribution.
    rng = np.random.default_rng(1)
    logits = rng.normal(scale=0.01, size=5000)
    got = target_distribution(logits, SamplingParams(temperature=1.0, top_p=0.9))
    p = _softmax(logits)
    order = np.argsort(-p, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
    keep = order[before < 0.9]
    want = np.zeros_like(p)
    want[keep] = p[keep] / p[keep].sum()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-15)
    assert 4000 < np.count_nonzero(got) < 5000


def test_min_p():
    probs = np.array([0.4, 0.3, 0.2, 0.07, 0.03])
    got = target_distribution(np.log(probs), SamplingParams(temperature=1.0, min_p=0.2))
    # threshold 0.2 * 0.4 = 0.08: the last two go.
    np.testing.assert_allclose(got, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0, 0], rtol=1e-12)


def test_filter_order_temperature_first():
    logits = np.log(np.array([0.6, 0.25, 0.1, 0.05]))
    # At T=2 the scaled softmax is flatter, so top_p=0.8 keeps more than it would at T=1.
    p = SamplingParams(temperature=2.0, top_k=3, top_p=0.8, min_p=0.0)
    got = target_distribution(logits, p)
    scaled = _softmax(logits[:3] / 2.0)  # after top_k
    # scaled ≈ [0.50, 0.32, 0.20]: cumulative before = 0, 0.50, 0.82 -> keep two.
    want = np.zeros(4)
    want[:2] = scaled[:2] / scaled[:2].sum()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert np.count_nonzero(target_distribution(logits, SamplingParams(temperature=1.0, top_p=0.8))) == 2
    assert np.count_nonzero(target_distribution(logits, SamplingParams(temperature=0.5, top_p=0.8))) == 1


def test_distribution_sums_to_one_and_masks_neg_inf():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(6, 300)).astype(np.float32) * 3
    logits[:, :10] = -np.inf
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02)
    dists = target_distributions(logits, params)
    assert dists.shape == (6, 300) and dists.dtype == np.float64
    np.testing.assert_allclose(dists.sum(axis=1), 1.0, atol=1e-12)
    assert np.all(dists[:, :10] == 0)
    assert np.all((dists > 0).sum(axis=1) <= 40)
    for row in range(6):
        np.testing.assert_array_equal(dists[row], target_distribution(logits[row], params))
    greedy = target_distributions(logits, SamplingParams())
    np.testing.assert_array_equal(greedy.argmax(axis=1), logits.argmax(axis=1))
    np.testing.assert_array_equal(greedy.sum(axis=1), 1.0)


def test_seeded_sampling_is_deterministic():
    logits = np.random.default_rng(3).normal(size=1000)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    a = [sample(logits, p, r) for r in [make_rng(p.seed)] for _ in range(50)]
    b = [sample(logits, p, r) for r in [make_rng(p.seed)] for _ in range(50)]
    assert a == b
    assert len(set(a)) > 5
    assert make_rng(-5).random() == make_rng(-5).random()  # negative OpenAI seeds are fine


def test_one_uniform_per_draw_inverse_cdf():
    logits = np.random.default_rng(4).normal(size=100)
    p = SamplingParams(temperature=0.9, top_k=20)
    rng, twin = make_rng(7), make_rng(7)
    for _ in range(100):
        tok = sample(logits, p, rng)
        u = twin.random()
        cdf = np.cumsum(target_distribution(logits, p))
        assert tok == int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    assert rng.random() == twin.random()


def test_sample_from_never_picks_zero_mass():
    probs = np.array([0.0, 0.3, 0.0, 0.7, 0.0])

    class Edge:
        def __init__(self, u):
            self.u = u

        def random(self):
            return self.u

    assert sample_from(probs, Edge(0.0)) == 1
    assert sample_from(probs, Edge(0.3 - 1e-12)) == 1
    assert sample_from(probs, Edge(0.3)) == 3
    assert sample_from(probs, Edge(np.nextafter(1.0, 0.0))) == 3


def test_empirical_frequencies_chi_square():
    logits = np.random.default_rng(5).normal(scale=1.5, size=64)
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.95, min_p=0.01, seed=2024)
    probs = target_distribution(logits, params)
    rng = make_rng(params.seed)
    n = 20000
    # sample() is sample_from(target_distribution(...)) (checked above); drawing from probs keeps this fast.
    counts = np.bincount([sample_from(probs, rng) for _ in range(n)], minlength=64)
    assert np.all(counts[probs == 0] == 0)
    support = probs > 0
    expected = probs[support] * n
    chi2 = float((((counts[support] - expected) ** 2) / expected).sum())
    dof = int(support.sum()) - 1
    # 99.9th percentile of chi-square(dof) via Wilson-Hilferty; fixed seed so this is deterministic anyway.
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_validate_rejects(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs).validate()
    assert info.value.param == param


def test_validate_accepts_edges():
    for p in (
        SamplingParams(),
        SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, seed=-3),
        SamplingParams(temperature=0.0, top_p=1e-6, min_p=1.0),
    ):
        assert p.validate() is p
