"""Stopping a running llama_decode from another thread, without taking the GIL, and counting how
far it has got.

llama.cpp's CPU backend calls the context's abort callback on its first compute thread after every
graph node; when it returns true the graph stops, llama_decode drops the micro-batch it was on and
returns 2 (the backend drops the earlier calls of the step: LlamaCppBackend._rollback). That lets a
step of batch-lane work be long (big prompt chunks cost less per token) and still give way at once
to an interactive request that arrives during it.

The callback must be native code: a ctypes Python callback would take the GIL hundreds of times per
step on the compute thread, stalling the matmuls behind whatever the event loop is doing. C already
has the functions it needs. Where libc's semaphores behave as POSIX has them (glibc, musl; checked
once, below), it is sem_post on a semaphore of the context's own: an atomic increment returning 0
(go on), so the count of graph nodes computed moves while a step runs, and the engine worker's
heartbeat reads it (engine/worker/child.py): a long prefill on a slow machine is seen moving, where
the hang watchdog, which judged whole steps, killed it. Stopping is sem_post's other answer: on a
semaphore at SEM_VALUE_MAX it fails (-1, a true `bool`), so set() stores that value. Elsewhere
(macOS has no unnamed semaphores, Windows no sem_post) it is strlen on a two-byte buffer whose
second byte stays 0: it returns 0 (go on) or 1 (stop), and a step's progress shows when it ends.
GPU backends never call the callback: a decode there runs to its end, so a model with GPU layers
does not declare itself interruptible (LlamaCppBackend.set_offload), and counts nothing in a step.
"""

from __future__ import annotations

import ctypes
import sys

import llama_cpp

_SEM_VALUE_MAX = 2**31 - 1  # POSIX's minimum, glibc's and musl's value
_RESET_AT = 2**30  # a count this high starts again from 0 before the next decode, far from the max


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.cdll.msvcrt if sys.platform == "win32" else ctypes.CDLL(None)
    except OSError:
        return None


def _callback(function) -> "llama_cpp.ggml_abort_callback | None":
    address = ctypes.cast(function, ctypes.c_void_p).value
    return llama_cpp.ggml_abort_callback(address) if address else None


class _Byte:
    """strlen's target: the stop flag, and no count."""

    def __init__(self) -> None:
        self.buffer = (ctypes.c_ubyte * 2)()

    def stop(self) -> None:
        self.buffer[0] = 1

    def clear(self) -> None:
        self.buffer[0] = 0

    def stopped(self) -> bool:
        return bool(self.buffer[0])

    def count(self) -> int:
        return 0


class _Semaphore:
    """sem_post's target: its value counts the graph nodes computed, SEM_VALUE_MAX stops the graph.
    Its value is the first 32-bit word of the sem_t (glibc on little-endian, musl), which the check
    below confirms before any is used."""

    def __init__(self) -> None:
        self.buffer = (ctypes.c_uint64 * 8)()  # 64 bytes, 8-aligned: more than any sem_t here
        self._value = ctypes.c_int32.from_buffer(self.buffer)
        if _SEM_INIT(self.buffer, 0, 0) != 0:
            raise OSError("sem_init failed")

    def stop(self) -> None:
        self._value.value = _SEM_VALUE_MAX  # a store: sem_post's compare-and-swap then fails and rereads

    def clear(self) -> None:
        self._value.value = 0

    def stopped(self) -> bool:
        return self._value.value == _SEM_VALUE_MAX

    def count(self) -> int:
        value = self._value.value
        return 0 if value == _SEM_VALUE_MAX else value


def _counting() -> tuple["llama_cpp.ggml_abort_callback | None", object]:
    """sem_post as the callback, and sem_init, where they behave as the callback needs: post
    returns 0 and counts, a value stored as SEM_VALUE_MAX makes it return a true bool, a value
    stored as 0 counts again. (None, None) elsewhere."""
    libc = _libc()
    try:
        sem_init, sem_post = libc.sem_init, libc.sem_post
    except AttributeError:  # no libc (None), or one without them
        return None, None
    sem_init.argtypes, sem_init.restype = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint), ctypes.c_int
    sem_post.argtypes, sem_post.restype = (ctypes.c_void_p,), ctypes.c_int
    probe = (ctypes.c_uint64 * 8)()
    value = ctypes.c_int32.from_buffer(probe)
    if sem_init(probe, 0, 0) != 0 or sem_post(probe) & 0xFF or value.value != 1:
        return None, None
    value.value = _SEM_VALUE_MAX
    if not sem_post(probe) & 0xFF:  # the low byte is what a caller reads as the bool
        return None, None
    value.value = 0
    if sem_post(probe) & 0xFF or value.value != 1:
        return None, None
    return _callback(sem_post), sem_init


def _byte_reader() -> "llama_cpp.ggml_abort_callback | None":
    try:
        return _callback(_libc().strlen)
    except AttributeError:
        return None


# Module scope: the C side keeps only the raw pointers, so these objects must outlive every context.
_COUNT, _SEM_INIT = _counting()
_READ_BYTE = _byte_reader()


def available() -> bool:
    return _COUNT is not None or _READ_BYTE is not None


def counts() -> bool:
    """Whether decodes count their graph nodes here (compute_ticks moves inside a step)."""
    return _COUNT is not None


class InterruptFlag:
    """One context's stop flag, and its count of graph nodes computed. set() from any thread;
    arm(True) before a decode that may stop, arm(False) before one that must not (its callback then
    has a target that is never stopped)."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx
        kind, self._function = (_Semaphore, _COUNT) if _COUNT is not None else (_Byte, _READ_BYTE)
        self._flag, self._never = kind(), kind()
        self._armed: bool | None = None
        self.arm(False)

    def arm(self, armed: bool) -> None:
        """Before each decode (on the thread that decodes)."""
        for target in (self._flag, self._never):
            if target.count() > _RESET_AT:  # hours of nodes; nothing posts now, between decodes
                target.clear()
        if self._function is None or armed == self._armed:
            return
        target = self._flag if armed else self._never
        llama_cpp.llama_set_abort_callback(self._ctx, self._function, ctypes.cast(target.buffer, ctypes.c_void_p))
        self._armed = armed

    def set(self) -> None:
        self._flag.stop()

    def clear(self) -> None:
        self._flag.clear()

    def is_set(self) -> bool:
        return self._flag.stopped()

    def ticks(self) -> int:
        """Graph nodes computed (modulo a reset now and then: read it for change only); 0 where
        the callback cannot count."""
        return self._flag.count() + self._never.count()
