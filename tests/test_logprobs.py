"""Generated tokens' log-probabilities: the NumPy reference against torch, and plain, speculative (chain, DDTree,
sampled, after a drafter fails) decoding against the target's own logits of the same sequence in one pass."""

import numpy as np
import pytest
import torch

from services.engine.errors import InvalidRequestError
from services.engine.generate import GenerationResult, generate, generate_stream
from services.engine.loader import load_target
from services.engine.logprobs import MAX_TOP_LOGPROBS, logprobs_of_row, row_logprobs
from services.engine.sampling import SamplingParams
from services.engine.speculative import SpecConfig, speculative_stream
from tests.hf_models import make_gguf_model
from tests.spec_helpers import TrackingProposer, perturbed_copy

TOL = 2e-4      # batched verify rows against one-token rows (f32 sums in another order), and f32 vs f64


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return make_gguf_model("qwen35", tmp_path_factory.mktemp("qwen35_lp"), seed=5, num_hidden_layers=4)


def reference(target, prompt, tokens, n):
    """Each generated token's log-softmax row from one teacher-forced pass over prompt + tokens, by torch."""
    state = target.new_state(len(prompt) + len(tokens) + 1)
    seq = list(prompt) + list(tokens[:-1])
    logits = np.asarray(target.forward(state, seq, logits="all").logits, dtype=np.float64)
    rows = torch.log_softmax(torch.from_numpy(logits[len(prompt) - 1:]), dim=-1).numpy()
    out = []
    for row, t in zip(rows, tokens):
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:n]
        out.append((float(row[t]), order, [float(row[i]) for i in order]))
    return out


def check_against(target, prompt, res, n):
    assert res.logprobs is not None and len(res.logprobs) == len(res.token_ids) > 0
    for lp, t, (want, ids, vals) in zip(res.logprobs, res.token_ids, reference(target, prompt, res.token_ids, n)):
        assert lp.token == t
        assert abs(lp.logprob - want) < TOL
        assert len(lp.top) == n
        got_ids = [i for i, _ in lp.top]
        # the same set of best tokens; where two are closer than the tolerance either order is right
        for (gi, gv), wi, wv in zip(lp.top, ids, vals):
            assert abs(gv - wv) < TOL
            assert gi == wi or abs(row_value(vals, ids, gi) - wv) < TOL
        assert all(lp.top[j][1] >= lp.top[j + 1][1] for j in range(n - 1))
        assert len(set(got_ids)) == n


def row_value(vals, ids, i):
    return vals[ids.index(i)] if i in ids else -np.inf


def test_row_reference_against_torch_with_ties_at_the_cut():
    rng = np.random.default_rng(0)
    for n_vocab in (7, 50, 1000):
        x = rng.normal(size=n_vocab).astype(np.float32) * 4
        x[rng.integers(0, n_vocab, 4)] = x.max()          # ties at the top
        x[3] = x[5] = np.sort(x)[-3]                        # and a tie at a cut
        want = torch.log_softmax(torch.from_numpy(x.astype(np.float64)), -1).numpy()
        for n in (0, 1, 3, min(MAX_TOP_LOGPROBS, n_vocab)):
            lp = logprobs_of_row(x, 2, n)
            assert abs(lp.logprob - want[2]) < 1e-12
            order = sorted(range(n_vocab), key=lambda i: (-x[i], i))[:n]
            assert [i for i, _ in lp.top] == order
            assert np.allclose([v for _, v in lp.top], want[order], atol=1e-12)
    # rows of an array, a 1-D row, and the row index -1
    xs = rng.normal(size=(3, 40))
    got = row_logprobs(xs, [2, 0, -1], [1, 2, 3], 2)
    assert [g.logprob for g in got] == [logprobs_of_row(xs[r], t, 2).logprob for r, t in ((2, 1), (0, 2), (2, 3))]
    assert row_logprobs(xs[1], [-1], [4], 0)[0] == logprobs_of_row(xs[1], 4, 0)


