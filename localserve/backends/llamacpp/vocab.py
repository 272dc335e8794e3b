"""llama.cpp's tokenizer without its compute: a vocab-only load of a GGUF.

A backend that computes elsewhere (ONNX Runtime) must tokenize and render tokens exactly as the
llama.cpp backend does, or the same prompt would become other ids on each backend. So this class
does not reimplement anything: it loads the GGUF with `vocab_only` (no weights read, a few MB) and
shares LlamaCppBackend's tokenizer (tokenizer.py), which needs only `vocab`, `n_vocab` and a
piece cache, and reads the model's facts with the same function (llamacpp_info.py).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from pathlib import Path

import llama_cpp

from ...errors import GGUFError
from ..base import ModelInfo
from .loading import without_paths
from .info import read_model_info
from .runtime import ensure_runtime, error_count, last_error_since
from .tokenizer import LlamaTokenizer


class LlamaVocab(LlamaTokenizer):
    def __init__(self, path: str | os.PathLike[str], *, n_ctx_train: int, n_embd: int, n_params: int) -> None:
        path = Path(path)
        ensure_runtime()
        errors_before = error_count()
        mparams = llama_cpp.llama_model_default_params()
        mparams.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(os.fsencode(path), mparams)
        if not model:
            reason = without_paths(last_error_since(errors_before), path)
            raise GGUFError(f"could not read the tokenizer of {path.name!r}" + (f": {reason}" if reason else ""))
        self.model = model
        self._finalizer = weakref.finalize(self, llama_cpp.llama_model_free, model)
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_embd = n_embd
        self._pieces: dict[tuple[int, bool], bytes] = {}
        # A vocab-only load reads no hyperparameters or tensors: the caller knows these sizes.
        info = read_model_info(model, self.vocab, path, n_vocab=self.n_vocab, n_embd=n_embd)
        self.info: ModelInfo = dataclasses.replace(info, n_ctx_train=n_ctx_train,
                                                   n_embd=n_embd, n_params=n_params)

    def close(self) -> None:
        self._finalizer()
