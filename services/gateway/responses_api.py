"""OpenAI's Responses API (`POST /v1/responses`, what Codex CLI speaks) over the same chat core: request parsing into
chat messages, tools and sampling, and response / SSE event shaping (pure functions; http.py serves).

Nothing is stored: a request carries its whole conversation in `input` (Codex sends `store: false` and does), and a
`previous_response_id` is a 400. Input items become the chat the template renders (`instructions` and system or
developer messages first, `function_call` items as the assistant's tool calls, `function_call_output` items as tool
messages); the answer comes back as output items in the order the model wrote them: `reasoning`, `message`
(`output_text`), and a `function_call` per parsed `<tool_call>`.

Custom (freeform) tools, which Codex declares its `apply_patch` as, reach the model as function tools of one string
parameter `input` (their grammar quoted in the description), and a call of one comes back as a `custom_tool_call`
with that raw input; `custom_tool_call` / `custom_tool_call_output` items in `input` go back the same way. Hosted
tools (web_search, file_search, ...) run on OpenAI's servers: a local model cannot call them, so they are not offered
to it (logged), which is what llama.cpp's server does too.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from services.engine.errors import InvalidRequestError
from services.engine.sampling import SamplingParams

from .core import Outcome
from .errors import invalid
from .openai_api import opt_bool, opt_number, text_parts
from .toolcalls import ToolCall, check_tool_choice, check_tools

log = logging.getLogger("specsplit.gateway")

_UNHONOURED = {
    "previous_response_id": "stored responses (nothing is stored: send the whole conversation in input)",
    "conversation": "stored conversations",
    "background": "background responses",
    "prompt": "stored prompt templates",
}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def new_response_id() -> str:
    return _id("resp")


def _text(content: Any, where: str) -> str:
    return text_parts(content, where, "input", ("input_text", "output_text", "text"))


def to_chat_messages(body: dict) -> list[dict]:
    """`instructions` and `input` as the chat messages a template renders."""
    for name, what in _UNHONOURED.items():
        if body.get(name) not in (None, False, ""):
            raise invalid(f"'{name}': {what} is not supported by this server", name)
    out: list[dict] = []
    if body.get("instructions") is not None:
        out.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a string or a non-empty array of items", "input")
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise invalid(f"input[{i}] must be an object", "input")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(f"input[{i}].role must be user, assistant, system or developer", "input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(it.get("content", ""), f"input[{i}]")})
        elif kind in ("function_call", "custom_tool_call"):
            if not isinstance(it.get("name"), str):
                raise invalid(f"input[{i}]: a {kind} needs a name", "input")
            if kind == "custom_tool_call":      # a custom tool's raw input, as its function form's one parameter
                args = {CUSTOM_INPUT: str(it.get("input", ""))}
            else:
                if not isinstance(it.get("arguments", "{}"), str):
                    raise invalid(f"input[{i}]: a function_call's arguments must be JSON text", "input")
                try:
                    args = json.loads(it.get("arguments") or "{}")
                except ValueError:
                    raise invalid(f"input[{i}].arguments is not JSON", "input") from None
            call = {"id": str(it.get("call_id", "")), "type": "function",
                    "function": {"name": it["name"], "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":   # calls after the assistant's text join it
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = it.get("output", "")
            out.append({"role": "tool", "tool_call_id": str(it.get("call_id", "")),
                        "content": _text(output, f"input[{i}].output")})
        elif kind == "reasoning":
            continue          # earlier turns' reasoning: Qwen templates drop it before the last user turn anyway
        else:
            raise invalid(f"input[{i}]: item type {kind!r} is not supported (message, function_call, "
                          "function_call_output, reasoning)", "input")
    return out


CUSTOM_INPUT = "input"      # the one parameter a custom tool's function form takes


def custom_tool_names(body: dict) -> frozenset[str]:
    """The request's custom (freeform) tools: a call of one is answered as a custom_tool_call."""
    return frozenset(t["name"] for t in body.get("tools") or () if isinstance(t, dict) and t.get("type") == "custom"
                     and isinstance(t.get("name"), str))


def _custom_as_function(t: dict) -> dict:
    fmt = t.get("format") or {}
    grammar = fmt.get("definition") if isinstance(fmt, dict) and fmt.get("type") == "grammar" else None
    desc = (t.get("description") or "").strip()
    desc += ("\n\nPass the raw input as the string parameter `input`, not as JSON" +
             (f"; it follows this {fmt.get('syntax', '')} grammar:\n{grammar}" if grammar else "."))
    return {"name": t["name"], "description": desc.strip(),
            "parameters": {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
                           "required": [CUSTOM_INPUT]}}


def to_tools(body: dict) -> tuple[list[dict] | None, bool]:
    """Responses tools as chat function tools (function tools as they are, custom ones as one-string-parameter
    functions; hosted tools left out: see the module's doc), and whether the answer is searched for calls
    (tool_choice as on chat: auto or none; a forced call is a 400)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("'tools' must be an array", "tools")
    out, hosted = [], []
    for i, t in enumerate(tools or ()):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                         if k in t}})
        elif kind == "custom":
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise invalid(f"tools[{i}]: a custom tool needs a name", "tools")
            out.append({"type": "function", "function": _custom_as_function(t)})
        elif isinstance(kind, str):
            hosted.append(kind)
        else:
            raise invalid(f"tools[{i}] must be an object with a type", "tools")
    if hosted:
        log.info("responses: hosted tools %s are not offered to the local model", ", ".join(sorted(set(hosted))))
    if not out:
        check_tool_choice(body.get("tool_choice"), None)       # refuses a forced call, as with tools
        return None, False
    out = check_tools(out)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return out, check_tool_choice(choice, out)


def thinking_kwargs(body: dict) -> dict:
    """reasoning.effort none / minimal renders the template with thinking off, another effort on; no `reasoning`
    keeps the template's own default."""
    r = body.get("reasoning")
    if r is None:
        return {}
    if not isinstance(r, dict):
        raise invalid("'reasoning' must be an object", "reasoning")
    effort = r.get("effort")
    return {} if effort is None else {"enable_thinking": effort not in ("none", "minimal")}


