"""Decode throughput of the ONNX Runtime backend vs the llama.cpp backend and onnxruntime-genai's
own engine (OGA) on the same weights.

    python benchmarks/onnx_backends.py [--model PATH] [--threads N] [--steps N] [--weights fp32,int8] [--no-oga]

Both backends load the test model (SmolLM2-135M Q4_1 by default; the ONNX side converts it first
into a temporary folder, once per --weights form: int4 MatMulNBits blocks and/or fp32 dequantized
weights, with the weights file's size and the RSS a load adds), prefill BATCH sequences with a short prompt,
then time STEPS packed decode steps of one token per sequence (decode + argmax per row), for batch
1, 4, 8 and 16. Figures are the best of 3 repeats: on a shared machine the rest is noise.
OGA has no step-level API: its row is BATCH concurrent greedy requests of STEPS tokens through its
engine, output tokens over wall time (a short prefill included), the closest it offers.

Then the mixed load, through each one's request-level engine (engine_api.ModelEngine, what the
server calls): 32 streaming greedy requests of mixed prompt (20-240 tokens) and answer (16-96
tokens) lengths, 8 in flight at a time; output tok/s over the wall time and TTFT p50/p95. The OGA
folder is converted from the same GGUF (fp32, its default). Prints the tables and, as its last
line, one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# This file is named onnx.py: with its own folder first on sys.path, `import onnx` would find it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from localserve.backends.base import BatchToken  # noqa: E402

BATCHES = (1, 4, 8, 16)
PROMPT = "<|im_start|>user\nTell me a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"
MIXED_REQUESTS, MIXED_CONCURRENCY = 32, 8
FILLER = "The keeper climbed the stairs again and counted the ships that passed the rocks at night. "


def decode_tok_s(backend, batch: int, steps: int) -> float:
    ids = backend.tokenize(PROMPT)
    best = 0.0
    for _ in range(3):
        for s in range(batch):
            backend.kv_remove(s)
        backend.decode([BatchToken(t, s, i, i == len(ids) - 1) for s in range(batch) for i, t in enumerate(ids)])
        rows = [(s + 1) * len(ids) - 1 for s in range(batch)]
        nxt = [int(backend.logits_row(r).argmax()) for r in rows]
        start = time.perf_counter()
        for k in range(steps):
            backend.decode([BatchToken(nxt[s], s, len(ids) + k, True) for s in range(batch)])
            nxt = [int(backend.logits_row(s).argmax()) for s in range(batch)]
        best = max(best, batch * steps / (time.perf_counter() - start))
    for s in range(batch):
        backend.kv_remove(s)
    return best


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def mixed_requests(tokenize, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, answer length) of the mixed load: prompts of 1-12 filler sentences (about 20
    per sentence) and answers of 16-96 tokens, the same for every engine."""
    rng = random.Random(seed)
    out = []
    for i in range(MIXED_REQUESTS):
        text = f"<|im_start|>user\nStory {i}: " + FILLER * rng.randint(1, 12) + "Go on.<|im_end|>\n<|im_start|>assistant\n"
        out.append((tokenize(text), rng.randint(16, 96)))
    return out


async def _stream(engine, ids: list[int], max_tokens: int, started: float) -> tuple[float, int]:
    """(TTFT s, tokens) of one greedy streaming request that runs to max_tokens."""
    from localserve.protocol.requests import GenerationRequest, SamplingParams

    ttft, n = None, 0
    stream = await engine.generate(GenerationRequest(ids, SamplingParams(temperature=0), max_tokens=max_tokens,
                                                     ignore_eos=True))
    async for event in stream:
        if event.token_ids and ttft is None:
            ttft = time.perf_counter() - started
        n += len(event.token_ids)
    return ttft or 0.0, n


async def _concurrent(engine, work: list[tuple[list[int], int]], concurrency: int) -> tuple[float, list[float], int]:
    """(wall s, TTFTs, output tokens) of `work` sent `concurrency` at a time (a new one as one ends)."""
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def one(ids, max_tokens):
        async with gate:
            return await _stream(engine, ids, max_tokens, time.perf_counter())

    results = await asyncio.gather(*[one(ids, n) for ids, n in work])
    return time.perf_counter() - start, [r[0] for r in results], sum(r[1] for r in results)


def mixed_load(engine, work) -> dict[str, float]:
    wall, ttfts, tokens = asyncio.run(_concurrent(engine, work, MIXED_CONCURRENCY))
    return {"tok_s": tokens / wall, "ttft_p50_ms": 1000 * float(np.percentile(ttfts, 50)),
            "ttft_p95_ms": 1000 * float(np.percentile(ttfts, 95))}


