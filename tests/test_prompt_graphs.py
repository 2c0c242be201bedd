"""Prompt chunks as graph steps (qwen35_gpu.PROMPT_GRAPHS), on the CPU: generate.prefill cuts a prompt at the model's
own chunk length, and the GPU model's forward() runs a prompt chunk as the step it can replay: a whole chunk as a
chain of the state's widest width, a shorter one padded to the next width of the ladder as a checkpointed chain whose
rows past the prompt are dropped from the result and whose commit takes the prompt's tokens only. The steps
themselves are stubbed here (nothing launches); tests/test_gpu_backend.py runs them on a GPU against the NumPy
engine."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kernels import loader
from services.engine import synthetic as S
from services.engine.models import qwen35_gpu as QG
from tests.fake_cupy import fake_cupy


@pytest.fixture
def fake(monkeypatch):
    """A Qwen35GpuModel stand-in whose step (_enqueue) records its arguments and answers rows that say their index:
    logits row i all i, argmax i, captured row i all i."""
    cp = fake_cupy()
    monkeypatch.setattr(loader, "require", lambda: cp)
    cfg = S.get_shape("tiny").target
    calls = []

    def enqueue(state, tokens, parents, capture, checkpoints, logits, ahead=0):
        toks, par, is_chain = QG.check_step(tokens, parents, cfg.n_vocab)
        T = len(toks)
        calls.append({"tokens": toks.tolist(), "checkpoints": checkpoints, "logits": logits, "capture": capture})
        state.pending = QG.GpuPending(n_tokens=T, parents=par, per_token=checkpoints or not is_chain,
                                      is_chain=is_chain)
        rows = {"all": T, "last": 1, "none": 0}[logits]
        first = T - rows
        lg = np.repeat(np.arange(first, T, dtype=np.float32)[:, None], 8, axis=1) if rows else None
        amax = np.arange(first, T, dtype=np.int32) if rows else None
        cap = np.repeat(np.arange(T, dtype=np.float32)[:, None, None], 4, axis=2) if capture else None
        return lg, amax, cap, True

    model = types.SimpleNamespace(be=types.SimpleNamespace(xp=cp), cfg=cfg, use_graphs=True, graph_blocker=None,
                                  _enqueue=enqueue)
    for name in ("_prompt_pad", "_prompt_top", "prompt_chunk"):
        setattr(model, name, (lambda f: lambda *a: f(model, *a))(getattr(QG.Qwen35GpuModel, name)))
    model._prompt_widths = QG.Qwen35GpuModel._prompt_widths
    model.forward = lambda *a, **kw: QG.Qwen35GpuModel.forward(model, *a, **kw)
    return types.SimpleNamespace(model=model, calls=calls, cfg=cfg)


def _state(cfg, max_tree: int = 65, max_ctx: int = 256):
    return QG.GpuSequenceState(cfg, max_ctx, "f16", "f16", max_tree=max_tree)


@pytest.mark.parametrize("n, logits, width", [(5, "last", 8), (8, "last", 8), (9, "last", 16), (17, "last", 32),
                                              (33, "none", 64), (64, "last", 64), (2, "none", 8)])
def test_a_short_chunk_is_padded_to_the_next_ladder_width(fake, n, logits, width):
    st = _state(fake.cfg)
    toks = list(range(3, 3 + n))
    res = fake.model.forward(st, toks, capture=[0, 1], logits=logits)
    call = fake.calls[-1]
    assert call["tokens"] == toks + [toks[-1]] * (width - n)          # padded with the last token
    assert call["checkpoints"] is True                                  # so that the prompt's prefix is committable
    assert call["logits"] == ("none" if logits == "none" else "all")   # the prompt's last row is not the step's
    assert st.pending.n_tokens == width and st.pending.n_real == n
    want = {"last": [n - 1], "none": []}[logits]
    assert res.logit_rows.tolist() == want
    if want:
        assert res.logits.argmax_rows().tolist() == want
        assert np.asarray(res.logits)[:, 0].tolist() == want
    else:
        assert res.logits is None
    assert np.asarray(res.captured)[:, 0, 0].tolist() == list(range(n))   # the prompt's rows only


def test_the_padded_chunk_commits_whole_only(fake):
    st = _state(fake.cfg)
    fake.model.forward(st, [1, 2, 3, 4, 5], logits="last")
    for path in ([0, 1, 2], list(range(8)), [0, 1, 2, 3, 5]):
        with pytest.raises(ValueError):
            st.commit(path)
    assert st.pending is not None and st.n_past == 0


def test_a_whole_chunk_runs_as_it_is(fake):
    """A whole chunk (the state's widest width, no logits) is a graph step of its own: no padding, no checkpoints;
    with logits it is padded to its own width (a checkpointed chain's graph, like the last chunk)."""
    st = _state(fake.cfg, max_tree=23)
    assert fake.model.prompt_chunk(st, 512) == 23
    fake.model.forward(st, list(range(23)), logits="none")
    assert fake.calls[-1]["tokens"] == list(range(23)) and fake.calls[-1]["checkpoints"] is False
    fake.model.forward(st, list(range(23)), logits="last")
    assert fake.calls[-1]["checkpoints"] is True and len(fake.calls[-1]["tokens"]) == 23
    fake.model.forward(st, list(range(20)), logits="last")            # ladder 8, 16 below 23, then 23
    assert len(fake.calls[-1]["tokens"]) == 23


@pytest.mark.parametrize("case", ["graphs off", "blocked", "narrow state", "one token", "tree", "checkpoints",
                                  "every row's logits", "longer than the width", "no room"])
def test_chunks_that_keep_their_own_shape(fake, case):
    """Eager (or a step of its own): graphs off or blocked, a state narrower than PROMPT_MIN_WIDTH (its prompt chunk
    is generate's default), a one-token step, a tree, a checkpointed chain, a chain with every row's logits (not a
    prompt's), a chunk wider than the state's steps, and a chunk whose padding would not fit the context."""
    m = fake.model
    st = _state(fake.cfg, max_tree=8 if case == "narrow state" else 65, max_ctx=70)
    m.use_graphs = case != "graphs off"
    m.graph_blocker = "capture failed" if case == "blocked" else None
    n = {"one token": 1, "longer than the width": 65}.get(case, 5)
    if case == "no room":
        st.n_past = 66                                   # 4 rows left: 5 tokens padded to 8 would not fit
        n = 3
    toks = list(range(1, n + 1))
    parents = [-1, 0, 0, 1, 1] if case == "tree" else None
    m.forward(st, toks, parents, checkpoints=case == "checkpoints", logits="all" if case == "every row's logits"
              else "last")
    assert fake.calls[-1]["tokens"] == toks and st.pending.n_real == 0
    if case in ("graphs off", "blocked", "narrow state"):
        assert m.prompt_chunk(st, 512) == 512


def test_the_room_left_picks_a_narrower_width(fake):
    st = _state(fake.cfg, max_ctx=100)
    st.n_past = 80                                       # 20 rows left: 9 tokens padded to 16, not 32
    fake.model.forward(st, list(range(1, 10)), logits="last")
    assert len(fake.calls[-1]["tokens"]) == 16
    st.pending, st.n_past = None, 90
    fake.model.forward(st, list(range(1, 10)), logits="last")   # 10 rows left: 16 does not fit, nor 9 -> as it is
    assert len(fake.calls[-1]["tokens"]) == 9 and st.pending.n_real == 0


def test_prefill_cuts_the_prompt_at_the_models_chunk():
    """generate.prefill asks the model for its chunk length on the state; the chunks' results equal one pass's."""
    from services.engine.generate import prefill
    from tests.dflash_models import make_tiny_target

    model = make_tiny_target()
    ids = list(np.random.default_rng(4).integers(0, model.cfg.n_vocab, 11))
    whole_logits, whole_feats = prefill(model, model.new_state(32), ids, capture=[0, 1])

    class Chunked:
        def __init__(self, inner):
            self.inner, self.seen, self.cfg = inner, [], inner.cfg

        def prompt_chunk(self, state, default):
            assert default == 512
            return 4

        def forward(self, state, part, **kw):
            self.seen.append(len(part))
            return self.inner.forward(state, part, **kw)

    chunked = Chunked(model)
    logits, feats = prefill(chunked, model.new_state(32), ids, capture=[0, 1])
    assert chunked.seen == [4, 4, 3]
    np.testing.assert_allclose(logits, whole_logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(feats, whole_feats, rtol=1e-4, atol=1e-4)
