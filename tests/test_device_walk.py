"""The speculative walk and plain draws on a GPU model's logits (speculative._walk_on_device, sampling.sample_row
with sample_rows) against the host walk over the same rows: same path, bonus token and generator state after, for
sampled, penalised and penalised-greedy requests. The device is a NumPy stand-in drawing with the twin
(tests/sampling_twin.py); tests/test_kernels_sampling.py checks the real device against the same twin."""

from __future__ import annotations

import numpy as np
import pytest

from services.engine.ddtree import build_chain, build_ddtree
from services.engine.sampling import SamplingParams, sample_row
from services.engine.speculative import walk_tree
from tests.sampling_twin import TwinDeviceLogits

V = 40
PARAMS = [
    SamplingParams(temperature=0.9, top_p=0.9),
    SamplingParams(temperature=1.2, top_k=5, min_p=0.05),
    SamplingParams(temperature=0.8, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3,
                   repeat_last_n=6),
    SamplingParams(temperature=0.0, repetition_penalty=2.0, repeat_last_n=-1),
]


def test_an_array_of_uniforms_is_the_same_draws_one_at_a_time():
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    assert np.array_equal(a.random(7), [b.random() for _ in range(7)])


def _tree_and_logits(rng: np.random.Generator, chain: bool):
    L, K = 6, 3
    top_ids = np.stack([rng.choice(V, K, replace=False) for _ in range(L)])
    top_logp = np.sort(np.log(rng.dirichlet(np.ones(K), size=L)), axis=1)[:, ::-1]
    tree = build_chain(top_ids, top_logp, L) if chain else build_ddtree(top_ids, top_logp, 12)
    kids = tree.children()
    x = rng.standard_normal((len(tree) + 1, V)).astype(np.float32)
    for i, ch in enumerate(kids):           # the target likes the drafted children: walks go deep
        for t in ch:
            x[i, t] += 2.5
    return tree, x


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("chain", [True, False])
def test_walk_on_device_equals_the_host_walk(params, chain):
    rng = np.random.default_rng(17)
    depths = []
    for trial in range(40):
        tree, x = _tree_and_logits(rng, chain)
        history = [int(t) for t in rng.integers(0, V, size=9)]
        seed = 100 + trial
        host_rng, dev_rng = np.random.default_rng(seed), np.random.default_rng(seed)
        dev = TwinDeviceLogits(x)
        want = walk_tree(tree, x, params, host_rng, history)
        got = walk_tree(tree, dev, params, dev_rng, history)
        assert got == want
        assert dev.fetched == 0
        assert host_rng.random() == dev_rng.random()   # the generator advanced by the same draws
        depths.append(len(want[0]))
    assert max(depths) >= 3, "the walks must accept drafted nodes"


@pytest.mark.parametrize("params", PARAMS)
def test_sample_row_on_device_equals_the_host_draw(params):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, V)).astype(np.float32)
    history = [1, 2, 2, 30]
    a, b = np.random.default_rng(8), np.random.default_rng(8)
    dev = TwinDeviceLogits(x)
    for row in (-1, 0, 1):
        assert sample_row(dev, row, params, a, history) == sample_row(x, row, params, b, history)
    assert dev.fetched == 0 and a.random() == b.random()
