"""Gateway unit-level tests: an in-process gateway (HTTP on 127.0.0.1:0, optional public gRPC) routed to an
in-process verifier (the verifier package's `serve_verifier`) on the tiny target + drafter pair.

Covers the OpenAI surface (error statuses and bodies, SSE chunk shapes, stop strings, usage, timings),
/health, /metrics (parsed with prometheus_client), 429 from a full verifier queue, cancellation on client
disconnect, the public gRPC API, trace context, and the TextAssembler on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services import telemetry
from services.gateway.server import GatewayConfig, serve_gateway
from services.gateway.textstream import TextAssembler, prompt_opens_thinking, think_token_ids
from services.verifier.service import VerifierConfig, serve_verifier
from services.wire import pb, pb_grpc

TIMEOUT = aiohttp.ClientTimeout(total=60)


@contextlib.asynccontextmanager
async def stack(tiny_pair, source, *, draft: bool = True, slots: int = 1, max_queue: int = 4,
                max_ctx: int | None = None, verifier: bool = True, grpc_listen: str | None = None,
                ping_interval: float = 5.0):
    """(gateway, http session) with an in-process verifier behind it (or an address nobody serves)."""
    _, target, drafter = tiny_pair
    v = None
    if verifier:
        v = await serve_verifier(VerifierConfig(model=target, draft=drafter if draft else None, slots=slots,
                                                max_queue=max_queue, max_ctx=max_ctx),
                                 f"inproc:verifier-{uuid.uuid4().hex[:8]}")
        addresses = [str(v.address)]
    else:
        addresses = [f"inproc:nobody-{uuid.uuid4().hex[:8]}"]
    g = await serve_gateway(GatewayConfig(model=target, verifiers=addresses, host="127.0.0.1", port=0,
                                          grpc_listen=grpc_listen, ping_interval=ping_interval), source=source)
    try:
        if verifier:
            assert await g.core.pool.wait_ready(30), g.core.pool.status_message()
        async with aiohttp.ClientSession(base_url=g.url, timeout=TIMEOUT) as http:
            yield g, http
    finally:
        await g.stop(0)
        if v is not None:
            await v.stop(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def post(http: aiohttp.ClientSession, path: str, body) -> tuple[int, dict, dict]:
    kw = {"data": body} if isinstance(body, (bytes, str)) else {"json": body}
    async with http.post(path, **kw) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


async def sse(http: aiohttp.ClientSession, path: str, body: dict) -> tuple[int, list]:
    """Status and parsed SSE events ('[DONE]' kept as the string)."""
    async with http.post(path, json=body) as r:
        if r.content_type != "text/event-stream":
            return r.status, [await r.json(content_type=None)]
        events = []
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.status, events


async def wait_idle(g, timeout: float = 30.0, endpoint: int = 0) -> None:
    """Wait (bounded) until the verifier's own counters show no running or queued request."""
    ep = g.core.pool.endpoints[endpoint]
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        info = await ep.stub.Info(pb.InfoRequest(), timeout=5)
        if info.active == 0 and info.queued == 0:
            return
        assert asyncio.get_running_loop().time() < deadline, f"verifier still busy: {info}"
        await asyncio.sleep(0.02)


CHAT = {"messages": [{"role": "user", "content": "Hello, how are you?"}], "max_tokens": 12}


def assert_error(status: int, body: dict, want_status: int, want_type: str, param: str | None = None) -> None:
    assert status == want_status, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] == want_type and err["code"] == want_status and err["message"]
    if param is not None:
        assert err["param"] == param


# ----------------------------------------------------------------------------------------- errors


