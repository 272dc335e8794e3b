"""A reasoning model's thinking, told apart from its answer as the text streams.

Reasoning models (Qwen3, DeepSeek-R1 distills, QwQ) start their answer with `<think>...</think>`.
A dialect with a place for it (the Responses API's reasoning item, OpenAI chat's
`reasoning_content`, Ollama's `thinking`) shows it there and the answer without it. `ThinkSplit`
reads the text delta by delta and says which piece is which, holding back only what may still turn
out to be a tag (`<thi` at the start, `</thi` inside), so thinking streams as it comes; a whole
answer goes through the same object (`split_thinking`), so a streamed and a collected answer split
alike. An answer that does not start with `<think>` is all
answer, unchanged; a think block never closed (cut by max tokens) is all thinking. Templates that
open the block themselves (DeepSeek-R1 distills end the prompt with `<think>`) start it inside
(`inside=True`): the answer's text is thinking up to `</think>`.
"""

from __future__ import annotations

from typing import Literal

OPEN, CLOSE = "<think>", "</think>"
# OpenAI chat's `reasoning_format`, llama-server's field and values: "auto" (the default) and
# "deepseek" give the thinking apart in `reasoning_content`, "none" leaves it in the content.
REASONING_FORMATS = ("auto", "deepseek", "none")
Piece = tuple[Literal["reasoning", "text"], str]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplit:
    def __init__(self, inside: bool = False) -> None:
        self.state: Literal["start", "think", "after", "answer"] = "think" if inside else "start"
        self.held = ""
        self.thought = inside  # the answer is in a think block (began with <think>, or the prompt opened it)

    def feed(self, delta: str) -> list[Piece]:
        out: list[Piece] = []
        text = self.held + delta
        self.held = ""
        if self.state == "start":
            head = text.lstrip()
            if not head or (len(head) < len(OPEN) and OPEN.startswith(head)):
                self.held = text  # nothing yet, or maybe the tag
                return out
            if not head.startswith(OPEN):
                self.state = "answer"
                return [("text", text)]
            self.state, text, self.thought = "think", head[len(OPEN):], True
        if self.state == "think":
            end = text.find(CLOSE)
            if end < 0:
                keep = _partial_suffix(text, CLOSE)
                self.held = text[len(text) - keep:] if keep else ""
                thought = text[: len(text) - keep]
                return [("reasoning", thought)] if thought else []
            if end:
                out.append(("reasoning", text[:end]))
            self.state, text = "after", text[end + len(CLOSE):]
        if self.state == "after":
            text = text.lstrip()  # the blank lines between the thinking and the answer
            if not text:
                return out
            self.state = "answer"
        if text:
            out.append(("text", text))
        return out

    def finish(self) -> list[Piece]:
        """What was held back, at the end of the answer."""
        held, self.held = self.held, ""
        if not held:
            return []
        return [("reasoning", held)] if self.state == "think" else [("text", held)]


def split_thinking(text: str, inside: bool = False) -> tuple[str | None, str]:
    """(thinking, answer) of a whole answer; thinking None when it was not in a think block."""
    split = ThinkSplit(inside)
    pieces = split.feed(text) + split.finish()
    thinking = "".join(p for kind, p in pieces if kind == "reasoning")
    answer = "".join(p for kind, p in pieces if kind == "text")
    return (thinking if split.thought else None), answer


def _joined(pieces: list[Piece]) -> tuple[str, str]:
    return ("".join(p for kind, p in pieces if kind == "reasoning"),
            "".join(p for kind, p in pieces if kind == "text"))


class Thoughts:
    """(thinking, answer) of each delta, and of a whole answer alike; `inside`: the prompt opened
    the think block (None: the request keeps the text as the model wrote it, and every delta is
    answer)."""

    def __init__(self, inside: bool | None):
        self.inside = inside
        self._split = ThinkSplit(inside) if inside is not None else None

    def feed(self, text: str, last: bool = False) -> tuple[str, str]:
        """A delta's (thinking, answer); `last`: the answer's final delta, which also gives what
        was held back as a possible tag's start."""
        if self._split is None:
            return "", text
        return _joined(self._split.feed(text) + (self._split.finish() if last else []))

    def whole(self, text: str) -> tuple[str, str]:
        if self.inside is None:
            return "", text
        thinking, answer = split_thinking(text, self.inside)
        return thinking or "", answer
