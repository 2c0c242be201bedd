"""The OpenAI-compatible HTTP surface (aiohttp, on the same event loop as the gRPC clients).

Routes (each also without the /v1 prefix, as llama-server serves them): /v1/models, /v1/chat/completions,
/v1/completions, /v1/responses (responses_api.py), /tokenize, /detokenize, /health (/v1/health), /metrics; and
Anthropic's /v1/messages and /v1/messages/count_tokens (anthropic_api.py), whose errors take Anthropic's shape.

Streaming: the handler waits for the first event before sending headers (up to one ping interval), so
errors the verifier reports at once (queue full, prompt too long) still become proper HTTP statuses; a
long prefill past that gets headers, the role chunk and `: ping` comments, which clients ignore. Errors
after the headers are one `data: {"error": ...}` event. A client that disconnects cancels the handler
(handler_cancellation=True), which cancels the verifier call and frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from . import anthropic_api as anth
from . import responses_api as rapi
from .core import Delta, GatewayCore, Generation, GenerationRequest, Outcome
from .errors import APIError, invalid, unavailable
from .openai_api import (
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    join_logprobs,
    merge_choices,
    merged_usage,
    new_id,
    now,
    opt_bool,
    opt_model,
    opt_object,
    parse_chat_echo,
    parse_chat_logprobs,
    parse_common,
    parse_completion_logprobs,
    parse_messages,
    parse_prompt,
    prompt_logprobs,
)
from .textstream import prompt_opens_thinking
from .toolcalls import arguments_as_objects, check_tool_choice, check_tools

log = logging.getLogger("specsplit.gateway")

CORE_KEY = web.AppKey("core", GatewayCore)
PING_KEY = web.AppKey("ping_interval", float)
_PROPAGATOR = TraceContextTextMapPropagator()
# The status a streamed response really ended with (its HTTP status is 200 once headers are out).
_STATUS_KEY: Any = web.RequestKey("status", int) if hasattr(web, "RequestKey") else "specsplit.status"

# Canonical endpoint label for metrics (prefixed and unprefixed spellings count together).
_ENDPOINTS = {
    "/v1/chat/completions": "/v1/chat/completions", "/chat/completions": "/v1/chat/completions",
    "/v1/completions": "/v1/completions", "/completions": "/v1/completions",
    "/v1/models": "/v1/models", "/models": "/v1/models",
    "/health": "/health", "/v1/health": "/health",
    "/tokenize": "/tokenize", "/detokenize": "/detokenize",
    "/v1/responses": "/v1/responses", "/responses": "/v1/responses",
    "/v1/messages": "/v1/messages", "/messages": "/v1/messages",
    "/v1/messages/count_tokens": "/v1/messages/count_tokens", "/messages/count_tokens": "/v1/messages/count_tokens",
}
_ANTHROPIC = frozenset(p for p, e in _ENDPOINTS.items() if e.startswith("/v1/messages"))

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(err: APIError, anthropic: bool = False) -> web.Response:
    """The error in OpenAI's body shape, or Anthropic's on its routes."""
    return web.json_response(anth.error_body(err) if anthropic else err.body(), status=err.status,
                             headers=err.headers())


async def read_json(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = json.loads(raw.decode("utf-8") if raw else "")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


@web.middleware
async def _errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error becomes an OpenAI error body; every API request is counted by endpoint and status."""
    core = request.app[CORE_KEY]
    endpoint = _ENDPOINTS.get(request.path)
    shaped = request.path in _ANTHROPIC
    status: int | str = 500
    try:
        resp = await handler(request)
        status = request.get(_STATUS_KEY, resp.status)
        return resp
    except APIError as e:
        status = e.status
        return error_response(e, shaped)
    except web.HTTPException as e:
        status = e.status
        if e.status == 404:
            return error_response(APIError(404, f"no route for {request.method} {request.path}"), shaped)
        if e.status == 405:
            return error_response(APIError(405, f"method {request.method} not allowed on {request.path}",
                                           type="invalid_request_error"), shaped)
        if e.status >= 400:                 # e.g. 413 for a body over client_max_size
            return error_response(APIError(e.status, e.reason or e.text or "request failed",
                                           type="invalid_request_error" if e.status < 500 else None), shaped)
        raise
    except asyncio.CancelledError:
        status = 499                     # client went away (nginx's convention; logs and metrics only)
        raise
    except Exception as e:
        log.exception("unhandled error on %s", request.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"), shaped)
    finally:
        if endpoint is not None and endpoint not in ("/health",):
            core.metrics.observe_request(endpoint, status)


# ------------------------------------------------------------------------------------------ handlers


async def health(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    if not core.pool.ready:
        err = unavailable(f"Loading model: {core.pool.status_message()}")
        return error_response(err)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    core.metrics.observe_verifiers(core.pool.endpoints)
    return web.Response(body=core.metrics.render(), headers={"Content-Type": core.metrics.content_type})


async def models(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    info = core.pool.model_info()
    card: dict[str, Any] = {"id": core.model_name, "object": "model",
                            "created": int(info.created) if info is not None and info.created else core.created,
                            "owned_by": "specsplit", "root": core.model_name, "parent": None}
    if info is not None:
        card["max_model_len"] = int(info.context_length)
        card["meta"] = {"n_ctx": int(info.context_length), "n_vocab": int(info.n_vocab), "arch": info.arch,
                        "speculative": bool(info.speculative)}
    return web.json_response({"object": "list", "data": [card]})


async def tokenize(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    body = await read_json(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise invalid("'content' must be a string", "content")
    ids = core.encode(content, add_special=opt_bool(body, "add_special"))
    if opt_bool(body, "with_pieces"):
        tok = core.tokenizer
        return web.json_response({"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]})
    return web.json_response({"tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    body = await read_json(request)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid("'tokens' must be an array of token ids", "tokens")
    return web.json_response({"content": core.tokenizer.decode(ids)})


def _trace_context(request: web.Request):
    return _PROPAGATOR.extract(carrier=request.headers) if "traceparent" in request.headers else None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    core = request.app[CORE_KEY]
    arrived = time.perf_counter()
    body = await read_json(request)
    model = core.resolve_model(opt_model(body))
    params = parse_common(body)
    parse_chat_echo(body)
    top_logprobs = parse_chat_logprobs(body)
    messages = parse_messages(body)
    kwargs = dict(opt_object(body, "chat_template_kwargs") or {})
    reserved = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt"})
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    tools = check_tools(body.get("tools"))
    parse_calls = check_tool_choice(body.get("tool_choice"), tools)
    req = _chat_request(core, request, arrived, new_id("chatcmpl"), "/v1/chat/completions", model,
                        arguments_as_objects(messages), tools, parse_calls, kwargs, "messages",
                        max_tokens=params.max_tokens, sampling=params.sampling, sampling_set=params.sampling_set,
                        stop=params.stop, timeout=params.timeout, ignore_eos=params.ignore_eos,
                        top_logprobs=top_logprobs)
    reqs = _choices(req, params.n)
    if params.stream:
        return await _stream(request, core, reqs, chat=True, include_usage=params.include_usage)
    created, answers = now(), []
    for content, reasoning, out in await _collect_all(core, reqs):
        lps = None if out.logprobs is None else chat_logprobs(out.logprobs, core.token_text)
        answers.append((chat_response(req.request_id, created, model, content, reasoning, out, lps), out))
    return web.json_response(_one_response(answers))


async def completions(request: web.Request) -> web.StreamResponse:
    core = request.app[CORE_KEY]
    arrived = time.perf_counter()
    body = await read_json(request)
    model = core.resolve_model(opt_model(body))
    echo = opt_bool(body, "echo")
    params = parse_common(body, echo=echo)
    top_logprobs = parse_completion_logprobs(body)
    prompt = parse_prompt(body)
    prompt_ids = core.encode(prompt, add_special=True) if isinstance(prompt, str) else prompt
    core.check_prompt(prompt_ids)
    # echo: the prompt's text leads the answer, and with logprobs its tokens' (scored on the verifier); a prompt
    # scored with nothing generated (max_tokens 0) is asked for even without logprobs
    scored = echo and (top_logprobs is not None or params.max_tokens == 0)
    req = GenerationRequest(request_id=new_id("cmpl"), operation="text_completion", endpoint="/v1/completions",
                            model=model, prompt_ids=prompt_ids, max_tokens=params.max_tokens,
                            sampling=params.sampling, sampling_set=params.sampling_set, stop=params.stop,
                            timeout=params.timeout, ignore_eos=params.ignore_eos, top_logprobs=top_logprobs,
                            prompt_logprobs=(top_logprobs or 0) if scored else None,
                            arrived=arrived, trace_context=_trace_context(request))
    echo_text = (prompt if isinstance(prompt, str) else core.tokenizer.decode(prompt_ids)) if echo else None
    reqs = _choices(req, params.n)
    if params.stream:
        return await _stream(request, core, reqs, chat=False, include_usage=params.include_usage, echo=echo_text)
    created, answers = now(), []
    for content, _, out in await _collect_all(core, reqs):
        lps = None
        if out.logprobs is not None:
            lps, offset = completion_logprobs([], core.token_text)
            if echo:    # the prompt's tokens first (its first without a value), then the completion's
                lps, offset = prompt_logprobs(prompt_ids[0], out.prompt_logprobs or [], core.token_text)
            lps = join_logprobs(lps, completion_logprobs(out.logprobs, core.token_text, offset)[0])
        text = (echo_text or "") + content
        answers.append((completion_response(req.request_id, created, model, text, out, lps), out))
    return web.json_response(_one_response(answers))


def _chat_request(core: GatewayCore, request: web.Request, arrived: float, rid: str, endpoint: str, model: str,
                  messages: list[dict], tools: list[dict] | None, parse_calls: bool, template_kwargs: dict,
                  param: str, **fields: Any) -> GenerationRequest:
    """A chat generation from a request's messages (OpenAI chat's, or what an Anthropic or Responses request
    became): the template rendered, the prompt checked (blamed on `param`), reasoning split, tool calls parsed when
    asked; `fields`: the GenerationRequest's sampling and limit ones."""
    prompt_text = core.render_chat(messages, tools, template_kwargs)
    prompt_ids = core.encode(prompt_text, add_special=False)
    core.check_prompt(prompt_ids, param=param)
    split = core.think_ids is not None
    return GenerationRequest(request_id=rid, operation="chat", endpoint=endpoint, model=model, prompt_ids=prompt_ids,
                             split_reasoning=split, in_reasoning=split and prompt_opens_thinking(prompt_text),
                             tools=tools if parse_calls else None, arrived=arrived,
                             trace_context=_trace_context(request), **fields)


def _anthropic_request(core: GatewayCore, body: dict, arrived: float, request: web.Request
                       ) -> tuple[GenerationRequest, bool]:
    """A Messages request as a chat generation (anthropic_api.py), and whether it streams."""
    model = core.resolve_model(opt_model(body))
    max_tokens, sampling, given, stop, stream = anth.sampling(body)
    tools, parse_calls = anth.to_tools(body)
    req = _chat_request(core, request, arrived, anth.new_message_id(), "/v1/messages", model,
                        anth.to_chat_messages(body), tools, parse_calls, anth.thinking_kwargs(body), "messages",
                        max_tokens=max_tokens, sampling=sampling, sampling_set=given, stop=stop)
    return req, stream


async def anthropic_messages(request: web.Request) -> web.StreamResponse:
    core = request.app[CORE_KEY]
    arrived = time.perf_counter()
    req, stream = _anthropic_request(core, await read_json(request), arrived, request)
    if stream:
        return await _anthropic_stream(request, core, req)
    blocks = anth.BlockAssembler()
    async with core.open(req) as gen:
        while not isinstance(ev := await gen.next(), Outcome):
            blocks.add(ev.reasoning, ev.content, ev.tool_calls)
    blocks.finish()
    return web.json_response(anth.message(req.request_id, req.model, blocks.blocks, ev))


async def anthropic_count_tokens(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    body = await read_json(request)
    core.resolve_model(opt_model(body))
    tools, _ = anth.to_tools(body)
    text = core.render_chat(anth.to_chat_messages(body), tools, anth.thinking_kwargs(body))
    return web.json_response({"input_tokens": len(core.encode(text, add_special=False))})


def _event(obj: dict) -> bytes:
    """An Anthropic SSE event: its type as the event name, the object as data."""
    return (f"event: {obj['type']}\n".encode() + b"data: " +
            json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n")


async def _until_outcome(gen: Generation, first: Any, ping: float) -> AsyncIterator[Any]:
    """A generation's events from its first one to its Outcome; None where a ping interval passed without one."""
    ev = first
    while True:
        yield ev
        if isinstance(ev, Outcome):
            return
        ev = await gen.next(timeout=ping or None)


async def _anthropic_stream(request: web.Request, core: GatewayCore, req: GenerationRequest) -> web.StreamResponse:
    """message_start, each block's start / deltas / stop, message_delta (stop reason, usage), message_stop; ping
    events while nothing else is due; an error after the headers is an `error` event."""
    ping = request.app[PING_KEY]
    async with core.open(req) as gen:
        first = await gen.next(timeout=ping or None)     # errors before any byte: HTTP statuses
        resp = await _open_sse(request)

        async def body() -> None:
            await resp.write(_event({"type": "message_start", "message": {
                "id": req.request_id, "type": "message", "role": "assistant", "model": req.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(req.prompt_ids), "output_tokens": 0}}}))
            blocks = anth.BlockAssembler()
            async for ev in _until_outcome(gen, first, ping):
                if ev is None:
                    await resp.write(_event({"type": "ping"}))
                elif isinstance(ev, Delta):
                    for e in blocks.add(ev.reasoning, ev.content, ev.tool_calls):
                        await resp.write(_event(e))
                else:
                    for e in blocks.finish():
                        await resp.write(_event(e))
                    reason, stop_seq = anth.stop_reason(ev)
                    await resp.write(_event({"type": "message_delta",
                                             "delta": {"stop_reason": reason, "stop_sequence": stop_seq},
                                             "usage": {"output_tokens": ev.completion_tokens}}))
                    await resp.write(_event({"type": "message_stop"}))

        return await _run_stream(request, resp, req.request_id, body, lambda e: _event(anth.error_body(e)))


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API (responses_api.py): the chat core, answered as output items."""
    core = request.app[CORE_KEY]
    arrived = time.perf_counter()
    body = await read_json(request)
    model = core.resolve_model(opt_model(body))
    max_tokens, sampling, given, stream = rapi.sampling(body)
    tools, parse_calls = rapi.to_tools(body)
    req = _chat_request(core, request, arrived, rapi.new_response_id(), "/v1/responses", model,
                        rapi.to_chat_messages(body), tools, parse_calls, rapi.thinking_kwargs(body), "input",
                        max_tokens=max_tokens, sampling=sampling, sampling_set=given)
    created = rapi.now()
    if stream:
        return await _responses_stream(request, core, req, body, tools, created)
    items = rapi.OutputAssembler(rapi.custom_tool_names(body))
    async with core.open(req) as gen:
        while not isinstance(ev := await gen.next(), Outcome):
            items.add(ev.reasoning, ev.content, ev.tool_calls)
    items.finish()
    return web.json_response(rapi.response(req.request_id, created, model, body, items.items, ev, tools))


async def _responses_stream(request: web.Request, core: GatewayCore, req: GenerationRequest, body: dict,
                            tools: list[dict] | None, created: int) -> web.StreamResponse:
    """response.created / .in_progress, each output item's added / deltas / done events, response.completed; SSE
    comments while a long prompt runs; an error after the headers is an `error` event."""
    ping = request.app[PING_KEY]
    seq = [0]

    def event(obj: dict) -> bytes:
        seq[0] += 1
        return _event({**obj, "sequence_number": seq[0] - 1})

    async with core.open(req) as gen:
        first = await gen.next(timeout=ping or None)     # errors before any byte: HTTP statuses
        resp = await _open_sse(request)

        async def events() -> None:
            started = rapi.response(req.request_id, created, req.model, body, [], None, tools)
            await resp.write(event({"type": "response.created", "response": started}))
            await resp.write(event({"type": "response.in_progress", "response": started}))
            items = rapi.OutputAssembler(rapi.custom_tool_names(body))
            async for ev in _until_outcome(gen, first, ping):
                if ev is None:
                    await resp.write(b": ping\n\n")
                elif isinstance(ev, Delta):
                    for e in items.add(ev.reasoning, ev.content, ev.tool_calls):
                        await resp.write(event(e))
                else:
                    for e in items.finish():
                        await resp.write(event(e))
                    done = rapi.response(req.request_id, created, req.model, body, items.items, ev, tools)
                    await resp.write(event({"type": "response.incomplete" if done["status"] == "incomplete"
                                            else "response.completed", "response": done}))

        return await _run_stream(request, resp, req.request_id, events, lambda e: event(
            {"type": "error", "code": e.type, "message": e.message, "param": e.param}))


def _choices(req: GenerationRequest, n: int) -> list[GenerationRequest]:
    """A request's n choices, each a generation of its own: choice i draws with seed + i when a seed is given
    (llama.cpp's rule), else with its own random seed; request ids `<id>`, `<id>.1`, ..."""
    out = [req]
    for i in range(1, n):
        sampling = req.sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
        out.append(dataclasses.replace(req, request_id=f"{req.request_id}.{i}", sampling=sampling))
    return out


async def _collect_all(core: GatewayCore, reqs: list[GenerationRequest]) -> list[tuple[str, str, Outcome]]:
    """Run every choice to its end at once; the first error ends them all (their verifier calls cancelled)."""
    async with contextlib.AsyncExitStack() as stack:
        gens = [await stack.enter_async_context(core.open(r)) for r in reqs]
        return list(await asyncio.gather(*(g.collect() for g in gens)))


def _one_response(answers: list[tuple[dict, Outcome]]) -> dict:
    if len(answers) == 1:
        return answers[0][0]
    return merge_choices([a for a, _ in answers], [o for _, o in answers])


# ----------------------------------------------------------------------------------------- streaming


async def _open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    return resp


async def _run_stream(request: web.Request, resp: web.StreamResponse, rid: str, body: Callable[[], Awaitable[None]],
                      error_event: Callable[[APIError], bytes]) -> web.StreamResponse:
    """Write a stream's events (`body`) after its headers: an error then can only travel as an event (its real
    status kept for logs and metrics); a client gone between writes ends it quietly."""
    try:
        await body()
    except APIError as e:
        request[_STATUS_KEY] = e.status
        await resp.write(error_event(e))
    except ConnectionError:     # aiohttp noticed the disconnect on a write rather than by cancelling
        request[_STATUS_KEY] = 499
        return resp
    except Exception as e:
        log.exception("stream %s failed", rid)
        request[_STATUS_KEY] = 500
        await resp.write(error_event(APIError(500, f"internal error: {type(e).__name__}: {e}")))
    await resp.write_eof()
    return resp


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _stream(request: web.Request, core: GatewayCore, reqs: list[GenerationRequest], chat: bool,
                  include_usage: bool, echo: str | None = None) -> web.StreamResponse:
    """SSE of one or more choices (n): each choice's chunks carry its index, in the order its events come; one
    usage chunk for all (include_usage) and one [DONE] at the end."""
    ping = request.app[PING_KEY]
    created = now()
    rid, model = reqs[0].request_id, reqs[0].model
    async with contextlib.AsyncExitStack() as stack:
        choices = [_StreamChoice(i, r, await stack.enter_async_context(core.open(r)), core, chat, echo)
                   for i, r in enumerate(reqs)]
        # Errors raised here (before any byte is sent) propagate to the middleware as HTTP statuses. Several choices
        # wait together for at most one ping interval: on a verifier with fewer slots than choices the last ones
        # start only as the first ones end, and the client must hear from the server before that.
        tasks: dict[asyncio.Future, _StreamChoice] = {asyncio.ensure_future(c.gen.next()): c for c in choices}
        done, _ = await asyncio.wait(tasks, timeout=ping or None,
                                     return_when=asyncio.ALL_COMPLETED if ping else asyncio.FIRST_COMPLETED)
        try:
            for t in done:
                t.result()
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        resp = await _open_sse(request)
        if chat:
            for c in choices:
                await resp.write(_sse(chat_chunk(rid, created, model, {"role": "assistant", "content": None},
                                                 index=c.index)))
        outs: list[Outcome | None] = [None] * len(choices)

        async def events() -> None:
            if len(done) < len(tasks):      # a choice's first event is a ping interval late: the client hears so
                await resp.write(b": ping\n\n")
            for t in sorted(done, key=lambda t: tasks[t].index):     # the first events, in choice order
                c = tasks.pop(t)
                await _write_event(resp, rid, created, model, c, t.result(), outs, include_usage)
                if outs[c.index] is None:
                    tasks[asyncio.ensure_future(c.gen.next())] = c
            while tasks:
                ready, _ = await asyncio.wait(tasks, timeout=ping or None, return_when=asyncio.FIRST_COMPLETED)
                if not ready:
                    await resp.write(b": ping\n\n")
                for t in ready:
                    c = tasks.pop(t)
                    await _write_event(resp, rid, created, model, c, t.result(), outs, include_usage)
                    if outs[c.index] is None:
                        tasks[asyncio.ensure_future(c.gen.next())] = c
            done_outs = [o for o in outs if o is not None]
            if include_usage:
                make = chat_chunk if chat else completion_chunk
                await resp.write(_sse(make(rid, created, model, None, usage=merged_usage(done_outs),
                                           timings=done_outs[0].timings)))
            await resp.write(b"data: [DONE]\n\n")

        try:
            return await _run_stream(request, resp, rid, events, lambda e: _sse(e.body()))
        finally:
            for t in tasks:
                t.cancel()


class _StreamChoice:
    """One choice of a stream: its generation, index, logprobs state and whether its echoed prompt went out."""

    def __init__(self, index: int, req: GenerationRequest, gen: Generation, core: GatewayCore, chat: bool,
                 echo: str | None):
        self.index, self.req, self.gen, self.chat, self.echo = index, req, gen, chat, echo
        self.lp = _StreamLogprobs(core, chat) if req.top_logprobs is not None else None


async def _write_event(resp: web.StreamResponse, rid: str, created: int, model: str, c: _StreamChoice, ev: Any,
                       outs: list, include_usage: bool) -> None:
    if c.echo is not None:     # completions' echo: the prompt first, once it is scored
        await resp.write(_sse(completion_chunk(rid, created, model, c.echo, index=c.index,
                                               logprobs=c.lp.prompt(c.req, c.gen) if c.lp is not None else None)))
        c.echo = None
    if isinstance(ev, Delta):
        await resp.write(_sse(_delta_chunk(rid, created, model, ev, c.chat, c.lp, c.index)))
    elif isinstance(ev, Outcome):
        outs[c.index] = ev
        await _write_finish(resp, rid, created, model, ev, c, timings=not include_usage)


class _StreamLogprobs:
    """A stream's log-probabilities chunk by chunk: each Delta's tokens, the rest (tokens that released no text)
    with the finish chunk, and a completion's text offsets running on across chunks."""

    def __init__(self, core: GatewayCore, chat: bool):
        self.core, self.chat = core, chat
        self.sent = 0
        self.offset = 0

    def shape(self, lps: list) -> dict | None:
        self.sent += len(lps)
        if self.chat:
            return chat_logprobs(lps, self.core.token_text)
        out, self.offset = completion_logprobs(lps, self.core.token_text, self.offset)
        return out

    def prompt(self, req: GenerationRequest, gen: Generation) -> dict:
        """An echoed prompt's logprobs (completions), the text offsets of what follows counted from its end."""
        out, self.offset = prompt_logprobs(req.prompt_ids[0], gen.prompt_logprobs or [], self.core.token_text)
        return out

    def rest(self, out: Outcome) -> dict | None:
        left = (out.logprobs or [])[self.sent:]
        return self.shape(left) if left else None


def _delta_chunk(rid: str, created: int, model: str, ev: Delta, chat: bool, lp: _StreamLogprobs | None,
                 index: int = 0) -> dict:
    lps = lp.shape(ev.logprobs) if lp is not None else None
    if not chat:
        return completion_chunk(rid, created, model, ev.content, logprobs=lps, index=index)
    if ev.tool_calls:      # a whole call a chunk: index, id, type and name with the complete arguments
        delta: dict = {"tool_calls": [c.as_openai(with_index=True) for c in ev.tool_calls]}
    elif ev.reasoning:
        delta = {"reasoning_content": ev.reasoning}
    else:
        delta = {"content": ev.content}
    return chat_chunk(rid, created, model, delta, logprobs=lps, index=index)


async def _write_finish(resp: web.StreamResponse, rid: str, created: int, model: str, out: Outcome,
                        c: _StreamChoice, timings: bool) -> None:
    """A choice's finish chunk (with what log-probabilities are left). llama.cpp puts `timings` in the last chunk
    before [DONE]: this one when no usage chunk follows."""
    make = chat_chunk if c.chat else completion_chunk
    finish_payload: Any = {} if c.chat else ""
    lps = c.lp.rest(out) if c.lp is not None else None
    await resp.write(_sse(make(rid, created, model, finish_payload, out.finish_reason,
                               timings=out.timings if timings else None, logprobs=lps, index=c.index)))


# --------------------------------------------------------------------------------------------- app


def create_app(core: GatewayCore, ping_interval: float = 15.0) -> web.Application:
    """The aiohttp application. Run it with handler_cancellation=True (serve_gateway does) so a client
    disconnect cancels the request."""
    app = web.Application(middlewares=[_errors_and_metrics], client_max_size=64 * 1024 * 1024)
    app[CORE_KEY] = core
    app[PING_KEY] = float(ping_interval)
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/chat/completions", chat_completions)
        app.router.add_post(f"{prefix}/completions", completions)
        app.router.add_post(f"{prefix}/responses", responses)
        app.router.add_get(f"{prefix}/models", models)
        app.router.add_get(f"{prefix}/health", health)
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/messages", anthropic_messages)
        app.router.add_post(f"{prefix}/messages/count_tokens", anthropic_count_tokens)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    return app


__all__ = ["create_app", "CORE_KEY", "Generation"]