def test_bad_requests_get_openai_errors_and_server_keeps_serving(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source, max_ctx=48) as (g, http):
            cases = [
                (b"{not json", 400, "invalid_request_error", None),
                (b"[1, 2]", 400, "invalid_request_error", None),
                ({"messages": "hi"}, 400, "invalid_request_error", "messages"),
                ({"messages": []}, 400, "invalid_request_error", "messages"),
                ({**CHAT, "temperature": "hot"}, 400, "invalid_request_error", "temperature"),
                ({**CHAT, "max_tokens": "10"}, 400, "invalid_request_error", "max_tokens"),
                ({**CHAT, "max_tokens": -1}, 400, "invalid_request_error", "max_tokens"),
                ({**CHAT, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
                ({**CHAT, "max_completion_tokens": 0}, 400, "invalid_request_error", "max_completion_tokens"),
                ({**CHAT, "n": 17}, 400, "invalid_request_error", "n"),
                ({**CHAT, "n": 0}, 400, "invalid_request_error", "n"),
                ({**CHAT, "top_p": 0}, 400, "invalid_request_error", "top_p"),
                ({**CHAT, "min_p": 2}, 400, "invalid_request_error", "min_p"),
                ({**CHAT, "top_k": -5}, 400, "invalid_request_error", "top_k"),
                ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_request_error", "stop"),
                ({**CHAT, "stop": 5}, 400, "invalid_request_error", "stop"),
                ({**CHAT, "stream": "yes"}, 400, "invalid_request_error", "stream"),
                ({**CHAT, "model": "no-such-model"}, 404, "not_found_error", "model"),
                ({**CHAT, "chat_template_kwargs": {"messages": []}}, 400, "invalid_request_error",
                 "chat_template_kwargs"),
                ({**CHAT, "messages": [{"content": "no role"}]}, 400, "invalid_request_error", "messages"),
                # fields that would change the answer, which the server does not do: refused, never ignored
                ({**CHAT, "logit_bias": {"42": -101}}, 400, "invalid_request_error", "logit_bias"),
                ({**CHAT, "logit_bias": {"not-an-id": 1}}, 400, "invalid_request_error", "logit_bias"),
                ({**CHAT, "logit_bias": [1, 2]}, 400, "invalid_request_error", "logit_bias"),
                ({**CHAT, "logit_bias": {"99999999": 1}}, 400, "invalid_request_error", "logit_bias"),  # verifier
                ({**CHAT, "min_tokens": 5}, 400, "invalid_request_error", "min_tokens"),
                ({**CHAT, "guided_json": {"type": "object"}}, 400, "invalid_request_error", "guided_json"),
                ({**CHAT, "functions": [{"name": "f"}]}, 400, "invalid_request_error", "functions"),
                ({"messages": [{"role": "user", "content": "def add(a, b): return a + b " * 10}],
                  "max_tokens": 4}, 400, "exceed_context_size_error", "messages"),
            ]
            for body, status, typ, param in cases:
                s, b, _ = await post(http, "/v1/chat/completions", body)
                assert_error(s, b, status, typ, param)
                ok, resp, _ = await post(http, "/v1/chat/completions", CHAT)   # still serving
                assert ok == 200, resp
            s, b, _ = await post(http, "/v1/completions", {"prompt": "def add(a, b): return a + b " * 10,
                                                           "max_tokens": 4})
            assert_error(s, b, 400, "exceed_context_size_error", "prompt")
            for field, value in (("suffix", "}"), ("best_of", 3), ("grammar", "root ::= \"a\"")):
                s, b, _ = await post(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, field: value})
                assert_error(s, b, 400, "invalid_request_error", field)
            s, b, _ = await post(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, "suffix": "", "best_of": 1,
                                                           "logit_bias": {}, "min_tokens": 0})
            assert s == 200, b
            s, b, _ = await post(http, "/v1/completions", {"prompt": {"x": 1}})
            assert_error(s, b, 400, "invalid_request_error", "prompt")
            s, b, _ = await post(http, "/v1/completions", {"prompt": [1, 2, 99999], "max_tokens": 2})
            assert_error(s, b, 400, "invalid_request_error", "prompt")
            async with http.get("/v1/nothing-here") as r:
                assert_error(r.status, await r.json(), 404, "not_found_error")
            # Unknown fields are accepted and ignored; the model's own name and the verifier's id work.
            s, b, _ = await post(http, "/v1/chat/completions",
                                 {**CHAT, "frobnicate": True, "model": g.core.model_name, "logit_bias": {},
                                  "chat_template_kwargs": {"enable_thinking": False}, "top_k": -1})
            assert s == 200, b
    run(scenario())


def test_over_long_prompt_is_caught_at_the_verifier_too(tiny_pair, source):
    """The gateway checks the context itself; the verifier's INVALID_ARGUMENT maps to the same answer."""
    async def scenario():
        async with stack(tiny_pair, source, max_ctx=48) as (g, http):
            g.core.check_prompt = lambda ids, ep=None, param="prompt": None     # let it through to the verifier
            long = "def add(a, b): return a + b " * 10
            s, b, _ = await post(http, "/v1/completions", {"prompt": long, "max_tokens": 4})
            assert_error(s, b, 400, "exceed_context_size_error", "prompt")
            s, b, _ = await post(http, "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": long}], "max_tokens": 4})
            assert_error(s, b, 400, "exceed_context_size_error", "messages")
    run(scenario())


