"""Backend registry: from placement's BackendChoice to a loaded engine, one entry per backend.

`choose` is the one place that turns a model's stored formats, the hardware report and the user's
preference (`backend`, `model_backends`, `--backend`) into a BackendChoice: `plan_model`, `show`
and `hw` all ask it, so what they print is what a load does. With `auto`, a choice whose backend
cannot load here (not installed, not built yet) falls back to the next format the model has, and
the reason says what would have been preferred and why it was not taken. An explicit preference is
obeyed; its load then fails with the backend's own reason.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..config.gpu_split import split_prefs
from ..config.moe import cpu_moe_layers
from ..config.per_model import per_model_value
from ..config.settings import Settings
from ..errors import BackendError, ConfigError
from .adapters import checked_lora_files, lora_files
from .placement import BACKENDS, FORMAT_BACKEND, PREFERENCES, BackendChoice, Runtimes, choose_backend

if TYPE_CHECKING:  # the engine pulls in llama.cpp; choosing a backend must import without it
    from ..protocol.engine import ModelEngine
    from ..hardware import HardwareReport
    from .memory import MemoryEstimate
    from .plan import ModelPlan
    from ..store.cache import InstalledModel, StoredVariant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendEntry:
    name: str
    formats: tuple[str, ...]  # store formats it runs, best first
    missing: Callable[[], str | None]  # None when it can load here, else why not (one line)
    load: Callable[["InstalledModel", "StoredVariant", "ModelPlan", Settings], "ModelEngine"]


def _llamacpp_missing() -> str | None:
    return None if importlib.util.find_spec("llama_cpp") else "llama-cpp-python is not installed"


def _load_llamacpp(installed: "InstalledModel", variant: "StoredVariant", plan: "ModelPlan",
                   settings: Settings) -> "ModelEngine":
    if (why_not := _llamacpp_missing()) is not None:
        raise BackendError(f"{installed.ref}: {why_not}")
    from ..engine.local import Engine
    from ..backends.llamacpp.backend import LlamaCppBackend
    from ..backends.llamacpp.loading import GpuSplit
    from ..backends.llamacpp.probe import extra_buffers_allowed

    limits = plan.limits
    cpu = plan.cpu  # the report plan_model took: probed once per process
    backend = LlamaCppBackend.load(
        variant.path,
        n_ctx=limits.n_ctx,
        n_seq_max=limits.n_seq_max,
        n_batch=limits.batch_tokens,
        n_threads=settings.threads or None,
        n_gpu_layers=plan.n_gpu_layers,
        cpu_moe_layers=plan.choice.cpu_moe_layers if plan.choice is not None else 0,
        split=GpuSplit.of(plan.choice),
        kv_unified=limits.kv_unified,
        flash_attention=limits.flash_attention,
        kv_type=limits.kv_type,
        extra_buffers=extra_buffers_allowed(variant.path, cpu.model, cpu.features),
        mmproj=installed.mmproj,
        loras=checked_lora_files(installed, settings),
    )
    engine = Engine(backend, limits, installed.ref, prompt_disk=_prompt_disk(backend, variant, plan, settings))
    engine.start()
    return engine


def _prompt_disk(backend, variant: "StoredVariant", plan: "ModelPlan", settings: Settings):
    """The prompt cache on disk for a loaded llama.cpp model (engine/prompt_disk.py), keyed by the
    model file's sha256 and what makes its saved states readable; None where it is off."""
    limits = plan.limits
    if not (settings.prompt_cache_disk_bytes and limits.prefix_cache and variant.sha256):
        return None
    from ..backends.llamacpp.seq_state import SeqState, state_key
    from ..engine.prompt_disk import PromptDisk
    from ..store.prompt_cache import PromptDiskCache

    key = state_key(kv_unified=limits.kv_unified, kv_type=limits.kv_type,
                    flash_attention=limits.flash_attention, exact_attention=backend.exact_attention)
    try:
        files = PromptDiskCache(settings.home, variant.sha256, key, settings.prompt_cache_disk_bytes).open()
    except OSError as e:  # a read-only or full data home: serve without it
        log.warning("prompt cache on disk off for this load: %s", e)
        return None
    return PromptDisk(files, SeqState(backend))


def _onnx_missing() -> str | None:
    if importlib.util.find_spec("onnxruntime") is None:
        return "onnxruntime is not installed (pip install 'localserve[onnx]')"
    return None


def _load_onnx(installed: "InstalledModel", variant: "StoredVariant", plan: "ModelPlan",
               settings: Settings) -> "ModelEngine":
    variant.verify(installed.ref)  # a corrupt folder is named as such, before any backend question
    if lora_files(installed, settings):  # served without them, every request would answer unadapted
        raise BackendError(f"{installed.ref}: LoRA adapters run on llama.cpp only; set model_backends "
                           f"\"{installed.ref}=llamacpp\"")
    if (why_not := _onnx_missing()) is not None:
        raise BackendError(f"{installed.ref}: {why_not}")
    if variant.format == "oga":  # served by onnxruntime-genai's own engine, not our scheduler
        if importlib.util.find_spec("onnxruntime_genai") is None:
            raise BackendError(f"{installed.ref}: onnxruntime-genai is not installed "
                               "(pip install 'localserve[onnx-genai]')")
        from .oga_loader import load_oga_engine

        return load_oga_engine(installed, variant, plan, settings)
    from .onnx_loader import load_onnx_engine

    return load_onnx_engine(installed, variant, plan, settings)


