"""Anthropic's request shapes turned into the chat shapes our templates render (no HTTP here).

`system` (a string or text blocks) and `messages` (content blocks: text, image, tool_use,
tool_result; thinking blocks of earlier turns are dropped, as reasoning templates drop old
reasoning) become
chat messages as api/validation.parse_messages takes them; `tools` (`input_schema`) and
`tool_choice` (auto, any, tool, none) become the function tools and choice of the chat path.

Claude Code's prompt cache (clients-and-anchors notes, section 3 item 8): it puts a per-request
`x-anthropic-billing-header: cc_version=...; cch=<hash>;` line at the head of the system prompt, and
a system-role message ("N tokens left") into `messages` after each tool result. The header line
is dropped, so two turns of one conversation share their whole prefix in our cache; the
in-conversation system messages stay where they are (joined to the tool result or user turn before
them), never hoisted into the top system prompt, where each turn's new one would change the
prefix of everything after the tools.

Image blocks (`base64` and `url` sources), in a user turn and inside a `tool_result`, where Claude
Code puts its screenshots, become one MEDIA_MARKER each in the text where they stood and an image
in the request's ImageParts (api/images.py), named by their own field (`...source.data`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .images import ImageParts
from .validation import MAX_MESSAGES, MAX_TOOLS, Body, invalid, type_name

# The line Claude Code prepends to its system prompt; its cch (and version suffix) change per request.
BILLING_HEADER = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n|\Z)", re.IGNORECASE)
ROLES = ("user", "assistant", "system")
MAX_BLOCKS = 4096  # content blocks of one message
NO_DOCUMENTS = "this server reads no documents (PDF or text files as blocks): send their text"


def drop_billing_header(text: str) -> str:
    return BILLING_HEADER.sub("", text, count=1)


def _text_of(block: Any, param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"'{param}.text' must be a string", f"{param}.text")
    return text


def _block(block: Any, param: str) -> tuple[str, dict[str, Any]]:
    """(type, block) of a content block; media a 400 naming the block's type field."""
    if isinstance(block, str):
        return "text", {"type": "text", "text": block}
    if not isinstance(block, dict):
        raise invalid(f"'{param}' must be a content block object, not {type_name(block)}", param)
    kind = block.get("type")
    if kind == "document":
        raise invalid(f"'{param}.type' is {kind!r}: {NO_DOCUMENTS}", f"{param}.type")
    if not isinstance(kind, str):
        raise invalid(f"'{param}.type' must be a string", f"{param}.type")
    return kind, block


