"""Host check (DNS rebinding), CORS allow-list and API key, on a real server (no model needed:
these answers come before any model is touched)."""

from __future__ import annotations

import pytest

from localserve.config.settings import DEFAULT_CORS_ORIGINS, replace
from localserve.errors import ConfigError
from localserve.runtime.manager import ModelManager
from localserve.server import create_app
from localserve.server.security import (
    MAX_HEADER_NAME_LEN,
    MAX_PREFLIGHT_HEADERS,
    is_local_host,
    origin_allowed,
    requested_headers,
    split_host,
)

from server_harness import LiveServer, raw_http, server_settings


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(server_settings(tmp_path_factory.mktemp("home"))) as live:
        yield live


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    with LiveServer(server_settings(tmp_path_factory.mktemp("home"), api_key="s3cret-key")) as live:
        yield live


def get(port: int, path: str, host: str, extra: str = "") -> tuple[int, bytes]:
    answer = raw_http(port, f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{extra}\r\n".encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "localhost.evil.example", "192.168.1.10",
                                  "10.0.0.1:11480", ""])
def test_foreign_host_is_refused(server, host):
    status, body = get(server.port, "/v1/models", host)
    assert status == 403
    assert b'"code":"host_not_allowed"' in body.replace(b" ", b"")
    status, _ = get(server.port, "/health", host)  # /health is not exempt from the Host check
    assert status == 403


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "app.localhost", "127.0.0.1", "127.0.0.2:99", "[::1]:8080"])
def test_local_hosts_are_served(server, host):
    status, _ = get(server.port, "/health", host)
    assert status == 200


def test_ollama_paths_answer_in_ollama_shape(server):
    status, body = get(server.port, "/api/tags", "evil.example")
    assert status == 403 and body.startswith(b'{"error":') and b'"type"' not in body


def test_cors_allow_list(server):
    for origin in ["http://localhost:3000", "http://127.0.0.1", "vscode-webview://abc123", "vscode-file://vscode-app"]:
        status, headers, _ = server.request("GET", "/v1/models", headers={"Origin": origin})
        assert status == 200 and headers.get("Access-Control-Allow-Origin") == origin, origin
        assert "Origin" in headers.get("Vary", "")
    for origin in ["https://evil.example", "http://localhost.evil.example", "http://localhostx:80", "null"]:
        status, headers, data = server.request("GET", "/v1/models", headers={"Origin": origin})
        assert status == 403 and "Access-Control-Allow-Origin" not in headers, origin
        assert b"origin_not_allowed" in data


def test_cross_site_simple_post_is_refused(server):
    # What a hostile page can send without a preflight: a text/plain POST. It must not run.
    status, headers, _ = server.request("DELETE", "/api/delete", raw=b'{"model": "x"}',
                                        headers={"Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers


# What the official `openai` npm package makes Chromium ask for: lowercase and sorted, as browsers send it.
SDK_HEADERS = ("authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,"
               "x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,"
               "x-stainless-runtime-version,x-stainless-timeout")


def preflight(server, origin: str, request_headers: str | None = SDK_HEADERS) -> tuple[int, dict[str, str], bytes]:
    pre = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    if request_headers is not None:
        pre["Access-Control-Request-Headers"] = request_headers
    return server.request("OPTIONS", "/v1/chat/completions", headers=pre)


def assert_no_grant(headers: dict[str, str]) -> None:
    for name in ("Access-Control-Allow-Origin", "Access-Control-Allow-Methods", "Access-Control-Allow-Headers",
                 "Access-Control-Allow-Credentials"):
        assert name not in headers, name


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1", "http://[::1]", "http://[::1]:8080",
                                    "vscode-webview://abc123"])
def test_cors_preflight_echoes_the_requested_headers(server, origin):
    status, headers, _ = preflight(server, origin)
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == origin
    assert [h.strip() for h in headers["Access-Control-Allow-Headers"].split(",")] == SDK_HEADERS.split(",")
    assert {"GET", "POST", "DELETE"} <= {m.strip() for m in headers["Access-Control-Allow-Methods"].split(",")}
    assert int(headers["Access-Control-Max-Age"]) > 0
    vary = {v.strip() for v in headers["Vary"].split(",")}
    assert {"Origin", "Access-Control-Request-Headers"} <= vary
    assert "Access-Control-Allow-Credentials" not in headers


def test_cors_preflight_without_request_headers(server):
    status, headers, _ = preflight(server, "http://localhost:3000", None)
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "Access-Control-Allow-Headers" not in headers
    # Empty list items are legal (RFC 9110 asks recipients to skip them).
    status, headers, _ = preflight(server, "http://localhost:3000", " content-type, ,authorization,")
    assert status == 204 and headers["Access-Control-Allow-Headers"] == "content-type, authorization"


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost.evil.example", "http://[::2]",
                                    "http://[::1].evil.example", "https://[::1]", "null"])
def test_cors_preflight_from_a_foreign_origin_grants_nothing(server, origin):
    status, headers, data = preflight(server, origin)
    assert status == 403 and b"origin_not_allowed" in data
    assert_no_grant(headers)


