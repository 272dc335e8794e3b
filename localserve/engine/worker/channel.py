"""The pipe between the daemon and one engine worker process: messages, and who may send them.

A message is a tuple whose first item names it; `multiprocessing.connection.Connection` frames each
one (a length prefix, then the pickle) over a local pipe: no port, nothing another user reaches.
Both ends are our own code at the same version, so pickle is safe here, and it carries the
protocol's dataclasses (GenerationRequest, GenerationEvent, EngineStats) and our errors as they are
(errors.LocalserveError rebuilds itself across it).

daemon -> worker                            worker -> daemon
  ("generate", call, GenerationRequest)       ("ready", ModelInfo, n_ctx_per_seq, backend name, pid, RSS before the load)
  ("cancel", request_id)                      ("load_failed", error)
  ("embed", call, inputs, lane)               ("reply", call, value) / ("fail", call, error)
  ("rank", call, inputs, lane)                ("reply", call, value) / ("fail", call, error)
  ("abandon", call)  (its caller left)        ("events", [(request_id, GenerationEvent), ...])
  ("call", call, method, args)                ("beat", progress, longest recent step in s)
                                              (progress: the engine's turns, its backend's count
                                              of graph nodes; sent while either moves)
  ("shutdown", timeout)                       ("log", level, logger name, message)
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import Any

# The worker's ModelEngine members the daemon calls and waits for (the rest have messages of their
# own): each is answered by a "reply" or a "fail".
CALLS = ("tokenize", "detokenize", "tokenize_media", "token_pieces", "stats", "live_sequences", "live_steps",
         "live_parked")


class Channel:
    """One end of the pipe. `send` is safe from any thread (the daemon sends from the event loop,
    from cancel() callers and from tokenize threads; the worker from its loop and its heartbeat);
    only one thread ever receives."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, *message: Any) -> bool:
        """False when the other end is gone (its reader learns why)."""
        try:
            with self._lock:
                self.conn.send(message)
            return True
        except (OSError, EOFError, ValueError):  # closed pipe, or closed by us meanwhile
            return False

    def close(self) -> None:
        with self._lock:
            self.conn.close()