@pytest.mark.parametrize("n", [0, 3, MAX_TOP_LOGPROBS])
def test_plain_decoding_logprobs_are_the_targets(target_path, n):
    target = load_target(target_path, with_tokenizer=False).model
    prompt = [5, 17, 3, 99, 12]
    res = generate(target, prompt, 12, top_logprobs=n)
    assert res.token_ids == generate(target, prompt, 12).token_ids
    check_against(target, prompt, res, n)
    # greedy: the chosen token is the best one
    if n:
        assert all(lp.top[0][0] == lp.token for lp in res.logprobs)


@pytest.mark.parametrize("budget", [None, 3, 22])
def test_speculative_logprobs_equal_plain_ones(target_path, budget):
    target = load_target(target_path, with_tokenizer=False).model
    draft = perturbed_copy(target_path, 0.05, seed=2)
    prompt = [7, 1, 250, 31, 9, 44]
    plain = generate(target, prompt, 30, top_logprobs=4)
    res = GenerationResult()
    prop = TrackingProposer(draft, prompt, res)
    for _ in speculative_stream(target, prop, prompt, 30, SamplingParams(), SpecConfig(budget=budget), result=res,
                                top_logprobs=4):
        pass
    assert res.spec["steps"] > 0 and res.spec["accepted"] > 0     # accepted drafts: rows of verify batches
    assert res.token_ids == plain.token_ids
    for a, b in zip(res.logprobs, plain.logprobs):
        assert a.token == b.token and abs(a.logprob - b.logprob) < TOL
        assert [i for i, _ in a.top][:1] == [i for i, _ in b.top][:1]
        assert np.allclose([v for _, v in a.top], [v for _, v in b.top], atol=TOL)
    check_against(target, prompt, res, 4)


def test_sampled_and_penalized_logprobs_are_the_raw_distributions(target_path):
    """Temperature, penalties and top-p shape the draw, not the reported numbers (the model's own log-softmax)."""
    target = load_target(target_path, with_tokenizer=False).model
    draft = perturbed_copy(target_path, 0.05, seed=4)
    prompt = [3, 3, 8, 120]
    params = SamplingParams(temperature=1.7, top_p=0.9, seed=11, repetition_penalty=1.3, presence_penalty=0.5)
    res = GenerationResult()
    for _ in speculative_stream(target, TrackingProposer(draft, prompt, res), prompt, 24, params,
                                SpecConfig(budget=8), result=res, top_logprobs=2):
        pass
    check_against(target, prompt, res, 2)
    # and plain sampling the same way
    check_against(target, prompt, generate(target, prompt, 10, params, top_logprobs=2), 2)


@pytest.mark.parametrize("fail_after", [0, 2])
def test_logprobs_survive_the_drafter_failing(target_path, fail_after):
    target = load_target(target_path, with_tokenizer=False).model
    draft = perturbed_copy(target_path, 0.05, seed=6)
    prompt = [11, 12, 13]
    res = GenerationResult()
    prop = TrackingProposer(draft, prompt, res)
    prop.fail_after = fail_after
    for _ in speculative_stream(target, prop, prompt, 20, SamplingParams(), SpecConfig(budget=6), result=res,
                                top_logprobs=1):
        pass
    assert res.spec["fallback"]
    check_against(target, prompt, res, 1)


