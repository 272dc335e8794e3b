"""Prebuilt llama-cpp-python wheels, looked for before `localserve setup` compiles (issue 46 item 4).

A GPU build from source needs the vendor's toolkit and a compiler, and minutes; Ollama, LM Studio
and the rest ship their GPU builds instead. `setup` first asks each wheel source the user named (a
local folder of wheels, a find-links page, or a package index, per build or for all) for the pinned
version, with pip itself, binaries only: pip picks a wheel whose tags fit this interpreter and
platform and checks an index's published hashes. A wheel's file name does not say its flavour (a
CUDA wheel and the CPU one are both `llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl`), so
the flavour is read from the libraries inside it before it may replace the installed build.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .buildinfo import BUILDS, PACKAGE

# The ggml backend library each GPU build adds beside the CPU one (libggml-cuda.so, ggml-cuda.dll,
# libggml-metal.dylib, ...). A wheel with none of them is a CPU build.
GPU_LIBRARY = {"cuda": "ggml-cuda", "rocm": "ggml-hip", "vulkan": "ggml-vulkan", "metal": "ggml-metal"}
_LIBRARY_SUFFIXES = (".so", ".dll", ".dylib")


@dataclass(frozen=True)
class WheelSource:
    location: str  # a folder, a file:// or https:// find-links page, or an index URL ending in /simple/
    build: str | None  # the build it serves; None: any (the flavour is checked either way)


def parse_sources(entries: tuple[str, ...] | list[str]) -> list[WheelSource]:
    """`BUILD=LOCATION` or `LOCATION` entries (the llama_wheels setting, setup's --wheels)."""
    sources = []
    for entry in entries:
        build, sep, location = entry.partition("=")
        if sep and build in BUILDS:
            sources.append(WheelSource(location.strip(), build))
        else:
            sources.append(WheelSource(entry.strip(), None))
    return sources


def wheel_flavour(wheel: Path) -> str:
    """The build a wheel holds, from the names of its libraries: "cuda", ..., or "cpu"."""
    with zipfile.ZipFile(wheel) as archive:
        names = [Path(n).name for n in archive.namelist() if n.endswith(_LIBRARY_SUFFIXES) or ".so." in n]
    for build, library in GPU_LIBRARY.items():
        if any(library in name for name in names):
            return build
    return "cpu"


def _pip_download(source: WheelSource, version: str, dest: Path, python: str) -> list[str]:
    where = source.location
    is_index = where.rstrip("/").endswith("/simple") and not Path(where).exists()
    origin = ["--index-url", where] if is_index else ["--no-index", "--find-links", where]
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
            *origin, "--dest", str(dest), f"{PACKAGE}=={version}"]


def find_wheel(build: str, version: str, sources: list[WheelSource], scratch: Path, log: Path,
               python: str = sys.executable) -> tuple[Path | None, list[str]]:
    """The first wheel of `version` for `build` that a source offers, and why each other source
    did not serve (one line each, for the user). pip's output goes to `log`."""
    misses = []
    for n, source in enumerate(s for s in sources if s.build in (None, build)):
        dest = scratch / f"source-{n}"
        cmd = _pip_download(source, version, dest, python)
        with log.open("a", encoding="utf-8") as out:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
        wheels = sorted(dest.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            misses.append(f"{source.location}: no {PACKAGE} {version} wheel for this machine")
            continue
        flavour = wheel_flavour(wheels[0])
        if flavour != build:
            misses.append(f"{source.location}: its {PACKAGE} {version} wheel is a {flavour} build, not {build}")
            continue
        return wheels[0], misses
    return None, misses
