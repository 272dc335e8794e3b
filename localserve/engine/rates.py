"""An engine's recent figures as rates (tokens/s, prompt tokens/s, completions/s) over a sliding
window, for stats(), /metrics and the dashboard; shared by our engine (local.py) and
onnxruntime-genai's (oga/engine.py)."""

from __future__ import annotations

import collections
import time

RATE_WINDOW_S = 10.0  # tokens/s and completions/s are measured over this much recent time


class Rates:
    """Recent per-step figures -> rates, over a sliding time window (engine thread writes,
    any thread reads a consistent-enough snapshot)."""

    def __init__(self) -> None:
        self._steps: collections.deque[tuple[float, float, int, int]] = collections.deque()
        self._finishes: collections.deque[float] = collections.deque()

    def step(self, end: float, busy_s: float, decode_tokens: int, prompt_tokens: int) -> None:
        self._steps.append((end, busy_s, decode_tokens, prompt_tokens))
        while self._steps and self._steps[0][0] < end - RATE_WINDOW_S:
            self._steps.popleft()

    def finished(self, n: int) -> None:
        now = time.monotonic()
        self._finishes.extend([now] * n)
        while self._finishes and self._finishes[0] < now - RATE_WINDOW_S:
            self._finishes.popleft()

    def steps_since(self, since: float) -> list[tuple[float, float, int, int]]:
        """(end, busy seconds, decode rows, prompt rows) of the window's steps that ended after `since`."""
        return [s for s in self._steps.copy() if s[0] > since]

    def tokens_per_s(self, now: float | None = None) -> tuple[float, float]:
        """Decode and prompt tokens per busy second over the window before `now` (default: this
        moment). The window is cut at reading time too, not only when a step arrives: an engine
        that went idle after a load showed that load's rate for as long as it stayed idle."""
        since = (time.monotonic() if now is None else now) - RATE_WINDOW_S
        steps = [s for s in self._steps.copy() if s[0] >= since]
        busy = sum(s[1] for s in steps)
        if busy <= 0:
            return 0.0, 0.0
        return sum(s[2] for s in steps) / busy, sum(s[3] for s in steps) / busy

    def finishes_per_s(self) -> float:
        return len(self._finishes) / RATE_WINDOW_S
