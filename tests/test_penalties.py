"""Repetition penalties (llama.cpp's penalties sampler; OpenAI presence / frequency penalties).

The math against a loop written from the definitions, the window, validation, sampling a model file declares
(GGUF general.sampling.*, written by `specsplit set-sampling`, read as defaults by the CLI and the verifier),
and exactness under penalties: plain decoding equals a hand-written loop, speculative greedy equals plain
greedy token for token, and sampled speculative decoding follows the penalized target (chi-square).
"""

from __future__ import annotations

import json
import math
import shutil

import gguf
import numpy as np
import pytest

from kernels import loader as kernel_loader
from services.engine.errors import InvalidRequestError, ModelFormatError
from services.engine.generate import GenerationResult, generate
from services.engine.loader import load_target
from services.engine.sampling import (
    SamplingParams,
    apply_penalties,
    model_sampling_defaults,
    resolve_sampling,
    sample,
    target_distribution,
)
from services.engine.speculative import LocalProposer, SpecConfig, speculative_generate, speculative_stream
from tests.conftest import SMALL_VOCAB
from tests.test_cli import run_cli
from tests.test_spec_sampled import chi_square_pvalue

PENALIZED = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, repeat_last_n=8)


def reference_penalties(logits, history, rp, presence, frequency, last_n):
    """The definitions, one token at a time: llama.cpp's repeat penalty, then OpenAI's
    mu[j] - c[j] * frequency - (c[j] > 0) * presence, over the last `last_n` tokens."""
    out = [float(v) for v in logits]
    window = list(history) if last_n < 0 else list(history)[max(0, len(history) - last_n):] if last_n else []
    for tok in sorted(set(window)):
        c = window.count(tok)
        v = out[tok]
        v = v / rp if v > 0 else v * rp
        out[tok] = v - c * frequency - presence
    return np.array(out)


def test_penalties_match_the_definitions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=10).astype(np.float32)
    history = [1, 1, 3, 9, 9, 9, 4, 1]
    for rp, pres, freq, n in ((1.3, 0.2, 0.1, -1), (0.8, 0.0, 0.5, 3), (1.0, -0.5, 0.0, 5), (1.7, 1.0, 1.0, 100)):
        p = SamplingParams(repetition_penalty=rp, presence_penalty=pres, frequency_penalty=freq, repeat_last_n=n)
        np.testing.assert_allclose(apply_penalties(logits, history, p),
                                   reference_penalties(logits, history, rp, pres, freq, n), rtol=0, atol=1e-12)
    # tokens outside the window or never seen are untouched; an empty history changes nothing
    p = SamplingParams(repetition_penalty=2.0, repeat_last_n=2)
    out = apply_penalties(logits, history, p)
    changed = np.flatnonzero(out != logits.astype(np.float64))
    assert set(changed) == {4, 1}
    np.testing.assert_array_equal(apply_penalties(logits, [], PENALIZED), logits.astype(np.float64))


def test_penalized_flag_and_window_off():
    assert not SamplingParams().penalized
    assert not SamplingParams(repetition_penalty=1.5, repeat_last_n=0).penalized    # window 0: off
    assert SamplingParams(presence_penalty=0.1).penalized
    assert SamplingParams(frequency_penalty=-0.1).penalized


@pytest.mark.parametrize("kwargs,param", [
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"repeat_last_n": 1.5}, "repeat_last_n"),
])
def test_validate_rejects_penalties(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs).validate()
    assert e.value.param == param


def test_samplers_need_the_history():
    logits = np.arange(5, dtype=np.float32)
    with pytest.raises(ValueError, match="history"):
        sample(logits, PENALIZED, np.random.default_rng(0))
    with pytest.raises(ValueError, match="history"):
        target_distribution(logits, PENALIZED)
    # greedy with a penalty on the argmax picks the runner-up
    assert sample(logits, SamplingParams(repetition_penalty=1.5), np.random.default_rng(0), history=[4]) == 3


def test_resolve_sampling_order():
    declared = {"repetition_penalty": 1.1, "repeat_last_n": 64, "temperature": 0.7}
    p = resolve_sampling({}, declared)
    assert (p.repetition_penalty, p.repeat_last_n, p.temperature) == (1.1, 64, 0.7)
    p = resolve_sampling({"repetition_penalty": 1.0, "temperature": 0.0, "top_k": None}, declared)
    assert (p.repetition_penalty, p.temperature, p.top_k) == (1.0, 0.0, 0)      # the request wins
    with pytest.raises(InvalidRequestError):
        resolve_sampling({"nucleus": 0.9})
    with pytest.raises(InvalidRequestError):
        resolve_sampling({}, {"repetition_penalty": -1.0})                        # a bad file is no exception


