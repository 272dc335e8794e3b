"""Reading tool calls back out of a model's text.

Models trained for tools answer in one of a few shapes:
- Hermes / Qwen 2.5 / Qwen 3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one
  block per call, possibly after some text; the closing tag is sometimes missing when generation
  stopped on the end-of-turn token right after the JSON.
- plain JSON: the whole answer is `{"name": ..., "arguments": ...}` (Llama 3.x uses "parameters"),
  a list of those, or the same inside a ```json fence -- also what a grammar-forced
  `tool_choice` produces here.
A candidate only counts as a call when it names one of the request's tools: otherwise a model that
was asked for JSON data would see its answer turned into a phantom call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..backends.common.schema_bounds import check_schema
from .validation import invalid, parse_tool_choice

TOOL_CALL_OPEN = "<tool_call>"
_BLOCK_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out

    def ollama(self) -> dict[str, Any]:
        try:
            args = json.loads(self.arguments)
        except (ValueError, RecursionError):  # JSONDecodeError, or an integer past Python's 4300 digits
            args = {}
        return {"function": {"name": self.name, "arguments": args}}


def _as_call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def _calls_from_json(text: str, names: set[str]) -> list[ToolCall] | None:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, too deep, or an integer Python will not read
        return None
    if isinstance(data, dict) and isinstance(data.get("tool_calls"), list):
        data = data["tool_calls"]
    items = data if isinstance(data, list) else [data]
    calls = [_as_call(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """(content left over, calls). With no recognisable call, the text comes back unchanged."""
    names = {t["function"]["name"] for t in tools}
    if not names:
        return text, []
    if TOOL_CALL_OPEN in text:
        calls = []
        for block in _BLOCK_RE.findall(text):
            found = _calls_from_json(block, names)
            if found is None:
                return text, []  # a malformed block: show the model's text rather than guess
            calls.extend(found)
        content = text[: text.index(TOOL_CALL_OPEN)].strip()
        return content, calls
    stripped = text.strip()
    fenced = _FENCE_RE.match(stripped)
    if fenced:
        stripped = fenced.group(1)
    if stripped[:1] in ("{", "["):
        found = _calls_from_json(stripped, names)
        if found:
            return "", found
    return text, []


class ToolCallStream:
    """Streams content while keeping back whatever may still become a tool call.

    The text before a `<tool_call>` tag goes out as it arrives (a trailing `<tool` is held until
    the next delta shows what it is); an answer that starts like JSON is held entirely, since only
    its end tells whether it is a call. `finish()` parses the whole text and returns what was held
    back as content when it was not a call after all.
    """

    def __init__(self, tools: list[dict[str, Any]]):
        self.tools = tools
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.sent == 0:
            head = self.text.lstrip()
            if not head or head.startswith(("{", "[", "`")):
                return ""
        tag = self.text.find(TOOL_CALL_OPEN, self.sent)
        safe = tag if tag >= 0 else len(self.text) - _partial_tag_len(self.text)
        out = self.text[self.sent : max(self.sent, safe)]
        self.sent = max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls)."""
        _, calls = parse_tool_calls(self.text, self.tools)
        if not calls:
            return self.text[self.sent :], []
        tag = self.text.find(TOOL_CALL_OPEN)
        rest = self.text[self.sent : tag] if tag >= 0 else ""
        return (rest if rest.strip() else ""), calls


def _partial_tag_len(text: str) -> int:
    """Length of the longest end of `text` that is a beginning of the tag (`<`, `<tool`, ...)."""
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def forced_call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A JSON schema that admits only a call of one of `tools` (for tool_choice "required" or a
    named function): the grammar makes the model emit `{"name": ..., "arguments": {...}}`."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object"}
        options.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"],
        })
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_choice_plan(value: Any, tools: list[dict[str, Any]], json_schema: dict | None,
                     format_param: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(the tools the model may call, the tools one of which it must call, or None) for a body's
    `tool_choice`; a forced call is refused beside a JSON format (`format_param`), and its grammar is
    checked against the schema bounds before any model load."""
    choice = parse_tool_choice(value, tools)
    forced = tools if choice == "required" else [choice] if isinstance(choice, dict) else None
    if forced and json_schema is not None:
        raise invalid(f"'{format_param}' cannot be combined with a forced 'tool_choice'", format_param)
    if forced:
        check_schema(forced_call_schema(forced), "tools")
    return ([] if choice == "none" else tools), forced
