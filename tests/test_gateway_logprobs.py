"""OpenAI `logprobs` through the gateway (in-process gateway + verifier on the tiny pair): chat and completions,
streamed and not, the public gRPC API, bad values, all against the engine's own numbers for the same prompt."""

from __future__ import annotations

import uuid

import grpc
import pytest

from services.engine.generate import generate
from services.engine.loader import load_target
from services.wire import pb, pb_grpc
from tests.test_gateway_http import assert_error, post, run, sse, stack

TOL = 2e-4
MSGS = [{"role": "user", "content": "Write a function that adds two numbers."}]
KW = {"chat_template_kwargs": {"enable_thinking": False}, "temperature": 0}


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_target(tiny_pair[1], with_tokenizer=False).model


def engine_logprobs(target, prompt_ids, n_tokens, top):
    return generate(target, prompt_ids, n_tokens, top_logprobs=top).logprobs


def chat_prompt(g, messages):
    core = g.core
    return core.encode(core.render_chat(messages, None, {"enable_thinking": False}), add_special=False)


def check_chat_entries(g, entries, want, top):
    core = g.core
    assert len(entries) == len(want)
    for e, w in zip(entries, want):
        text, data = core.token_text(w.token)
        assert e["token"] == text and e["bytes"] == list(data)
        assert abs(e["logprob"] - w.logprob) < TOL
        assert len(e["top_logprobs"]) == top
        for t, (i, v) in zip(e["top_logprobs"], w.top):
            assert abs(t["logprob"] - v) < TOL
            assert t["token"] == core.token_text(i)[0] or abs(t["logprob"] - e["top_logprobs"][0]["logprob"]) < TOL


def test_chat_logprobs_streamed_and_not(tiny_pair, source, target):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            body = {"messages": MSGS, "max_tokens": 14, "logprobs": True, "top_logprobs": 3, **KW}
            s, b, _ = await post(http, "/v1/chat/completions", body)
            assert s == 200, b
            choice = b["choices"][0]
            entries = choice["logprobs"]["content"]
            n = b["usage"]["completion_tokens"] - (choice["finish_reason"] == "stop")   # the EOS is not listed
            want = engine_logprobs(target, chat_prompt(g, MSGS), b["usage"]["completion_tokens"], 3)[:n]
            check_chat_entries(g, entries, want, 3)
            # the tokens' bytes are the content (a random model's tokens may each hold part of a character)
            assert bytes(x for e in entries for x in e["bytes"]).decode("utf-8", "replace") == \
                choice["message"]["content"]
            # streamed: the same entries, spread over the chunks that carry the text
            s, events = await sse(http, "/v1/chat/completions", {**body, "stream": True})
            assert s == 200
            streamed, text = [], ""
            for ev in events[:-1]:
                for c in ev["choices"]:
                    if c["logprobs"] is not None:
                        streamed += c["logprobs"]["content"]
                    text += c["delta"].get("content") or ""
            assert [e["token"] for e in streamed] == [e["token"] for e in entries]
            assert all(abs(a["logprob"] - b_["logprob"]) < TOL for a, b_ in zip(streamed, entries))
            assert text == choice["message"]["content"]
            # no logprobs unless asked; logprobs without alternatives
            s, b, _ = await post(http, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **KW})
            assert b["choices"][0]["logprobs"] is None
            s, b, _ = await post(http, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "logprobs": True,
                                                                **KW})
            assert [e["top_logprobs"] for e in b["choices"][0]["logprobs"]["content"]] == [[]] * 4
    run(scenario())


