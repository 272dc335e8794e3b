"""Responses API input items, read and turned into the chat path's messages.

A Responses `input` is a string or a list of items: messages (roles user, system, developer,
assistant; content a string or `input_text` / `output_text` parts), `function_call`s the model
made, the client's `function_call_output`s, and `item_reference`s to items of stored responses.
Each item is checked here with its own `input[i]` param and kept in one canonical shape with an
id (what is stored, listed by input_items, and continued by `previous_response_id`); a field is
bounded by what the model can see of it, since what is stored outlives the request (a
`namespace`, which no prompt shows, to MAX_NAMESPACE); a client's id is kept (agents send back the
ids we gave them), except that a repeated one within a request gets a fresh id, so that one
response's items have one id each;
`chat_messages` then turns a whole item list into the messages /v1/chat/completions would get for
the same conversation: consecutive function calls join the assistant message before them as its
`tool_calls`, an output becomes a `tool` message.
Reasoning items (Codex sends its earlier ones back) carry nothing the model here can use: they are
accepted and left out.
A user message's `input_image` parts (`image_url`: a data: URL or an https link) and `input_audio`
parts (`input_audio`: base64 `data` and a `format`, wav or mp3) are kept in its canonical content
between its text parts, stored with it, and become one MEDIA_MARKER each in the chat message's text
and an image or clip of the request's ImageParts (api/images.py).
"""

from __future__ import annotations

import uuid
from typing import Any

from .audio_checks import FORMATS as AUDIO_FORMATS
from .images import ImageParts
from .validation import MAX_MESSAGES, invalid, type_name

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
MEDIA_PARTS = ("input_image", "input_audio")
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_CALL_ID = 512
MAX_ITEM_ID = 256
MAX_NAMESPACE = 256  # a namespace tool's name (responses_tools.py): stored, never in a prompt


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(value: Any, param: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"'{param}' must be a string or an array of content parts", param)
    texts = []
    for j, part in enumerate(value):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else type_name(part)
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS:
            raise invalid(f"'{p}': only text content is supported here (got {str(kind)[:30]!r}); this server "
                          "reads no files, and images and audio only as input_image and input_audio parts of user messages", p)
        if not isinstance(part.get("text"), str):
            raise invalid(f"'{p}.text' must be a string", f"{p}.text")
        texts.append(part["text"])
    return "".join(texts)


def _image_part(part: dict[str, Any], param: str, role: str) -> dict[str, Any]:
    """An `input_image` part as stored: its URL (checked as an image in chat_messages)."""
    if role != "user":
        raise invalid(f"'{param}': images go in user messages (this is a {role} message)", param)
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        why = "images by file_id are not served (no Files API for images here)" if part.get("file_id") else \
            "it must be a data: URL or an https:// link"
        raise invalid(f"'{param}.image_url': {why}", f"{param}.image_url")
    kept = {"type": "input_image", "image_url": url}
    if isinstance(part.get("detail"), str):
        kept["detail"] = part["detail"]
    return kept


def _audio_part(part: dict[str, Any], param: str, role: str) -> dict[str, Any]:
    """An `input_audio` part as stored: its base64 data and format (decoded and checked as audio in
    chat_messages)."""
    if role != "user":
        raise invalid(f"'{param}': audio goes in user messages (this is a {role} message)", param)
    audio = part.get("input_audio")
    if not isinstance(audio, dict) or not isinstance(audio.get("data"), str) or audio.get("format") not in AUDIO_FORMATS:
        raise invalid(f"'{param}.input_audio' must be an object with 'data' (base64) and 'format' (\"wav\" or "
                      "\"mp3\")", f"{param}.input_audio")
    return {"type": "input_audio", "input_audio": {"data": audio["data"], "format": audio["format"]}}


def _message_content(value: Any, param: str, role: str) -> list[dict[str, Any]]:
    """A message's canonical content: its text as one part, or with images or audio its text runs
    and `input_image` / `input_audio` parts in their order."""
    kind = "output_text" if role == "assistant" else "input_text"
    if not isinstance(value, list) or not any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in value):
        part: dict[str, Any] = {"type": kind, "text": _text_of(value, param)}
        return [part | {"annotations": []} if role == "assistant" else part]
    out: list[dict[str, Any]] = []
    for j, part in enumerate(value):
        if isinstance(part, dict) and part.get("type") == "input_image":
            out.append(_image_part(part, f"{param}[{j}]", role))
        elif isinstance(part, dict) and part.get("type") == "input_audio":
            out.append(_audio_part(part, f"{param}[{j}]", role))
        else:
            out.append({"type": kind, "text": _text_of([part], f"{param}[{j}]")})
    return out


