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

The sandbox keeps a template from reaching Python's internals, not from running forever or
building a gigabyte string (`{% for i in range(10**5) %}{% for j in range(10**5) %}...`,
`{{ 'x' * 10**9 }}`). So templates render in worker threads (`render_async`), under a deadline and
an output-size limit (RENDER_TIME_LIMIT_S, MAX_RENDER_CHARS) that the template's own code checks:
every loop iterates through a checking iterator (the parse tree is rewritten so), and calls,
filters, `*`, `**`, `+`, `%` and `~` refuse results (or arguments asking for results) over the
size limit. A thread cannot be killed from outside; these checks are how a runaway render ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidRequestError, OverloadedError

# A real template renders in milliseconds; even 8 MB of messages take well under a second.
RENDER_TIME_LIMIT_S = 2.0
# Twice the default body limit: a prompt is the messages plus the template's framing, and anything
# near this is far beyond any model's context anyway.
MAX_RENDER_CHARS = 16 * 1024 * 1024
_MAX_INT_BITS = 1 << 16  # `**` results beyond this many bits are refused (10**19728 or so)
_RENDER_WORKERS = 4  # threads rendering at once, for all models together
_CHECK_EVERY = 256  # loop iterations between deadline checks (time.monotonic is not free)
_BIG_FORMAT_WIDTH = re.compile(r"\d{8,}")  # a width/precision in str.format asking for > MAX_RENDER_CHARS

# ChatML: what SmolLM, Qwen and many fine-tunes use; the fallback for a GGUF without a template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The fallback's turn markers as stop text. A model trained on ChatML has <|im_end|> as an
# end-of-generation token; one given ChatML only because its GGUF has no template (Gemma 3 270M
# base) writes the markers as plain text and, without these, runs to max_tokens (32,000 from Claude
# Code).
CHATML_STOPS = ("<|im_end|>", "<|im_start|>")

TOOL_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


# Chat templates that let a model reason before it answers (Qwen3, DeepSeek-R1 and their kin).
_THINKING_MARKS = ("<think>", "enable_thinking", "reasoning_content")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def is_reasoning_template(template: str) -> bool:
    return any(mark in template for mark in _THINKING_MARKS)


class TemplateRaised(Exception):
    """`raise_exception(...)` inside a template."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class RenderLimit(Exception):
    """A render ran past RENDER_TIME_LIMIT_S or built more than MAX_RENDER_CHARS."""


class _Deadline(threading.local):
    at: float = float("inf")  # per worker thread: each render sets its own


_DEADLINE = _Deadline()


def _check_time() -> None:
    if time.monotonic() > _DEADLINE.at:
        raise RenderLimit(f"took longer than {RENDER_TIME_LIMIT_S:g} s")


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_RENDER_CHARS:
        raise RenderLimit(f"built a value of more than {MAX_RENDER_CHARS} items")
    return value


def _check_args(args: Any) -> None:
    """Refuse an argument that asks for a huge result (`'x'.ljust(10**9)`, `center(10**9)`)
    before the result is allocated."""
    for arg in args:
        if isinstance(arg, int) and abs(arg) > MAX_RENDER_CHARS:
            raise RenderLimit(f"asked for a size over {MAX_RENDER_CHARS}")


def _bounded_iter(iterable: Any) -> Any:
    """Every `{% for %}` iterates through this (see _BoundedSandbox._parse): the one place a loop
    with no calls and no output in its body can be stopped."""
    for i, item in enumerate(iterable):
        if i % _CHECK_EVERY == 0:
            _check_time()
        yield item


def _bounded_filter(fn: Any) -> Any:
    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment markers
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_time()
        _check_args(args[1:])
        _check_args(kwargs.values())
        return _check_size(fn(*args, **kwargs))

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        # `a ~ b` compiles to a join the sandbox never sees; a template doubling a string with it
        # would reach gigabytes in 30 steps.
        self.write("environment.bounded(")
        super().visit_Concat(node, frame)
        self.write(")")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "_bounded_iter", [], [], None, None, lineno=loop.lineno)
        return tree

    @staticmethod
    def bounded(value: Any) -> Any:
        _check_time()
        return _check_size(value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        _check_time()
        _check_args(args)
        _check_args(kwargs.values())
        # The sandbox hands templates str.format wrapped (its own safe formatter); the format
        # string is the wrapped method's __self__.
        fmt = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(fmt, str) and getattr(__obj, "__name__", "") in ("format", "format_map") \
                and _BIG_FORMAT_WIDTH.search(fmt):
            raise RenderLimit(f"asked for a size over {MAX_RENDER_CHARS}")
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDER_CHARS:
                    raise RenderLimit(f"built a value of more than {MAX_RENDER_CHARS} items")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 \
                    and max(left.bit_length(), 1) * right > _MAX_INT_BITS:
                raise RenderLimit("computed a power too large")
        elif operator == "%":
            _check_args(right if isinstance(right, tuple) else (right,))
            if isinstance(left, str) and _BIG_FORMAT_WIDTH.search(left):
                raise RenderLimit(f"asked for a size over {MAX_RENDER_CHARS}")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > MAX_RENDER_CHARS:  # checked before the sum is built
                raise RenderLimit(f"built a value of more than {MAX_RENDER_CHARS} items")
        return _check_size(super().call_binop(context, operator, left, right))


def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks as transformers sets them: templates are written for those settings.
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(fn) for name, fn in env.filters.items()}
    env.filters["_bounded_iter"] = _bounded_iter
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_EXECUTOR = concurrent.futures.ThreadPoolExecutor(_RENDER_WORKERS, thread_name_prefix="chat-template")


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
    model: str = ""  # named in errors: a broken or hostile template is that model file's fault

    @property
    def _name(self) -> str:
        return f"the chat template of {self.model}" if self.model else "the model's chat template"

    @classmethod
    def for_model(cls, chat_template: str | None, bos_token: str | None, eos_token: str | None,
                  model: str = "") -> "ChatTemplate":
        if chat_template and chat_template.strip():
            return cls(chat_template, bos_token or "", eos_token or "", model=model)
        return cls(CHATML_TEMPLATE, bos_token or "", eos_token or "", is_fallback=True, model=model)

    @property
    def stops(self) -> list[str]:
        """Text that ends an answer besides the model's own end tokens: the fallback's markers."""
        return list(CHATML_STOPS) if self.is_fallback else []

    @property
    def supports_tools(self) -> bool:
        return "tools" in _compile(self.source)[1]

    async def render_async(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """`render` in a worker thread, so the event loop never runs template code. The render stops
        itself at its deadline; the wait here has a margin on top for a render stuck in one long
        C-level step, which is then left to finish in its thread."""
        future = _EXECUTOR.submit(self.render, messages, **kwargs)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), RENDER_TIME_LIMIT_S * 2)
        except asyncio.TimeoutError:
            if future.cancel():  # never started: every worker is busy with other renders
                raise OverloadedError("too many chat templates are rendering; retry shortly", retry_after=1.0) from None
            raise InvalidRequestError(
                f"{self._name} took longer than {RENDER_TIME_LIMIT_S:g} s to render", param="messages") from None

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for `messages`, within RENDER_TIME_LIMIT_S and MAX_RENDER_CHARS.
        Raises InvalidRequestError when the template refuses them or exceeds a limit."""
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
        _DEADLINE.at = time.monotonic() + RENDER_TIME_LIMIT_S
        try:
            return _bounded_output(template.generate(**context))
        except TemplateRaised as e:
            raise InvalidRequestError(f"{self._name} rejected the messages: {e}", param="messages") from None
        except RenderLimit as e:
            raise InvalidRequestError(f"{self._name} {e} rendering these messages", param="messages") from None
        except (RecursionError, MemoryError, OverflowError):
            raise InvalidRequestError(f"{self._name} exceeded the render limits on these messages",
                                      param="messages") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise InvalidRequestError(f"{self._name} failed on these messages: {e}", param="messages") from None
        finally:
            _DEADLINE.at = float("inf")


