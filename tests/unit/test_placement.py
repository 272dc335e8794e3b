"""Backend choice: a table over the recorded machines (tests/fixtures/hw) and model sizes, plus the
edge cases of the policy."""

from __future__ import annotations

import pytest

from fixtures.hw.loader import fixture_env
from localserve.errors import BackendError
from localserve.store.gguf_facts import GGUFFacts
from localserve.hardware import CPUInfo, GPUInfo, HardwareReport, detect_hardware
from localserve.runtime.memory import estimate_memory
from localserve.runtime.placement import BackendChoice, Runtimes, choose_backend

GiB = 1 << 30


def _facts(**kw) -> GGUFFacts:
    base = dict(architecture="llama", name=None, n_params=0, quant="Q4_K_M", file_type_id=15, tokenizer_model="gpt2",
                chat_template=None, license=None, bos_token_id=1, eos_token_id=2, tensor_count=0, gguf_version=3)
    return GGUFFacts(**{**base, **kw})


# Shapes and sizes of the Q4_K_M files people run (Qwen2.5-7B-Instruct, Llama-3.1-70B-Instruct).
QWEN_7B = _facts(n_layers=28, n_heads=28, n_kv_heads=4, n_embd=3584, head_dim=128, head_dim_v=128, context_length=32768,
                 vocab_size=152064, file_size=4_683_073_184, weights_bytes=4_677_000_000, layer_bytes=3_924_000_000,
                 largest_layer_bytes=152_000_000, kv_heads_all_layers=112)
LLAMA_70B = _facts(n_layers=80, n_heads=64, n_kv_heads=8, n_embd=8192, head_dim=128, head_dim_v=128,
                   context_length=131072, vocab_size=128256, file_size=42_520_395_200, weights_bytes=42_510_000_000,
                   layer_bytes=41_060_000_000, largest_layer_bytes=540_000_000, kv_heads_all_layers=640)
SMALL = estimate_memory(QWEN_7B, 8192)  # 5.3 GiB
BIG = estimate_memory(LLAMA_70B, 8192)  # 43.2 GiB, 547 MiB per layer, 1.1 GiB compute

CPU_EP = "CPUExecutionProvider"
KEEP = object()  # keep the fixture's recorded runtimes

