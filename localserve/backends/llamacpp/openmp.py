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

Measured again 2026-12-05 (same load, one server at a time; "busy": two `while True` processes
beside it), output tokens/s:

    GOMP_SPINCOUNT=1000     106.1, 109.8 / 53.7      <- still chosen
    GOMP_SPINCOUNT=30000    111.1, 111.4 / -
    GOMP_SPINCOUNT=100000   115.0, 113.6 / 28.4
    libgomp's default       119.2, 120.8 / 25.0
    llama-server -fa off    122.1 (its default spin)

On the engine alone (8 one-row decodes a call, no serving between them) the knee is lower: 161.5
tok/s at 1000, 168.4 at 3000, 172.2 at 10000, 174.9 at 30000, which is llama-batched-bench's 175.7
(-fa off): some graph nodes leave one thread waiting longer than 1000 spins. Serving gains less from
those because a spinning thread also takes the core our engine thread and event loop run on between
steps. The default's last 10% on a quiet machine costs half the throughput on a shared one, so the
short spin stays; GOMP_SPINCOUNT=300000 in the environment buys it back where the machine is yours.
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