# ------------------------------------------------------------------------ a tiny target and drafter

V = SMALL_VOCAB


def manual_greedy(target, prompt, n, rp, pres, freq, last_n):
    st = target.new_state(len(prompt) + n + 1)
    out = target.forward(st, prompt, logits="last")
    st.commit(range(len(prompt)))
    seq, toks = list(prompt), []
    for _ in range(n):
        row = reference_penalties(out.logits[-1], seq, rp, pres, freq, last_n)
        t = int(np.argmax(row))
        toks.append(t)
        seq.append(t)
        out = target.forward(st, [t], logits="last")
        st.commit([0])
    return toks


def test_plain_decoding_with_penalties_matches_a_hand_loop(small_vocab_pair):
    target, _ = small_vocab_pair
    prompt = [3, 7, 1, 3]
    got = generate(target, prompt, 20, PENALIZED).token_ids
    assert got == manual_greedy(target, prompt, 20, 1.3, 0.4, 0.2, 8)
    assert got != generate(target, prompt, 20).token_ids, "the penalties must change this output"


@pytest.mark.parametrize("spec", [SpecConfig(budget=None), SpecConfig(budget=6), SpecConfig(budget=2)])
def test_speculative_greedy_with_penalties_equals_plain(small_vocab_pair, spec):
    target, drafter = small_vocab_pair
    for prompt in ([3, 7, 1, 3], [5, 5, 5, 2, 9]):
        for params in (PENALIZED, SamplingParams(repetition_penalty=1.5, repeat_last_n=-1)):
            plain = generate(target, prompt, 24, params)
            out = speculative_generate(target, LocalProposer(drafter), prompt, 24, params, spec)
            assert out.token_ids == plain.token_ids
            assert out.spec["steps"] >= 1


def test_sampled_speculative_with_penalties_follows_the_penalized_target(small_vocab_pair):
    target, drafter = small_vocab_pair
    prompt = [3, 7, 3]
    params = SamplingParams(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.3,
                            repeat_last_n=4)

    def dist(prefix):
        st = target.new_state(16)
        out = target.forward(st, prompt + list(prefix), logits="last")
        return target_distribution(out.logits[-1], params, history=prompt + list(prefix))

    expected = {}
    p1 = dist(())
    for a in range(V):
        p2 = dist((a,))
        for b in range(V):
            p3 = dist((a, b))
            for c in range(V):
                expected[(a, b, c)] = p1[a] * p2[b] * p3[c]
    n, observed, accepted = 4000, {}, 0
    for i in range(n):
        p = SamplingParams(**{**params.__dict__, "seed": 7000 + i})
        res = GenerationResult()
        for _ in speculative_stream(target, LocalProposer(drafter), prompt, 3, p, SpecConfig(budget=3), result=res):
            pass
        observed[tuple(res.token_ids)] = observed.get(tuple(res.token_ids), 0) + 1
        accepted += res.spec["accepted"]
    assert accepted > n * 0.1, "the test must exercise accepted drafts"
    assert chi_square_pvalue(observed, expected, n) > 1e-3
    # and the penalties moved the distribution: the unpenalized one fails the same test
    plain = SamplingParams(temperature=1.0)
    unpen = {k: 0.0 for k in expected}
    q1 = target_distribution(target.forward(target.new_state(16), prompt, logits="last").logits[-1], plain)
    for a in range(V):
        st = target.new_state(16)
        q2 = target_distribution(target.forward(st, prompt + [a], logits="last").logits[-1], plain)
        for b in range(V):
            st = target.new_state(16)
            q3 = target_distribution(target.forward(st, prompt + [a, b], logits="last").logits[-1], plain)
            for c in range(V):
                unpen[(a, b, c)] = q1[a] * q2[b] * q3[c]
    assert chi_square_pvalue(observed, unpen, n) < 1e-3


# ------------------------------------------------------------------- sampling a model file declares


