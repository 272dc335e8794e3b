"""One Anthropic message built from engine events: its content blocks and its stream events.

`MessageStream` turns the events of one generation into Anthropic's stream (message_start, ping,
content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) /
content_block_stop per block, message_delta with stop_reason and usage, message_stop) and keeps
the content blocks it announced, so a non-streamed message is the same machine fed all at once:
the two answers cannot differ.

A reasoning model's `<think>...</think>` becomes a thinking block (shown only when the request
asked for thinking); tool calls are held back by api/tools.ToolCallStream and told as tool_use
blocks once the answer is complete (a call is known to be one only then).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..protocol.requests import GenerationEvent, Usage
from .anthropic_messages import tool_input
from .templates import THINK_CLOSE, THINK_OPEN
from .tools import ToolCallStream

Frame = tuple[str, dict[str, Any]]  # (event name, data)
PING: Frame = ("ping", {"type": "ping"})


def usage_body(usage: Usage | None, prompt_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage: input_tokens excludes what the prefix cache served (cache_read_input_tokens)."""
    prompt = usage.prompt_tokens if usage else prompt_tokens
    cached = usage.cached_tokens if usage else 0
    return {"input_tokens": prompt - cached, "output_tokens": usage.completion_tokens if usage else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _held(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkingSplitter:
    """Splits a reasoning model's text into ("thinking", ...) and ("text", ...) pieces at
    <think> / </think>, holding back a half-arrived tag."""

    def __init__(self, thinking: bool):
        self.thinking = thinking  # True when the prompt already opened <think>
        self.pending = ""
        self.answer_began = False  # the newlines between </think> and the answer are no answer

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.pending += delta
        pieces = []
        while True:
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            at = self.pending.find(tag)
            if at < 0:
                keep = _held(self.pending, tag)
                out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
                pieces.append(self._piece(out))
                break
            pieces.append(self._piece(self.pending[:at]))
            self.pending = self.pending[at + len(tag):]
            self.thinking = not self.thinking
        return [p for p in pieces if p[1]]

    def finish(self) -> list[tuple[str, str]]:
        rest, self.pending = self.pending, ""
        return [self._piece(rest)] if rest else []

    def _piece(self, text: str) -> tuple[str, str]:
        if self.thinking:
            return "thinking", text
        if not self.answer_began:
            text = text.lstrip("\n")
            self.answer_began = bool(text)
        return "text", text


class MessageStream:
    def __init__(self, message: dict[str, Any], *, tools: list[dict[str, Any]], reasoning: bool,
                 starts_thinking: bool, show_thinking: bool, stops: Sequence[str],
                 detokenize: Callable[[list[int]], str], prompt_tokens: int):
        self.message = message  # id, model, ... of message_start
        self.tools = ToolCallStream(tools) if tools else None
        self.splitter = ThinkingSplitter(starts_thinking) if reasoning else None
        self.show_thinking = show_thinking
        self.stops = list(stops)
        self.detokenize = detokenize
        self.prompt_tokens = prompt_tokens
        self.content: list[dict[str, Any]] = []
        self.open: str | None = None  # the kind of the block being streamed
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, int] = usage_body(None, prompt_tokens)

    def start(self) -> list[Frame]:
        message = {**self.message, "type": "message", "role": "assistant", "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": self.usage}
        return [("message_start", {"type": "message_start", "message": message}), PING]

    def feed(self, event: GenerationEvent) -> list[Frame]:
        """The frames of one event (its finish included)."""
        self.token_ids.extend(event.token_ids)
        frames = self._text(self.splitter.feed(event.text) if self.splitter else [("text", event.text)])
        if event.finish_reason is not None:
            frames += self._finish(event)
        return frames

    def final(self) -> dict[str, Any]:
        """The whole message (the non-streamed answer), after the last event was fed."""
        return {**self.message, "type": "message", "role": "assistant", "content": self.content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self.usage}

    def _text(self, pieces: list[tuple[str, str]]) -> list[Frame]:
        frames: list[Frame] = []
        for kind, text in pieces:
            if kind == "thinking":
                if self.show_thinking:
                    frames += self._delta("thinking", text)
                continue
            shown = self.tools.feed(text) if self.tools else text
            frames += self._delta("text", shown)
        return frames

    def _delta(self, kind: str, text: str) -> list[Frame]:
        if not text:
            return []
        frames = []
        if self.open != kind:
            frames += self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                else {"type": "text", "text": ""}
            self.content.append(dict(block))
            self.open = kind
            frames.append(("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                                    "content_block": block}))
        self.content[-1][kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        frames.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                "delta": delta}))
        return frames

    def _close(self) -> list[Frame]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})]

    def _finish(self, event: GenerationEvent) -> list[Frame]:
        frames = self._text(self.splitter.finish()) if self.splitter else []
        calls = []
        if self.tools:
            rest, calls = self.tools.finish()
            frames += self._delta("text", rest)
        frames += self._close()
        for call in calls:
            block = {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
                     "input": {}}
            index = len(self.content)
            self.content.append({**block, "input": tool_input(call.arguments)})
            frames += [("content_block_start", {"type": "content_block_start", "index": index, "content_block": block}),
                       ("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "input_json_delta", "partial_json": call.arguments}}),
                       ("content_block_stop", {"type": "content_block_stop", "index": index})]
        self.stop_reason, self.stop_sequence = self._stop_reason(event.finish_reason, bool(calls))
        self.usage = usage_body(event.usage, self.prompt_tokens)
        frames.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                                         "usage": self.usage}))
        frames.append(("message_stop", {"type": "message_stop"}))
        return frames

    def _stop_reason(self, reason: str | None, called: bool) -> tuple[str, str | None]:
        if called:
            return "tool_use", None
        if reason == "length":
            return "max_tokens", None
        matched = self._matched_stop()
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    def _matched_stop(self) -> str | None:
        """The stop sequence that ended the answer: the engine holds it back from the text, so it is
        the first one found in the text of the tokens generated (an engine that names no tokens, a
        remote one, tells none)."""
        if not self.stops or not self.token_ids:
            return None
        full = self.detokenize(self.token_ids)
        found = [(full.find(s), s) for s in self.stops if s in full]
        return min(found)[1] if found else None


