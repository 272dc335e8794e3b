"""The Ollama-compatible API with plain HTTP, on the real model: NDJSON streams, Ollama's field
names and final statistics, model management (tags/show/ps/pull/delete), embeddings; the tests of
one loaded model run once on each backend (server_harness.BACKENDS)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading

import pytest

from server_harness import BACKENDS, MODEL, MODEL_TAG, LiveServer, backend_server, server_settings

pytestmark = pytest.mark.model
FULL = f"{MODEL}:{MODEL_TAG}"
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module", params=BACKENDS)
def server(request):
    with backend_server(request) as live:
        yield live


def ndjson(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def check_final(final: dict) -> None:
    assert final["done"] is True and final["done_reason"] in ("stop", "length")
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration"):
        assert isinstance(final[key], int) and final[key] >= 0, key
    assert final["prompt_eval_count"] > 0 and 0 < final["eval_count"] <= 12
    assert final["total_duration"] >= final["eval_duration"]


def test_generate_streaming_and_not(server):
    body = {"model": MODEL, "prompt": "Why is the sky blue?", "options": GREEDY}
    status, headers, data = server.request("POST", "/api/generate", body)
    assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")
    lines = ndjson(data)
    assert all(line["model"] == FULL and line["created_at"].endswith("Z") for line in lines)
    assert all(line["done"] is False for line in lines[:-1])
    streamed = "".join(line["response"] for line in lines)
    check_final(lines[-1])

    status, whole = server.json("POST", "/api/generate", {**body, "stream": False})
    assert status == 200 and whole["response"] == streamed
    check_final(whole)
    assert whole["context"][: whole["prompt_eval_count"]] == lines[-1]["context"][: whole["prompt_eval_count"]]
    assert len(whole["context"]) == whole["prompt_eval_count"] + whole["eval_count"]

    # The returned context continues the conversation.
    status, more = server.json("POST", "/api/generate", {"model": MODEL, "prompt": "Say more.", "context": whole["context"],
                                                          "stream": False, "options": GREEDY})
    assert status == 200 and more["prompt_eval_count"] > len(whole["context"])


def test_generate_raw_system_and_stop(server):
    status, r = server.json("POST", "/api/generate", {"model": MODEL, "prompt": "1, 2, 3, 4,", "raw": True,
                                                       "stream": False, "options": {**GREEDY, "stop": [" 7"]}})
    assert status == 200 and " 7" not in r["response"]
    status, r = server.json("POST", "/api/generate", {"model": MODEL, "prompt": "Hi", "system": "Answer in French.",
                                                       "stream": False, "options": GREEDY})
    assert status == 200 and r["response"]


def test_chat_streaming_and_not(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a joke."}], "options": GREEDY}
    status, _, data = server.request("POST", "/api/chat", body)
    lines = ndjson(data)
    assert status == 200
    assert all(line["message"]["role"] == "assistant" for line in lines)
    check_final(lines[-1])
    status, whole = server.json("POST", "/api/chat", {**body, "stream": False})
    assert whole["message"] == {"role": "assistant", "content": "".join(line["message"]["content"] for line in lines)}
    check_final(whole)


def test_format_json_and_schema(server):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["color"]}
    status, r = server.json("POST", "/api/chat", {
        "model": MODEL, "messages": [{"role": "user", "content": "Pick a color."}], "stream": False,
        "format": schema, "options": {"temperature": 0, "num_predict": 30}})
    assert status == 200 and json.loads(r["message"]["content"])["color"] in ("red", "green", "blue")
    status, r = server.json("POST", "/api/generate", {"model": MODEL, "prompt": "A JSON object please.", "format": "json",
                                                       "stream": False, "options": {"temperature": 0, "num_predict": 40}})
    assert status == 200 and r["response"].lstrip().startswith("{")


def test_chat_tools_in_ollama_shape(server):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
    # SmolLM2 is too small to call tools on its own; a format schema forces the call's shape, and the
    # reply must come back as Ollama's tool_calls with arguments as an object.
    call_schema = {"type": "object", "properties": {"name": {"const": "get_time"},
                                                    "arguments": tools[0]["function"]["parameters"]},
                   "required": ["name", "arguments"]}
    status, r = server.json("POST", "/api/chat", {
        "model": MODEL, "messages": [{"role": "user", "content": "What time is it in UTC?"}], "tools": tools,
        "format": call_schema, "stream": False, "options": {"temperature": 0, "num_predict": 40}})
    assert status == 200
    (call,) = r["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and call["function"]["arguments"]["zone"] in ("UTC", "CET")


def test_model_listing_show_and_version(server):
    status, tags = server.json("GET", "/api/tags")
    (entry,) = tags["models"]
    assert entry["name"] == entry["model"] == FULL
    assert entry["size"] > 90_000_000 and len(entry["digest"]) == 64
    assert entry["details"]["format"] == "gguf" and entry["details"]["family"] == "llama"
    assert entry["details"]["quantization_level"] == "Q4_1" and entry["details"]["parameter_size"].endswith("M")

    status, show = server.json("POST", "/api/show", {"model": MODEL})
    assert status == 200
    assert "<|im_start|>" in show["template"]
    assert show["model_info"]["general.architecture"] == "llama"
    # The context a request is served with here (the harness loads 1024), not the trained 8192.
    assert show["model_info"]["llama.context_length"] == 1024 and show["parameters"] == "num_ctx 1024"
    assert show["capabilities"] == ["completion", "tools"]  # tools through the system-prompt fallback
    assert "/" not in show["modelfile"].split("FROM", 1)[1].strip().split(":")[0]  # names the model, not a path

    status, version = server.json("GET", "/api/version")
    assert status == 200 and version["version"]
    status, _, text = server.request("GET", "/")
    assert status == 200 and b"running" in text


def test_ps_and_keep_alive_unload(server):
    server.json("POST", "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False, "options": GREEDY})
    status, ps = server.json("GET", "/api/ps")
    (row,) = ps["models"]
    assert row["name"] == FULL and row["size"] > 0 and row["expires_at"].endswith("Z")
    assert row["details"]["family"] == "llama" and set(row["waiting"]) == {"interactive", "default", "batch"}
    # The harness sizes the engine with context_length=1024, max_sequences=8 (server_harness.py).
    assert (row["context_length"], row["max_sequences"]) == (1024, 8)
    # CI's CPU build of llama.cpp: the loaded engine reports no layer and no byte on a GPU.
    assert (row["gpu_layers"], row["offloadable_layers"], row["size_vram"]) == (0, 0, 0)

    status, r = server.json("POST", "/api/generate", {"model": MODEL, "keep_alive": 0})
    assert status == 200 and r["done"] and r["done_reason"] == "unload"
    assert server.json("GET", "/api/ps")[1]["models"] == []
    status, r = server.json("POST", "/api/chat", {"model": MODEL, "messages": []})
    assert status == 200 and r["done_reason"] == "load" and r["message"]["content"] == ""
    assert [m["name"] for m in server.json("GET", "/api/ps")[1]["models"]] == [FULL]
    # A keep_alive past year 9999 is "never", not a 500 from /api/ps; a non-finite one is refused.
    status, r = server.json("POST", "/api/chat", {"model": MODEL, "messages": [], "keep_alive": 1e12})
    assert status == 200
    status, ps = server.json("GET", "/api/ps")
    assert status == 200 and ps["models"][0]["expires_at"] == "9999-12-31T23:59:59Z"
    status, r = server.json("POST", "/api/chat", {"model": MODEL, "messages": [], "keep_alive": "nan"})
    assert status == 400 and "finite" in r["error"]


def test_bad_options_are_refused_before_the_model_loads(server):
    server.json("POST", "/api/generate", {"model": MODEL, "keep_alive": 0})  # unloaded
    bad = {"temperature": "hot"}
    status, r = server.json("POST", "/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "options": bad, "stream": False})
    assert status == 400 and "temperature" in r["error"]
    status, r = server.json("POST", "/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                                      "options": {"num_predict": "many"}})
    assert status == 400 and "num_predict" in r["error"]
    assert server.json("GET", "/api/ps")[1]["models"] == []  # nothing was loaded for them


def test_embeddings(server):
    status, r = server.json("POST", "/api/embed", {"model": MODEL, "input": ["hello world", "goodbye"]})
    assert status == 200 and r["model"] == FULL
    assert len(r["embeddings"]) == 2 and len(r["embeddings"][0]) == 576
    assert r["prompt_eval_count"] > 0 and r["total_duration"] > 0
    status, legacy = server.json("POST", "/api/embeddings", {"model": MODEL, "prompt": "hello world"})
    assert status == 200 and legacy["embedding"] == pytest.approx(r["embeddings"][0], abs=1e-5)
    # truncate (the default) cuts inputs to the context; truncate=false refuses them.
    status, r = server.json("POST", "/api/embed", {"model": MODEL, "input": "word " * 1500})
    assert status == 200
    status, r = server.json("POST", "/api/embed", {"model": MODEL, "input": "word " * 1500, "truncate": False})
    assert status == 400 and "error" in r


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def file_host(smollm2_gguf):
    """A local web server handing out the model file, like a model host would."""
    handler = functools.partial(_Quiet, directory=str(smollm2_gguf.parent))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/{smollm2_gguf.name}"
    httpd.shutdown()


def test_pull_progress_and_delete(smollm2_gguf, file_host, tmp_path):
    digest = hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({"models": {"tiny-test": {"description": "test", "default": "Q4_1", "variants": {
        "Q4_1": {"quant": "Q4_1", "size": smollm2_gguf.stat().st_size, "sha256": digest, "file": "tiny.gguf",
                 "sources": [{"url": file_host}]}}}}}))
    with LiveServer(server_settings(tmp_path / "home", catalog=catalog)) as live:
        status, _, data = live.request("POST", "/api/pull", {"model": "tiny-test"})
        assert status == 200
        lines = ndjson(data)
        assert lines[-1] == {"status": "success"}
        progress = [line for line in lines if "completed" in line]
        assert progress and progress[-1]["completed"] == progress[-1]["total"] == smollm2_gguf.stat().st_size
        assert [m["name"] for m in live.json("GET", "/api/tags")[1]["models"]] == ["tiny-test:Q4_1"]
        status, again = live.json("POST", "/api/pull", {"model": "tiny-test", "stream": False})
        assert status == 200 and again == {"status": "success"}

        status, r = live.json("POST", "/api/generate", {"model": "tiny-test", "prompt": "Hi", "stream": False,
                                                        "options": GREEDY})
        assert status == 200 and r["model"] == "tiny-test:Q4_1"
        status, _, _ = live.request("DELETE", "/api/delete", {"model": "tiny-test"})
        assert status == 200
        assert live.json("GET", "/api/tags")[1]["models"] == []
        assert live.json("GET", "/api/ps")[1]["models"] == []
        status, r = live.json("DELETE", "/api/delete", {"model": "tiny-test"})
        assert status == 404 and "error" in r
        status, r = live.json("POST", "/api/pull", {"model": "not-in-any-catalog"})
        assert status == 404 and isinstance(r["error"], str)
