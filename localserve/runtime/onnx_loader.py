"""From the registry's plan to a running Engine over the ONNX backend (backends/registry.py).

The execution provider is placement's choice; one onnxruntime here cannot initialise (VitisAI
named by the hardware report but not installed in this onnxruntime, say) falls back to the CPU EP
with the reason logged. The tokenizer is the tag's GGUF variant's, which must be the GGUF the graph
was converted from (localserve-onnx.json names its sha256).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from ..backends.onnx.kv import MAX_SLOTS
from ..config.settings import Settings
from ..errors import BackendError

if TYPE_CHECKING:
    from ..protocol.engine import ModelEngine
    from .plan import ModelPlan
    from ..store.cache import InstalledModel, StoredVariant

log = logging.getLogger(__name__)


def providers_for(ep: str | None, ref: str) -> list[str]:
    """[ep, CPU] when onnxruntime has `ep`, else [CPU] with the reason logged."""
    import onnxruntime as ort

    from ..backends.onnx.session import CPU_EP

    if not ep or ep == CPU_EP:
        return [CPU_EP]
    if ep not in ort.get_available_providers():
        log.warning("%s: %s is not available in this onnxruntime (%s); running on the CPU EP",
                    ref, ep, ", ".join(ort.get_available_providers()))
        return [CPU_EP]
    return [ep, CPU_EP]


def kv_slots(meta: dict, planned: int) -> int:
    """The KV pool: a static folder's graphs fix it (the engine's limits must agree; a broken entry
    is the backend's to refuse), else the plan's within MAX_SLOTS."""
    static = meta.get("static") if meta.get("flavour") == "static" else None
    try:
        return int(static["slots"])
    except (TypeError, KeyError, ValueError):
        return min(planned, MAX_SLOTS)


def load_onnx_engine(installed: "InstalledModel", variant: "StoredVariant", plan: "ModelPlan",
                     settings: Settings) -> "ModelEngine":
    from ..engine.local import Engine
    from ..store.model_dirs import ONNX, check_layout
    from ..backends.onnx.load import load_onnx

    # Again at load, not only at add: a folder stored before the graph checks existed, or changed
    # since, must not hand onnxruntime an external-data name that leaves it.
    check_layout(variant.path, ONNX)
    want = (variant.meta.get("tokenizer") or {}).get("gguf_sha256")
    gguf = installed.gguf
    if gguf is None or not gguf.available or (want and gguf.sha256 and gguf.sha256 != want):
        raise BackendError(f"{installed.ref}: the ONNX variant needs the GGUF it was converted from "
                           "(its tokenizer); pull that GGUF into the same tag or convert again")
    limits = dataclasses.replace(plan.limits, n_ctx=kv_slots(variant.meta, plan.limits.n_ctx))
    backend = load_onnx(
        variant.path, gguf.path,
        n_ctx=limits.n_ctx, n_seq_max=limits.n_seq_max, n_batch=limits.batch_tokens,
        n_threads=settings.threads or None,
        providers=providers_for(plan.choice.execution_provider, installed.ref),
    )
    engine = Engine(backend, limits, installed.ref)
    engine.start()
    return engine
