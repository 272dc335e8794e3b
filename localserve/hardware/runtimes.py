"""What the installed inference runtimes can do: ONNX Runtime's execution providers and whether
this llama-cpp-python build was compiled with a GPU backend."""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass, field

# Backend names llama.cpp prints in llama_print_system_info ("CUDA : ARCHS = 890 | ... | CPU : ...").
_GPU_BACKENDS = {"CUDA": "CUDA", "ROCM": "ROCm", "HIP": "ROCm", "METAL": "Metal", "VULKAN": "Vulkan",
                 "SYCL": "SYCL", "MUSA": "MUSA", "OPENCL": "OpenCL", "CANN": "CANN"}
_SECTION_RE = re.compile(r"(?:^|\|)\s*([A-Za-z][A-Za-z0-9_]*)\s*:")


@dataclass
class LlamaBuild:
    gpu_offload: bool | None  # None: llama-cpp-python is not importable
    gpu_apis: list[str] = field(default_factory=list)


def parse_system_info(text: str) -> list[str]:
    apis = []
    for name in _SECTION_RE.findall(text):
        api = _GPU_BACKENDS.get(name.upper())
        if api and api not in apis:
            apis.append(api)
    return apis


def probe_llama() -> LlamaBuild:
    try:
        llama_cpp = importlib.import_module("llama_cpp")
    except ImportError:
        return LlamaBuild(None)
    from .ggml import backend_names

    info = llama_cpp.llama_print_system_info()
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    apis = parse_system_info(text)
    # The registered backends too: a Vulkan build's system info names only the CPU.
    apis += [api for api in parse_system_info(" | ".join(f"{n} :" for n in backend_names())) if api not in apis]
    return LlamaBuild(bool(llama_cpp.llama_supports_gpu_offload()), apis)


def probe_onnxruntime() -> list[str] | None:
    if importlib.util.find_spec("onnxruntime") is None:
        return None
    ort = importlib.import_module("onnxruntime")
    return list(ort.get_available_providers())
