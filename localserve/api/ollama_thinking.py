"""Ollama's `thinking` field: a reasoning model's thought apart from its answer, when asked.

Ollama answers a request that sets `think` (true or a level) with the model's thinking in
`message.thinking` (/api/chat) or `thinking` (/api/generate) and only the answer in `content` /
`response`; without `think` the text stays as the model wrote it, tags and all, as Ollama's older
releases gave it. The split is reasoning.ThinkSplit's, streamed and whole alike.
"""

from __future__ import annotations

from .reasoning import Piece, ThinkSplit, split_thinking


def _joined(pieces: list[Piece]) -> tuple[str, str]:
    return ("".join(p for kind, p in pieces if kind == "reasoning"),
            "".join(p for kind, p in pieces if kind == "text"))


class Thoughts:
    """(thinking, answer) of each delta; `inside`: the prompt opened the think block (None: the
    request did not ask for thinking apart, and every delta is answer)."""

    def __init__(self, inside: bool | None):
        self.inside = inside
        self._split = ThinkSplit(inside) if inside is not None else None

    def feed(self, text: str) -> tuple[str, str]:
        return _joined(self._split.feed(text)) if self._split is not None else ("", text)

    def finish(self) -> tuple[str, str]:
        return _joined(self._split.finish()) if self._split is not None else ("", "")

    def whole(self, text: str) -> tuple[str, str]:
        if self.inside is None:
            return "", text
        thinking, answer = split_thinking(text, self.inside)
        return thinking or "", answer
