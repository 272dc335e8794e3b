"""GPUs as the installed llama.cpp build sees them: ggml's backend device registry.

The OS probes (sysfs, nvidia-smi, the registry) find cards by their PCI functions. A software
Vulkan device like Mesa's lavapipe has none, yet a Vulkan build offloads to it (with
GGML_VK_VISIBLE_DEVICES set). ggml lists every device its backends registered; llama-cpp-python
binds none of ggml_backend_dev_*, so they are called here through ctypes on the library
llama_cpp already loaded. Entries for cards an OS probe already found are dropped by
detect._merge_gpus (same PCI bus id, or any OS-probed GPU when ggml gives no id).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from .report import GPUInfo

# ggml-backend.h: enum ggml_backend_dev_type
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
# Device name prefixes of ggml's GPU backends ("Vulkan0", "CUDA0", "ROCm0", "MTL0").
_APIS = {"Vulkan": "Vulkan", "CUDA": "CUDA", "ROCm": "ROCm", "HIP": "ROCm", "MTL": "Metal", "Metal": "Metal",
         "SYCL": "SYCL"}


@dataclass(frozen=True)
class GgmlDevice:
    name: str  # "Vulkan0", "CUDA0", "CPU"
    description: str  # "llvmpipe (LLVM 15.0.6, 256 bits)"
    type: str  # a DEVICE_TYPES value
    memory_free: int
    memory_total: int
    bus_id: str | None = None  # "0000:01:00.0"; None for devices without a PCI function


class _Caps(ctypes.Structure):
    _fields_ = [(n, ctypes.c_bool) for n in ("async_", "host_buffer", "buffer_from_host_ptr", "events",
                                             "mmap_support")]


class _Props(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("description", ctypes.c_char_p), ("memory_free", ctypes.c_size_t),
                ("memory_total", ctypes.c_size_t), ("type", ctypes.c_int), ("device_id", ctypes.c_char_p),
                ("caps", _Caps),
                # Room for fields a later ggml appends: get_props writes the whole struct it knows.
                ("_spare", ctypes.c_byte * 64)]


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode("utf-8", "replace")


def _ggml() -> ctypes.CDLL | None:
    """libggml as llama_cpp loaded it (dlopen hands back the same handle, with the backends it
    registered), after backend init; None without llama_cpp."""
    from ..backends.llamacpp import openmp  # noqa: F401 - its wait policy must precede loading llama.cpp

    try:
        import llama_cpp
    except ImportError:
        return None
    from ..backends.llamacpp.runtime import ensure_runtime

    ensure_runtime()  # backend init with llama.cpp's log routed (Vulkan's init prints its devices)
    return ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml.so"))


def backend_names() -> list[str]:
    """The backends the build registered ("Vulkan", "CPU"), with or without a usable device:
    llama_print_system_info names only those with CPU-style features, so a Vulkan build shows
    just "CPU" there."""
    lib = _ggml()
    if lib is None:
        return []
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    lib.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_reg_get.restype = ctypes.c_void_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    return [_text(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))) for i in range(lib.ggml_backend_reg_count())]


def probe_ggml_devices() -> list[GgmlDevice]:
    """Every device the installed build registered, the CPU included; [] without llama_cpp."""
    lib = _ggml()
    if lib is None:
        return []
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get_props.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Props)]
    lib.ggml_backend_dev_get_props.restype = None
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        props = _Props()
        lib.ggml_backend_dev_get_props(lib.ggml_backend_dev_get(i), ctypes.byref(props))
        out.append(GgmlDevice(_text(props.name), _text(props.description), DEVICE_TYPES.get(props.type, "unknown"),
                              props.memory_free, props.memory_total, _text(props.device_id) or None))
    return out


def gpus_from_ggml(devices: list[GgmlDevice]) -> list[GPUInfo]:
    """The GPU-type devices as GPUInfo (vendor unknown to ggml: named from the description)."""
    gpus = []
    for dev in devices:
        if dev.type not in ("gpu", "igpu"):
            continue
        api = next((a for prefix, a in _APIS.items() if dev.name.startswith(prefix)), None)
        gpus.append(GPUInfo(
            vendor=dev.description.split()[0] if dev.description else "unknown",
            name=dev.description or dev.name,
            kind="integrated" if dev.type == "igpu" else "discrete",
            vram_bytes=dev.memory_total or None, vram_free_bytes=dev.memory_free or None,
            apis=[api] if api else [], bus_id=dev.bus_id, source="ggml",
        ))
    return gpus