def test_health_503_without_a_verifier(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source, verifier=False) as (g, http):
            async with http.get("/health") as r:
                body = await r.json()
                assert_error(r.status, body, 503, "unavailable_error")
            s, b, h = await post(http, "/v1/chat/completions", CHAT)
            assert_error(s, b, 503, "unavailable_error")
            assert "Retry-After" in h
            async with http.get("/v1/models") as r:       # the gateway itself still answers
                assert r.status == 200
    run(scenario())


# ------------------------------------------------------------------------------------- responses


def test_non_streaming_chat_and_completion(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            s, b, _ = await post(http, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 10,
                                                                 "max_tokens": 99})
            assert s == 200, b
            assert b["object"] == "chat.completion" and b["id"].startswith("chatcmpl-")
            assert b["model"] == g.core.model_name
            (choice,) = b["choices"]
            assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
            assert choice["finish_reason"] in ("stop", "length")
            u = b["usage"]
            assert u["completion_tokens"] <= 10 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
            t = b["timings"]
            assert t["prompt_n"] == u["prompt_tokens"] and t["predicted_n"] == u["completion_tokens"]
            assert t["draft_n"] > 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
            assert t.get("draft_n_accepted", 1) > 0     # only present when > 0

            s, b, _ = await post(http, "/completions", {"prompt": "def add(a, b):", "max_tokens": 6})
            assert s == 200, b
            assert b["object"] == "text_completion" and b["choices"][0]["finish_reason"] == "length"
            assert b["usage"]["completion_tokens"] == 6 and isinstance(b["choices"][0]["text"], str)

            async with http.get("/models") as r:
                models = await r.json()
            assert models["object"] == "list" and models["data"][0]["id"] == g.core.model_name
            assert models["data"][0]["max_model_len"] > 0
    run(scenario())


def test_sse_chunk_shapes(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            s, ev = await sse(http, "/v1/chat/completions", {**CHAT, "stream": True,
                                                             "stream_options": {"include_usage": True}})
            assert s == 200, ev
            assert ev[-1] == "[DONE]"
            chunks = ev[:-1]
            assert len({c["id"] for c in chunks}) == 1
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            first, *middle, finish, usage = chunks
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
            assert first["usage"] is None
            for c in middle:
                d = c["choices"][0]["delta"]
                assert "role" not in d and set(d) <= {"content", "reasoning_content"}
                assert c["choices"][0]["finish_reason"] is None and c["usage"] is None
            assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
            assert usage["timings"]["draft_n"] > 0 and "timings" not in finish

            # The streamed text is the non-streamed text (greedy).
            s, b, _ = await post(http, "/v1/chat/completions", CHAT)
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in middle) == \
                b["choices"][0]["message"]["content"]

            # Without include_usage: no usage chunk; timings ride on the finish chunk.
            s, ev = await sse(http, "/chat/completions", {**CHAT, "stream": True})
            assert ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] == "length"
            assert ev[-2]["timings"]["predicted_n"] == 12 and all(c["usage"] is None for c in ev[:-1])

            s, ev = await sse(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 5, "stream": True,
                                                        "stream_options": {"include_usage": True}})
            assert ev[-1] == "[DONE]"
            *texts, finish, usage = ev[:-1]
            assert all(c["object"] == "text_completion" for c in ev[:-1])
            assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["text"] == ""
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    run(scenario())


