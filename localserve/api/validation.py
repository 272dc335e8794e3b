"""Typed, bounded reading of request bodies.

Every field a client sends is checked for type and range before it reaches the engine, and every
failure is an InvalidRequestError naming the offending `param`, so a client sees
`400 {"error": {"param": "temperature", ...}}` instead of a crash deep in the sampler. Python's
`bool` is an `int`; JSON `true` must never pass as `max_tokens=1`, so bools are refused where
numbers are expected. Sizes are bounded too (n, stop strings, logit_bias entries, tools, messages):
one request must not be able to make the server do unbounded work.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any, Iterable

from ..protocol.requests import LANES, Lane, SamplingParams
from ..errors import ContextLengthExceededError, InvalidRequestError
from ..backends.common.schema_bounds import check_schema

if TYPE_CHECKING:
    from .images import ImageParts

MAX_N = 8
MAX_STOP = 4
MAX_STOP_CHARS = 512
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
MAX_MESSAGES = 4096
MAX_PROMPTS = 16
MAX_EMBED_INPUTS = 2048
ROLES = ("system", "developer", "user", "assistant", "tool")

_MISSING = object()


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def invalid(message: str, param: str | None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


class Body:
    """A JSON object with typed getters; `prefix` names nested objects in error params."""

    def __init__(self, data: dict[str, Any], prefix: str = ""):
        self.data = data
        self.prefix = prefix

    def param(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        value = self.data.get(name, default)
        return default if value is None else value

    def error(self, name: str, problem: str) -> InvalidRequestError:
        """`'<param>' <problem>`, naming the field with its prefix."""
        return invalid(f"'{self.param(name)}' {problem}", self.param(name))

    def _typed(self, name: str, kind: type, label: str) -> Any:
        """The field's value (None when absent or null), refused when it is not a `kind`."""
        value = self.data.get(name)
        if value is not None and not isinstance(value, kind):
            raise self.error(name, f"must be {label}, not {type_name(value)}")
        return value

    def get_str(self, name: str, default: str | None = None, *,
                choices: Iterable[str] | None = None, max_len: int = 1 << 20) -> str | None:
        value = self._typed(name, str, "a string")
        if value is None:
            return default
        if len(value) > max_len:
            raise self.error(name, f"is longer than {max_len} characters")
        if choices is not None:
            options = tuple(choices)
            if value not in options:
                raise self.error(name, f"must be one of {', '.join(options)} (got {value!r:.40})")
        return value

    def get_bool(self, name: str, default: bool) -> bool:
        value = self._typed(name, bool, "a boolean")
        return default if value is None else value

    def get_int(self, name: str, default: int | None, *, lo: int, hi: int) -> int | None:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 16.0 from a JavaScript client is a fine 16
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"must be an integer, not {type_name(value)}")
        if not lo <= value <= hi:
            raise self.error(name, f"must be between {lo} and {hi} (got {value})")
        return value

    def get_float(self, name: str, default: float | None, *, lo: float, hi: float) -> float | None:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(name, f"must be a number, not {type_name(value)}")
        if not lo <= value <= hi:
            raise self.error(name, f"must be between {lo:g} and {hi:g} (got {value:g})")
        return float(value)

    def get_object(self, name: str) -> "Body | None":
        value = self._typed(name, dict, "an object")
        return None if value is None else Body(value, f"{self.param(name)}.")

    def get_list(self, name: str, *, max_items: int) -> list | None:
        value = self._typed(name, list, "an array")
        if value is not None and len(value) > max_items:
            raise self.error(name, f"has more than {max_items} items")
        return value


THREAD_PARSE_BYTES = 64 * 1024


def parse_stop(value: Any, param: str = "stop") -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid(f"'{param}' must be a string or an array of strings", param)
    if len(items) > MAX_STOP:
        raise invalid(f"'{param}' may hold at most {MAX_STOP} sequences", param)
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise invalid(f"'{param}' sequences must be at most {MAX_STOP_CHARS} characters", param)
    return [s for s in items if s]


