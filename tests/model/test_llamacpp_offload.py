"""Where a llama.cpp load put the model: the load's own log lines, captured per thread and read
by llamacpp_offload. The CPU build is loaded for real; GPU loads are replayed from recorded lines."""

from __future__ import annotations

import threading

from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.backends.llamacpp.offload import parse_load_log
from localserve.backends.llamacpp.runtime import captured_log

# The CPU build loading SmolLM2-135M Q4_1 (this machine, llama-cpp-python 0.3.36).
CPU_LOAD = """\
load_tensors:   CPU_Mapped model buffer size =    92.10 MiB
llama_context:        CPU  output buffer size =     0.38 MiB
llama_kv_cache:        CPU KV buffer size =    11.25 MiB
sched_reserve:        CPU compute buffer size =    12.28 MiB
""".splitlines()

# The Vulkan build on lavapipe, -ngl 10 of SmolLM2-135M's 30 layers (recorded from
# benchmarks/vulkan_lavapipe.py's load): the output layer counts as one of the 10; pinned host
# buffers (Vulkan_Host) are not device memory.
VULKAN_PARTIAL = """\
load_tensors: offloading output layer to GPU
load_tensors: offloading 9 repeating layers to GPU
load_tensors: offloaded 10/31 layers to GPU
load_tensors:   CPU_Mapped model buffer size =    92.10 MiB
load_tensors:      Vulkan0 model buffer size =    47.71 MiB
llama_context: Vulkan_Host  output buffer size =     0.19 MiB
llama_kv_cache:        CPU KV buffer size =     3.94 MiB
llama_kv_cache:    Vulkan0 KV buffer size =     1.69 MiB
sched_reserve:    Vulkan0 compute buffer size =    12.14 MiB
sched_reserve: Vulkan_Host compute buffer size =     0.44 MiB
""".splitlines()

# A GPU build whose only device ggml skipped (lavapipe without GGML_VK_VISIBLE_DEVICES): it still
# logs the layers it was asked for, but every buffer is on the CPU.
VULKAN_NO_DEVICE = """\
load_tensors: offloaded 31/31 layers to GPU
load_tensors:   CPU_Mapped model buffer size =    92.10 MiB
llama_kv_cache:        CPU KV buffer size =    11.25 MiB
""".splitlines()

MIB = 1024 * 1024


def test_cpu_load_has_nothing_on_a_gpu() -> None:
    facts = parse_load_log(CPU_LOAD)
    assert (facts.gpu_layers, facts.offloadable_layers, facts.gpu_memory_bytes, facts.devices) == (0, 0, 0, [])


def test_partial_offload_counts_device_buffers_only() -> None:
    facts = parse_load_log(VULKAN_PARTIAL)
    assert (facts.gpu_layers, facts.offloadable_layers) == (10, 31)
    assert facts.devices == ["Vulkan0"]
    assert facts.device_bytes == {"model": round(47.71 * MIB), "KV": round(1.69 * MIB), "compute": round(12.14 * MIB)}
    assert facts.gpu_memory_bytes == sum(facts.device_bytes.values())


def test_requested_layers_without_a_device_buffer_ran_on_the_cpu() -> None:
    facts = parse_load_log(VULKAN_NO_DEVICE)
    assert (facts.gpu_layers, facts.offloadable_layers, facts.gpu_memory_bytes) == (0, 31, 0)


def test_real_load_is_captured_on_its_own_thread(smollm2_gguf) -> None:
    """A load's lines reach its thread's capture (nested ones too) and no other thread's."""
    other: list[str] = []
    started, done = threading.Event(), threading.Event()

    def bystander() -> None:
        with captured_log() as lines:
            started.set()
            done.wait(60)
        other.extend(lines)

    t = threading.Thread(target=bystander)
    t.start()
    started.wait(10)
    with captured_log() as outer:
        backend = LlamaCppBackend.load(smollm2_gguf, n_ctx=256, n_seq_max=1, n_batch=32)
    done.set()
    t.join(10)
    try:
        assert any("CPU_Mapped model buffer size" in line for line in outer)
        assert not any("buffer size" in line for line in other)
        # The CPU build (what CI installs): nothing offloaded, and the engine's info says so.
        assert (backend.info.gpu_layers, backend.info.gpu_memory_bytes) == (0, 0)
        assert backend.offload.devices == []
    finally:
        backend.close()
