"""How an engine worker ended, in words a user and a log reader can use: the signal, the watchdog's
reason, and the last lines of its native log (what llama.cpp printed before it aborted)."""

from __future__ import annotations

import signal
from pathlib import Path

NATIVE_TAIL_LINES = 20


class HangReason(str):
    """The watchdog's reason for a kill. `first_step`: the engine had ended no step yet, so its limit
    knew none of its steps (a 7B model's first prompt chunk on a laptop CPU, where the native count
    of a step's progress is missing: a GPU step, an ONNX run): runtime/crashes.py restarts it as any
    crash but does not count it toward marking the model failed."""

    first_step: bool

    def __new__(cls, text: str, first_step: bool = False) -> "HangReason":
        reason = super().__new__(cls, text)
        reason.first_step = first_step
        return reason


def describe_exit(code: int | None) -> str:
    """How a worker ended, as a user reads it: the signal's name, or the exit status."""
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"{name}, killed for memory or by another program" if name == "SIGKILL" else name
    return f"exit status {code}"


def native_tail(path: Path | None, lines: int = NATIVE_TAIL_LINES) -> list[str]:
    """The last lines of a worker's stderr log (what llama.cpp printed before it aborted)."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def telling_line(tail: list[str]) -> str:
    """The line of a native log tail that says what went wrong (llama.cpp's `file:line:
    GGML_ASSERT(...) failed`, a C++ `terminate called after ...`), else its last line."""
    for line in reversed(tail):
        if any(mark in line for mark in ("GGML_ASSERT", "GGML_ABORT", "terminate called", "error", "failed")):
            return line.strip()
    return tail[-1].strip() if tail else ""


def tail_lines(tail: list[str]) -> str:
    return "; its last native log lines:\n    " + "\n    ".join(tail) if tail else ""
