"""Speculative decoding benchmark: an edit workload and load B, localserve with speculative=auto vs
off, and llama.cpp's llama-server without and with its own n-gram speculation, on the same GGUF,
one server at a time, in one run.

    python benchmarks/speculative.py --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf

Edit workload: a real source file (--file, default a 155-line module of ours) sent with an
instruction to return it with one small change (a different identifier renamed per request, placed
before the file, so no two requests share a cached prefix), greedy, --max-tokens of output each
with end-of-generation banned (full length), at each --concurrency (as many requests as the
concurrency, one wave). Load B (serve.py's: 5-40-word chats, 128 tokens out) at concurrency 8.

Prints per server and workload: output tokens/s (all output over the wall time), decode tokens/s
per request (after its first token: what speculation changes), TTFT p50, and for localserve the
draft tokens verified and accepted (/metrics). Also how many of localserve's greedy edit answers
with speculation equal those without (they can part at near-ties: docs/architecture.md).

Figures, not assertions: tests never time anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import (LOADS, REPO, eog_bias, make_chats, percentile, start_llama_server, start_localserve, stop,  # noqa: E402
                   wait_ready)

# (launcher, extra) per server name: localserve's env, llama-server's flags.
SERVERS: dict[str, tuple[str, Any]] = {
    "localserve": ("localserve", {"LOCALSERVE_SPECULATIVE": "auto"}),
    "localserve-off": ("localserve", {"LOCALSERVE_SPECULATIVE": "off"}),
    "llama-server": ("llama-server", []),
    "llama-server+ngram": ("llama-server", ["--spec-type", "ngram-mod"]),
}
RENAMES = ["request", "sampler", "tokens", "status", "stream", "cells", "order", "seq_id"]


def edit_messages(source: str, i: int) -> list[dict[str, str]]:
    name = RENAMES[i % len(RENAMES)]
    return [{"role": "user", "content": f"Rename `{name}` to `{name}_{i}` in this Python file and return the "
                                        f"whole file, nothing else:\n\n{source}"}]


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    first, text, tokens = None, [], 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens") or tokens
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return {"text": "".join(text), "tokens": tokens, "ttft": (first or end) - start,
            "decode_s": end - (first or end)}


async def wave(url: str, model: str, conversations: list[list[dict[str, str]]], max_tokens: int,
               bias: dict[str, float], concurrency: int) -> tuple[list[dict[str, Any]], float]:
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:
        async def one(messages):
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}, "logit_bias": bias}
            async with limit:
                return await stream_chat(session, url, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(m) for m in conversations))
        return list(results), time.perf_counter() - start


async def drafts(url: str) -> tuple[int, int]:
    """Draft tokens verified and accepted so far, all lanes, from /metrics."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    totals = {"localserve_draft_tokens_total": 0.0, "localserve_draft_accepted_tokens_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return int(totals["localserve_draft_tokens_total"]), int(totals["localserve_draft_accepted_tokens_total"])


def summary(results: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    tokens = sum(r["tokens"] for r in results)
    rates = [(r["tokens"] - 1) / r["decode_s"] for r in results if r["decode_s"] > 0]
    return {"output_tok_s": tokens / seconds, "decode_tok_s_per_request": statistics.median(rates),
            "ttft_ms_p50": percentile([r["ttft"] * 1000 for r in results], 50)}


async def bench_server(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    launcher, extra = SERVERS[name]
    if launcher == "localserve":
        proc, url, model = start_localserve(args.model_path, args.threads, 8, work, extra)
    else:
        proc, url, model = start_llama_server(args.model_path, args.threads, 8, work, extra_args=extra)
    source = Path(args.file).read_text()
    bias = eog_bias(args.model_path)
    out: dict[str, Any] = {}
    try:
        await wait_ready(url, "/health", proc)
        await wave(url, model, [[{"role": "user", "content": "Hello"}]], 4, {}, 1)  # loads the model
        for c in args.concurrency:
            before = await drafts(url) if launcher == "localserve" else (0, 0)
            results, seconds = await wave(url, model, [edit_messages(source, c * 10 + i) for i in range(c)],
                                          args.max_tokens, bias, c)
            after = await drafts(url) if launcher == "localserve" else (0, 0)
            out[f"edit c={c}"] = summary(results, seconds) | {
                "drafted": after[0] - before[0], "accepted": after[1] - before[1]}
            out[f"texts c={c}"] = [r["text"] for r in results]
            print(f"{name} edit c={c}: {out[f'edit c={c}']}", file=sys.stderr)
        lo, hi, max_tokens, _ = LOADS["B"]
        chats = make_chats(args.load_b_requests, args.seed, lo, hi)
        before = await drafts(url) if launcher == "localserve" else (0, 0)
        results, seconds = await wave(url, model, chats, max_tokens, bias, 8)
        after = await drafts(url) if launcher == "localserve" else (0, 0)
        out["load B c=8"] = summary(results, seconds) | {"drafted": after[0] - before[0], "accepted": after[1] - before[1]}
        print(f"{name} load B: {out['load B c=8']}", file=sys.stderr)
    finally:
        stop(proc)
    return out


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    workloads = [f"edit c={c}" for c in args.concurrency] + ["load B c=8"]
    names = list(results)
    print("| workload | figure | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for w in workloads:
        for key in ("output_tok_s", "decode_tok_s_per_request", "ttft_ms_p50", "drafted", "accepted"):
            cells = [f"{results[n][w][key]:.1f}" if isinstance(results[n][w][key], float) else str(results[n][w][key])
                     for n in names]
            print(f"| {w} | {key} | " + " | ".join(cells) + " |")
    if "localserve" in results and "localserve-off" in results:
        for c in args.concurrency:
            on, off = results["localserve"][f"texts c={c}"], results["localserve-off"][f"texts c={c}"]
            same = sum(a == b for a, b in zip(on, off))
            print(f"localserve edit answers with speculation equal to those without, c={c}: {same} of {len(on)}")


async def main_async(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="localserve-spec-"))
    results = {}
    try:
        for name in args.servers:
            run_dir = work / name
            run_dir.mkdir()
            results[name] = await bench_server(name, args, run_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results, args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, required=True)
    p.add_argument("--file", default=str(REPO / "localserve" / "batching" / "sequence.py"))
    p.add_argument("--servers", default=",".join(SERVERS), type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--concurrency", default="1,4,8", type=lambda s: [int(x) for x in s.split(",") if x])
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--load-b-requests", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown:
        p.error(f"unknown servers {unknown}; choose from {', '.join(SERVERS)}")
    args.model_path = args.model_path.resolve()
    return args


if __name__ == "__main__":
    asyncio.run(main_async(parse_args()))
