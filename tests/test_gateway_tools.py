"""Tool calls: the parser on Qwen's JSON and XML `<tool_call>` blocks (whole and split anywhere), and the gateway
answering chat requests with `tools` through the real `openai` client, its verifier a scripted gRPC Verifier that
streams the tokens of a given answer (a random test model does not call tools)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import openai
import pytest

from services.engine.chat_template import ChatTemplate
from services.gateway.core import load_tokenizer_source
from services.gateway.pool import VERIFIER_SERVICE
from services.gateway.server import GatewayConfig, serve_gateway
from services.gateway.toolcalls import ToolCall, ToolCallParser, arguments_as_objects
from services.rpc import start_server
from services.wire import pb, pb_grpc
from tests.test_chat_template import QWEN_STYLE_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": ["number", "null"]}, "tags": {"type": "array"}, "zip": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]

XML_ANSWER = ("Let me look that up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n1.5\n"
              "</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n"
              "</function>\n</tool_call>")
XML_ARGS = {"city": "Paris", "days": 3, "metric": True, "hours": 1.5, "tags": ["a", "b"], "zip": "75001"}
JSON_ANSWER = ('<tool_call>\n{"name": "search", "arguments": {"query": "specsplit <tool_call> docs"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>')


def run_parser(text: str, pieces: list[int] | None = None) -> list:
    """Events of the text fed whole, or cut at `pieces` offsets; adjacent strings joined."""
    p = ToolCallParser(TOOLS)
    cuts = [0, *(pieces or []), len(text)]
    events = []
    for a, b in zip(cuts, cuts[1:]):
        events += p.push(text[a:b])
    events += p.finish()
    out: list = []
    for e in events:
        if isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e
        elif e != "":
            out.append(e)
    return out


def calls(events) -> list[tuple[str, dict]]:
    return [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]


def test_xml_and_json_calls_with_typed_arguments():
    ev = run_parser(XML_ANSWER)
    assert ev[0] == "Let me look that up.\n\n" and calls(ev) == [("get_weather", XML_ARGS)]
    ev = run_parser(JSON_ANSWER)
    assert calls(ev) == [("search", {"query": "specsplit <tool_call> docs"}), ("get_weather", {"city": "Oslo"})]
    assert [e.index for e in ev if isinstance(e, ToolCall)] == [0, 1]
    assert len({e.id for e in ev if isinstance(e, ToolCall)}) == 2
    # a value the schema does not type is read as JSON when it is JSON
    ev = run_parser("<tool_call>\n<function=other>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\nhi there\n"
                    "</parameter>\n</function>\n</tool_call>")
    assert calls(ev) == [("other", {"n": 7, "s": "hi there"})]


@pytest.mark.parametrize("text", [XML_ANSWER, JSON_ANSWER, "plain <tool text> with <tool_ and < signs"])
def test_any_split_of_the_stream_gives_the_same_events(text):
    whole = run_parser(text)
    for step in (1, 2, 3, 7, 13):
        got = run_parser(text, list(range(step, len(text), step)))
        assert [e if isinstance(e, str) else (e.name, e.arguments) for e in got] == \
            [e if isinstance(e, str) else (e.name, e.arguments) for e in whole]


def test_what_does_not_parse_stays_content():
    bad = "<tool_call>\nnot a call\n</tool_call> after"
    assert run_parser(bad) == [bad]
    assert run_parser('<tool_call>{"name": 3}</tool_call>') == ['<tool_call>{"name": 3}</tool_call>']
    # the answer ended inside a block: a whole call is still a call, a cut one is text
    ev = run_parser('<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n')
    assert calls(ev) == [("search", {"query": "x"})]
    assert run_parser('<tool_call>\n{"name": "search", "argu') == ['<tool_call>\n{"name": "search", "argu']
    assert run_parser("ends with <tool_") == ["ends with <tool_"]


def test_history_tool_call_arguments_reach_templates_as_objects():
    """OpenAI clients send an earlier call's arguments as JSON text; Qwen3.5 / 3.6 templates iterate its items."""
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tmpl = ChatTemplate(QWEN_STYLE_TEMPLATE)
    text = tmpl.render(arguments_as_objects(msgs), tools=TOOLS)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text and "sunny" in text
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'   # not mutated


