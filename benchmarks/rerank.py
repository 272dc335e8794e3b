"""Rerank throughput and latency, localserve beside llama-server --reranking, and what reranking costs
running chats on localserve.

    python benchmarks/rerank.py --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf

No reranker GGUF can be fetched on these machines: the benchmark ranks with the test reranker
(tests/rerank_model.py: SmolLM2 with a seeded rank head and Qwen3-Reranker's rerank template), which
both servers load alike. Each server runs alone, in alternating passes (localserve, llama-server,
localserve, ...), one at a time on the same cores. Per pass: `--requests` rerank requests one after
another, each a query and `--documents` documents; printed: pairs per second, request latency p50 and
p95. localserve then runs the same requests while two chats stream on the same model, and prints the
chats' tokens per second without and with the reranking beside them (llama-server started with
--reranking serves no chat, so it has no such row).

Figures, not assertions: tests never time anything (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import REPO, percentile, start_llama_server, start_localserve, stop, wait_ready  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from rerank_model import with_rank_head  # noqa: E402  (the reranker the tests use)

WORDS = ("model server local token batch cache query document search index rank score memory thread "
         "paris france river city capital bridge museum tower garden street night light").split()


def documents(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "." for _ in range(n)]


async def rerank_pass(url: str, model: str, args: argparse.Namespace) -> tuple[list[float], int]:
    """(latency of each request, pairs ranked)."""
    latencies = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for i in range(args.requests):
            body = {"model": model, "query": "Which city has the tower by the river?",
                    "documents": documents(args.documents, args.words, args.seed + i)}
            start = time.perf_counter()
            async with session.post(url + "/v1/rerank", json=body) as resp:
                data = await resp.json()
                if resp.status != 200 or len(data.get("results", ())) != args.documents:
                    raise RuntimeError(f"rerank answered {resp.status}: {str(data)[:200]}")
            latencies.append(time.perf_counter() - start)
    return latencies, args.requests * args.documents


async def chat_loop(session: aiohttp.ClientSession, url: str, model: str, stop_at: asyncio.Event,
                    tokens: list[int]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 128,
            "stream": True, "temperature": 0.7}
    while not stop_at.is_set():
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                async for line in resp.content:
                    if b'"content"' in line:
                        tokens[0] += 1  # a token a chunk: speculative decoding is off (main_async)
                    if stop_at.is_set():
                        break


async def chats_during(url: str, model: str, seconds: float | None, work) -> tuple[float, object]:
    """Two chats' tokens per second while `work` (a coroutine) runs, or for `seconds` without it."""
    tokens = [0]
    stop_at = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        chats = [asyncio.create_task(chat_loop(session, url, model, stop_at, tokens)) for _ in range(2)]
        await asyncio.sleep(2.0)  # both are decoding
        tokens[0] = 0
        start = time.perf_counter()
        result = await work if work is not None else await asyncio.sleep(seconds or 0)
        elapsed = time.perf_counter() - start
        stop_at.set()
        for chat in chats:
            chat.cancel()
        await asyncio.gather(*chats, return_exceptions=True)
    return tokens[0] / elapsed, result


def row(name: str, load: str, latencies: list[float], pairs: int) -> str:
    return (f"{name:<12} {load:<14} {pairs / sum(latencies):7.1f} pairs/s  latency p50 "
            f"{percentile(latencies, 50) * 1000:6.0f} ms  p95 {percentile(latencies, 95) * 1000:6.0f} ms")


async def main_async(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="localserve-rerank-bench-"))
    try:
        model_path = with_rank_head(Path(args.model_path).resolve(), work / "rerank.gguf")
        pooled: dict[tuple[str, str], list[float]] = {}
        chat_rates: dict[str, list[float]] = {}
        for round_no in range(args.rounds):
            for name in args.servers.split(","):
                run_dir = work / f"{name}-{round_no}"
                run_dir.mkdir()
                if name == "localserve":
                    # Drafts off: a chunk is then one token, which is what the chats' rate counts.
                    proc, url, model = start_localserve(model_path, args.threads, 8, run_dir,
                                                        {"LOCALSERVE_SPECULATIVE": "off"})
                else:
                    proc, url, model = start_llama_server(model_path, args.threads, 8, run_dir,
                                                          extra_args=["--reranking"])
                try:
                    await wait_ready(url, "/health", proc)
                    await rerank_pass(url, model, argparse.Namespace(**{**vars(args), "requests": 1}))  # load, warm
                    latencies, pairs = await rerank_pass(url, model, args)
                    print(row(name, "alone", latencies, pairs), flush=True)
                    pooled.setdefault((name, "alone"), []).extend(latencies)
                    if name == "localserve":
                        rate_alone, _ = await chats_during(url, model, sum(latencies), None)
                        rate_beside, (latencies, pairs) = await chats_during(url, model, None,
                                                                            rerank_pass(url, model, args))
                        print(row(name, "beside 2 chats", latencies, pairs)
                              + f"  chats {rate_alone:.1f} tok/s alone, {rate_beside:.1f} beside", flush=True)
                        pooled.setdefault((name, "beside 2 chats"), []).extend(latencies)
                        chat_rates.setdefault("alone", []).append(rate_alone)
                        chat_rates.setdefault("beside", []).append(rate_beside)
                finally:
                    stop(proc)
        print(f"\npooled over {args.rounds} round(s), {args.documents} documents of {args.words} words a request:")
        for (name, load), latencies in pooled.items():
            print(row(name, load, latencies, len(latencies) * args.documents))
        if chat_rates:
            print(f"localserve chats: {statistics.median(chat_rates['alone']):.1f} tok/s alone, "
                  f"{statistics.median(chat_rates['beside']):.1f} tok/s while reranking (medians)")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="a llama-architecture GGUF (SmolLM2): a rank head is added to a copy")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=10, help="rerank requests per pass")
    p.add_argument("--documents", type=int, default=32, help="documents per request")
    p.add_argument("--words", type=int, default=40, help="words per document")
    p.add_argument("--seed", type=int, default=45)
    p.add_argument("--rounds", type=int, default=2, help="alternating passes per server")
    p.add_argument("--servers", default="localserve,llama-server", help="comma-separated, in pass order")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async(parse_args())))
