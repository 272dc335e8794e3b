"""Engine benchmark on the real SmolLM2-135M: per-step overhead, lane latency, prefix-cache gain.

    python benchmarks/engine.py [--model PATH] [--threads N]

--threads defaults to 1: on a shared 2-core machine llama.cpp's two spinning threads collapse
whenever anything else runs (measured: the bare loop at batch 1 swung between 80 and 2 tok/s), which
makes every figure noise. Both loops run on the same backend, so the ratios hold for any count;
use --threads 2 on an idle machine for absolute speed.

Prints a table, then as its last line one JSON object:
  engine_vs_bare_b8                  engine decode tok/s at batch 8 / bare llama_decode+argmax loop
                                     at batch 8 (same backend and context, same run); target >= 0.9
  interactive_ttft_under_load_ratio  TTFT of an interactive request while 16 batch-lane requests
                                     decode / its TTFT on an idle engine; target <= 1.5
  prefix_hit_ttft_ratio              TTFT with a 1,000-token prefix cached / uncached; target <= 0.25
  interactive_itl_p95_ms             gaps between the tokens of 2 interactive streams while 6
                                     batch-lane requests with ~400-token prompts arrive: the
                                     product (batch prompts get a quarter of each step while the
                                     interactive lane decodes) and, as "_whole_budget", the same
                                     run with batch prompts allowed the whole step
Each figure is the median (ratios) or best (throughput) of a few repeats: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from localserve.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from localserve.backends.llamacpp.baseline import greedy_bare_loop  # noqa: E402
from localserve.batching.limits import EngineLimits  # noqa: E402
from localserve.protocol.requests import GenerationRequest, SamplingParams  # noqa: E402
from localserve.engine.local import Engine  # noqa: E402

# Where the test suite's fixture pulls the model (through our own puller).
DEFAULT_MODEL = REPO / ".test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf"
GREEDY = SamplingParams(temperature=0)
# The product's defaults: a KV stream per sequence id (n_ctx = ids x cells per stream), flash
# attention off (config.py says why). 2048 cells per stream hold the 1,000-token prefix test.
N_SEQ_MAX, N_CTX_SEQ, N_BATCH = 32, 2048, 512
N_CTX = N_SEQ_MAX * N_CTX_SEQ
DECODE_TOKENS = 64
BATCH_SIZES = (1, 4, 8, 16)
ROUNDS = 3  # throughput: best of; latencies: median of


def prompt(backend: LlamaCppBackend, i: int, words: int) -> list[int]:
    """A distinct prompt per i (no shared prefix: every benchmark computes what it measures)."""
    body = " ".join(f"item{i}-{k}" for k in range(words))
    return backend.tokenize(f"Request {i}. Continue this list: {body}")


def new_engine(backend: LlamaCppBackend, **limits) -> Engine:
    backend.kv_clear()  # a fresh engine's books start empty: so must the cache
    values = dict(max_sequences=16, batch_tokens=N_BATCH, n_ctx=N_CTX, n_ctx_seq=N_CTX_SEQ, prefix_cache=False)
    values.update(limits)
    engine = Engine(backend, EngineLimits(**values), name="bench")
    engine.start()
    return engine


async def stream_times(engine: Engine, request: GenerationRequest, t_submit: float) -> list[tuple[float, int]]:
    """(arrival time, tokens) for each event with tokens."""
    out = []
    async for event in engine.submit(request):
        if event.token_ids:
            out.append((time.perf_counter(), len(event.token_ids)))
    return out


async def engine_decode_rate(backend: LlamaCppBackend, batch: int) -> float:
    """Tokens/s of the decode phase: from the moment every sequence has its first token to the end,
    counting the tokens generated in between (as the bare loop counts its decode steps)."""
    engine = new_engine(backend)
    try:
        prompts = [prompt(backend, 100 + i, 8) for i in range(batch)]
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(
            stream_times(engine, GenerationRequest(p, GREEDY, max_tokens=DECODE_TOKENS, ignore_eos=True), t0)
            for p in prompts
        ))
    finally:
        engine.shutdown()
    start = max(s[0][0] for s in streams)
    end = max(s[-1][0] for s in streams)
    tokens = sum(n for s in streams for t, n in s if t > start)
    return tokens / (end - start)


def bare_decode_rate(backend: LlamaCppBackend, batch: int) -> float:
    prompts = [prompt(backend, 100 + i, 8) for i in range(batch)]
    result = greedy_bare_loop(backend, prompts, DECODE_TOKENS)
    backend.kv_clear()
    return result.decode_tokens_per_s


async def ttft(engine: Engine, tokens: list[int], lane: str = "interactive") -> float:
    t0 = time.perf_counter()
    async for event in engine.submit(GenerationRequest(tokens, GREEDY, max_tokens=1, lane=lane)):
        if event.token_ids:
            return time.perf_counter() - t0
    raise RuntimeError("no token")


async def interactive_under_load(backend: LlamaCppBackend) -> tuple[float, float]:
    """Median TTFT of a ~150-token interactive prompt on an idle engine and with 16 batch-lane
    requests decoding. The budget (256) is the engine's default on a 2-core machine."""
    engine = new_engine(backend, batch_tokens=256, max_sequences=17)
    try:
        idle = [await ttft(engine, prompt(backend, 200 + r, 60)) for r in range(ROUNDS)]
        load = [
            asyncio.ensure_future(engine.submit(GenerationRequest(
                prompt(backend, 300 + i, 8), GREEDY, max_tokens=100_000, ignore_eos=True, lane="batch",
            )).__anext__())
            for i in range(16)
        ]
        await asyncio.gather(*load)  # all 16 are decoding now
        loaded = []
        for r in range(ROUNDS):
            await asyncio.sleep(0.05 * (r + 1))  # arrive at different points of a step
            loaded.append(await ttft(engine, prompt(backend, 400 + r, 60)))
    finally:
        engine.shutdown()
    return statistics.median(idle), statistics.median(loaded)


