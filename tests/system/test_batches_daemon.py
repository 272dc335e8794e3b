"""Durability on the real daemon: SIGKILL it mid-batch, start it again, and the batch completes
with every custom_id exactly once; then `localserve batch submit` / `results` over the CLI.

The killed batch runs on a gated fake upstream (gated_upstream.py): exactly 3 of its lines are let
through before the kill, so the kill always lands mid-batch, whatever the machine's speed."""

from __future__ import annotations

import json
import signal
import time

import openai

from daemon_util import cli, cli_env, free_port, register_model, serving, stop_quietly, wait_published
from gated_upstream import GatedUpstream, vector

MODEL = "smollm2-135m"
GATED = "gated-kill"


def chat_line(i: int) -> str:
    return json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": f"Write a word about the number {i}."}]}})


def emb_line(i: int) -> str:
    return json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": GATED, "input": f"text {i}"}})


def until(client: openai.OpenAI, batch_id: str, check, timeout: float = 300):
    """Poll until `check(batch)` holds; the timeout only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not check(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, f"stuck at {batch.status} {batch.request_counts}"
        time.sleep(0.05)
    return batch


def test_sigkill_mid_batch_then_resume_exactly_once(tmp_path, smollm2_gguf):
    home = tmp_path / "home"
    n = 24
    with GatedUpstream(GATED) as gate:
        env = cli_env(home, free_port(), LOCALSERVE_UPSTREAMS=json.dumps([gate.table()]))
        register_model(env, smollm2_gguf)
        with serving(env) as proc:
            info = wait_published(home, proc)
            client = openai.OpenAI(base_url=info["url"] + "/v1", api_key="unused", max_retries=0)
            f = client.files.create(file=("in.jsonl", ("\n".join(emb_line(i) for i in range(n)) + "\n").encode()),
                                    purpose="batch")
            batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
            gate.release(GATED, 3)
            until(client, batch.id, lambda b: b.request_counts.completed == 3)  # the rest are held
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        with serving(env) as proc:
            info = wait_published(home, proc)
            client = openai.OpenAI(base_url=info["url"] + "/v1", api_key="unused", max_retries=0)
            before = client.batches.retrieve(batch.id)
            assert before.status == "in_progress" and before.request_counts.completed == 3
            gate.open(GATED)
            done = until(client, batch.id, lambda b: b.status != "in_progress")
            assert done.status == "completed"
            assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
            out = [json.loads(l) for l in client.files.content(done.output_file_id).text.splitlines()]
            ids = [o["custom_id"] for o in out]
            assert sorted(ids) == sorted(f"line-{i}" for i in range(n))  # each exactly once
            assert all(o["response"]["body"]["data"][0]["embedding"] == vector(f"text {o['custom_id'][5:]}")
                       for o in out)

            # The CLI on the same daemon: submit follows to the end and writes the results beside the input.
            src = tmp_path / "small.jsonl"
            src.write_text("\n".join(chat_line(i) for i in range(3)) + "\n" + json.dumps(
                {"custom_id": "oops", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "nope"}}) + "\n")
            result = cli(env, "batch", "submit", str(src), "--model", MODEL, timeout=400)
            assert result.returncode == 0, result.stderr
            lines = [json.loads(l) for l in (tmp_path / "small.results.jsonl").read_text().splitlines()]
            assert [l["custom_id"] for l in lines] == ["line-0", "line-1", "line-2", "oops"]
            assert lines[3]["response"]["status_code"] == 400  # --model replaced "nope"; the body lacks messages
            assert "completed" in result.stderr and "3/4" not in result.stderr.splitlines()[-1]
            listed = cli(env, "batch", "list")
            assert batch.id in listed.stdout and listed.stdout.count("completed") == 2
            again = cli(env, "batch", "results", batch.id)
            assert sorted(json.loads(l)["custom_id"] for l in again.stdout.splitlines()) == sorted(ids)
            stop_quietly(env, proc)
