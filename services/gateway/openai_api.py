"""OpenAI request parsing and response shaping (pure functions; the aiohttp handlers live in http.py).

Field handling follows serving.md §1.2: `max_completion_tokens` wins over `max_tokens`; `top_k` and
`min_p` are read at the top level as vLLM and llama.cpp do; unknown fields are accepted and ignored;
values of the wrong type or out of range are a 400 naming the field (`param`).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.engine.errors import InvalidRequestError
from services.engine.logprobs import TokenLogprob, check_top_logprobs
from services.engine.sampling import SamplingParams, normalize_logit_bias

from .core import Outcome
from .errors import APIError, invalid

MAX_STOP = 4
MAX_N = 16          # choices a request may ask for (each a generation of its own on the verifiers)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------------- field readers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def opt_int(body: dict, name: str, minimum: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise invalid(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if minimum is not None and v < minimum:
        raise invalid(f"'{name}' must be >= {minimum}, got {v}", name)
    return v


def opt_number(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v) or not math.isfinite(v):
        raise invalid(f"'{name}' must be a finite number, got {v!r}", name)
    return float(v)


def text_parts(content: Any, where: str, param: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A content that must be text: a string, or an array of parts of `kinds` with a `text` (Anthropic's text
    blocks, the Responses API's input_text / output_text parts), joined; else a 400 blaming `param`."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in kinds or not isinstance(p.get("text"), str):
                raise invalid(f"{where}: content part {p!r:.80} is not supported (text only)", param)
            parts.append(p["text"])
        return "".join(parts)
    raise invalid(f"{where} must be a string or an array of text parts", param)


def opt_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def opt_object(body: dict, name: str) -> dict | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(f"'{name}' must be an object, got {type(v).__name__}", name)
    return v


def opt_model(body: dict) -> str | None:
    v = body.get("model")
    if v is None:
        return None
    if not isinstance(v, str):
        raise invalid(f"'model' must be a string, got {type(v).__name__}", "model")
    return v


# ---------------------------------------------------------------------------------- common parameters


@dataclass
class CommonParams:
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    timeout: float | None
    n: int = 1                          # choices: each its own generation (seed + i when a seed is given)
    ignore_eos: bool = False            # vLLM extension: generate through end-of-sequence tokens (benchmarks)
    sampling_set: frozenset[str] = frozenset()   # the sampling fields the request set (others: model defaults)


def parse_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list):
        if not all(isinstance(s, str) for s in value):
            raise invalid("'stop' must be a string or a list of strings", "stop")
        if len(value) > MAX_STOP:
            raise invalid(f"'stop' takes at most {MAX_STOP} sequences, got {len(value)}", "stop")
        return [s for s in value if s]
    raise invalid(f"'stop' must be a string or a list of strings, got {type(value).__name__}", "stop")


def parse_common(body: dict, echo: bool = False) -> CommonParams:
    """The fields chat and completions share. echo (completions' `echo`, read by the caller): max_tokens may be 0,
    the prompt scored and nothing generated."""
    n = opt_int(body, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise invalid(f"'n' must be in 1..{MAX_N}, got {n}", "n")
    mct = opt_int(body, "max_completion_tokens")
    mt = opt_int(body, "max_tokens")
    max_tokens = mct if mct is not None else mt
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        name = "max_completion_tokens" if mct is not None else "max_tokens"
        least = "0 (with echo)" if echo else "1"
        raise invalid(f"'{name}' must be at least {least}, got {max_tokens}", name)
    temperature = opt_number(body, "temperature")
    top_p = opt_number(body, "top_p")
    min_p = opt_number(body, "min_p")
    top_k = opt_int(body, "top_k")
    if top_k is not None and top_k < 0:
        if top_k != -1:                  # -1 is vLLM's "disabled"
            raise invalid(f"'top_k' must be >= 0 (or -1 for disabled), got {top_k}", "top_k")
        top_k = 0
    seed = opt_int(body, "seed")
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed,
             "presence_penalty": opt_number(body, "presence_penalty"),
             "frequency_penalty": opt_number(body, "frequency_penalty"),
             # vLLM's and llama.cpp's extensions (llama.cpp's own spelling of the first is repeat_penalty)
             "repetition_penalty": opt_number(body, "repetition_penalty"),
             "repeat_last_n": opt_int(body, "repeat_last_n")}
    if given["repetition_penalty"] is None:
        given["repetition_penalty"] = opt_number(body, "repeat_penalty")
    lb = body.get("logit_bias")
    if lb is not None and not isinstance(lb, dict):
        raise invalid(f"'logit_bias' must be an object of token id -> bias, got {type(lb).__name__}", "logit_bias")
    try:
        given["logit_bias"] = normalize_logit_bias(lb) or None
    except InvalidRequestError as e:
        raise invalid(str(e), e.param) from None
    given = {k: v for k, v in given.items() if v is not None}
    try:
        # validated against the engine's defaults here; the verifier fills unset fields from its model's
        # declared defaults (GGUF general.sampling.*) and validates again
        sampling = SamplingParams(**given).validate()
    except InvalidRequestError as e:
        raise invalid(str(e), e.param) from None
    stream = opt_bool(body, "stream")
    so = opt_object(body, "stream_options")
    include_usage = bool(so and so.get("include_usage"))
    if so is not None and "include_usage" in so and not isinstance(so["include_usage"], (bool, type(None))):
        raise invalid("'stream_options.include_usage' must be a boolean", "stream_options")
    timeout = opt_number(body, "timeout")
    if timeout is not None and timeout <= 0:
        raise invalid(f"'timeout' must be > 0 seconds, got {timeout}", "timeout")
    refuse_unhonoured(body)
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text",):
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
    return CommonParams(max_tokens=max_tokens, sampling=sampling, stop=parse_stop(body.get("stop")),
                        stream=stream, include_usage=include_usage, timeout=timeout, n=n or 1,
                        ignore_eos=opt_bool(body, "ignore_eos"), sampling_set=frozenset(given))


# Fields that change what a request means, which specsplit does not do: set to anything but their neutral value they
# are a 400, never ignored (unknown fields are ignored, as vLLM does, only because they cannot change the answer).
UNHONOURED = {
    "suffix": (lambda v: v in (None, ""), "a suffix (fill in the middle)"),
    "best_of": (lambda v: v in (None, 1), "best_of > 1"),
    "functions": (lambda v: v in (None, []), "legacy 'functions' (send 'tools')"),
    "function_call": (lambda v: v in (None, "none", "auto"), "legacy 'function_call' (send 'tool_choice')"),
    "min_tokens": (lambda v: v in (None, 0), "min_tokens (vLLM's)"),
    "guided_json": (lambda v: v is None, "guided decoding (vLLM's guided_*)"),
    "guided_regex": (lambda v: v is None, "guided decoding (vLLM's guided_*)"),
    "guided_choice": (lambda v: v is None, "guided decoding (vLLM's guided_*)"),
    "guided_grammar": (lambda v: v is None, "guided decoding (vLLM's guided_*)"),
    "grammar": (lambda v: v in (None, ""), "grammar-constrained decoding (llama.cpp's grammar)"),
    "json_schema": (lambda v: v is None, "schema-constrained decoding (llama.cpp's json_schema)"),
}


def refuse_unhonoured(body: dict) -> None:
    """A 400 for a field in UNHONOURED set to a value that would change the answer."""
    for name, (neutral, what) in UNHONOURED.items():
        if name in body and not neutral(body[name]):
            raise invalid(f"'{name}': {what} is not supported by this server", name)


def parse_chat_echo(body: dict) -> None:
    """Chat has no `echo` (a completions field); silently ignoring it would hand a harness wrong numbers."""
    if body.get("echo") not in (None, False):
        raise invalid("'echo' is a /v1/completions field (the prompt's text and log-probabilities)", "echo")


def parse_top_logprobs(n: int | None, param: str = "top_logprobs") -> int | None:
    """None or a count of alternatives 0..20 (logprobs.check_top_logprobs), else a 400 naming `param`."""
    try:
        return check_top_logprobs(n, param)
    except InvalidRequestError as e:
        raise invalid(str(e), e.param) from None


def parse_chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs` (bool) and `top_logprobs` (0..20, needs logprobs): None, or how many alternatives."""
    on = opt_bool(body, "logprobs")
    top = parse_top_logprobs(opt_int(body, "top_logprobs"))
    if top is not None and not on:
        raise invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    return (top or 0) if on else None


def parse_completion_logprobs(body: dict) -> int | None:
    """Completions' `logprobs`: None, or an integer 0..20 (alternatives a token; the sampled one is listed too)."""
    return parse_top_logprobs(opt_int(body, "logprobs"), "logprobs")


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object", "messages")
        if not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}].role must be a string", "messages")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise invalid(f"messages[{i}].content must be a string, an array of parts or null", "messages")
    return msgs


