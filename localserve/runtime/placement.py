"""Which backend and device a model runs on: a pure function of what the machine has, which model
formats are available, which runtimes are installed and how much memory the model needs.

Order of preference, first that applies wins:
 1. an NPU whose vendor stack supports LLMs, an ONNX variant, and the matching ONNX Runtime EP
    (QNN for Qualcomm Hexagon, VitisAI for AMD XDNA 2, OpenVINO for Intel) -> onnx on the NPU;
 2. a GGUF, a llama.cpp build with a backend for the GPU, and the whole model fits -> full offload;
    a mixture-of-experts model that does not fit but whose weights other than its experts do ->
    full offload with every layer's experts in RAM (cpu_moe "auto"; config/moe.py); before that,
    on several GPUs, every layer over the cards, shares by free memory (config/gpu_split.py);
 3. an ONNX variant and a GPU execution provider (DirectML on Windows GPUs, CUDA) that fits -> onnx;
 4. a GGUF and at least one layer fits on the GPU -> partial offload of as many layers as fit;
 5. the CPU (llama.cpp for GGUF, ONNX Runtime's CPU EP otherwise).

A preference (`backend` setting, `--backend`, a per-model entry in `model_backends`) other than
`auto` narrows the formats to the ones that backend runs, and the reason says who asked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from ..config.gpu_split import SplitPrefs
from ..errors import BackendError
from ..hardware.report import GPUInfo, HardwareReport
from .memory import MemoryEstimate, experts_in_ram, format_bytes

GiB = 1 << 30
BACKENDS = ("llamacpp", "onnx")
PREFERENCES = ("auto", *BACKENDS)
# The store's formats and the backend that runs each: our ONNX export and onnxruntime-genai folders
# both run on ONNX Runtime's execution providers.
FORMAT_BACKEND = {"gguf": "llamacpp", "onnx": "onnx", "oga": "onnx"}
# Memory a GPU runtime takes before any tensor (CUDA/ROCm context, cuBLAS workspace, driver
# allocations). Ollama budgets 457 MiB ("MinimumMemory"); we round up.
GPU_RESERVE = 512 << 20
# An integrated GPU is worth offloading to only with a large dedicated carve-out (Strix Halo, Arc
# with big BIOS allocations); a 512 MiB iGPU slice only moves work off a faster CPU path.
MIN_IGPU_CARVEOUT = 8 * GiB

# ONNX Runtime EPs that run on a GPU of a given vendor, best first. DirectML runs on any Windows GPU.
GPU_PROVIDERS = {
    "NVIDIA": ["CUDAExecutionProvider", "DmlExecutionProvider"],
    "AMD": ["MIGraphXExecutionProvider", "DmlExecutionProvider"],
    "Intel": ["OpenVINOExecutionProvider", "DmlExecutionProvider"],
    "Qualcomm": ["DmlExecutionProvider"],
}


@dataclass(frozen=True)
class Runtimes:
    """Installed inference runtimes. Empty `llama_gpu_apis` means "unknown": any GPU may do."""

    llama_cpp: bool = True
    llama_gpu_offload: bool = False
    llama_gpu_apis: tuple[str, ...] = ()
    onnx_providers: tuple[str, ...] = ()  # empty: onnxruntime not installed

    @classmethod
    def from_report(cls, report: HardwareReport) -> "Runtimes":
        return cls(
            llama_cpp=report.llama_gpu_offload is not None,
            llama_gpu_offload=bool(report.llama_gpu_offload),
            llama_gpu_apis=tuple(report.llama_gpu_apis),
            onnx_providers=tuple(report.onnx_providers or ()),
        )


@dataclass(frozen=True)
class BackendChoice:
    backend: Literal["llamacpp", "onnx"]
    device: str  # "cpu", "gpu:N" or "npu:N" (index into the report's gpus / npus)
    n_gpu_layers: int  # llama.cpp: -1 = every layer and the output, 0 = none
    reason: str  # one line, shown by `show`
    execution_provider: str | None = None  # onnx only
    device_name: str = "CPU"
    # onnx only: the tag has no ONNX variant yet; the load converts its GGUF first (registry.py)
    convert: bool = False
    # llama.cpp: the first N layers' MoE experts stay in RAM (-1: all); the rest of them goes where
    # n_gpu_layers says. `experts_ram_bytes` is their size.
    cpu_moe_layers: int = 0
    experts_ram_bytes: int = 0
    # llama.cpp on several GPUs: llama_split_mode's name, the card that holds it all with "none"
    # (llama.cpp's index among the usable GPUs), each card's share, and each card's planned bytes.
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    vram_per_device: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _gpu_budget(gpu: GPUInfo) -> int | None:
    memory = gpu.vram_free_bytes if gpu.vram_free_bytes is not None else gpu.vram_bytes
    return None if memory is None else memory - GPU_RESERVE


def _llama_can_use(gpu: GPUInfo, runtimes: Runtimes) -> bool:
    if gpu.vram_bytes is None:
        return False
    if gpu.kind == "integrated" and gpu.vram_bytes < MIN_IGPU_CARVEOUT:
        return False
    return not runtimes.llama_gpu_apis or any(api in runtimes.llama_gpu_apis for api in gpu.apis)


def _fits(estimate: MemoryEstimate | None, budget: int | None) -> bool:
    return estimate is None or (budget is not None and estimate.total_bytes <= budget)


def _needs(estimate: MemoryEstimate | None) -> str:
    return f"needs {format_bytes(estimate.total_bytes)}" if estimate else "size unknown"


def _choose_npu(report: HardwareReport, runtimes: Runtimes, notes: list[str]) -> BackendChoice | None:
    for i, npu in enumerate(report.npus):
        if not npu.llm_capable:
            continue
        ep = next((p for p in npu.execution_providers if p in runtimes.onnx_providers), None)
        if ep is None:
            wanted = npu.execution_providers[0] if npu.execution_providers else "a matching execution provider"
            notes.append(f"{npu.name} unused: onnxruntime has no {wanted}")
            continue
        return BackendChoice("onnx", f"npu:{i}", 0, f"ONNX on {npu.name} via {ep}", ep, npu.name)
    return None


def _choose_onnx_gpu(report: HardwareReport, runtimes: Runtimes, estimate: MemoryEstimate | None) -> BackendChoice | None:
    for i, gpu in enumerate(report.gpus):
        for ep in GPU_PROVIDERS.get(gpu.vendor, []):
            if ep not in runtimes.onnx_providers or (ep == "DmlExecutionProvider" and report.os != "Windows"):
                continue
            # Integrated GPUs share system RAM: they fit whatever the RAM check lets through.
            budget = _gpu_budget(gpu) if gpu.kind != "integrated" or gpu.vram_bytes else report.ram_available_bytes
            if _fits(estimate, budget):
                return BackendChoice("onnx", f"gpu:{i}", 0, f"ONNX on {gpu.name} via {ep} ({_needs(estimate)})", ep, gpu.name)
    return None


def choose_backend(
    report: HardwareReport,
    variants: Sequence[str],
    runtimes: Runtimes | None = None,
    estimate: MemoryEstimate | None = None,
    prefer: str = "auto",
    requested_by: str = "",
    cpu_moe: int | None = None,
    split: SplitPrefs = SplitPrefs(),
) -> BackendChoice:
    """Pick backend, device and GPU layer count for a model available in `variants` ("gguf",
    "onnx", "oga"), needing `estimate` memory (None: unknown size, assume it fits). `prefer` is
    "auto" or the one backend to use; `requested_by` says where that came from, for the reason.
    `cpu_moe`: the layers whose MoE experts stay in RAM on a GPU (-1: all; None: auto, all
    exactly when the model fits only without them). `split`: how several GPUs share a model."""
    runtimes = runtimes or Runtimes.from_report(report)
    formats = {"onnx" if v.lower() == "oga" else v.lower() for v in variants}
    if prefer != "auto":
        if prefer not in BACKENDS:
            raise BackendError(f"unknown backend {prefer!r}; choose one of {', '.join(PREFERENCES)}")
        wanted = {f for f in formats if FORMAT_BACKEND.get(f) == prefer}
        if not wanted:
            have = ", ".join(sorted(formats)) or "no variants"
            raise BackendError(f"backend {prefer} was requested{_by(requested_by)}, but the model has no variant "
                               f"it runs (it has {have})")
        choice = choose_backend(report, sorted(wanted), runtimes, estimate, cpu_moe=cpu_moe, split=split)
        return dataclasses.replace(choice, reason=f"{choice.reason}; backend {prefer} requested{_by(requested_by)}")
    has_gguf = "gguf" in formats and runtimes.llama_cpp
    has_onnx = "onnx" in formats and bool(runtimes.onnx_providers)
    notes: list[str] = []

    if has_onnx and (choice := _choose_npu(report, runtimes, notes)):
        return choice

    usable = usable_llama_gpus(report, runtimes) if has_gguf else []
    gpu_index, gpu = max(usable, key=lambda item: _gpu_budget(item[1]) or 0) if usable else (None, None)
    if has_gguf and report.gpus and not runtimes.llama_gpu_offload:
        notes.append("llama.cpp build has no GPU offload")
    budget = _gpu_budget(gpu) if gpu else None
    if split.shares and (choice := _choose_split(usable, estimate, split)):
        return choice  # shares asked for: split even where one card would do, as llama-server does
    if gpu is not None and (choice := _choose_full_offload(gpu_index, gpu, estimate, budget, cpu_moe or 0)):
        return _on_one_card(choice, usable, gpu_index)
    if choice := _choose_split(usable, estimate, split):
        return choice
    if gpu is not None and cpu_moe is None and (choice := _choose_full_offload(gpu_index, gpu, estimate, budget, None)):
        return _on_one_card(choice, usable, gpu_index)

    if has_onnx and (choice := _choose_onnx_gpu(report, runtimes, estimate)):
        return choice

    if gpu is not None and estimate is not None and budget is not None and estimate.layer_bytes > 0:
        layers = min((budget - estimate.compute_bytes) // estimate.layer_bytes, estimate.n_layers)
        if layers >= 1:
            reason = (f"{layers}/{estimate.n_layers} layers on {gpu.name} ({format_bytes(budget)} free, "
                      f"model {_needs(estimate)}), rest on CPU")
            return _on_one_card(BackendChoice("llamacpp", f"gpu:{gpu_index}", int(layers), reason, None, gpu.name,
                                              cpu_moe_layers=cpu_moe or 0,
                                              experts_ram_bytes=experts_in_ram(estimate, cpu_moe or 0)),
                                usable, gpu_index)
        notes.append(f"{gpu.name} too small ({format_bytes(budget)} free)")

    return _choose_cpu(report, has_gguf, has_onnx, runtimes, estimate, notes, formats)


def _choose_full_offload(gpu_index: int | None, gpu: GPUInfo, estimate: MemoryEstimate | None, budget: int | None,
                         cpu_moe: int | None) -> BackendChoice | None:
    """Every layer on `gpu` where the model fits: whole, or without the experts `cpu_moe` keeps in
    RAM; with cpu_moe auto (None), without every layer's experts where it fits only that way."""
    layers = cpu_moe if cpu_moe is not None else 0 if _fits(estimate, budget) else -1
    in_ram = experts_in_ram(estimate, layers)
    if estimate is not None and (budget is None or estimate.total_bytes - in_ram > budget):
        return None
    if not in_ram:
        reason = f"all layers on {gpu.name} ({_needs(estimate)}, {format_bytes(budget or 0)} free)"
        return BackendChoice("llamacpp", f"gpu:{gpu_index}", -1, reason, None, gpu.name)
    assert estimate is not None and budget is not None
    whose = "every layer's" if in_ram == estimate.expert_bytes else f"the first {layers} layers'"
    reason = (f"all layers on {gpu.name} but {whose} MoE experts ({format_bytes(in_ram)}) in RAM "
              f"({format_bytes(estimate.total_bytes - in_ram)} on the GPU, {format_bytes(budget)} free)")
    return BackendChoice("llamacpp", f"gpu:{gpu_index}", -1, reason, None, gpu.name, cpu_moe_layers=layers,
                         experts_ram_bytes=in_ram)


