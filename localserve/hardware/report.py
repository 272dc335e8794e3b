"""The hardware report: plain dataclasses, JSON-ready through `to_dict()`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

GPUKind = Literal["discrete", "integrated", "unified"]


@dataclass
class CPUInfo:
    model: str
    arch: str  # "x86_64", "arm64"
    cores_physical: int | None
    cores_logical: int | None
    cores_usable: int | None  # what this process may run on (containers and affinity masks limit it)
    features: list[str] = field(default_factory=list)  # "AVX2", "AVX-512", "NEON", ...


@dataclass
class GPUInfo:
    vendor: str  # "NVIDIA", "AMD", "Intel", "Apple", "Qualcomm", ...
    name: str
    kind: GPUKind
    vram_bytes: int | None  # dedicated memory (for "unified": the share the GPU may wire)
    vram_free_bytes: int | None
    apis: list[str]  # best first: "CUDA", "ROCm", "Metal", "DirectML", "Vulkan"
    arch: str | None = None  # CUDA compute capability "8.9", AMD "gfx1100"
    driver: str | None = None
    pci_id: str | None = None  # "10de:2684"
    bus_id: str | None = None  # "0000:01:00.0"
    source: str = ""  # which probe found it

    @property
    def api(self) -> str | None:
        return self.apis[0] if self.apis else None


@dataclass
class NPUInfo:
    vendor: str
    name: str
    driver: str | None
    execution_providers: list[str]  # ONNX Runtime EPs that can run on it, best first
    generation: str | None = None  # "XDNA 2", "Meteor Lake", "Hexagon"
    pci_id: str | None = None
    llm_capable: bool = True  # False where the vendor's LLM stack does not support this generation
    note: str | None = None
    source: str = ""


@dataclass
class HardwareReport:
    os: str  # "Linux", "Windows", "Darwin"
    cpu: CPUInfo
    ram_total_bytes: int | None
    ram_available_bytes: int | None
    gpus: list[GPUInfo] = field(default_factory=list)
    npus: list[NPUInfo] = field(default_factory=list)
    onnx_providers: list[str] | None = None  # None: onnxruntime not installed
    llama_gpu_offload: bool | None = None  # None: llama-cpp-python not importable
    llama_gpu_apis: list[str] = field(default_factory=list)  # GPU backends compiled into llama.cpp
    errors: list[str] = field(default_factory=list)  # probe failures, one line each

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
