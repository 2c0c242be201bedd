"""OpenAI logit_bias in the engine: added before the penalties, greedy and speculative decoding under it equal plain
decoding under it, and bad values are refused naming the field (the sampler kernels' twin tests are in
test_kernels_sampling_sim.py, the sampled distribution's in test_spec_sampled.py)."""

import numpy as np
import pytest

from services.engine.errors import InvalidRequestError
from services.engine.generate import GenerationResult, generate
from services.engine.loader import load_target
from services.engine.sampling import SamplingParams, apply_penalties, normalize_logit_bias, sample
from services.engine.speculative import SpecConfig, speculative_stream
from tests.hf_models import make_gguf_model
from tests.spec_helpers import TrackingProposer, perturbed_copy


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return make_gguf_model("qwen35", tmp_path_factory.mktemp("qwen35_lb"), seed=9, num_hidden_layers=3)


def test_bias_comes_before_the_penalties():
    x = np.array([2.0, -1.0, 0.5, 0.0], np.float32)
    p = SamplingParams(logit_bias=((0, 1.0), (1, 0.5), (3, -100.0)), repetition_penalty=2.0, repeat_last_n=-1)
    got = apply_penalties(x, [0, 1], p)
    # token 0: (2 + 1) / 2; token 1: (-1 + 0.5) * 2; token 3: biased only
    assert got.tolist() == [1.5, -1.0, 0.5, -100.0]
    assert apply_penalties(x, None, SamplingParams(logit_bias=((2, 3.0),))).tolist() == [2.0, -1.0, 3.5, 0.0]
    assert sample(x, SamplingParams(logit_bias=((1, 5.0),)), np.random.default_rng(0)) == 1


def test_greedy_and_speculative_decoding_under_a_bias(target_path):
    target = load_target(target_path, with_tokenizer=False).model
    draft = perturbed_copy(target_path, 0.05, seed=1)
    prompt = [4, 8, 15, 16, 23, 42]
    plain = generate(target, prompt, 16).token_ids
    favour = SamplingParams(logit_bias=((77, 100.0),))
    assert generate(target, prompt, 8, favour).token_ids == [77] * 8
    ban = SamplingParams(logit_bias=tuple((t, -100.0) for t in sorted(set(plain))))
    banned = generate(target, prompt, 16, ban).token_ids
    assert not set(banned) & set(plain)
    for params in (ban, SamplingParams(logit_bias=((plain[3], -7.5), (9, 2.0)))):
        want = generate(target, prompt, 16, params).token_ids
        for budget in (None, 8):
            res = GenerationResult()
            for _ in speculative_stream(target, TrackingProposer(draft, prompt, res), prompt, 16, params,
                                        SpecConfig(budget=budget), result=res):
                pass
            assert res.token_ids == want and res.spec["steps"] > 0


def test_a_bias_outside_the_vocabulary_is_refused(target_path):
    target = load_target(target_path, with_tokenizer=False).model
    for stream in (lambda p: generate(target, [1, 2], 2, p),
                   lambda p: next(speculative_stream(target, None, [1, 2], 2, p))):
        with pytest.raises(InvalidRequestError) as e:
            stream(SamplingParams(logit_bias=((target.cfg.n_vocab, 1.0),)))
        assert e.value.param == "logit_bias"


def test_bad_biases_are_refused():
    assert normalize_logit_bias({"10": 1, "3": -2.5, "4": 0}) == ((3, -2.5), (10, 1.0))
    for bad in ({"x": 1}, {"1.5": 1}, {"2": "a"}, {"2": True}):
        with pytest.raises(InvalidRequestError) as e:
            normalize_logit_bias(bad)
        assert e.value.param == "logit_bias"
    for pairs in (((1, 101.0),), ((-1, 1.0),), ((2, 1.0), (2, 3.0)), ((1, float("nan")),)):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(logit_bias=pairs).validate()
        assert e.value.param == "logit_bias"
