"""The official `openai` npm package in a real headless Chromium, against the real daemon.

Node does no CORS, so only a browser shows whether a page or an editor webview can use the API: the
SDK's preflight asks for its `X-Stainless-*` headers, and the browser drops the real request unless
the answer grants them. A page served from an allowed origin (http://localhost:PORT, and
http://[::1]:PORT) must get a streamed chat, a chat and embeddings, with and without an API key; the
same page from a foreign origin must get nothing.

Needs Debian's `chromium` and `chromium-driver` and `npm` (.ci/run installs them); the package is
installed from the npm registry into .test-cache/npm by the test itself.
"""

from __future__ import annotations

import asyncio
import mimetypes
import shutil
import socket
import threading
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlencode

import pytest
from aiohttp import web

from browser_util import CHROMEDRIVER, CHROMIUM, chromium
from daemon_util import cli_env, free_port, register_model, serving, stop_quietly, wait_published
import prefetch

pytestmark = pytest.mark.model

PAGE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "browser"
MODEL = "smollm2-135m"
N_EMBD = 576  # SmolLM2-135M's embedding width
API_KEY = "browser-test-key"

NPM = shutil.which("npm")
if not (CHROMIUM and CHROMEDRIVER and NPM):
    pytest.skip("needs Debian's chromium and chromium-driver and npm (apt-get install chromium chromium-driver npm)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def openai_js() -> Path:
    """node_modules/openai, installed once per cache by npm itself."""
    package = prefetch.openai_js()
    assert (package / "index.mjs").is_file()
    return package


def file_handler(path: Path) -> Any:
    async def handler(_: web.Request) -> web.FileResponse:
        return web.FileResponse(path)

    return handler


class PageServer:
    """The test page and the package's ESM files, served by aiohttp on its own loop and thread."""

    def __init__(self, package: Path, host: str):
        # The browser runs a module only when it comes as JavaScript; not every mimetypes table
        # knows .mjs.
        mimetypes.add_type("text/javascript", ".mjs")
        app = web.Application()
        app.router.add_get("/", file_handler(PAGE_DIR / "index.html"))
        app.router.add_get("/page.js", file_handler(PAGE_DIR / "page.js"))
        app.router.add_static("/npm/openai", package)
        self.app, self.host = app, host
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="page-server", daemon=True)
        self.runner = web.AppRunner(app)
        self.port = 0

    def __enter__(self) -> "PageServer":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    async def _start(self) -> None:
        await self.runner.setup()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self.runner, sock).start()

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def pages(openai_js) -> Iterator[dict[str, str]]:
    """Page URLs by origin: allowed (localhost, [::1]) and foreign (127.0.0.2 is loopback too, but no
    entry of the allow-list names it)."""
    with PageServer(openai_js, "127.0.0.1") as local, PageServer(openai_js, "127.0.0.2") as foreign:
        urls = {"localhost": f"http://localhost:{local.port}/", "foreign": f"http://127.0.0.2:{foreign.port}/"}
        if not ipv6_loopback():
            yield urls
            return
        with PageServer(openai_js, "::1") as v6:
            yield {**urls, "ipv6": f"http://[::1]:{v6.port}/"}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module", params=[None, API_KEY], ids=["no-key", "api-key"])
def daemon(request, smollm2_gguf, tmp_path_factory) -> Iterator[tuple[str, str | None]]:
    """The real daemon (`localserve serve`), without and with an API key: (url, key)."""
    home = tmp_path_factory.mktemp("home")
    extra = {"LOCALSERVE_API_KEY": request.param} if request.param else {}
    env = cli_env(home, free_port(), **extra)
    register_model(env, smollm2_gguf)
    with serving(env) as proc:
        try:
            info = wait_published(home, proc)
            yield info["url"], request.param
        finally:
            stop_quietly(env, proc)


def run_page(browser: Any, page: str, base: str, key: str | None) -> tuple[dict[str, Any], list[str]]:
    """Load the page against the daemon; its result and the console messages it caused."""
    from selenium.webdriver.support.ui import WebDriverWait

    query = {"base": base, "model": MODEL, "key": key or "no-key-needed"}
    if key:
        query["bad_key"] = key + "-wrong"
    browser.get_log("browser")  # drop what earlier pages left
    browser.get(page + "?" + urlencode(query))
    # A liveness bound only: three small calls on a 135M model take seconds.
    result = WebDriverWait(browser, 240, poll_frequency=0.2).until(lambda d: d.execute_script("return window.__result"))
    console = [entry["message"] for entry in browser.get_log("browser")]
    return result, console


def cors_errors(console: list[str]) -> list[str]:
    return [line for line in console if "CORS" in line or "Access-Control" in line]


@pytest.mark.parametrize("origin", ["localhost", "ipv6"])
def test_openai_js_works_from_an_allowed_origin(browser, pages, daemon, origin):
    if origin not in pages:
        pytest.skip("this machine cannot bind the IPv6 loopback address")
    base, key = daemon
    result, console = run_page(browser, pages[origin], base, key)
    assert "fatal" not in result, (result, console)
    for call in ("chat", "stream", "embed"):
        assert result[call]["ok"], (call, result[call], console)
    chat, stream = result["chat"]["value"], result["stream"]["value"]
    assert chat["text"].strip() and chat["finish"] in ("stop", "length")
    # Greedy: the streamed answer, read by the SDK's own stream parser, is the whole answer.
    assert stream == chat
    assert result["embed"]["value"] == N_EMBD
    if key:
        # A wrong key is an answer the page can read (401 with the CORS grant), not a network error.
        assert result["badKey"]["error"] == "AuthenticationError" and result["badKey"]["status"] == 401
    assert cors_errors(console) == [], console


def test_openai_js_is_refused_from_a_foreign_origin(browser, pages, daemon):
    base, key = daemon
    result, console = run_page(browser, pages["foreign"], base, key)
    assert "fatal" not in result, (result, console)
    for call in ("chat", "stream", "embed"):
        # The browser hides the refused preflight from the page: a connection error, no status.
        assert not result[call]["ok"], (call, result[call])
        assert result[call]["error"] == "APIConnectionError" and result[call]["status"] is None
    # The console says why, which is also what proves the allowed case's empty list meaningful.
    assert cors_errors(console), console
