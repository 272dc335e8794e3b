"""Where constrained samplers are built: off the event loop, on threads with a large C stack.

Compiling a JSON schema to GBNF and parsing GBNF (llama_sampler_init_grammar) take from
milliseconds to a second for big legal grammars, too long for the event loop every client shares.
llama.cpp's parser also recurses once per nested group; schema_bounds keeps the nesting a few
thousand deep, which fits a default 8 MiB stack, but secondary threads get much smaller default
stacks on some systems (512 KiB on macOS), so these threads ask for STACK_BYTES explicitly
(address space only: pages are committed as they are touched). Measured with llama.cpp b0.3.36's
parser: ~400 bytes of stack per nested group, so MAX_GRAMMAR_DEPTH needs ~1 MiB; 8 MiB crashes
past ~20,000 levels, 512 KiB past ~1,200. 64 MiB leaves a wide margin.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

STACK_BYTES = 64 * 1024 * 1024
N_THREADS = 2  # one slow build must not hold up every other constrained request

_lock = threading.Lock()
_jobs: queue.SimpleQueue = queue.SimpleQueue()
_threads: list[threading.Thread] = []


def submit(fn: Callable[..., T], *args: object) -> concurrent.futures.Future:
    """Run fn(*args) on a big-stack sampler thread."""
    _start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    _jobs.put((fn, args, future))
    return future


def run(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) on a sampler thread, waiting for it (at once when already on one)."""
    if threading.current_thread() in _threads:
        return fn(*args)
    return submit(fn, *args).result()


def _start() -> None:
    with _lock:
        if _threads:
            return
        # stack_size applies to threads created after the call: set it just for ours.
        previous = threading.stack_size(STACK_BYTES)
        try:
            for i in range(N_THREADS):
                thread = threading.Thread(target=_work, name=f"sampler-build-{i}", daemon=True)
                thread.start()
                _threads.append(thread)
        finally:
            threading.stack_size(previous)


def _work() -> None:
    while True:
        fn, args, future = _jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(e)
