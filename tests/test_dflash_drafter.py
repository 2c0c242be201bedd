"""The DFlash drafter against an independent one-pass torch reference, its formats, masks and errors.

The reference below is written from dflash.md §1.3/1.4 only (it reads config.json and the safetensors
itself, shares no code with services/engine/models/dflash.py): context + block in ONE forward pass with no
cache, float64. The engine's incremental draft(), fed the features in pieces over several calls, must give
the same block logits to 1e-4 relative error.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from services.engine.errors import DrafterMismatchError, ModelFormatError, UnsupportedModelError
from services.engine.formats import open_model_file
from services.engine.gguf_write import write_gguf
from services.engine.models.dflash import (
    DFlashDrafter,
    build_target_layer_ids,
    drafter_config_from_gguf,
    drafter_config_from_hf,
    export_drafter_gguf,
    load_drafter,
)
from tests.dflash_models import FULL, SLIDING, make_tiny_target, make_zlab_drafter

QT = gguf.GGMLQuantizationType
E = 64


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(n_layer=8, n_embd=E, n_vocab=320)


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# -- independent reference ---------------------------------------------------------------------------

def torch_reference(folder: Path, target, features: np.ndarray, block_ids) -> np.ndarray:
    """Logits (B, V) of all block slots; context features at positions 0..S-1, block at S..S+B-1."""
    import torch
    from safetensors.torch import load_file

    f64 = torch.float64
    cfg = json.loads((folder / "config.json").read_text())
    w = {k.removeprefix("model."): v.to(f64) for k, v in load_file(str(folder / "model.safetensors")).items()}
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    window = cfg["sliding_window"] if cfg.get("use_sliding_window") else None
    feats = torch.tensor(np.asarray(features, np.float64).reshape(len(features), w["fc.weight"].shape[1]))
    S, B = feats.shape[0], len(block_ids)

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    def rope(x, pos):                                   # HF rotate_half form, x: (N, heads, D)
        inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=f64) / D)
        ang = torch.cat([pos[:, None].to(f64) * inv[None]] * 2, dim=-1)[:, None, :]
        rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], dim=-1)
        return x * ang.cos() + rot * ang.sin()

    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = torch.tensor(np.asarray(target.tok_embd, np.float64))[torch.tensor(list(block_ids))]
    pos_all = torch.arange(S + B)
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(B, H, D)
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"]), pos_all[S:])
        src = torch.cat([ctx, h])                       # context is not passed through input_layernorm
        k = rope(rms((src @ w[p + "self_attn.k_proj.weight"].T).view(S + B, Hkv, D),
                     w[p + "self_attn.k_norm.weight"]), pos_all)
        v = (src @ w[p + "self_attn.v_proj.weight"].T).view(S + B, Hkv, D)
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        allowed = torch.ones(B, S + B, dtype=torch.bool)
        if kind == SLIDING:
            for j in range(B):
                for c in range(S):
                    allowed[j, c] = window is None or c >= S + j - (window - 1)
                for c in range(B):
                    allowed[j, S + c] = c <= j
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", probs, v).reshape(B, H * D)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h2 = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h2 @ w[p + "mlp.gate_proj.weight"].T
        up = h2 @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    out = rms(x, w["norm.weight"]) @ torch.tensor(np.asarray(target.output, np.float64)).T
    return out.numpy()


CASES = {
    # window 5 < context, GQA 4:2, 3 target layers feeding 3 draft layers
    "swa-full-swa-w5-b8": dict(n_layer=3, block_size=8, layer_types=[SLIDING, FULL, SLIDING],
                               sliding_window=5, target_layer_ids=[0, 3, 7]),
    # all full, MHA, `model.` prefix, block 16, 2 features for 2 layers
    "full-full-b16": dict(n_layer=2, block_size=16, layer_types=[FULL, FULL], n_head_kv=4, prefix="model."),
    # a sliding layer with no window: causal inside the block, all context; K=3 features, 2 layers
    "swa-nowindow": dict(n_layer=2, block_size=8, layer_types=[SLIDING, FULL], sliding_window=None,
                         target_layer_ids=[2, 4, 6], n_head_kv=1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_incremental_draft_matches_one_pass_reference(tmp_path, target, name):
    folder = make_zlab_drafter(tmp_path / name, target.cfg, seed=3, **CASES[name])
    d = load_drafter(str(folder), target)
    B, K = d.block_size, len(d.target_layer_ids)
    feats = (np.random.default_rng(1).standard_normal((20, K * E)) * 3).astype(np.float32)
    sess = d.new_session()

    # no context at all yet (start 0), then pieces of 7, 1 and 12 committed tokens
    got = d.draft(sess, None, 5, 0)
    ref = torch_reference(folder, target, feats[:0], [5] + [d.mask_token_id] * (B - 1))
    assert got.shape == (B - 1, 320) and got.dtype == np.float32
    assert rel_err(got, ref[1:]) < 1e-4

    n = 0
    for piece, last in zip([7, 1, 12], [3, 100, 319]):
        new = feats[n:n + piece]
        if piece == 12:
            new = new.reshape(piece, K, E)             # as TargetModel.forward captures them
        got = d.draft(sess, new, last, n + piece)
        n += piece
        ref = torch_reference(folder, target, feats[:n], [last] + [d.mask_token_id] * (B - 1))
        assert rel_err(got, ref[1:]) < 1e-4, f"{name}: context {n}"
        assert sess.n_ctx == n
    # drafting again from the same context (no new features) gives the same answer
    assert np.array_equal(d.draft(sess, None, 319, n), got)


# -- attention pattern ----------------------------------------------------------------------------------

def _session(d, feats):
    s = d.new_session()
    d.append_context(s, feats, len(feats))
    return s


def test_full_layers_are_bidirectional_in_the_block(tmp_path, target):
    d = load_drafter(str(make_zlab_drafter(tmp_path, target.cfg, n_layer=2, block_size=8,
                                           layer_types=[FULL, FULL])), target)
    s = _session(d, np.random.default_rng(0).standard_normal((10, 2 * E)).astype(np.float32))
    ids = np.array([4, 9, 17, 30, 2, 77, 5, 319])
    alt = ids.copy()
    alt[5] = 123
    a, b = d.block_logits(s, ids, 10), d.block_logits(s, alt, 10)
    for row in range(5):                                # earlier slots see the later token
        assert rel_err(b[row], a[row]) > 1e-4, row


def test_sliding_layers_are_causal_in_the_block(tmp_path, target):
    d = load_drafter(str(make_zlab_drafter(tmp_path, target.cfg, n_layer=2, block_size=8,
                                           layer_types=[SLIDING, SLIDING], sliding_window=None)), target)
    s = _session(d, np.random.default_rng(0).standard_normal((10, 2 * E)).astype(np.float32))
    ids = np.array([4, 9, 17, 30, 2, 77, 5, 319])
    alt = ids.copy()
    alt[5] = 123
    a, b = d.block_logits(s, ids, 10), d.block_logits(s, alt, 10)
    np.testing.assert_allclose(b[:5], a[:5], rtol=1e-6, atol=1e-6)
    assert rel_err(b[5], a[5]) > 1e-4


def test_sliding_window_per_query(tmp_path, target):
    """One sliding layer, W=4, block at 16: slot j sees context k >= 16 + j - 3."""
    d = load_drafter(str(make_zlab_drafter(tmp_path, target.cfg, n_layer=1, block_size=8,
                                           layer_types=[SLIDING], sliding_window=4)), target)
    rng = np.random.default_rng(0)
    base = rng.standard_normal((16, E)).astype(np.float32)
    ids = np.array([4] + [d.mask_token_id] * 7)
    ref = d.block_logits(_session(d, base), ids, 16)

    def changed(rows):
        f = base.copy()
        f[rows] = rng.standard_normal((len(rows), E))
        return d.block_logits(_session(d, f), ids, 16)

    np.testing.assert_allclose(changed(list(range(13))), ref, rtol=1e-6, atol=1e-6)   # all out of window
    at13 = changed([13])                                # only slot 0 (q=16) reaches back to 13
    assert rel_err(at13[0], ref[0]) > 1e-4
    np.testing.assert_allclose(at13[1:], ref[1:], rtol=1e-6, atol=1e-6)
    at14 = changed([14])                                # slots 0 and 1
    assert rel_err(at14[1], ref[1]) > 1e-4
    np.testing.assert_allclose(at14[2:], ref[2:], rtol=1e-6, atol=1e-6)


def test_full_layer_sees_all_context(tmp_path, target):
    d = load_drafter(str(make_zlab_drafter(tmp_path, target.cfg, n_layer=1, block_size=8,
                                           layer_types=[FULL])), target)
    rng = np.random.default_rng(0)
    base = rng.standard_normal((16, E)).astype(np.float32)
    f = base.copy()
    f[0] += 1.0
    a = d.draft(_session(d, base), None, 4, 16)
    b = d.draft(_session(d, f), None, 4, 16)
    assert all(rel_err(b[r], a[r]) > 1e-5 for r in range(7))


# -- GGUF ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("out_type,tol", [("f32", 1e-5), ("f16", 1e-3),
                                          ("q8_0", 2e-2)])
def test_gguf_export_roundtrip(tmp_path, target, out_type, tol):
    folder = make_zlab_drafter(tmp_path / "hf", target.cfg, n_layer=3, block_size=8,
                               layer_types=[SLIDING, FULL, SLIDING], sliding_window=5)
    hf_cfg = json.loads((folder / "config.json").read_text())
    cfg = drafter_config_from_hf(hf_cfg)
    mf = open_model_file(folder)
    out = tmp_path / f"draft-{out_type}.gguf"
    export_drafter_gguf(cfg, {n: t.dequantize() for n, t in mf.tensors.items()}, out, out_type)

    g = open_model_file(out)
    assert g.metadata["general.architecture"] == "dflash-draft"
    back = drafter_config_from_gguf(g.metadata)
    assert back.rms_eps == pytest.approx(cfg.rms_eps)    # stored as float32
    assert replace(back, rms_eps=cfg.rms_eps) == cfg
    assert g.tensors["blk.0.attn_q_norm.weight"].qtype == QT.F32
    assert g.tensors["dflash_hidden_norm.weight"].qtype == QT.F32
    matrix_type = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0}[out_type]
    assert g.tensors["blk.2.ffn_down.weight"].qtype == matrix_type

    ref_d, gg_d = load_drafter(str(folder), target), load_drafter(str(out), target)
    feats = np.random.default_rng(2).standard_normal((12, cfg.n_features)).astype(np.float32)
    a = ref_d.draft(ref_d.new_session(), feats, 7, 12)
    b = gg_d.draft(gg_d.new_session(), feats, 7, 12)
    assert rel_err(b, a) < tol


# z-lab layer tensor -> Lucebox `qwen35-dflash-draft` name (its converter: ffn_norm, not post_attention_norm)
LUCEBOX_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def test_lucebox_gguf_derives_layer_ids_from_target_depth(tmp_path, target):
    # Lucebox rule for depth 8, 2 features: 1 + k * ((8 - 2) // 1) -> [1, 7]
    folder = make_zlab_drafter(tmp_path / "hf", target.cfg, n_layer=2, block_size=16,
                               layer_types=[FULL, FULL], target_layer_ids=[1, 7], rope_theta=1e6)
    cfg = drafter_config_from_hf(json.loads((folder / "config.json").read_text()))
    tensors = {}
    for n, t in open_model_file(folder).tensors.items():
        n = {"fc.weight": "dflash.fc.weight", "hidden_norm.weight": "dflash.hidden_norm.weight",
             "norm.weight": "output_norm.weight"}.get(n, n)
        if n.startswith("layers."):
            _, i, rest = n.split(".", 2)
            n = f"blk.{i}.{LUCEBOX_LAYER_NAMES[rest]}"
        tensors[n] = (t.dequantize(), QT.F32)
    a = "qwen35-dflash-draft"
    meta = {"general.architecture": a, f"{a}.block_count": 2, f"{a}.embedding_length": E,
            f"{a}.feed_forward_length": cfg.n_ff, f"{a}.attention.head_count": cfg.n_head,
            f"{a}.attention.head_count_kv": cfg.n_head_kv, f"{a}.attention.key_length": cfg.head_dim,
            f"{a}.attention.value_length": cfg.head_dim, f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{a}.rope.freq_base": 1e6, f"{a}.dflash.n_target_layers": 2, f"{a}.dflash.block_size": 16,
            f"{a}.dflash.mask_token_id": cfg.mask_token_id, f"{a}.vocab_size": 320}
    write_gguf(tmp_path / "lb.gguf", meta, tensors)

    lb = load_drafter(str(tmp_path / "lb.gguf"), target)
    assert lb.target_layer_ids == [1, 7] and lb.block_size == 16
    ref = load_drafter(str(folder), target)
    feats = np.random.default_rng(2).standard_normal((9, 2 * E)).astype(np.float32)
    np.testing.assert_allclose(lb.draft(lb.new_session(), feats, 11, 9),
                               ref.draft(ref.new_session(), feats, 11, 9), rtol=1e-5, atol=1e-5)


# -- configs ------------------------------------------------------------------------------------------

def test_build_target_layer_ids_matches_published_configs():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]        # Qwen3-8B
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]       # Qwen3.5/3.6-27B
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]       # Qwen3.5-35B-A3B
    assert build_target_layer_ids(36, 1) == [18]


def test_config_fallbacks_and_overrides(tmp_path, target):
    folder = make_zlab_drafter(tmp_path, target.cfg, n_layer=2, layer_types=[SLIDING, FULL])
    hf = json.loads((folder / "config.json").read_text())
    del hf["dflash_config"]["target_layer_ids"]
    assert drafter_config_from_hf(hf).target_layer_ids == [1, 5]       # from num_target_layers = 8
    del hf["num_target_layers"]
    assert drafter_config_from_hf(hf, n_target_layer=36).target_layer_ids == [1, 33]
    with pytest.raises(ModelFormatError, match="target_layer_ids"):
        drafter_config_from_hf(hf)

    hf = json.loads((folder / "config.json").read_text())
    assert drafter_config_from_hf(hf).layer_causal == [True, False]
    hf["dflash_config"]["causal"] = True
    assert drafter_config_from_hf(hf).layer_causal == [True, True]
    hf["is_causal"] = False
    assert drafter_config_from_hf(hf).layer_causal == [False, False]

    hf = json.loads((folder / "config.json").read_text())
    hf["dflash_config"]["block_size"] = 8                 # newer checkpoints nest it
    hf["use_sliding_window"] = False
    hf["rope_parameters"] = {"rope_theta": 1e7}
    del hf["rope_theta"]
    c = drafter_config_from_hf(hf)
    assert (c.block_size, c.sliding_window, c.rope_theta) == (8, None, 1e7)

    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 64.0}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        drafter_config_from_hf(hf)


def test_bad_draft_calls(tmp_path, target):
    d = load_drafter(str(make_zlab_drafter(tmp_path, target.cfg, n_layer=2, block_size=8)), target)
    s = d.new_session()
    feats = np.zeros((4, 2 * E), np.float32)
    with pytest.raises(ValueError, match="starts at position 5"):
        d.draft(s, feats, 1, 5)
    with pytest.raises(ValueError, match="features must be"):
        d.draft(s, np.zeros((4, E), np.float32), 1, 4)
    d.draft(s, feats, 1, 4)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        d.draft(s, None, 1, 6)
    with pytest.raises(ValueError, match="block token ids"):
        d.draft(s, None, 320, 4)


# -- mismatches and bad files -------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(hidden_size=32), "hidden size 32 != target hidden size 64"),
    (dict(target_layer_ids=[1, 8]), r"has 8 layers .*\[8\] out of range"),
    (dict(mask_token_id=320), "mask_token_id 320 is outside the target's 320-row"),
    (dict(vocab_size=151936), "vocab_size 151936 != target vocabulary 320"),
])
def test_mismatches(tmp_path, target, kw, match):
    folder = make_zlab_drafter(tmp_path, target.cfg, n_layer=2, **kw)
    with pytest.raises(DrafterMismatchError, match=match):
        load_drafter(str(folder), target)


def test_fc_width_mismatch(tmp_path, target):
    folder = make_zlab_drafter(tmp_path, target.cfg, n_layer=2, target_layer_ids=[1, 5])
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 3, 5]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterMismatchError, match="fc takes 128 input features .* = 192"):
        load_drafter(str(folder), target)


def test_bad_files(tmp_path, target):
    # truncated safetensors
    folder = make_zlab_drafter(tmp_path / "trunc", target.cfg, n_layer=2)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match="truncated"):
        load_drafter(str(folder), target)

    # a tensor missing
    from safetensors.numpy import load_file, save_file

    folder = make_zlab_drafter(tmp_path / "missing", target.cfg, n_layer=2)
    t = load_file(str(folder / "model.safetensors"))
    del t["layers.1.mlp.up_proj.weight"]
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        load_drafter(str(folder), target)

    # no mask token id
    folder = make_zlab_drafter(tmp_path / "nomask", target.cfg, n_layer=2)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="mask_token_id"):
        load_drafter(str(folder), target)

    # a target model handed over as drafter
    tgt = tmp_path / "target"
    tgt.mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((8, 4), np.float32)}, str(tgt / "model.safetensors"))
    tgt_cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    (tgt / "config.json").write_text(json.dumps(tgt_cfg))
    with pytest.raises(ModelFormatError, match="a target model"):
        load_drafter(str(tgt), target)

    # GGUF of another architecture, and a DFlash GGUF without its keys
    write_gguf(tmp_path / "llama.gguf", {"general.architecture": "llama", "llama.block_count": 1},
               {"x.weight": (np.zeros(32, np.float32), QT.F32)})
    with pytest.raises(ModelFormatError, match="architecture 'llama'"):
        load_drafter(str(tmp_path / "llama.gguf"), target)
    write_gguf(tmp_path / "nokeys.gguf", {"general.architecture": "dflash-draft"},
               {"x.weight": (np.zeros(32, np.float32), QT.F32)})
    with pytest.raises(ModelFormatError, match="dflash-draft.block_count"):
        load_drafter(str(tmp_path / "nokeys.gguf"), target)

    # not a model at all
    (tmp_path / "junk.bin").write_bytes(b"hello, this is not a model file")
    with pytest.raises(ModelFormatError):
        load_drafter(str(tmp_path / "junk.bin"), target)


def test_constructor_takes_hf_tensor_names(tmp_path, target):
    folder = make_zlab_drafter(tmp_path, target.cfg, n_layer=2, block_size=8)
    cfg = drafter_config_from_hf(json.loads((folder / "config.json").read_text()))
    t = {n: r.dequantize() for n, r in open_model_file(folder).tensors.items()}
    d = DFlashDrafter(cfg, t, target)
    ref = load_drafter(str(folder), target)
    feats = np.ones((3, 2 * E), np.float32)
    assert np.array_equal(d.draft(d.new_session(), feats, 2, 3), ref.draft(ref.new_session(), feats, 2, 3))


def test_drafts_from_captured_target_features(tmp_path, target):
    """The loop's real input: TargetModel.forward(capture=ids).captured rows, (n, K, n_embd) each step."""
    folder = make_zlab_drafter(tmp_path, target.cfg, n_layer=2, block_size=8, layer_types=[SLIDING, FULL],
                               sliding_window=6, target_layer_ids=[1, 4, 6])
    d = load_drafter(str(folder), target)
    prompt = [5, 17, 99, 3, 250, 8, 41, 7, 12, 300]
    state = target.new_state(64)
    out = target.forward(state, prompt, capture=d.target_layer_ids)
    state.commit(range(len(prompt)))
    sess = d.new_session()
    bonus = int(np.argmax(out.logits[-1]))
    got = d.draft(sess, out.captured, bonus, len(prompt))
    ref = torch_reference(folder, target, out.captured, [bonus] + [d.mask_token_id] * 7)
    assert rel_err(got, ref[1:]) < 1e-4

    # next step: the target verifies [bonus, drafts...]; say 3 tokens get committed
    drafts = np.argmax(got, axis=1)
    step = target.forward(state, [bonus, *drafts[:2].tolist()], capture=d.target_layer_ids)
    state.commit(range(3))
    feats = np.concatenate([out.captured, step.captured])
    got2 = d.draft(sess, step.captured, 42, len(prompt) + 3)
    ref2 = torch_reference(folder, target, feats, [42] + [d.mask_token_id] * 7)
    assert rel_err(got2, ref2[1:]) < 1e-4
