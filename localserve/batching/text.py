"""Token bytes -> text deltas that are safe to send: whole UTF-8 characters only, stop strings never.

Tokens are byte pieces: one emoji can span three tokens, and a stop string like "\\n\\nUser:" can
span four. Sending each token's bytes as text would put U+FFFD into the stream and leak half a stop
string to the client before we know it is one, so both are held back until they resolve.
"""

from __future__ import annotations

import codecs
from typing import Callable, Sequence


class StopMatcher:
    """Finds stop strings across deltas; holds back any tail that could still become one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped). After a stop, the stop string and everything
        after it are dropped."""
        if not self.stops:
            return text, False
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return buf[:cut], True
        hold = 0
        for stop in self.stops:
            # Longest suffix of buf that is a proper prefix of this stop string.
            for k in range(min(len(stop) - 1, len(buf)), hold, -1):
                if buf.endswith(stop[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """At a finish that is not a stop string, the held tail was ordinary text after all."""
        text, self._held = self._held, ""
        return text


class Detokenizer:
    """Incremental token -> text for one sequence, UTF-8 safe, stop strings withheld."""

    def __init__(self, token_bytes: Callable[[int], bytes], stops: Sequence[str] = ()):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopMatcher(stops)

    def add(self, token: int) -> tuple[str, bool]:
        """Returns (text delta, stopped)."""
        return self._stops.feed(self._utf8.decode(self._token_bytes(token)))

    def finish(self) -> str:
        """The rest at a non-stop finish: an incomplete character becomes U+FFFD, held text is released."""
        tail, stopped = self._stops.feed(self._utf8.decode(b"", final=True))
        return tail if stopped else tail + self._stops.flush()