def test_stop_strings_never_leak(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            body = {"prompt": "The quick brown fox", "max_tokens": 24}
            s, ev = await sse(http, "/v1/completions", {**body, "stream": True})
            pieces = [c["choices"][0]["text"] for c in ev[:-1] if c["choices"] and c["choices"][0]["text"]]
            full = "".join(pieces)
            # A stop string made of the end of one token's text and the start of the next one.
            cands = [a[-1] + b[:2] for a, b in zip(pieces, pieces[1:]) if "\ufffd" not in a[-1] + b[:2]]
            assert cands, pieces
            stop = cands[len(cands) // 2]
            want = full[: full.index(stop)]
            s, b, _ = await post(http, "/v1/completions", {**body, "stop": [stop, "never-there"]})
            assert s == 200, b
            assert b["choices"][0]["text"] == want and b["choices"][0]["finish_reason"] == "stop"
            assert b["usage"]["completion_tokens"] < 24
            s, ev = await sse(http, "/v1/completions", {**body, "stop": stop, "stream": True})
            streamed = [c["choices"][0]["text"] for c in ev[:-1] if c["choices"]]
            assert "".join(streamed) == want        # nothing of the stop string was sent, not even in part
            assert ev[-2]["choices"][0]["finish_reason"] == "stop"
            # Same for chat.
            s, b, _ = await post(http, "/v1/chat/completions", CHAT)
            content = b["choices"][0]["message"]["content"]
            if len(content) >= 4:
                stop = content[2:4]
                s, b, _ = await post(http, "/v1/chat/completions", {**CHAT, "stop": stop})
                assert b["choices"][0]["message"]["content"] == content[: content.index(stop)]
    run(scenario())


# -------------------------------------------------------------------------------------- metrics


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_match_the_requests_made(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            gen = prompt = draft = accepted = 0
            for body in (CHAT, {**CHAT, "max_tokens": 5}):
                s, b, _ = await post(http, "/v1/chat/completions", body)
                assert s == 200
                gen += b["usage"]["completion_tokens"]
                prompt += b["usage"]["prompt_tokens"]
                draft += b["timings"].get("draft_n", 0)
                accepted += b["timings"].get("draft_n_accepted", 0)
            s, ev = await sse(http, "/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True,
                                                     "stream_options": {"include_usage": True}})
            gen += ev[-2]["usage"]["completion_tokens"]
            prompt += ev[-2]["usage"]["prompt_tokens"]
            draft += ev[-2]["timings"].get("draft_n", 0)
            accepted += ev[-2]["timings"].get("draft_n_accepted", 0)
            await post(http, "/v1/chat/completions", {**CHAT, "n": 99})
            await post(http, "/v1/chat/completions", b"oops")

            async with http.get("/metrics") as r:
                assert r.status == 200 and r.content_type.startswith("text/plain")
                m = _samples(await r.text())
            req = "specsplit:requests_total"
            assert m[(req, (("endpoint", "/v1/chat/completions"), ("status", "200")))] == 2
            assert m[(req, (("endpoint", "/v1/chat/completions"), ("status", "400")))] == 2
            assert m[(req, (("endpoint", "/v1/completions"), ("status", "200")))] == 1
            assert m[("specsplit:generation_tokens_total", ())] == gen
            assert m[("specsplit:prompt_tokens_total", ())] == prompt
            assert m[("specsplit:time_to_first_token_seconds_count", ())] == 3
            assert m[("specsplit:spec_decode_num_draft_tokens_total", ())] == draft > 0
            assert m[("specsplit:spec_decode_num_accepted_tokens_total", ())] == accepted
            per_pos = sum(v for (n, _), v in m.items()
                          if n == "specsplit:spec_decode_num_accepted_tokens_per_pos_total")
            assert per_pos == accepted
            drafts = m[("specsplit:spec_decode_num_drafts_total", ())]
            assert drafts > 0
            assert m[("specsplit:spec_decode_mean_acceptance_length", ())] == pytest.approx(1 + accepted / drafts)
            assert m[("specsplit:spec_decode_fallbacks_total", ())] == 0
            assert m[("specsplit:spec_decode_draft_seconds_total", ())] > 0
            assert m[("specsplit:spec_decode_drafter_seconds_total", ())] == 0     # the drafter is in process
            assert m[("specsplit:requests_running", ())] == 0
            # The inter-token histogram counts every token after the first of each request.
            assert m[("specsplit:inter_token_latency_seconds_count", ())] <= gen - 3
            # KV accounting from the verifier's Info: 32-wide heads -> `auto` keeps f32 on both sides
            from services.engine.config import config_from_gguf
            from services.engine.formats import open_model_file
            from services.engine.kvcache import kv_bytes_per_token

            per_tok = {dict(lb)["cache_type_k"] + "/" + dict(lb)["cache_type_v"]: v for (n, lb), v in m.items()
                       if n == "specsplit:kv_cache_bytes_per_token"}
            cfg = config_from_gguf(open_model_file(tiny_pair[1]).metadata)
            assert per_tok == {"f32/f32": kv_bytes_per_token(cfg, "f32", "f32")}
            cap = [v for (n, _), v in m.items() if n == "specsplit:kv_cache_capacity_tokens"]
            total = [v for (n, _), v in m.items() if n == "specsplit:kv_cache_bytes"]
            assert len(cap) == 1 and cap[0] > 0 and total == [cap[0] * per_tok["f32/f32"]]
    run(scenario())


# ------------------------------------------------------------------------- overload, disconnect


def test_full_queue_is_429_and_disconnect_frees_the_slot(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source, slots=1, max_queue=0) as (g, http):
            long = {"prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
            async with http.post("/v1/completions", json=long) as r:
                assert r.status == 200
                await r.content.readline()          # the stream is running: the only slot is taken
                s, b, h = await post(http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
                assert_error(s, b, 429, "rate_limit_error")
                assert int(h["Retry-After"]) >= 1
                r.close()                           # client goes away mid-stream
            await wait_idle(g)
            s, b, _ = await post(http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
            assert s == 200, b
            async with http.get("/metrics") as r:
                m = _samples(await r.text())
            assert m[("specsplit:requests_total", (("endpoint", "/v1/completions"), ("status", "429")))] == 1
            assert m[("specsplit:requests_running", ())] == 0
    run(scenario())


def test_ignore_eos_generates_through_end_of_sequence(tiny_pair, source):
    """`ignore_eos` (vLLM's extension): the tiny model ends "Hello" after 23 tokens; with it, max_tokens run."""
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            s, b, _ = await post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 40})
            assert s == 200 and b["choices"][0]["finish_reason"] == "stop" and b["usage"]["completion_tokens"] < 40
            s, b, _ = await post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True})
            assert s == 200 and b["choices"][0]["finish_reason"] == "length"
            assert b["usage"]["completion_tokens"] == 40
            s, b, _ = await post(http, "/v1/completions", {"prompt": "Hello", "ignore_eos": "yes"})
            assert_error(s, b, 400, "invalid_request_error", "ignore_eos")
    run(scenario())


def test_back_to_back_requests_never_see_their_own_slot_busy(tiny_pair):
    """slots=1, max_queue=0: a request sent the moment the previous one's final chunk arrives must get the
    slot (the verifier frees it before that chunk goes out, not just after)."""
    from services import rpc

    _, target, _ = tiny_pair

    async def scenario():
        v = await serve_verifier(VerifierConfig(model=target, slots=1, max_queue=0, speculative=False),
                                 f"inproc:b2b-{uuid.uuid4().hex[:6]}")
        try:
            async with rpc.open_channel(str(v.address)) as ch:
                stub = pb_grpc.VerifierStub(ch)
                for i in range(40):
                    call = stub.Generate(pb.GenerateRequest(prompt_ids=[1 + i % 7, 2], max_tokens=1))
                    async for chunk in call:
                        if chunk.HasField("usage"):
                            break                        # the final chunk: send the next request at once
        finally:
            await v.stop()
    run(scenario())


def test_errors_after_headers_are_sse_events(tiny_pair, source):
    """With a tiny ping interval the headers (and pings) go out before the verifier answers; its 429 then
    travels as a `data: {"error": ...}` event, which openai-python raises as APIError."""
    async def scenario():
        async with stack(tiny_pair, source, slots=1, max_queue=0, ping_interval=1e-4) as (g, http):
            async with http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True,
                                                           "stream": True}) as busy:
                await busy.content.readline()
                async with http.post("/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                    assert r.status == 200 and r.content_type == "text/event-stream"
                    raw = (await r.read()).decode()
                busy.close()
            await wait_idle(g)
            events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
            assert events[-1]["error"]["code"] == 429 and events[-1]["error"]["type"] == "rate_limit_error"
            assert "[DONE]" not in raw
            s, b, _ = await post(http, "/v1/chat/completions", {**CHAT, "stream": False})
            assert s == 200, b
    run(scenario())


def test_request_timeout_becomes_the_grpc_deadline(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            s, b, _ = await post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True,
                                                         "timeout": 0.05})
            assert_error(s, b, 504, "timeout_error")
            s, b, _ = await post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "timeout": -1})
            assert_error(s, b, 400, "invalid_request_error", "timeout")
            s, b, _ = await post(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "timeout": 30})
            assert s == 200, b
    run(scenario())


