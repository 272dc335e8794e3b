"""Batch mode of the serving benchmark (serve.py's helpers): the Batch API against the same work
sent to /v1/chat/completions, and interactive TTFT while a batch runs.

    python benchmarks/serve_batch.py --launch --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/serve_batch.py --url http://127.0.0.1:11480 --model smollm2-135m

1. 256 short chats (5-40 words, 32 tokens out, end-of-generation banned so every answer has its
   full length) as one batch: output tokens/s from batches.create to completed.
2. The same 256 requests streamed to /v1/chat/completions at concurrency 8: output tokens/s.
   Each of the two runs twice, in the order batch, concurrent, concurrent, batch: a shared
   machine's speed drifts by a tenth over minutes, more than the difference being measured, and
   this order cancels a steady drift. Each figure is its two passes' tokens over their seconds.
3. Interactive TTFT p95 of short chats sent one after another, idle and while a second copy of the
   batch runs. Figures, not assertions; a shared machine makes them noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import eog_bias, make_chats, percentile, run_load, start_localserve, stop, wait_ready  # noqa: E402

PROBES = 20


def batch_file(chats: list, model: str, max_tokens: int, extra: dict) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "messages": chat, "max_tokens": max_tokens, "temperature": 0, **extra}}) + "\n"
        for i, chat in enumerate(chats)).encode()


def run_batch(client: openai.OpenAI, data: bytes) -> tuple[float, int, str]:
    """(seconds, output tokens, batch id) of one batch from create to completed."""
    f = client.files.create(file=("bench.jsonl", data), purpose="batch")
    start = time.perf_counter()
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    elapsed = time.perf_counter() - start
    if batch.output_file_id is None:  # cancelled before any line completed
        return elapsed, 0, batch.id
    tokens = sum(json.loads(l)["response"]["body"]["usage"]["completion_tokens"]
                 for l in client.files.content(batch.output_file_id).text.splitlines())
    return elapsed, tokens, batch.id


async def probe(url: str, model: str, extra: dict, seed: int) -> list[float]:
    out = []
    for chat in make_chats(PROBES, seed, 5, 20):
        results, _ = await run_load(url, model, [chat], concurrency=1, request_rate=math.inf, max_tokens=8,
                                    seed=seed, api_key=None, extra={**extra, "priority": "interactive"})
        out += [r.ttft * 1000 for r in results if r.ok]
        await asyncio.sleep(0.3)
    return out


async def bench(url: str, model: str, args: argparse.Namespace) -> None:
    extra = {"logit_bias": eog_bias(Path(args.model_path))} if args.model_path else {}
    chats = make_chats(args.lines, args.seed, 5, 40)
    data = batch_file(chats, model, args.max_tokens, extra)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    await asyncio.to_thread(run_batch, client, batch_file(chats[:8], model, 4, extra))  # load the model, warm up
    passes: dict[str, list[tuple[float, int]]] = {"batch": [], "concurrent": []}
    for mode in ("batch", "concurrent", "concurrent", "batch"):
        if mode == "batch":
            seconds, tokens, _ = await asyncio.to_thread(run_batch, client, data)
        else:
            results, seconds = await run_load(url, model, chats, concurrency=8, request_rate=math.inf,
                                              max_tokens=args.max_tokens, seed=args.seed, api_key=None, extra=extra)
            tokens = sum(r.output_tokens for r in results if r.ok)
        passes[mode].append((seconds, tokens))
        print(f"  pass: {mode:10s} {tokens / seconds:6.1f} tok/s ({seconds:.1f} s)", flush=True)
    (b_s, b_tokens), (c_s, c_tokens) = ([sum(x) for x in zip(*passes[m])] for m in ("batch", "concurrent"))
    idle = await probe(url, model, extra, args.seed + 100)
    running = asyncio.create_task(asyncio.to_thread(run_batch, client, data))
    await asyncio.sleep(2)  # the batch is under way
    loaded = await probe(url, model, extra, args.seed + 200)
    for batch in client.batches.list(limit=5):  # its work is done: do not wait for its end
        if batch.status == "in_progress":
            client.batches.cancel(batch.id)
    await running
    print(f"\n{args.lines} chats, {args.max_tokens} tokens out each (two passes each)")
    print(f"  batch API:                {b_tokens / b_s:8.1f} tok/s ({b_s:.1f} s)")
    print(f"  /v1/chat, concurrency 8:  {c_tokens / c_s:8.1f} tok/s ({c_s:.1f} s)"
          f"   batch/concurrent = {(b_tokens / b_s) / (c_tokens / c_s):.2f}x")
    p_idle, p_loaded = percentile(idle, 95), percentile(loaded, 95)
    print(f"  interactive TTFT p95:     idle {p_idle:.0f} ms, batch running {p_loaded:.0f} ms"
          f"   ratio {p_loaded / p_idle:.2f}x")
    print(f"  probes, ms: idle {sorted(round(t) for t in idle)}; batch running {sorted(round(t) for t in loaded)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--launch", action="store_true", help="start localserve on --model-path")
    p.add_argument("--model-path")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--lines", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--localserve-env", action="append", default=[], type=lambda t: tuple(t.split("=", 1)),
                   metavar="NAME=VALUE", help="a setting for the launched localserve (repeatable)")
    args = p.parse_args()
    if not args.launch:
        asyncio.run(bench(args.url, args.model, args))
        return 0
    with tempfile.TemporaryDirectory() as work:
        proc, url, model = start_localserve(Path(args.model_path).resolve(), args.threads, args.sequences, Path(work),
                                             dict(args.localserve_env))
        try:
            asyncio.run(wait_ready(url, "/health", proc))
            asyncio.run(bench(url, model, args))
        finally:
            stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
