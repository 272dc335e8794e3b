"""Stopping a running llama_decode from another thread, without taking the GIL.

llama.cpp's CPU backend calls the context's abort callback on its first compute thread after every
graph node; when it returns true the graph stops, llama_decode drops the micro-batch it was on and
returns 2 (the backend drops the earlier calls of the step: LlamaCppBackend._rollback). That lets a
step of batch-lane work be long (big prompt chunks cost less per token) and still give way at once
to an interactive request that arrives during it.

The callback must be native code: a ctypes Python callback would take the GIL hundreds of times per
step on the compute thread, stalling the matmuls behind whatever the event loop is doing. What it
has to do is read one byte, and C already has that function: strlen on a two-byte buffer whose
second byte stays 0 returns 0 (go on) or 1 (stop), which is a valid `bool (*)(void *)` result.
GPU backends never call the callback: a decode there runs to its end, so a model with GPU layers
does not declare itself interruptible (LlamaCppBackend.set_offload).
"""

from __future__ import annotations

import ctypes
import sys

import llama_cpp


def _byte_reader() -> "llama_cpp.ggml_abort_callback | None":
    try:
        libc = ctypes.cdll.msvcrt if sys.platform == "win32" else ctypes.CDLL(None)
        address = ctypes.cast(libc.strlen, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return llama_cpp.ggml_abort_callback(address) if address else None


# Module scope: the C side keeps only the raw pointer, so this object must outlive every context.
_READ_BYTE = _byte_reader()


def available() -> bool:
    return _READ_BYTE is not None


class InterruptFlag:
    """One context's stop flag. set() from any thread; arm(True) before a decode that may stop,
    arm(False) before one that must not (its callback then reads a byte that is always 0)."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx
        self._flag = (ctypes.c_ubyte * 2)()
        self._never = (ctypes.c_ubyte * 2)()
        self._armed: bool | None = None
        self.arm(False)

    def arm(self, armed: bool) -> None:
        if _READ_BYTE is None or armed == self._armed:
            return
        target = self._flag if armed else self._never
        llama_cpp.llama_set_abort_callback(self._ctx, _READ_BYTE, ctypes.cast(target, ctypes.c_void_p))
        self._armed = armed

    def set(self) -> None:
        self._flag[0] = 1

    def clear(self) -> None:
        self._flag[0] = 0

    def is_set(self) -> bool:
        return bool(self._flag[0])