def test_routes_to_the_least_busy_ready_verifier(tiny_pair, source):
    """Two live verifiers and one address nobody serves: /health is 200, requests never go to the dead
    one, and two concurrent streams land on different verifiers."""
    _, target, drafter = tiny_pair

    async def scenario():
        vs = [await serve_verifier(VerifierConfig(model=target, slots=1, max_queue=0),
                                   f"inproc:rv{i}-{uuid.uuid4().hex[:6]}") for i in range(2)]
        dead = f"inproc:dead-{uuid.uuid4().hex[:6]}"
        g = await serve_gateway(GatewayConfig(model=target, verifiers=[dead, *(str(v.address) for v in vs)],
                                              host="127.0.0.1", port=0), source=source)
        try:
            assert await g.core.pool.wait_ready(30)
            # wait_ready returns once one verifier is: the split below needs both (else the second stream first
            # tries the busy one, is turned away, and lands on the other as it comes up: right, but counted twice)
            for _ in range(300):
                if len(g.core.pool.ready) == 2:
                    break
                await asyncio.sleep(0.1)
            assert len(g.core.pool.ready) == 2, g.core.pool.status_message()
            async with aiohttp.ClientSession(base_url=g.url, timeout=TIMEOUT) as http:
                async with http.get("/health") as r:
                    assert r.status == 200
                body = {"prompt": "Hello", "max_tokens": 300, "stream": True, "ignore_eos": True}
                async with http.post("/v1/completions", json=body) as a, \
                        http.post("/v1/completions", json=body) as b:
                    assert a.status == b.status == 200        # with max_queue=0 the second would be 429
                    await a.content.readline()
                    await b.content.readline()
                    assert [v.servicer.counters.requests for v in vs] == [1, 1]
                    # Both full: the gateway tries each (nothing was sent yet) before answering 429.
                    s, res, _ = await post(http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
                    assert_error(s, res, 429, "rate_limit_error")
                    assert [v.servicer.counters.requests for v in vs] == [2, 2]
                for i in (1, 2):                    # the closed streams' slots come back
                    await wait_idle(g, endpoint=i)
                for _ in range(4):
                    s, res, _ = await post(http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
                    assert s == 200, res
        finally:
            await g.stop(0)
            for v in vs:
                await v.stop(0)
    run(scenario())


# ------------------------------------------------------------------------------------ public gRPC


def test_public_grpc_api(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source, grpc_listen=f"inproc:gw-{uuid.uuid4().hex[:6]}") as (g, http):
            async with grpc.aio.insecure_channel(g.grpc_server.address.target) as ch:
                stub = pb_grpc.GatewayStub(ch)
                models = await stub.ListModels(pb.ListModelsRequest(), timeout=10)
                assert models.models[0].id == g.core.model_name and models.models[0].context_length > 0
                chunks = [c async for c in stub.Generate(pb.PublicGenerateRequest(prompt="def add(a, b):",
                                                                                   max_tokens=7), timeout=30)]
                assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
                assert chunks[-1].usage.completion_tokens == 7
                assert sum(len(c.token_ids) for c in chunks) == 7
                s, b, _ = await post(http, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 7})
                assert "".join(c.text for c in chunks) == b["choices"][0]["text"]
                chat = pb.PublicGenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user",
                                                                                            content="Hi")]),
                                                max_tokens=3)
                chunks = [c async for c in stub.Generate(chat, timeout=30)]
                assert chunks[-1].usage.completion_tokens == 3
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(pb.PublicGenerateRequest(model="nope", prompt="x"), timeout=10):
                        pass
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(pb.PublicGenerateRequest(prompt="x", max_tokens=-3), timeout=10):
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    run(scenario())


