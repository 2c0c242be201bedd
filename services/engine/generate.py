"""Plain autoregressive generation: prefill in chunks, then one token per target pass."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ContextOverflowError, InvalidRequestError
from .logprobs import TokenLogprob, check_top_logprobs, row_logprobs
from .models.base import TargetModel
from .sampling import SamplingParams, make_rng, sample_row
from .state import SequenceState

PREFILL_CHUNK = 512
# a prompt whose tokens' log-probabilities are asked for (OpenAI `echo`) runs in chunks of at most this many tokens:
# each chunk's every logits row exists at once (64 x 248320 f32 = 64 MB for a Qwen3.6 vocabulary); on a GPU a chunk
# is a graph step of the prompt's (the planned width) either way
PROMPT_LOGPROBS_CHUNK = 64


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"          # "stop" (EOS / stop id) or "length"
    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    spec: dict | None = None               # filled by speculative decoding
    # one per token_ids entry when the request asked for log-probabilities (top_logprobs set), else None
    logprobs: list[TokenLogprob] | None = None
    # the prompt's tokens after the first (which has no context), when asked (prompt_logprobs set), else None
    prompt_logprobs: list[TokenLogprob] | None = None

    def timings(self) -> dict:
        n = len(self.token_ids)
        return {
            "prompt_n": self.prompt_tokens,
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_second": round(self.prompt_tokens / (self.prompt_ms / 1e3), 3) if self.prompt_ms else 0.0,
            "predicted_n": n,
            "predicted_ms": round(self.decode_ms, 3),
            "predicted_per_second": round(n / (self.decode_ms / 1e3), 3) if self.decode_ms else 0.0,
        }


def check_request(model: TargetModel, prompt_ids: Sequence[int], max_tokens: int, max_ctx: int,
                  scoring: bool = False, params: SamplingParams | None = None) -> None:
    """Raise for a request the engine cannot run. scoring: the prompt's log-probabilities are asked for, so
    max_tokens 0 (score the prompt, generate nothing) is a request too. params: their logit bias must name tokens
    of the model's vocabulary."""
    if len(prompt_ids) == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if max_tokens < (0 if scoring else 1):
        raise InvalidRequestError(f"max_tokens must be at least {0 if scoring else 1}", param="max_tokens")
    bad = [t for t in prompt_ids if not 0 <= int(t) < model.cfg.n_vocab]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]} outside the vocabulary (0..{model.cfg.n_vocab - 1})",
                                  param="prompt")
    bad = [i for i, _ in params.logit_bias if i >= model.cfg.n_vocab] if params is not None else []
    if bad:
        raise InvalidRequestError(f"logit_bias token id {bad[0]} outside the vocabulary (0..{model.cfg.n_vocab - 1})",
                                  param="logit_bias")
    if len(prompt_ids) >= max_ctx:
        raise ContextOverflowError(len(prompt_ids) + 1, max_ctx)


