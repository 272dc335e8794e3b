"""How much memory a GGUF model needs at a given context: weights + KV cache + compute buffers.

Used by `show`, by the model manager's memory budget, and by placement (how many layers fit on a
GPU). The figures are estimates for llama.cpp with a plain f16 KV cache and no flash attention,
which is the larger of the two compute-buffer cases, so we err towards "does not fit".
Sliding-window layers (Gemma 2/3) are counted at the full context: llama.cpp's default context
parameters have swa_full=true, which allocates them that way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config.kv_cache import KV_TYPE_BYTES
from ..errors import InvalidRequestError

if TYPE_CHECKING:  # a type only: the tray formats bytes with this module without loading gguf (0.3 s)
    from ..store.gguf_facts import GGUFFacts

# llama.cpp's default micro-batch (n_ubatch): the compute graph is sized for this many tokens.
DEFAULT_UBATCH = 512
F32 = 4

# Bytes per KV element for the cache types llama.cpp offers (q8_0/q4_0 store 32 values per block of
# 34/18 bytes): config/kv_cache.py's table.
KV_BYTES = KV_TYPE_BYTES


@dataclass(frozen=True)
class MemoryEstimate:
    n_ctx: int  # KV cells in total (n_ctx per sequence x n_seq)
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    total_bytes: int
    # For partial GPU offload: one repeating layer (its weights + its share of the KV cache), the
    # number of such layers, and the weights outside them (token embeddings, output head).
    n_layers: int
    layer_bytes: int
    non_layer_bytes: int
    expert_bytes: int = 0  # MoE expert stacks, all layers (part of weights_bytes; cpu_moe keeps them in RAM)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kv_cache_bytes(facts: GGUFFacts, n_cells: int, kv_bytes_per_elem: float = 2.0) -> int:
    """K and V for `n_cells` tokens over all layers: n_cells x sum over layers of n_kv_heads x
    (head_dim_k + head_dim_v) x bytes — i.e. 2 x n_ctx x n_layer x n_kv_heads x head_dim x bytes
    when K and V heads are the same size and every layer has attention."""
    return math.ceil(n_cells * facts.kv_heads_all_layers * (facts.head_dim + facts.head_dim_v) * kv_bytes_per_elem)


def compute_buffer_bytes(facts: GGUFFacts, n_cells: int, n_ubatch: int = DEFAULT_UBATCH, n_outputs: int = 1,
                         flash_attention: bool = False) -> int:
    """Scratch memory of one forward pass, from Ollama's GraphSize estimate for llama-style models
    (fs/ggml/ggml.go, "fullOffload"): the larger of the attention working set
    4·b·(1 + 4·embd + ctx·(1 + heads)) — dominated by the b x ctx x heads f32 KQ score matrix — and
    the output projection 4·b·(embd + vocab), with b = min(ctx, n_ubatch); plus the f32 logits
    buffer of one output row per sequence. Measured on SmolLM2-135M at ctx 8192 with llama.cpp
    (llama-cpp-python 0.3.36, CPU): estimate 164.7 MiB; llama.cpp reserves 166.4 MiB without flash
    attention and 98.3 MiB + 0.2 MiB with it (tests/system/test_memory.py checks the live figure).
    With flash attention no score matrix is kept, so the projection term is what remains."""
    b = min(n_cells, n_ubatch)
    attention = 0 if flash_attention else F32 * b * (1 + 4 * facts.n_embd + n_cells * (1 + facts.n_heads))
    projection = F32 * b * (facts.n_embd + facts.vocab_size)
    logits = F32 * facts.vocab_size * n_outputs
    return max(attention, projection) + logits


def estimate_memory(
    facts: GGUFFacts,
    n_ctx: int,
    kv_bytes_per_elem: float = 2.0,
    n_seq: int = 1,
    n_ubatch: int = DEFAULT_UBATCH,
    flash_attention: bool = False,
) -> MemoryEstimate:
    """Memory to run `facts`' model with `n_ctx` tokens of context for each of `n_seq` sequences
    (per-sequence KV streams: attention spans one stream of n_ctx cells).

    With llama.cpp's unified KV cache (one pool shared by all sequences) pass the pool size as
    `n_ctx` and keep n_seq=1. `kv_bytes_per_elem` is 2 for the default f16 cache (see KV_BYTES)."""
    if n_ctx <= 0 or n_seq <= 0:
        raise InvalidRequestError(f"context length and sequence count must be positive (got {n_ctx}, {n_seq})")
    if kv_bytes_per_elem <= 0:
        raise InvalidRequestError(f"KV bytes per element must be positive (got {kv_bytes_per_elem})")
    cells = n_ctx * n_seq
    kv = kv_cache_bytes(facts, cells, kv_bytes_per_elem)
    compute = compute_buffer_bytes(facts, n_ctx, n_ubatch, n_seq, flash_attention)
    weights = facts.weights_bytes
    per_layer = 0
    if facts.n_layers:
        # Offload is decided layer by layer, so size by the biggest block and an even share of the KV.
        per_layer = facts.largest_layer_bytes + math.ceil(kv / facts.n_layers)
    return MemoryEstimate(
        n_ctx=cells,
        weights_bytes=weights,
        kv_bytes=kv,
        compute_bytes=compute,
        total_bytes=weights + kv + compute,
        n_layers=facts.n_layers,
        layer_bytes=per_layer,
        non_layer_bytes=facts.non_layer_bytes,
        expert_bytes=facts.expert_bytes,
    )


def experts_in_ram(estimate: MemoryEstimate | None, cpu_moe_layers: int) -> int:
    """Bytes of the experts the first `cpu_moe_layers` layers (negative: all) keep in RAM; layers
    are counted as equal shares of the experts (a MoE model's layers are alike)."""
    if estimate is None or not estimate.expert_bytes or not cpu_moe_layers:
        return 0
    if cpu_moe_layers < 0 or cpu_moe_layers >= estimate.n_layers:
        return estimate.expert_bytes
    return estimate.expert_bytes * cpu_moe_layers // estimate.n_layers


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; used by `show`, `hw` and placement reasons."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - loop always returns