# ---------------------------------------------------------------------------------------- tracing


def test_request_span_continues_the_callers_trace(tiny_pair, source):
    provider = telemetry.configure_tracing("memory", "test")
    try:
        async def scenario():
            async with stack(tiny_pair, source) as (g, http):
                trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
                headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
                async with http.post("/v1/chat/completions", json={**CHAT, "seed": 7, "top_k": 3},
                                     headers=headers) as r:
                    b = await r.json()
                return trace_id, b, g.core.model_name
        trace_id, b, model = run(scenario())
        spans = provider.memory_exporter.get_finished_spans()
        (req,) = [s for s in spans if s.name == f"chat {model}"]
        assert format(req.context.trace_id, "032x") == trace_id
        assert req.kind.name == "SERVER"
        a = req.attributes
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "specsplit"
        assert a["gen_ai.request.model"] == model and a["gen_ai.request.max_tokens"] == 12
        assert a["gen_ai.request.seed"] == 7 and a["gen_ai.request.top_k"] == 3
        assert a["gen_ai.response.id"] == b["id"]
        assert list(a["gen_ai.response.finish_reasons"]) == [b["choices"][0]["finish_reason"]]
        assert a["gen_ai.usage.input_tokens"] == b["usage"]["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == b["usage"]["completion_tokens"]
        assert a["spec.draft_tokens"] == b["timings"]["draft_n"]
        (ver,) = [s for s in spans if s.name == "verifier.generate"]
        assert ver.parent is not None and ver.parent.span_id == req.context.span_id
        assert ver.context.trace_id == req.context.trace_id
        steps = [s for s in spans if s.name == "spec.verify"]
        assert len(steps) == b["timings"]["draft_steps"] > 0
    finally:
        telemetry.configure_tracing("none", "test")


# ----------------------------------------------------------------------------------- text assembly


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text)