def engine_batch_tok_s(engine, ids: list[int], batch: int, steps: int) -> float:
    """OGA's row of the decode table: `batch` concurrent requests of `steps` tokens, best of 3."""
    best = 0.0
    for _ in range(3):
        wall, _, tokens = asyncio.run(_concurrent(engine, [(ids, steps)] * batch, batch))
        best = max(best, tokens / wall)
    return best


def our_engine(backend, slots: int):
    """Our scheduler over `backend`, sized as the mixed load needs (8 sequences, no prefix cache: the
    prompts share a filler that would otherwise favour whoever caches it)."""
    from localserve.batching.limits import EngineLimits
    from localserve.engine.local import Engine

    limits = EngineLimits(max_sequences=MIXED_CONCURRENCY, batch_tokens=256, n_ctx=slots, n_ctx_seq=512,
                          prefix_cache=False, kv_unified=True)
    engine = Engine(backend, limits, name="bench")
    engine.start()
    return engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the test model in .test-cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--slots", type=int, default=2048, help="KV cells/slots of both backends")
    ap.add_argument("--weights", default="fp32,int8", help="the ONNX folders' weights, comma-separated")
    ap.add_argument("--no-oga", action="store_true", help="leave out onnxruntime-genai's engine")
    args = ap.parse_args()
    from localserve.backends.llamacpp.backend import LlamaCppBackend
    from localserve.backends.onnx.load import load_onnx
    from localserve.convert import convert_gguf

    gguf = args.model or next((HERE.parent / ".test-cache" / "home").rglob("*.gguf"))
    results: dict[str, dict[int, float]] = {}
    mixed: dict[str, dict[str, float]] = {}
    sizes: dict[str, str] = {}
    for weights in args.weights.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            convert_gguf(gguf, Path(tmp) / "onnx", weights=weights)
            convert_s = time.perf_counter() - t0
            rss = _rss()
            onnx = load_onnx(Path(tmp) / "onnx", gguf, n_ctx=args.slots, n_seq_max=16, n_batch=512,
                                    n_threads=args.threads)
            rss = _rss() - rss
            results[f"onnx-{weights}"] = {b: decode_tok_s(onnx, b, args.steps) for b in BATCHES}
            engine = our_engine(onnx, args.slots)
            mixed[f"onnx-{weights}"] = mixed_load(engine, mixed_requests(onnx.tokenize))
            engine.shutdown()
            onnx.close()
            size = (Path(tmp) / "onnx" / "model.onnx.data").stat().st_size
            sizes[weights] = f"{weights}: converted in {convert_s:.1f} s, {size / 2**20:.0f} MiB, load +{rss / 2**20:.0f} MiB RSS"
    llama = LlamaCppBackend.load(gguf, n_ctx=args.slots, n_seq_max=16, n_batch=512, n_threads=args.threads,
                                 kv_unified=True, flash_attention=False)
    results["llamacpp"] = {b: decode_tok_s(llama, b, args.steps) for b in BATCHES}
    work = mixed_requests(llama.tokenize)
    engine = our_engine(llama, args.slots)
    mixed["llamacpp"] = mixed_load(engine, work)
    engine.shutdown()
    llama.close()
    if not args.no_oga:
        from localserve.convert.oga import convert_gguf_oga
        from localserve.runtime.oga_loader import build_oga_engine

        with tempfile.TemporaryDirectory() as tmp:
            convert_gguf_oga(gguf, Path(tmp) / "oga", weights="fp32")
            oga = build_oga_engine(Path(tmp) / "oga", threads=args.threads)
            ids = oga.tokenize(PROMPT, add_special=False)
            results["oga-fp32"] = {b: engine_batch_tok_s(oga, ids, b, args.steps) for b in BATCHES}
            mixed["oga-fp32"] = mixed_load(oga, work)
            oga.shutdown()
    print("; ".join(sizes.values()))
    print(f"decode tok/s, {args.threads} threads, {args.slots} KV slots")
    print("backend    " + "".join(f"{'batch ' + str(b):>10}" for b in BATCHES))
    for name, row in results.items():
        print(f"{name:<11}" + "".join(f"{row[b]:>10.1f}" for b in BATCHES))
    print(f"\nmixed load: {MIXED_REQUESTS} streaming requests, {MIXED_CONCURRENCY} in flight")
    print(f"{'engine':<11}{'tok/s':>10}{'TTFT p50':>12}{'TTFT p95':>12}")
    for name, m in mixed.items():
        print(f"{name:<11}{m['tok_s']:>10.1f}{m['ttft_p50_ms']:>10.0f}ms{m['ttft_p95_ms']:>10.0f}ms")
    first = next(iter(results))
    ratio = results[first][8] / results[first][1]
    print(json.dumps({"folders": sizes, f"{first}_b8_over_b1": round(ratio, 2),
                      **{f"{n}_b{b}": round(v, 1) for n, r in results.items() for b, v in r.items()},
                      **{f"mixed_{n}_{k}": round(v, 1) for n, m in mixed.items() for k, v in m.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
