"""Which llama-cpp-python build is installed, which one fits this machine, and how to build it.

One decision shared by `localserve setup`, `localserve hw` and the installer. A GPU build is
recommended only where placement would actually offload to a GPU with it (same rules as
`placement.choose_backend`, asked rather than restated) and only where its toolkit is present;
otherwise the missing toolkit is named with how to get it, and the CPU build stays.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from ..hardware.report import HardwareReport
from .placement import Runtimes, choose_backend

PACKAGE = "llama-cpp-python"


@dataclass(frozen=True)
class BuildSpec:
    name: str  # "cpu", "cuda", "metal", "rocm", "vulkan"
    api: str | None  # the GPU backend llama.cpp reports for it ("CUDA", ...); None for the CPU
    cmake_args: str
    toolkit: str  # what must be installed to compile it
    how_to_get: str


BUILDS: dict[str, BuildSpec] = {
    "cpu": BuildSpec("cpu", None, "", "a C/C++ compiler and CMake", "install your system's build tools (build-essential, cmake)"),
    "cuda": BuildSpec("cuda", "CUDA", "-DGGML_CUDA=on", "the CUDA toolkit (nvcc)",
                      "install the CUDA Toolkit from NVIDIA's CUDA downloads page, or your distribution's "
                      "nvidia-cuda-toolkit package, and put nvcc on PATH (or set CUDA_HOME)"),
    "metal": BuildSpec("metal", "Metal", "-DGGML_METAL=on", "Xcode command line tools",
                       "run `xcode-select --install`"),
    "rocm": BuildSpec("rocm", "ROCm", "-DGGML_HIP=on", "ROCm with hipcc",
                      "install ROCm from AMD's ROCm installation guide (hipcc in /opt/rocm/bin or on PATH)"),
    "vulkan": BuildSpec("vulkan", "Vulkan", "-DGGML_VULKAN=on", "the Vulkan loader and headers and glslc",
                        "install the Vulkan SDK from LunarG, or your distribution's libvulkan-dev and glslc packages"),
}
# Most specific first: a vendor's own stack beats Vulkan on the same card.
PREFERENCE = ("cuda", "rocm", "metal", "vulkan")

# ggml compiles for the build machine's own ISA (-march=native). Some x86-64 VMs (Firecracker)
# advertise AMX in cpuid but trap its tile instructions, and the native build then dies with SIGILL
# in the first prompt of a few dozen tokens. Desktop CPUs have no AMX, so where cpuid claims it we
# compile without it: a server with working AMX loses only ggml's AMX matmul path.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


@dataclass(frozen=True)
class Toolkits:
    """Compilers and SDKs present on this machine (injectable: tests pass their own)."""

    nvcc: bool = False
    hipcc: bool = False
    vulkan_loader: bool = False
    glslc: bool = False
    xcode: bool = False

    @classmethod
    def probe(cls, which: Callable[[str], str | None] = shutil.which) -> "Toolkits":
        cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        return cls(
            nvcc=bool(which("nvcc")) or Path(cuda_home, "bin", "nvcc").exists(),
            hipcc=bool(which("hipcc")) or Path(os.environ.get("ROCM_PATH", "/opt/rocm"), "bin", "hipcc").exists(),
            vulkan_loader=ctypes.util.find_library("vulkan") is not None or bool(os.environ.get("VULKAN_SDK")),
            glslc=bool(which("glslc")),
            xcode=bool(which("xcrun")),
        )

    def has(self, build: str) -> bool:
        return {
            "cpu": True, "cuda": self.nvcc, "rocm": self.hipcc, "metal": self.xcode,
            "vulkan": self.vulkan_loader and self.glslc,
        }[build]


@dataclass
class Recommendation:
    build: str  # the best build this machine can compile now
    reason: str
    missing: list[str] = field(default_factory=list)  # better builds blocked by a toolkit: one line each

    def as_dict(self) -> dict[str, Any]:
        return {"build": self.build, "reason": self.reason, "missing": list(self.missing)}


def installed_build(report: HardwareReport) -> str | None:
    """The installed build's name, from the backends llama.cpp reports; None if not importable."""
    if report.llama_gpu_offload is None:
        return None
    for spec in BUILDS.values():
        if spec.api and spec.api in report.llama_gpu_apis:
            return spec.name
    return "gpu" if report.llama_gpu_offload else "cpu"


def pinned_version() -> str | None:
    """The llama-cpp-python version localserve pins (pyproject), from the installed metadata."""
    try:
        requires = metadata.requires("localserve") or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        name, sep, version = req.partition("==")
        if sep and name.strip().lower().replace("_", "-") == PACKAGE:
            return version.split(";")[0].strip()
    return None


def installed_version() -> str | None:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def _offloads_with(report: HardwareReport, build: str) -> str | None:
    """The GPU placement would use with this build (None: it would stay on the CPU)."""
    api = BUILDS[build].api
    runtimes = Runtimes(llama_cpp=True, llama_gpu_offload=True, llama_gpu_apis=(api,) if api else ())
    choice = choose_backend(report, ["gguf"], runtimes, None)
    return choice.device_name if choice.device.startswith("gpu") else None


def recommend(report: HardwareReport, toolkits: Toolkits) -> Recommendation:
    missing: list[str] = []
    for build in PREFERENCE:
        if build == "metal" and not (report.os == "Darwin" and report.cpu.arch == "arm64"):
            continue
        gpu = _offloads_with(report, build)
        if gpu is None:
            continue
        spec = BUILDS[build]
        if toolkits.has(build):
            return Recommendation(build, f"{spec.api} on {gpu}", missing)
        missing.append(f"{build}: {gpu} needs {spec.toolkit}; {spec.how_to_get}")
    reason = "no GPU llama.cpp can offload to" if not missing else "the toolkit for a GPU build is missing"
    return Recommendation("cpu", reason, missing)


def build_env(build: str, report: HardwareReport, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for compiling `build`: CMAKE_ARGS, and the AMX guard where cpuid claims AMX."""
    env = dict(os.environ if base is None else base)
    env["CMAKE_ARGS"] = " ".join(filter(None, [env.get("CMAKE_ARGS", ""), BUILDS[build].cmake_args])).strip()
    env["FORCE_CMAKE"] = "1"
    if report.cpu.arch in ("x86_64", "AMD64") and "AMX" in report.cpu.features:
        for var in ("CFLAGS", "CXXFLAGS"):
            env[var] = f"{env.get(var, '')} {NO_AMX_FLAGS}".strip()
    return env


def setup_command(build: str) -> str:
    return f"localserve setup --build {build}"
