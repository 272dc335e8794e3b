"""LlamaCppBackend.load's steps: checking its arguments, loading the weights, the context's
parameters (and what each costs), making the context; and llama.cpp's error text without host
paths (the vocab-only load uses it too)."""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from ...config.kv_cache import kv_pair, needs_flash_attention
from ...errors import BackendError, GGUFError, ModelNotFoundError
from . import kv_pages
from .moe import set_expert_overrides
from .probe import build_died_here
from .runtime import captured_log, error_count, last_error_since

# ggml's type ids of the KV types config/kv_cache.py names (llama-cpp-python 0.3.36 has no BF16 constant:
# 30 is ggml.h's GGML_TYPE_BF16).
KV_TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "bf16": 30,
            "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q5_1": llama_cpp.GGML_TYPE_Q5_1, "q5_0": llama_cpp.GGML_TYPE_Q5_0,
            "q4_1": llama_cpp.GGML_TYPE_Q4_1, "q4_0": llama_cpp.GGML_TYPE_Q4_0, "iq4_nl": llama_cpp.GGML_TYPE_IQ4_NL}

_ABS_PATH = re.compile(r"(?<![\w.])(?:[A-Za-z]:\\|/)[^\s:'\"]+")


def without_paths(message: str, path: Path) -> str:
    """llama.cpp's errors name files by their full path; clients may only see the file name."""
    message = message.replace(str(path.resolve()), path.name).replace(str(path), path.name)
    return _ABS_PATH.sub("<path>", message)


def check_load_args(path: Path, n_ctx: int, n_seq_max: int, n_batch: int, kv_type: str) -> None:
    max_seq = llama_cpp.llama_max_parallel_sequences()
    if not 1 <= n_seq_max <= max_seq:
        raise ValueError(f"n_seq_max must be in 1..{max_seq}")
    if n_ctx < 1 or n_batch < 1:
        raise ValueError("n_ctx and n_batch must be positive")
    if any(t not in KV_TYPES for t in kv_pair(kv_type)):
        raise ValueError(f"kv_type must be K/V of {sorted(KV_TYPES)}")
    if not path.is_file():
        raise ModelNotFoundError(path.name, message=f"model file {path.name!r} does not exist")


@dataclass(frozen=True)
class GpuSplit:
    """How llama.cpp spreads the offloaded layers over several GPUs (config/gpu_split.py): its
    llama_split_mode by name, the card used alone with "none", each card's share (empty:
    llama.cpp's own, by free memory)."""

    mode: str = "layer"
    main_gpu: int = 0
    shares: tuple[float, ...] = ()

    @classmethod
    def of(cls, choice: Any) -> "GpuSplit":
        """The split a placement choice (runtime/placement.BackendChoice) asks for."""
        if choice is None:
            return cls()
        return cls(choice.split_mode, choice.main_gpu, tuple(choice.tensor_split))

    def apply(self, mparams: Any) -> Any:
        """Set `mparams`' split fields; returns the shares' array, kept alive until the load returns."""
        mparams.split_mode = _SPLIT_MODES[self.mode]
        mparams.main_gpu = self.main_gpu
        if not self.shares:
            return None
        n = llama_cpp.llama_max_devices()
        if len(self.shares) > n:
            raise ValueError(f"tensor_split names {len(self.shares)} GPUs; this llama.cpp build takes at most {n}")
        array = (ctypes.c_float * n)(*self.shares)
        mparams.tensor_split = ctypes.cast(array, ctypes.POINTER(ctypes.c_float))
        return array


_SPLIT_MODES = {"none": llama_cpp.LLAMA_SPLIT_MODE_NONE, "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
                "row": llama_cpp.LLAMA_SPLIT_MODE_ROW}


def load_model(path: Path, n_gpu_layers: int, extra_buffers: bool | None,
               cpu_moe_layers: int = 0, split: GpuSplit = GpuSplit()) -> tuple[Any, list[str]]:
    """The weights, and llama.cpp's log lines of the load (where it put the layers); GGUFError in
    llama.cpp's own words, with no host path, when it cannot load the file. `cpu_moe_layers`: the
    first N layers' MoE experts stay in RAM (moe.ALL_LAYERS: every layer's)."""
    errors_before = error_count()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = n_gpu_layers
    mparams.use_extra_bufts = not build_died_here() if extra_buffers is None else extra_buffers
    kept = (set_expert_overrides(mparams, cpu_moe_layers), split.apply(mparams))
    with captured_log() as load_lines:
        model = llama_cpp.llama_model_load_from_file(os.fsencode(path), mparams)
    del kept  # read by the load only
    if not model:
        reason = without_paths(last_error_since(errors_before), path)
        raise GGUFError(f"could not load model file {path.name!r}" + (f": {reason}" if reason else ""))
    return model, load_lines


