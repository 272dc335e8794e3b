"""Images inside the continuous batch: time to first token of a one-image question (issue 43).

    python benchmarks/vision.py [--passes 2] [--threads 2]

Three figures, for localserve's engine and for llama.cpp's own llama-server (built from the sources
the pinned llama-cpp-python vendors: benchmarks/llama_server_build.py) with the same GGUF and
projector (`--mmproj`), one after the other in alternating passes (A B A B):

- **alone**: a question about a new image, nothing else running;
- **beside 4 chats**: the same kind of question while 4 streaming chats decode;
- **again**: a second question about the image of `alone` (its cells in the prefix cache).

Targets: alone <= 1.0x llama-server; beside 4 chats <= 1.3x alone; again <= 0.2x the first.

The model is tests/vision_model.py's: SmolLM2-135M with a SmolVLM-shaped projector of seeded
weights (64 positions per tile, a tile and an overview per image), built into a temporary folder.
localserve's side is its engine (engine/local.py, as a worker runs it: one KV stream per sequence,
flash attention off, the default step budget), called directly: the HTTP dialects that carry images
are the API half of the issue, so until they land this measures the engine without the daemon's
HTTP hop (a millisecond). llama-server gets the same image as a `data:` URL over HTTP.

Figures, not assertions: tests never time anything (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vision_model  # noqa: E402
from serve import start_llama_server, stop, wait_ready  # noqa: E402

SLOTS = 8
SLOT_CTX = 2048
QUESTION = "Describe the picture in detail."
CHAT = "Tell me a long story about {topic}."
TOPICS = ("rivers", "bread", "owls", "tea")
MAX_TOKENS = 8
CHAT_TOKENS = 400  # the chats outlast the question


def image(seed: int):
    from localserve.protocol.media import ImageInput

    data = vision_model.test_image(seed)
    return ImageInput(data=data, sha256=hashlib.sha256(data).hexdigest(), width=96, height=96, format="png")


# --- localserve's engine ------------------------------------------------------------------------
class LocalEngine:
    def __init__(self, model: Path, projector: Path, threads: int):
        from localserve.backends.llamacpp.backend import LlamaCppBackend
        from localserve.batching.limits import EngineLimits
        from localserve.engine.local import Engine

        budget = max(256, min(2048, 128 * threads))  # the default step budget (batching/limits.py)
        self.backend = LlamaCppBackend.load(model, n_ctx=SLOT_CTX * SLOTS, n_seq_max=SLOTS, n_batch=budget,
                                            n_threads=threads, kv_unified=False, flash_attention=False,
                                            mmproj=projector)
        self.engine = Engine(self.backend, EngineLimits(max_sequences=SLOTS, batch_tokens=budget,
                                                        n_ctx=SLOT_CTX * SLOTS, n_ctx_seq=SLOT_CTX,
                                                        prefix_cache=True), name="bench")
        self.engine.start()

    async def ask(self, seed: int) -> float:
        from localserve.protocol.media import MEDIA_MARKER
        from localserve.protocol.requests import GenerationRequest, SamplingParams

        img = image(seed)
        text = f"<|im_start|>user\n{MEDIA_MARKER}\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
        t0 = time.perf_counter()
        tokens = await asyncio.to_thread(self.engine.tokenize_media, text, [img])
        request = GenerationRequest(tokens, SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS,
                                    ignore_eos=True, images=[img], lane="interactive")
        ttft = None
        async for event in self.engine.submit(request):
            if ttft is None and event.token_ids:
                ttft = time.perf_counter() - t0
        return ttft or float("nan")

    async def chat(self, topic: str) -> None:
        from localserve.protocol.requests import GenerationRequest, SamplingParams

        tokens = self.backend.tokenize(f"<|im_start|>user\n{CHAT.format(topic=topic)}<|im_end|>\n"
                                       "<|im_start|>assistant\n")
        request = GenerationRequest(tokens, SamplingParams(temperature=0.0), max_tokens=CHAT_TOKENS, ignore_eos=True)
        stream = self.engine.submit(request)
        try:
            async for _ in stream:
                pass
        finally:
            stream.cancel()  # the pass is over: the engine drops it, as a client that left

    def running(self) -> int:
        return self.engine.stats().running

    def close(self) -> None:
        self.engine.shutdown()
        self.backend.close()


# --- llama-server -------------------------------------------------------------------------------
class LlamaServer:
    def __init__(self, model: Path, projector: Path, threads: int, work: Path):
        self.proc, self.url, self.name = start_llama_server(
            model, threads, SLOTS, work, ["--mmproj", str(projector), "-fa", "off", "--no-warmup"], SLOT_CTX)
        self.in_flight = 0

    async def start(self) -> None:
        await wait_ready(self.url, "/health", self.proc)

    async def _stream(self, body: dict) -> float:
        body = {"model": self.name, "stream": True, "temperature": 0, "ignore_eos": True, **body}
        t0 = time.perf_counter()
        ttft = None
        self.in_flight += 1
        try:
            # A fresh connection per request (serve.py: llama-server closes a streamed response's).
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer bench"}) as session:
                async with session.post(self.url + "/v1/chat/completions", json=body) as resp:
                    resp.raise_for_status()
                    async for line in resp.content:
                        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                            continue
                        delta = json.loads(line[6:])["choices"][0].get("delta", {})
                        if ttft is None and delta.get("content"):
                            ttft = time.perf_counter() - t0
        finally:
            self.in_flight -= 1
        return ttft or float("nan")

    async def ask(self, seed: int) -> float:
        url = "data:image/png;base64," + base64.b64encode(image(seed).data).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
        return await self._stream({"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS})

    async def chat(self, topic: str) -> None:
        await self._stream({"messages": [{"role": "user", "content": CHAT.format(topic=topic)}],
                            "max_tokens": CHAT_TOKENS})

    def running(self) -> int:
        return self.in_flight

    def close(self) -> None:
        stop(self.proc)


# --- the passes ---------------------------------------------------------------------------------
async def one_pass(server, seed: int) -> dict[str, float]:
    alone = await server.ask(seed)
    again = await server.ask(seed)
    chats = [asyncio.ensure_future(server.chat(topic)) for topic in TOPICS]
    while server.running() < len(TOPICS):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # the chats' prompts read: they decode
    beside = await server.ask(seed + 1000)
    for task in chats:
        task.cancel()
    await asyncio.gather(*chats, return_exceptions=True)
    return {"alone": alone, "beside 4 chats": beside, "again": again}


def print_comparison(results: dict[str, list[dict[str, float]]]) -> None:
    print("\nmedian TTFT (ms)        localserve   llama-server   ratio")
    for key in ("alone", "beside 4 chats", "again"):
        ours = statistics.median(r[key] for r in results["localserve"]) * 1000
        theirs = statistics.median(r[key] for r in results["llama-server"]) * 1000
        print(f"{key:<22} {ours:>10.0f} {theirs:>14.0f} {ours / theirs:>7.2f}x")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--servers", default="localserve,llama-server",
                        help="which to run, comma-separated (localserve alone: no llama-server build)")
    args = parser.parse_args()
    names = args.servers.split(",")
    smollm2 = vision_model.SMOLLM2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, projector = vision_model.write_text_model(smollm2, work), vision_model.write_projector(work)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for p in range(args.passes):
            for name in names:
                if name == "localserve":
                    server = LocalEngine(model, projector, args.threads)
                else:
                    server = LlamaServer(model, projector, args.threads, work)
                    await server.start()
                try:
                    await one_pass(server, seed=10 + p)  # a warm-up pass: graphs, first allocations
                    results[name].append(await one_pass(server, seed=100 + p))
                finally:
                    server.close()
                print(f"pass {p + 1} {name}: " + ", ".join(f"{k} {v * 1000:.0f} ms"
                                                           for k, v in results[name][-1].items()), flush=True)
    if len(names) == 2:
        print_comparison(results)
    for name, runs in results.items():
        alone = statistics.median(r["alone"] for r in runs)
        print(f"{name}: beside 4 chats / alone {statistics.median(r['beside 4 chats'] for r in runs) / alone:.2f}x "
              f"(target <= 1.3x), again / alone {statistics.median(r['again'] for r in runs) / alone:.2f}x "
              "(target <= 0.2x)")


if __name__ == "__main__":
    asyncio.run(main())