def parse_lane(body: Body, header: str | None, default: Lane) -> Lane:
    """The body's `priority`, else the X-Priority `header` value (None: no header, or no HTTP
    request at all), else `default`."""
    value = body.data.get("priority")
    param = "priority"
    if value is None:
        value = header
        param = "X-Priority"
    if value is None:
        return default
    if value not in LANES:
        raise invalid(f"'{param}' must be one of {', '.join(LANES)} (got {str(value)[:40]!r})", param)
    return value  # type: ignore[return-value]


def parse_seed(body: Body, name: str = "seed") -> int | None:
    seed = body.get_int(name, None, lo=-(1 << 63), hi=(1 << 64) - 1)
    if seed is None or seed < 0:
        return None  # Ollama's seed -1 means "random"
    return seed & 0xFFFFFFFF  # llama.cpp seeds are uint32


def parse_logit_bias(value: Any, param: str = "logit_bias") -> dict[int, float]:
    """OpenAI's {"token id": bias} -> {int: float}, biases in OpenAI's -100..100 (-100: banned, -inf);
    whether the ids are in the vocabulary is SamplingParams.validate's to say."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be an object mapping token ids to biases", param)
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"'{param}' may hold at most {MAX_LOGIT_BIAS} entries", param)
    bias: dict[int, float] = {}
    for key, b in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise invalid(f"'{param}' keys must be token ids (got {str(key)[:20]!r})", param) from None
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise invalid(f"'{param}' biases must be numbers between -100 and 100", param)
        # OpenAI documents -100 as a ban. Added as a finite number, it loses to nothing when a
        # grammar leaves only banned tokens: the client would get exactly what it banned. As -inf,
        # that request ends in the sampler's "no token is allowed" 400 instead.
        bias[token] = -math.inf if b == -100 else float(b)
    return bias


def parse_json_format(value: Any, param: str) -> dict | None:
    """OpenAI `response_format` or Ollama `format` -> SamplingParams.json_schema ({} = any object),
    within schema_bounds (checked here too, so a refusal comes before any model load)."""
    schema = _json_format(value, param)
    if schema:
        check_schema(schema, param)
    return schema


def _json_format(value: Any, param: str) -> dict | None:
    if value is None or value == "":
        return None
    if value == "json":  # Ollama
        return {}
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be \"json\" or an object", param)
    kind = value.get("type")
    if param == "format":  # Ollama: the object is the schema itself
        return value
    if kind == "text":
        return None
    if kind == "json_object":
        return {}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid("'response_format.json_schema' must be an object with a 'schema' object",
                          "response_format.json_schema")
        return spec.get("schema") or {}
    raise invalid("'response_format.type' must be one of text, json_object, json_schema", "response_format.type")


def sampling_from(body: Body, *, n_vocab: int | None, seed: int | None, names: dict[str, str] | None = None,
                  **fields: Any) -> SamplingParams:
    """Validated SamplingParams from OpenAI-named fields (`names` maps our names to the body's, e.g.
    for Ollama's `repeat_last_n`) plus `fields` parsed elsewhere (logit_bias, json_schema, ...).
    The body's getters check types and the API's documented ranges; SamplingParams.validate then
    applies what every backend needs (top_p and repeat_penalty above 0, ...), so nothing that passes
    here fails in a backend after a model load. `n_vocab=None`: the model is not loaded yet (a
    fail-fast check before loading it). Unset fields keep SamplingParams' defaults (llama.cpp's, as llama-server does), which suit
    small local models better than OpenAI's 1.0/1.0."""
    names = names or {}
    d = SamplingParams()

    def key(ours: str) -> str:
        return names.get(ours, ours)

    sampling = SamplingParams(
        temperature=body.get_float(key("temperature"), d.temperature, lo=0.0, hi=2.0),
        top_k=body.get_int(key("top_k"), d.top_k, lo=0, hi=max(n_vocab or 1 << 20, 1)),
        top_p=body.get_float(key("top_p"), d.top_p, lo=0.0, hi=1.0),
        min_p=body.get_float(key("min_p"), d.min_p, lo=0.0, hi=1.0),
        seed=seed,
        repeat_penalty=body.get_float(key("repeat_penalty"), d.repeat_penalty, lo=0.0, hi=10.0),
        frequency_penalty=body.get_float(key("frequency_penalty"), d.frequency_penalty, lo=-2.0, hi=2.0),
        presence_penalty=body.get_float(key("presence_penalty"), d.presence_penalty, lo=-2.0, hi=2.0),
        penalty_last_n=body.get_int(key("penalty_last_n"), d.penalty_last_n, lo=-1, hi=1 << 20),
        **fields,
    )
    return sampling.validate(n_vocab, param=lambda ours: body.param(key(ours)))