def test_set_sampling_declares_defaults_the_cli_uses(tiny_pair, tmp_path):
    _, src, _ = tiny_pair
    model = tmp_path / "declared.gguf"
    shutil.copyfile(src, model)
    out = json.loads(run_cli("set-sampling", str(model), "repetition_penalty=1.8", "repeat_last_n=16").stdout)
    assert out["declared"] == {"repetition_penalty": 1.8, "repeat_last_n": 16}
    # every tensor byte and every other key is as it was
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(str(model))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert x.tensor_type == y.tensor_type and np.array_equal(x.data, y.data)
    for k, f in a.fields.items():
        if not k.startswith("GGUF."):
            assert b.fields[k].types == f.types and b.fields[k].contents() == f.contents(), k
    lt = load_target(str(model))
    assert model_sampling_defaults(lt.file.metadata) == lt.sampling_defaults == out["declared"]

    def gen(path, *extra):
        return json.loads(run_cli("generate", "--model", path, "--prompt", "def add(a, b):", "--max-tokens", "16",
                                  "--ignore-eos", "--json", "--no-draft", *extra).stdout)

    declared, explicit = gen(str(model)), gen(src, "--repeat-penalty", "1.8", "--repeat-last-n", "16")
    assert declared["token_ids"] == explicit["token_ids"]
    assert declared["token_ids"] == generate(lt.model, declared["prompt_ids"], 16,
                                             SamplingParams(repetition_penalty=1.8, repeat_last_n=16)).token_ids
    assert gen(str(model), "--repeat-penalty", "1")["token_ids"] == gen(src)["token_ids"]   # the option wins
    assert declared["token_ids"] != gen(src)["token_ids"], "the declared penalty must change this output"
    # errors name the field; the file is left as it was
    before = model.read_bytes()
    for bad in (["temperature=-1"], ["nucleus=0.9"], ["top_k=x"]):
        p = run_cli("set-sampling", str(model), *bad, check=False)
        assert p.returncode != 0 and ("temperature" in p.stderr or "nucleus" in p.stderr or "top_k" in p.stderr)
    assert model.read_bytes() == before
    run_cli("set-sampling", str(model), "--clear", "repetition_penalty")
    assert load_target(str(model)).sampling_defaults == {"repeat_last_n": 16}


# ------------------------------------------------------------------------------------------- GPU

_GPU_REASON = kernel_loader.unavailable_reason()


@pytest.mark.skipif(_GPU_REASON is not None, reason=f"GPU test skipped: {_GPU_REASON}")
def test_gpu_speculative_under_declared_penalties_equals_plain():
    """On the GPU the device argmax no longer decides a penalized step: rows are fetched per visited node.
    Speculative (GPU drafter, chain and DDTree) equals plain decoding under the embedded model's declared
    sampling, and plain GPU equals plain NumPy on this prompt."""
    from services.engine.default_model import default_model_paths
    from services.engine.placement import load_drafter_on, load_target_on

    tpath, dpath = default_model_paths()
    gpu = load_target_on(tpath, "cuda:0")
    cpu = load_target(tpath)
    params = resolve_sampling({}, gpu.sampling_defaults)
    assert params.penalized
    ids = cpu.tokenizer.encode("def fibonacci(n):\n")
    plain = generate(gpu.model, ids, 48, params).token_ids
    assert plain == generate(cpu.model, ids, 48, params).token_ids
    assert plain != generate(gpu.model, ids, 48).token_ids
    placed = load_drafter_on(dpath, gpu.model, "cuda:0")
    for spec in (SpecConfig(budget=None), SpecConfig(budget=22)):
        out = speculative_generate(gpu.model, placed.new_proposer(), ids, 48, params, spec)
        assert out.token_ids == plain and out.spec["accepted"] > 0


def test_hf_generation_config_declares_defaults(tiny_pair, tmp_path):
    """A Hugging Face folder's generation_config.json declares sampling as vLLM reads it; HF's repetition
    penalty covers the whole sequence; with do_sample false only the penalty is kept; a corrupt file is one
    clear error."""
    hf, _, _ = tiny_pair
    folder = tmp_path / "hf"
    shutil.copytree(hf, folder)
    gen = folder / "generation_config.json"
    gen.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                               "repetition_penalty": 1.05, "eos_token_id": [1, 2]}))
    assert load_target(str(folder)).sampling_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                                          "repetition_penalty": 1.05, "repeat_last_n": -1}
    gen.write_text(json.dumps({"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.2}))
    lt = load_target(str(folder))
    assert lt.sampling_defaults == {"repetition_penalty": 1.2, "repeat_last_n": -1}
    out = json.loads(run_cli("generate", "--model", str(folder), "--prompt", "def add(a, b):", "--max-tokens",
                             "12", "--ignore-eos", "--json").stdout)
    want = generate(lt.model, out["prompt_ids"], 12, SamplingParams(repetition_penalty=1.2, repeat_last_n=-1))
    assert out["token_ids"] == want.token_ids
    gen.write_text("{not json")
    with pytest.raises(ModelFormatError, match="generation_config.json"):
        _ = load_target(str(folder)).sampling_defaults
    p = run_cli("generate", "--model", str(folder), "--prompt", "x", "--max-tokens", "2", check=False)
    assert p.returncode != 0 and "generation_config.json" in p.stderr and "Traceback" not in p.stderr
