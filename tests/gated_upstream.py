"""A fake OpenAI-compatible upstream whose answers the test lets out: the gate of the batch tests.

Every embeddings request waits until the test releases it (`release(model, n)` lets n more of that
model's through, `open(model)` all of them from then on; each model has its own gate, so tests
sharing the server never take each other's releases), so a batch on its model is held at a known
point -- n lines
answered, the rest in flight -- for as long as the test needs. A cancel, an expiry, a SIGKILL or a
full disk then happen at that point whatever the machine's speed; only the test's own steps decide
a verdict. It is a real aiohttp server on 127.0.0.1 in its own thread, and the daemon reaches it
as a configured upstream over HTTP, through the same pool and engine as any other upstream.

An answer's vector is `vector(text, dims)`: the test knows what every line must get back.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any, Callable

from aiohttp import web


def vector(text: str, dims: int = 2) -> list[float]:
    return [float(len(text))] + [float((sum(map(ord, text)) + i) % 97) for i in range(dims - 1)]


class GatedUpstream:
    def __init__(self, *models: str, name: str = "gated"):
        self.models, self.name = models, name
        self.received = dict.fromkeys(models, 0)  # embeddings requests that arrived (answered or held)
        self.answered = dict.fromkeys(models, 0)
        self._cond = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gated-upstream", daemon=True)
        self._open: set[str] = set()
        self.port = 0

    # --- the test's side ------------------------------------------------------------------------
    def table(self) -> dict[str, Any]:
        """The [[upstreams]] table naming this server (max_concurrency above any batch width)."""
        return {"name": self.name, "url": f"http://127.0.0.1:{self.port}/v1", "models": list(self.models),
                "max_concurrency": 256}

    def release(self, model: str, n: int = 1) -> None:
        def let_out() -> None:
            for _ in range(n):
                self._gates[model].release()

        self._loop.call_soon_threadsafe(let_out)

    def open(self, model: str) -> None:
        def let_all_out() -> None:
            self._open.add(model)
            for _ in range(self.received[model]):  # the held ones; later ones do not wait
                self._gates[model].release()

        self._loop.call_soon_threadsafe(let_all_out)

    def wait_for(self, predicate: Callable[["GatedUpstream"], bool], timeout: float = 120) -> None:
        """Block until `predicate(self)` holds (a condition, not a verdict: the timeout only fails a hang)."""
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self), timeout), "the upstream never saw that"

    # --- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> "GatedUpstream":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _start(self) -> None:
        self._gates = {model: asyncio.Semaphore(0) for model in self.models}
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/embeddings", self._embeddings)
        # A request the daemon gave up on (a cancelled batch) stops waiting, so it never takes a
        # release meant for a later line.
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    # --- the daemon's side ----------------------------------------------------------------------
    def _count(self, counts: dict[str, int], model: str) -> None:
        with self._cond:
            counts[model] += 1
            self._cond.notify_all()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        model = body["model"]
        self._count(self.received, model)
        if model not in self._open:
            await self._gates[model].acquire()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        dims = int(body.get("dimensions") or 2)
        data = [{"object": "embedding", "index": i, "embedding": vector(str(text), dims)}
                for i, text in enumerate(inputs)]
        self._count(self.answered, model)
        return web.json_response({"object": "list", "data": data, "model": body["model"],
                                  "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}})
