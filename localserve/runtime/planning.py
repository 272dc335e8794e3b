"""Planning a load: the engine limits, memory and backend a model gets here, and the memory the
loaded models may use together.

Context size per model (EngineLimits.from_settings decides; see batching/limits.py): every request
gets settings.context_length, or min(trained context, 8192). Where a share of the RAM the weights
leave over holds a KV stream of that length for every sequence id (running and parked prefix-cache
ones), each id gets one (exact answers); otherwise one shared q8_0 pool of up to max_sequences x
context cells serves them all (settings.kv_layout, kv_cache_type). The memory a load is charged is
the estimate for the whole KV cache plus weights and compute buffers (memory.estimate_memory); the
device and GPU layer count come from placement.choose_backend over the hardware report.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

from ..config.kv_cache import kv_element_bytes, model_kv_type
from ..config.per_model import per_model_value
from ..config.settings import Settings
from ..errors import BackendError, ConfigError, LocalserveError
from ..store.cache import InstalledModel
from .plan import ModelPlan

if TYPE_CHECKING:  # the engine pulls in llama.cpp; planning must import without it
    from ..batching.limits import EngineLimits
    from ..engine.local import Engine
    from ..store.gguf_facts import GGUFFacts
    from .memory import MemoryEstimate

BUDGET_FRACTION = 0.9  # of available RAM / free VRAM: leave room for the OS and the daemon itself


_report_lock = threading.Lock()


def hardware_report() -> Any:
    """Probed once per process: probes spawn tools like nvidia-smi, too slow to repeat per load.
    The daemon starts the probe in the background at start (warm_start.py); a load that asks
    meanwhile waits for that probe under the lock rather than running a second one beside it
    (lru_cache alone lets two concurrent first calls both probe)."""
    with _report_lock:
        return _probed_hardware()


@functools.lru_cache(maxsize=1)
def _probed_hardware() -> Any:
    from ..hardware import detect_hardware

    return detect_hardware()


def plan_model(installed: InstalledModel, settings: Settings) -> ModelPlan:
    """Limits, memory and backend for a load, over every format the tag holds (backends.registry
    chooses). Sizes come from the GGUF's facts; a tag with only folder variants is charged its
    files' size, since its KV layout is the (future) ONNX backend's to say."""
    from . import registry
    from ..backends.llamacpp.sizing import plan_kv as llamacpp_plan_kv
    from ..batching.limits import EngineLimits
    from ..store.gguf_facts import GGUFFacts, read_gguf_facts

    estimate = None
    if installed.gguf is not None:
        try:
            facts = GGUFFacts.from_dict(installed.facts) if installed.facts else read_gguf_facts(installed.gguf.path)
        except LocalserveError:
            facts = read_gguf_facts(installed.gguf.path)  # an older manifest without every fact: read the file
        limits, estimate = gguf_limits(facts, settings, installed.ref)
        memory = estimate.total_bytes
    else:
        folder = next(iter(installed.variants.values()))
        limits = EngineLimits.from_settings(settings, n_ctx_train=int(folder.meta.get("context_length") or 0),
                                            model_bytes=folder.size, plan_kv=llamacpp_plan_kv,
                                            kv_type=model_kv_type(settings.model_kv_cache_type, installed.ref))
        memory = folder.size
    limits.speculative = speculative_mode(settings, installed.ref)
    report = hardware_report()
    choice = registry.choose(installed, settings, report, estimate)
    vram = planned_vram(choice.n_gpu_layers, estimate, memory, choice.experts_ram_bytes)
    return ModelPlan(
        limits=limits,
        memory_bytes=memory,
        n_gpu_layers=choice.n_gpu_layers,
        device=choice.device,
        vram_bytes=vram,
        choice=choice,
        cpu=report.cpu,
    )


def speculative_mode(settings: Settings, ref: str) -> str:
    """The `speculative` mode the model `ref` is served with: its `model_speculative` item, else
    the setting."""
    from ..batching.speculation import MODES

    mode = per_model_value(settings.model_speculative, ref, "model_speculative", MODES)
    mode = mode or settings.speculative.strip().lower()
    if mode not in MODES:
        raise ConfigError(f"setting 'speculative': {settings.speculative!r} is not one of {', '.join(MODES)}")
    return mode


def planned_vram(n_gpu_layers: int, estimate: "MemoryEstimate | None", memory: int, experts_ram_bytes: int = 0) -> int:
    """The part of `memory` a load with `n_gpu_layers` (-1: all) is expected to put on the GPU;
    MoE experts kept in RAM (cpu_moe, `experts_ram_bytes`) are not."""
    if n_gpu_layers == 0:
        return 0
    if estimate is None or n_gpu_layers < 0 or not estimate.n_layers:
        return max(0, memory - experts_ram_bytes)
    return max(0, min(memory, n_gpu_layers * estimate.layer_bytes) - experts_ram_bytes)


def gguf_limits(facts: "GGUFFacts", settings: Settings, ref: str = "") -> tuple["EngineLimits", "MemoryEstimate"]:
    """The engine limits a load of this GGUF (the model `ref`) gets here and their memory (what
    `show` prints too)."""
    # Sized by llama.cpp's rules (pure arithmetic, no llama_cpp import): a plan is made before the
    # registry chooses the backend, and every load has been sized for llama.cpp so far.
    from ..backends.llamacpp.sizing import plan_kv as llamacpp_plan_kv
    from ..batching.limits import EngineLimits
    from .memory import estimate_memory, kv_cache_bytes

    limits = EngineLimits.from_settings(settings, n_ctx_train=facts.context_length, model_bytes=facts.weights_bytes,
                                        kv_bytes_per_token=kv_cache_bytes(facts, 1), plan_kv=llamacpp_plan_kv,
                                        kv_type=model_kv_type(settings.model_kv_cache_type, ref))
    streams = 1 if limits.kv_unified else limits.n_seq_max
    estimate = estimate_memory(facts, limits.n_ctx // streams, kv_element_bytes(limits.kv_type), n_seq=streams,
                               flash_attention=limits.flash_attention)
    return limits, estimate


def load_engine(installed: InstalledModel, settings: Settings) -> "Engine":
    """The default loader: plan, then the backend the plan chose (backends/registry.py), started."""
    from . import registry

    if not installed.available:
        raise BackendError(f"the files of model {installed.ref} are missing; pull or add it again")
    return registry.load(installed, plan_model(installed, settings), settings)


def memory_budget(settings: Settings, ours_ram_bytes: int = 0) -> int:
    """Bytes the loaded models may use together, asked each time a load must be decided: the RAM
    the machine has available now (psutil) plus what our own loaded models are charged in RAM (they
    would give it back), and the free VRAM the hardware report saw before any load, less a safety
    share. Another program that grows shrinks the budget; one that quits grows it. A model larger
    than the budget still loads when it is alone (llama.cpp maps weights from disk), it just never
    shares."""
    import psutil

    report = hardware_report()
    memory = psutil.virtual_memory()
    ram = min(memory.total, memory.available + ours_ram_bytes)
    from .placement import usable_llama_gpus

    # Every card llama.cpp offloads to: a model may be split over several (config/gpu_split.py).
    vram = sum(g.vram_free_bytes or g.vram_bytes or 0 for _, g in usable_llama_gpus(report))
    return int((ram + vram) * BUDGET_FRACTION)
