"""A worker model's tokenizer on the daemon's side: a GGUF model's `tokenize`, `detokenize` and
`token_pieces` run in the daemon, on a vocab-only load of the same file (llama.cpp's own tokenizer,
so the same ids), and only without one as a round trip to the worker (proxy.py says why)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def open_vocab(gguf: Path | None) -> Any:
    """The GGUF's tokenizer in this process, or None (then the worker tokenizes)."""
    if gguf is None:
        return None
    from ...backends.llamacpp.vocab import LlamaVocab  # not at import time: loads llama.cpp

    try:
        return LlamaVocab(gguf, n_ctx_train=0, n_embd=0, n_params=0)
    except Exception as e:  # noqa: BLE001 - the worker's tokenizer still works, a round trip away
        log.info("tokenizing %s in its worker: %s", gguf.name, e)
        return None


class VocabCalls:
    """ModelEngine's tokenizer members for WorkerEngine, which sets `_vocab` (open_vocab's) and
    answers `_wait` (a call to the worker); each renders as engine/local.py's does."""

    _vocab: Any

    def _wait(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        if self._vocab is not None:
            return self._vocab.tokenize(text, add_special=add_special)
        return self._wait("tokenize", text, add_special)

    def detokenize(self, tokens: list[int]) -> str:
        if self._vocab is not None:
            return b"".join(map(self._vocab.token_to_bytes, tokens)).decode("utf-8", errors="replace")
        return self._wait("detokenize", tokens)

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        if self._vocab is not None:
            return [self._vocab.token_to_bytes(t, special=True) for t in tokens]
        return self._wait("token_pieces", tokens)


def yield_the_cores() -> None:
    """Lowest CPU priority for the calling thread: proxy.py's vocab thread, which opens the vocab
    (~0.25 s of native work on 2 cores) right after the worker is ready, as the worker's first step
    runs on threads that spin at every barrier. Side by side, a 31-token first step took 220-260 ms
    instead of 106-122 ms (2026-12-07, cold first token 0.56-0.59 s, 0.38-0.48 s niced). Linux only:
    there a thread is a task of its own for setpriority; elsewhere the number is no pid, and could
    name another process."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass  # a sandbox that refuses it: the vocab opens at normal priority, as before
