"""Tool calls in a model's answer -> OpenAI `tool_calls`: Qwen's `<tool_call>` blocks, JSON (Qwen3, Hermes) or XML
(Qwen3.5 / 3.6, Qwen3-Coder), found while the text streams, so a client never sees a call's markup as content.

A block's text is held back from the moment its opening tag could be starting; a block that does not parse stays
content (nothing the model wrote is dropped). XML parameter values are typed by the tool's JSON schema, as the
model was told it (a `string` stays text; numbers, booleans, objects and arrays are read as JSON).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import invalid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call, as OpenAI returns it: `arguments` is a JSON object's text."""

    index: int
    id: str
    name: str
    arguments: str

    def as_openai(self, with_index: bool = False) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, **out} if with_index else out


# ------------------------------------------------------------------------------------------ request fields


def check_tools(tools: Any) -> list[dict] | None:
    """The request's `tools` (OpenAI function tools), or a 400 naming what is wrong."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"tools[{i}].function.name must be a non-empty string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return tools or None


def check_tool_choice(choice: Any, tools: list[dict] | None) -> bool:
    """Whether the answer is searched for tool calls: `auto` (the default with tools) yes, `none` no. A choice that
    forces a call (`required`, a named function) would need constrained decoding, which specsplit does not do:
    a 400 rather than a call the model may not make."""
    if choice is None or choice == "auto":
        return tools is not None
    if choice == "none":
        return False
    if choice == "required" or isinstance(choice, dict):
        raise invalid("tool_choice that forces a call ('required' or a named function) is not supported: "
                      "specsplit does not constrain decoding; send 'auto' (the model may call a tool) or 'none'",
                      "tool_choice")
    raise invalid(f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {choice!r}", "tool_choice")


# ------------------------------------------------------------------------------------------------ parsing


def _schema_types(tools: list[dict]) -> dict[str, dict[str, str]]:
    """Per tool name, per parameter: its JSON schema type (the first non-null one of a list)."""
    out: dict[str, dict[str, str]] = {}
    for t in tools:
        fn = t["function"]
        props = ((fn.get("parameters") or {}).get("properties") or {})
        types = {}
        for name, schema in props.items() if isinstance(props, dict) else ():
            typ = schema.get("type") if isinstance(schema, dict) else None
            if isinstance(typ, list):
                typ = next((x for x in typ if x != "null"), None)
            types[name] = typ if isinstance(typ, str) else ""
        out[fn["name"]] = types
    return out


def _typed(value: str, typ: str | None) -> Any:
    """An XML parameter's text as its schema type says; text that is not of that type stays text."""
    if typ == "string":
        return value
    if typ == "integer":
        try:
            return int(value.strip())
        except ValueError:
            return value
    if typ == "number":
        try:
            f = float(value.strip())
        except ValueError:
            return value
        return int(f) if f.is_integer() and re.fullmatch(r"\s*-?\d+\s*", value) else f
    if typ == "boolean":
        low = value.strip().lower()
        return {"true": True, "false": False}.get(low, value)
    try:    # object, array, null, or a parameter the schema does not name: JSON when it is, else text
        return json.loads(value)
    except ValueError:
        return value


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Splits a stream of answer text into content and ToolCalls. push(text) and finish() return what became
    final, in order: strings (content) and ToolCall objects."""

    def __init__(self, tools: list[dict]):
        self._types = _schema_types(tools)
        self._buf = ""
        self._in_call = False
        self.calls = 0

    def push(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    if len(self._buf) > keep:
                        out.append(self._buf[:len(self._buf) - keep])
                        self._buf = self._buf[len(self._buf) - keep:]
                    return out
                if at:
                    out.append(self._buf[:at])
                self._buf, self._in_call = self._buf[at + len(OPEN):], True
            end = self._buf.find(CLOSE)
            if end < 0:
                return out
            out.append(self._call(self._buf[:end], closed=True))
            self._buf, self._in_call = self._buf[end + len(CLOSE):], False

    def finish(self) -> list[str | ToolCall]:
        """End of the answer: what is held back, an unclosed block parsed as a call if it is a whole one."""
        out: list[str | ToolCall] = []
        if self._in_call:
            out.append(self._call(self._buf, closed=False))
        elif self._buf:
            out.append(self._buf)
        self._buf, self._in_call = "", False
        return out

    def _call(self, body: str, closed: bool) -> str | ToolCall:
        parsed = self._parse(body.strip())
        if parsed is None:    # not a call after all: the text as the model wrote it
            return OPEN + body + (CLOSE if closed else "")
        name, args = parsed
        call = ToolCall(self.calls, _new_id(), name, json.dumps(args, ensure_ascii=False))
        self.calls += 1
        return call

    def _parse(self, body: str) -> tuple[str, dict] | None:
        if body.startswith("{"):          # {"name": ..., "arguments": {...}} (Qwen3, Hermes)
            try:
                obj = json.loads(body)
            except ValueError:
                return None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            return (obj["name"], args) if isinstance(args, dict) else None
        m = _FUNCTION.match(body)          # <function=NAME><parameter=ARG>VALUE</parameter>...</function>
        if m is None:
            return None
        name = m.group(1).strip()
        types = self._types.get(name, {})
        args = {}
        for p in _PARAMETER.finditer(m.group(2)):
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = p.group(1).strip()
            args[key] = _typed(value, types.get(key))
        return name, args


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the tag may be starting)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def arguments_as_objects(messages: list) -> list:
    """Chat history with each assistant tool call's `arguments` JSON text as an object, as chat templates read it
    (Qwen3.5 / 3.6 iterate over its items; transformers and vLLM hand templates objects too)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and any(isinstance(c, dict) and isinstance((c.get("function") or {}).get(
                "arguments"), str) for c in calls):
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call
