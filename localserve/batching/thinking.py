"""Where one sequence is in its think block, counted in tokens, and the close it is owed (issue 45).

A reasoning model's answer is `<think>` ... `</think>` then the answer. The request says which
tokens open and close the block (protocol/requests.Thinking, tokenized by the API from the model's
own tags); this counts the tokens between them as the sequence appends them, for
Usage.reasoning_tokens, and says when a budget is spent: the sequence then appends the end tokens
in place of its next sample (Sequence.append), as if the model had written them, so the answer
follows in the same generation. Tags are matched as token ids, not text: the model writes its
own tag as the tokens it was trained on (one special token in Qwen3), and a text match would have
to wait on the detokenizer's held-back stop strings.

The block opens either before the answer (the prompt ended with `<think>`: `start` is empty) or
with the answer's very first tokens (`start`: Qwen3 writes `<think>` itself); an answer whose
first tokens are not `start` has no think block and nothing is counted.
"""

from __future__ import annotations

from typing import Literal

from ..protocol.requests import Thinking


class ThinkCounter:
    __slots__ = ("spec", "state", "tokens", "_seen")

    def __init__(self, spec: Thinking):
        self.spec = spec
        self.state: Literal["before", "think", "answer"] = "think" if not spec.start else "before"
        self.tokens = 0  # reasoning tokens so far: inside the block, its tags not counted
        self._seen: list[int] = []  # the answer's first tokens (before) or the block's last ones (think)

    @property
    def due(self) -> bool:
        """The budget is spent and the block still open: the next sample gives way to the close."""
        return self.state == "think" and self.spec.budget is not None and self.tokens >= self.spec.budget

    def close(self) -> list[int]:
        """The end tokens the sequence appends now; the block is over (they are not reasoning)."""
        self.state = "answer"
        self._seen = []
        return list(self.spec.end)

    def see(self, token: int) -> None:
        """One token the sequence appended (sampled, or forced by close())."""
        if self.state == "before":
            self._seen.append(token)
            start = self.spec.start
            if self._seen == start:
                self.state, self._seen = "think", []
            elif self._seen != start[: len(self._seen)]:
                self.state, self._seen = "answer", []
        elif self.state == "think":
            end = self.spec.end
            self.tokens += 1
            self._seen = (self._seen + [token])[-len(end):]
            if self._seen == end:  # the model closed the block itself: its tag is no reasoning
                self.tokens -= len(end)
                self.state, self._seen = "answer", []