def test_assembler_holds_back_split_stop_strings(source):
    tok = source.tokenizer
    ids = _ids(tok, "Hello, how are you today? I am fine, thank you.")
    full = tok.decode(ids)
    for stop in ("are you", "you today?", "fine, th", "ank you."):
        asm = TextAssembler(tok, stop=[stop])
        out = []
        for t in ids:
            for p in asm.push(t):
                out.append(p.text)
            if asm.stopped:
                break
        out += [p.text for p in asm.finish()]
        assert "".join(out) == full[: full.index(stop)]
        assert asm.stopped and asm.matched_stop == stop
    # No stop: everything comes out, nothing held at the end.
    asm = TextAssembler(tok, stop=["zzz"])
    text = "".join(p.text for t in ids for p in asm.push(t)) + "".join(p.text for p in asm.finish())
    assert text == full and not asm.stopped


def test_assembler_splits_reasoning(source):
    tok = source.tokenizer
    think = think_token_ids(tok)
    assert think is not None                    # the tiny tokenizer has <think> and </think>
    eos = sorted(tok.eos_ids)
    ids = tok.encode("<think>\nHello there</think>\n\nI am fine") + eos[:1]
    asm = TextAssembler(tok, stop_ids=eos, think_ids=think)
    pieces = [p for t in ids for p in asm.push(t)] + asm.finish()
    reasoning = "".join(p.text for p in pieces if p.channel == "reasoning")
    content = "".join(p.text for p in pieces if p.channel == "content")
    assert reasoning == "Hello there" and content == "I am fine"
    # A prompt that opened the block: the stream starts inside it.
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    asm = TextAssembler(tok, think_ids=think, in_reasoning=True)
    pieces = [p for t in tok.encode("Hmm</think>Yes") for p in asm.push(t)] + asm.finish()
    merged: list[list[str]] = []
    for p in pieces:
        if merged and merged[-1][0] == p.channel:
            merged[-1][1] += p.text
        else:
            merged.append([p.channel, p.text])
    assert merged == [["reasoning", "Hmm"], ["content", "Yes"]]
    # Without think ids the tags are plain text.
    asm = TextAssembler(tok)
    text = "".join(p.text for t in tok.encode("<think>a</think>b") for p in asm.push(t))
    assert text + "".join(p.text for p in asm.finish()) == "<think>a</think>b"


def test_gateway_cli_flags_and_env(monkeypatch):
    from services.cli import build_parser
    from services.gateway.cli import config_from_args

    monkeypatch.setenv("SPECSPLIT_VERIFIER", "unix:///run/a.sock, localhost:50051")
    monkeypatch.setenv("SPECSPLIT_PORT", "9000")
    monkeypatch.setenv("SPECSPLIT_GRPC_LISTEN", "0.0.0.0:50052")
    cfg = config_from_args(build_parser().parse_args(["gateway", "--model", "m.gguf"]))
    assert cfg.verifiers == ["unix:///run/a.sock", "localhost:50051"] and cfg.port == 9000
    assert cfg.grpc_listen == "0.0.0.0:50052"
    cfg = config_from_args(build_parser().parse_args(["gateway", "--model", "m.gguf", "--verifier", "h:1",
                                                      "--verifier", "h:2", "--port", "81",
                                                      "--request-timeout", "30"]))
    assert cfg.verifiers == ["h:1", "h:2"] and cfg.port == 81 and cfg.request_timeout == 30


# ------------------------------------------------------------------------------------------- n > 1