def clamp_max_tokens(requested: int | None, prompt_tokens: int, n_ctx: int, param: str = "messages",
                     whose: str = "this model's context", default: int = 0) -> int:
    """Tokens the request may generate: what it asked for, or `default` (setting default_max_tokens)
    where it named no limit, cut to the context left after its prompt; no limit at all: that rest."""
    if prompt_tokens >= n_ctx:
        raise ContextLengthExceededError(
            f"{whose} is {n_ctx} tokens; the prompt has {prompt_tokens} tokens, which leaves no room "
            "to generate. Shorten the prompt or the message history.",
            param=param,
        )
    left = n_ctx - prompt_tokens
    asked = requested if requested is not None else default or None
    return left if asked is None else max(1, min(asked, left))


def parse_n(body: Body) -> int:
    return body.get_int("n", 1, lo=1, hi=MAX_N) or 1


def parse_content(value: Any, param: str, images: "ImageParts | None" = None) -> str:
    """Message content: a string, null, or OpenAI's array of parts: text parts, and with `images`
    image parts (`image_url`) and audio parts (`input_audio`), each one MEDIA_MARKER in the text
    where it stood (api/images.py)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else type_name(part)
            if kind == "image_url" and images is not None:
                texts.append(_image_url_part(part, f"{param}[{i}]", images))
                continue
            if kind == "input_audio" and images is not None:
                texts.append(images.add_audio(part.get("input_audio"), f"{param}[{i}].input_audio"))
                continue
            if kind not in ("text", "input_text"):
                raise invalid(f"'{param}[{i}]': only text{', image and audio' if images is not None else ''} content is "
                              f"supported (got {str(kind)[:30]!r})", f"{param}[{i}]")
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"'{param}[{i}].text' must be a string", f"{param}[{i}].text")
            texts.append(text)
        return "".join(texts)
    raise invalid(f"'{param}' must be a string or an array of content parts", param)


def _image_url_part(part: dict[str, Any], param: str, images: "ImageParts") -> str:
    """{"type": "image_url", "image_url": {"url": ..., "detail": ...}} (or the URL as a string,
    as some clients send it) -> the image's marker."""
    value = part.get("image_url")
    if isinstance(value, dict):
        return images.add_url(value.get("url"), f"{param}.image_url.url")
    return images.add_url(value, f"{param}.image_url")