def context_params(*, n_ctx: int, n_seq_max: int, n_batch: int, n_threads: int, kv_unified: bool, kv_type: str,
                    flash_attention: bool, exact_attention: bool) -> Any:
    """llama.cpp's context parameters for LlamaCppBackend.load's arguments. What the ones that
    change answers or memory do:

    exact_attention: F32 KV cache and no flash attention: the least rounding llama.cpp offers,
        the reference the tests compare other runtimes (ONNX, OGA) against. Costs 2x KV memory
        and ~10% decode speed. It does not make a unified pool independent of where a
        sequence's cells sit: the vector kernels sum cells in lanes, so an offset that moves a
        sequence across lanes moves its sums. Measured on SmolLM2 on an AVX2 machine, a prompt
        behind another sequence's cells differs by up to 0.49 in its logits (enough to flip a
        greedy token) unless that offset is a multiple of 8, where CI's AMX machines had
        passed a bit-equality test. Per-sequence streams (kv_unified=False) keep answers exact.
    kv_unified: one pool of n_ctx cells for all sequences (True, load's default) or one stream
        of n_ctx / n_seq_max cells per sequence (False, what the product loads:
        settings.kv_unified, EngineLimits). Measured on SmolLM2 (tests/model/
        test_backend_llamacpp.py): in a unified pool a sequence's attention sums run over cells
        interleaved with other sequences' (masked) cells, so its greedy tokens can change with
        the batch it runs in, even with exact_attention. Per-sequence streams keep each
        sequence's cells where they would be alone: outputs are bit-identical batched or
        alone, with the default F16 cache too. The price: no sequence grows past its stream,
        and kv_copy copies the stream instead of sharing cells.
    flash_attention: False disables it (True, load's default, lets llama.cpp decide; the
        product passes settings.flash_attention, False). On CPU its kernel switches to a tiled
        variant for micro-batches of 64+ tokens, which rounds differently, so a prompt
        prefilled in other chunk sizes (alone vs. beside other requests) can end in other
        greedy tokens. With per-sequence streams and flash attention off, outputs are identical
        whatever the batch (tests/model/test_engine_llamacpp.py), with the F16 cache.
    kv_type: the cache's element types, "K/V" or one name for both ("f16", "q8_0", "q8_0/f16":
        config/kv_cache.py; q8_0 halves KV memory). llama.cpp needs flash attention for a
        quantized V cache, so a quantized V turns it on; a quantized K alone does not. Ignored
        with exact_attention, which keeps F32.
    """
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = n_batch
    cparams.n_ubatch = min(n_batch, 512)  # llama.cpp's default micro-batch: bigger only costs memory
    cparams.n_seq_max = n_seq_max
    cparams.kv_unified = kv_unified
    cparams.n_threads = n_threads
    cparams.n_threads_batch = n_threads
    cparams.embeddings = False
    type_k, type_v = kv_pair(kv_type)
    cparams.type_k, cparams.type_v = KV_TYPES[type_k], KV_TYPES[type_v]
    if needs_flash_attention(kv_type):
        flash_attention = True  # llama.cpp refuses a quantized V cache without it
    if exact_attention:
        cparams.type_k = cparams.type_v = llama_cpp.GGML_TYPE_F32
    if exact_attention or not flash_attention:
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return cparams


def make_context(model: Any, cparams: Any, path: Path) -> tuple[Any, list[str], kv_pages.KVPages | None]:
    """The context, llama.cpp's log lines of making it (where it put the KV cache), and where its KV
    buffer's pages lie if they can go back to the OS (kv_pages.py); frees the model and raises
    BackendError where llama.cpp cannot make one."""
    # The KV buffer's clear gives its pages back instead of writing them (kv_pages.py): a
    # context of 16 x 8,192 cells was 3 GiB committed and most of a 2.3 s load.
    with captured_log() as context_lines, kv_pages.zeroing_by_release() as zeroed:
        ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise BackendError(f"could not create a context for {path.name!r} (n_ctx={cparams.n_ctx}; out of memory?)")
    return ctx, context_lines, kv_pages.KVPages.locate(model, cparams, zeroed)
