"""Speculative decoding is lossless: greedy output equals plain greedy, rollback equals plain decode state."""

import numpy as np
import pytest

from services.engine.convert import convert_hf_to_gguf
from services.engine.ddtree import build_ddtree, topk_logprobs
from services.engine.generate import GenerationResult, generate, prefill
from services.engine.loader import load_target
from services.engine.sampling import SamplingParams
from services.engine.speculative import SpecConfig, speculative_stream, walk_tree
from tests.hf_models import make_hf_model
from tests.spec_helpers import TrackingProposer, perturbed_copy


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


BUDGETS = [None, 1, 2, 7, 15, 16, 22, 40, 64]


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def target_path(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, folder / "hf", seed=3, num_hidden_layers=4)
    convert_hf_to_gguf(str(folder / "hf"), str(folder / "t.gguf"), "f32")
    return str(folder / "t.gguf")


def spec_run(target, draft, prompt, n, budget, params=SamplingParams(), stop=(), block=16):
    res = GenerationResult()
    prop = TrackingProposer(draft, prompt, res, block_size=block)
    for _ in speculative_stream(target, prop, prompt, n, params, SpecConfig(budget=budget), stop, result=res):
        pass
    return res


@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_spec_equals_plain(target_path, budget):
    target = load_target(target_path, with_tokenizer=False).model
    draft = perturbed_copy(target_path, 0.05, seed=1)
    rng = np.random.default_rng(budget or 0)
    for plen in (1, 5, 17):
        prompt = rng.integers(0, 320, plen).tolist()
        plain = generate(target, prompt, 40).token_ids
        res = spec_run(target, draft, prompt, 40, budget)
        assert res.token_ids == plain
        assert res.spec["steps"] > 0
        # a stop id inside an accepted block, and max_tokens landing mid-block
        stop_tok = plain[len(plain) // 2]
        cut = plain[: plain.index(stop_tok) + 1]
        assert spec_run(target, draft, prompt, 40, budget, stop=[stop_tok]).token_ids == cut
        assert spec_run(target, draft, prompt, 13, budget).token_ids == plain[:13]


def test_perfect_drafter_is_fully_accepted(target_path):
    target = load_target(target_path, with_tokenizer=False).model
    prompt = [1, 2, 3, 4]
    res = spec_run(target, target, prompt, 46, None)    # the target drafting for itself
    assert res.token_ids == generate(target, prompt, 46).token_ids
    assert res.spec["mean_acceptance_length"] == pytest.approx(16.0, rel=0.01)
    assert res.spec["per_position"][-1] == res.spec["steps"]


def test_rollback_equals_plain_decode_state(target_path):
    target = load_target(target_path, with_tokenizer=False).model
    draft = perturbed_copy(target_path, 0.3, seed=2)
    prompt = list(range(5, 14))
    state = target.new_state(128)
    logits, _ = prefill(target, state, prompt)
    root = int(np.argmax(logits))
    from tests.spec_helpers import ModelProposer

    prop = ModelProposer(draft)
    prop.known = prompt + [root]
    top = prop.propose(None, root, state.n_past, 4)
    tree = build_ddtree(*top, budget=24)
    tokens, parents = tree.verify_batch(root)
    out = target.forward(state, tokens, parents, checkpoints=True)
    # commit a deep branch that is not the top-1 spine when there is one
    leaf = int(np.argmax(tree.depths * 100 - np.arange(len(tree))))
    path = [leaf + 1]
    while parents[path[0]] >= 0:
        path.insert(0, int(parents[path[0]]))
    state.commit(path)

    ref = target.new_state(128)
    prefill(target, ref, prompt + [int(tokens[i]) for i in path])
    assert state.n_past == ref.n_past
    # equal to float32 rounding (the tree pass and the chunked prefill round differently)
    for i in state.ssm:
        assert rel_err(state.ssm[i], ref.ssm[i]) < 1e-5
        assert rel_err(state.conv[i], ref.conv[i]) < 1e-5
    n = ref.n_past
    for i in state.kv_k:
        assert rel_err(state.kv_k[i][:n], ref.kv_k[i][:n]) < 1e-5
        assert rel_err(state.kv_v[i][:n], ref.kv_v[i][:n]) < 1e-5
    # and the walk over a verified tree only follows existing children
    p, bonus = walk_tree(tree, out.logits, SamplingParams(), np.random.default_rng(0))
    assert p[0] == 0 and all(parents[b] == a for a, b in zip(p, p[1:]))


def test_row_logits_are_computed_when_read(target_path):
    """logits="rows": row i is that row alone through the final norm and the LM head (for a one-token pass, bitwise
    what logits="last" gives); np.asarray and slices give every row in one product, as logits="all" does."""
    target = load_target(target_path, with_tokenizer=False).model
    state = target.new_state(64)
    prefill(target, state, [5, 6, 7])
    tokens, parents = [8, 9, 10, 11, 12], [-1, 0, 1, 0, 3]
    full = target.forward(state, tokens, parents, checkpoints=True, logits="all").logits
    state.pending = None
    out = target.forward(state, tokens, parents, checkpoints=True, logits="rows")
    rows = out.logits
    assert rows.shape == full.shape and rows.ndim == 2 and len(rows) == 5 and out.logit_rows.tolist() == [0, 1, 2, 3, 4]
    for i in (3, 0, -1):
        np.testing.assert_allclose(rows[i], full[i], rtol=1e-5, atol=1e-5)
    assert rows[1] is rows[1]                                    # computed once
    np.testing.assert_array_equal(np.asarray(rows), full)
    np.testing.assert_array_equal(rows[1:3], full[1:3])
    with pytest.raises(IndexError):
        rows[5]
    state.commit([0, 3, 4])                                      # the pass is committed as any other
    one = target.forward(state, [13], logits="last").logits
    state.pending = None
    np.testing.assert_array_equal(target.forward(state, [13], logits="rows").logits[0], one[0])
    with pytest.raises(ValueError, match="logits must be"):
        target.forward(state, [13], logits="some")


def test_topk_breaks_ties_by_lower_id_even_at_the_cut():
    x = np.zeros((3, 10))
    x[0, [7, 2, 5]] = 1.0          # three tied best, k = 2: ids 2 and 5, not whichever partition picks
    x[2, 9] = 2.0                  # one best, then nine tied: the lowest of them
    ids, logp = topk_logprobs(x, 2)
    assert ids.tolist() == [[2, 5], [0, 1], [9, 0]]
    np.testing.assert_allclose(np.exp(logp[1]), [0.1, 0.1])


def test_topk_matches_a_full_sort_per_row():
    """The vectorised path (no ties at the cut) and the per-row path (ties there) both give, per row, the first k
    of all ids sorted by (log-prob descending, id ascending), with the log-softmax at the temperature."""
    rng = np.random.default_rng(3)
    for trial in range(300):
        rows, n, k = int(rng.integers(1, 17)), int(rng.integers(1, 200)), int(rng.integers(1, 10))
        x = rng.standard_normal((rows, n)).astype(np.float32) * 3
        if trial % 3 == 1:
            x = rng.integers(-2, 2, (rows, n)).astype(np.float32)          # ties everywhere, at the cut too
        temp = [1.0, 0.6, 1.7][trial % 3]
        ids, logp = topk_logprobs(x, k, temp)
        z = x.astype(np.float64) / temp
        z -= z.max(axis=-1, keepdims=True)
        ref_lp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        kk = min(k, n)
        assert ids.shape == logp.shape == (rows, kk) and ids.dtype == np.int64
        for r in range(rows):
            order = sorted(range(n), key=lambda i: (-ref_lp[r, i], i))[:kk]
            assert ids[r].tolist() == order
            np.testing.assert_array_equal(logp[r], ref_lp[r, order])


def test_ddtree_shape():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((15, 50)) * 3
    ids, logp = topk_logprobs(logits, 8)
    for budget in (1, 5, 15, 22, 64):
        t = build_ddtree(ids, logp, budget)
        assert len(t) == min(budget, 15 * 8)
        assert np.all(t.parents < np.arange(len(t)))
        # the top-1 chain is seeded first
        n = min(budget, 15)
        assert t.tokens[:n].tolist() == ids[:n, 0].tolist()
        # best-first: every non-chain node's weight is no better than its parent's
        for i in range(len(t)):
            if t.parents[i] >= 0:
                assert t.logw[i] <= t.logw[t.parents[i]] + 1e-12
        # no duplicate children under one parent
        seen = set(zip(t.parents.tolist(), t.tokens.tolist()))
        assert len(seen) == len(t)


@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_spec_with_dflash_drafter_equals_plain(tiny_pair, budget):
    from services.engine.models.dflash import load_drafter
    from services.engine.speculative import LocalProposer, speculative_generate

    _, gguf, drafter_dir = tiny_pair
    target = load_target(gguf, with_tokenizer=False).model
    drafter = load_drafter(drafter_dir, target)
    rng = np.random.default_rng(100 + (budget or 0))
    for plen in (1, 9, 30):
        prompt = rng.integers(0, target.cfg.n_vocab, plen).tolist()
        plain = generate(target, prompt, 24).token_ids
        res = speculative_generate(target, LocalProposer(drafter), prompt, 24, spec=SpecConfig(budget=budget))
        assert res.token_ids == plain
        assert res.spec["steps"] >= 1 and res.spec["draft_tokens"] >= res.spec["steps"]


class _BeginProposer(TrackingProposer):
    """A two-half proposer (propose_begin) that logs when each half runs against the target's commits; it drafts in
    the first half, as a GPU drafter queues its pass, so a draft that saw an uncommitted state would differ."""

    def __init__(self, *a, log, fail_begin_at=None, fail_fetch_at=None, **kw):
        super().__init__(*a, **kw)
        self.log, self.begins = log, 0
        self.fail_begin_at, self.fail_fetch_at = fail_begin_at, fail_fetch_at

    def propose_begin(self, new_features, last_token, start, k):
        from services.engine.speculative import DrafterUnavailableError

        self.begins += 1
        n = self.begins
        self.log.append(("begin", start))
        if n == self.fail_begin_at:
            raise DrafterUnavailableError("begin failed (test)")
        top = self.propose(new_features, last_token, start, k)

        def fetch():
            self.log.append(("fetch", start))
            if n == self.fail_fetch_at:
                raise DrafterUnavailableError("fetch failed (test)")
            return top
        return fetch


def _logged_state(target, log):
    """target.new_state with each commit logged as ("commit", n_past after it)."""
    make = target.new_state

    def new_state(*a, **kw):
        st = make(*a, **kw)
        commit = st.commit

        def logged(path):
            commit(path)
            log.append(("commit", st.n_past))
        st.commit = logged
        return st
    return new_state


@pytest.mark.parametrize("fail", [None, "begin", "fetch"])
def test_the_next_draft_starts_before_the_commit(target_path, monkeypatch, fail):
    """begin_propose: the next block is requested before the step's commit (whose device work then overlaps the
    host's tree building) and waited for at the next step; output stays plain greedy's, and a drafter failing in
    either half falls back to plain decoding."""
    target = load_target(target_path, with_tokenizer=False).model
    draft = perturbed_copy(target_path, 0.05, seed=1)
    prompt = [3, 1, 4, 1, 5]
    plain = generate(target, prompt, 40).token_ids
    log: list = []
    monkeypatch.setattr(target, "new_state", _logged_state(target, log))
    res = GenerationResult()
    at = {"begin": {"fail_begin_at": 2}, "fetch": {"fail_fetch_at": 2}, None: {}}[fail]
    prop = _BeginProposer(draft, prompt, res, log=log, **at)
    for _ in speculative_stream(target, prop, prompt, 40, SamplingParams(), SpecConfig(budget=22), (), result=res):
        pass
    assert res.token_ids == plain
    begins = [i for i, e in enumerate(log) if e[0] == "begin"]
    assert begins, log
    for i in begins:
        # the commit that brings the state to the drafted start comes right after the begin
        assert log[i + 1] == ("commit", log[i][1]), log
    fetches = [e for e in log if e[0] == "fetch"]
    if fail is None:
        assert [e[1] for e in fetches] == [log[i][1] for i in begins][:len(fetches)]
        assert res.spec["fallback"] is False and res.spec["steps"] >= len(fetches) + 1
    else:
        assert res.spec["fallback"] is True and fail in res.spec["fallback_reason"]
        # the first block through propose(), the next two begun (the second failing in the half under test)
        assert len(begins) == 2 and prop.calls == 2 + (fail == "fetch")


class _FakeGpuDrafter:
    """What GpuProposer asks of a DFlashGpuDrafter, logging the order of a pass's halves and the session's return."""

    block_size, target_layer_ids = 16, [1]

    def __init__(self, log, fail_wait=False):
        self.log, self.fail_wait = log, fail_wait

    def acquire_session(self):
        self.log.append("acquire")
        return "session"

    def release_session(self, s):
        self.log.append(("release", s))

    def draft_topk_begin(self, session, feats, last, start, k):
        self.log.append(("queued", start))

        def fetch():
            self.log.append(("waited", start))
            if self.fail_wait:
                raise RuntimeError("device error (test)")
            return np.zeros((15, k), np.int64), np.zeros((15, k))
        return fetch


def test_gpu_proposer_waits_for_a_pass_in_flight_before_its_session_goes_back():
    """GpuProposer.close(): a draft begun and never asked for (a request cancelled between steps) is waited for before
    the session returns to the drafter's pool; one already asked for is not waited for again; the session goes back
    even when that wait fails."""
    from services.engine.models.dflash_gpu import GpuProposer

    log: list = []
    p = GpuProposer(_FakeGpuDrafter(log))
    ids, _ = p.propose(None, 5, 10, 8)
    assert ids.shape == (15, 8) and log == ["acquire", ("queued", 10), ("waited", 10)]
    p.propose_begin(None, 6, 13, 8)
    p.close()
    assert log[3:] == [("queued", 13), ("waited", 13), ("release", "session")]
    p.close()                                   # closed twice: returned once
    assert log.count(("release", "session")) == 1
    with pytest.raises(RuntimeError, match="closed proposer"):
        p.propose_begin(None, 6, 13, 8)

    log.clear()
    q = GpuProposer(_FakeGpuDrafter(log, fail_wait=True))
    q.propose_begin(None, 1, 2, 1)
    with pytest.raises(RuntimeError, match="device error"):
        q.close()
    assert log[-1] == ("release", "session")


def test_prefill_hands_each_chunks_features_on_or_collects_them_on_the_host(tiny_pair):
    """generate.prefill with on_captured: each committed chunk's captured rows with the context length after it,
    nothing collected; without it, the same rows gathered on the host."""
    _, gguf, drafter_dir = tiny_pair
    from services.engine.models.dflash import load_drafter

    target = load_target(gguf, with_tokenizer=False).model
    layers = load_drafter(drafter_dir, target).target_layer_ids
    ids = np.random.default_rng(5).integers(0, target.cfg.n_vocab, 300).tolist()
    handed = []
    logits, feats = prefill(target, target.new_state(320), ids, capture=layers, chunk=128,
                            on_captured=lambda rows, n_past: handed.append((np.array(rows), n_past)))
    assert feats is None and [n for _, n in handed] == [128, 256, 300]
    logits2, collected = prefill(target, target.new_state(320), ids, capture=layers, chunk=128)
    assert isinstance(collected, np.ndarray) and collected.shape == (300, len(layers), target.cfg.n_embd)
    np.testing.assert_array_equal(np.concatenate([r for r, _ in handed]), collected)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits2))