def test_completion_logprobs_streamed_and_not(tiny_pair, source, target):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            prompt = "def add(a, b):"
            body = {"prompt": prompt, "max_tokens": 10, "logprobs": 2, "temperature": 0}
            s, b, _ = await post(http, "/v1/completions", body)
            assert s == 200, b
            lp = b["choices"][0]["logprobs"]
            n = len(lp["tokens"])
            want = engine_logprobs(target, g.core.encode(prompt, add_special=True), 10, 2)[:n]
            assert n == b["usage"]["completion_tokens"] - (b["choices"][0]["finish_reason"] == "stop")
            data = b"".join(g.core.token_text(w.token)[1] for w in want)
            assert data.decode("utf-8", "replace") == b["choices"][0]["text"]
            offset = 0
            for j, w in enumerate(want):
                assert lp["tokens"][j] == g.core.token_text(w.token)[0]
                assert abs(lp["token_logprobs"][j] - w.logprob) < TOL
                assert lp["text_offset"][j] == offset
                offset += len(lp["tokens"][j])
                top = lp["top_logprobs"][j]
                assert lp["tokens"][j] in top and 1 <= len(top) <= 3          # the best two and the sampled one
                assert max(top.values()) == pytest.approx(w.top[0][1], abs=TOL)
            s, events = await sse(http, "/v1/completions", {**body, "stream": True})
            merged = {"tokens": [], "token_logprobs": [], "text_offset": []}
            for ev in events[:-1]:
                for c in ev["choices"]:
                    if c["logprobs"] is not None:
                        for k in merged:
                            merged[k] += c["logprobs"][k]
            assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
            assert all(abs(a - c) < TOL for a, c in zip(merged["token_logprobs"], lp["token_logprobs"]))
    run(scenario())


def test_logprobs_stop_at_a_stop_string(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            body = {"prompt": "def add(a, b):", "max_tokens": 16, "logprobs": 0, "temperature": 0}
            s, full, _ = await post(http, "/v1/completions", body)
            text = full["choices"][0]["text"]
            # two ASCII letters past the start (a random model's text: each token's piece decodes on its own only
            # where it holds whole characters)
            at = next(i for i in range(2, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalpha())
            stop = text[at:at + 2]
            s, b, _ = await post(http, "/v1/completions", {**body, "stop": [stop]})
            assert s == 200 and b["choices"][0]["finish_reason"] == "stop"
            cut = b["choices"][0]["text"]
            toks = b["choices"][0]["logprobs"]["tokens"]
            # every listed token was generated; the last one holds the start of the stop string
            assert toks == full["choices"][0]["logprobs"]["tokens"][:len(toks)]
            joined = "".join(toks)
            assert joined.startswith(cut) and stop in joined and stop not in "".join(toks[:-1])
    run(scenario())


def test_completion_echo_scores_the_prompt_as_lm_eval_asks(tiny_pair, source, target):
    """lm-eval's loglikelihood payload (local-completions): token-id prompt, echo, logprobs 1, max_tokens 1; its
    parse (token_logprobs[ctxlen:-1], greedy when each equals its top_logprobs' max) on the engine's numbers."""
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            ids = g.core.encode("def add(a, b):\n    return a + b", add_special=False)
            body = {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
            s, b, _ = await post(http, "/v1/completions", body)
            assert s == 200, b
            choice = b["choices"][0]
            lp = choice["logprobs"]
            want = generate(target, ids, 1, prompt_logprobs=1, top_logprobs=1)
            assert len(lp["tokens"]) == len(ids) + 1
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for j in range(1, len(ids)):
                w = want.prompt_logprobs[j - 1]
                assert lp["tokens"][j] == g.core.token_text(ids[j])[0]
                assert abs(lp["token_logprobs"][j] - w.logprob) < TOL
                assert max(lp["top_logprobs"][j].values()) == pytest.approx(w.top[0][1], abs=TOL)
            assert abs(lp["token_logprobs"][-1] - want.logprobs[0].logprob) < TOL
            assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(lp["tokens"]))]
            assert choice["text"].startswith(g.core.tokenizer.decode(ids))
            ctxlen = 3
            score = sum(lp["token_logprobs"][ctxlen:-1])
            assert score == pytest.approx(sum(w.logprob for w in want.prompt_logprobs[ctxlen - 1:]), abs=10 * TOL)
            greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1],
                                                                    lp["top_logprobs"][ctxlen:-1]))
            assert greedy == all(w.top[0][0] == w.token for w in want.prompt_logprobs[ctxlen - 1:])
            # max_tokens 0: the prompt scored, nothing generated
            s, z, _ = await post(http, "/v1/completions", {**body, "max_tokens": 0})
            assert s == 200, z
            assert z["choices"][0]["logprobs"]["tokens"] == lp["tokens"][:-1]
            assert z["choices"][0]["text"] == g.core.tokenizer.decode(ids)
            assert z["usage"]["completion_tokens"] == 0 and z["choices"][0]["finish_reason"] == "length"
            # echo without logprobs: the prompt's text leads, nothing else changes
            s, e, _ = await post(http, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 6,
                                                           "echo": True, "temperature": 0})
            s, plain, _ = await post(http, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 6,
                                                               "temperature": 0})
            assert e["choices"][0]["text"] == "def add(a, b):" + plain["choices"][0]["text"]
            assert e["choices"][0]["logprobs"] is None
            # streamed: the prompt's chunk first, then the completion's, offsets running on
            s, events = await sse(http, "/v1/completions", {**body, "max_tokens": 3, "stream": True})
            chunks = [c for ev in events[:-1] for c in ev["choices"]]
            assert chunks[0]["text"] == g.core.tokenizer.decode(ids)
            merged = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
            offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
            assert merged[:len(ids) + 1] == lp["tokens"]
            assert offsets == [sum(len(t) for t in merged[:j]) for j in range(len(merged))]
    run(scenario())


