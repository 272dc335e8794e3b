"""Keep-alive: when a loaded model nobody uses is unloaded.

When a model's last lease goes, it expires after its keep-alive (the last request's `keep_alive`,
else settings.keep_alive): 0 or an unload asked for while it was busy = right away, negative =
never. One reaper task sleeps until the next expiry, or until something changes the picture
(`wake`), and hands each expired model to the manager's unload. A leased model never expires:
`use()` clears its expiry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable

from .loaded import LoadedModel

log = logging.getLogger(__name__)


def expiry(model: LoadedModel, now: float) -> float | None:
    """When an idle `model` expires (epoch seconds), or None to keep it loaded forever."""
    if model.keep_alive == 0 or model.unload_when_idle:
        return now
    if model.keep_alive < 0:
        return None
    return now + model.keep_alive


class KeepAliveReaper:
    """Unloads models past their `expires_at`; `models` lists the loaded ones, `unload` starts one's
    unload (it leaves `models` at once). Lives on the event loop, as the manager does."""

    def __init__(self, models: Callable[[], Iterable[LoadedModel]], unload: Callable[[LoadedModel], object]) -> None:
        self._models = models
        self._unload = unload
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._reap(), name="keep-alive reaper")

    def idle(self, model: LoadedModel) -> None:
        """`model`'s last lease went: it expires after its keep-alive."""
        model.expires_at = expiry(model, time.time())
        self.wake()

    def wake(self) -> None:
        """An expiry changed: look again."""
        self._wake.set()

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _reap(self) -> None:
        while not self._closed:
            self._wake.clear()
            now = time.time()
            next_expiry: float | None = None
            for model in list(self._models()):
                if model.pinned or model.expires_at is None:
                    continue
                if model.expires_at <= now:
                    log.info("keep-alive of %s expired", model.name)
                    self._unload(model)
                elif next_expiry is None or model.expires_at < next_expiry:
                    next_expiry = model.expires_at
            timeout = None if next_expiry is None else max(0.01, next_expiry - now)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