# case, variants, llama build (offload, apis), onnx providers, estimate -> backend, device, n_gpu_layers, EP, reason part
TABLE = [
    # NVIDIA H200 (141 GiB), recorded on a headless datacenter VM: nvidia-smi only, no /sys/class/drm.
    ("linux_h200", ["gguf"], KEEP, KEEP, BIG, "llamacpp", "gpu:0", -1, None, "all layers on NVIDIA H200"),
    ("linux_h200", ["gguf"], (False, []), KEEP, BIG, "llamacpp", "cpu", 0, None, "llama.cpp build has no GPU offload"),
    # NVIDIA RTX 4090 (24 GiB), CUDA build.
    ("linux_nvidia", ["gguf"], KEEP, KEEP, SMALL, "llamacpp", "gpu:0", -1, None, "all layers on NVIDIA GeForce RTX 4090"),
    ("linux_nvidia", ["gguf"], KEEP, KEEP, BIG, "llamacpp", "gpu:0", 40, None, "40/80 layers on NVIDIA GeForce RTX 4090"),
    ("linux_nvidia", ["gguf"], (False, []), KEEP, SMALL, "llamacpp", "cpu", 0, None, "llama.cpp build has no GPU offload"),
    ("linux_nvidia", ["gguf"], (True, ["Vulkan"]), KEEP, SMALL, "llamacpp", "gpu:0", -1, None, "RTX 4090"),
    ("linux_nvidia", ["onnx"], KEEP, [CPU_EP], SMALL, "onnx", "cpu", 0, CPU_EP, "CPU with ONNX Runtime"),
    ("linux_nvidia", ["onnx"], KEEP, ["CUDAExecutionProvider", CPU_EP], SMALL, "onnx", "gpu:0", 0,
     "CUDAExecutionProvider", "ONNX on NVIDIA GeForce RTX 4090"),
    # AMD RX 7900 XTX + Phoenix XDNA (an NPU generation Ryzen AI's LLM stack does not support), ROCm build.
    ("linux_amd", ["gguf"], KEEP, KEEP, SMALL, "llamacpp", "gpu:0", -1, None, "Radeon RX 7900"),
    ("linux_amd", ["gguf", "onnx"], KEEP, ["VitisAIExecutionProvider", CPU_EP], SMALL, "llamacpp", "gpu:0", -1, None,
     "Radeon RX 7900"),
    ("linux_amd", ["gguf"], KEEP, KEEP, BIG, "llamacpp", "gpu:0", 40, None, "40/80 layers"),
    ("linux_amd", ["gguf"], (True, ["CUDA"]), KEEP, SMALL, "llamacpp", "cpu", 0, None, "no GPU that llama.cpp can offload to"),
    # Strix Halo: integrated GPU with a 64 GiB carve-out, XDNA 2 NPU.
    ("linux_strix_halo", ["gguf", "onnx"], KEEP, ["VitisAIExecutionProvider", CPU_EP], SMALL, "onnx", "npu:0", 0,
     "VitisAIExecutionProvider", "ONNX on AMD NPU via VitisAIExecutionProvider"),
    ("linux_strix_halo", ["gguf"], KEEP, KEEP, BIG, "llamacpp", "gpu:0", -1, None, "all layers on AMD GPU [1002:1586]"),
    # Intel Meteor Lake: Arc iGPU (shared memory, not an offload target) + NPU.
    ("linux_intel", ["gguf", "onnx"], KEEP, ["OpenVINOExecutionProvider", CPU_EP], SMALL, "onnx", "npu:0", 0,
     "OpenVINOExecutionProvider", "Intel Meteor Lake NPU"),
    ("linux_intel", ["gguf", "onnx"], KEEP, [CPU_EP], SMALL, "llamacpp", "cpu", 0, None,
     "Intel Meteor Lake NPU unused: onnxruntime has no OpenVINOExecutionProvider"),
    ("linux_intel", ["gguf"], (True, ["Vulkan"]), KEEP, SMALL, "llamacpp", "cpu", 0, None, "no GPU that llama.cpp can offload to"),
    ("linux_intel", ["gguf"], KEEP, KEEP, BIG, "llamacpp", "cpu", 0, None, "warning: needs 43.2 GiB but RAM is 30.1 GiB"),
    # Apple M2 Pro, 32 GiB unified memory (Metal may wire 21.3 GiB); the Neural Engine is not an LLM target.
    ("apple_m2_pro", ["gguf"], KEEP, KEEP, SMALL, "llamacpp", "gpu:0", -1, None, "all layers on Apple M2 Pro GPU"),
    ("apple_m2_pro", ["gguf"], KEEP, KEEP, BIG, "llamacpp", "gpu:0", 36, None, "36/80 layers on Apple M2 Pro GPU"),
    ("apple_m2_pro", ["onnx"], KEEP, KEEP, SMALL, "onnx", "cpu", 0, CPU_EP, "CPU with ONNX Runtime"),
    # Snapdragon X Elite: Hexagon NPU via QNN; Adreno via DirectML; CPU-only llama.cpp wheel.
    ("windows_snapdragon", ["gguf", "onnx"], KEEP, ["QNNExecutionProvider", CPU_EP], SMALL, "onnx", "npu:0", 0,
     "QNNExecutionProvider", "Qualcomm(R) Hexagon(TM) NPU via QNNExecutionProvider"),
    ("windows_snapdragon", ["gguf", "onnx"], KEEP, ["DmlExecutionProvider", CPU_EP], SMALL, "onnx", "gpu:0", 0,
     "DmlExecutionProvider", "ONNX on Qualcomm(R) Adreno(TM) X1-85 GPU via DmlExecutionProvider"),
    ("windows_snapdragon", ["gguf"], KEEP, KEEP, SMALL, "llamacpp", "cpu", 0, None, "CPU with llama.cpp"),
    # Windows desktop: RTX 3060 12 GiB (CUDA build) + UHD 770 iGPU.
    ("windows_nvidia", ["gguf"], KEEP, KEEP, SMALL, "llamacpp", "gpu:0", -1, None, "all layers on NVIDIA GeForce RTX 3060"),
    ("windows_nvidia", ["gguf"], KEEP, KEEP, BIG, "llamacpp", "gpu:0", 17, None, "17/80 layers on NVIDIA GeForce RTX 3060"),
    ("windows_nvidia", ["onnx"], KEEP, ["DmlExecutionProvider", CPU_EP], SMALL, "onnx", "gpu:0", 0,
     "DmlExecutionProvider", "NVIDIA GeForce RTX 3060 via DmlExecutionProvider"),
]


@pytest.mark.parametrize(("case", "variants", "llama", "onnx", "estimate", "backend", "device", "layers", "ep", "reason"),
                         TABLE, ids=[f"{row[0]}-{'+'.join(row[1])}-{i}" for i, row in enumerate(TABLE)])
def test_choice_on_recorded_machines(case, variants, llama, onnx, estimate, backend, device, layers, ep, reason) -> None:
    overrides = {}
    if llama is not KEEP:
        overrides["llama"] = llama
    if onnx is not KEEP:
        overrides["onnx"] = onnx
    report = detect_hardware(fixture_env(case, **overrides))
    choice = choose_backend(report, variants, Runtimes.from_report(report), estimate)
    assert (choice.backend, choice.device, choice.n_gpu_layers, choice.execution_provider) == (backend, device, layers, ep)
    assert reason in choice.reason
    assert "\n" not in choice.reason