def parse_tool_call_arguments(value: Any) -> Any:
    """Arguments arrive as a JSON string (OpenAI) or an object (Ollama); templates such as Qwen's
    apply `tojson` to them and expect the object, so a parseable string is decoded. Any other
    string is kept as it came: not JSON, or JSON Python will not hold (an integer past its
    4300-digit limit is a ValueError, nesting past the recursion limit a RecursionError)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return value
    return value if value is not None else {}


def parse_messages(value: Any, param: str = "messages", images: "ImageParts | None" = None) -> list[dict[str, Any]]:
    """Chat messages normalised for a template: role, content (string), and tool fields. With
    `images`, image parts and Ollama's `images` (base64, before the text, as Ollama places them)
    become markers in the content and images in `images`; without, they are refused."""
    if not isinstance(value, list) or not value:
        raise invalid(f"'{param}' must be a non-empty array of messages", param)
    if len(value) > MAX_MESSAGES:
        raise invalid(f"'{param}' has more than {MAX_MESSAGES} messages", param)
    out = []
    for i, message in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"'{p}' must be an object", p)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"'{p}.role' must be one of {', '.join(ROLES)}", f"{p}.role")
        markers = _ollama_images(message.get("images"), f"{p}.images", images)
        norm: dict[str, Any] = {
            # Templates know system, user, assistant and tool; "developer" is OpenAI's new name for system.
            "role": "system" if role == "developer" else role,
            "content": markers + parse_content(message.get("content"), f"{p}.content", images),
        }
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                norm[key] = message[key]
        calls = message.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise invalid(f"'{p}.tool_calls' must be an array", f"{p}.tool_calls")
            norm["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise invalid(f"'{p}.tool_calls[{j}].function.name' must be a string", f"{p}.tool_calls[{j}]")
                norm["tool_calls"].append({
                    "id": call.get("id") or f"call_{i}_{j}",
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": parse_tool_call_arguments(fn.get("arguments"))},
                })
        out.append(norm)
    return out


def _ollama_images(value: Any, param: str, images: "ImageParts | None") -> str:
    if not value:
        return ""
    if images is None:
        raise invalid(f"'{param}': this endpoint takes no images", param)
    if not isinstance(value, list):
        raise invalid(f"'{param}' must be an array of base64 images", param)
    return "".join(images.add_base64(item, f"{param}[{j}]") for j, item in enumerate(value))


def parse_tools(value: Any, param: str = "tools") -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(f"'{param}' must be an array", param)
    if len(value) > MAX_TOOLS:
        raise invalid(f"'{param}' has more than {MAX_TOOLS} tools", param)
    tools = []
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid(f"'{param}[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", f"{param}[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"'{param}[{i}].function.name' must be a non-empty string", f"{param}[{i}].function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise invalid(f"'{param}[{i}].function.parameters' must be an object", f"{param}[{i}].function.parameters")
        tools.append({"type": "function", "function": fn})
    return tools


def parse_tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | dict:
    """"none" | "auto" | "required" | the one named function's tool entry."""
    if value is None:
        return "auto"
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise invalid("'tool_choice' is \"required\" but no tools were given", "tool_choice")
        return value
    # {"type": "function", "function": {"name"}} as chat completions names one; {"type": "function",
    # "name"} as Responses does and ollama-ai-provider-v2 sends it to /api/chat.
    named = value.get("function") if isinstance(value, dict) else None
    if isinstance(value, dict) and (isinstance(named, dict) or (named is None and "name" in value)):
        name = (named or value).get("name")
        for tool in tools:
            if tool["function"]["name"] == name:
                return tool
        raise invalid(f"'tool_choice' names a function that is not in 'tools' ({str(name)[:40]!r})", "tool_choice")
    raise invalid("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", ...}", "tool_choice")


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_keep_alive(value: Any, param: str = "keep_alive") -> float | None:
    """Seconds a model stays loaded after this request: a number of seconds or a Go-style duration
    ("5m", "1h30m", "-1"); negative = forever, 0 = unload right away (Ollama's semantics)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise invalid(f"'{param}' must be a duration such as \"5m\" or a number of seconds", param)
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise invalid(f"'{param}' must be finite", param)
        return -1.0 if value < 0 else float(value)
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.lstrip("+-")
        try:
            seconds = float(text)
        except ValueError:
            pass
        else:  # "nan" and "inf" parse as floats too; refused as the numbers are
            if not math.isfinite(seconds):
                raise invalid(f"'{param}' must be finite", param)
            return -1.0 if sign < 0 else seconds
        pos, total = 0, 0.0
        for m in _DURATION_RE.finditer(text):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
            pos = m.end()
        if text and pos == len(text):
            if not math.isfinite(total):  # a run of digits past float's range
                raise invalid(f"'{param}' must be finite", param)
            return -1.0 if sign < 0 else total
    raise invalid(f"'{param}' must be a duration such as \"5m\" or a number of seconds", param)