def test_bad_logprobs_fields_are_400s(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            chat = {"messages": MSGS, "max_tokens": 2}
            cases = [
                ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs"),
                ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
                ("/v1/chat/completions", {**chat, "logprobs": 3}, "logprobs"),
                ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
                ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
                ("/v1/completions", {"prompt": "x", "logprobs": "2"}, "logprobs"),
                ("/v1/chat/completions", {**chat, "echo": True}, "echo"),
                ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
                ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
                ("/v1/completions", {"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
            ]
            for path, body, param in cases:
                s, b, _ = await post(http, path, body)
                assert_error(s, b, 400, "invalid_request_error", param)
                s, b, _ = await post(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 1})
                assert s == 200 and len(b["choices"][0]["logprobs"]["tokens"]) >= 1
    run(scenario())


def test_public_grpc_logprobs(tiny_pair, source, target):
    async def scenario():
        async with stack(tiny_pair, source, grpc_listen=f"inproc:gw-{uuid.uuid4().hex[:6]}") as (
                g, http):
            async with grpc.aio.insecure_channel(g.grpc_server.address.target) as ch:
                stub = pb_grpc.GatewayStub(ch)
                req = pb.PublicGenerateRequest(prompt="def add(a, b):", max_tokens=9, top_logprobs=2)
                chunks = [c async for c in stub.Generate(req, timeout=30)]
                lps = [lp for c in chunks for lp in c.logprobs]
                ids = [t for c in chunks for t in c.token_ids]
                listed = [t for t in ids if t not in g.core.stop_ids]
                assert [lp.chosen.token_id for lp in lps] == listed
                want = engine_logprobs(target, g.core.encode("def add(a, b):", add_special=True), 9, 2)
                for lp, w in zip(lps, want):
                    assert abs(lp.chosen.logprob - w.logprob) < TOL and len(lp.top) == 2
                    assert lp.chosen.bytes == g.core.token_text(w.token)[1]
                    assert lp.chosen.token == g.core.token_text(w.token)[0]
                chunks = [c async for c in stub.Generate(pb.PublicGenerateRequest(prompt="x", max_tokens=3),
                                                         timeout=30)]
                assert not any(c.logprobs for c in chunks)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Generate(pb.PublicGenerateRequest(prompt="x", top_logprobs=30), timeout=10):
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    run(scenario())
