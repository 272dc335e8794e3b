"""runtime/wheels.py: a wheel's flavour read from its libraries, and the llama_wheels entries."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from localserve.runtime.wheels import WheelSource, parse_sources, wheel_flavour


def _wheel(path: Path, *names: str) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name in names:
            z.writestr(name, b"\0")
    return path


@pytest.mark.parametrize("libraries, flavour", [
    (["llama_cpp/lib/libllama.so", "llama_cpp/lib/libggml-cpu.so", "llama_cpp/lib/libggml-cuda.so"], "cuda"),
    (["llama_cpp/lib/libllama.so", "llama_cpp/lib/libggml-cpu.so.0.9.4"], "cpu"),
    (["llama_cpp/lib/llama.dll", "llama_cpp/lib/ggml-vulkan.dll"], "vulkan"),
    (["llama_cpp/lib/libllama.dylib", "llama_cpp/lib/libggml-metal.dylib"], "metal"),
    (["llama_cpp/lib/libllama.so", "llama_cpp/lib/libggml-hip.so"], "rocm"),
    # A library's name in a docstring or a header is not a library.
    (["llama_cpp/lib/libllama.so", "llama_cpp/include/ggml-cuda.h"], "cpu"),
])
def test_a_wheels_flavour_is_the_gpu_library_it_carries(tmp_path, libraries, flavour):
    assert wheel_flavour(_wheel(tmp_path / "w.whl", *libraries)) == flavour


def test_entries_name_a_build_or_serve_any():
    assert parse_sources(["cuda=/opt/wheels/cu124", "/home/me/wheels", "https://example.invalid/simple/"]) == [
        WheelSource("/opt/wheels/cu124", "cuda"), WheelSource("/home/me/wheels", None),
        WheelSource("https://example.invalid/simple/", None)]
    # A Windows path's drive letter is not a build.
    assert parse_sources(["C:=x"]) == [WheelSource("C:=x", None)]
