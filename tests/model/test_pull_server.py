"""/api/pull through the real HTTP API (an in-process app on 127.0.0.1) against real local servers
that trickle bytes, stall or redirect: pulls never starve the rest of the API, are capped (429),
stop when their client leaves, refuse links to local services, and report failures after the
stream started as its last NDJSON line."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from server_harness import MODEL, LiveServer, install_model, server_settings
from test_gguf_facts import write_tiny_llama
from test_pull import PAYLOAD, LocalServer, Served

from localserve.pull.policy import HTTP_REFUSED, LOCAL_REFUSED
from localserve.store.cache import ModelStore

ALLOW_LOCAL = ("127.0.0.1",)


@pytest.fixture
def files():
    srv = LocalServer().start()
    yield srv
    srv.stop()


@pytest.fixture
def tiny(tmp_path: Path) -> bytes:
    return write_tiny_llama(tmp_path / "tiny.gguf").read_bytes()


class OpenPull:
    """A streaming /api/pull whose client keeps the connection open until close()."""

    def __init__(self, server: LiveServer, url: str):
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        self.conn.request("POST", "/api/pull", json.dumps({"model": url}), {"Content-Type": "application/json"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200, self.response.read()
        self.first = json.loads(self.response.readline())

    def close(self) -> None:
        """Hang up mid-stream, as a client that quits does."""
        self.response.close()
        self.conn.close()


def pull_lines(server: LiveServer, body: dict[str, Any], timeout: float = 60) -> tuple[int, list[dict[str, Any]]]:
    status, _, raw = server.request("POST", "/api/pull", body, timeout=timeout)
    return status, [json.loads(line) for line in raw.splitlines() if line.strip()]


def wait_for(condition: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {seconds} s"
        time.sleep(0.05)


def chat(server: LiveServer, timeout: float) -> str:
    status, body = server.json("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0,
    }, timeout=timeout)
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


@pytest.mark.model
def test_stalled_pulls_never_starve_chats_or_listing_and_the_cap_answers_429(tmp_path, files, smollm2_gguf):
    settings = server_settings(tmp_path / "home", max_concurrent_pulls=6, pull_allow_http_hosts=ALLOW_LOCAL)
    install_model(settings, smollm2_gguf)
    for i in range(8):
        files.files[f"t{i}.gguf"] = Served(PAYLOAD, trickle=0.05)
    with LiveServer(settings) as server:
        answer = chat(server, timeout=120)  # the model loads before the pulls start
        pulls = [OpenPull(server, f"{files.url}/files/t{i}.gguf") for i in range(6)]
        wait_for(lambda: len(files.log) >= 6, 10, "six downloads started")

        for _ in range(3):  # every pull slot is taken and every download trickles
            status, listing = server.json("GET", "/v1/models", timeout=5)
            assert status == 200 and [m["id"] for m in listing["data"]] == [f"{MODEL}:Q4_1"]
            assert chat(server, timeout=5) == answer
            assert server.json("GET", "/api/tags", timeout=5)[0] == 200

        status, headers, raw = server.request("POST", "/api/pull", {"model": f"{files.url}/files/t6.gguf"}, timeout=5)
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert "max_concurrent_pulls" in json.loads(raw)["error"]
        assert len(files.log) == 6  # refused before any download began

        for pull in pulls:
            pull.close()
        for record in files.log:
            assert record["closed"].wait(10), "a pull kept downloading after its client left"

        # The slots come back once the cancelled threads ended: a new pull is accepted.
        deadline = time.monotonic() + 10
        while True:
            try:
                pull = OpenPull(server, f"{files.url}/files/t7.gguf")
                break
            except AssertionError:
                assert time.monotonic() < deadline, "pull slots were not freed"
                time.sleep(0.1)
        pull.close()


def test_a_client_that_leaves_cancels_its_pull_and_the_partial_resumes(tmp_path, files, tiny):
    files.files["t.gguf"] = Served(tiny, trickle=0.02)
    settings = server_settings(tmp_path / "home", pull_allow_http_hosts=ALLOW_LOCAL)
    partial = ModelStore(settings).model_dir("t", "latest") / "t.gguf.partial"
    with LiveServer(settings) as server:
        pull = OpenPull(server, f"{files.url}/files/t.gguf")
        wait_for(lambda: partial.exists() and partial.stat().st_size > 20_000, 20, "bytes arriving")
        pull.close()
        (record,) = files.requests_for("t.gguf")
        assert record["closed"].wait(5), "the download went on after the client left"
        # A chunk the download thread read just before the cancel is still written after the
        # server saw the close (CI caught 20480 -> 24576): the size settles once that write is done.
        time.sleep(0.3)
        kept = partial.stat().st_size
        time.sleep(0.3)
        assert partial.stat().st_size == kept < len(tiny)

        files.files["t.gguf"].trickle = 0
        status, lines = pull_lines(server, {"model": f"{files.url}/files/t.gguf"})
        assert status == 200 and lines[-1] == {"status": "success"}, lines
        assert files.requests_for("t.gguf")[-1]["range"] == f"bytes={kept}-"
        assert ModelStore(settings).find("t").path.read_bytes() == tiny


def test_a_failure_after_the_stream_started_is_its_last_line(tmp_path, files):
    files.files["s.gguf"] = Served(PAYLOAD, stall_after=100_000)
    settings = server_settings(tmp_path / "home", pull_allow_http_hosts=ALLOW_LOCAL, pull_stall_timeout=1.0)
    with LiveServer(settings) as server:
        status, lines = pull_lines(server, {"model": f"{files.url}/files/s.gguf"})
        assert status == 200 and lines[0]["status"].startswith("resolving")
        assert list(lines[-1]) == ["error"] and "stalled: no data arrived for 1 s" in lines[-1]["error"]
        assert all("error" not in line for line in lines[:-1])

        status, body = server.json("POST", "/api/pull", {"model": f"{files.url}/files/s.gguf", "stream": False})
        assert status == 502 and "stalled" in body["error"]


def test_link_policy_over_the_http_api(tmp_path, files, tiny):
    files.files["x.gguf"] = Served(tiny)
    with LiveServer(server_settings(tmp_path / "strict")) as server:
        for link in (f"{files.url}/files/x.gguf", f"https://127.0.0.1:{files.port}/files/x.gguf",
                     "https://[::1]:8443/x.gguf", "https://10.0.0.8/x.gguf"):
            status, body = server.json("POST", "/api/pull", {"model": link})
            assert status == 400 and set(body) == {"error"}, body
            assert body["error"] in (HTTP_REFUSED, LOCAL_REFUSED) and str(files.port) not in body["error"]
        assert files.log == []  # nothing was ever sent

    files.cdn_url = f"http://localhost:{files.port}"  # a redirect leaving the allowed host
    with LiveServer(server_settings(tmp_path / "allowing", pull_allow_http_hosts=ALLOW_LOCAL)) as server:
        status, lines = pull_lines(server, {"model": f"{files.url}/files/x.gguf"})
        assert status == 200 and lines[-1] == {"status": "success"}
        assert server.json("GET", "/api/tags")[1]["models"][0]["name"] == "x:latest"

        status, lines = pull_lines(server, {"model": f"{files.url}/Org/Repo/resolve/main/y.gguf"})
        assert lines[-1] == {"error": HTTP_REFUSED} and files.requests_for("y.gguf") == []

        with socket.socket() as probe:  # a port nothing listens on: the error must not say so in socket terms
            probe.bind(("127.0.0.1", 0))
            closed_port = probe.getsockname()[1]
        status, lines = pull_lines(server, {"model": f"http://127.0.0.1:{closed_port}/files/z.gguf"})
        error = lines[-1]["error"]
        assert "cannot reach 127.0.0.1" in error and str(closed_port) not in error and "rrno" not in error


def test_a_pull_behind_a_held_lock_ends_with_409(tmp_path, files, tiny):
    files.files["x.gguf"] = Served(tiny)
    settings = server_settings(tmp_path / "home", pull_allow_http_hosts=ALLOW_LOCAL, pull_lock_timeout=0.5)
    held = ModelStore(settings).lock("x", "latest")
    assert held.acquire(blocking=False)
    try:
        with LiveServer(settings) as server:
            status, body = server.json("POST", "/api/pull", {"model": f"{files.url}/files/x.gguf", "stream": False})
            assert status == 409 and body == {"error": "another pull of x:latest is in progress; try again when it finishes"}
    finally:
        held.release()
