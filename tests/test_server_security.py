"""Host check (DNS rebinding), CORS allow-list and API key, on a real server (no model needed:
these answers come before any model is touched)."""

from __future__ import annotations

import pytest

from localserve.config import replace
from localserve.errors import ConfigError
from localserve.models import ModelManager
from localserve.server import create_app
from localserve.server.security import is_local_host, origin_allowed, split_host

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


def test_cors_preflight(server):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,authorization"}
    status, headers, _ = server.request("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://localhost:5173", **pre})
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
    assert "POST" in headers["Access-Control-Allow-Methods"] and "Authorization" in headers["Access-Control-Allow-Headers"]
    status, headers, _ = server.request("OPTIONS", "/v1/chat/completions", headers={"Origin": "https://evil.example", **pre})
    assert "Access-Control-Allow-Origin" not in headers and "Access-Control-Allow-Methods" not in headers


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