def prefill(model: TargetModel, state: SequenceState, prompt_ids: Sequence[int],
            capture: Sequence[int] = (), chunk: int = PREFILL_CHUNK,
            on_captured: Callable[[Any, int], None] | None = None,
            prompt_logprobs: int | None = None, logprobs_out: list[TokenLogprob] | None = None):
    """Commit the prompt in chunks (of the model's own length for this state where it has one: a GPU model's
    graph steps); returns the last position's logits and the captured layer outputs (on the host).

    on_captured(rows, n_past): each chunk's captured rows as the model returns them (a GPU model's on the device),
    handed on once the chunk is committed instead of collected (the returned features are then None), so that a
    drafter beside the target takes them where they are. Collected ones go to the host chunk by chunk: a GPU
    model's rows left on the device would pile up a whole prompt's features there, past what the memory plan
    counts.

    prompt_logprobs set (0..20): each chunk's every row is computed, and the log-probabilities of the prompt's tokens
    after the first (each from the row before it) are appended to `logprobs_out`."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    if prompt_logprobs is not None:
        chunk = min(chunk, PROMPT_LOGPROBS_CHUNK)
    if hasattr(model, "prompt_chunk"):
        chunk = model.prompt_chunk(state, chunk)
    feats = []
    logits = None
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        last = s + chunk >= len(ids)
        if prompt_logprobs is not None:
            # one token: its one row is the last (a decode step's shape, whose graph a GPU state has)
            res = model.forward(state, part, capture=capture, logits="rows" if len(part) > 1 else "last")
            nxt = ids[s + 1:s + len(part) + 1]      # the token each row predicts (the last row's: generated)
            rows = res.logits if hasattr(res.logits, "logprobs") else np.asarray(res.logits)
            logprobs_out.extend(row_logprobs(rows, range(len(nxt)), nxt.tolist(), prompt_logprobs))
        else:
            res = model.forward(state, part, capture=capture, logits="last" if last else "none")
        state.commit(range(len(part)))
        if res.captured is not None:
            if on_captured is not None:
                on_captured(res.captured, state.n_past)
            else:
                feats.append(np.asarray(res.captured, dtype=np.float32))
        if last:
            logits = res.logits[-1]
    return logits, (np.concatenate(feats, axis=0) if feats else None)


def generate_stream(model: TargetModel, prompt_ids: Sequence[int], max_tokens: int,
                    params: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
                    max_ctx: int | None = None, result: GenerationResult | None = None,
                    top_logprobs: int | None = None, prompt_logprobs: int | None = None) -> Iterator[list[int]]:
    """Yield generated token ids as they are decided; `result` (if given) holds the totals at the end.

    A stop id ends generation and is included as the last token (callers strip it from text). top_logprobs set
    (0..20): result.logprobs gets each token's log-probability and that many alternatives (logprobs.py);
    prompt_logprobs set: result.prompt_logprobs the prompt's (OpenAI `echo`), and max_tokens may be 0.
    """
    params.validate()
    top_logprobs = check_top_logprobs(top_logprobs)
    prompt_logprobs = check_top_logprobs(prompt_logprobs, "prompt_logprobs")
    max_ctx = max_ctx or model.cfg.context_length
    check_request(model, prompt_ids, max_tokens, max_ctx, scoring=prompt_logprobs is not None, params=params)
    res = result if result is not None else GenerationResult()
    res.prompt_tokens = len(prompt_ids)
    res.logprobs = [] if top_logprobs is not None else None
    res.prompt_logprobs = [] if prompt_logprobs is not None else None
    stop = set(int(s) for s in stop_ids)
    rng = make_rng(params.seed)
    need = min(max_ctx, len(prompt_ids) + max_tokens)
    # a GPU target hands out pooled states (their captured graphs outlive the request); released at the end
    acquire = getattr(model, "acquire_state", None)
    state = acquire(need, max_ctx) if acquire is not None else model.new_state(need)
    try:
        yield from _plain_loop(model, state, prompt_ids, max_tokens, params, stop, rng, res, top_logprobs,
                               prompt_logprobs)
    finally:
        release = getattr(model, "release_state", None)
        if release is not None:
            release(state)


def _plain_loop(model: TargetModel, state, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams,
                stop: set[int], rng, res: GenerationResult, top_logprobs: int | None = None,
                prompt_logprobs: int | None = None) -> Iterator[list[int]]:
    """generate_stream's loop over a state it was handed."""
    t0 = time.perf_counter()
    logits, _ = prefill(model, state, prompt_ids, prompt_logprobs=prompt_logprobs, logprobs_out=res.prompt_logprobs)
    res.prompt_ms = (time.perf_counter() - t0) * 1e3
    if max_tokens == 0:         # the prompt scored, nothing generated
        res.finish_reason = "length"
        return
    t1 = time.perf_counter()
    history = list(prompt_ids) if params.penalized else None    # what repetition penalties look back on
    tok = sample_row(logits, -1, params, rng, history)
    lps = None if top_logprobs is None else row_logprobs(logits, [-1], [tok], top_logprobs)
    logits = None
    rest = plain_tokens(model, state, tok, max_tokens - 1, params, rng, history, top_logprobs, lps)
    try:
        while True:
            res.token_ids.append(tok)
            if lps is not None:
                res.logprobs.append(lps.pop(0))
            if history is not None:
                history.append(tok)
            yield [tok]
            if tok in stop:
                res.finish_reason = "stop"
                break
            tok = next(rest, None)
            if tok is None:     # max_tokens, or the context is full
                res.finish_reason = "length"
                break
    finally:
        rest.close()
    res.decode_ms = (time.perf_counter() - t1) * 1e3


def plain_tokens(model: TargetModel, state, token: int, limit: int, params: SamplingParams, rng,
                 history: list[int] | None = None, top_logprobs: int | None = None,
                 logprobs_out: list[TokenLogprob] | None = None) -> Iterator[int]:
    """Plain decoding after `token` (decided, not yet fed): up to `limit` more tokens, fewer when the context is
    full; one target pass and commit each. `history` (penalized params) must hold every token up to the one last
    yielded. Greedy decoding on a GPU target that can (can_decode_ahead) runs a step ahead of the host there
    (decode_ahead: the same tokens and states; closed early, the step after the last token read has run too). Close
    the generator when stopping early. top_logprobs set: each token's TokenLogprob is appended to `logprobs_out`
    before the token is yielded (those steps read their logits row, so they do not run ahead)."""
    if limit < 1:
        return
    if (top_logprobs is None and params.greedy and not params.shifted
            and getattr(model, "can_decode_ahead", lambda _: False)(state)):
        yield from model.decode_ahead(state, token, limit)
        return
    for _ in range(limit):
        if state.n_past + 1 > state.max_ctx:
            return
        out = model.forward(state, [token], logits="last")
        state.commit([0])
        token = sample_row(out.logits, -1, params, rng, history)   # on a GPU model the row stays there when greedy
        if top_logprobs is not None:
            logprobs_out.extend(row_logprobs(out.logits, [-1], [token], top_logprobs))
        out = None     # a GPU result still held when its graph replays next is copied first
        yield token


def generate(model: TargetModel, prompt_ids: Sequence[int], max_tokens: int,
             params: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
             max_ctx: int | None = None, top_logprobs: int | None = None,
             prompt_logprobs: int | None = None) -> GenerationResult:
    res = GenerationResult()
    for _ in generate_stream(model, prompt_ids, max_tokens, params, stop_ids, max_ctx, res, top_logprobs,
                             prompt_logprobs):
        pass
    return res
