"""Facts about an installed model that only its tokenizer knows, without loading its weights.

/api/show must say whether a model can fill in the middle before any load (Continue decides from
it, and an editor asks at startup for every model): llama.cpp finds FIM tokens by the GGUF's
tokenizer.ggml.fim_*_token_id or by their text, so a vocab-only load (a few MB, no weights) asks it
the same way a load would. Answers are kept per file and digest.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..store.cache import InstalledModel

FIM_REQUIRED = ("pre", "suf", "mid")


def fim_capable(model: InstalledModel) -> bool:
    gguf = model.gguf
    if gguf is None:  # folder variants: their tokenizer.json names no FIM roles we read
        return False
    return _fim_capable(str(gguf.path), gguf.sha256 or "")


@functools.lru_cache(maxsize=64)
def _fim_capable(path: str, _digest: str) -> bool:
    from ..backends.llamacpp.vocab import LlamaVocab
    from ..errors import LocalserveError

    try:
        vocab = LlamaVocab(Path(path), n_ctx_train=0, n_embd=0, n_params=0)
    except (LocalserveError, OSError):
        return False
    try:
        return all(role in vocab.info.fim_tokens for role in FIM_REQUIRED)
    finally:
        vocab.close()