REGISTRY: dict[str, BackendEntry] = {
    "llamacpp": BackendEntry("llamacpp", ("gguf",), _llamacpp_missing, _load_llamacpp),
    "onnx": BackendEntry("onnx", ("onnx", "oga"), _onnx_missing, _load_onnx),
}
assert set(REGISTRY) == set(BACKENDS)


def preference(settings: Settings, ref: str) -> tuple[str, str]:
    """(backend or "auto", who asked) for the model `name:tag`: a `model_backends` item naming
    the tag wins over one naming the model, which wins over the `backend` setting."""
    chosen = per_model_value(settings.model_backends, ref, "model_backends", PREFERENCES)
    if chosen is not None:
        return chosen, "setting model_backends"
    backend = settings.backend.strip().lower()
    if backend not in PREFERENCES:
        raise ConfigError(f"setting 'backend': {settings.backend!r} is not one of {', '.join(PREFERENCES)}")
    source = settings.sources.get("backend", "default")
    return backend, ("" if source == "default" else source)


def choose(installed: "InstalledModel", settings: Settings, report: "HardwareReport",
           estimate: "MemoryEstimate | None") -> BackendChoice:
    """The backend, device and EP `installed` gets here, and why (see the module docstring)."""
    prefer, requested_by = preference(settings, installed.ref)
    formats = list(installed.variants)
    convertible_gguf = convertible(installed)
    runtimes = Runtimes.from_report(report)
    cpu_moe = cpu_moe_layers(settings.cpu_moe, settings.n_cpu_moe, settings.model_cpu_moe, installed.ref)
    split = split_prefs(settings.split_mode, settings.tensor_split, settings.model_split_mode,
                        settings.model_tensor_split, installed.ref)
    choice = choose_backend(report, formats + ["onnx"] * convertible_gguf, runtimes, estimate, prefer, requested_by,
                            cpu_moe, split)
    if convertible_gguf and choice.backend == "onnx":
        choice = dataclasses.replace(choice, convert=True,
                                     reason=f"{choice.reason}; its GGUF is converted to ONNX on first use")
    why_not = REGISTRY[choice.backend].missing()
    if prefer != "auto" or why_not is None:
        return choice
    rest = [f for f in formats if FORMAT_BACKEND.get(f) != choice.backend]
    if not rest:
        return choice  # nothing else to run it with: the load says why_not
    fallback = choose_backend(report, rest, runtimes, estimate, cpu_moe=cpu_moe, split=split)
    preferred = f"{choice.backend} on {choice.device_name}" + (
        f" via {choice.execution_provider}" if choice.execution_provider else "")
    return dataclasses.replace(fallback, reason=f"{fallback.reason}; {preferred} would be preferred, but {why_not}")


def convertible(installed: "InstalledModel") -> bool:
    """The tag has a GGUF and no ONNX variant, `localserve convert` handles its architecture and
    onnxruntime is here: the onnx backend can take it, after a conversion on first use. (Its
    tensor types are checked by the conversion itself, before any work.)"""
    if installed.gguf is None or {"onnx", "oga"} & set(installed.variants) or _onnx_missing():
        return False
    from ..convert.spec import SUPPORTED_ARCHS
    from ..store.gguf_facts import read_gguf_facts

    architecture = installed.facts.get("architecture")
    if architecture is None and installed.gguf.available:  # an older manifest without the facts
        try:
            architecture = read_gguf_facts(installed.gguf.path).architecture
        except Exception:  # noqa: BLE001 - an unreadable GGUF: its load says what is wrong
            return False
    return architecture in SUPPORTED_ARCHS


def variant_for(installed: "InstalledModel", choice: BackendChoice) -> "StoredVariant":
    """The stored variant the chosen backend loads (its first format the tag holds)."""
    for fmt in REGISTRY[choice.backend].formats:
        if fmt in installed.variants:
            return installed.variants[fmt]
    raise BackendError(f"model {installed.ref} has no variant the {choice.backend} backend runs")


def load(installed: "InstalledModel", plan: "ModelPlan", settings: Settings) -> "ModelEngine":
    """Load `installed` with the backend its plan chose; BackendError (no paths) when it cannot."""
    choice: BackendChoice = plan.choice
    entry = REGISTRY[choice.backend]
    if choice.convert:
        from ..convert.first_use import convert_for_load

        installed = convert_for_load(installed, settings, choice.execution_provider)
    variant = variant_for(installed, choice)
    if not variant.available:
        raise BackendError(f"the {variant.format} variant of model {installed.ref} is missing; pull or add it again")
    if not settings.engine_workers:
        return entry.load(installed, variant, plan, settings)
    # The same loader, run in a worker process of the model's own (engine/worker/): what it loads
    # and runs there can crash that process only.
    import logging

    from ..engine.worker.proxy import WorkerEngine

    return WorkerEngine.start(installed.ref, entry.load, (installed, variant, plan, settings),
                              log_path=settings.log_dir / f"engine-{_file_safe(installed.ref)}.log",
                              hang_timeout=settings.engine_hang_timeout,
                              log_level=logging.getLogger().getEffectiveLevel(),
                              vocab_gguf=variant.path if variant.format == "gguf" else None)


def _file_safe(ref: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in ref)
