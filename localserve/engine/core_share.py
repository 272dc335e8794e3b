"""Our own engines share the cores: one engine's step never computes on threads another's holds.

The thread governor (threads.py) follows other processes' load, but it reads the machine a window
late and acts between steps only. Two models of ours decoding at once is the case that costs most:
the second model's first step starts while the first's step holds every core, and with libgomp's
default spin each thread then waits out its partner's whole time slice at every barrier; a step
that takes 0.1 s alone took over 4 s (tests/test_engine_workers.py's hang watchdog, 1 run in 5).
Our engines need not guess about each other: they keep a small record in shared memory, one slot
per engine (its process id, whether it has work, the threads its running step computes on), and
before a step each takes the smallest of
  - what the governor wants (what other processes leave),
  - its fair share (its threads divided among our engines that have work),
  - what the steps running now leave,
and when that is nothing, waits for one of them to end (a decode is tens of milliseconds, a prompt
chunk about a second), never longer than WAIT_LIMIT_S.

The daemon makes one share (`current()`) and hands it to every worker it starts, which installs it
(engine/worker/child.py); an engine in the daemon's own process takes a slot of the same share. A
worker that dies inside a step is forgotten by its pid (engine/worker/proxy.py), and a lock a dead
process held is waited on for LOCK_TIMEOUT_S only: after that a step goes on with what the governor
wants, as every step did before the share existed.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from multiprocessing.context import BaseContext

SLOTS = 16  # engines at once; one more runs unshared (governed still)
_PID, _BUSY, _THREADS = range(3)
WAIT_LIMIT_S = 5.0
LOCK_TIMEOUT_S = 0.05
POLL_S = 0.001


def worker_context() -> BaseContext:
    """The multiprocessing context engine workers start in (forkserver where there is one): a share
    handed to a worker must be made in it, since a lock made for fork cannot travel to a forkserver
    or spawned child."""
    if sys.platform == "win32" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("forkserver")


class CoreShare:
    """The shared record (see the module docstring). Picklable to a process being started."""

    def __init__(self, ctx: BaseContext | None = None) -> None:
        ctx = ctx or worker_context()
        self._lock = ctx.Lock()
        self._cells = ctx.Array("i", SLOTS * 3, lock=False)

    def join(self) -> "Seat | None":
        """A seat for an engine of this process, or None when every slot is taken."""
        if not self._lock.acquire(timeout=LOCK_TIMEOUT_S):
            return None
        try:
            for slot in range(SLOTS):
                if self._cells[slot * 3 + _PID] == 0:
                    self._set(slot, os.getpid(), 0, 0)
                    return Seat(self, slot)
            return None
        finally:
            self._lock.release()

    def _take(self, slot: int, want: int, limit: int) -> int:
        deadline = time.monotonic() + WAIT_LIMIT_S
        while True:
            if not self._lock.acquire(timeout=LOCK_TIMEOUT_S):
                return want  # a process died holding the lock: go on as if unshared
            try:
                self._cells[slot * 3 + _BUSY] = 1
                busy, held = self._others(slot)
                n = min(want, max(1, limit // (busy + 1)), limit - held)
                if n >= 1 or time.monotonic() >= deadline:
                    n = max(1, n)
                    self._cells[slot * 3 + _THREADS] = n
                    return n
            finally:
                self._lock.release()
            time.sleep(POLL_S)

    def _step_done(self, slot: int) -> None:
        self._cells[slot * 3 + _THREADS] = 0  # only this slot's engine writes it

    def _idle(self, slot: int) -> None:
        self._cells[slot * 3 + _THREADS] = 0
        self._cells[slot * 3 + _BUSY] = 0

    def forget(self, pid: int) -> None:
        """Free every slot of a process that ended (a worker that died inside a step holds threads)."""
        for slot in range(SLOTS):
            if self._cells[slot * 3 + _PID] == pid:
                self._set(slot, 0, 0, 0)

    def threads_in_use(self) -> int:
        """Threads of every step running now (for tests and the dashboard's curious)."""
        return sum(self._cells[slot * 3 + _THREADS] for slot in range(SLOTS))

    def _others(self, slot: int) -> tuple[int, int]:
        """Engines other than `slot` that have work, and the threads their running steps hold."""
        busy = held = 0
        cells = self._cells[:]  # one copy out of shared memory instead of 3 * SLOTS reads
        for other in range(SLOTS):
            if other != slot and cells[other * 3 + _PID]:
                busy += cells[other * 3 + _BUSY]
                held += cells[other * 3 + _THREADS]
        return busy, held

    def _set(self, slot: int, pid: int, busy: int, threads: int) -> None:
        base = slot * 3
        self._cells[base + _BUSY] = busy
        self._cells[base + _THREADS] = threads
        self._cells[base + _PID] = pid


class Seat:
    """One engine's slot in a CoreShare: what the engine's thread calls around its steps."""

    def __init__(self, share: CoreShare, slot: int) -> None:
        self.share, self.slot = share, slot

    def take(self, want: int, limit: int) -> int:
        """Threads for the next step, from 1 to `want`, for an engine that may use `limit`
        threads; marks the engine busy and holding them until `step_done`."""
        return self.share._take(self.slot, want, limit)

    def step_done(self) -> None:
        self.share._step_done(self.slot)

    def idle(self) -> None:
        """The engine has no work: it no longer counts in anyone's fair share."""
        self.share._idle(self.slot)

    def leave(self) -> None:
        self.share._set(self.slot, 0, 0, 0)


_current: CoreShare | None = None
_current_lock = threading.Lock()


def install(share: CoreShare) -> None:
    """Make `share` this process's (an engine worker, with the share of the daemon that started it)."""
    global _current
    _current = share


def current() -> CoreShare:
    """This process's share: the one installed, else one made now for the engines it will start."""
    global _current
    with _current_lock:
        if _current is None:
            _current = CoreShare()
        return _current
