"""The device check's llama.cpp: a trimmed source archive made here, one CUDA build made there.

`prepare_sources` (here, with network) packs the pinned llama-cpp-python sdist (benchmarks/
llama_server_build.py's cache) without what no build reads: the sdist is 76 MB and the device
machine takes at most 64 MiB of files in all, so models, docs, tests, the web UI's sources and the
other GPU backends (Vulkan, SYCL, Metal, ...) stay behind.

`build_cuda` (there, no network) configures vendor/llama.cpp once with CUDA for the one card found
and builds only the targets the check runs: the shared libraries our backend loads (libllama,
libggml*), llama-server, llama-batched-bench and llama-quantize. `install_python_package` then
installs the sdist's Python package with pip, compiling nothing (LLAMA_BUILD=OFF), and points it at
that build's libraries: one CUDA compile serves both servers, so they run the very same kernels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_server_build import LLAMA_CPP_PYTHON, NO_AMX, _sdist_sources  # noqa: E402

SDIST_DIR = f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
TARGETS = ("llama", "llama-server", "llama-batched-bench", "llama-quantize")
# Top-level paths of vendor/llama.cpp that no build of these targets reads (LLAMA_BUILD_TESTS,
# _EXAMPLES and _UI are off): 75 MB of vocabulary GGUFs under models/ alone.
_VENDOR_DROP = {"models", "docs", "media", "tests", "benches", "examples", "pocs", ".github", ".devops",
                "gguf-py", "conversion", "ci", "requirements", "skills", "tools/ui/src", "tools/ui/tests",
                "tools/ui/package-lock.json", "tools/server/bench"}
_GGML_KEEP = {"ggml-cpu", "ggml-cuda"}  # backend folders of ggml/src kept; the rest are never configured
_SDIST_KEEP = {"CMakeLists.txt", "pyproject.toml", "PKG-INFO", "README.md", "LICENSE.md", "llama_cpp", "vendor"}


def _keep(rel: str) -> bool:
    """Whether a path of the sdist (relative to its root) goes into the trimmed archive."""
    parts = rel.split("/")
    if parts[0] != SDIST_DIR:
        return False
    if len(parts) == 1:
        return True
    if parts[1] not in _SDIST_KEEP:
        return False
    if parts[1] != "vendor" or len(parts) < 4 or parts[2] != "llama.cpp":
        return True
    inner = "/".join(parts[3:])
    if any(inner == d or inner.startswith(d + "/") for d in _VENDOR_DROP):
        return False
    if inner.startswith("ggml/src/ggml-") and len(parts) > 6:  # a file inside a backend folder
        return parts[5] in _GGML_KEEP
    return True


def prepare_sources(archive: Path) -> Path:
    """Write the trimmed sdist to `archive` (a .tar.gz) from the cached, unpacked sdist."""
    root = _sdist_sources(_cache()).parent.parent  # .../llama_cpp_python-X/vendor/llama.cpp -> sdist root
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz", compresslevel=9) as tar:
        for path in sorted(root.rglob("*")):
            rel = f"{SDIST_DIR}/{path.relative_to(root).as_posix()}"
            if path.is_file() and not path.is_symlink() and _keep(rel):
                tar.add(path, arcname=rel, recursive=False)
    return archive


def _cache() -> Path:
    from llama_server_build import cache_dir

    return cache_dir()


def unpack(archive: Path, into: Path) -> Path:
    """The sdist root, unpacked from the trimmed archive (once)."""
    root = into / SDIST_DIR
    if not (root / "CMakeLists.txt").is_file():
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
    return root


def cuda_architecture() -> str:
    """The card's compute capability as CMake wants it ("9.0" -> "90"): one architecture, not the
    default list, cuts the CUDA compile (the long pole) to a fraction."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0].strip().replace(".", "")


