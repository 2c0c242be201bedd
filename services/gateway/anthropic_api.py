"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the same chat core: request
parsing into chat messages, tools and sampling, and response / SSE event shaping (pure functions; http.py serves).

Claude Code and other Anthropic clients point at a local model this way. A request becomes the chat the model's
template renders: `system` first, text blocks joined, `tool_use` blocks as the assistant's tool calls, `tool_result`
blocks as tool messages, `thinking` blocks as reasoning. The answer comes back as content blocks in the order the
model wrote them (thinking, text, tool_use); `thinking` absent or disabled renders the template without it.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from services.engine.errors import InvalidRequestError
from services.engine.sampling import SamplingParams

from .core import Outcome
from .errors import APIError, invalid
from .openai_api import MAX_STOP, opt_bool, opt_number, text_parts
from .toolcalls import ToolCall

log = logging.getLogger("specsplit.gateway")

# Anthropic's error types by HTTP status (docs.anthropic.com "Errors")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "api_error", 529: "overloaded_error"}


def error_body(err: APIError) -> dict:
    """An APIError in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _text(content: Any, where: str) -> str:
    return text_parts(content, where, "messages")


def to_chat_messages(body: dict) -> list[dict]:
    """The request's `system` and `messages` as the chat messages a template renders."""
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"messages[{i}] must be an object with role 'user' or 'assistant'", "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"messages[{i}].content must be a string or an array of content blocks", "messages")
        text, reasoning, calls = [], [], []
        for b in content:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "thinking" and m["role"] == "assistant":
                reasoning.append(str(b.get("thinking", "")))
            elif kind == "redacted_thinking" and m["role"] == "assistant":
                continue
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise invalid(f"messages[{i}]: a tool_use block needs a name and an input object", "messages")
                calls.append({"id": str(b.get("id", "")), "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif kind == "tool_result" and m["role"] == "user":
                if text:        # text before a result stays before it
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": _text(result, f"messages[{i}] tool_result") if result else ""})
            else:
                raise invalid(f"messages[{i}]: content block type {kind!r} is not supported here "
                              "(text, and on the assistant's side thinking and tool_use, on the user's tool_result)",
                              "messages")
        if m["role"] == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not any(o.get("role") == "tool" for o in out[-1:]):
            out.append({"role": "user", "content": "".join(text)})
    return out


def to_tools(body: dict) -> tuple[list[dict] | None, bool]:
    """Anthropic tools ({name, description, input_schema}) as OpenAI function tools, and whether the answer is
    searched for calls (tool_choice auto, the default; none: no). Forcing a call (any, tool) is a 400. Server tools
    (web_search_..., code_execution_...) run on Anthropic's servers: a local model cannot call them, so they are not
    offered to it (logged), as on the Responses API."""
    tools = body.get("tools")
    if tools is None:
        return None, False
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array", "tools")
    out, server = [], []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise invalid(f"tools[{i}] needs a name", "tools")
        if t.get("type") not in (None, "custom"):
            server.append(str(t["type"]))
            continue
        schema = t.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise invalid(f"tools[{i}].input_schema must be a JSON schema object", "tools")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                      "parameters": schema}})
    if server:
        log.info("messages: server tools %s are not offered to the local model", ", ".join(sorted(set(server))))
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind in (None, "auto"):
        return out or None, bool(out)
    if kind == "none":
        return out or None, False
    if kind in ("any", "tool"):
        raise invalid("tool_choice that forces a call ('any' or a named tool) is not supported: specsplit does not "
                      "constrain decoding; send 'auto' or 'none'", "tool_choice")
    raise invalid(f"'tool_choice' must be auto, none, any or tool, got {choice!r}", "tool_choice")


def thinking_kwargs(body: dict) -> dict:
    """The template's enable_thinking: on when `thinking` is enabled, else off (Anthropic's default)."""
    t = body.get("thinking")
    if t is None:
        return {"enable_thinking": False}
    if not isinstance(t, dict) or t.get("type") not in ("enabled", "disabled", "adaptive"):
        raise invalid("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}",
                      "thinking")
    return {"enable_thinking": t["type"] != "disabled"}


def sampling(body: dict) -> tuple[int, SamplingParams, frozenset[str], list[str], bool]:
    """(max_tokens, sampling, the fields set, stop sequences, stream) of a Messages request."""
    mt = body.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise invalid(f"'max_tokens' is required and must be an integer >= 1, got {mt!r}", "max_tokens")
    given = {name: v for name in ("temperature", "top_p") if (v := opt_number(body, name)) is not None}
    if "temperature" in given and not 0.0 <= given["temperature"] <= 1.0:
        raise invalid(f"'temperature' must be in [0, 1], got {given['temperature']}", "temperature")
    k = body.get("top_k")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise invalid(f"'top_k' must be an integer >= 0, got {k!r}", "top_k")
        given["top_k"] = k
    try:
        params = SamplingParams(**given).validate()
    except InvalidRequestError as e:
        raise invalid(str(e), e.param) from None
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("'stop_sequences' must be an array of strings", "stop_sequences")
    if len(stop) > MAX_STOP:
        raise invalid(f"'stop_sequences' takes at most {MAX_STOP} sequences here, got {len(stop)}", "stop_sequences")
    return mt, params, frozenset(given), [s for s in stop if s], opt_bool(body, "stream")


# ------------------------------------------------------------------------------------------------ shaping


def stop_reason(out: Outcome) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an outcome."""
    if out.finish_reason == "tool_calls":
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if out.stop_string:
        return "stop_sequence", out.stop_string
    return "end_turn", None


def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def message(mid: str, model: str, blocks: list[dict], out: Outcome) -> dict:
    reason, seq = stop_reason(out)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": out.prompt_tokens, "output_tokens": out.completion_tokens}}


class BlockAssembler:
    """An answer's Deltas as Anthropic content blocks in order: consecutive text (or thinking) joins one block, each
    tool call is a block of its own, and whitespace alone (the newlines between calls) opens no text block.
    add() returns the stream events it makes; blocks holds the whole answer."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._open: str | None = None          # the type of the last block while more of it may come
        self._space = ""                       # whitespace that would open a text block: held until text follows

    def add(self, reasoning: str, content: str, calls: list[ToolCall]) -> list[dict]:
        events: list[dict] = []
        if content and self._open != "text":
            if not content.strip():
                self._space += content
                content = ""
            else:
                content, self._space = self._space + content, ""
        for kind, text in (("thinking", reasoning), ("text", content)):
            if text:
                if self._open != kind:
                    events += self._close()
                    block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
                    self.blocks.append(block)
                    self._open = kind
                    events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                                   "content_block": dict(block)})
                self.blocks[-1][kind] += text
                events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                               "delta": {"type": f"{kind}_delta", kind: text}})
        for call in calls:
            self._space = ""
            events += self._close()
            block = tool_use_block(call)
            self.blocks.append(block)
            i = len(self.blocks) - 1
            events += [{"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}},
                       {"type": "content_block_delta", "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                       {"type": "content_block_stop", "index": i}]
        return events

    def finish(self) -> list[dict]:
        return self._close()

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]
