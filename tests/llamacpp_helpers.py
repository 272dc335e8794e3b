"""Helpers shared by the llama.cpp backend and sampling tests (not a test module)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from localserve.backends.base import BatchToken, Sampler
from localserve.backends.llamacpp.backend import LlamaCppBackend

from worker_locks import THREADS  # noqa: F401  (re-exported: the tests that load through here use it)


def load(path: Path, *, n_ctx: int = 2048, n_seq_max: int = 8, n_batch: int = 512,
         exact: bool = False, kv_unified: bool = True, flash_attention: bool = True) -> LlamaCppBackend:
    return LlamaCppBackend.load(path, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, n_threads=THREADS,
                                exact_attention=exact, kv_unified=kv_unified, flash_attention=flash_attention)


def prompt_batch(tokens: Sequence[int], seq_id: int, start: int = 0) -> list[BatchToken]:
    """A prompt as batch tokens; only the last one asks for logits."""
    last = len(tokens) - 1
    return [BatchToken(t, seq_id, start + i, i == last) for i, t in enumerate(tokens)]


def generate(backend: LlamaCppBackend, sampler: Sampler, prompt: Sequence[int], n: int, seq_id: int = 0,
             stop_at_eog: bool = True) -> list[int]:
    """Run one sequence alone: prefill, then sample up to n tokens (stopping after an EOG token)."""
    backend.kv_remove(seq_id)
    backend.decode(prompt_batch(prompt, seq_id))
    out: list[int] = []
    row, pos = len(prompt) - 1, len(prompt)
    for _ in range(n):
        token = sampler.sample(row).token
        out.append(token)
        if stop_at_eog and backend.is_eog(token):
            break
        backend.decode([BatchToken(token, seq_id, pos, True)])
        row, pos = 0, pos + 1
    return out


def text_of(backend: LlamaCppBackend, tokens: Sequence[int]) -> str:
    return b"".join(backend.token_to_bytes(t) for t in tokens).decode("utf-8", errors="replace")
