"""Build llama.cpp's own `llama-server` (and `llama-batched-bench`, the hardware's ceiling) from the
sources llama-cpp-python vendors, once, cached.

    python benchmarks/llama_server_build.py                       # llama-server's path (built if needed)
    python benchmarks/llama_server_build.py llama-batched-bench   # another tool of the same build

The anchor of benchmarks/serve.py must be the very llama.cpp localserve runs on, so the sources
come from the pinned llama-cpp-python sdist (its vendor/llama.cpp), fetched with pip into a cache
directory outside the repository (~/.cache/localserve-bench, or LOCALSERVE_BENCH_CACHE). The build
runs under `nice` so other work on a shared machine keeps its cores, and happens only when the
binary is missing.
"""

from __future__ import annotations

import fcntl
import os
import platform
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # pyproject.toml pins the same version
# Some x86-64 VMs (this project's CI: Firecracker) advertise AMX in cpuid but trap its tile
# instructions; a -march=native build then dies with SIGILL in its first prompt (see .ci/run).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cache_dir() -> Path:
    return Path(os.environ.get("LOCALSERVE_BENCH_CACHE") or Path.home() / ".cache" / "localserve-bench")


def _sdist_sources(cache: Path) -> Path:
    """vendor/llama.cpp of the pinned sdist, unpacked under the cache."""
    unpacked = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if (unpacked / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return unpacked / "vendor" / "llama.cpp"
    dl = cache / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    # --no-binary for this one package only: with ":all:" pip also builds the sdist's build
    # dependencies from source to read its metadata (cmake among them: over 10 minutes on 2 cores).
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                    "-d", str(dl), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
    archive = next(dl.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return unpacked / "vendor" / "llama.cpp"


def llama_server_binary() -> Path:
    """Path of the built llama-server; builds it on first use (minutes on a small CPU)."""
    return tool_binary("llama-server")


def tool_binary(target: str) -> Path:
    """Path of one of llama.cpp's tools (llama-server, llama-batched-bench), built on first use
    into the one build directory: a second tool reuses the objects of the first."""
    cache = cache_dir()
    build = cache / "build"
    binary = build / "bin" / target
    if binary.is_file():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    # One build at a time: three benchmarks that started together once ran cmake in the one build
    # folder at once and left it broken (object files half written by two compilers).
    with open(cache / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.is_file():  # built by whoever held the lock before us
            _build(cache, build, target)
    return binary


def _build(cache: Path, build: Path, target: str) -> None:
    src = _sdist_sources(cache)
    env = dict(os.environ)
    if platform.machine() in ("x86_64", "AMD64"):
        env["CFLAGS"] = f"{env.get('CFLAGS', '')} {NO_AMX}".strip()
        env["CXXFLAGS"] = f"{env.get('CXXFLAGS', '')} {NO_AMX}".strip()
    if not (build / "CMakeCache.txt").is_file():
        # No CURL: the benchmark serves a local file. Release: the figures must be the optimised build's.
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON"], check=True, env=env)
    jobs = str(max(1, (os.cpu_count() or 1)))
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(build), "--target", target, "-j", jobs],
                   check=True, env=env)


if __name__ == "__main__":
    print(tool_binary(sys.argv[1] if len(sys.argv) > 1 else "llama-server"))