def _bounded_output(pieces: Any) -> str:
    """Join a render's output pieces, stopping once past the deadline or MAX_RENDER_CHARS (a loop
    that only prints is stopped here)."""
    out: list[str] = []
    total = 0
    for piece in pieces:
        total += len(piece)
        if total > MAX_RENDER_CHARS:
            raise RenderLimit(f"produced more than {MAX_RENDER_CHARS} characters")
        _check_time()
        out.append(piece)
    return "".join(out)


# Past this many characters of JSON, tools are listed compactly (compact_tool_listing). Open WebUI
# 0.12.4 sends its 36 built-in tools (24.8 KB) with every chat: as JSON they were a 7,013-token
# system prompt, 86% of SmolLM2's context, two minutes of prefill on a CPU before the first token.
FULL_LISTING_MAX_CHARS = 4096
_DESCRIPTION_CHARS = 100


def tool_listing(tools: list[dict[str, Any]]) -> str:
    """The tools as the fallback system prompt lists them: their JSON as given while that is small,
    else one line each (compact_tool_listing)."""
    full = "\n".join(_tojson(t) for t in tools)
    return full if len(full) <= FULL_LISTING_MAX_CHARS else compact_tool_listing(tools)


def compact_tool_listing(tools: list[dict[str, Any]]) -> str:
    """`name(arg: type, optional?: type) - first line of the description` per tool: what a model
    needs to pick a tool and fill its arguments, without the schemas' nested descriptions."""
    lines = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = set(params.get("required") or []) if isinstance(params.get("required"), list) else set()
        args = ", ".join(f"{name}{'' if name in required else '?'}: {_type_name(spec)}" for name, spec in props.items())
        description = _first_sentence(str(fn.get("description") or ""))
        lines.append(f"{fn['name']}({args})" + (f" - {description}" if description else ""))
    return "\n".join(lines)


def _first_sentence(text: str) -> str:
    line = text.strip().split("\n")[0]
    end = line.find(". ")
    return (line[: end + 1] if end >= 0 else line)[:_DESCRIPTION_CHARS]


def _type_name(spec: Any) -> str:
    kind = spec.get("type") if isinstance(spec, dict) else None
    if isinstance(kind, list):
        return "|".join(str(k) for k in kind)
    if kind == "array" and isinstance(spec.get("items"), dict):
        return f"{_type_name(spec['items'])}[]"
    if isinstance(spec, dict) and isinstance(spec.get("enum"), list):
        return "|".join(json.dumps(v) for v in spec["enum"][:8])
    return str(kind or "any")


def with_tool_system_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Describe the tools in the system message for templates that have no `tools` support."""
    text = TOOL_SYSTEM_PROMPT.format(tools=tool_listing(tools))
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
