"""Mixture-of-experts weights kept in RAM while the rest of the model is offloaded: llama-server's
`--cpu-moe` / `--n-cpu-moe N`, as llama.cpp's tensor buffer-type overrides.

An MoE layer reads only its chosen experts per token, so its expert stacks (most of the weights)
run well enough from RAM while attention and the router stay on the GPU: how a 30B-A3B model is
served on a 12 GB card. llama.cpp takes a NULL-terminated array of {regex, buffer type}; a weight
whose name matches a regex goes to that buffer type instead of the layer's device. The regexes are
llama.cpp's own (common/common.h LLM_FFN_EXPS_REGEX, llm_add_n_cpu_ffn_overrides), so a model
llama-server splits one way is split the same way here.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from ...store.gguf_facts import EXPERTS_REGEX

ALL_LAYERS = -1  # cpu_moe_layers: every layer's experts (--cpu-moe)


class _BuftOverride(ctypes.Structure):
    # llama.h's struct llama_model_tensor_buft_override; llama-cpp-python 0.3.36 declares the
    # llama_model_params field as a bare pointer and defines no such struct.
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def expert_patterns(cpu_moe_layers: int) -> list[str]:
    """The regexes that keep the experts of the first `cpu_moe_layers` layers (ALL_LAYERS: all) in RAM."""
    if cpu_moe_layers == ALL_LAYERS:
        return [EXPERTS_REGEX]
    return [rf"blk\.{i}{EXPERTS_REGEX}" for i in range(max(cpu_moe_layers, 0))]


@functools.lru_cache(maxsize=1)
def cpu_buffer_type() -> int:
    """ggml's CPU buffer type, the very pointer llama.cpp compares an override's type against (it
    then picks the CPU's extra buffer types, repacked layouts, for the tensor as a CPU load would)."""
    import llama_cpp
    from llama_cpp import _ctypes_extensions, _ggml

    del llama_cpp  # loaded first: it puts the library folder on the search path (Windows)
    base = _ctypes_extensions.load_shared_library("ggml-base", _ggml.libggml_base_path)
    base.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    base.ggml_backend_cpu_buffer_type.argtypes = []
    return int(base.ggml_backend_cpu_buffer_type())


def set_expert_overrides(mparams: Any, cpu_moe_layers: int) -> Any:
    """Point `mparams.tensor_buft_overrides` at the overrides for `cpu_moe_layers`; returns the
    array, which the caller keeps alive until the load returns (llama.cpp reads it during the load
    only). None, and nothing set, when no layer's experts stay in RAM."""
    patterns = expert_patterns(cpu_moe_layers)
    if not patterns:
        return None
    buft = cpu_buffer_type()
    array = (_BuftOverride * (len(patterns) + 1))(*[_BuftOverride(p.encode(), buft) for p in patterns])
    mparams.tensor_buft_overrides = ctypes.cast(array, ctypes.c_void_p)
    return array
