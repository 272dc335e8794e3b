"""llama.cpp server's native `/completion` and `/props` (Continue's and Tabby's llama.cpp providers,
llama.vscode's startup), `t_max_predict_ms`, and the SSE pings every stream gets while it waits,
on the real model through a real server."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from server_harness import MODEL, model_server

pytestmark = pytest.mark.model
COUNTING = "1\n2\n3\n4\n5\n"  # SmolLM2 goes on counting, a line a number: newlines come early


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf):
    # One sequence at a time, so a second stream waits in the queue; pings every 0.2 s.
    with model_server(tmp_path_factory.mktemp("home"), smollm2_gguf, max_sequences=1,
                      sse_ping_interval=0.2) as live:
        yield live


def sse_lines(server, path: str, body: dict) -> list[bytes]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return [line.rstrip(b"\n") for line in resp if line.strip()]


def frames(lines: list[bytes]) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in lines if line.startswith(b"data: ")]


def test_completion_answers_as_v1_completions_does(server) -> None:
    body = {"prompt": "The capital of France is", "n_predict": 12, "temperature": 0}
    status, native = server.json("POST", "/completion", {**body, "model": MODEL, "return_tokens": True})
    assert status == 200, native
    status, openai = server.json("POST", "/v1/completions", {"model": MODEL, "prompt": body["prompt"],
                                                             "max_tokens": 12, "temperature": 0})
    assert status == 200
    assert native["content"] == openai["choices"][0]["text"]
    assert native["stop"] is True and native["stop_type"] == "limit" and native["tokens_predicted"] == 12
    assert len(native["tokens"]) == 12 and native["prompt"] == body["prompt"]
    assert native["tokens_evaluated"] == openai["usage"]["prompt_tokens"]
    assert set(native["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"}


def test_completion_streams_content_then_the_summary(server) -> None:
    prompt = "def fibonacci(n):\n    " + "# the n-th Fibonacci number, computed by a loop\n    " * 6
    body = {"model": MODEL, "prompt": prompt, "n_predict": 12, "temperature": 0, "stream": True}
    got = frames(sse_lines(server, "/completion", body))
    assert all(f["stop"] is False for f in got[:-1]) and got[-1]["stop"] is True
    status, whole = server.json("POST", "/completion", {**body, "stream": False})
    assert "".join(f["content"] for f in got[:-1]) == whole["content"]
    # The same prompt again (the next keystroke's request): the prefix cache serves most of it.
    assert whole["tokens_cached"] >= whole["tokens_evaluated"] // 2 > 0
    assert whole["timings"]["cache_n"] == whole["tokens_cached"]


def test_completion_takes_token_ids_and_a_json_schema(server) -> None:
    status, tok = server.json("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                                          "logprobs": 0})
    status, by_ids = server.json("POST", "/completion", {"model": MODEL, "prompt": [1, 19556], "n_predict": 4,
                                                         "temperature": 0})
    assert status == 200 and by_ids["tokens_evaluated"] == 2
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    status, shaped = server.json("POST", "/completion", {"model": MODEL, "prompt": "A number as JSON:",
                                                         "n_predict": 24, "temperature": 0, "json_schema": schema})
    assert status == 200 and shaped["content"].lstrip().startswith("{")


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "grammar": "root ::= \"a\""}, "grammar"),
    ({"prompt": "x", "json_schema": "object"}, "json_schema"),
    ({"prompt": "x", "n_predict": "many"}, "n_predict"),
    ({"prompt": "x", "t_max_predict_ms": -5}, "t_max_predict_ms"),
])
def test_completion_refuses_bad_fields_in_openais_error_shape(server, body, param) -> None:
    status, err = server.json("POST", "/completion", {"model": MODEL, **body})
    assert status == 400
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"


def test_t_max_predict_ms_ends_a_long_answer_after_a_newline(server) -> None:
    body = {"model": MODEL, "prompt": COUNTING, "n_predict": 2000, "temperature": 0, "t_max_predict_ms": 200}
    status, out = server.json("POST", "/completion", body)
    assert status == 200, out
    assert out["stop_type"] == "limit" and 0 < out["tokens_predicted"] < 2000
    assert "\n" in out["content"]
    # Streamed, the last frame says the same, and the model is free for the next request.
    got = frames(sse_lines(server, "/completion", {**body, "stream": True}))
    assert got[-1]["stop"] is True and got[-1]["stop_type"] == "limit"
    assert server.engine_stats()["running"] == 0


def test_props_gives_the_served_context_and_slots(server) -> None:
    status, props = server.json("GET", "/props")
    assert status == 200
    status, show = server.json("POST", "/api/show", {"model": MODEL})
    assert props["default_generation_settings"]["n_ctx"] == show["model_info"]["llama.context_length"] == 1024
    assert props["total_slots"] == 1
    assert "/" not in props["model_path"]  # a model name, never where the file is
    status, named = server.json("GET", f"/props?model={MODEL}")
    assert status == 200 and named["model_alias"] == props["model_alias"]
    status, missing = server.json("GET", "/props?model=nope")
    assert status == 404


def test_a_waiting_stream_gets_keepalive_chunks_before_its_first_token(server) -> None:
    first = threading.Thread(target=sse_lines, args=(server, "/completion", {
        "model": MODEL, "prompt": COUNTING, "n_predict": 300, "temperature": 0, "stream": True,
        "ignore_eos": True}))
    first.start()
    time.sleep(0.3)  # the first request holds the only sequence
    lines = sse_lines(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True})
    first.join(120)
    # Keepalives the SDK parses (a chunk with empty text, no finish_reason), not comments it drops.
    assert b": ping" not in lines
    chunks = frames(lines[:-1])
    text_at = next(i for i, chunk in enumerate(chunks) if chunk["choices"][0]["text"])
    assert text_at >= 2 and all(chunk["choices"] == [{"index": 0, "text": "", "logprobs": None,
                                                      "finish_reason": None}] for chunk in chunks[:text_at])
    assert lines[-1] == b"data: [DONE]"


def test_the_openai_sdk_reads_through_pings(server) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="x")
    first = threading.Thread(target=sse_lines, args=(server, "/completion", {
        "model": MODEL, "prompt": COUNTING, "n_predict": 200, "temperature": 0, "stream": True}))
    first.start()
    time.sleep(0.3)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    first.join(120)
    assert text


def test_an_anthropic_stream_that_waits_gets_anthropics_ping_events(server) -> None:
    first = threading.Thread(target=sse_lines, args=(server, "/completion", {
        "model": MODEL, "prompt": COUNTING, "n_predict": 300, "temperature": 0, "stream": True,
        "ignore_eos": True}))
    first.start()
    time.sleep(0.3)
    lines = sse_lines(server, "/v1/messages", {"model": MODEL, "max_tokens": 4, "stream": True,
                                               "messages": [{"role": "user", "content": "Hi"}]})
    first.join(120)
    events = [line[len(b"event: "):] for line in lines if line.startswith(b"event: ")]
    waited = events[:events.index(b"content_block_start")]
    assert waited[0] == b"message_start" and waited.count(b"ping") >= 2
    assert b": ping" not in lines  # Anthropic's own ping event, not the comment
    assert events[-1] == b"message_stop"


def test_id_slot_is_superseded_only_by_the_same_client(server) -> None:
    """Issue 49 #10. A second /completion for id_slot 0 with the same User-Agent from the same process
    (its own connection: one request at a time per HTTP/1.1 connection) ends the first; one from
    another process with the same User-Agent is another client, and both are answered (here one
    after the other: this server runs one sequence)."""
    import asyncio
    import subprocess
    import sys

    import aiohttp

    body = {"model": MODEL, "prompt": COUNTING, "id_slot": 0, "temperature": 0, "ignore_eos": True}
    editor = {"User-Agent": "axios/1.7.9"}
    other_process = (
        "import json, sys, urllib.request\n"
        "req = urllib.request.Request(sys.argv[1] + '/completion', data=sys.argv[2].encode(),\n"
        "                             headers={'Content-Type': 'application/json', 'User-Agent': 'axios/1.7.9'})\n"
        "with urllib.request.urlopen(req, timeout=300) as resp:\n"
        "    print(resp.status, json.loads(resp.read())['stop'])\n")

    async def first_frames(http: aiohttp.ClientSession, n_predict: int):
        response = await http.post("/completion", json={**body, "n_predict": n_predict, "stream": True}, headers=editor)
        lines = response.content.__aiter__()
        async for line in lines:
            if line.startswith(b"data: "):
                assert json.loads(line[6:])["stop"] is False  # it is generating
                return response, lines
        raise AssertionError("no frame")

    async def run() -> None:
        async with aiohttp.ClientSession(server.url) as http:
            # Another process, the same User-Agent: the first runs to its end.
            first, lines = await first_frames(http, 40)
            async with first:
                other = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", other_process, server.url, json.dumps({**body, "n_predict": 2}),
                    stdout=subprocess.PIPE)
                rest = [json.loads(line[6:]) async for line in lines if line.startswith(b"data: ")]
            out, _ = await other.communicate()
            assert out.split() == [b"200", b"True"], out
            assert "error" not in rest[-1] and rest[-1]["stop"] is True, rest[-1]
            assert rest[-1]["tokens_predicted"] == 40

            # The same process, the same User-Agent: the first is superseded.
            first, lines = await first_frames(http, 400)
            async with first:
                async with http.post("/completion", json={**body, "n_predict": 2}, headers=editor) as newer:
                    assert newer.status == 200 and (await newer.json())["tokens_predicted"] == 2
                rest = [json.loads(line[6:]) async for line in lines if line.startswith(b"data: ")]
            assert "superseded" in rest[-1]["error"]["message"], rest[-1]

    asyncio.run(run())