class _AppendingProposer:
    """A LocalProposer that logs its prompt appends and the rows each draft brings (and can fail an append)."""

    def __init__(self, drafter, with_append=True, fail_append=False):
        from services.engine.speculative import LocalProposer

        self.inner = LocalProposer(drafter)
        self.block_size, self.target_layer_ids = self.inner.block_size, self.inner.target_layer_ids
        self.appends, self.proposed, self.fail_append, self.closed = [], [], fail_append, False
        if with_append:
            self.append_features = self._append

    def _append(self, new_features, start):
        from services.engine.speculative import DrafterUnavailableError

        if self.fail_append:
            raise DrafterUnavailableError("append failed (test)")
        self.appends.append((len(new_features), start))
        self.inner.append_features(new_features, start)

    def propose(self, new_features, last_token, start, k):
        self.proposed.append(0 if new_features is None else len(new_features))
        return self.inner.propose(new_features, last_token, start, k)

    def close(self):
        self.closed = True
        self.inner.close()


@pytest.mark.parametrize("plen", [200, 300])
def test_a_prompts_features_reach_the_drafter_as_its_chunks_commit(tiny_pair, plen):
    """A proposer with append_features takes a prompt's features as its chunks commit, in appends of at least
    PROMPT_APPEND_ROWS (the NumPy target's prompt is one chunk here: appended whole from 256 tokens); rows short of
    an append go with the first draft. Lossless, and the drafts are the ones of a proposer without appends
    (tests/test_gpu_loop.py: the GPU target's 64-token chunks gathered on the device)."""
    from services.engine.models.dflash import load_drafter
    from services.engine.speculative import PROMPT_APPEND_ROWS, speculative_generate

    _, gguf, drafter_dir = tiny_pair
    target = load_target(gguf, with_tokenizer=False).model
    drafter = load_drafter(drafter_dir, target)
    prompt = np.random.default_rng(plen).integers(0, target.cfg.n_vocab, plen).tolist()
    plain = generate(target, prompt, 20).token_ids
    runs = {}
    for with_append in (True, False):
        prop = _AppendingProposer(drafter, with_append)
        res = speculative_generate(target, prop, prompt, 20, spec=SpecConfig(budget=7))
        assert res.token_ids == plain and res.spec["fallback"] is False
        runs[with_append] = (prop, res)
    prop, res = runs[True]
    assert prop.appends == ([(plen, plen)] if plen >= PROMPT_APPEND_ROWS else [])
    assert all(n >= PROMPT_APPEND_ROWS for n, _ in prop.appends)
    assert prop.proposed[0] == plen - sum(n for n, _ in prop.appends) and runs[False][0].proposed[0] == plen
    assert prop.proposed[1:] == runs[False][0].proposed[1:]
    assert res.spec["accepted"] == runs[False][1].spec["accepted"] and res.spec["steps"] == runs[False][1].spec["steps"]


def test_a_drafter_failing_during_the_prompt_leaves_plain_decoding(tiny_pair):
    from services.engine.models.dflash import load_drafter
    from services.engine.speculative import speculative_generate

    _, gguf, drafter_dir = tiny_pair
    target = load_target(gguf, with_tokenizer=False).model
    prompt = np.random.default_rng(9).integers(0, target.cfg.n_vocab, 400).tolist()
    prop = _AppendingProposer(load_drafter(drafter_dir, target), fail_append=True)
    res = speculative_generate(target, prop, prompt, 12, spec=SpecConfig(budget=7))
    assert res.token_ids == generate(target, prompt, 12).token_ids
    assert res.spec["fallback"] is True and "append failed" in res.spec["fallback_reason"]
    assert prop.proposed == [] and prop.closed
