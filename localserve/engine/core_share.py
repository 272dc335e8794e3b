"""Our own engines share the cores: one engine's step never computes on threads another's holds.

The thread governor (threads.py) follows other processes' load, but it reads the machine a window
late and acts between steps only. Two models of ours decoding at once is the case that costs most:
the second model's first step starts while the first's step holds every core, and with libgomp's
default spin each thread then waits out its partner's whole time slice at every barrier; a step
that takes 0.1 s alone took over 4 s (tests/system/test_engine_workers.py's hang watchdog, 1 run in 5).
Our engines need not guess about each other: they keep a small record in shared memory, one slot
per engine (its process id, whether it has work, the threads its running step computes on, when
that step began, how long its steps take), and before a step each takes the smallest of
  - what the governor wants (what other processes leave),
  - its fair share (its threads divided among our engines that have work),
  - what the steps running now leave,
and when that is nothing, waits for one of them to end (a decode is tens of milliseconds, a prompt
chunk about a second).

No lock is taken around a step. A lock held by a process that dies (the OOM killer in the
microseconds it was held) is never released, and with one around every take each step of every
engine waited it out for the daemon's life. Each slot is written by its own engine only, and a
take is a claim: write the threads wanted as pending, read the others again, and commit (or, when
a step or a lower slot's claim took them meanwhile, withdraw and wait); a lower slot keeps its
claim against a higher one's, so two engines claiming at once never both compute on the same
threads. The one lock left guards `join` (claiming a free slot, once per model load), and a joiner
that finds it held LOCK_TIMEOUT_S by no live process releases it for the dead one.

A holder that does not move must not hold the others: an engine frozen inside a step (a native
hang, SIGSTOP, swapped out) never frees its threads, and a healthy model beside it made a step per
WAIT_LIMIT_S until the hang watchdog ended it, 30-300 s later. So a take that waits judges what it
waits for: a holder whose process is gone, a step that has run STALL_MULTIPLE times its engine's
median step (at least STALL_FLOOR_S), a claim pending past CLAIM_STALL_S, or anything still there
at WAIT_LIMIT_S, is stalled: the take goes on without it, and this engine's later takes do not
count that slot again until its step count moves. A frozen or dead holder so costs each other
engine one short wait, once.

The daemon makes one share (`current()`) and hands it to every worker it starts, which installs it
(engine/worker/child.py); an engine in the daemon's own process takes a slot of the same share. A
worker that dies is forgotten by its pid (engine/worker/proxy.py), which frees its slot.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.context import BaseContext

log = logging.getLogger(__name__)

SLOTS = 16  # engines at once; one more runs unshared (governed still)
# One slot's cells, each written by its engine only: its pid; 1 while it has work; the threads its
# running step holds; the threads it is claiming; its takes so far; when its step (or claim) began
# and its recent median step, in monotonic milliseconds (one clock for every process on a machine).
_PID, _BUSY, _THREADS, _CLAIM, _STEP, _START_MS, _TYPICAL_MS = range(7)
_FIELDS = 7
_HOLDER = SLOTS * _FIELDS  # the pid inside join() (the lock's holder), else 0
WAIT_LIMIT_S = 5.0
STALL_FLOOR_S = 1.0  # a step running this long is stalled when its engine's steps are short...
STALL_MULTIPLE = 10  # ... and when it has run this many times its engine's median step
CLAIM_STALL_S = 0.05  # a claim is two writes microseconds apart: pending longer, its engine froze
RECENT_STEPS = 9  # the steps an engine's median is taken over
LOCK_TIMEOUT_S = 0.05
POLL_S = 0.001

# Between a claim's write and the re-read of the others: a lock's atomic instruction is a fence, so
# this core's store is visible before it reads theirs (plain stores and loads may pass each other).
_FENCE = threading.Lock()


def worker_context() -> BaseContext:
    """The multiprocessing context engine workers start in (forkserver where there is one): a share
    handed to a worker must be made in it, since a lock made for fork cannot travel to a forkserver
    or spawned child."""
    if sys.platform == "win32" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("forkserver")


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


def _alive(pid: int) -> bool:
    import psutil  # only a take that waits asks (os.kill(pid, 0) would end the process on Windows)

    return psutil.pid_exists(pid)


class CoreShare:
    """The shared record (see the module docstring). Picklable to a process being started."""

    def __init__(self, ctx: BaseContext | None = None) -> None:
        ctx = ctx or worker_context()
        self._lock = ctx.Lock()  # join() only
        self._cells = ctx.Array("q", SLOTS * _FIELDS + 1, lock=False)

    def join(self) -> "Seat | None":
        """A seat for an engine of this process, or None when every slot is taken."""
        if not self._acquire():
            return None
        try:
            for slot in range(SLOTS):
                if self._cells[slot * _FIELDS + _PID] == 0:
                    self._clear(slot)
                    self._cells[slot * _FIELDS + _PID] = os.getpid()
                    return Seat(self, slot)
            return None
        finally:
            self._cells[_HOLDER] = 0
            self._lock.release()

    def _acquire(self) -> bool:
        if self._lock.acquire(timeout=LOCK_TIMEOUT_S):
            self._cells[_HOLDER] = os.getpid()
            return True
        holder = self._cells[_HOLDER]
        if holder and _alive(holder):
            return False  # a live joiner, frozen inside join: this engine runs unshared (governed still)
        # Held for microseconds by whoever holds it; after LOCK_TIMEOUT_S with no live holder (or
        # one killed before it could write its pid), it was left by a dead process: release it.
        log.warning("the core share's lock was left by a process that died (pid %s); released", holder or "unknown")
        try:
            self._lock.release()
        except ValueError:  # released meanwhile by another joiner that found it so
            pass
        if self._lock.acquire(timeout=LOCK_TIMEOUT_S):
            self._cells[_HOLDER] = os.getpid()
            return True
        return False

    def forget(self, pid: int) -> None:
        """Free every slot of a process that ended (a worker that died inside a step holds threads)."""
        for slot in range(SLOTS):
            if self._cells[slot * _FIELDS + _PID] == pid:
                self._clear(slot)
                self._cells[slot * _FIELDS + _PID] = 0

    def threads_in_use(self) -> int:
        """Threads of every step running now (for tests and the dashboard's curious)."""
        cells = self._cells[:]
        return sum(cells[slot * _FIELDS + _THREADS] for slot in range(SLOTS) if cells[slot * _FIELDS + _PID])

    def _clear(self, slot: int) -> None:
        base = slot * _FIELDS
        for field in range(1, _FIELDS):
            self._cells[base + field] = 0


@dataclass
class _Others:
    """What the other engines hold, as one take reads it (slots judged stalled left out)."""
    busy: int = 0  # engines with work
    held: int = 0  # threads of their running steps
    claimed_below: int = 0  # threads claimed, not yet committed, by lower slots
    claimed_above: int = 0  # ... by higher slots
    blockers: tuple[int, ...] = ()  # slots holding or claiming threads


class Seat:
    """One engine's slot in a CoreShare: what the engine's thread calls around its steps. Its
    records (`waits`, `stalled`) are this engine's own."""

    def __init__(self, share: CoreShare, slot: int) -> None:
        self.share, self.slot = share, slot
        self.waits = 0  # takes that had to wait for another engine's step (or claim)
        self.stalled: dict[int, tuple[int, int]] = {}  # slot -> (pid, step count) not counted now
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._started = 0.0

    def take(self, want: int, limit: int) -> int:
        """Threads for the next step, from 1 to `want`, for an engine that may use `limit`
        threads; marks the engine busy and holding them until `step_done`."""
        cells, me = self.share._cells, self.slot * _FIELDS
        cells[me + _STEP] += 1
        cells[me + _BUSY] = 1
        deadline = time.monotonic() + WAIT_LIMIT_S
        waited = False
        while True:
            n = self._claim(want, limit)
            if n:
                self._started = time.monotonic()
                return n
            if self._judge(deadline):
                continue  # what held us is stalled or gone: try again at once
            if not waited:
                waited = True
                self.waits += 1
            time.sleep(POLL_S)

    def step_done(self) -> None:
        cells, me = self.share._cells, self.slot * _FIELDS
        cells[me + _THREADS] = 0
        self._recent.append(time.monotonic() - self._started)
        cells[me + _TYPICAL_MS] = int(sorted(self._recent)[len(self._recent) // 2] * 1000)

    def idle(self) -> None:
        """The engine has no work: it no longer counts in anyone's fair share."""
        cells, me = self.share._cells, self.slot * _FIELDS
        cells[me + _THREADS] = 0
        cells[me + _BUSY] = 0

    def leave(self) -> None:
        self.share._clear(self.slot)
        self.share._cells[self.slot * _FIELDS + _PID] = 0

    def _claim(self, want: int, limit: int) -> int:
        """Claim threads for a step: their number, or 0 when the steps and claims of the others
        leave none (or took them while this one claimed)."""
        cells, me = self.share._cells, self.slot * _FIELDS
        others = self._others()
        n = min(want, max(1, limit // (others.busy + 1)),
                limit - others.held - others.claimed_below - others.claimed_above)
        if n < 1:
            return 0
        cells[me + _START_MS] = _now_ms()
        cells[me + _CLAIM] = n
        while True:
            with _FENCE:
                pass
            others = self._others()
            if others.held + others.claimed_below + n > limit:
                cells[me + _CLAIM] = 0  # a step or a lower slot's claim came first: it goes first
                return 0
            if others.held + others.claimed_below + others.claimed_above + n <= limit:
                cells[me + _START_MS] = _now_ms()
                cells[me + _THREADS] = n  # committed before the claim is withdrawn: never neither
                cells[me + _CLAIM] = 0
                return n
            # A higher slot claims too: it withdraws when it reads ours (or is judged stalled).
            self._judge(None)
            time.sleep(0)

    def _others(self, cells: list[int] | None = None) -> _Others:
        if cells is None:
            cells = self.share._cells[:]  # one copy out of shared memory instead of a read per cell
        out = _Others()
        blockers = []
        for other in range(SLOTS):
            base = other * _FIELDS
            pid = cells[base + _PID]
            if other == self.slot:
                continue
            record = self.stalled.get(other)
            if record is not None:
                if record == (pid, cells[base + _STEP]):
                    continue
                del self.stalled[other]  # it moved on, or the slot was freed: count it again
            if not pid:
                continue
            out.busy += cells[base + _BUSY]
            out.held += cells[base + _THREADS]
            if other < self.slot:
                out.claimed_below += cells[base + _CLAIM]
            else:
                out.claimed_above += cells[base + _CLAIM]
            if cells[base + _THREADS] or cells[base + _CLAIM]:
                blockers.append(other)
        out.blockers = tuple(blockers)
        return out

    def _judge(self, deadline: float | None) -> bool:
        """Mark the slots this take waits for that are stalled (see the module docstring); True
        when any was. `deadline`: past it, everything still in the way is."""
        cells = self.share._cells[:]
        now_ms, found = _now_ms(), False
        past = deadline is not None and time.monotonic() >= deadline
        for other in self._others(cells).blockers:
            base = other * _FIELDS
            pid, step = cells[base + _PID], cells[base + _STEP]
            age_s = (now_ms - cells[base + _START_MS]) / 1000
            if cells[base + _THREADS]:
                why = "its step has run %.1f s" if age_s > max(STALL_FLOOR_S, STALL_MULTIPLE * cells[
                    base + _TYPICAL_MS] / 1000) else None
            else:
                why = "its claim has been pending %.1f s" if age_s > CLAIM_STALL_S else None
            if why is None and past:
                why = "it has held threads for %.1f s"
            if why is None and not _alive(pid):
                why = "its process ended %.1f s into its step"
            if why is None:
                continue
            self.stalled[other] = (pid, step)
            found = True
            log.info("computing beside engine pid %d, stalled (%s): not waiting for it until it moves",
                     pid, why % age_s)
        return found


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
