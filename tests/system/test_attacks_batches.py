"""The Batch API's attack cases of review 3 (issue 25) against the real daemon: each gets its 4xx in
OpenAI's error shape, without a host path, and the daemon stays responsive.

- a 40 MiB line (a 413 over HTTP) is refused at create naming the line and max_body_bytes, before
  anything parses or tokenizes it, with /health fast meanwhile;
- multipart without a boundary, and a part header line over 8,190 bytes: 400, not 500;
- a create whose input file vanished after the lookup (what a create racing a DELETE sees): the
  404 a create after the delete gets, not a 500;
- a line holding a 5,000-digit integer is answered with the endpoint's 400 under its own custom_id.
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Iterator

import openai
import pytest

from daemon_util import attacked_daemon
from test_attacks import HEALTH_BUDGET_S, HealthProbe, _split, assert_clean

pytestmark = pytest.mark.model
BOUNDARY = "xBoundary7"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[tuple[str, Path]]:
    home = tmp_path_factory.mktemp("batch-attacks")
    with attacked_daemon(home, smollm2_gguf) as (info, _):
        yield info["url"], home


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post_form(url: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*_split(url), timeout=60)
    try:
        conn.request("POST", "/v1/files", body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_40_mib_line_is_refused_at_create_with_health_fast(daemon: tuple[str, Path]) -> None:
    url, _ = daemon
    client = client_of(url)
    big = json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "smol", "messages": [{"role": "user", "content": "word " * (8 << 20)}]}})  # 40 MiB
    small = json.dumps({"custom_id": "ok", "method": "POST", "url": "/v1/embeddings",
                        "body": {"model": "smol", "input": "hi"}})
    f = client.files.create(file=("big.jsonl", f"{small}\n{big}\n".encode()), purpose="batch")
    with HealthProbe(url) as probe:
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        took = time.monotonic() - t0
        time.sleep(0.1)  # the probe sees the daemon just after the answer too
    message = e.value.body["message"]
    # Refused by size, naming the line: not a context-length 400, which only a tokenizer could give.
    assert "line 2" in message and "max_body_bytes" in message and "context" not in message, message
    assert e.value.body["param"] == "input_file_id"
    assert_clean(json.dumps(e.value.body).encode())
    assert probe.latencies and max(probe.latencies) < HEALTH_BUDGET_S, max(probe.latencies, default=None)
    assert took < 5, took  # loose: the refusal reads 8 MiB of the line, never the 40


@pytest.mark.parametrize("content_type, body, words", [
    ("multipart/form-data", b"--x\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--x--\r\n",
     "boundary"),
    (f"multipart/form-data; boundary={BOUNDARY}",
     f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\nX-Long: ".encode()
     + b"a" * 9000 + f"\r\n\r\n{{}}\r\n--{BOUNDARY}--\r\n".encode(), "8190 bytes"),
])
def test_malformed_multipart_is_a_400(daemon: tuple[str, Path], content_type: str, body: bytes, words: str) -> None:
    url, _ = daemon
    status, raw = post_form(url, body, content_type)
    assert status == 400, raw[:300]
    error = json.loads(raw)["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error", error
    assert_clean(raw)


def test_create_whose_file_vanished_is_the_404_of_a_deleted_file(daemon: tuple[str, Path]) -> None:
    url, home = daemon
    client = client_of(url)
    f = client.files.create(file=("in.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
    # The state a create racing DELETE /v1/files/{id} meets: the lookup passed, the content is gone.
    (home / "batches" / "files" / f.id).unlink()
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["param"] == "input_file_id" and f.id in e.value.body["message"]
    assert_clean(json.dumps(e.value.body).encode())


def test_a_5000_digit_integer_keeps_the_lines_custom_id(daemon: tuple[str, Path]) -> None:
    url, _ = daemon
    client = client_of(url)
    line = (b'{"custom_id": "huge-int", "method": "POST", "url": "/v1/embeddings", "body": {"model": "smol", '
            b'"input": "hi", "dimensions": ' + b"9" * 5000 + b"}}\n")
    good = b'{"custom_id": "fine", "method": "POST", "url": "/v1/embeddings", "body": {"model": "smol", "input": "hi"}}\n'
    f = client.files.create(file=("in.jsonl", line + good), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 120
    while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, done.status
        time.sleep(0.1)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    [error] = [json.loads(l) for l in client.files.content(done.error_file_id).text.splitlines()]
    assert error["custom_id"] == "huge-int"
    assert error["response"]["status_code"] == 400 and "digits" in error["response"]["body"]["error"]["message"]
