"""The Responses API's event stream for one generation, as plain dicts; no HTTP here.

The sequence OpenAI sends, each event with its `sequence_number`: `response.created` and
`response.in_progress` (the response object, no output yet); per output item
`response.output_item.added`, its content part (`response.content_part.added`), the text deltas
(`response.output_text.delta`, or `response.reasoning_text.delta` for a reasoning model's
thinking), `.done` events with the whole text, `response.content_part.done`,
`response.output_item.done`; per function call its item with the arguments as one
`response.function_call_arguments.delta` and `.done` (a call is known only once its text is whole);
then `response.completed`, or `response.incomplete` when max_output_tokens cut the answer. A
failure after the first event is an `error` event followed by `response.failed`, since no status
can change any more.

Text that may still be a tool call is held back (tools.ToolCallStream), thinking is told apart as
it streams (reasoning.ThinkSplit), so the items streamed are the ones `create_response` would
answer for the same generation.
"""

from __future__ import annotations

from typing import Any

from ..errors import LocalserveError
from ..protocol.engine import ModelEngine
from ..protocol.requests import GenerationEvent
from .errors import openai_exception_body
from .reasoning import ThinkSplit
from .responses import (
    Conversation,
    call_item,
    count_tokens,
    message_item,
    reasoning_item,
    response_object,
    status_of,
    usage_object,
)
from .tools import ToolCallStream

Event = dict[str, Any]


class ResponseEvents:
    def __init__(self, conv: Conversation, model: str, engine: ModelEngine | None):
        self.conv = conv
        self.model = model
        self.engine = engine
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items, the open one last
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.open_text = ""
        self.think = ThinkSplit(inside=conv.thinking_open)
        self.tools = ToolCallStream(conv.chat.tools) if conv.chat.tools else None
        self.reasoning_tokens = 0

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _response(self, status: str, **kw: Any) -> dict[str, Any]:
        return response_object(self.conv.call, self.model, status, list(self.output), **kw)

    def opening(self) -> list[Event]:
        response = self._response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def still_working(self) -> Event:
        """The keepalive of a silent stream (a long prefill): `response.in_progress` again, an
        event every client reads and none acts on."""
        return self._event("response.in_progress", response=self._response("in_progress"))

    # --- text ------------------------------------------------------------------------------
    def feed(self, event: GenerationEvent) -> list[Event]:
        """The events of one generation step's text (none while it may be a tag or a call)."""
        return self._pieces(self.think.feed(event.text)) if event.text else []

    def _pieces(self, pieces: list[tuple[str, str]]) -> list[Event]:
        out: list[Event] = []
        for kind, piece in pieces:
            if kind == "text" and self.tools is not None:
                piece = self.tools.feed(piece)
            if piece:
                out += self._delta(kind, piece)
        return out

    def _delta(self, kind: str, piece: str) -> list[Event]:
        out: list[Event] = []
        item_type = "reasoning" if kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != item_type:
            out += self._close("completed")
            out += self._open(item_type)
        self.open_text += piece
        name = "response.reasoning_text.delta" if item_type == "reasoning" else "response.output_text.delta"
        extra = {} if item_type == "reasoning" else {"logprobs": []}
        out.append(self._event(name, item_id=self.open["id"], output_index=len(self.output) - 1, content_index=0,
                               delta=piece, **extra))
        return out

    def _open(self, item_type: str) -> list[Event]:
        item = reasoning_item("") if item_type == "reasoning" else message_item("", "in_progress")
        item["status"] = "in_progress"
        part = dict(item["content"][0])
        item["content"] = []
        self.open, self.open_text = item, ""
        self.output.append(item)
        index = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=index, item=_copy(item)),
                self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part=part)]

    def _close(self, status: str) -> list[Event]:
        item = self.open
        if item is None:
            return []
        self.open = None
        index = len(self.output) - 1
        reasoning = item["type"] == "reasoning"
        part: dict[str, Any] = ({"type": "reasoning_text", "text": self.open_text} if reasoning else
                                {"type": "output_text", "text": self.open_text, "annotations": [], "logprobs": []})
        item["content"] = [part]
        item["status"] = status
        if reasoning:
            self.reasoning_tokens += count_tokens(self.engine, self.open_text)
        done = (self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=self.open_text) if reasoning else
                self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=self.open_text, logprobs=[]))
        return [done,
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    # --- the end ---------------------------------------------------------------------------
    def finish(self, event: GenerationEvent) -> tuple[list[Event], dict[str, Any]]:
        """The closing events of the finished generation, and the final response object."""
        status, incomplete = status_of(event.finish_reason)
        out = self._pieces(self.think.finish())
        calls = []
        if self.tools is not None:
            rest, calls = self.tools.finish()
            if rest:
                out += self._delta("text", rest)
            if not self.conv.call.parallel_tool_calls:
                calls = calls[:1]
        if not calls and not any(item["type"] == "message" for item in self.output):
            # An empty answer is still a message, as create_response answers it.
            if self.open is not None:
                out += self._close("completed")
            out += self._open("message")
        out += self._close(status)
        for call in calls:
            out += self._function_call(call_item(call, self.conv.call.tools))
        response = self._response(status, usage=usage_object(event.usage, self.reasoning_tokens),
                                  incomplete=incomplete)
        out.append(self._event("response.incomplete" if status == "incomplete" else "response.completed",
                               response=response))
        return out, response

    def _function_call(self, item: dict[str, Any]) -> list[Event]:
        index = len(self.output)
        self.output.append(item)
        added = {**item, "status": "in_progress", "arguments": ""}
        common = {"item_id": item["id"], "output_index": index}
        return [self._event("response.output_item.added", output_index=index, item=added),
                self._event("response.function_call_arguments.delta", **common, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **common, arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=dict(item))]

    def failure(self, exc: LocalserveError) -> list[Event]:
        """An `error` event and `response.failed`, for a failure after the stream began."""
        error = openai_exception_body(exc, f"stream of {self.conv.call.id}")["error"]
        return [self._event("error", code=error["code"], message=error["message"], param=error["param"]),
                self._event("response.failed", response=self._response(
                    "failed", error={"code": error["code"] or "server_error", "message": error["message"]}))]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(part) for part in item.get("content", [])]}

