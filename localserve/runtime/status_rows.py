"""The manager's status rows (/api/ps, `localserve ps`, the dashboard, the tray): one per model
loaded, loading, or waited for, in the one shape all of them read.

Memory, three figures: `memory_bytes` is what the plan charges the load against the budget (swaps
read it); `memory_max_bytes` the most the model may hold (that plan plus what its worker process
held before the load); `memory_held_bytes` what it holds now, measured when the row is made, or None
where it cannot be told apart from the daemon's own memory. Since KV pages are committed only as
requests use them (backends/llamacpp/kv_pages.py), an idle model holds far less than its plan.
"""

from __future__ import annotations

from typing import Any

from ..engine.worker.proxy import WorkerEngine
from ..protocol.engine import ModelEngine
from .loaded import LoadedModel


def loaded_row(m: LoadedModel, stats: dict[str, Any], load_wait: dict[str, Any], now: float,
               restarts: int = 0) -> dict[str, Any]:
    """A loaded model; `load_wait`: the swap queue's row for it (requests waiting to be admitted again);
    `restarts`: how often its engine worker died since the daemon started."""
    return {
        "name": m.name,
        "state": "loaded",
        # While it makes room for another model: the lane it drains for (it admits only better ones).
        "draining_for": m.draining_for,
        "size": m.info.size,
        "memory_bytes": m.memory_bytes,
        **_memory_row(m),
        "vram_bytes": m.vram_bytes,
        "device": m.device,
        "quant": m.info.quant,
        "format": m.info.format,
        "sha256": m.info.sha256,
        "loaded_at": m.loaded_at,
        "expires_at": m.expires_at,
        "expires_in": None if m.expires_at is None else max(0.0, m.expires_at - now),
        "keep_alive": m.keep_alive,
        "pinned": m.pinned,
        "running": stats.get("running", 0),
        "waiting": stats.get("waiting", {}),
        # Requests for it that wait to be admitted again (it drains for another model).
        "waiting_for_load": load_wait.get("waiting_for_load", 0),
        "reason": (f"making room for {m.making_room_for}" if m.making_room_for else load_wait.get("reason", "")),
        # What the engine was sized to: tokens per request and requests decoding at once.
        "context_length": m.engine.n_ctx_per_seq,
        # What its projector takes, as loaded (issue 43): /api/show's "vision" and "audio" for a loaded model.
        "vision": bool(getattr(m.engine.info, "vision", False)),
        "audio": bool(getattr(m.engine.info, "audio", False)),
        "max_sequences": stats.get("max_sequences", 0),
        **_offload_row(m.engine),
        "worker": _worker_row(m.engine, now),
        "restarts": restarts,
        "stats": stats,
    }


def failed_row(name: str, why: str, restarts: int) -> dict[str, Any]:
    """A model not loaded again after its engine kept crashing (crashes.py), until loaded explicitly."""
    return {"name": name, "state": "failed", "reason": why, "restarts": restarts, "memory_bytes": 0,
            "memory_held_bytes": 0, "memory_max_bytes": 0, "pinned": 0, "waiting": {}, "waiting_for_load": 0}


def _memory_row(m: LoadedModel) -> dict[str, int | None]:
    """What the model holds now and the most it may hold. Held: its worker's RSS (read now, on
    demand: nothing samples an idle daemon) plus what it put on a GPU, which RSS does not count.
    An engine in the daemon's process says None: the daemon's RSS is not the model's."""
    engine = m.engine
    if not isinstance(engine, WorkerEngine):
        return {"memory_held_bytes": None, "memory_max_bytes": m.memory_bytes}
    resident = engine.resident_bytes()
    held = None if resident is None else resident + device_bytes(m)
    return {"memory_held_bytes": held, "memory_max_bytes": m.memory_bytes + engine.rss_before_load}


def device_bytes(m: LoadedModel) -> int:
    """Its memory on a GPU: llama.cpp's own buffer sizes where the engine reported an offload, else
    the plan's (/api/ps's size_vram is the same figure)."""
    info = m.engine.info
    return info.gpu_memory_bytes if info.gpu_layers else m.vram_bytes


def _worker_row(engine: ModelEngine, now: float) -> dict[str, Any] | None:
    """The process an engine runs in, when it is a worker of its own (engine/worker/)."""
    if not isinstance(engine, WorkerEngine):
        return None
    return {"pid": engine.pid, "uptime_s": round(max(0.0, now - engine.started_at), 1)}


def loading_row(name: str, reserved_bytes: int, load_wait: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "state": "loading", "memory_bytes": reserved_bytes, "memory_held_bytes": None,
            "memory_max_bytes": reserved_bytes, "pinned": 0,
            "waiting_for_load": load_wait.get("waiting_for_load", 0), "waiting": load_wait.get("waiting", {}),
            "reason": load_wait.get("reason", "")}


def _offload_row(engine: ModelEngine) -> dict[str, Any]:
    """Where the engine says the load went (vram_bytes beside it is our estimate from the plan)."""
    info = engine.info
    return {"gpu_layers": info.gpu_layers, "offloadable_layers": info.offloadable_layers,
            "gpu_memory_bytes": info.gpu_memory_bytes, "moe_layers_in_ram": info.moe_layers_in_ram,
            "gpu_memory_by_device": dict(info.gpu_memory_by_device)}