def _by(requested_by: str) -> str:
    return f" by {requested_by}" if requested_by else ""


def usable_llama_gpus(report: HardwareReport, runtimes: Runtimes | None = None) -> list[tuple[int, GPUInfo]]:
    """(report index, GPU) of the GPUs this llama.cpp build offloads to, in the report's order,
    which is taken as llama.cpp's device order (nvidia-smi lists cards by PCI bus; CUDA orders the
    same for alike cards, unless CUDA_DEVICE_ORDER says otherwise)."""
    runtimes = runtimes or Runtimes.from_report(report)
    if not runtimes.llama_gpu_offload:
        return []
    return [(i, g) for i, g in enumerate(report.gpus) if _llama_can_use(g, runtimes)]


def _on_one_card(choice: BackendChoice, usable: list[tuple[int, GPUInfo]], gpu_index: int | None) -> BackendChoice:
    """A choice of one card where there are several: llama.cpp's default spreads layers over every
    card, so it is told to keep to this one (split "none", main_gpu)."""
    if len(usable) < 2:
        return choice
    main = next(pos for pos, (i, _) in enumerate(usable) if i == gpu_index)
    return dataclasses.replace(choice, split_mode="none", main_gpu=main)


def _choose_split(usable: list[tuple[int, GPUInfo]], estimate: MemoryEstimate | None,
                  split: SplitPrefs) -> BackendChoice | None:
    """Every layer over several cards, each holding its share (the asked shares, else shares by
    free memory) where every share fits its card; None where there is one card, split is "none",
    or a share does not fit."""
    if split.mode == "none" or len(usable) < 2:
        return None
    budgets = [_gpu_budget(g) or 0 for _, g in usable]
    shares = (tuple(split.shares) + (0.0,) * len(usable))[:len(usable)] if split.shares else tuple(map(float, budgets))
    if not any(shares):
        return None
    compute, head = (estimate.compute_bytes, estimate.non_layer_bytes) if estimate else (0, 0)
    layers = estimate.total_bytes - compute - head if estimate else 0
    last = max(k for k, s in enumerate(shares) if s > 0)
    # Each card holds its share of the layers and their KV, and a compute buffer of its own; the
    # output head goes with llama.cpp's last layer to the last card (on lavapipe's two devices,
    # SmolLM2 at 1,1: 16/15 layers, 39 and 74 MiB), so that card is charged it whole.
    need = [round(layers * s / sum(shares)) + (compute if s else 0) + (head if k == last else 0)
            for k, s in enumerate(shares)]
    if estimate is not None and any(n > b for n, b in zip(need, budgets)):
        return None
    cards = [(i, g, n, b) for (i, g), n, b, s in zip(usable, need, budgets, shares) if s > 0]
    where = ", ".join(f"{format_bytes(n)} on {g.name} #{i} ({format_bytes(b)} free)" for i, g, n, b in cards)
    reason = f"all layers over {len(cards)} GPUs, {split.mode} split ({where}; {_needs(estimate)})"
    return BackendChoice("llamacpp", "gpu:" + ",".join(str(i) for i, _, _, _ in cards), -1, reason, None,
                         " + ".join(g.name for _, g, _, _ in cards), split_mode=split.mode,
                         tensor_split=tuple(s / sum(shares) for s in shares), vram_per_device=tuple(need))


def _choose_cpu(report: HardwareReport, has_gguf: bool, has_onnx: bool, runtimes: Runtimes,
                estimate: MemoryEstimate | None, notes: list[str], formats: set[str]) -> BackendChoice:
    if not notes:
        notes.append("no GPU that llama.cpp can offload to" if report.gpus else "no GPU found")
    if estimate is not None and report.ram_total_bytes and estimate.total_bytes > report.ram_total_bytes:
        notes.append(f"warning: {_needs(estimate)} but RAM is {format_bytes(report.ram_total_bytes)}")
    detail = "; ".join(notes)
    if has_gguf:
        return BackendChoice("llamacpp", "cpu", 0, f"CPU with llama.cpp ({detail})")
    if has_onnx and "CPUExecutionProvider" in runtimes.onnx_providers:
        return BackendChoice("onnx", "cpu", 0, f"CPU with ONNX Runtime ({detail})", "CPUExecutionProvider")
    have = ", ".join(sorted(formats)) or "no variants"
    raise BackendError(f"no installed runtime can run this model ({have}); install llama-cpp-python or onnxruntime")