def test_logprobs_end_with_the_tokens_at_a_stop_id_or_max_tokens(target_path):
    target = load_target(target_path, with_tokenizer=False).model
    draft = perturbed_copy(target_path, 0.05, seed=8)
    prompt = [2, 4, 6, 8]
    plain = generate(target, prompt, 30).token_ids
    stop = plain[len(plain) // 2]
    for max_tokens, stop_ids in ((30, [stop]), (13, [])):
        res = GenerationResult()
        chunks = []
        for c in speculative_stream(target, TrackingProposer(draft, prompt, res), prompt, max_tokens,
                                    SamplingParams(), SpecConfig(budget=10), stop_ids, result=res, top_logprobs=0):
            chunks.append((len(c), len(res.logprobs), len(res.token_ids)))
        assert all(a == b for _, a, b in chunks)      # after every chunk: one entry per token
        assert [lp.token for lp in res.logprobs] == res.token_ids
        assert len(res.token_ids) == (plain.index(stop) + 1 if stop_ids else 13)


def test_no_logprobs_unless_asked_and_bad_counts_refused(target_path):
    target = load_target(target_path, with_tokenizer=False).model
    assert generate(target, [1, 2], 3).logprobs is None
    for bad in (-1, MAX_TOP_LOGPROBS + 1, 2.5, True):
        with pytest.raises(InvalidRequestError) as e:
            next(generate_stream(target, [1, 2], 3, top_logprobs=bad))
        assert e.value.param == "top_logprobs"
        with pytest.raises(InvalidRequestError):
            next(speculative_stream(target, None, [1, 2], 3, top_logprobs=bad))


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_prompt_logprobs_are_the_targets_over_several_chunks(tmp_path, arch):
    """The prompt's log-probabilities (OpenAI echo): token j's from row j - 1 of one teacher-forced pass, across the
    64-token chunks a scored prompt runs in; with max_tokens 0 nothing is generated."""
    target = load_target(make_gguf_model(arch, tmp_path, seed=7, num_hidden_layers=2), with_tokenizer=False).model
    prompt = np.random.default_rng(1).integers(0, 300, 150).tolist()
    state = target.new_state(len(prompt) + 1)
    full = np.asarray(target.forward(state, prompt, logits="all").logits, dtype=np.float64)
    want = torch.log_softmax(torch.from_numpy(full), dim=-1).numpy()
    for max_tokens in (0, 5):
        res = generate(target, prompt, max_tokens, prompt_logprobs=2)
        assert len(res.prompt_logprobs) == len(prompt) - 1 and len(res.token_ids) == max_tokens
        assert res.logprobs is None and (max_tokens or res.finish_reason == "length")
        for j, lp in enumerate(res.prompt_logprobs, start=1):
            assert lp.token == prompt[j] and abs(lp.logprob - want[j - 1, prompt[j]]) < TOL
            assert [i for i, _ in lp.top] == sorted(range(want.shape[1]), key=lambda i: (-want[j - 1, i], i))[:2]
    assert res.token_ids == generate(target, prompt, 5).token_ids


def test_speculative_prompt_logprobs_and_scoring_only(target_path):
    target = load_target(target_path, with_tokenizer=False).model
    draft = perturbed_copy(target_path, 0.05, seed=3)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    plain = generate(target, prompt, 6, prompt_logprobs=1, top_logprobs=1)
    for max_tokens in (0, 6):
        res = GenerationResult()
        chunks = list(speculative_stream(target, TrackingProposer(draft, prompt, res), prompt, max_tokens,
                                         SamplingParams(), SpecConfig(budget=4), result=res, prompt_logprobs=1,
                                         top_logprobs=1))
        assert [lp.token for lp in res.prompt_logprobs] == prompt[1:]
        assert np.allclose([lp.logprob for lp in res.prompt_logprobs],
                           [lp.logprob for lp in plain.prompt_logprobs], atol=1e-6)
        assert res.token_ids == plain.token_ids[:max_tokens] and len(res.logprobs) == max_tokens
        assert (chunks == []) == (max_tokens == 0)
    with pytest.raises(InvalidRequestError) as e:
        next(speculative_stream(target, None, prompt, 0))        # max_tokens 0 scores a prompt only when asked
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as e:
        next(generate_stream(target, prompt, 1, prompt_logprobs=21))
    assert e.value.param == "prompt_logprobs"
