"""Chat templates from GGUF metadata, rendered the way Hugging Face transformers renders them.

The template text comes from a downloaded file, so it is untrusted code: it runs in jinja2's
ImmutableSandboxedEnvironment (no attribute access to Python internals, no mutation of the
messages we pass). The globals and filters are the ones HF templates rely on: `raise_exception`
(templates use it to reject e.g. non-alternating roles -- a client error, so it becomes a 400),
`strftime_now` (Llama 3.x puts today's date in the system prompt) and a `tojson` that keeps
non-ASCII text and key order as `json.dumps` does (jinja's own `tojson` HTML-escapes `<` and `'`,
which changes the prompt the model was trained on).

Templates that know `tools` get them as HF passes them; for templates that do not, the tools are
described in a system message that asks for Hermes-style `<tool_call>` output, which tools.py
parses back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidRequestError

# ChatML: what SmolLM, Qwen and many fine-tunes use; the fallback for a GGUF without a template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOOL_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


class TemplateRaised(Exception):
    """`raise_exception(...)` inside a template."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks as transformers sets them: templates are written for those settings.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def _compile(source: str) -> tuple[jinja2.Template, frozenset[str]]:
    try:
        ast = _ENV.parse(source)
        template = _ENV.from_string(source)
    except jinja2.TemplateError as e:
        # A broken template in a model file; the client cannot fix it, but must learn why.
        raise InvalidRequestError(f"the model's chat template cannot be compiled: {e}", param="model") from None
    return template, frozenset(meta.find_undeclared_variables(ast))


@dataclass
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""
    is_fallback: bool = False

    @classmethod
    def for_model(cls, chat_template: str | None, bos_token: str | None, eos_token: str | None) -> "ChatTemplate":
        if chat_template and chat_template.strip():
            return cls(chat_template, bos_token or "", eos_token or "")
        return cls(CHATML_TEMPLATE, bos_token or "", eos_token or "", is_fallback=True)

    @property
    def supports_tools(self) -> bool:
        return "tools" in _compile(self.source)[1]

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for `messages`. Raises InvalidRequestError when the template refuses them."""
        template, _ = _compile(self.source)
        if tools and not self.supports_tools:
            messages = with_tool_system_prompt(messages, tools)
            tools = None
        context = dict(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )
        if tools:
            context["tools"] = tools
        try:
            return template.render(**context)
        except TemplateRaised as e:
            raise InvalidRequestError(f"the model's chat template rejected the messages: {e}", param="messages") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise InvalidRequestError(f"the model's chat template failed on these messages: {e}", param="messages") from None


def with_tool_system_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Describe the tools in the system message for templates that have no `tools` support."""
    listing = "\n".join(_tojson(t) for t in tools)
    text = TOOL_SYSTEM_PROMPT.format(tools=listing)
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
    else:
        out.insert(0, {"role": "system", "content": text})
    # Tool turns are shown as the template's roles know them: calls inside the assistant text,
    # results as user turns wrapped like Hermes does.
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(
                "<tool_call>\n" + _tojson({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                + "\n</tool_call>" for c in m.pop("tool_calls")
            )
            m["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
        elif m["role"] == "tool":
            m["role"] = "user"
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
    return out
