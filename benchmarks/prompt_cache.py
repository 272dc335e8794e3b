"""Prompt cache on disk, engine level (issue 42 part 3): TTFT of a conversation's next turn computed
cold against the same turn after the engine that answered it is gone (an unload or restart: the
parked entry written at shutdown, a new engine on the same weights reads it back).

Not yet the issue's full benchmark (a daemon restarted, a keep_alive unload and a SIGKILLed worker
on Gemma 3 270M with a 20k-token prompt): this measures the same path inside one process.
    .venv/bin/python benchmarks/prompt_cache.py [--model PATH] [--tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import tempfile
import time
from pathlib import Path

from localserve.backends.llamacpp.backend import LlamaCppBackend
from localserve.backends.llamacpp.seq_state import SeqState, state_key
from localserve.batching.limits import EngineLimits
from localserve.engine.local import Engine
from localserve.engine.prompt_disk import PromptDisk
from localserve.protocol.requests import GenerationRequest, SamplingParams
from localserve.store.prompt_cache import PromptDiskCache

SMOLLM2 = Path(".test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf")


def engine(backend, n_ctx_seq: int, home: Path | None) -> Engine:
    backend.kv_clear()
    disk = None
    if home is not None:
        key = state_key(kv_unified=False, kv_type="f16", flash_attention=False, exact_attention=False)
        disk = PromptDisk(PromptDiskCache(home, "bench" + hashlib.sha256(b"x").hexdigest()[:8], key, 8 << 30).open(),
                          SeqState(backend))
    e = Engine(backend, EngineLimits(max_sequences=2, batch_tokens=512, n_ctx=backend.n_ctx, n_ctx_seq=n_ctx_seq),
               prompt_disk=disk)
    e.start()
    return e


async def ttft(e: Engine, prompt: list[int]) -> tuple[float, list[int], int]:
    t0 = time.monotonic()
    first, tokens, last = None, [], None
    async for ev in e.submit(GenerationRequest(prompt, SamplingParams(temperature=0), max_tokens=8, ignore_eos=True)):
        if ev.token_ids and first is None:
            first = time.monotonic() - t0
        tokens += ev.token_ids
        last = ev
    return first, tokens, last.usage.cached_tokens


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=SMOLLM2)
    ap.add_argument("--tokens", type=int, default=3000)
    args = ap.parse_args()
    n_ctx_seq = 1 << (args.tokens + 600).bit_length()
    backend = LlamaCppBackend.load(args.model, n_ctx=4 * n_ctx_seq, n_seq_max=4, n_batch=512, kv_unified=False,
                                   flash_attention=False)
    first = backend.tokenize("<|im_start|>system\n" + "You help with code; the tools are listed here. " * 4000)[: args.tokens]
    turn = backend.tokenize(" And now the next question, please.\n", add_special=False)
    with tempfile.TemporaryDirectory() as home:
        e = engine(backend, n_ctx_seq, Path(home))
        cold_first, reply, _ = await ttft(e, first)
        e.shutdown()  # the unload writes the parked conversation
        follow = first + reply + turn
        e = engine(backend, n_ctx_seq, None)
        cold, cold_tokens, _ = await ttft(e, follow)
        e.shutdown()
        e = engine(backend, n_ctx_seq, Path(home))
        warm, warm_tokens, cached = await ttft(e, follow)
        e.shutdown()
    print(f"{args.model.name}: first turn {len(first)} tokens, TTFT {cold_first:.2f} s")
    print(f"next turn ({len(follow)} tokens): cold TTFT {cold:.2f} s; from disk {warm:.2f} s "
          f"({100 * warm / cold:.1f}% of cold), cached_tokens {cached}, same greedy answer: {warm_tokens == cold_tokens}")


if __name__ == "__main__":
    asyncio.run(main())
