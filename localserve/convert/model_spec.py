"""A decoder's shape as the converter reads it from a GGUF (spec.py) and checks it (bounds.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int  # the context the GGUF claims (checked only against a sanity bound)
    n_positions: int  # the rope tables' length: n_ctx_train capped at what serving reaches (bounds.py)
    rope_base: float
    rms_eps: float
    rope_interleaved: bool  # llama.cpp's "normal" rope on permuted q/k rows: adjacent pairs rotate
    qkv_bias: bool
    tied_embeddings: bool
    rope_freqs: bool  # llama 3.1's per-frequency factors tensor is present
