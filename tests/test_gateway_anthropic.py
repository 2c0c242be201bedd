"""The Anthropic Messages API through the real `anthropic` client: text answers equal the chat endpoint's for the
same conversation, streaming rebuilds the same message, count_tokens counts the prompt the answer used, tool calls
come back as tool_use blocks (a scripted verifier answers with them), and errors take Anthropic's shape."""

from __future__ import annotations

import asyncio

import anthropic
import pytest

from tests.test_gateway_http import post, run, stack
from tests.test_gateway_tools import JSON_ANSWER, TOOLS, XML_ANSWER, XML_ARGS, scripted_stack

SYSTEM = "You are terse."
MSGS = [{"role": "user", "content": "Hello, how are you?"}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_messages_match_the_chat_endpoint(tiny_pair, source):
    async def scenario():
        async with stack(tiny_pair, source) as (g, http):
            client = anthropic.AsyncAnthropic(base_url=g.url, api_key="none", max_retries=0, timeout=60)
            r = await client.messages.create(model=g.core.model_name, max_tokens=12, system=SYSTEM, messages=MSGS,
                                             extra_body={"temperature": 0})
            s, chat, _ = await post(http, "/v1/chat/completions", {
                "messages": [{"role": "system", "content": SYSTEM}] + MSGS, "max_tokens": 12, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False}})
            assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
            assert [b.type for b in r.content] == ["text"]
            assert r.content[0].text == chat["choices"][0]["message"]["content"]
            assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
            assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
            assert r.usage.output_tokens == chat["usage"]["completion_tokens"]
            count = await client.messages.count_tokens(model=g.core.model_name, system=SYSTEM, messages=MSGS)
            assert count.input_tokens == r.usage.input_tokens
            # streamed: the SDK rebuilds the same message from the events
            async with client.messages.stream(model=g.core.model_name, max_tokens=12, system=SYSTEM,
                                              messages=MSGS, extra_body={"temperature": 0}) as stream:
                texts = [t async for t in stream.text_stream]
                final = await stream.get_final_message()
            assert "".join(texts) == r.content[0].text == final.content[0].text
            assert final.stop_reason == r.stop_reason and final.usage.output_tokens == r.usage.output_tokens
            # a stop sequence ends the answer before it
            text = r.content[0].text
            stop = next((text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].isascii()
                         and text[i:i + 2].isalpha()), None)
            if stop:
                r2 = await client.messages.create(model=g.core.model_name, max_tokens=12, system=SYSTEM,
                                                  messages=MSGS, stop_sequences=[stop],
                                                  extra_body={"temperature": 0})
                assert r2.stop_reason == "stop_sequence" and r2.stop_sequence == stop
                assert stop not in r2.content[0].text and text.startswith(r2.content[0].text)
            # errors: Anthropic's shape, the server goes on
            with pytest.raises(anthropic.BadRequestError) as e:
                await client.messages.create(model=g.core.model_name, max_tokens=0, messages=MSGS)
            assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
            with pytest.raises(anthropic.NotFoundError) as e:
                await client.messages.create(model="claude-nope", max_tokens=4, messages=MSGS)
            assert e.value.body["error"]["type"] == "not_found_error"
            for bad in ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                        {"messages": MSGS, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}},
                        {"messages": MSGS, "extra_body": {"temperature": 1.5}},
                        {"messages": [{"role": "system", "content": "x"}]}):
                with pytest.raises(anthropic.BadRequestError):
                    await client.messages.create(model=g.core.model_name, max_tokens=4, **bad)
            r = await client.messages.create(model=g.core.model_name, max_tokens=3, messages=MSGS)
            assert r.usage.output_tokens == 3
    run(scenario())


def test_tool_use_blocks_and_a_tool_result_turn(tiny_pair, source):
    async def scenario():
        async with scripted_stack(tiny_pair) as (script, g):
            client = anthropic.AsyncAnthropic(base_url=g.url, api_key="none", max_retries=0, timeout=30)
            msgs = [{"role": "user", "content": "Weather in Paris?"}]
            script.answer = XML_ANSWER
            # a server tool beside them (Claude Code may offer web search): not offered to the local model
            r = await client.messages.create(model="scripted", max_tokens=200, messages=msgs,
                                             tools=ANTHROPIC_TOOLS + [{"type": "web_search_20250305",
                                                                       "name": "web_search", "max_uses": 2}])
            assert r.stop_reason == "tool_use"
            assert [b.type for b in r.content] == ["text", "tool_use"]
            assert r.content[0].text == "Let me look that up.\n\n"
            call = r.content[1]
            assert call.name == "get_weather" and call.input == XML_ARGS and call.id.startswith("toolu_")
            async with client.messages.stream(model="scripted", max_tokens=200, messages=msgs,
                                              tools=ANTHROPIC_TOOLS) as stream:
                final = await stream.get_final_message()
            assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == XML_ARGS
            script.answer = JSON_ANSWER
            r = await client.messages.create(model="scripted", max_tokens=200, messages=msgs,
                                             tools=ANTHROPIC_TOOLS)
            assert [(b.type, b.name) for b in r.content] == [("tool_use", "search"), ("tool_use", "get_weather")]
            # the call and its result as the next turn's history
            script.answer = "It is sunny."
            history = msgs + [{"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                                {"type": "tool_use", "id": call.id,
                                                                 "name": call.name, "input": call.input}]},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                            "content": "sunny, 21 C"},
                                                           {"type": "text", "text": "And tomorrow?"}]}]
            r = await client.messages.create(model="scripted", max_tokens=50, messages=history,
                                             tools=ANTHROPIC_TOOLS)
            assert r.content[0].text == "It is sunny." and r.stop_reason == "end_turn"
            prompt = source.tokenizer.decode(script.requests[-1].prompt_ids)
            assert "sunny, 21 C" in prompt and "And tomorrow?" in prompt and "Checking." in prompt

    asyncio.run(asyncio.wait_for(scenario(), 120))
