"""How much of the machine's CPU other processes are using now, in cores.

The thread governor (engine/threads.py) reads this between steps to run llama.cpp on the cores
other processes leave free. "Other" is everything that is not this process: the user's compiler and
browser, and also our own daemon when the model runs in a worker process, since its event loop
competes for the same cores. Time the hypervisor stole counts as used: those cores were not ours.
"""

from __future__ import annotations

import os
import time

import psutil


def _our_cpus() -> set[int] | None:
    """The logical CPUs this process may run on, where the platform says (Linux); None: all."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity call in os
        return None


def cpu_count() -> int:
    """Logical CPUs this process may run on (its affinity mask where the platform has one)."""
    cpus = _our_cpus()
    return len(cpus) if cpus else (os.cpu_count() or 1)


def _busy_seconds(cpus: set[int] | None) -> float:
    """CPU seconds every process together has used since boot on `cpus` (None: all), idle and iowait
    excluded. Only our CPUs: in a container pinned to 2 of a host's 64, the other 62 are someone
    else's load that never takes a core of ours. (Guest time is inside user time already.)"""
    per_cpu = psutil.cpu_times(percpu=True)
    if cpus is not None and max(cpus, default=0) < len(per_cpu):
        per_cpu = [per_cpu[i] for i in sorted(cpus)]
    return sum(v for t in per_cpu for k, v in t._asdict().items() if k not in ("idle", "iowait", "guest", "guest_nice"))


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class OtherLoad:
    """Cores other processes used between two calls of `sample` (a moving window the caller times)."""

    def __init__(self) -> None:
        self._cpus = _our_cpus()
        self._last = self._read()

    def _read(self) -> tuple[float, float, float]:
        return time.monotonic(), _busy_seconds(self._cpus), _own_seconds()

    def sample(self) -> float:
        """Cores used by other processes since the last call (or the first: creation), on average; >= 0."""
        now = self._read()
        wall = now[0] - self._last[0]
        busy = now[1] - self._last[1]
        own = now[2] - self._last[2]
        self._last = now
        if wall <= 0:
            return 0.0
        # /proc/stat counts in clock ticks and os.times in its own: over a short window the two can
        # disagree by a tick, so the difference is clamped rather than trusted below zero.
        return max(0.0, (busy - own) / wall)