def parse_prompt(body: dict) -> str | list[int]:
    """A completion prompt: a string, a one-string list, token ids, or a one-list of token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise invalid("batched prompts are not supported: send one prompt per request", "prompt")
    raise invalid("'prompt' must be a string or an array of token ids", "prompt")


# -------------------------------------------------------------------------------------------- shaping

TokenText = Callable[[int], tuple[str, bytes]]      # GatewayCore.token_text
LOGPROB_FLOOR = -9999.0                             # JSON has no -inf (vLLM's floor)


def _lp(v: float) -> float:
    v = float(v)
    return max(v, LOGPROB_FLOOR) if math.isfinite(v) else LOGPROB_FLOOR


def chat_logprobs(lps: Sequence[TokenLogprob], text_of: TokenText) -> dict:
    """A chat choice's `logprobs`: {content: [{token, logprob, bytes, top_logprobs: [...]}], refusal}."""
    def entry(token: int, logprob: float) -> dict:
        text, data = text_of(token)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(data)}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in lps],
            "refusal": None}


def prompt_logprobs(first: int, lps: Sequence[TokenLogprob], text_of: TokenText) -> tuple[dict, int]:
    """A completion's legacy `logprobs` for an echoed prompt: its first token without a value (no context), then the
    others', and the text offset after them."""
    text, _ = text_of(first)
    rest, offset = completion_logprobs(lps, text_of, len(text))
    return {"tokens": [text] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}, offset