async def interactive_itl_under_batch_prompts(backend: LlamaCppBackend, worse_lane_share: int | None = None
                                              ) -> tuple[float, float]:
    """(p95 gap between interactive tokens, seconds until the batch requests finished) while 6
    batch-lane requests with ~400-token prompts arrive beside 2 decoding interactive streams; with
    the scheduler's own share of the step for batch prompts, or `worse_lane_share` (1: no cap)."""
    engine = new_engine(backend, batch_tokens=256, max_sequences=8)
    if worse_lane_share is not None:
        engine.scheduler.worse_lane_share = worse_lane_share  # set before any request reaches the engine
    try:
        chat = [engine.submit(GenerationRequest(prompt(backend, 600 + i, 8), GREEDY, max_tokens=100_000,
                                                ignore_eos=True, lane="interactive")) for i in range(2)]
        for stream in chat:
            await stream.__anext__()  # both are decoding now
        times: list[float] = []
        done = asyncio.Event()

        async def follow(stream) -> None:
            async for event in stream:
                if done.is_set():
                    return
                if event.token_ids:
                    times.append(time.perf_counter())

        followers = [asyncio.ensure_future(follow(s)) for s in chat]
        t0 = time.perf_counter()
        await asyncio.gather(*(
            stream_times(engine, GenerationRequest(prompt(backend, 700 + i, 150), GREEDY, max_tokens=4, lane="batch"), t0)
            for i in range(6)
        ))
        batch_s = time.perf_counter() - t0
        done.set()
    finally:
        engine.shutdown()
    await asyncio.gather(*followers, return_exceptions=True)
    times.sort()
    # Two streams: the gap of one stream is the time between its consecutive tokens, which with both
    # decoding every step is the step time; pairs of arrivals in one step are ~0 apart, so take the
    # gaps between steps (those above 1 ms).
    gaps = [b - a for a, b in zip(times, times[1:]) if b - a > 0.001]
    return statistics.quantiles(gaps, n=20)[-1], batch_s