CMAKE_OPTIONS = [
    # Shared libraries: libllama.so is what llama-cpp-python loads. UI off and no prebuilt UI: the
    # device has no network, and the prebuilt-UI step would try to download it. No flash-attention
    # kernels: localserve runs without them (llama-server gets -fa off), and their 37 template
    # instances then compile to empty kernels (GGML_CUDA_NO_FA) instead of the heaviest device code
    # of the build. No NCCL: one card.
    "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_CUDA=ON",
    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_CUDA_NCCL=OFF",
    "-DGGML_CUDA_FA=OFF",
]


def _found(pattern: str) -> Path | None:
    """A file of the NVIDIA wheels in this Python's site-packages (nvidia/**/pattern)."""
    import site

    for root in site.getsitepackages():
        if hit := sorted((Path(root) / "nvidia").glob(f"**/{pattern}")):
            return hit[-1]
    return None


def _toolkit_fallbacks(configure_log: str) -> list[str]:
    """CMake options for what the configure missed in the CUDA toolkit: a toolkit without cuBLAS
    (seen on this project's dev machine: nvcc and cudart only) takes the cuBLAS of the NVIDIA
    wheels PyTorch brought; one without the driver library's stub builds without CUDA VMM."""
    options = []
    cublas, cublas_lt, header = _found("libcublas.so*"), _found("libcublasLt.so*"), _found("cublas_v2.h")
    if "CUDA::cublas" in configure_log and cublas and cublas_lt and header:
        options += [f"-DCUDA_cublas_LIBRARY={cublas}", f"-DCUDA_cublasLt_LIBRARY={cublas_lt}",
                    f"-DCMAKE_CUDA_FLAGS=-I{header.parent}"]
    if "CUDA::cuda_driver" in configure_log:
        options.append("-DGGML_CUDA_NO_VMM=ON")
    return options


def build_cuda(sdist_root: Path, build: Path, log: Path) -> dict[str, float]:
    """Configure and build TARGETS with CUDA into `build`; returns the stage's timings."""
    arch = cuda_architecture()
    configure = ["cmake", "-S", str(sdist_root / "vendor" / "llama.cpp"), "-B", str(build), *CMAKE_OPTIONS,
                 f"-DCMAKE_CUDA_ARCHITECTURES={arch}"]
    started = time.perf_counter()
    # The device is a Firecracker VM like CI's: its CPU may advertise AMX and trap the tile
    # instructions, and llama.cpp's CPU part (-march=native) still runs the embedding lookup.
    env = dict(os.environ, CFLAGS=NO_AMX, CXXFLAGS=NO_AMX)
    with open(log, "a") as out:
        # CMake names one missing toolkit part per try: add its fallback and configure again.
        fallbacks: list[str] = []
        for _ in range(3):
            tried = subprocess.run(configure + fallbacks, env=env, capture_output=True, text=True)
            out.write(tried.stdout + tried.stderr)
            more = [o for o in _toolkit_fallbacks(tried.stdout + tried.stderr) if o not in fallbacks]
            if tried.returncode == 0 or not more:
                break
            out.write(f"\nconfigure again with {more}\n")
            fallbacks += more
            (build / "CMakeCache.txt").unlink(missing_ok=True)
        if tried.returncode:
            raise SystemExit(f"cmake configure failed (build.log): {tried.stderr.strip()[-400:]}")
        configured = time.perf_counter()
        out.flush()
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", *TARGETS],
                       check=True, env=env, stdout=out, stderr=subprocess.STDOUT)
    return {"cuda_arch": float(arch), "configure_s": configured - started,
            "build_s": time.perf_counter() - configured, "cmake_fallbacks": " ".join(fallbacks)}


def install_python_package(sdist_root: Path, site: Path, lib_dir: Path, log: Path) -> None:
    """pip-install the sdist's llama_cpp package into `site` without compiling (no network: no
    dependencies, no build isolation), then put `lib_dir`'s shared libraries in its lib folder,
    where llama_cpp looks for them."""
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
    with open(log, "ab") as out:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--no-compile", "--target", str(site), str(sdist_root)],
                       check=True, env=env, stdout=out, stderr=subprocess.STDOUT)
    lib = site / "llama_cpp" / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    for so in lib_dir.glob("lib*.so*"):
        shutil.copy2(so, lib / so.name, follow_symlinks=True)
