"""Renders a model's Jinja chat template into a prompt string, the way transformers' apply_chat_template does.

Templates come from model files, i.e. untrusted code: they run in Jinja's immutable sandbox.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.engine.errors import InvalidRequestError, ModelFormatError

# For models whose files carry no template: plain ChatML, reading string or OpenAI content-part lists.
CHATML_MESSAGES = (
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- elif message.content is iterable and message.content is not mapping %}"
    "{%- set ns = namespace(text='') %}"
    "{%- for part in message.content %}"
    "{%- if part is mapping and part.type == 'text' %}{%- set ns.text = ns.text + part.text %}{%- endif %}"
    "{%- endfor %}"
    "{%- set content = ns.text %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
)
DEFAULT_CHATML_TEMPLATE = CHATML_MESSAGES + (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Names clients use for a message's reasoning; transformers copies it to the ones templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}` marks assistant spans for training masks; here it only renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    # `dict` for templates without handing them the real type (no attribute escapes through it).
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore names on a namespace are a way into CPython internals; transformers refuses them too.
    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(str(message), param="messages")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _prepare_messages(messages: list[dict]) -> list[dict]:
    # Like transformers 5: drop None-valued keys (OpenAI clients send content=None, tool_calls=None, which
    # templates render as "None" or trip on) and copy reasoning under every name templates read.
    prepared = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param="messages")
        m = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        prepared.append(m)
    return prepared


class ChatTemplate:
    """A compiled chat template plus the bos/eos strings templates may reference."""

    def __init__(
        self, template: str, bos_token: str = "", eos_token: str = "", source: str = "<chat_template>"
    ):
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._compiled = _make_environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ModelFormatError(
                source, "a valid Jinja chat template", f"syntax error on line {e.lineno}: {e.message}"
            ) from None

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text; extra kwargs (enable_thinking, preserve_thinking, ...) reach the template."""
        if not isinstance(messages, list):
            raise InvalidRequestError("messages must be a list", param="messages")
        variables: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        variables.update(kwargs)
        variables.setdefault("documents", None)
        try:
            return self._compiled.render(
                messages=_prepare_messages(messages),
                tools=copy.deepcopy(tools),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except InvalidRequestError:
            raise
        except jinja2.TemplateError as e:
            raise InvalidRequestError(
                f"chat template failed on these messages: {e}", param="messages"
            ) from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError) as e:
            # Python errors inside template expressions (e.g. "a" + 1 on a malformed message).
            raise InvalidRequestError(
                f"chat template failed on these messages: {type(e).__name__}: {e}", param="messages"
            ) from None
