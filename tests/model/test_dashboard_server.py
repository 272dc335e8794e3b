"""The dashboard's server side on a real in-process server: `/` for browsers and for probes, the
page's files, the stats snapshot and its SSE stream, and bad input (unknown model, foreign Host,
missing key, a stream reader that stops reading)."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

from localserve.server import dashboard_routes

from server_harness import MODEL, LiveServer, install_model, model_server, raw_http, server_settings

HTML = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}  # Chromium's
KEY = "dash-key"


@pytest.fixture
def server(tmp_path: Path, smollm2_gguf: Path):
    settings = server_settings(tmp_path / "home")
    install_model(settings, smollm2_gguf)  # installed, never loaded here
    with LiveServer(settings) as live:
        yield live


def test_root_serves_the_page_to_browsers_and_text_to_probes(server):
    status, headers, body = server.request("GET", "/", headers=HTML)
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'<script src="/dashboard/app.js">' in body and b'content="0"' in body  # no key needed
    for accept in (None, "*/*", "application/json", "text/plain, text/html;q=0.5"):
        status, headers, body = server.request("GET", "/", headers={"Accept": accept} if accept else {})
        assert (status, body) == (200, b"localserve is running"), accept


@pytest.mark.parametrize("accept, html", [
    ("text/html", True), ("*/*", False), ("", False), ("text/html;q=0", False),
    ("application/json, text/html;q=0.1", False), ("text/html;q=bad, */*", False), ("TEXT/HTML", True),
])
def test_prefers_html(accept, html):
    assert dashboard_routes.prefers_html(accept) is html


def test_assets_are_a_fixed_list(server):
    for name, kind in dashboard_routes.ASSETS.items():
        status, headers, body = server.request("GET", f"/dashboard/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind) and body, name
    for path in ("/dashboard/nope.js", "/dashboard/..%2Fapp.py", "/dashboard/%2E%2E%2Fserver%2Fapp.py"):
        status, _, body = server.request("GET", path)
        assert status == 404 and b"Traceback" not in body and b"/" + b"work" not in body, path


def test_the_page_and_its_files_cannot_be_framed_by_another_site(server):
    """Clickjacking (review 3 A.10): "Unload" is one click on the page's own origin, so the page says
    no site may frame it, and loads nothing but its own files."""
    paths = ["/"] + [f"/dashboard/{name}" for name in dashboard_routes.ASSETS]
    for path in paths:
        status, headers, _ = server.request("GET", path, headers=HTML)
        assert status == 200, path
        policy = {d.split()[0]: d.split()[1:] for d in headers["Content-Security-Policy"].split("; ")}
        assert policy["frame-ancestors"] == ["'none'"] and headers["X-Frame-Options"] == "DENY", path
        assert policy["default-src"] == policy["script-src"] == ["'self'"], path
        assert headers["X-Content-Type-Options"] == "nosniff", path


def test_state_and_stream(server):
    status, state = server.json("GET", "/api/dashboard/state")
    assert status == 200 and state["models"] == [] and state["pulls"] == 0 and state["api_key"] is False
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /api/dashboard/stats?model=smollm2-135m HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        buffer = b""
        while len(re.findall(rb"data: (\{.*?\})\n\n", buffer)) < 2:
            buffer += s.recv(65536)  # a liveness bound only: the socket's 10 s timeout
    head = buffer.partition(b"\r\n\r\n")[0]
    assert b"text/event-stream" in head
    # The body is chunked; each event is one `data: {json}` line and a blank line.
    snaps = [json.loads(m) for m in re.findall(rb"data: (\{.*?\})\n\n", buffer)]
    assert len(snaps) >= 2 and all(s["models"] == [] for s in snaps) and snaps[1]["time"] > snaps[0]["time"]


def test_bad_input(server):
    status, body = server.json("GET", "/api/dashboard/stats?model=no-such-model")
    assert status == 404 and isinstance(body["error"], str) and "no-such-model" in body["error"]
    assert server.json("GET", "/api/dashboard/state?model=no-such-model")[0] == 404
    for path in ("/", "/api/dashboard/stats", "/dashboard/app.js"):
        answer = raw_http(server.port, f"GET {path} HTTP/1.1\r\nHost: evil.example\r\nAccept: text/html\r\n"
                                       "Connection: close\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 403"), (path, answer[:200])


def test_api_key_guards_data_not_the_page(tmp_path: Path):
    with LiveServer(server_settings(tmp_path / "home", api_key=KEY)) as server:
        status, _, body = server.request("GET", "/", headers=HTML)
        assert status == 200 and b'content="1"' in body  # the page knows to ask for the key first
        assert server.request("GET", "/dashboard/app.js")[0] == 200
        assert server.json("GET", "/api/dashboard/state")[0] == 401
        assert server.json("GET", "/api/dashboard/stats")[0] == 401
        status, state = server.json("GET", "/api/dashboard/state", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200 and state["api_key"] is True


def test_a_reader_that_stops_is_dropped_without_buffering(tmp_path: Path, monkeypatch):
    """Snapshots as fast as the socket takes them; the client reads nothing. Each write waits for
    its drain, so once the buffers are full no snapshot is made (none queue up in memory), and after
    stream_write_timeout the connection is dropped."""
    made = [0]
    real = dashboard_routes.snapshot

    def counting(*args, **kwargs):
        made[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(dashboard_routes, "snapshot", counting)
    monkeypatch.setattr(dashboard_routes, "STATS_INTERVAL_S", 0.0)
    with LiveServer(server_settings(tmp_path / "home", stream_write_timeout=2.0)) as server:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.port))
        s.sendall(b"GET /api/dashboard/stats HTTP/1.1\r\nHost: localhost\r\n\r\n")
        deadline = time.monotonic() + 30
        while True:  # until the buffers are full: the count stops moving
            before = made[0]
            time.sleep(0.3)
            if made[0] == before and before > 0:
                break
            assert time.monotonic() < deadline, "the stream never blocked"
        # Past stream_write_timeout (and the guard's poll) without reading a byte.
        time.sleep(4.0)
        assert made[0] == before  # blocked in write() all along: nothing made, nothing queued
        # Dropped: reading now gets what the kernel still holds, then EOF or a reset. A stream
        # still alive would feed this reader forever: more than 64 MiB means it was not dropped.
        s.settimeout(30)
        received = 0
        try:
            while chunk := s.recv(1 << 20):
                received += len(chunk)
                assert received < 64 << 20, "the stream was not dropped"
        except ConnectionResetError:
            pass
        s.close()
        status, _ = server.json("GET", "/api/dashboard/state")
        assert status == 200  # the server carries on


def test_latency_windows_are_exact_and_per_lane():
    """The rings answer from the samples themselves: each window holds exactly the samples of its
    span, per lane and all together, and the percentiles interpolate as numpy's default does."""
    import statistics

    from localserve.api.live import LatencyRings, percentile

    rings = LatencyRings(size=1000)
    now = 10_000.0
    recent = [0.010, 0.020, 0.030, 0.040, 0.100]
    rings.add("m", "itl", "batch", 9.0, at=now - 1000)  # in neither window
    rings.add("m", "itl", "default", 0.5, at=now - 120)  # in the 15-minute window only
    for i, v in enumerate(recent):
        rings.add("m", "itl", "interactive", v, at=now - 30 + i)
    itl = rings.summary("m", now)["itl"]
    assert itl["1m"]["all"]["n"] == 5 and itl["1m"]["interactive"]["n"] == 5 and itl["1m"]["default"]["n"] == 0
    assert itl["15m"]["all"]["n"] == 6 and itl["15m"]["default"]["p50"] == 0.5 and itl["15m"]["batch"]["n"] == 0
    assert itl["1m"]["all"]["p50"] == 0.030
    assert itl["1m"]["all"]["p95"] == pytest.approx(statistics.quantiles(recent, n=20, method="inclusive")[18])
    assert itl["1m"]["default"]["p50"] is None and percentile([], 0.5) is None
    # Bounded: the oldest samples go first.
    for i in range(2000):
        rings.add("m", "ttft", "default", float(i), at=now - 1)
    assert rings.summary("m", now)["ttft"]["1m"]["all"]["n"] == 1000


