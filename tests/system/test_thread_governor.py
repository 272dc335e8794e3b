"""The thread governor (engine/threads.py): llama.cpp computes on the cores other processes leave
free. Its premise is checked on the real model (the thread count changes no logit), and it is run
beside a real busy process, on the real load readings."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from localserve.backends.base import BatchToken
from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.batching.limits import EngineLimits
from localserve.engine import threads
from localserve.engine.local import Engine
from localserve.engine.threads import ThreadGovernor, threads_for
from localserve.hardware.cpu_load import OtherLoad

# alone: these read the machine's other load, which a test on the second worker would be.
pytestmark = [pytest.mark.model, pytest.mark.alone]


@pytest.fixture(scope="module")
def backend(smollm2_gguf):
    b = LlamaCppBackend.load(smollm2_gguf, n_ctx=2048, n_seq_max=2, n_batch=256, n_threads=2, kv_unified=False,
                             flash_attention=False)
    yield b
    b.close()


def greedy_logits(backend: LlamaCppBackend, n_threads: int, steps: int = 12) -> np.ndarray:
    """A prompt's last logits and `steps` greedy decodes' after it, all at `n_threads`."""
    backend.set_threads(n_threads)
    backend.kv_clear()
    prompt = backend.tokenize("def add(a, b):\n    return a + b\n\n# The quick brown fox jumps over " * 6)
    backend.decode([BatchToken(t, 0, i, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    rows = [backend.logits(len(prompt) - 1).copy()]
    for pos in range(len(prompt), len(prompt) + steps):
        backend.decode([BatchToken(int(np.argmax(rows[-1])), 0, pos, True)])
        rows.append(backend.logits(0).copy())
    backend.kv_clear()
    return np.stack(rows)


def test_the_thread_count_changes_no_logit(backend):
    """The governor changes threads between any two steps, so a result that depended on the count
    would make answers depend on what else the machine runs."""
    two = greedy_logits(backend, 2)
    one = greedy_logits(backend, 1)
    assert np.array_equal(one, two)
    backend.set_threads(2)


@pytest.mark.parametrize("other, max_threads, n_cpus, want", [
    (0.0, 2, 2, 2), (0.6, 2, 2, 2),  # a daemon and a client's trickle leave us both cores
    (0.7, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1),  # never fewer than one
    (0.0, 4, 8, 4), (3.0, 4, 8, 3),  # SMT: 3 logical CPUs taken are 1.5 of our physical-core threads
    (1.2, 8, 8, 7),
])
def test_threads_for(other, max_threads, n_cpus, want):
    assert threads_for(other, max_threads, n_cpus) == want


def _busy_process() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _until(governor: ThreadGovernor, want: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        governor.before_step()
        if governor.threads == want:
            return True
        time.sleep(0.02)
    return False


def test_a_busy_process_takes_a_thread_and_gives_it_back(backend, monkeypatch):
    monkeypatch.setattr(threads, "WINDOW_S", 0.3)
    # n_cpus=2: the machine this test asks about is two cores, one of which the busy process takes,
    # whatever the runner has (on more cores one busy process would rightly leave all our threads).
    governor = ThreadGovernor(backend, n_cpus=2)
    assert governor.threads == 2
    hog = _busy_process()
    try:
        assert _until(governor, 1, timeout=10), f"still {governor.threads} threads, other load {governor.other_cores:.2f}"
        assert governor.other_cores > 0.65
    finally:
        hog.kill()
        hog.wait()
    assert _until(governor, 2, timeout=10), f"still {governor.threads} threads, other load {governor.other_cores:.2f}"


def test_other_load_leaves_out_this_process():
    """Work in this process is ours, not other processes' load."""
    load = OtherLoad()
    t = time.monotonic()
    while time.monotonic() - t < 0.5:
        pass
    assert load.sample() < 0.5


def test_the_engine_governs_only_when_asked(backend):
    limits = dict(max_sequences=2, batch_tokens=64, n_ctx=backend.n_ctx, n_ctx_seq=1024)
    governed = Engine(backend, EngineLimits(**limits, adaptive_threads=True))
    fixed = Engine(backend, EngineLimits(**limits))
    assert governed.stats().compute_threads == 2 and governed._threads is not None
    assert fixed.stats().compute_threads == 2 and fixed._threads is None


READ_ON_CPU0 = """
import os, time
os.sched_setaffinity(0, {0})
from localserve.hardware.cpu_load import OtherLoad
load = OtherLoad()
time.sleep(1.5)
print(load.sample())
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to pin to")
@pytest.mark.parametrize("hog_cpu, busy", [(1, False), (0, True)])
def test_other_load_counts_only_the_cpus_we_may_run_on(hog_cpu, busy):
    """A process pinned to a CPU we may not use never takes a core of ours (a container pinned to
    2 of a host's CPUs must not read the host's load as its own)."""
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{hog_cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)
        out = subprocess.run([sys.executable, "-c", READ_ON_CPU0], capture_output=True, text=True, check=True,
                             timeout=60)
    finally:
        hog.kill()
        hog.wait()
    other = float(out.stdout.strip().splitlines()[-1])
    assert (other > 0.6) if busy else (other < 0.4), other