def _report(*gpus: GPUInfo, os: str = "Linux") -> HardwareReport:
    return HardwareReport(os=os, cpu=CPUInfo("x", "x86_64", 8, 16, 16, ["AVX2"]), ram_total_bytes=64 * GiB,
                          ram_available_bytes=48 * GiB, gpus=list(gpus))


def _gpu(vram: int | None, kind: str = "discrete", vendor: str = "NVIDIA", apis=("CUDA", "Vulkan")) -> GPUInfo:
    return GPUInfo(vendor, f"{vendor} test GPU", kind, vram, None, list(apis))


CUDA = Runtimes(llama_gpu_offload=True, llama_gpu_apis=("CUDA",))


def test_unknown_size_offloads_everything() -> None:
    choice = choose_backend(_report(_gpu(8 * GiB)), ["gguf"], CUDA, None)
    assert (choice.device, choice.n_gpu_layers) == ("gpu:0", -1) and "size unknown" in choice.reason


def test_gpu_too_small_for_one_layer() -> None:
    choice = choose_backend(_report(_gpu(2 * GiB)), ["gguf"], CUDA, BIG)
    assert (choice.device, choice.n_gpu_layers) == ("cpu", 0)
    assert "NVIDIA test GPU too small (1.5 GiB free)" in choice.reason


def test_biggest_usable_gpu_wins_and_unknown_backends_match_any_gpu() -> None:
    report = _report(_gpu(8 * GiB), _gpu(16 * GiB, vendor="AMD", apis=("ROCm", "Vulkan")))
    assert choose_backend(report, ["gguf"], CUDA, SMALL).device == "gpu:0"  # CUDA build cannot use the AMD card
    unknown = Runtimes(llama_gpu_offload=True)
    assert choose_backend(report, ["gguf"], unknown, SMALL).device == "gpu:1"


def test_small_igpu_carveout_is_not_an_offload_target() -> None:
    choice = choose_backend(_report(_gpu(512 << 20, kind="integrated", vendor="AMD", apis=("Vulkan",))), ["gguf"],
                            Runtimes(llama_gpu_offload=True, llama_gpu_apis=("Vulkan",)), SMALL)
    assert choice.device == "cpu"


def test_directml_only_on_windows() -> None:
    runtimes = Runtimes(onnx_providers=("DmlExecutionProvider", CPU_EP))
    assert choose_backend(_report(_gpu(12 * GiB)), ["onnx"], runtimes, SMALL).device == "cpu"
    assert choose_backend(_report(_gpu(12 * GiB), os="Windows"), ["onnx"], runtimes, SMALL).device == "gpu:0"


def test_nothing_can_run_the_model() -> None:
    with pytest.raises(BackendError, match="no installed runtime can run this model"):
        choose_backend(_report(), ["onnx"], Runtimes(), SMALL)
    with pytest.raises(BackendError):
        choose_backend(_report(), ["gguf"], Runtimes(llama_cpp=False, onnx_providers=(CPU_EP,)), SMALL)


def test_runtimes_default_from_the_report() -> None:
    report = detect_hardware(fixture_env("windows_nvidia"))
    assert Runtimes.from_report(report) == Runtimes(True, True, ("CUDA",), ())
    assert choose_backend(report, ["GGUF"], None, SMALL).as_dict() == BackendChoice(
        "llamacpp", "gpu:0", -1, "all layers on NVIDIA GeForce RTX 3060 (needs 5.3 GiB, 10.5 GiB free)", None,
        "NVIDIA GeForce RTX 3060").as_dict()


def test_a_preference_narrows_the_formats_and_says_who_asked() -> None:
    report = detect_hardware(fixture_env("windows_snapdragon", onnx=["QNNExecutionProvider", CPU_EP]))
    auto = choose_backend(report, ["gguf", "oga"], None, SMALL)  # a vendor OGA folder counts as onnx
    assert (auto.backend, auto.device, auto.execution_provider) == ("onnx", "npu:0", "QNNExecutionProvider")
    forced = choose_backend(report, ["gguf", "oga"], None, SMALL, prefer="llamacpp", requested_by="flag --backend")
    assert (forced.backend, forced.device) == ("llamacpp", "cpu")
    assert forced.reason.endswith("; backend llamacpp requested by flag --backend")
    with pytest.raises(BackendError, match="backend onnx was requested, but the model has no variant it runs"):
        choose_backend(report, ["gguf"], None, SMALL, prefer="onnx")
    with pytest.raises(BackendError, match="unknown backend 'tpu'"):
        choose_backend(report, ["gguf"], None, SMALL, prefer="tpu")
