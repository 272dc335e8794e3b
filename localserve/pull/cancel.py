"""Stopping a pull from another thread (the HTTP client of /api/pull went away, the daemon stops).

A flag alone is not enough: a download blocked reading from a server that sends nothing would only
see it when the stall timeout fires. So the token also keeps the sockets of the pull's open
connections and shuts them down, which makes a blocked read return at once. The `.partial` file
keeps the bytes received, so a later pull resumes.
"""

from __future__ import annotations

import socket
import threading
import weakref

from ..errors import LocalserveError


class PullCancelled(LocalserveError):
    """Not a DownloadError on purpose: a cancelled pull must not fall through to the next source."""

    http_status = 499
    code = "pull_cancelled"

    def __init__(self) -> None:
        super().__init__("the pull was cancelled; pull again to resume")


class CancelToken:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._sockets: "weakref.WeakSet[socket.socket]" = weakref.WeakSet()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise PullCancelled()

    def wait(self, seconds: float) -> None:
        """Sleep (retry backoff), waking to raise PullCancelled as soon as the pull is cancelled."""
        if self._event.wait(seconds):
            raise PullCancelled()

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self.check()
            self._sockets.add(sock)

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed: nothing is blocked on it
