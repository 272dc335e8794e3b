"""How many threads llama.cpp computes a step with: the cores other processes leave free.

llama.cpp's CPU threads meet at an OpenMP barrier after every graph node, hundreds a step. When
another process takes one of the cores, one of our threads is descheduled for a whole time slice
while the other waits at the barrier for it, and a step costs several slices. Measured with load B
(benchmarks/serve.py, SmolLM2, 2 cores, output tok/s, one pass each, 2026-12-05; "hogs" are
`while True` processes beside the daemon):

                                        quiet     1 hog    2 hogs
    2 threads, libgomp's default spin   119-121    11.2     21.5
    2 threads, GOMP_SPINCOUNT=1000      106-110    62.6     51.1
    1 thread,  libgomp's default spin    75.2      73.6     50.9

So the thread count, not the spin, is what has to follow the machine: all the cores while it is
quiet, fewer as soon as something else runs. Before a step, at most once a WINDOW_S, the governor
reads how many cores other processes used in the last window (hardware/cpu_load.py) and sets the
threads to the cores left: one fewer for each core they take beyond TOLERATED_CORES (the daemon and
its clients take a little all the time; under load B they read 0.03-0.07). It drops at once,
since a step beside a busy core costs 5-10x, and rises again only after RISE_WINDOWS windows in a
row agree, so a burst of a compiler does not make it flap.
The first step after an idle spell decides from the whole spell's average at once: it is the best
guess there is without polling while idle. A new engine reads the machine for FIRST_READ_S before
its first step (part of the model's load, not of a request's wait; a worker's reading starts
with its load, read_from_now, so it adds nothing to a cold first token): a second model's worker that
started beside a busy one ran its first prompt with 2 threads beside the other's 2, on 2 cores,
and one step took over 4 s (tests/system/test_engine_workers.py's hang watchdog caught it).
The cost that stays: a step running when a process starts runs slowly to its end (the threads
cannot change inside a llama_decode); the next one is governed. Our own engines (a second model's
worker) never cause it: they share the cores through core_share.py, which caps what the governor
wants by what the other engines' running steps leave.

How long each thread spins at a barrier is backends/llamacpp/openmp.py's: the table's first two
rows are libgomp's default (what the daemon uses) and the short spin it set before the governor
(which kept half a shared machine's throughput and paid a tenth on a quiet one).

llama.cpp's results do not depend on the thread count (each output element is summed by one
thread; tests/system/test_thread_governor.py checks the logits are bit-equal), so this changes speed only.
"""

from __future__ import annotations

import logging
import math
import time

from ..backends.base import Backend
from ..hardware.cpu_load import OtherLoad, cpu_count
from .core_share import CoreShare

log = logging.getLogger(__name__)

WINDOW_S = 1.0
TOLERATED_CORES = 0.65  # other processes may use this much before a thread is given up
RISE_WINDOWS = 2
FIRST_READ_S = 0.1  # long enough for the clock ticks (10 ms) to tell a busy core from a quiet one


def threads_for(other_cores: float, max_threads: int, n_cpus: int) -> int:
    """Threads to use when other processes take `other_cores` of `n_cpus` logical CPUs. With SMT
    our threads are one per physical core, so a logical CPU taken costs max_threads / n_cpus of one."""
    taken = other_cores * max_threads / max(1, n_cpus)
    return max(1, max_threads - max(0, math.ceil(taken - TOLERATED_CORES)))


# A worker's first reading, started before its model loads (read_from_now), else None.
_first_reading: tuple[OtherLoad, float] | None = None


def read_from_now() -> None:
    """Start the first reading now: an engine worker calls it before its model loads, so the
    governor its engine builds waits only for what is left of FIRST_READ_S (the load is longer:
    no wait), not FIRST_READ_S more on a cold first token. The load's own CPU is this process's,
    which the reading leaves out."""
    global _first_reading
    _first_reading = (OtherLoad(), time.monotonic())


class ThreadGovernor:
    """Sets a backend's compute threads from the machine's load (see the module docstring), within
    what `share` leaves it beside our other engines (None: no other engine to share with)."""

    def __init__(self, backend: Backend, *, n_cpus: int | None = None, share: CoreShare | None = None) -> None:
        self._backend = backend
        self.max_threads = backend.n_threads
        self._n_cpus = n_cpus or cpu_count()
        self.threads = self.max_threads  # what the step computes on now
        self.wanted = self.max_threads  # what other processes leave, as the windows voted
        self._seat = share.join() if share is not None else None
        global _first_reading
        (self._load, started), _first_reading = _first_reading or (OtherLoad(), time.monotonic()), None
        self._window_start = time.monotonic()
        self._rise_votes = 0
        time.sleep(max(0.0, started + FIRST_READ_S - time.monotonic()))
        self.other_cores = self._load.sample()  # the last window's reading, for logs
        self._vote(threads_for(self.other_cores, self.max_threads, self._n_cpus))
        self._apply(self.wanted)

    def before_step(self) -> None:
        """Before a decode: read the machine if a window has passed, take threads from the share."""
        now = time.monotonic()
        if now - self._window_start >= WINDOW_S:
            self._window_start = now
            self.other_cores = self._load.sample()
            self._vote(threads_for(self.other_cores, self.max_threads, self._n_cpus))
        self._apply(self._seat.take(self.wanted, self.max_threads) if self._seat else self.wanted)

    def after_step(self) -> None:
        """The decode ended: its threads are free for our other engines."""
        if self._seat:
            self._seat.step_done()

    def idle(self) -> None:
        """No work left: our other engines need not share the cores with this one."""
        if self._seat:
            self._seat.idle()

    def close(self) -> None:
        if self._seat:
            self._seat.leave()
            self._seat = None

    def _vote(self, want: int) -> None:
        if want > self.wanted:
            self._rise_votes += 1
            if self._rise_votes < RISE_WINDOWS:
                return
        self._rise_votes = 0
        if want != self.wanted:
            log.debug("wanted threads %d -> %d (other processes: %.2f cores)", self.wanted, want, self.other_cores)
            self.wanted = want

    def _apply(self, n: int) -> None:
        if n != self.threads:
            self.threads = n
            self._backend.set_threads(n)