def _blocks(content: Any, param: str) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(content, str):
        return [("text", {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise invalid(f"'{param}' must be a string or an array of content blocks", param)
    if len(content) > MAX_BLOCKS:
        raise invalid(f"'{param}' has more than {MAX_BLOCKS} blocks", param)
    return [_block(b, f"{param}[{j}]") for j, b in enumerate(content)]


def system_text(value: Any, param: str = "system") -> str:
    """The top system prompt: a string or text blocks, the billing header line dropped."""
    if value is None:
        return ""
    texts = []
    for kind, block in _blocks(value, param):
        if kind != "text":
            raise invalid(f"'{param}' blocks must be text blocks (got {kind[:30]!r})", param)
        texts.append(drop_billing_header(block["text"]))
    return "\n\n".join(t for t in texts if t)


def _image(block: dict[str, Any], param: str, images: ImageParts) -> str:
    """An image block's marker: {"source": {"type": "base64", "media_type", "data"}} or
    {"source": {"type": "url", "url"}}."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise invalid(f"'{param}.source' must be an object", f"{param}.source")
    kind = source.get("type")
    if kind == "base64":
        media_type = source.get("media_type")
        if not isinstance(media_type, str) or not media_type.lower().startswith("image/"):
            raise invalid(f"'{param}.source.media_type' must be an image type (image/png, image/jpeg, ...)",
                          f"{param}.source.media_type")
        return images.add_base64(source.get("data"), f"{param}.source.data")
    if kind == "url":
        return images.add_url(source.get("url"), f"{param}.source.url")
    raise invalid(f"'{param}.source.type' must be \"base64\" or \"url\" (got {str(kind)[:30]!r})",
                  f"{param}.source.type")


def _tool_result_text(block: dict[str, Any], param: str, images: ImageParts) -> str:
    content = block.get("content")
    if content is None:
        return ""
    texts = []
    for j, (kind, part) in enumerate(_blocks(content, f"{param}.content")):
        if kind == "image":
            texts.append(_image(part, f"{param}.content[{j}]", images))
            continue
        if kind != "text":
            raise invalid(f"'{param}.content[{j}].type' must be \"text\" or \"image\" (got {kind[:30]!r})",
                          f"{param}.content[{j}].type")
        texts.append(_text_of(part, f"{param}.content[{j}]"))
    return "\n".join(texts)


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    name, tool_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not name:
        raise invalid(f"'{param}.name' must be a non-empty string", f"{param}.name")
    if not isinstance(tool_id, str) or not tool_id:
        raise invalid(f"'{param}.id' must be a non-empty string", f"{param}.id")
    if not isinstance(args, dict):
        raise invalid(f"'{param}.input' must be an object", f"{param}.input")
    return {"id": tool_id, "type": "function", "function": {"name": name, "arguments": args}}


def _user_turn(blocks: list[tuple[str, dict[str, Any]]], param: str, tool_names: dict[str, str],
               images: ImageParts) -> list[dict]:
    """Tool results become tool messages (named after their call), the text one user message after them."""
    out: list[dict[str, Any]] = []
    texts = []
    for j, (kind, block) in enumerate(blocks):
        p = f"{param}[{j}]"
        if kind == "text":
            texts.append(_text_of(block, p))
        elif kind == "image":
            texts.append(_image(block, p, images))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"'{p}.tool_use_id' must be a non-empty string", f"{p}.tool_use_id")
            text = _tool_result_text(block, p, images)
            if block.get("is_error") is True:
                text = f"Error: {text}"
            message = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in tool_names:
                message["name"] = tool_names[call_id]
            out.append(message)
        else:
            raise invalid(f"'{p}.type' {kind[:30]!r} is not served in a user turn (text, image, tool_result)",
                          f"{p}.type")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(blocks: list[tuple[str, dict[str, Any]]], param: str, tool_names: dict[str, str]) -> dict:
    texts, calls = [], []
    for j, (kind, block) in enumerate(blocks):
        p = f"{param}[{j}]"
        if kind == "text":
            texts.append(_text_of(block, p))
        elif kind == "tool_use":
            call = _tool_use(block, p)
            tool_names[call["id"]] = call["function"]["name"]
            calls.append(call)
        elif kind not in ("thinking", "redacted_thinking"):
            raise invalid(f"'{p}.type' {kind[:30]!r} is not served in an assistant turn (text, tool_use, thinking)",
                          f"{p}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(system: Any, messages: Any, images: ImageParts | None = None) -> list[dict[str, Any]]:
    """Chat messages for the template: the system prompt first, then every turn in its place;
    the turns' images in `images` (a fresh ImageParts with default bounds when None)."""
    images = images if images is not None else ImageParts()
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array of messages", "messages")
    if len(messages) > MAX_MESSAGES:
        raise invalid(f"'messages' has more than {MAX_MESSAGES} messages", "messages")
    out: list[dict[str, Any]] = []
    top = system_text(system)
    if top:
        out.append({"role": "system", "content": top})
    tool_names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer them
    for i, message in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"'{p}' must be an object", p)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"'{p}.role' must be one of {', '.join(ROLES)}", f"{p}.role")
        blocks = _blocks(message.get("content"), f"{p}.content")
        if role == "user":
            out.extend(_user_turn(blocks, f"{p}.content", tool_names, images))
        elif role == "assistant":
            out.append(_assistant_turn(blocks, f"{p}.content", tool_names))
        else:
            _add_system_turn(out, system_text(message.get("content"), f"{p}.content"))
    return out


def _add_system_turn(out: list[dict[str, Any]], text: str) -> None:
    """A system message inside the conversation (Claude Code's "tokens left") stays where it is:
    joined to the user or tool turn before it (templates that want strict alternation accept
    that), or a system message of its own in that place."""
    if not text:
        return
    if out and out[-1]["role"] in ("user", "tool"):
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{text}" if out[-1]["content"] else text}
    else:
        out.append({"role": "system", "content": text})


def chat_tools(value: Any) -> list[dict[str, Any]]:
    """Anthropic tools -> function tools; server tools (web search, bash, ...) are not served."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("'tools' must be an array", "tools")
    if len(value) > MAX_TOOLS:
        raise invalid(f"'tools' has more than {MAX_TOOLS} tools", "tools")
    tools = []
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"'{p}' must be an object", p)
        if tool.get("type") not in (None, "custom"):
            raise invalid(f"'{p}.type' {str(tool.get('type'))[:40]!r}: only client tools (with an input_schema) "
                          "are served here", f"{p}.type")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise invalid(f"'{p}.name' must be a string of 1 to 128 characters", f"{p}.name")
        if not isinstance(schema, dict):
            raise invalid(f"'{p}.input_schema' must be an object (a JSON schema)", f"{p}.input_schema")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        tools.append({"type": "function", "function": fn})
    return tools


def chat_tool_choice(body: Body) -> str | dict[str, Any] | None:
    """auto / any / tool / none -> the chat path's auto / required / the named function / none."""
    choice = body.get_object("tool_choice")
    if choice is None:
        return None
    kind = choice.get_str("type", None, choices=("auto", "any", "tool", "none"))
    choice.get_bool("disable_parallel_tool_use", False)  # checked; calls come as the model makes them
    if kind == "tool":
        name = choice.get_str("name", None, max_len=128)
        if not name:
            raise invalid("'tool_choice.name' is required with type \"tool\"", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    if kind is None:
        raise invalid("'tool_choice.type' is required", "tool_choice.type")
    return {"any": "required"}.get(kind, kind)


def tool_input(arguments: str) -> dict[str, Any]:
    """A parsed call's arguments (JSON text) as the tool_use block's `input` object."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
