"""Process-wide llama.cpp setup: backend init once, and its log output routed to Python logging.

llama.cpp prints model-loading chatter and errors straight to stderr unless a log callback is
installed. A desktop daemon must keep the terminal (and a `localserve run` session) clean, so every
line goes to the "localserve.llama" logger instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import sys
import tempfile
import threading
from typing import Iterator

import llama_cpp

logger = logging.getLogger("localserve.llama")
# Without any handler configured, logging's last-resort handler would print warnings to stderr:
# exactly the terminal noise this module exists to prevent. Configured root handlers still get them.
logger.addHandler(logging.NullHandler())

# ggml.h of the pinned llama.cpp: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continues the
# previous line). llama-cpp-python's own _logger.py still has the older numbering; don't copy it.
# Its INFO lines are a load's ~150-line dump of metadata and buffers: debug for us, so the daemon's
# log (and a terminal's stderr) at its default info level keeps one line per load, not a page.
_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_CONT = 5
# What llama.cpp logs as warnings and errors when a decode stops because we asked it to
# (llamacpp_interrupt.py; GGML_STATUS_ABORTED is 1, and llama_decode returns 2): routine, so debug.
# A real compute failure has other status codes; the lost micro-batch's removal is only a detail.
_INTERRUPT_LINES = re.compile(
    r"failed with error 1$|compute status: 1$|failed to decode, ret = 2$|removing memory module entries")


class _LogRouter:
    """Joins llama.cpp's partial log fragments into lines and hands each to `logger`.

    Also remembers the last error line, so that an API that only returns NULL (grammar parsing,
    model loading) can tell the user *why*.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._level = logging.INFO
        self._partial: list[str] = []
        self.last_error = ""
        self.error_count = 0
        # Per-thread line collectors (captured_log): a load's lines come from the loading thread,
        # so two models loading at once each get only their own lines.
        self._captures: dict[int, list[list[str]]] = {}  # nested captures each get every line

    def __call__(self, level: int, text: bytes | None, _user_data: ctypes.c_void_p) -> None:
        # Runs on whatever thread llama.cpp logs from; an exception here would be printed by ctypes
        # to stderr (the thing we route away from), so never raise.
        try:
            chunk = (text or b"").decode("utf-8", errors="replace")
            with self._lock:
                if level != _CONT:
                    self._level = _LEVELS.get(level, logging.DEBUG)
                self._partial.append(chunk)
                if not chunk.endswith("\n"):
                    return
                line = "".join(self._partial).rstrip()
                self._partial.clear()
                log_level = self._level
                if log_level >= logging.WARNING and _INTERRUPT_LINES.search(line):
                    log_level = logging.DEBUG
                if line:
                    for capture in self._captures.get(threading.get_ident(), ()):
                        capture.append(line)
                if log_level >= logging.ERROR and line:
                    self.last_error = line
                    self.error_count += 1
            if line:
                logger.log(log_level, "%s", line)
        except Exception:  # noqa: BLE001 - see comment above
            pass


_router = _LogRouter()
# The C side keeps only a raw function pointer: if this object were garbage collected the process
# would segfault at the next log line (seen in the research smoke tests). Module scope keeps it alive.
_c_callback = llama_cpp.llama_log_callback(_router)
_init_lock = threading.Lock()
_initialised = False


def ensure_runtime() -> None:
    """llama_backend_init once per process, with logging routed first (loading logs a lot)."""
    global _initialised
    with _init_lock:
        if _initialised:
            return
        llama_cpp.llama_log_set(_c_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _initialised = True


def last_error_since(count: int) -> str:
    """The last llama.cpp error line logged after `error_count` was `count`, or ''."""
    return _router.last_error if _router.error_count > count else ""


def error_count() -> int:
    return _router.error_count


@contextlib.contextmanager
def captured_log() -> Iterator[list[str]]:
    """The llama.cpp log lines this thread emits meanwhile (they still reach the logger too).

    Some facts of a load exist only as log lines: how many layers went to the GPU and each
    device's buffer sizes (llamacpp_offload.py reads them)."""
    lines: list[str] = []
    key = threading.get_ident()
    with _router._lock:
        _router._captures.setdefault(key, []).append(lines)
    try:
        yield lines
    finally:
        with _router._lock:
            active = _router._captures[key]
            del active[next(i for i, c in enumerate(active) if c is lines)]  # by identity: equal lists abound
            if not active:
                del _router._captures[key]


_stderr_lock = threading.Lock()


@contextlib.contextmanager
def native_stderr_captured() -> Iterator[list[str]]:
    """Collect what native code writes straight to fd 2 meanwhile; the text is in the list after.

    Some llama.cpp code bypasses the log callback: the grammar parser fprintf's its parse errors
    (and the whole grammar) to stderr. Capturing them keeps the terminal clean and lets us tell
    the user what is wrong with their grammar.
    """
    box: list[str] = []
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box.append(tmp.read().decode("utf-8", errors="replace"))
