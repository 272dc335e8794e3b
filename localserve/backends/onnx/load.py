"""Load a converted ONNX folder as the backend its flavour needs: the dynamic graph (backend.py)
or the fixed-shape graphs for NPUs (static.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ..common.threads import default_threads
from .backend import OnnxBackend
from .session import CPU_EP, read_meta
from .static import StaticOnnxBackend


def load_onnx(model_dir: str | os.PathLike[str], gguf_path: str | os.PathLike[str], *, n_ctx: int,
              n_seq_max: int, n_batch: int, n_threads: int | None = None,
              providers: Sequence[str] = (CPU_EP,)) -> OnnxBackend:
    """Load a converted folder; `gguf_path` is the GGUF it came from (its tokenizer and template).

    n_ctx: KV slots of all sequences together (one pool; a static folder's graphs fix it instead);
    n_seq_max: sequence ids; n_batch: most tokens per decode. The session runs on `providers` in
    order (CPU last as fallback)."""
    if n_ctx < 1 or n_seq_max < 1 or n_batch < 1:
        raise ValueError("n_ctx, n_seq_max and n_batch must be positive")
    model_dir = Path(model_dir)
    meta = read_meta(model_dir)
    n_threads = n_threads or default_threads()
    if meta["flavour"] == "static":
        return StaticOnnxBackend.open(model_dir, meta, gguf_path, n_seq_max=n_seq_max, n_batch=n_batch,
                                      n_threads=n_threads, providers=providers)
    return OnnxBackend.open(model_dir, meta, gguf_path, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch,
                            n_threads=n_threads, providers=providers)
