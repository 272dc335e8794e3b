"""A model's LoRA adapters on llama.cpp (issue 45, item 5): each file loaded once per model
(llama_adapter_lora_init), and the set the next decodes run with put on the context
(llama_set_adapters_lora).

llama.cpp applies adapters to a whole context: every sequence of a decode runs with the context's
set, so requests with different sets cannot share a decode. The scheduler plans each step for one
set (batching/adapter_turns.py) and the engine's step switches the set here only when it changes.
Adapters belong to the model and are freed with it (llama_model_free), never one by one: freeing one
first and the model after frees it twice.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Sequence

import llama_cpp

from ...errors import BackendError, InvalidRequestError
from ...protocol.requests import LoraSet


class LoraAdapters:
    def __init__(self, handles: list[Any], paths: list[str]) -> None:
        self.handles = handles
        self.paths = paths
        self.current: LoraSet = ()  # what the context runs with now

    @classmethod
    def load(cls, model: Any, paths: Sequence[str | os.PathLike[str]]) -> "LoraAdapters":
        handles = []
        for path in paths:
            handle = llama_cpp.llama_adapter_lora_init(model, os.fsencode(path))
            if not handle:
                raise BackendError(f"llama.cpp could not load the LoRA adapter {Path(path).name!r} for this model "
                                   "(its log says why: another architecture, or tensors of other shapes)")
            handles.append(handle)
        return cls(handles, [str(p) for p in paths])

    def apply(self, ctx: Any, adapters: LoraSet) -> None:
        """Run the context's next decodes with `adapters` ((id, scale) pairs), and no others."""
        if adapters == self.current:
            return
        if any(not 0 <= i < len(self.handles) for i, _ in adapters):
            raise InvalidRequestError(f"LoRA adapter ids must be 0..{len(self.handles) - 1}", param="lora")
        n = len(adapters)
        handles = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*(self.handles[i] for i, _ in adapters)) if n else None
        scales = (ctypes.c_float * n)(*(s for _, s in adapters)) if n else None
        if llama_cpp.llama_set_adapters_lora(ctx, handles, n, scales) != 0:
            raise BackendError("llama.cpp refused the LoRA adapters' set")
        self.current = adapters