def test_summary_line_is_the_trays():
    from localserve.api.dashboard_feed import summary_line

    models = [{"state": "loaded", "running_by_lane": {"interactive": 1, "default": 3, "batch": 0}},
              {"state": "loading"}]
    assert summary_line(models) == "1 model loaded · running: interactive 1, default 3, batch 0"
    assert summary_line([], pulls=2) == "0 models loaded · running: interactive 0, default 0, batch 0 · 2 pulls"


def test_traffic_per_dialect_and_route(tmp_path: Path, smollm2_gguf: Path):
    """One short request in each dialect shows up under its dialect and route: the editor's FIM
    (a `suffix` on /v1/completions, /infill), the agent's Anthropic and Responses calls, chats;
    the snapshot's one-line state is the tray's; a request that is not running cannot be cancelled.
    SmolLM2 has no FIM tokens: its FIM requests are refused (400), and counted all the same, as
    every answered request is."""
    from localserve.api.dashboard_feed import summary_line

    chat = [{"role": "user", "content": "Hi"}]
    calls = [
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 2}, 200),
        ("/v1/completions", {"model": MODEL, "prompt": "def add(a, b):", "suffix": "\n", "max_tokens": 2}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 2}, 200),
        ("/api/chat", {"model": MODEL, "messages": chat, "stream": False, "options": {"num_predict": 2}}, 200),
        ("/v1/messages", {"model": MODEL, "messages": chat, "max_tokens": 2}, 200),
        ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2}, 200),
        ("/infill", {"model": MODEL, "input_prefix": "def add(a, b):", "input_suffix": "\n", "n_predict": 2}, 400),
    ]
    with model_server(tmp_path / "home", smollm2_gguf) as server:
        for path, body, expected in calls:
            status, answer = server.json("POST", path, body)
            assert status == expected, (path, answer)
        status, state = server.json("GET", "/api/dashboard/state")
        traffic = {(t["dialect"], t["route"]): t["requests"] for t in state["traffic"]}
        assert traffic == {("openai", "/v1/chat/completions"): 1, ("fim", "/v1/completions"): 1,
                           ("openai", "/v1/completions"): 1, ("ollama", "/api/chat"): 1,
                           ("anthropic", "/v1/messages"): 1, ("responses", "/v1/responses"): 1,
                           ("fim", "/infill"): 1}, traffic
        model = state["models"][0]
        assert model["sequences"] == [] and model["running_by_lane"] == {"interactive": 0, "default": 0, "batch": 0}
        assert model["kv"]["total"] == model["kv_total"] and model["kv"]["running"] + model["kv"]["parked"] == model["kv_used"]
        assert model["latency"]["queue"]["1m"]["all"]["n"] >= 5 and model["latency"]["step"]["1m"]["all"]["n"] > 0
        assert state["summary"] == summary_line(state["models"]) == "1 model loaded · running: interactive 0, default 0, batch 0"
        status, body = server.json("POST", "/api/dashboard/requests/req-999999/cancel")
        assert status == 404 and "req-999999" in body["error"]