def sampling(body: dict) -> tuple[int | None, SamplingParams, frozenset[str], bool]:
    """(max_output_tokens, sampling, the fields set, stream)."""
    mt = body.get("max_output_tokens")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        raise invalid(f"'max_output_tokens' must be an integer >= 1, got {mt!r}", "max_output_tokens")
    given = {name: v for name in ("temperature", "top_p") if (v := opt_number(body, name)) is not None}
    try:
        params = SamplingParams(**given).validate()
    except InvalidRequestError as e:
        raise invalid(str(e), e.param) from None
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise invalid("only text output is supported (text.format {\"type\": \"text\"})", "text")
    if body.get("top_logprobs") not in (None, 0):
        raise invalid("'top_logprobs' is not supported on /v1/responses (use /v1/chat/completions)", "top_logprobs")
    return mt, params, frozenset(given), opt_bool(body, "stream")


# ------------------------------------------------------------------------------------------------ shaping


def response(rid: str, created: int, model: str, body: dict, output: list[dict], out: Outcome | None,
             tools: list[dict] | None) -> dict:
    """The response object: in progress (out None, no output yet) or finished."""
    incomplete = out is not None and out.finish_reason == "length"
    usage = None
    if out is not None:
        usage = {"input_tokens": out.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                 "output_tokens": out.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": out.prompt_tokens + out.completion_tokens}
    return {"id": rid, "object": "response", "created_at": created, "model": model,
            "status": "in_progress" if out is None else ("incomplete" if incomplete else "completed"),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": [{"type": "function", **t["function"]} for t in tools or ()], "usage": usage,
            "metadata": body.get("metadata") or {}, "store": False, "text": {"format": {"type": "text"}}}


class OutputAssembler:
    """An answer's Deltas as Responses output items in order: consecutive reasoning, or text, is one item; each
    tool call an item of its own (a custom tool's as a custom_tool_call); whitespace alone opens no message. add()
    returns the stream events (without sequence numbers) it makes; items holds the whole answer."""

    def __init__(self, custom: frozenset[str] = frozenset()) -> None:
        self.custom = custom
        self.items: list[dict] = []
        self._open: str | None = None
        self._space = ""

    def add(self, reasoning: str, content: str, calls: list[ToolCall]) -> list[dict]:
        events: list[dict] = []
        if content and self._open != "message":
            if not content.strip():
                self._space += content
                content = ""
            else:
                content, self._space = self._space + content, ""
        if reasoning:
            events += self._start("reasoning")
            self.items[-1]["content"][0]["text"] += reasoning
            events.append({"type": "response.reasoning_text.delta", **self._where(), "content_index": 0,
                           "delta": reasoning})
        if content:
            events += self._start("message")
            self.items[-1]["content"][0]["text"] += content
            events.append({"type": "response.output_text.delta", **self._where(), "content_index": 0,
                           "delta": content, "logprobs": []})
        for call in calls:
            self._space = ""
            events += self._close()
            if call.name in self.custom:
                events += self._custom_call(call)
                continue
            item = {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.name,
                    "arguments": call.arguments, "status": "completed"}
            self.items.append(item)
            where = self._where()
            events += [{"type": "response.output_item.added", "output_index": where["output_index"],
                        "item": {**item, "arguments": "", "status": "in_progress"}},
                       {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments},
                       {"type": "response.function_call_arguments.done", **where, "arguments": call.arguments,
                        "name": call.name},
                       {"type": "response.output_item.done", "output_index": where["output_index"], "item": item}]
        return events

    def finish(self) -> list[dict]:
        return self._close()

    def _custom_call(self, call: ToolCall) -> list[dict]:
        args = json.loads(call.arguments)
        raw = args[CUSTOM_INPUT] if set(args) == {CUSTOM_INPUT} and isinstance(args[CUSTOM_INPUT], str) else \
            call.arguments      # not the one string parameter: the arguments as the model wrote them
        item = {"type": "custom_tool_call", "id": _id("ctc"), "call_id": call.id, "name": call.name, "input": raw,
                "status": "completed"}
        self.items.append(item)
        where = self._where()
        return [{"type": "response.output_item.added", "output_index": where["output_index"],
                 "item": {**item, "input": "", "status": "in_progress"}},
                {"type": "response.custom_tool_call_input.delta", **where, "delta": raw},
                {"type": "response.custom_tool_call_input.done", **where, "input": raw},
                {"type": "response.output_item.done", "output_index": where["output_index"], "item": item}]

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _start(self, kind: str) -> list[dict]:
        if self._open == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": []}]}
        self.items.append(item)
        self._open = kind
        where = self._where()
        events.append({"type": "response.output_item.added", "output_index": where["output_index"],
                       "item": {**item, "content": []}})
        if kind == "message":
            events.append({"type": "response.content_part.added", **where, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}})
        return events

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        item, where = self.items[-1], self._where()
        item["status"] = "completed"
        part = item["content"][0]
        if self._open == "reasoning":
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": part["text"]}]
        else:
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                       "logprobs": []},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}]
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": json.loads(json.dumps(item))})
        self._open = None
        return events


def now() -> int:
    return int(time.time())
