"""The Batch API with the official `openai` client against a real server and the real model:
files.create -> batches.create -> batches.retrieve until final -> files.content, for chat,
completions and embeddings (each greedy line answers as the same request sent alone); bad lines
in the error file with the endpoint's own error body; bad files refused at create naming the line;
404s. Cancel, expiry, a full disk and a failing database, each at a point the test holds the batch
at, are test_batches_gated.py."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest

from server_harness import MODEL, model_server

FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_gguf):
    with model_server(tmp_path_factory.mktemp("batches"), smollm2_gguf) as server:
        yield server


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def line(cid: str, url: str, body: dict[str, Any], method: str = "POST") -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body})


def submit(client: openai.OpenAI, lines: list[str], endpoint: str) -> Any:
    f = client.files.create(file=("input.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0 and f.filename == "input.jsonl"
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h",
                                 metadata={"test": "yes"})


def wait(client: openai.OpenAI, batch_id: str, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINAL:
            return batch
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} did not finish within {timeout} s")


def contents(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(l) for l in client.files.content(file_id).text.splitlines()] if file_id else []


def by_id(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    ids = [i["custom_id"] for i in items]
    assert len(ids) == len(set(ids)), "a custom_id appears twice"
    return {i["custom_id"]: i for i in items}


def chat_body(i: int, max_tokens: int = 12) -> dict[str, Any]:
    system = "You are terse." if i % 2 else "You answer in French."
    return {"model": MODEL, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Name fruit number {i}."}]}


def test_chat_batch_answers_as_single_requests(client):
    bodies = {f"chat-{i}": chat_body(i, 6) for i in range(8)}
    batch = submit(client, [line(cid, "/v1/chat/completions", b) for cid, b in bodies.items()], "/v1/chat/completions")
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 8
    assert batch.metadata == {"test": "yes"} and batch.expires_at - batch.created_at == 86_400
    done = wait(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.completed, done.request_counts.failed) == (8, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = by_id(contents(client, done.output_file_id))
    assert set(out) == set(bodies)
    for cid, body in bodies.items():
        item = out[cid]
        assert item["error"] is None and item["response"]["status_code"] == 200
        assert item["id"].startswith("batch_req_") and item["response"]["request_id"].startswith("req_")
        got = item["response"]["body"]
        assert got["object"] == "chat.completion"
        alone = client.chat.completions.create(**body)
        assert got["choices"][0]["message"]["content"] == alone.choices[0].message.content
    out_file = client.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output"
    assert done.id in [b.id for b in client.batches.list(limit=100).data]


def test_completions_and_embeddings_batches(client):
    prompts = {f"c{i}": {"model": MODEL, "prompt": f"The {i}th planet is", "max_tokens": 6, "temperature": 0}
               for i in range(4)}
    inputs = {f"e{i}": {"model": MODEL, "input": f"sentence number {i}"} for i in range(4)}
    b1 = submit(client, [line(c, "/v1/completions", b) for c, b in prompts.items()], "/v1/completions")
    b2 = submit(client, [line(c, "/v1/embeddings", b) for c, b in inputs.items()], "/v1/embeddings")
    d1, d2 = wait(client, b1.id), wait(client, b2.id)
    assert (d1.status, d2.status) == ("completed", "completed")
    for cid, item in by_id(contents(client, d1.output_file_id)).items():
        alone = client.completions.create(**prompts[cid])
        assert item["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
    for cid, item in by_id(contents(client, d2.output_file_id)).items():
        alone = client.embeddings.create(**inputs[cid], encoding_format="float")
        assert item["response"]["body"]["data"][0]["embedding"] == pytest.approx(alone.data[0].embedding, abs=1e-6)


def test_bad_lines_get_the_endpoints_error_body(client, live):
    url = "/v1/chat/completions"
    bad_bodies = {
        "bad-temp": {**chat_body(1), "temperature": 9},
        "no-model": {**chat_body(1), "model": "no-such-model"},
        "no-messages": {"model": MODEL},
    }
    lines = [line("good", url, chat_body(2, 4)), "{this is not json",
             line("wrong-url", "/v1/embeddings", chat_body(1)), line("wrong-method", url, chat_body(1), method="GET"),
             *(line(cid, url, body) for cid, body in bad_bodies.items())]
    done = wait(client, submit(client, lines, url).id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 6)
    errors = contents(client, done.error_file_id)
    assert sum(1 for e in errors if e["custom_id"] is None) == 1  # the line that is not JSON
    errors_by_id = by_id([e for e in errors if e["custom_id"] is not None])
    for cid, body in bad_bodies.items():
        status, direct = live.json("POST", url, body)
        assert errors_by_id[cid]["response"]["status_code"] == status and status in (400, 404)
        assert errors_by_id[cid]["response"]["body"] == direct
    assert errors_by_id["wrong-url"]["response"]["body"]["error"]["param"] == "url"
    assert errors_by_id["wrong-method"]["response"]["body"]["error"]["param"] == "method"
    assert set(by_id(contents(client, done.output_file_id))) == {"good"}


@pytest.mark.parametrize("data, where", [
    (b"name,age\nbob,3\n", "line 1: not JSON"),
    (b'{"custom_id": "a", "url": "/v1/embeddings", "method": "POST", "body": {}}\n[1, 2]\n', "line 2: not a JSON object"),
    (b'{"custom_id": "a"}\n{"custom_id": "b"}\n\n{"custom_id": "a"}\n', "line 4: custom_id 'a' repeats line 1"),
    (b'{"custom_id": "a"}\n\xff\xfe\n', "line 2: not UTF-8"),
    (b'{"url": "/v1/embeddings"}\n', "line 1: 'custom_id' must be"),
])
def test_bad_files_are_refused_at_create_naming_the_line(client, data, where):
    f = client.files.create(file=("x.jsonl", data), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    assert where in e.value.body["message"] and e.value.body["param"] == "input_file_id"


def test_limits_unknown_ids_and_bad_fields(client, live):
    settings = live.settings
    f = client.files.create(file=("x.jsonl", b'{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c"}\n'),
                            purpose="batch")
    settings.batch_max_lines = 2
    try:
        with pytest.raises(openai.BadRequestError, match="line 3: more than 2 requests"):
            client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    finally:
        settings.batch_max_lines = 50_000
    settings.batch_max_file_bytes = 10
    try:
        with pytest.raises(openai.BadRequestError, match="larger than 10 bytes"):
            client.files.create(file=("x.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
    finally:
        settings.batch_max_file_bytes = 200 * 1024 * 1024
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
