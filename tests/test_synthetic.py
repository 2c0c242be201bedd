"""Synthetic models (services/engine/synthetic.py): real shapes, types and metadata, valid random weights."""

import json
import os

import gguf
import numpy as np
import pytest

from services.cli import build_parser, main
from services.engine import synthetic as S
from services.engine.config import config_from_gguf
from services.engine.errors import SpecsplitError
from services.engine.formats import open_model_file
from services.engine.loader import load_target
from services.engine.models.dflash import load_drafter
from services.engine.quants import dequantize
from services.engine.sampling import SamplingParams
from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate

Q = gguf.GGMLQuantizationType

# beellama's llama-bench on the peer's synthetic Qwen3.6-27B Q4_K_M (../shared/reference/peer_baseline.md)
PEER_BYTES = {"Q4_K": 12_076_646_400, "Q6_K": 4_449_177_600, "F32": 10_582_016}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return S.make_synthetic("tiny", str(tmp_path_factory.mktemp("synthetic")), seed=7, quiet=True)


def test_tiny_round_trip_and_forward(tiny):
    shape = S.get_shape("tiny")
    assert os.path.getsize(tiny.target_path) == tiny.target_bytes
    assert not [f for f in os.listdir(os.path.dirname(tiny.target_path)) if ".partial-" in f]
    target = load_target(tiny.target_path)
    cfg, want = target.cfg, shape.target
    for key in ("arch", "n_layer", "n_embd", "n_ff", "n_vocab", "n_head", "n_head_kv", "head_dim", "n_rot",
                "context_length", "recurrent_layers", "ssm_conv_kernel", "ssm_head_k_dim", "ssm_n_k_heads",
                "ssm_n_v_heads", "ssm_inner_size"):
        assert getattr(cfg, key) == getattr(want, key), key
    assert target.file.metadata["general.description"].startswith("SYNTHETIC")
    assert "synthetic" in target.file.metadata["general.name"]
    # stored types are the plan's
    for spec in S.target_tensors(want):
        t = target.file.tensors[spec.name]
        assert (t.shape, t.qtype) == (spec.shape, spec.qtype), spec.name

    tok = target.tokenizer
    ids = tok.encode("the cat sat on the mat")
    assert len(ids) < len("the cat sat on the mat") and tok.decode(ids) == "the cat sat on the mat"
    state = target.model.new_state(128)
    res = target.model.forward(state, ids, capture=[1, 3])
    assert np.isfinite(res.logits).all() and np.isfinite(res.captured).all()
    assert 0.1 < float(res.logits.std()) < 10.0

    drafter = load_drafter(tiny.drafter_path, target.model)
    out = speculative_generate(target.model, LocalProposer(drafter), ids, 6, SamplingParams(), SpecConfig(budget=8))
    assert len(out.token_ids) == 6 and all(0 <= t < cfg.n_vocab for t in out.token_ids)


def test_27b_types_and_bytes_equal_the_peer_file():
    specs = S.target_tensors(S.get_shape("qwen3.6-27b").target)
    assert len(specs) == 851
    assert S.bytes_by_type(specs) == PEER_BYTES
    types = {s.name: s.qtype for s in specs}
    more = [i for i in range(64) if S.use_more_bits(i, 64)]
    assert len(more) == 32 and more[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 10] and more[-8:] == list(range(56, 64))
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    assert types["blk.0.attn_qkv.weight"] == Q.Q6_K and types["blk.8.attn_qkv.weight"] == Q.Q4_K
    assert types["blk.3.attn_v.weight"] == Q.Q6_K and types["blk.11.attn_v.weight"] == Q.Q4_K
    assert types["blk.10.ffn_down.weight"] == Q.Q6_K and types["blk.11.ffn_down.weight"] == Q.Q4_K
    assert types["blk.0.ssm_conv1d.weight"] == Q.F32 and types["blk.0.ssm_a"] == Q.F32
    drafter = S.drafter_tensors(S.get_shape("qwen3.6-27b").drafter)
    assert len(drafter) == 3 + 11 * 5
    assert sum(s.nbytes for s in drafter) == 1_838_535_680        # ~1.73 B params at Q8_0


