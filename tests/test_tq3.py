"""TQ3_0 format (layout, codes, rotation, error bound) and the KV cache types: attention, speculation, CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest

from services.engine.kvcache import KVCache, kv_bytes_per_token, resolve_cache_types, row_bytes
from services.engine.layers import ancestor_matrix, masked_attention
from services.engine.quants import tq3

# TurboQuant_mse distortion bound for b = 3 bits per coordinate of a unit vector (Zandieh et al.,
# arXiv:2504.19874, Thm. 1): E||x - x~||^2 <= sqrt(3) pi / 2 * 4^-b.
TURBOQUANT_BOUND_3BIT = np.sqrt(3) * np.pi / 2 * 4.0 ** -3


def butterfly_rotate(x: np.ndarray) -> np.ndarray:
    """The published CUDA rotation written out: signs1, in-place FWHT, 1/sqrt(g), signs2 (float64)."""
    g = len(x)
    y = x.astype(np.float64) * tq3.SIGNS1[:g]
    h = 1
    while h < g:
        for i in range(0, g, 2 * h):
            for j in range(i, i + h):
                a, b = y[j], y[j + h]
                y[j], y[j + h] = a + b, a - b
        h *= 2
    return y / np.sqrt(g) * tq3.SIGNS2[:g]


def test_block_layout_and_size():
    x = np.random.default_rng(0).standard_normal((3, 5, 256)).astype(np.float32)
    b = tq3.quantize_tq3_0(x)
    assert b.shape == (3, 5, 8, 14) and b.dtype == np.uint8
    assert b.nbytes * 8 / x.size == 3.5
    assert tq3.row_bytes(256) == 112 and row_bytes("tq3_0", 128) == 56 and row_bytes("q8_0", 128) == 136
    # the 4 blocks of one 128-value group carry the same fp16 norm
    norms = tq3.block_norms(b)
    assert np.array_equal(norms[..., 0:4], np.repeat(norms[..., 0:1], 4, axis=-1))
    assert not np.array_equal(norms[..., 0], norms[..., 4])
    with pytest.raises(ValueError, match="multiple of 64"):
        tq3.quantize_tq3_0(np.zeros((2, 96), np.float32))


@pytest.mark.parametrize("g", [128, 64])
def test_rotation_is_orthogonal_invertible_and_the_published_one(g):
    rng = np.random.default_rng(1)
    eye = np.eye(g, dtype=np.float32)
    r = tq3.rotate(eye)                                   # rows: images of the unit vectors
    np.testing.assert_allclose(r @ r.T, eye, atol=1e-6)
    x = rng.standard_normal((7, 2 * g)).astype(np.float32)
    np.testing.assert_allclose(tq3.inverse_rotate(tq3.rotate(x)), x, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(tq3.rotate(x), axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    np.testing.assert_allclose(tq3.rotate(x[0, :g]), butterfly_rotate(x[0, :g]), atol=1e-5)


@pytest.mark.parametrize("g", [128, 64])
def test_known_vector_codes_by_hand(g):
    # 5 * e_0: the rotation gives y_j = signs2_j * signs1_0 / sqrt(g) = -signs2_j / sqrt(g) (signs1_0 = -1),
    # |y_j| = 0.0884 (g=128) lies between midpoints 0.0436 and 0.0918: codes 2 (-0.0657) or 5 (+0.0657);
    # for g = 64, |y_j| = 0.125 lies between the sqrt(2)-scaled midpoints 0.0616 and 0.1298: same codes.
    x = np.zeros(g, np.float32)
    x[0] = 5.0
    b = tq3.quantize_tq3_0(x)
    want_idx = np.where(tq3.SIGNS2[:g] > 0, 2, 5).astype(np.uint8)
    assert np.array_equal(tq3.decode_indices(b).reshape(-1), want_idx)
    # stored norm = ||x|| / ||centroids||, ||centroids|| = 0.065717 * sqrt(g)
    want_norm = np.float16(5.0 / (0.065717 * np.sqrt(g)))
    assert np.all(tq3.block_norms(b) == np.float32(want_norm))
    # bytes: idx 2 = low 0b10, high 0; idx 5 = low 0b01, high 1; value j at bits 2*(j%4) of qs[j//4]
    blk = b[0]
    low, high = want_idx[:32] & 3, want_idx[:32] >> 2
    assert blk[2:10].tolist() == [int(sum(int(low[4 * i + k]) << (2 * k) for k in range(4))) for i in range(8)]
    assert blk[10:14].tolist() == [int(sum(int(high[8 * i + k]) << k for k in range(8))) for i in range(4)]
    assert blk[0:2].tobytes() == want_norm.tobytes()
    np.testing.assert_allclose(tq3.dequantize_tq3_0(b), x, atol=5 * 2e-3)


@pytest.mark.parametrize("dim", [128, 256, 64])
def test_round_trip_error_below_turboquant_bound(dim):
    rng = np.random.default_rng(2)
    gauss = rng.standard_normal((2000, dim)).astype(np.float32)
    heavy = rng.standard_t(3, (2000, dim)).astype(np.float32)
    outl = gauss.copy()
    outl[:, [3, 17, 40]] *= 20.0                        # a few large channels, as real keys have
    for x in (gauss, heavy, outl):
        y = tq3.dequantize_tq3_0(tq3.quantize_tq3_0(x))
        g = tq3.group_size(dim)
        xg, yg = x.reshape(-1, g), y.reshape(-1, g)
        # per 128-group (64 for dim 64): squared error relative to the group's squared norm
        nmse = float((((xg - yg) ** 2).sum(1) / (xg ** 2).sum(1)).mean())
        assert nmse < TURBOQUANT_BOUND_3BIT, nmse
    # and the Gaussian case is close to the Lloyd-Max optimum (0.0345), not just under the bound
    y = tq3.dequantize_tq3_0(tq3.quantize_tq3_0(gauss))
    assert float(((gauss - y) ** 2).sum() / (gauss ** 2).sum()) < 0.036


def test_zero_rows_stay_zero():
    b = tq3.quantize_tq3_0(np.zeros((2, 128), np.float32))
    assert np.array_equal(tq3.dequantize_tq3_0(b), np.zeros((2, 128), np.float32))


COMBOS = [("tq3_0", "tq3_0"), ("q8_0", "tq3_0"), ("f16", "tq3_0"), ("tq3_0", "f16"), ("q8_0", "q8_0"),
          ("f16", "f16"), ("f32", "f32")]


@pytest.mark.parametrize("types", COMBOS)
def test_attention_over_quantized_kv_equals_attention_over_dequantized(types):
    rng = np.random.default_rng(3)
    H, Hkv, D, n_past, max_ctx = 6, 2, 128, 40, 64
    cache = KVCache.allocate(max_ctx, Hkv, D, *types)
    k = rng.standard_normal((n_past, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((n_past, Hkv, D)).astype(np.float32)
    for t in range(n_past):                       # written one token at a time, as decode does
        cache.write(t, k[t:t + 1], v[t:t + 1])
    # a tree of 5 tokens after the context (single-token decode is the T = 1 case)
    parents = np.array([-1, 0, 0, 1, 3])
    T = len(parents)
    cache.write(n_past, rng.standard_normal((T, Hkv, D)).astype(np.float32),
                rng.standard_normal((T, Hkv, D)).astype(np.float32))
    visible = np.concatenate([np.ones((T, n_past), bool), ancestor_matrix(parents)], axis=1)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    n = n_past + T
    got = cache.attend(q, n, visible)
    want = masked_attention(q, cache.k.dequantize(n), cache.v.dequantize(n), visible)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    one = cache.attend(q[:1], n_past + 1, visible[:1, :n_past + 1])
    np.testing.assert_allclose(one, masked_attention(q[:1], cache.k.dequantize(n_past + 1),
                                                     cache.v.dequantize(n_past + 1), visible[:1, :n_past + 1]),
                               rtol=1e-4, atol=2e-5)
    # writing a row quantizes it on its own: the same values at another position store the same bytes
    cache.write(max_ctx - 1, k[5:6], v[5:6])
    assert np.array_equal(cache.k.data[max_ctx - 1], cache.k.data[5])
    assert np.array_equal(cache.v.data[max_ctx - 1], cache.v.data[5])


def test_q8_0_kv_values_are_the_q8_0_codec():
    from services.engine.quants import legacy

    rng = np.random.default_rng(4)
    cache = KVCache.allocate(8, 2, 64, "q8_0", "q8_0")
    k = rng.standard_normal((3, 2, 64)).astype(np.float32)
    cache.write(0, k, k)
    want = legacy.dequantize_q8_0(legacy.quantize_q8_0(k.reshape(-1, 32))).reshape(3, 2, 64)
    assert np.array_equal(cache.k.read(3), want)


def test_auto_rule_and_memory_accounting():
    from types import SimpleNamespace

    def cfg(h, hkv, d, layers=(False, True, False)):
        return SimpleNamespace(n_head=h, n_head_kv=hkv, head_dim=d, recurrent_layers=list(layers))

    assert resolve_cache_types(cfg(24, 4, 256)) == ("q8_0", "tq3_0")        # Qwen3.6-27B full attention, 6:1
    assert resolve_cache_types(cfg(8, 4, 128)) == ("tq3_0", "tq3_0")        # 2:1
    assert resolve_cache_types(cfg(4, 2, 32)) == ("f32", "f32")             # head too small for TQ3_0
    assert resolve_cache_types(cfg(4, 2, 32), "f16", "q8_0") == ("f16", "q8_0")
    with pytest.raises(ValueError, match="V cache: tq3_0 KV needs head_dim"):
        resolve_cache_types(cfg(4, 2, 32), "f16", "tq3_0")
    with pytest.raises(ValueError, match="unknown KV cache type"):
        resolve_cache_types(cfg(4, 2, 64), "q4_0", "f16")
    # Qwen3.5-27B: 16 attention layers x 4 KV heads x 256 = 32768 K+V values per token -> 14 KiB at 3.5 bpv
    q = cfg(24, 4, 256, layers=[False] * 16)
    assert kv_bytes_per_token(q, "tq3_0", "tq3_0") == 14 * 1024
    assert kv_bytes_per_token(q, "f16", "f16") == 64 * 1024
    assert kv_bytes_per_token(q, "q8_0", "tq3_0") == 16 * 4 * (272 + 112)


# ---------------------------------------------------------------------------------------------
# the engine with quantized KV


@pytest.fixture(scope="module")
def default_pair():
    from services.engine.default_model import default_model_paths
    from services.engine.loader import load_target
    from services.engine.models.dflash import load_drafter

    target_path, drafter_path = default_model_paths()
    target = load_target(target_path, with_tokenizer=False).model
    return target, load_drafter(drafter_path, target)


@pytest.mark.parametrize("types", [("tq3_0", "tq3_0"), ("q8_0", "tq3_0")])
def test_greedy_speculative_equals_plain_with_quantized_kv(default_pair, types):
    from services.engine.generate import generate
    from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

    target, drafter = default_pair
    assert target.cfg.head_dim == 64                   # the 64-group layout is what runs here
    target.set_kv_cache_types(*types)
    try:
        assert target.new_state(8).kv[3].k.kv_type == types[0]
        prompt = [20, 7, 301, 45, 9, 88, 17, 3]
        plain = generate(target, prompt, 32).token_ids
        for budget in (None, 22):
            res = speculative_generate(target, LocalProposer(drafter), prompt, 32, spec=SpecConfig(budget=budget))
            assert res.token_ids == plain
            assert res.spec["steps"] > 0
    finally:
        target.set_kv_cache_types("f32", "f32")


def test_greedy_speculative_equals_plain_on_tiny_pair_with_q8_0_kv(tiny_pair):
    # the tiny target's heads are 32 wide: too narrow for TQ3_0 (auto falls back to f32), q8_0 fits
    from services.engine.generate import generate
    from services.engine.loader import load_target
    from services.engine.models.dflash import load_drafter
    from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

    target = load_target(tiny_pair[1], with_tokenizer=False).model
    assert target.set_kv_cache_types() == ("f32", "f32")
    target.set_kv_cache_types("q8_0", "q8_0")
    drafter = load_drafter(tiny_pair[2], target)
    prompt = [5, 9, 2, 77, 31]
    plain = generate(target, prompt, 24).token_ids
    for budget in (None, 22):
        assert speculative_generate(target, LocalProposer(drafter), prompt, 24,
                                    spec=SpecConfig(budget=budget)).token_ids == plain


def test_tree_commit_keeps_the_branch_rows(default_pair):
    target, _ = default_pair
    state = target.new_state(64, "tq3_0", "q8_0")
    target.forward(state, [5, 6, 7])
    state.commit([0, 1, 2])
    # a tree: 0 -> {1, 2}, 2 -> 3; commit the branch 0, 2, 3
    target.forward(state, [10, 11, 12, 13], parents=[-1, 0, 0, 2], checkpoints=True)
    before = {i: (c.k.data[3:7].copy(), c.v.data[3:7].copy()) for i, c in state.kv.items()}
    state.commit([0, 2, 3])
    for i, c in state.kv.items():
        k, v = before[i]
        assert np.array_equal(c.k.data[3:6], k[[0, 2, 3]]) and np.array_equal(c.v.data[3:6], v[[0, 2, 3]])
    snap = state.snapshot()
    assert snap.kv[3].k.kv_type == "tq3_0" and np.array_equal(snap.kv[3].k.data, state.kv[3].k.data)


# ---------------------------------------------------------------------------------------------
# command line


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "services", *args], capture_output=True, text=True, timeout=300)


def test_generate_end_to_end_with_tq3_0(default_pair):
    from services.engine.generate import generate

    p = run_cli("generate", "--prompt-ids", "20,7,301,45", "--max-tokens", "8", "--no-draft", "--json",
                "--cache-type-k", "tq3_0", "--cache-type-v", "TQ3_0")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    kv = out["kv_cache"]
    assert (kv["cache_type_k"], kv["cache_type_v"]) == ("tq3_0", "tq3_0")
    target = default_pair[0]
    assert kv["kv_bytes_per_token"] == kv_bytes_per_token(target.cfg, "tq3_0", "tq3_0")
    assert kv["kv_bytes_per_token"] * 16 * 4 == kv["kv_bytes_per_token_f16"] * 14     # 3.5 vs 16 bits per value
    # the CLI decodes with the sampling the embedded target declares (a repetition penalty)
    from services.engine.default_model import default_model_paths
    from services.engine.formats import open_model_file
    from services.engine.sampling import model_sampling_defaults, resolve_sampling

    declared = resolve_sampling({}, model_sampling_defaults(open_model_file(default_model_paths()[0]).metadata))
    target.set_kv_cache_types("tq3_0", "tq3_0")
    try:
        assert out["token_ids"] == generate(target, [20, 7, 301, 45], 8, declared).token_ids
    finally:
        target.set_kv_cache_types("f32", "f32")


def test_bad_cache_type_is_a_clear_cli_error(tiny_pair, capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt-ids", "1,2", "--cache-type-k", "bad"])
    assert e.value.code == 2
    assert "--cache-type-k: expected one of auto, f32, f16, q8_0, tq3_0, got 'bad'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["verifier", "--model", "x.gguf", "--cache-type-v", "q4_0"])
    assert e.value.code == 2 and "--cache-type-v: expected one of" in capsys.readouterr().err
    # a type the model's head size cannot hold (tiny target: head_dim 32)
    assert main(["generate", "--model", tiny_pair[1], "--prompt-ids", "1,2", "--cache-type-v", "tq3_0"]) == 2
    assert "tq3_0 KV needs head_dim to be a multiple of 64, got 32" in capsys.readouterr().err


def test_verifier_config_takes_and_checks_cache_types():
    from services.verifier.service import VerifierConfig, VerifierServicer

    cfg = VerifierConfig(model="x.gguf", cache_type_k="Q8_0")
    assert (cfg.cache_type_k, cfg.cache_type_v) == ("q8_0", "auto")
    with pytest.raises(ValueError, match="cache_type_v must be one of auto, f32, f16, q8_0, tq3_0"):
        VerifierConfig(model="x.gguf", cache_type_v="q4_0")
    servicer = VerifierServicer(cfg)
    try:
        servicer.kv = {"cache_type_k": "q8_0", "cache_type_v": "tq3_0", "kv_bytes_per_token": 384,
                       "n_ctx": 1000, "kv_bytes": 384000}
        kv = servicer.info().kv_cache
        assert (kv.cache_type_k, kv.cache_type_v, kv.bytes_per_token, kv.max_ctx, kv.bytes_per_slot) == \
            ("q8_0", "tq3_0", 384, 1000, 384000)
    finally:
        servicer.close()
