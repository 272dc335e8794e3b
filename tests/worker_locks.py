"""The suite runs in two worker processes (`pytest -n 2`, pyproject's addopts), and two things
follow from that, both kept here.

- `filling(name)`: one worker at a time fills a part of the persistent `.test-cache` (the pulled
  models, the ONNX and OGA conversions, the npm agents). Without it, on a fresh clone both workers
  ask for SmolLM2 in their first test and two pulls, or two `npm install --prefix` runs, write the
  same files at once.
- `alone`: a test marked `@pytest.mark.alone` runs while the other worker runs nothing. The thread
  governor's tests measure the machine's other load and the Ctrl-C tests time a terminal's
  answer: a neighbour's prefill on the second core is exactly what they must not see. Every other
  test holds a shared lock for its setup, call and teardown; an `alone` test takes it exclusively.
  A turnstile in front keeps the exclusive one from waiting forever behind a stream of shared ones
  (flock does not queue waiters fairly).

Both are plain `flock`s: the cache's beside the cache (any run on this checkout fills it), the
turns' in the temporary folder under the run's id (two separate runs do not wait for each other).
A run without workers takes no turns.

And `THREADS`, the threads a test's own llama.cpp or ONNX Runtime computes on: the machine's cores
divided between the workers. Both libraries' threads spin at every barrier, so two workers with 2
threads each on 2 cores do not run half as fast but dozens of times slower (CI: a 5 s JSON-schema
test took 201 s, and a 12-step decode test ran past pytest's 300 s limit inside llama_decode).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

THREADS = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

LOCKS = Path(__file__).resolve().parent.parent / ".test-cache" / "locks"


def _lock_file(folder: Path, name: str) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    return os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)


@contextmanager
def filling(name: str) -> Iterator[None]:
    """Held while this process fills `.test-cache/<name>`: the second worker waits, then finds it filled."""
    fd = _lock_file(LOCKS, name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextmanager
def turn(alone: bool, run_id: str) -> Iterator[None]:
    """A test's turn: shared with the other worker's tests, or the whole machine when `alone`."""
    folder = Path(tempfile.gettempdir()) / f"localserve-tests-{run_id}"
    turnstile, room = _lock_file(folder, "turnstile"), _lock_file(folder, "room")
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        os.close(room)
        os.close(turnstile)
