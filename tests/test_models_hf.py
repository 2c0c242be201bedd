"""Targets agree with Hugging Face transformers (the independent reference) on tiny random models.

Logits of a prefill and of 16 single-token decode steps are within 1e-4 relative error in float32,
loaded from the HF folder and from the GGUF that `specsplit convert` writes; greedy generation of 32
tokens is identical; captured layer outputs equal HF's hidden_states[lid + 1].
"""

import zlib

import numpy as np
import pytest

from services.engine.convert import convert_hf_to_gguf
from services.engine.generate import generate
from services.engine.loader import load_target
from tests.hf_models import hf_greedy, hf_hidden_states, hf_logits, make_hf_model

CASES = {
    "qwen3": ("qwen3", {}),
    # GQA 4:2, partial rotary (8 of 32 dims), DeltaNet value/key head ratios 3, 2 and 1, two attention layers
    "qwen35-r3": ("qwen35", {}),
    "qwen35-r2": ("qwen35", dict(linear_num_value_heads=4, num_hidden_layers=4)),
    "qwen35-r1": ("qwen35", dict(linear_num_value_heads=2, linear_value_head_dim=16, num_hidden_layers=4)),
}


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    kind, over = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(kind, folder / "hf", seed=zlib.crc32(request.param.encode()) % 1000, **over)
    convert_hf_to_gguf(str(folder / "hf"), str(folder / "model.gguf"), "f32")
    return request.param, hf, folder


def _prompt(n=23, seed=5, vocab=320):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_prefill_and_decode_logits(case, source):
    name, hf, folder = case
    path = folder / ("hf" if source == "hf" else "model.gguf")
    model = load_target(str(path), with_tokenizer=False).model
    prompt = _prompt()
    cont = _prompt(16, seed=6)
    ref = hf_logits(hf, prompt + cont)

    state = model.new_state(64)
    out = model.forward(state, prompt)
    state.commit(range(len(prompt)))
    assert rel_err(out.logits, ref[:len(prompt)]) < 1e-4
    for j, tok in enumerate(cont):
        out = model.forward(state, [tok])
        state.commit([0])
        assert rel_err(out.logits[0], ref[len(prompt) + j]) < 1e-4, f"{name} decode step {j}"


def test_greedy_generation_matches_hf(case):
    name, hf, folder = case
    model = load_target(str(folder / "model.gguf"), with_tokenizer=False).model
    prompt = _prompt(11, seed=9)
    ours = generate(model, prompt, 32).token_ids
    assert ours == hf_greedy(hf, prompt, 32)


def test_captured_layers_are_hf_hidden_states(case):
    name, hf, folder = case
    model = load_target(str(folder / "hf"), with_tokenizer=False).model
    prompt = _prompt(9, seed=3)
    layers = [0, model.cfg.n_layer - 2]
    state = model.new_state(32)
    out = model.forward(state, prompt, capture=layers, logits="none")
    hs = hf_hidden_states(hf, prompt)
    for slot, lid in enumerate(layers):
        assert rel_err(out.captured[:, slot], hs[lid + 1]) < 1e-4


def test_chunked_prefill_equals_one_pass(case):
    from services.engine.generate import prefill

    name, hf, folder = case
    model = load_target(str(folder / "model.gguf"), with_tokenizer=False).model
    prompt = _prompt(40, seed=11)
    s1, s2 = model.new_state(64), model.new_state(64)
    l1, _ = prefill(model, s1, prompt, chunk=64)
    l2, _ = prefill(model, s2, prompt, chunk=7)
    assert rel_err(l2, l1) < 1e-4     # chunked vs token-loop DeltaNet: float32 rounding


@pytest.mark.parametrize("case", sorted(k for k in CASES if k.startswith("qwen35")), indirect=True)
def test_gguf_back_to_hf_state_dict(case):
    """tensors_to_hf inverts the GGUF conventions exactly: the converted GGUF maps back to HF's own tensors
    (qwen35 only: the inverse exists for drafter training on shipped hybrid targets)."""
    name, hf, folder = case
    from services.engine.config import config_from_gguf
    from services.engine.formats import open_model_file
    from services.engine.models.qwen35 import tensors_to_hf

    mf = open_model_file(str(folder / "model.gguf"))
    cfg = config_from_gguf(mf.metadata)
    back = tensors_to_hf(cfg, {n: t.dequantize() for n, t in mf.tensors.items()})
    ref = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    assert sorted(back) == sorted(ref)
    for k, v in ref.items():
        assert back[k].shape == v.shape, k
        np.testing.assert_allclose(back[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
