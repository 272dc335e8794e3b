"""What one request for an installed model is served with, asked without loading it.

/api/show (Ollama clients size their prompts by it) and /props (llama.cpp clients read `n_ctx` and
`total_slots`) both answer at an editor's startup, for models that may not be loaded yet: the
loaded engine's figures when it runs, else what its load would plan with today's settings.
`vision` and `audio` likewise: what the loaded engine's projector takes (ModelInfo.vision, .audio),
else what the projector the store holds for the tag says it takes (store/projector.py `kinds`;
GitHub Copilot's Ollama provider reads `vision` before sending images).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..api.lora import adapters_body
from ..runtime.adapters import lora_files
from ..runtime.planning import plan_model
from ..store.cache import InstalledModel
from ..store.projector import kinds
from .state import MANAGER_KEY, SETTINGS_KEY


@dataclass(frozen=True)
class Served:
    context: int  # prompt + answer tokens of one request
    slots: int  # requests decoding at once
    vision: bool = False  # takes images
    audio: bool = False  # takes audio clips


async def served(request: web.Request, model: InstalledModel) -> Served:
    for row in request.app[MANAGER_KEY].status():
        if row.get("name") == model.ref and row.get("context_length"):
            return Served(int(row["context_length"]), int(row.get("max_sequences") or 1), bool(row.get("vision")),
                          bool(row.get("audio")))
    plan = await asyncio.to_thread(plan_model, model, request.app[SETTINGS_KEY])
    takes = await asyncio.to_thread(kinds, model.mmproj)
    return Served(plan.limits.n_ctx_seq, plan.limits.max_sequences, "vision" in takes, "audio" in takes)


def lora_adapters(request: web.Request, model: InstalledModel) -> list[dict[str, Any]]:
    """The LoRA adapters `model` loads with (the tag's, then model_loras'), as GET /lora-adapters
    and /api/show list them: the ids a request's `lora` names, loaded or not."""
    return adapters_body(lora_files(model, request.app[SETTINGS_KEY]))
