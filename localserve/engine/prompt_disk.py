"""The prompt cache on disk, as one engine's prefix cache uses it (batching/prefix_cache.DiskTier).

Two halves meet here: the files (store/prompt_cache.py: index, checksums, the writer thread, the
bound) and the backend's sequence state (for llama.cpp backends/llamacpp/seq_state.py: a sequence's
cells as bytes and back). `save` and `restore` run on the engine thread, where the state is read
from the context and placed into it; the bytes go to the writer thread, so a step waits for a
memory copy of the sequence's cells (about 1 ms per MB here), never for the disk.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol, Sequence

from ..errors import LocalserveError
from ..store.prompt_cache import DiskEntry, PromptDiskCache

log = logging.getLogger(__name__)

# Entries shorter than this are not written: SmolLM2 computes 128 prompt tokens in ~0.1 s on 2
# cores, about what opening, checking and placing a file costs, and a chat's short turns would
# otherwise write a file each.
MIN_TOKENS = 128


class SequenceState(Protocol):
    trim_margin: int | None

    def save(self, seq_id: int) -> bytes: ...

    def restore(self, seq_id: int, state: bytes, keep: int) -> None: ...


class PromptDisk:
    def __init__(self, files: PromptDiskCache, state: SequenceState, min_tokens: int = MIN_TOKENS):
        self.files = files
        self.state = state
        self.min_tokens = min_tokens
        self.trim_margin = state.trim_margin
        self.save_seconds = 0.0  # engine-thread time spent copying states out, for benchmarks

    def entries(self) -> list[DiskEntry]:
        return self.files.entries()

    def read(self, entry: DiskEntry) -> bytes | None:
        return self.files.read(entry)

    def save(self, seq_id: int, tokens: Sequence[int]) -> None:
        started = time.perf_counter()
        try:
            state = self.state.save(seq_id)
        except LocalserveError as e:  # a cache file lost, nothing else: the request is answered
            log.warning("prompt cache: %s", e)
            return
        self.save_seconds += time.perf_counter() - started
        log.debug("prompt cache: %d tokens (%d MB) copied out in %.1f ms", len(tokens), len(state) >> 20,
                  (time.perf_counter() - started) * 1000)
        self.files.save(tokens, state)

    def restore(self, seq_id: int, state: bytes, keep: int) -> None:
        self.state.restore(seq_id, state, keep)

    def flush(self, timeout: float) -> bool:
        return self.files.flush(timeout)