async def prefix_hit(backend: LlamaCppBackend) -> tuple[float, float, int]:
    """Median TTFT of prefix(1,000 tokens) + question, uncached vs with the prefix cached."""
    engine = new_engine(backend, batch_tokens=256, prefix_cache=True)
    misses, hits, cached = [], [], 0
    try:
        for r in range(ROUNDS):
            prefix = prompt(backend, 500 + r, 1000)[:1000]
            misses.append(await ttft(engine, prefix + backend.tokenize(" First question?", add_special=False)))
            question = prefix + backend.tokenize(" Second question?", add_special=False)
            hits.append(await ttft(engine, question))
        cached = engine.stats().prefix_cache_hits // ROUNDS
    finally:
        engine.shutdown()
    return statistics.median(misses), statistics.median(hits), cached


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not args.model.is_file():
        print(f"model file not found: {args.model} (run the test suite once to fetch it)", file=sys.stderr)
        return 2
    backend = LlamaCppBackend.load(args.model, n_ctx=N_CTX, n_seq_max=N_SEQ_MAX, n_batch=N_BATCH, n_threads=args.threads,
                                   kv_unified=False, flash_attention=False)
    t_start = time.perf_counter()
    bare_loop_warmup = bare_decode_rate(backend, 4)  # first decodes pay for page faults and caches
    assert bare_loop_warmup > 0

    rows = []
    for batch in BATCH_SIZES:
        bare = engine = 0.0
        for _ in range(ROUNDS):  # interleaved, best of: the machine is shared
            bare = max(bare, bare_decode_rate(backend, batch))
            engine = max(engine, await engine_decode_rate(backend, batch))
        rows.append((batch, bare, engine))
    idle, loaded = await interactive_under_load(backend)
    miss, hit, cached = await prefix_hit(backend)
    itl_share, batch_share = await interactive_itl_under_batch_prompts(backend)
    itl_whole, batch_whole = await interactive_itl_under_batch_prompts(backend, 1)
    backend.close()

    print(f"SmolLM2-135M Q4_1, {args.threads} threads, {N_SEQ_MAX} KV streams of {N_CTX_SEQ}, decode of {DECODE_TOKENS} tokens per sequence")
    print(f"{'batch':>5} | {'bare tok/s':>10} | {'engine tok/s':>12} | {'engine/bare':>11}")
    for batch, bare, engine in rows:
        print(f"{batch:>5} | {bare:>10.1f} | {engine:>12.1f} | {engine / bare:>11.3f}")
    print(f"interactive TTFT: idle {idle * 1000:.1f} ms, under 16 batch requests {loaded * 1000:.1f} ms")
    print(f"prefix TTFT: uncached {miss * 1000:.1f} ms, {cached} tokens cached {hit * 1000:.1f} ms")
    print(f"interactive ITL p95 while batch prompts arrive: {itl_share * 1000:.1f} ms (batch prompts get a "
          f"quarter of each step; the batch requests took {batch_share:.1f} s) vs {itl_whole * 1000:.1f} ms "
          f"(whole step; {batch_whole:.1f} s)")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    b8 = next(r for r in rows if r[0] == 8)
    summary = {
        "engine_vs_bare_b8": round(b8[2] / b8[1], 3),
        "interactive_ttft_under_load_ratio": round(loaded / idle, 3),
        "prefix_hit_ttft_ratio": round(hit / miss, 3),
        "engine_tok_s": {str(b): round(e, 1) for b, _, e in rows},
        "bare_tok_s": {str(b): round(x, 1) for b, x, _ in rows},
        "interactive_ttft_idle_ms": round(idle * 1000, 1),
        "interactive_ttft_loaded_ms": round(loaded * 1000, 1),
        "prefix_ttft_uncached_ms": round(miss * 1000, 1),
        "prefix_ttft_cached_ms": round(hit * 1000, 1),
        "interactive_itl_p95_ms": round(itl_share * 1000, 1),
        "interactive_itl_p95_ms_whole_budget": round(itl_whole * 1000, 1),
        "batch_requests_s": round(batch_share, 2),
        "batch_requests_s_whole_budget": round(batch_whole, 2),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
