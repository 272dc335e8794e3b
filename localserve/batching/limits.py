"""Per-model engine limits: how many sequences, how many tokens per step, how big the queues.

Settings of 0 mean "size it for me": the defaults come from the machine (physical cores, RAM via
psutil) and the model's memory needs, so a laptop and a workstation both get a sane engine
without anyone tuning it. The same numbers size the backend's context (n_ctx, n_seq_max, n_batch),
so the scheduler's accounting and the backend's cache always agree.

This module is the backend-neutral arithmetic: context per request, sequences, step budget, the
memory the cache may take. How that memory becomes a cache (llama.cpp's streams or unified pool,
its 256-cell padding, its 256 sequence ids) is the backend's to say: Backend.plan_kv, for
llama.cpp backends/llamacpp/sizing.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import psutil

from ..backends.base import KVRequest, KVSizing, seq_ids_for
from ..config.kv_cache import parse_kv_type
from ..config.settings import Settings
from ..errors import ConfigError
from .prefix_cache import RELEASE_AFTER_S
from .speculation import MODES
from .step_clock import DEFAULT_TARGET_S

# KV bytes per token when the model does not tell us: f16 K+V of a ~1B llama-style model
# (16 layers x 2 x 512 dims x 2 bytes). Larger models pass their real figure.
_DEFAULT_KV_BYTES_PER_TOKEN = 32 * 1024
# Per request by default: editor plugins send 4-16k-token prompts, Ollama and LM Studio give 4,096.
_MAX_AUTO_CONTEXT = 8192
_KV_RAM_SHARE = 0.25  # at most this share of the RAM left after the weights goes to the KV cache
_KV_LAYOUTS = ("auto", "streams", "unified")  # the kv_layout setting's values (a backend reads it)


@dataclass
class EngineLimits:
    max_sequences: int = 8  # sequences decoding at once
    batch_tokens: int = 512  # tokens per step (decodes + prefill chunks); <= backend.n_batch
    queue_size: int = 64  # waiting requests per lane before submit refuses
    queue_timeout: float = 600.0  # seconds a request may wait before its first step
    n_ctx: int = 8192  # KV cells of the backend context (all sequences, or all streams, together)
    n_ctx_seq: int = 8192  # prompt + completion of one request
    prefix_cache: bool = True
    # Seconds a parked prefix-cache entry stays in memory unused while the engine idles, where a
    # later hit gets it back cheaply (prefix_cache.py); 0: until evicted.
    prefix_release_s: float = RELEASE_AFTER_S
    kv_unified: bool = False  # one shared cell pool instead of a stream per sequence (see config.py)
    kv_type: str = "f16"  # KV element types, "K/V" or one for both ("f16", "q8_0/f16": config/kv_cache.py)
    flash_attention: bool = False
    aging_steps: int = 256  # a waiting/running request gains one lane of priority per this many steps
    batch_step_s: float = DEFAULT_TARGET_S  # time a step's batch-lane prompt chunks may take (0 = no cap)
    # Drafting by prompt lookup: auto, ngram (always) or off (speculation.py). Off unless the
    # settings say otherwise (their default is auto): verification rows round like prompt chunks,
    # not like one-row decodes, so a near-tie can go the other way than in plain decoding.
    speculative: str = "off"
    # Threads follow the machine's load (engine/threads.py). Off unless the settings say otherwise
    # (their default is on), so an engine built by hand computes with what its backend was loaded with.
    adaptive_threads: bool = False

    def __post_init__(self) -> None:
        for name in ("max_sequences", "batch_tokens", "queue_size", "n_ctx", "n_ctx_seq", "aging_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine limit {name} must be at least 1 (got {getattr(self, name)})")
        if self.speculative not in MODES:
            raise ConfigError(f"speculative must be one of {', '.join(MODES)} (got {self.speculative!r})")
        self.kv_type = _kv_type("KV cache type", self.kv_type)
        self.max_sequences = _max_running(self.max_sequences, self.batch_tokens)
        self.n_ctx_seq = min(self.n_ctx_seq, self.n_ctx)

    @property
    def n_seq_max(self) -> int:
        """Sequence ids the backend context needs: the running ones plus as many parked prefix-cache
        entries (a finished request's KV stays resident under its own id until evicted)."""
        return seq_ids_for(self.max_sequences, self.prefix_cache)

    @property
    def full_length_requests(self) -> int:
        """Requests that can hold a full context at once: the running count with streams, the cells
        of the pool over one request's context in a unified pool (fewer when all run long)."""
        if not self.kv_unified:
            return self.max_sequences
        return min(self.max_sequences, self.n_ctx // self.n_ctx_seq)

    def describe(self) -> dict[str, object]:
        """What `show` reports: tokens per request, requests at once, and the KV layout behind them."""
        return {"context_per_request": self.n_ctx_seq, "concurrent_requests": self.max_sequences,
                "full_length_requests": self.full_length_requests,
                "kv_layout": "unified" if self.kv_unified else "streams", "kv_type": self.kv_type,
                "kv_cells": self.n_ctx, "speculative": self.speculative,
                "exact": not self.kv_unified and not self.flash_attention and self.speculative == "off"}

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        n_ctx_train: int,
        model_bytes: int,
        kv_bytes_per_token: int = 0,
        cores: int | None = None,
        ram_bytes: int | None = None,
        plan_kv: Callable[[KVRequest], KVSizing],
        kv_type: str | None = None,
    ) -> "EngineLimits":
        """Limits for one model. Settings win where they are non-zero; the rest is derived.

        `kv_bytes_per_token` is the f16 cache's figure (memory.kv_cache_bytes(facts, 1)). The
        cache itself is sized by the backend's rules, `plan_kv` (a Backend class's plan_kv),
        which the caller hands in: batching/ never imports a concrete backend. `kv_type`: the
        model's own KV types (model_kv_cache_type), else the setting kv_cache_type."""
        if settings.kv_layout not in _KV_LAYOUTS:
            raise ConfigError(f"setting kv_layout must be one of {', '.join(_KV_LAYOUTS)} (got {settings.kv_layout!r})")
        kv_type = kv_type or settings.kv_cache_type.strip().lower()
        if kv_type != "auto":
            kv_type = _kv_type("setting kv_cache_type", kv_type)
        cores = cores or settings.threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
        ram = ram_bytes or psutil.virtual_memory().total

        n_ctx_seq = settings.context_length or min(n_ctx_train or _MAX_AUTO_CONTEXT, _MAX_AUTO_CONTEXT)
        if n_ctx_train:
            n_ctx_seq = min(n_ctx_seq, n_ctx_train)
        # CPU decode scales with cores; beyond ~4 streams per core each stream just gets slower.
        max_sequences = settings.max_sequences or max(4, min(32, 4 * cores))
        # A step of this many prompt tokens takes a few hundred ms on a small CPU: long enough to
        # amortise the per-step overhead, short enough that running streams do not visibly stall.
        batch_tokens = settings.batch_tokens or max(256, min(2048, 128 * cores))
        want = KVRequest(
            n_ctx_seq=n_ctx_seq,
            # Clamped here, not only in __post_init__: the KV cache is sized for this count.
            max_sequences=_max_running(max_sequences, batch_tokens),
            prefix_cache=settings.prefix_cache,
            kv_budget_bytes=int(max(ram - model_bytes, 0) * _KV_RAM_SHARE),
            kv_bytes_per_token=kv_bytes_per_token or _DEFAULT_KV_BYTES_PER_TOKEN,
            layout=settings.kv_layout, kv_type=kv_type, flash_attention=settings.flash_attention,
        )
        kv = plan_kv(want)
        return cls(max_sequences=kv.max_sequences, batch_tokens=batch_tokens, n_ctx=kv.n_ctx, n_ctx_seq=kv.n_ctx_seq,
                   queue_size=settings.queue_size or 64, batch_step_s=settings.batch_step_ms / 1000,
                   queue_timeout=settings.queue_timeout or 600.0, prefix_cache=settings.prefix_cache,
                   prefix_release_s=settings.prefix_cache_idle_release_s,
                   kv_unified=kv.kv_unified, kv_type=kv.kv_type, flash_attention=kv.flash_attention,
                   speculative=settings.speculative.strip().lower(), adaptive_threads=settings.adaptive_threads)


def _kv_type(what: str, value: str) -> str:
    try:
        return parse_kv_type(value)
    except ValueError as e:
        raise ConfigError(f"{what} {value!r} {e}") from None


def _max_running(max_sequences: int, batch_tokens: int) -> int:
    """Every running sequence decodes one token per step, so the budget must hold them all."""
    return min(max_sequences, batch_tokens)
