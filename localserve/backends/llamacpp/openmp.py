"""OpenMP's wait policy for llama.cpp's CPU threads, set before anything loads llama.cpp.

llama.cpp's CPU build runs its threads on libgomp and synchronises every graph node with an
`omp barrier`, so the wait policy prices each of the hundreds of barriers in a decode: a thread
that arrives first spins GOMP_SPINCOUNT times, then sleeps. How many threads compute is the thread
governor's (engine/threads.py), which gives threads up while other processes hold cores; this is
how long each of those threads waits. Load B (benchmarks/serve.py, 2 threads on 2 cores, output
tokens/s, one pass each, 2026-12-05), with the governor:

    GOMP_SPINCOUNT=1000 (tens of microseconds)   106-110 (without the governor; 62.6 beside a busy process)
    GOMP_SPINCOUNT=30000                         117
    GOMP_SPINCOUNT=100000                        117
    libgomp's default (300000, milliseconds)     121-123                <- chosen
    llama-server -fa off (libgomp's default)     125.5-127.1

Why the default, written out: a step already running when another process starts runs
oversubscribed to its end (the governor changes threads between steps), and there a thread spins
through its partner's whole time slice at every barrier. For a second model of ours that is no
longer so: our engines share the cores (engine/core_share.py), and no step of one starts on cores
another's running step holds. Before the share, libgomp's default let one step of two models
decoding at once on 2 cores run past the 4 s hang watchdog of tests/system/test_engine_workers.py (1 run
in 5), and 30000 was shipped for a day at a cost of 5-8% (load B 112-115 against 122-123, the
edit's plain decode 36.7 against 40.0 tok/s); with the share, 3 runs of that module and 3 of its
two-model test passed at the default. What is left is another program starting during a step:
that one step runs slowly (a tenth of the speed at worst), the next is governed. Without the
governor a busy process cost far more: at the default, 2 threads beside one `while True` process
gave 11.2 tok/s and beside two 21.5 (1000: 62.6, 51.1). Every finite setting idles at 0.0% of a
core once the requests stop (the "idle CPU" row of benchmarks/serve.py): a desktop daemon must not
spin. It is written out rather than left to libgomp so that the choice is visible and tested.

Earlier measurements (load B quiet / beside two busy processes, no governor): OMP_WAIT_POLICY=
PASSIVE 95-96 / 62-65, spin 100 99 / 54, ACTIVE 126 / - (a whole core burnt while idle). On the
engine alone (8 one-row decodes a call, no serving between them): 161.5 tok/s at 1000, 168.4 at
3000, 172.2 at 10000, 174.9 at 30000, which is llama-batched-bench's 175.7 (-fa off).
OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment win.
"""

from __future__ import annotations

import os

SPIN_COUNT = "300000"  # libgomp's own default when OMP_WAIT_POLICY is unset


def apply_default_wait_policy() -> None:
    """GOMP_SPINCOUNT=SPIN_COUNT unless the user chose a policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT
    in the environment win). libgomp reads them once, when `import llama_cpp` loads it, so this
    runs from backends/__init__.py, ahead of every module that imports llama_cpp."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
