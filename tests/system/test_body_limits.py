"""Hostile request bodies against a real in-process server: each gets a 4xx in its API's shape
(OpenAI on /v1, Ollama on /api) at once, never a 500, a traceback or a host path, and the server
keeps answering. No model is installed: every refusal here must come before any model work."""

from __future__ import annotations

import json
import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.api.json_body import MAX_INT_DIGITS, MAX_JSON_DEPTH, json_depth
from server_harness import LiveServer, server_settings

OPENAI = "/v1/chat/completions"
OLLAMA = "/api/chat"
LIMIT = 1024 * 1024  # room for 100k-deep bodies, which must fail on depth, not size
BODY_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = server_settings(tmp_path_factory.mktemp("home"), max_body_bytes=LIMIT,
                               body_timeout=BODY_TIMEOUT, idle_timeout=2.0)
    with LiveServer(settings) as live:
        yield live


def assert_error_shape(path: str, body: bytes, code: str | None = None) -> str:
    """The error's message, after checking the body is the API's error shape and leaks nothing."""
    text = body.decode()
    assert "Traceback" not in text and "/work/" not in text and "/tmp/" not in text and "site-packages" not in text
    data = json.loads(text)
    assert set(data) == {"error"}
    if path.startswith("/api/"):
        assert isinstance(data["error"], str) and data["error"]
        return data["error"]
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code
    return err["message"]


def still_serving(server: LiveServer) -> None:
    status, body = server.json("POST", OPENAI, {"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def open_request(server: LiveServer, path: str, headers: dict[str, str], first_bytes: bytes = b"") -> socket.socket:
    """A raw connection that has sent the request line, `headers` and `first_bytes` of a body."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{server.port}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + first_bytes)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response (a 100 Continue before it is skipped), without waiting for the close."""
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed before a response: {buf!r}"
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        if status != 100:
            break
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    length = int(headers["content-length"])
    while len(buf) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the response body"
        buf += chunk
    return status, headers, buf[:length]


@pytest.mark.parametrize("path", [OPENAI, OLLAMA])
def test_huge_integer_literal_is_400(server: LiveServer, path: str) -> None:
    digits = "9" * 5000  # past Python's 4300-digit conversion limit: a ValueError inside json.loads
    for raw in (f'{{"model": "m", "seed": {digits}}}', f'{{"model": "m", "x": [1, -{digits}]}}',
                f'{{"model": "m", "x": {"1" * (MAX_INT_DIGITS + 1)}}}'):
        status, _, body = server.request("POST", path, raw=raw.encode())
        assert status == 400
        assert "digits" in assert_error_shape(path, body)
    still_serving(server)


@pytest.mark.parametrize("path", [OPENAI, OLLAMA])
@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
                                 b'{"model": "m", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"])
def test_deep_nesting_is_400(server: LiveServer, path: str, raw: bytes) -> None:
    status, _, body = server.request("POST", path, raw=raw)
    assert status == 400
    assert "deeper than" in assert_error_shape(path, body)


def test_nesting_within_the_limit_reaches_the_handler(server: LiveServer) -> None:
    depth = MAX_JSON_DEPTH - 2  # the body object and its "x" array are two more levels
    body = {"model": "nope", "messages": [{"role": "user", "content": "[[[{{ " * 50}], "x": [0]}
    raw = json.dumps(body).encode().replace(b"[0]", b"[" * depth + b"0" + b"]" * depth)
    status, _, data = server.request("POST", OPENAI, raw=raw)
    assert status == 404 and b"model_not_found" in data  # parsed, then the unknown model refused


def test_json_depth_counts_only_structure() -> None:
    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'{"a": "[[[[\\"[[[[", "b": "}}}"}') == 1
    assert json_depth(b"[" * 1000 + b"]" * 1000) == 1000
    assert json_depth(b'["' + b"[" * 1000 + b'"]') == 1
    assert json_depth(b"") == 0
    assert json_depth(b'["\\\\", ["\\\\\\"]"]]') == 2  # escaped backslashes, then an escaped quote


def _depth(value: object) -> int:
    if isinstance(value, dict):
        value = list(value.values())
    return 1 + max(map(_depth, value), default=0) if isinstance(value, list) else 0


_TRICKY = st.text(alphabet='[]{}"\\ax', max_size=6)
_JSON = st.recursive(st.none() | st.integers() | _TRICKY,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
                     max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(value=_JSON)
def test_json_depth_matches_the_parsed_depth(value: object) -> None:
    assert json_depth(json.dumps(value).encode()) == _depth(value)


@pytest.mark.parametrize("path", [OPENAI, OLLAMA])
def test_unterminated_escaped_quotes_are_refused_quickly(server: LiveServer, path: str) -> None:
    # A string scanner that retried an unterminated string from every later quote took minutes here.
    raw = b'{"model": "' + b'\\"' * 400_000
    start = time.monotonic()
    status, _, body = server.request("POST", path, raw=raw)
    assert status == 400 and time.monotonic() - start < 5  # liveness bound, not a benchmark
    assert "not valid JSON" in assert_error_shape(path, body)


@pytest.mark.parametrize("path", [OPENAI, OLLAMA])
@pytest.mark.parametrize("expect", [False, True])
def test_declared_terabyte_body_is_413_at_once(server: LiveServer, path: str, expect: bool) -> None:
    headers = {"Content-Length": "1000000000000"}
    if expect:
        headers["Expect"] = "100-continue"
    start = time.monotonic()
    with open_request(server, path, headers) as sock:  # and never send a byte of the body
        status, response_headers, body = read_response(sock)
        elapsed = time.monotonic() - start
    assert status == 413 and elapsed < 1.0
    assert response_headers.get("connection", "").lower() == "close"
    assert "max_body_bytes" in assert_error_shape(path, body, code="request_too_large")
    still_serving(server)


@pytest.mark.parametrize("path", [OPENAI, OLLAMA])
def test_chunked_body_over_the_limit_is_413(server: LiveServer, path: str) -> None:
    chunk = b"x" * 16384
    with open_request(server, path, {"Transfer-Encoding": "chunked"}) as sock:
        try:
            for _ in range(LIMIT // len(chunk) + 2):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # the server may answer and close before the last chunk
        status, _, body = read_response(sock)
    assert status == 413
    assert_error_shape(path, body, code="request_too_large")


@pytest.mark.parametrize("path", [OPENAI, OLLAMA])
def test_half_sent_body_is_408_after_the_body_timeout(server: LiveServer, path: str) -> None:
    start = time.monotonic()
    with open_request(server, path, {"Content-Length": "100"}, b'{"model": "m", ') as sock:
        status, headers, body = read_response(sock)
        elapsed = time.monotonic() - start
    assert status == 408 and BODY_TIMEOUT <= elapsed < BODY_TIMEOUT + 5
    assert headers.get("connection", "").lower() == "close"
    assert "body_timeout" in assert_error_shape(path, body, code="request_timeout")
    still_serving(server)


def test_trickled_headers_are_cut_off(server: LiveServer) -> None:
    # A slowloris client: a header byte every 0.2 s, never finishing. idle_timeout (2 s here) is the
    # longest a connection may take to complete its request headers.
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    start = time.monotonic()
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nX-Slow: ".encode())
    closed = False
    with sock:
        while time.monotonic() - start < 15:
            try:
                sock.sendall(b"a")
                sock.settimeout(0.2)
                closed = sock.recv(1024) == b""
            except socket.timeout:
                continue
            except OSError:
                closed = True
            if closed:
                break
    assert closed and time.monotonic() - start < 10
    status, _ = server.json("GET", "/health")
    assert status == 200