MIXES = [("q5_k_m", Q.Q5_K, 17), ("iq4_xs", Q.IQ4_XS, 30), ("q3_k_m", Q.Q3_K, 12), ("q4_0", Q.Q4_0, 2),
         ("iq4_nl", Q.IQ4_NL, 25)]


@pytest.mark.parametrize("quant,base,ftype", MIXES, ids=[m[0] for m in MIXES])
def test_type_mixes_are_the_q4_k_m_mix_with_another_base_type(tmp_path, quant, base, ftype):
    """--quant q5_k_m (llama.cpp's Q5_K_M mix: Q5_K where Q4_K_M has Q4_K; the LM head and the "more bits" layers'
    attn_v / attn_qkv and ffn_down Q6_K) and likewise iq4_xs / q3_k_m / q4_0 / iq4_nl (approximations of llama.cpp's
    own mixes: synthetic.QUANT_MIXES says where they differ): the base type's bytes as its block size scales Q4_K's,
    the file type (llama_ftype) in the metadata; a tiny file loads and runs."""
    shape = S.get_shape("qwen3.6-27b")
    q4 = {s.name: s for s in S.target_tensors(shape.target)}
    mix = S.target_tensors(shape.target, quant)
    assert [s.name for s in mix] == list(q4)
    for s in mix:
        want = base if q4[s.name].qtype == Q.Q4_K else q4[s.name].qtype
        assert (s.shape, s.qtype) == (q4[s.name].shape, want), s.name
    block, size = gguf.GGML_QUANT_SIZES[base]
    by = S.bytes_by_type(mix)
    assert by["Q6_K"] == PEER_BYTES["Q6_K"] and by[base.name] == PEER_BYTES["Q4_K"] // 144 * (256 // block * size)
    assert S.target_metadata(S.get_shape("tiny"), quant)["general.file_type"] == ftype
    res = S.make_synthetic("tiny", str(tmp_path), quant=quant, seed=3, draft=False, quiet=True)
    assert res.target_path.endswith(f"-{quant}.synthetic.gguf")
    target = load_target(res.target_path)
    assert target.file.tensors["blk.0.ffn_up.weight"].qtype == base
    out = target.model.forward(target.model.new_state(16), [1, 2, 3])
    assert np.isfinite(out.logits).all() and 0.1 < float(out.logits.std()) < 10.0


def test_an_unknown_mix_is_refused():
    assert set(S.QUANTS) == {"q4_k_m"} | {m[0] for m in MIXES}
    with pytest.raises(SpecsplitError, match="unknown --quant 'q2_k'"):
        S.target_tensors(S.get_shape("qwen3.6-27b").target, "q2_k")


def _header_only(path, shape):
    """The real header with a sparse (unwritten) data region: real shapes without writing gigabytes."""
    specs = S.target_tensors(shape.target, type_layers=shape.type_layers)
    header = S.gguf_header(S.target_metadata(shape), specs)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(S.file_size(header, specs))
    return specs


def test_27b_width_layers_2_header(tmp_path):
    """A --layers 2 file of the real widths: its header read back gives the real hparams and, tensor by
    tensor, the real file's shapes and types (data left sparse: no gigabytes written)."""
    shape = S.get_shape("qwen3.6-27b", layers=2)
    path = tmp_path / "h.gguf"
    specs = _header_only(path, shape)
    # gguf-py's reader needs about a minute for a 248k-token vocabulary; formats' own walk reads it in a second
    mf = open_model_file(str(path))
    meta, tensors = mf.metadata, mf.tensors
    cfg = config_from_gguf(meta, n_vocab=tensors["token_embd.weight"].shape[0], path=str(path))
    assert (cfg.n_embd, cfg.n_ff, cfg.n_vocab, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rot) == \
        (5120, 17408, 248320, 24, 4, 256, 64)
    assert (cfg.ssm_head_k_dim, cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_inner_size, cfg.ssm_conv_kernel) == \
        (128, 16, 48, 6144, 4)
    assert cfg.rope_theta == 1e7 and cfg.context_length == 262144 and cfg.n_layer == 2
    assert cfg.recurrent_layers == [True, True] and abs(cfg.rms_eps - 1e-6) < 1e-12
    assert meta["qwen35.rope.dimension_sections"] == [11, 11, 10, 0]
    assert meta["general.file_type"] == S.FILE_TYPE_Q4_K_M and meta["tokenizer.ggml.pre"] == "qwen35"
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) == 248320
    real = {s.name: s for s in S.target_tensors(S.get_shape("qwen3.6-27b").target)}
    assert len(tensors) == len(specs) == 3 + 2 * 14
    for name, t in tensors.items():       # every tensor present has the full model's shape and type
        assert (t.shape, t.qtype) == (real[name].shape, real[name].qtype), name
    assert tensors["blk.0.attn_qkv.weight"].qtype == Q.Q6_K      # layer 0 of 64 is a "more bits" layer


