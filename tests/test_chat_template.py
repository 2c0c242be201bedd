"""ChatTemplate renders what transformers' apply_chat_template renders, and fails with clear errors."""

from __future__ import annotations

import json
import os

import pytest
import tokenizers
from tokenizers import AddedToken, models, pre_tokenizers

from services.engine.chat_template import DEFAULT_CHATML_TEMPLATE, ChatTemplate
from services.engine.errors import InvalidRequestError, ModelFormatError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Written for these tests after the structure of the Qwen3.5/3.6 template (reference §5.4): ChatML,
# the template opens <think> in the generation prompt, assistant history as <think>..</think>, reasoning of
# turns before the last real user query dropped unless preserve_thinking, XML tool calls, tool results
# in a user turn.
QWEN_STYLE_TEMPLATE = r"""
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type in ('image', 'image_url') -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- else -%}
                {{- raise_exception('Unexpected content part type: ' + part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is none or content is undefined -%}
        {{- '' -}}
    {%- else -%}
        {{- raise_exception('Unexpected content type') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>" }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + render_content(messages[0].content)|trim + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = render_content(message.content)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — «quoted» ünïcode",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello!"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are a helpful assistant.  "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple addition: 2+2=4."},
        {"role": "user", "content": "And 3+3? 你好 😀"},
    ],
    "think_in_content": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "new reasoning"},
    ],
    "tools_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ],
    "content_parts": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}],
        },
    ],
    "reasoning_alias": [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning": "via the 'reasoning' field"},
        {"role": "user", "content": "Q again"},
    ],
}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tmpl_tok")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, *pre_tokenizers.ByteLevel.alphabet()])}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": QWEN_STYLE_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _hf_render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, True, False])
def test_matches_transformers(hf_tokenizer, name, thinking):
    messages = CONVERSATIONS[name]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    tools = TOOLS if name.startswith("tools") else None
    ours = ChatTemplate(QWEN_STYLE_TEMPLATE, eos_token="<|im_end|>").render(messages, tools=tools, **kwargs)
    assert ours == _hf_render(hf_tokenizer, messages, tools=tools, **kwargs)


def test_expected_shapes():
    t = ChatTemplate(QWEN_STYLE_TEMPLATE, eos_token="<|im_end|>")
    msgs = CONVERSATIONS["system_multi_turn"]
    assert t.render(msgs).endswith(
        "<|im_start|>user\nAnd 3+3? 你好 😀<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert t.render(msgs, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not t.render(msgs, add_generation_prompt=False).endswith("<|im_start|>assistant\n<think>\n")
    # Reasoning before the last user query is dropped unless preserve_thinking is set.
    assert "Simple addition" not in t.render(msgs)
    assert "<think>\nSimple addition: 2+2=4.\n</think>\n\n4<|im_end|>" in t.render(
        msgs, preserve_thinking=True
    )
    tools_prompt = t.render(CONVERSATIONS["tools_round_trip"], tools=TOOLS)
    assert '"description": "Weather for a city — «quoted» ünïcode"' in tools_prompt  # tojson keeps non-ASCII
    assert "<parameter=city>\nParis\n</parameter>" in tools_prompt
    assert "<tool_response>\nsunny\n</tool_response><|im_end|>" in tools_prompt


def test_preserve_thinking_matches_transformers(hf_tokenizer):
    msgs = CONVERSATIONS["think_in_content"] + [{"role": "user", "content": "Q3"}]
    for preserve in (True, False):
        ours = ChatTemplate(QWEN_STYLE_TEMPLATE).render(msgs, preserve_thinking=preserve)
        assert ours == _hf_render(hf_tokenizer, msgs, preserve_thinking=preserve)


def test_raise_exception_is_invalid_request():
    t = ChatTemplate(QWEN_STYLE_TEMPLATE)
    with pytest.raises(InvalidRequestError, match="Unexpected message role: wizard") as info:
        t.render([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}])
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="System message must be at the beginning"):
        t.render([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}])
    with pytest.raises(InvalidRequestError, match="No messages"):
        t.render([])


def test_render_errors_become_invalid_request():
    t = ChatTemplate("{{ messages[0].content + 1 }}")
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        t.render([{"role": "user", "content": "text"}])
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{{ messages[0].content.__class__ }}{{ ''.__class__.__mro__ }}").render(
            [{"role": "user", "content": "x"}]
        )
    with pytest.raises(InvalidRequestError, match="must be an object"):
        ChatTemplate(DEFAULT_CHATML_TEMPLATE).render(["not a dict"])


def test_syntax_error_at_construction():
    with pytest.raises(ModelFormatError, match="syntax error on line 2") as info:
        ChatTemplate("ok\n{% for m in messages %}{{ m.content }", source="model.gguf")
    assert "model.gguf" in str(info.value)


def test_default_chatml():
    t = ChatTemplate(DEFAULT_CHATML_TEMPLATE)
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    assert t.render(msgs) == (
        "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nab<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"
    )
    assert t.render(msgs[:1], add_generation_prompt=False) == "<|im_start|>system\nsys<|im_end|>\n"


def test_globals_and_filters():
    t = ChatTemplate(
        "{{ bos_token }}{{ {'k': 'é', 'n': [1, 2]} | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}"
        "|{% for x in [1, 2, 3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}"
        "|{% set d = dict(a=1) %}{{ d.a }}|{{ eos_token }}|{{ tools is none }}"
        "|{% generation %}g{% endgeneration %}",
        bos_token="<s>",
        eos_token="</s>",
    )
    out = t.render([])
    assert out == '<s>{\n  "k": "é",\n  "n": [\n    1,\n    2\n  ]\n}|4|13|1|</s>|True|g'


def test_messages_not_mutated():
    msgs = [{"role": "user", "content": "hi", "name": None}]
    ChatTemplate(QWEN_STYLE_TEMPLATE).render(msgs)
    assert msgs == [{"role": "user", "content": "hi", "name": None}]