def _string(item: dict[str, Any], key: str, param: str, max_len: int = 1 << 24) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise invalid(f"'{param}.{key}' must be a non-empty string of at most {max_len} characters", f"{param}.{key}")
    return value


def parse_input(value: Any, param: str = "input") -> list[dict[str, Any]]:
    """The request's input as canonical items (a string is one user message)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid(f"'{param}' must be a string or a non-empty array of items", param)
    if len(value) > MAX_MESSAGES:
        raise invalid(f"'{param}' has more than {MAX_MESSAGES} items", param)
    items: list[dict[str, Any]] = []
    ids: set[str] = set()
    for i, item in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{p}' must be an object", p)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise invalid(f"'{p}.role' must be one of {', '.join(MESSAGE_ROLES)}", f"{p}.role")
            items.append({"id": _own_id(item, "msg", ids), "type": "message", "role": role,
                          "content": _message_content(item.get("content"), f"{p}.content", role), "status": "completed"})
        elif kind == "function_call":
            if not isinstance(item.get("arguments"), str):
                raise invalid(f"'{p}.arguments' must be a string (the call's arguments as JSON)", f"{p}.arguments")
            call = {"id": _own_id(item, "fc", ids), "type": "function_call", "status": "completed",
                    "call_id": _string(item, "call_id", p, MAX_CALL_ID), "name": _string(item, "name", p, 256),
                    "arguments": item["arguments"]}
            namespace = item.get("namespace")
            if isinstance(namespace, str):  # a namespace tool's function (responses_tools.py)
                if len(namespace) > MAX_NAMESPACE:
                    raise invalid(f"'{p}.namespace' must be at most {MAX_NAMESPACE} characters", f"{p}.namespace")
                call["namespace"] = namespace
            items.append(call)
        elif kind == "function_call_output":
            items.append({"id": _own_id(item, "fco", ids), "type": "function_call_output", "status": "completed",
                          "call_id": _string(item, "call_id", p, MAX_CALL_ID),
                          "output": _text_of(item.get("output"), f"{p}.output")})
        elif kind == "item_reference":
            # An item of a stored response, by id: api/responses.py reads it before the answer.
            items.append({"type": "item_reference", "id": _string(item, "id", p, MAX_ITEM_ID), "_param": f"{p}.id"})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: nothing here can read it back
        else:
            raise invalid(f"'{p}.type' must be message, function_call, function_call_output, item_reference or "
                          f"reasoning (got {str(kind)[:40]!r})", f"{p}.type")
    if not items:
        raise invalid(f"'{param}' holds no message or function call output", param)
    return items


def _own_id(item: dict[str, Any], prefix: str, taken: set[str]) -> str:
    """The client's id for an item (Codex and the SDKs send ours back), or a new one."""
    given = item.get("id")
    chosen = given if isinstance(given, str) and 0 < len(given) <= MAX_ITEM_ID and given not in taken \
        else new_id(prefix)
    taken.add(chosen)
    return chosen


def _message_text(item: dict[str, Any], param: str | None, images: ImageParts) -> str:
    """`param`: the item's `input[i]`, None for a stored turn's (its images named previous_response_id)."""
    def text(j: int, part: dict[str, Any]) -> str:
        if part.get("type") == "input_image":
            return images.add_url(part["image_url"], f"{param}.content[{j}].image_url" if param else
                                  "previous_response_id")
        if part.get("type") == "input_audio":
            return images.add_audio(part["input_audio"], f"{param}.content[{j}].input_audio" if param else
                                    "previous_response_id")
        return str(part.get("text", ""))
    return "".join(text(j, part) for j, part in enumerate(item["content"]))


def chat_messages(instructions: str | None, items: list[dict[str, Any]], images: ImageParts | None = None,
                  own_from: int = 0) -> list[dict[str, Any]]:
    """The chat messages of a conversation of canonical items (input or output ones); an
    unresolved item_reference counts as an empty user turn (parse_responses checks the other
    fields with it before the store is read). Images go to `images`, named `input[i]...` from
    item `own_from` on (this request's own), `previous_response_id` before it (a stored turn's)."""
    images = images if images is not None else ImageParts()
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            param = f"input[{i - own_from}]" if i >= own_from else None
            messages.append({"role": item["role"], "content": _message_text(item, param, images)})
        elif kind == "function_call":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            function = {"name": item["name"], "arguments": item["arguments"]}
            last.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": function})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "item_reference":
            messages.append({"role": "user", "content": ""})
    return messages