def test_n_choices_streamed_and_not(tiny_pair, source):
    """n choices: each its own generation (seed + i), indexed; usage counts the prompt once and every choice's
    tokens; streamed, each index has its role chunk, deltas and finish chunk, one usage chunk and one [DONE]; more
    choices than the verifier takes is a 429 and the server goes on."""
    async def scenario():
        async with stack(tiny_pair, source, max_queue=0) as (g, http):
            body = {**CHAT, "temperature": 1.0, "seed": 7, "max_tokens": 8}
            singles = []
            for i in range(3):
                s, b, _ = await post(http, "/v1/chat/completions", {**body, "seed": 7 + i})
                singles.append(b)
            s, b, _ = await post(http, "/v1/chat/completions", {**body, "n": 2})
            assert s == 429, b                        # one slot and no queue: the second choice does not fit
            await wait_idle(g)
        async with stack(tiny_pair, source) as (g, http):
            s, b, _ = await post(http, "/v1/chat/completions", {**body, "n": 3})
            assert s == 200, b
            assert [c["index"] for c in b["choices"]] == [0, 1, 2]
            assert [c["message"]["content"] for c in b["choices"]] == \
                [x["choices"][0]["message"]["content"] for x in singles]
            assert b["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
            assert b["usage"]["completion_tokens"] == sum(x["usage"]["completion_tokens"] for x in singles)
            s, events = await sse(http, "/v1/chat/completions", {**body, "n": 3, "stream": True,
                                                               "stream_options": {"include_usage": True}})
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            usage = events[-2]
            assert usage["choices"] == [] and usage["usage"] == b["usage"]
            texts, roles, finishes = ["", "", ""], [0, 0, 0], [0, 0, 0]
            for ev in events[:-2]:
                assert ev["id"] == events[0]["id"]
                (c,) = ev["choices"]
                roles[c["index"]] += c["delta"].get("role") == "assistant"
                texts[c["index"]] += c["delta"].get("content") or ""
                finishes[c["index"]] += c["finish_reason"] is not None
            assert roles == [1, 1, 1] and finishes == [1, 1, 1]
            assert texts == [c["message"]["content"] for c in b["choices"]]
            # completions, greedy: the same text twice, each with its own logprobs
            s, b, _ = await post(http, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 5, "n": 2,
                                                           "logprobs": 1, "temperature": 0})
            assert s == 200 and b["choices"][0]["text"] == b["choices"][1]["text"]
            assert b["choices"][0]["logprobs"]["tokens"] == b["choices"][1]["logprobs"]["tokens"]
    run(scenario())


def test_logit_bias_reaches_the_verifier(tiny_pair, source):
    """OpenAI logit_bias through the gateway and the verifier's speculative loop: +100 on a token makes every
    generated token that one; -100 on the tokens plain decoding chose takes them out, and the answer is the
    engine's plain decoding under the same bias."""
    from services.engine.generate import generate
    from services.engine.loader import load_target
    from services.engine.sampling import SamplingParams

    target = load_target(tiny_pair[1], with_tokenizer=False).model
    plain = generate(target, [5, 6, 7], 6).token_ids
    ban = {i: -100.0 for i in sorted(set(plain))}
    want = generate(target, [5, 6, 7], 6, SamplingParams(logit_bias=tuple(ban.items()))).token_ids
    assert not set(want) & set(plain)

    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            tok = g.core.encode("7", add_special=False)[-1]
            body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            s, b, _ = await post(http, "/v1/completions", {**body, "logit_bias": {str(tok): 100}})
            assert s == 200 and b["choices"][0]["text"] == g.core.tokenizer.decode([tok] * 6)
            assert b["timings"].get("draft_n", 0) > 0     # speculative steps ran under the bias
            s, b, _ = await post(http, "/v1/completions", {**body, "logit_bias": {str(i): v for i, v in ban.items()}})
            assert s == 200 and b["choices"][0]["text"] == g.core.tokenizer.decode(want)
    run(scenario())


def test_more_choices_than_slots_stream_at_once(tiny_pair, source):
    """n = 3 streamed on a one-slot verifier: the choices run one after another, and each choice's tokens reach the
    client as they are made (not gathered until every choice has ended); the role chunks come first."""
    async def scenario():
        async with stack(tiny_pair, source, slots=1, max_queue=4, ping_interval=0.05) as (g, http):
            body = {**CHAT, "max_tokens": 160, "ignore_eos": True, "n": 3, "stream": True, "temperature": 0.7}
            t0 = loop.time()
            seen: dict = {}
            async with http.post("/v1/chat/completions", json=body) as r:
                assert r.status == 200
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: {"):
                        continue
                    for c in json.loads(line[6:])["choices"]:
                        key = ("role" if c["delta"].get("role") else "text" if c["delta"].get("content") else
                               "end" if c["finish_reason"] else "other", c["index"])
                        seen.setdefault(key, loop.time() - t0)
            # one slot: choice 0 ends before choice 2 says anything; its tokens reached the client as they were made,
            # not in one burst once every choice had started (then they would all arrive within a millisecond)
            assert seen[("end", 0)] < seen[("text", 2)]
            assert seen[("role", 2)] <= seen[("text", 0)] < seen[("end", 0)] - 0.02, seen
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(scenario(), 120))
    finally:
        loop.close()