@pytest.mark.parametrize("qtype,fan_in", [(Q.Q4_K, 5120), (Q.Q5_K, 6144), (Q.IQ4_XS, 5120), (Q.Q6_K, 17408),
                                          (Q.Q8_0, 25600), (Q.Q3_K, 6144), (Q.Q4_0, 5120), (Q.IQ4_NL, 17408)])
def test_random_blocks_are_valid_and_scaled(qtype, fan_in):
    rng = np.random.default_rng(0)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rows = 64
    raw = S.random_blocks(qtype, rows * fan_in // block, 1 / np.sqrt(fan_in), rng)
    w = dequantize(raw, qtype, (rows, fan_in))
    assert np.isfinite(w).all()
    std = 1 / np.sqrt(fan_in)
    assert abs(float(w.std()) / std - 1) < 0.1
    assert abs(float(w.mean())) < 0.05 * std
    # the fp16 super-scales are finite and positive (Q4_0 / IQ4_NL: of either sign, their codes' means cancel)
    at = {Q.Q4_K: 0, Q.Q5_K: 0, Q.IQ4_XS: 0, Q.Q6_K: 208, Q.Q8_0: 0, Q.Q3_K: 108, Q.Q4_0: 0, Q.IQ4_NL: 0}[qtype]
    d = np.ascontiguousarray(raw[:, at:at + 2]).view(np.float16).astype(np.float32)
    signed = qtype in (Q.Q4_0, Q.IQ4_NL)
    assert np.isfinite(d).all() and ((np.abs(d) if signed else d) > 0).all()


def test_disk_space_check(tmp_path, monkeypatch):
    monkeypatch.setattr(S.shutil, "disk_usage", lambda p: type("U", (), {"free": 10_000_000})())
    with pytest.raises(SpecsplitError, match=r"not enough disk space.*need 18\.4.*target 16\.54 GB.*use --layers N"):
        S.make_synthetic("qwen3.6-27b", str(tmp_path), quiet=True)
    assert os.listdir(tmp_path) == []


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def broken(spec, rng, chunk_bytes=0):
        yield np.zeros(16, np.uint8)
        raise OSError("disk on fire")

    monkeypatch.setattr(S, "tensor_chunks", broken)
    with pytest.raises(OSError, match="disk on fire"):
        S.make_synthetic("tiny", str(tmp_path), quiet=True)
    assert os.listdir(tmp_path) == []


def test_layers_override_keeps_drafter_in_range():
    shape = S.get_shape("qwen3.6-27b", layers=2)
    assert all(0 <= i < 2 for i in shape.drafter.target_layer_ids)
    assert shape.drafter.n_features == 5 * 5120
    with pytest.raises(SpecsplitError, match="--layers"):
        S.get_shape("tiny", layers=0)
    with pytest.raises(SpecsplitError, match="unknown synthetic shape"):
        S.get_shape("llama-7b")


def test_cli_make_synthetic(tmp_path, capsys):
    assert main(["make-synthetic", "--shape", "tiny", "--out", str(tmp_path), "--seed", "3", "--ctx", "2048",
                 "--no-draft"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drafter_path"] is None and os.listdir(tmp_path) == [os.path.basename(out["target_path"])]
    assert open_model_file(out["target_path"]).metadata["qwen35.context_length"] == 2048
    # the parser's choices (kept out of the import path) name what synthetic.py knows
    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command")
    opts = {a.dest: a.choices for a in sub.choices["make-synthetic"]._actions}
    assert sorted(opts["shape"]) == sorted(S.SHAPES) and list(opts["quant"]) == list(S.QUANTS)
    assert sorted(opts["draft_quant"]) == sorted(S.DRAFT_QUANTS)
