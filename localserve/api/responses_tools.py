"""Responses API tools, in the chat path's shape.

What a Responses request's `tools` may hold, and what becomes of each kind here:
- `function` ({"type": "function", "name", "description", "parameters", "strict"}): a chat tool;
- `namespace` ({"type": "namespace", "name", "tools": [functions]}; Codex groups its sub-agent
  tools so): its functions become chat tools, and a call of one is answered as a `function_call`
  item naming the `namespace`, as OpenAI answers it;
- the hosted tools OpenAI runs on its side (`web_search`, `file_search`, `code_interpreter`,
  `image_generation`, `mcp`, `computer_use_preview`, ...): nothing runs them here, so the model is
  not offered them, and the request is answered without them. Codex sends `web_search` with every
  request (tests/fixtures/agents), so refusing it would refuse Codex;
- `custom` tools (free-text input under a grammar) and anything unknown: a 400 naming
  `tools[i].type`, since the client runs those and expects calls of a shape not built here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .validation import MAX_TOOLS, invalid, type_name

HOSTED = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
          "file_search", "code_interpreter", "image_generation", "mcp", "computer_use_preview", "computer_use",
          "local_shell", "tool_search")


@dataclass
class ResponsesTools:
    chat: list[dict[str, Any]] = field(default_factory=list)  # what the chat path offers the model
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> its namespace
    echo: list[dict[str, Any]] = field(default_factory=list)  # the served tools, as the response repeats them


def _function(tool: dict[str, Any], p: str) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise invalid(f"'{p}.name' must be a non-empty string", f"{p}.name")
    if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
        raise invalid(f"'{p}.parameters' must be an object", f"{p}.parameters")
    # The chat path's function entry, key for key, so the template renders the same tools.
    fn = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": fn}


def parse_tools(value: Any) -> ResponsesTools:
    if value is None:
        return ResponsesTools()
    if not isinstance(value, list):
        raise invalid("'tools' must be an array", "tools")
    if len(value) > MAX_TOOLS:
        raise invalid(f"'tools' has more than {MAX_TOOLS} tools", "tools")
    tools = ResponsesTools()
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else type_name(tool)
        if kind == "function":
            tools.chat.append(_function(tool, p))
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(inner, list):
                raise invalid(f"'{p}' must be {{\"type\": \"namespace\", \"name\", \"tools\": [...]}}", p)
            for j, fn in enumerate(inner):
                q = f"{p}.tools[{j}]"
                if not isinstance(fn, dict) or fn.get("type", "function") != "function":
                    raise invalid(f"'{q}.type': a namespace holds function tools", f"{q}.type")
                tools.chat.append(_function(fn, q))
                tools.namespaces.setdefault(fn["name"], tool["name"])
        elif kind in HOSTED:
            continue  # run by OpenAI, not here: the model is not offered it
        else:
            raise invalid(f"'{p}.type': function and namespace tools are served, and hosted ones left out "
                          f"(got {str(kind)[:40]!r})", f"{p}.type")
        tools.echo.append(tool)
        if len(tools.chat) > MAX_TOOLS:
            raise invalid(f"'tools' holds more than {MAX_TOOLS} functions", "tools")
    return tools


def chat_tool_choice(value: Any) -> Any:
    """Responses' tool_choice in the chat path's shape: the modes as they are, a named function
    {"type": "function", "name"} as {"type": "function", "function": {"name"}}."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise invalid("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}",
                  "tool_choice")
