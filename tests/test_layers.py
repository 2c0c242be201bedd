"""The Gated DeltaNet forms agree: chunked prefill == token loop == tree with per-node parents == WY tree pass."""

import numpy as np

from services.engine.layers import (
    ancestor_matrix,
    conv_window_ids,
    gated_delta_rule_chunked,
    gated_delta_rule_tree,
    gated_delta_rule_tree_wy,
    l2_norm,
)


def _inputs(rng, T, H=3, dk=8, dv=5):
    q = l2_norm(rng.standard_normal((T, H, dk)).astype(np.float32), 1e-6) * np.float32(dk ** -0.5)
    k = l2_norm(rng.standard_normal((T, H, dk)).astype(np.float32), 1e-6)
    v = rng.standard_normal((T, H, dv)).astype(np.float32)
    g = -np.abs(rng.standard_normal((T, H))).astype(np.float32)
    beta = rng.uniform(0, 1, (T, H)).astype(np.float32)
    s0 = rng.standard_normal((H, dk, dv)).astype(np.float32) * 0.1
    return q, k, v, g, beta, s0


def test_chunked_equals_token_loop():
    rng = np.random.default_rng(0)
    for T in (1, 5, 64, 130):
        q, k, v, g, beta, s0 = _inputs(rng, T)
        o1, st = gated_delta_rule_tree(q, k, v, g, beta, s0, np.arange(-1, T - 1))
        o2, s2 = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk=16)
        np.testing.assert_allclose(o2, o1, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(s2, st[-1], rtol=1e-4, atol=1e-5)


def test_tree_branch_equals_its_own_chain():
    rng = np.random.default_rng(1)
    T = 7
    q, k, v, g, beta, s0 = _inputs(rng, T)
    parents = np.array([-1, 0, 1, 0, 3, 4, 1])
    o, st = gated_delta_rule_tree(q, k, v, g, beta, s0, parents)
    path = [0, 3, 4, 5]
    o2, st2 = gated_delta_rule_tree(q[path], k[path], v[path], g[path], beta[path], s0, np.arange(-1, 3))
    np.testing.assert_allclose(o[path], o2, rtol=1e-6)
    np.testing.assert_allclose(st[5], st2[-1], rtol=1e-6)


def test_wy_tree_pass_equals_token_loop():
    """The one-solve WY form over ancestor masks gives the token loop's outputs and every node's checkpoint,
    for chains, random trees, stars and strong decay (G down to about -60 along a path)."""
    rng = np.random.default_rng(2)
    for T in (1, 2, 7, 16, 23, 41, 65):
        for kind in ("chain", "random", "star"):
            parents = {"chain": np.arange(-1, T - 1),
                       "random": np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, T)]),
                       "star": np.array([-1] + [0] * (T - 1))}[kind]
            q, k, v, g, beta, s0 = _inputs(rng, T, H=2, dk=16, dv=8)
            if kind == "random":
                g = g * 3
            o1, st1 = gated_delta_rule_tree(q, k, v, g, beta, s0, parents)
            o2, st2 = gated_delta_rule_tree_wy(q, k, v, g, beta, s0, parents)
            assert len(st2) == T
            np.testing.assert_allclose(o2, o1, rtol=1e-4, atol=1e-5, err_msg=f"T={T} {kind}")
            np.testing.assert_allclose(st2.all(), st1, rtol=1e-4, atol=1e-5, err_msg=f"T={T} {kind}")


def test_ancestor_matrix_and_conv_windows():
    parents = np.array([-1, 0, 0, 2])
    a = ancestor_matrix(parents)
    assert a.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    ids = conv_window_ids(parents, 4)     # committed window rows 0..2, new rows start at 3
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[2].tolist() == [1, 2, 3, 5]
    assert ids[3].tolist() == [2, 3, 5, 6]
    chain = conv_window_ids(np.arange(-1, 4), 4)
    assert chain[3].tolist() == [3, 4, 5, 6]
