"""OpenMP's wait policy for llama.cpp's CPU threads, set before anything loads llama.cpp.

llama.cpp's CPU build runs its threads on libgomp and synchronises every graph node with an
`omp barrier`, so the wait policy prices each of the hundreds of barriers in a decode. Measured with
issue 8's load B (benchmarks/serve.py, 2 threads on 2 cores, output tokens/s, separate runs of one
session), on a quiet machine / on one shared with two busy processes:

    PASSIVE (futex sleep at once; the old default)           95-96 / 62-65
    GOMP_SPINCOUNT=100                                          99 / 54
    GOMP_SPINCOUNT=1000 (tens of microseconds, then sleep)  107-109 / 46-50   <- chosen
    GOMP_SPINCOUNT=10000                                       107 / 44
    libgomp's default (300000 spins, milliseconds)         101-110 / 32
    ACTIVE (spin forever)                                      126 / -, a whole core burnt while idle
    llama-server (libgomp's default)                        97-108 / 20-31

A short spin covers the barriers inside a step (both threads arrive microseconds apart) without
spinning through the gaps between steps, where our engine thread and event loop need the cores and
a process sharing the machine needs them more. 1000 keeps nearly all of the quiet machine's gain
and still gives 1.6-2.4x llama-server's throughput when the cores are shared; PASSIVE would give a
busy machine a quarter more and a quiet one a tenth less (set OMP_WAIT_POLICY=PASSIVE for that).
Every finite setting idles at 0.0% of a core once the requests stop (the "idle CPU" row of
benchmarks/serve.py): a desktop daemon must not spin.
"""

from __future__ import annotations

import os

SPIN_COUNT = "1000"


def apply_default_wait_policy() -> None:
    """GOMP_SPINCOUNT=SPIN_COUNT unless the user chose a policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT
    in the environment win). libgomp reads them once, when `import llama_cpp` loads it, so this
    runs from backends/__init__.py, ahead of every module that imports llama_cpp."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
