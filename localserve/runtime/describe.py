"""A model described as data: GGUF facts, the memory a load here takes, where it would run.

`localserve show` prints it and the dashboard's hardware panel reads its placement; it sits in
runtime/ because both are above it and it asks what only the runtime knows (the registry's choice,
the limits a load gets), so neither of them imports the other.
"""

from __future__ import annotations

import time
from typing import Any

from ..config.settings import Settings
from ..errors import InvalidRequestError
from ..store.cache import InstalledModel
from ..store.projector import kinds
from .adapters import lora_files


def summary(m: InstalledModel) -> dict[str, Any]:
    return {
        "name": m.name,
        "tag": m.tag,
        "model": m.ref,
        "size": m.size,
        "quant": m.quant,
        "format": m.format,
        "sha256": m.sha256,
        "modified": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.modified)),
        "path": str(m.path),
        "in_place": m.in_place,
        # The projector stored with the tag (what a load takes as `mmproj`); `vision` and `audio`
        # are what its header promises: the loaded engine's ModelInfo says whether it loaded.
        "mmproj": str(m.mmproj) if m.mmproj is not None else None,
        "vision": "vision" in kinds(m.mmproj),
        "audio": "audio" in kinds(m.mmproj),
        "variants": {fmt: {"path": str(v.path), "size": v.size, "sha256": v.sha256, "available": v.available,
                           **({"files": len(v.files)} if v.files else {})}
                     for fmt, v in m.variants.items()},
    }


def describe_model(model: InstalledModel, settings: Settings, n_ctx: int | None = None) -> dict[str, Any]:
    """Everything `show` prints, as data: GGUF facts, memory at a context, where it would run."""
    from ..hardware import detect_hardware
    from ..store.gguf_facts import read_gguf_facts
    from ..config.kv_cache import kv_element_bytes
    from .memory import estimate_memory, kv_cache_bytes
    from .planning import gguf_limits, planned_vram

    if n_ctx is not None and n_ctx <= 0:
        raise InvalidRequestError("--ctx must be a positive number of tokens")
    report = detect_hardware()
    if model.gguf is None:  # folder variants only: no GGUF facts to size it from
        meta = next(iter(model.variants.values())).meta
        return {**summary(model), "architecture": meta.get("architecture") or meta.get("model_type"),
                "context_length": meta.get("context_length"), "memory": None,
                "placement": _placement(None, model, settings, report)}
    facts = read_gguf_facts(model.gguf.path)
    limits, estimate = gguf_limits(facts, settings, model.ref)  # what a load here gets
    ctx_given = n_ctx is not None
    if n_ctx is None:
        n_ctx = limits.n_ctx  # all KV cells, every stream or the whole pool
    else:
        estimate = estimate_memory(facts, n_ctx, kv_element_bytes(limits.kv_type))
    info: dict[str, Any] = {
        **summary(model),
        "loras": [str(p) for p in lora_files(model, settings)],  # LoRA adapters by id (adapters.py)
        "architecture": facts.architecture,
        "parameters": facts.n_params,
        "context_length": facts.context_length,
        "layers": facts.n_layers,
        "embedding_length": facts.n_embd,
        "heads": facts.n_heads,
        "kv_heads": facts.n_kv_heads,
        "quantization": facts.quant,
        "chat_template": bool(facts.chat_template),
        "license": model.manifest.get("license") or facts.license,
        "source": (model.manifest.get("source") or {}).get("ref"),
        # What the KV types save: the same cells in f16 (kv_cache_type, model_kv_cache_type).
        "memory": {"n_ctx": n_ctx, **estimate.as_dict(), "kv_f16_bytes": kv_cache_bytes(facts, estimate.n_ctx)},
        "engine": limits.describe(),
        "ctx_given": ctx_given,
    }
    info["placement"] = place = _placement(estimate, model, settings, report)
    info["memory"].update(at_rest(estimate, place))
    info["native"] = native_condition(report) if place.get("backend") == "llamacpp" else None
    # Layers a load would put on the GPU (llama.cpp's count: the output layer is one more) and
    # their memory; `ps` / /api/ps show what a loaded model actually got.
    layers = place.get("n_gpu_layers") or 0
    in_ram = place.get("experts_ram_bytes") or 0
    info["gpu"] = {"layers": facts.n_layers + 1 if layers < 0 else layers, "of_layers": facts.n_layers + 1,
                   "memory_bytes": planned_vram(layers, estimate, estimate.total_bytes, in_ram),
                   # MoE experts kept in RAM on a GPU load (cpu_moe): layers (-1: all) and bytes
                   "cpu_moe_layers": place.get("cpu_moe_layers") or 0, "experts_ram_bytes": in_ram}
    return info


def at_rest(estimate: Any, place: dict[str, Any]) -> dict[str, Any]:
    """What a loaded, idle model is expected to hold, beside the plan's total (the most it may
    hold): where llama.cpp's KV pages are committed only as requests write cells (on the CPU, where
    kv_pages.py can hook the clear, Linux), weights and compute buffers; elsewhere the KV cache is
    reserved at load, so the whole plan. The engine process's own interpreter is not counted."""
    follows = place.get("backend") == "llamacpp" and not place.get("n_gpu_layers") and _kv_pages_here()
    rest = estimate.weights_bytes + estimate.compute_bytes if follows else estimate.total_bytes
    return {"kv_follows_use": follows, "at_rest_bytes": rest}


def _kv_pages_here() -> bool:
    try:
        from ..backends.llamacpp import kv_pages
    except (ImportError, OSError):  # no llama_cpp here: nothing loads it this way
        return False
    return kv_pages.available()


def native_condition(report: Any) -> str | None:
    """A condition of this machine's llama.cpp build that decides how models load (llamacpp/probe.py)."""
    try:
        from ..backends.llamacpp.probe import condition
    except ImportError:  # no llama_cpp: nothing to say about its build
        return None
    return condition(report.cpu.model, report.cpu.features)


def _placement(estimate: Any, model: InstalledModel, settings: Settings, report: Any) -> dict[str, Any]:
    """What a load would pick, asked the way a load asks (the registry, over every variant)."""
    from .registry import choose
    from ..errors import LocalserveError

    try:
        return choose(model, settings, report, estimate).as_dict()
    except LocalserveError as e:  # nothing installed here runs it: `show` still shows the model
        return {"backend": None, "reason": str(e)}