class ScriptedVerifier(pb_grpc.VerifierServicer):
    """Streams the tokens of `answer` (three a chunk) then the first stop id, whatever the prompt."""

    def __init__(self, tok, n_vocab: int):
        self.tok, self.n_vocab, self.answer = tok, n_vocab, ""
        self.requests: list = []

    async def Info(self, request, context):
        return pb.VerifierInfo(model=pb.ModelInfo(id="scripted", n_vocab=self.n_vocab, context_length=4096),
                               slots=1, backend="scripted")

    async def Generate(self, request, context):
        self.requests.append(request)
        ids = self.tok.encode(self.answer)
        for i in range(0, len(ids), 3):
            yield pb.GenerateChunk(token_ids=ids[i:i + 3])
        yield pb.GenerateChunk(token_ids=list(request.stop_ids[:1]), finish_reason=pb.FINISH_REASON_STOP,
                               usage=pb.Usage(prompt_tokens=len(request.prompt_ids), completion_tokens=len(ids) + 1))


@contextlib.asynccontextmanager
async def scripted_stack(tiny_pair):
    """(script, gateway): a gateway on the tiny pair's tokenizer routed to a ScriptedVerifier (set script.answer)."""
    source = load_tokenizer_source(tiny_pair[1])
    script = ScriptedVerifier(source.tokenizer, source.tokenizer.vocab_size)
    addr = f"inproc:scripted-{uuid.uuid4().hex[:8]}"
    v = await start_server([(pb_grpc.add_VerifierServicer_to_server, script)], addr, [VERIFIER_SERVICE])
    await v.set_ready(VERIFIER_SERVICE)
    g = await serve_gateway(GatewayConfig(model=tiny_pair[1], verifiers=[addr], host="127.0.0.1", port=0),
                            source=source)
    try:
        assert await g.core.pool.wait_ready(30)
        yield script, g
    finally:
        await g.stop(0)
        await v.stop(0)


def test_chat_with_tools_through_the_openai_client(tiny_pair):
    async def scenario():
        async with scripted_stack(tiny_pair) as (script, g):
            client = openai.AsyncOpenAI(base_url=f"{g.url}/v1", api_key="none", max_retries=0, timeout=30)
            msgs = [{"role": "user", "content": "Weather in Paris?"}]
            script.answer = XML_ANSWER
            r = await client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Let me look that up.\n\n"
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == XML_ARGS
            # streamed: one delta per call with index, id, type, name and the whole arguments
            stream = await client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS, stream=True)
            deltas = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in deltas if c.choices)
            tcs = [tc for c in deltas if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert text == "Let me look that up.\n\n" and "<tool_call>" not in text
            assert [(tc.index, tc.function.name) for tc in tcs] == [(0, "get_weather")]
            assert json.loads(tcs[0].function.arguments) == XML_ARGS and tcs[0].id and tcs[0].type == "function"
            assert deltas[-1].choices[0].finish_reason == "tool_calls"
            # two JSON calls, no text: content null
            script.answer = JSON_ANSWER
            r = await client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS)
            assert r.choices[0].message.content is None
            assert [c.function.name for c in r.choices[0].message.tool_calls] == ["search", "get_weather"]
            # without tools, or with tool_choice none, the markup is the answer's text
            for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
                r = await client.chat.completions.create(model="scripted", messages=msgs, **kw)
                assert r.choices[0].message.content == JSON_ANSWER and not r.choices[0].message.tool_calls
                assert r.choices[0].finish_reason == "stop"
            # a history with a call and its result renders (arguments as JSON text, as clients send them)
            script.answer = "It is sunny."
            history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
            r = await client.chat.completions.create(model="scripted", messages=history, tools=TOOLS)
            assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
            # requests the server cannot honour are 400s naming the field
            for kw, param in (({"tool_choice": "required"}, "tool_choice"),
                              ({"tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice"),
                              ({"tool_choice": "sometimes"}, "tool_choice")):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="scripted", messages=msgs, tools=TOOLS, **kw)
                assert e.value.body["param"] == param
            for bad in ([{"type": "function"}], [{"type": "function", "function": {"name": ""}}], {"a": 1},
                        [{"type": "code", "function": {"name": "x"}}]):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="scripted", messages=msgs, tools=bad)
                assert e.value.body["param"] == "tools"

    asyncio.run(asyncio.wait_for(scenario(), 120))
