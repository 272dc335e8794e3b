"""The plan of one model's load: the data planning.py computes and the registry's loaders read.

Its own room so that the loaders (registry, onnx_loader, oga_loader) take the type without
importing planning, which imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..batching.limits import EngineLimits


@dataclass
class ModelPlan:
    """How a model will be loaded: engine limits (context, sequences, batch), device, memory cost."""

    limits: "EngineLimits"
    memory_bytes: int
    n_gpu_layers: int = 0
    device: str = "cpu"
    vram_bytes: int = 0  # the part of memory_bytes expected on the GPU
    choice: Any = None  # placement.BackendChoice: which backend the registry loads it with, and why
    cpu: Any = None  # hardware.CPUInfo of the report this plan was made from (the AMX probe reads it)
