"""OpenAI's Responses API (what Codex CLI speaks) through the real `openai` client: answers equal the chat
endpoint's for the same conversation, the stream rebuilds the same response, tool calls come back as function_call
items and go back as history (a scripted verifier answers with them), and what the server cannot honour is a 400."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from services.gateway import responses_api as rapi
from tests.test_gateway_http import post, run, stack
from tests.test_gateway_tools import JSON_ANSWER, TOOLS, XML_ANSWER, XML_ARGS, scripted_stack

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_match_the_chat_endpoint(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            client = openai.AsyncOpenAI(base_url=f"{g.url}/v1", api_key="none", max_retries=0, timeout=60)
            model = g.core.model_name
            for kw, msgs in (({"input": "Hello, how are you?"}, [{"role": "user", "content": "Hello, how are you?"}]),
                             ({"instructions": "Be brief.", "input": [
                                 {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                                 {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
                                 {"role": "developer", "content": "Answer in French."},
                                 {"role": "user", "content": "How are you?"}]},
                              [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello."},
                               {"role": "system", "content": "Answer in French."},
                               {"role": "user", "content": "How are you?"}])):
                r = await client.responses.create(model=model, max_output_tokens=10, temperature=0, **kw)
                s, chat, _ = await post(http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 10,
                                                                       "temperature": 0})
                want = chat["choices"][0]["message"]["content"]
                assert r.object == "response" and r.id.startswith("resp_") and r.output_text == want
                assert [o.type for o in r.output] == ["message"]
                assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
                assert r.usage.output_tokens == chat["usage"]["completion_tokens"]
                if chat["choices"][0]["finish_reason"] == "length":
                    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
                else:
                    assert r.status == "completed"
                async with client.responses.stream(model=model, max_output_tokens=10, temperature=0, **kw) as st:
                    events = [e async for e in st]
                # the last event is response.completed, or response.incomplete at max_output_tokens (which the
                # SDK's get_final_response does not take: it reads completed only)
                final = events[-1].response
                assert events[-1].type == {"completed": "response.completed",
                                           "incomplete": "response.incomplete"}[r.status]
                deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
                assert "".join(deltas) == want == final.output_text and final.status == r.status
                assert [e.sequence_number for e in events] == list(range(len(events)))
            for bad, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                               ({"tools": [42]}, "tools"),
                               ({"tools": [{"type": "custom"}]}, "tools"),
                               ({"tools": FLAT_TOOLS, "tool_choice": "required"}, "tool_choice"),
                               ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text"),
                               ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                                         "image_url": "http://x"}]}]}, "input")):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.responses.create(model=model, **({"input": "Hi"} | bad))
                assert e.value.body["param"] == param
            r = await client.responses.create(model=model, input="Hi", max_output_tokens=2)
            assert r.usage.output_tokens == 2
    run(scenario())


def test_function_calls_out_and_back(tiny_pair, source):
    async def scenario():
        async with scripted_stack(tiny_pair) as (script, g):
            client = openai.AsyncOpenAI(base_url=f"{g.url}/v1", api_key="none", max_retries=0, timeout=30)
            script.answer = XML_ANSWER
            r = await client.responses.create(model="scripted", input="Weather in Paris?", tools=FLAT_TOOLS)
            assert [o.type for o in r.output] == ["message", "function_call"]
            assert r.output_text == "Let me look that up.\n\n"
            call = r.output[1]
            assert call.name == "get_weather" and json.loads(call.arguments) == XML_ARGS and call.call_id
            async with client.responses.stream(model="scripted", input="Weather in Paris?", tools=FLAT_TOOLS) as st:
                kinds = [e.type async for e in st]
                final = await st.get_final_response()
            assert [o.type for o in final.output] == ["message", "function_call"]
            assert json.loads(final.output[1].arguments) == XML_ARGS
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
            assert "response.function_call_arguments.done" in kinds
            script.answer = JSON_ANSWER
            r = await client.responses.create(model="scripted", input="Search and check", tools=FLAT_TOOLS)
            assert [(o.type, getattr(o, "name", None)) for o in r.output] == [("function_call", "search"),
                                                                              ("function_call", "get_weather")]
            # the call and its output as the next turn's input, as Codex sends them
            script.answer = "It is sunny."
            follow = [{"role": "user", "content": "Weather in Paris?"},
                      {"type": "function_call", "call_id": call.call_id, "name": call.name,
                       "arguments": call.arguments},
                      {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
            r = await client.responses.create(model="scripted", input=follow, tools=FLAT_TOOLS)
            assert r.output_text == "It is sunny." and r.status == "completed"
            prompt = source.tokenizer.decode(script.requests[-1].prompt_ids)
            assert "sunny, 21 C" in prompt and "Weather in Paris?" in prompt

    asyncio.run(asyncio.wait_for(scenario(), 120))


PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch"
CODEX_TOOLS = [{"type": "function", "name": "shell", "description": "Run a command",
                "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}},
               {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/s"}},
               {"type": "web_search"}]


def test_codex_tools_custom_apply_patch_and_hosted_ones(tiny_pair, source):
    """What Codex CLI sends: a function tool, apply_patch as a custom (freeform) tool, a hosted web_search. The custom
    tool reaches the model as a one-string function and its call comes back as a custom_tool_call with the raw
    patch; the hosted tool is not offered; the call and its output go back as the next turn's history."""
    async def scenario():
        async with scripted_stack(tiny_pair) as (script, g):
            client = openai.AsyncOpenAI(base_url=f"{g.url}/v1", api_key="none", max_retries=0, timeout=30)
            script.answer = ("<tool_call>\n<function=apply_patch>\n<parameter=input>\n" + PATCH +
                             "\n</parameter>\n</function>\n</tool_call>")
            r = await client.responses.create(model="scripted", input="Write hello.txt", tools=CODEX_TOOLS,
                                              store=False, reasoning={"effort": "medium"})
            (call,) = r.output
            assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH
            async with client.responses.stream(model="scripted", input="Write hello.txt", tools=CODEX_TOOLS) as st:
                events = [e async for e in st]
            assert [e.input for e in events if e.type == "response.custom_tool_call_input.done"] == [PATCH]
            assert events[-1].response.output[0].input == PATCH
            script.answer = "Done."
            follow = [{"role": "user", "content": "Write hello.txt"},
                      {"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch", "input": PATCH},
                      {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Success. Updated 1 file"}]
            r = await client.responses.create(model="scripted", input=follow, tools=CODEX_TOOLS)
            assert r.output_text == "Done."
            history = source.tokenizer.decode(script.requests[-1].prompt_ids)
            assert "Success. Updated 1 file" in history and "Write hello.txt" in history
    run(scenario())
    # what the template gets: the function tool, apply_patch as a one-string function naming its grammar, no
    # web_search (the tiny model's ChatML template does not render tools, so this is read off the translation)
    tools, parse = rapi.to_tools({"tools": CODEX_TOOLS})
    assert parse and [t["function"]["name"] for t in tools] == ["shell", "apply_patch"]
    patch = tools[1]["function"]
    assert patch["parameters"]["properties"] == {"input": {"type": "string"}} and "start: /.+/s" in \
        patch["description"]
