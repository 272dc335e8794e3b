"""What serves a model name a request sends: an installed model, a remote upstream's, the source of
a model Ollama's /api/create or /api/copy made (store/created.py), or the model a `model_aliases`
item maps it to (config/aliases.py); a name none of them serve is a 404 that says
how to serve it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..config.aliases import SETTING as ALIAS_SETTING, alias_target
from ..config.settings import Settings
from ..errors import InvalidNameError, ModelNotFoundError
from ..protocol.engine import ModelEngine
from ..store.cache import InstalledModel, ModelStore
from ..store.created import CreatedModels

if TYPE_CHECKING:
    from ..engine.upstream.pool import UpstreamPool


async def resolve(model_ref: str, store: ModelStore, upstreams: "UpstreamPool | None",
                  settings: Settings) -> "InstalledModel | tuple[str, ModelEngine]":
    """The installed model, or (name, engine) of an upstream's; the name itself first, then the
    model its `model_aliases` item maps it to."""
    try:
        return await _lookup(model_ref, store, upstreams)
    except (ModelNotFoundError, InvalidNameError) as missing:
        created = await asyncio.to_thread(CreatedModels(settings).get, model_ref)
        if created is not None:  # Ollama's /api/create or /api/copy made this name
            return await _lookup(created.source, store, upstreams)
        target = alias_target(model_ref, settings.model_aliases)
        if target is not None:
            return await _lookup(target, store, upstreams)
        if not isinstance(missing, ModelNotFoundError):
            raise
        # Agents send names of models that are not ours (claude-*, gpt-*): say how to serve them.
        raise ModelNotFoundError(
            model_ref, missing.suggestions,
            message=f"model {model_ref!r} is not served here: pull it, or map the name to an installed "
                    f"model with the {ALIAS_SETTING} setting (e.g. {model_ref.split('-')[0]}-*={settings.default_model})",
        ) from None


async def _lookup(model_ref: str, store: ModelStore,
                  upstreams: "UpstreamPool | None") -> "InstalledModel | tuple[str, ModelEngine]":
    try:
        return await asyncio.to_thread(store.find, model_ref)
    except (ModelNotFoundError, InvalidNameError):
        if upstreams is None:
            raise
        from ..engine.upstream.engine import remote_engine

        remote = await remote_engine(upstreams, model_ref)
        if remote is None:
            raise
        return model_ref, remote