@pytest.mark.parametrize("request_headers", [
    "content-type, x bad",                      # a space inside a name
    "content-type;authorization",               # not comma-separated
    "x-stainless-os, x(y)",                     # a separator character
    "x-" + "a" * 200,                           # longer than any real header name
    ",".join(f"x-h{i}" for i in range(65)),      # more names than any client sends
    "authorization, x-\"quoted\"",
])
def test_cors_preflight_with_malformed_header_names_is_refused(server, request_headers):
    status, headers, data = preflight(server, "http://localhost:5173", request_headers)
    assert status == 403 and b"headers_not_allowed" in data
    assert_no_grant(headers)


def test_cors_preflight_with_non_ascii_header_name_is_refused(server):
    # urllib cannot send these bytes; a raw request can (and a hostile client would).
    answer = raw_http(server.port, b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Origin: http://localhost:1\r\nAccess-Control-Request-Method: POST\r\n"
                      b"Access-Control-Request-Headers: x-\xc3\xa9t\xc3\xa9\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"403" and b"headers_not_allowed" in body
    assert b"access-control-allow" not in head.lower()


def test_ipv6_loopback_page_is_served(server):
    for origin in ["http://[::1]", "http://[::1]:5173"]:
        status, headers, _ = server.request("GET", "/v1/models", headers={"Origin": origin})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == origin


def test_every_answer_varies_on_origin(server):
    status, headers, _ = server.request("GET", "/v1/models")
    assert status == 200 and "Origin" in headers["Vary"] and "Access-Control-Allow-Origin" not in headers


def test_wildcard_allow_list_still_names_the_origin(tmp_path):
    with LiveServer(server_settings(tmp_path, cors_origins=("*",))) as live:
        status, headers, _ = preflight(live, "https://anything.example")
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "https://anything.example"
        assert "Access-Control-Allow-Credentials" not in headers


def test_requested_headers_parser():
    assert requested_headers("") == []
    assert requested_headers("X-Stainless-OS , Authorization") == ["X-Stainless-OS", "Authorization"]
    assert requested_headers("a" * MAX_HEADER_NAME_LEN) == ["a" * MAX_HEADER_NAME_LEN]
    assert requested_headers("a" * (MAX_HEADER_NAME_LEN + 1)) is None
    assert requested_headers(",".join(["x"] * MAX_PREFLIGHT_HEADERS)) is not None
    assert requested_headers(",".join(["x"] * (MAX_PREFLIGHT_HEADERS + 1))) is None
    for bad in ["a b", "a:b", "a/b", "a\tb", "é", "a\x00"]:
        assert requested_headers(bad) is None, bad


def test_streaming_responses_get_cors_headers_too(server):
    # An error answered before streaming and a preflight are covered above; the header hook runs
    # at prepare time, so a model-less 404 from a POST route shows the same grant.
    status, headers, _ = server.request("POST", "/v1/chat/completions",
                                        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
                                        headers={"Origin": "vscode-webview://x", "Content-Type": "application/json"})
    assert status == 404 and headers["Access-Control-Allow-Origin"] == "vscode-webview://x"


def test_api_key_enforced(keyed):
    status, body = keyed.json("GET", "/v1/models")
    assert status == 401
    assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
    assert keyed.json("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert keyed.json("GET", "/v1/models", headers={"Authorization": "Bearer s3cret-key"})[0] == 200
    assert keyed.json("GET", "/v1/models", headers={"X-Api-Key": "s3cret-key"})[0] == 200
    status, body = keyed.json("GET", "/api/tags")
    assert status == 401 and isinstance(body["error"], str)
    assert keyed.json("GET", "/health")[0] == 200  # exempt from the key
    status, _ = get(keyed.port, "/health", "evil.example")  # ... but not from the Host check
    assert status == 403


def test_api_key_works_with_the_openai_package(keyed):
    import openai

    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret-key", max_retries=0)
    assert good.models.list().data == []
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_non_loopback_bind_requires_a_key(tmp_path):
    settings = server_settings(tmp_path, host="0.0.0.0")
    with pytest.raises(ConfigError):
        create_app(settings, ModelManager(settings))
    create_app(replace(settings, api_key="k"), ModelManager(settings))


def test_helpers():
    assert split_host("[::1]:80") == "::1" and split_host("Example.COM.:8080") == "example.com"
    assert is_local_host("::1") and is_local_host("127.1.2.3") and not is_local_host("::ffff:8.8.8.8")
    assert is_local_host("myhost", bind_host="myhost") and not is_local_host("myhost", bind_host="0.0.0.0")
    assert origin_allowed("http://localhost:8080", ["http://localhost"])
    assert not origin_allowed("http://localhost:80x", ["http://localhost"])
    assert not origin_allowed("http://localhost@evil.example", ["http://localhost"])
    assert origin_allowed("http://[::1]:8080", DEFAULT_CORS_ORIGINS) and origin_allowed("http://[::1]", DEFAULT_CORS_ORIGINS)
    assert not origin_allowed("http://[::1]:80x", DEFAULT_CORS_ORIGINS)
