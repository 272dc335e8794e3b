"""A real localserve HTTP server for tests: create_app + a real ModelManager on 127.0.0.1, run on its
own event loop in a background thread, so tests can drive it with blocking clients (the official
`openai` package, urllib) or with their own event loop, exactly as separate processes would.

Built with aiohttp's default runner settings (no handler_cancellation), as the daemon runs it, so
disconnect handling is tested on the path production takes.

The backend-independent server tests run once per backend (`BACKENDS`, a module-scoped `server`
fixture per backend): llama.cpp on the GGUF, and ONNX Runtime on our conversion of it, installed
once per session as the tag's onnx variant next to the GGUF (its tokenizer). Every test of
those modules passes on both, so none is marked backend-only.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Coroutine, Iterator

import pytest
from aiohttp import web

from localserve.config.settings import Settings, replace
from localserve.runtime.manager import ModelManager
from localserve.server import create_app
from localserve.store.cache import ModelStore

from daemon_util import SPECULATIVE  # the test daemons' mode, and why
from worker_locks import THREADS

MODEL = "smollm2-135m"
MODEL_TAG = "Q4_1"

BACKENDS = [
    pytest.param("llamacpp", id="llamacpp"),
    pytest.param("onnx", id="onnx", marks=pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None,
                                                             reason="onnxruntime is not installed")),
]
BACKEND_CLASSES = {"llamacpp": "LlamaCppBackend", "onnx": "OnnxBackend"}


def server_settings(home: Path, **changes: Any) -> Settings:
    base = dict(home=home, threads=THREADS, context_length=1024, max_sequences=8, keep_alive=300.0,
                speculative=SPECULATIVE)
    base.update(changes)
    return replace(Settings(), **base)


def install_model(settings: Settings, gguf: Path) -> None:
    """Register the real model in place in a test home (no copy; the test home is thrown away)."""
    ModelStore(settings).register_local(gguf, MODEL, MODEL_TAG)


@contextmanager
def model_server(home: Path, gguf: Path, **changes: Any) -> Iterator["LiveServer"]:
    """A LiveServer on a fresh home with the real model installed (the usual module fixture)."""
    settings = server_settings(home, **changes)
    install_model(settings, gguf)
    with LiveServer(settings) as live:
        yield live


def install_onnx_model(settings: Settings, gguf: Path, onnx_dir: Path) -> None:
    """The real model with its ONNX conversion as the tag's onnx variant (copied into the store)."""
    install_model(settings, gguf)
    ModelStore(settings).add_directory(onnx_dir, MODEL, MODEL_TAG)


@contextmanager
def backend_server(request: pytest.FixtureRequest, **changes: Any) -> Iterator["LiveServer"]:
    """The module's LiveServer for the backend `request.param` names (a BACKENDS fixture param):
    llama.cpp on a fresh home holding the GGUF, ONNX on the session's onnx_home (conftest)."""
    backend = request.param
    if backend == "onnx":
        settings = server_settings(request.getfixturevalue("onnx_home"), backend="onnx", **changes)
    else:
        settings = server_settings(request.getfixturevalue("tmp_path_factory").mktemp("home"),
                                   backend=backend, **changes)
        install_model(settings, request.getfixturevalue("smollm2_gguf"))
    with LiveServer(settings) as live:
        # The parameterisation is only worth its time if the backend asked for is the one serving.
        assert live.backend_class(MODEL) == BACKEND_CLASSES[backend]
        yield live


class LiveServer:
    def __init__(self, settings: Settings, loader: Any = None):
        self.settings = settings
        self.loader = loader
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.runner: web.AppRunner | None = None
        self.manager: ModelManager | None = None
        self.port = 0

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self._stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    async def _start(self) -> None:
        self.manager = ModelManager(self.settings, loader=self.loader)
        app = create_app(self.settings, self.manager)
        self.runner = web.AppRunner(app, shutdown_timeout=2.0, keepalive_timeout=self.settings.idle_timeout)
        await self.runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self.runner, sock)
        await site.start()

    async def _stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        """Run a coroutine on the server's loop (e.g. to read engine state) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_stats(self) -> dict[str, Any]:
        async def read() -> dict[str, Any]:
            assert self.manager is not None
            rows = self.manager.status()
            return rows[0]["stats"] if rows else {}

        return self.call(read())

    def backend_class(self, model_ref: str) -> str:
        """The class name of the backend serving `model_ref` (loaded now if it is not)."""
        async def read() -> str:
            assert self.manager is not None
            async with self.manager.use(model_ref) as loaded:
                engine = loaded.engine  # in its worker process (engine/worker/), the worker says
                return getattr(engine, "backend_name", None) or type(engine.backend).__name__

        return self.call(read())

    # -- plain HTTP -----------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                headers: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, dict[str, str], bytes]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        if data is not None and "Content-Type" not in (headers or {}):
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, _, data = self.request(method, path, body, **kw)
        return status, (json.loads(data) if data.strip() else None)


def raw_http(port: int, request_bytes: bytes, timeout: float = 10) -> bytes:
    """Send bytes as they are (hostile Host headers, odd requests) and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request_bytes)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)