def join_logprobs(a: dict, b: dict) -> dict:
    """Two legacy `logprobs` objects one after the other (an echoed prompt's, then the completion's)."""
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def completion_logprobs(lps: Sequence[TokenLogprob], text_of: TokenText, offset: int = 0) -> tuple[dict, int]:
    """A completion choice's legacy `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}) and the text
    offset after its tokens. Each top_logprobs map holds the best alternatives and the sampled token (OpenAI: up
    to logprobs + 1 entries; tokens of the same text keep the first, best, value)."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text, _ = text_of(lp.token)
        tokens.append(text)
        values.append(_lp(lp.logprob))
        offsets.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for i, v in lp.top:
            top.setdefault(text_of(i)[0], _lp(v))
        top.setdefault(text, _lp(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_chunk(rid: str, created: int, model: str, delta: dict | None, finish: str | None = None,
               usage: dict | None = None, timings: dict | None = None, logprobs: dict | None = None,
               index: int = 0) -> dict:
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]
    obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "system_fingerprint": None, "choices": choices, "usage": usage}
    if timings is not None:
        obj["timings"] = timings
    return obj


def completion_chunk(rid: str, created: int, model: str, text: str | None, finish: str | None = None,
                     usage: dict | None = None, timings: dict | None = None, logprobs: dict | None = None,
                     index: int = 0) -> dict:
    choices = [] if text is None else [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    obj = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "system_fingerprint": None, "choices": choices, "usage": usage}
    if timings is not None:
        obj["timings"] = timings
    return obj


def chat_response(rid: str, created: int, model: str, content: str, reasoning: str, out: Outcome,
                  logprobs: dict | None = None) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if out.tool_calls:     # the calls; what text the answer had beside them stays content (null when none)
        message["tool_calls"] = [c.as_openai() for c in out.tool_calls]
        if not content.strip():
            message["content"] = None
    if reasoning:
        message["reasoning_content"] = reasoning.strip()
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": out.finish_reason}],
            "usage": out.usage, "timings": out.timings}


def completion_response(rid: str, created: int, model: str, text: str, out: Outcome,
                        logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}],
            "usage": out.usage, "timings": out.timings}


def merged_usage(outs: Sequence[Outcome]) -> dict:
    """Usage of a request's choices together: the prompt once, every choice's generated tokens (OpenAI's count)."""
    u = dict(outs[0].usage)
    u["completion_tokens"] = sum(o.completion_tokens for o in outs)
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    return u


def merge_choices(responses: Sequence[dict], outs: Sequence[Outcome]) -> dict:
    """One response of several single-choice ones (n > 1): their choices, indexed in order, and the merged usage;
    `timings` are the first choice's."""
    out = dict(responses[0])
    out["choices"] = [{**r["choices"][0], "index": i} for i, r in enumerate(responses)]
    out["usage"] = merged_usage(outs)
    return out


def now() -> int:
    return int(time.time())
