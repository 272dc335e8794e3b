"""LoRA adapters beside each other: what running requests with different adapter sets costs, localserve
beside llama-server, both loaded with the same two adapters.

    python benchmarks/lora.py --model-path .test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf

No adapter GGUF can be fetched on these machines: both servers load tests/lora_model.py's two seeded
adapters for SmolLM2's attention matrices (localserve through the setting model_loras, llama-server
through --lora). llama.cpp applies adapters to a whole context, so neither server can put two sets
in one decode: localserve runs one set per step (batching/adapter_turns.py), llama-server batches
only the slots whose adapters equal the first one's. Per pass and server, `--requests` completions
of `--tokens` tokens each (ignore_eos), sent together, in three mixes: all with adapter 0 ("same"),
half with adapter 0 and half with adapter 1 ("mixed"), and none ("base", `lora: []`). Printed: the
tokens per second of all of them together and the slowest request's seconds, median over passes;
the servers run one at a time, alternating, on the same cores.

Figures, not assertions: tests never time anything (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import REPO, start_llama_server, start_localserve, stop, wait_ready  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from lora_model import ADAPTER_NAMES, write_adapter  # noqa: E402  (the adapters the tests use)

MIXES = {"same": lambda i: [{"id": 0, "scale": 1.0}],
         "mixed": lambda i: [{"id": i % 2, "scale": 1.0}],
         "base": lambda i: []}


async def one_mix(url: str, model: str, mix: str, args: argparse.Namespace) -> tuple[float, float]:
    """(tokens per second of all requests together, the slowest request's seconds)."""
    async def ask(session: aiohttp.ClientSession, i: int) -> int:
        body = {"model": model, "prompt": f"Story {i}: once upon a time in a town called {i * 7},",
                "n_predict": args.tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                "lora": MIXES[mix](i)}
        async with session.post(url + "/completion", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{url} answered {resp.status}: {str(data)[:200]}")
            return int(data.get("tokens_predicted") or args.tokens)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(ask(session, i) for i in range(args.requests)))
        seconds = time.perf_counter() - start
    return sum(tokens) / seconds, seconds


async def bench(name: str, args: argparse.Namespace, adapters: list[Path], work: Path) -> dict[str, tuple[float, float]]:
    if name == "localserve":
        env = {"LOCALSERVE_MODEL_LORAS": ",".join(f"bench={a}" for a in adapters),
               "LOCALSERVE_KV_LAYOUT": "streams"}
        proc, url, model = start_localserve(args.model_path, args.threads, args.requests, work, extra_env=env)
    else:
        lora_args = [x for a in adapters for x in ("--lora", str(a))]
        proc, url, model = start_llama_server(args.model_path, args.threads, args.requests, work,
                                              extra_args=[*lora_args, "-fa", "off"], slot_ctx=512)
    try:
        await wait_ready(url, "/health", proc)
        await one_mix(url, model, "base", args)  # warm-up: the load, the first graphs
        return {mix: await one_mix(url, model, mix, args) for mix in MIXES}
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapters = [write_adapter(args.model_path, root / name, seed) for seed, name in enumerate(ADAPTER_NAMES, 1)]
        runs: dict[str, list[dict[str, tuple[float, float]]]] = {"localserve": [], "llama-server": []}
        for n in range(args.passes):
            for name in runs:
                work = root / f"{name}-{n}"
                work.mkdir()
                runs[name].append(asyncio.run(bench(name, args, adapters, work)))
    print(f"{args.requests} requests x {args.tokens} tokens together, {args.threads} threads, "
          f"median of {args.passes} passes: tok/s (slowest request s)")
    print(f"{'mix':8}" + "".join(f"{name:>24}" for name in runs))
    for mix in MIXES:
        cells = []
        for name, passes in runs.items():
            rate = statistics.median(p[mix][0] for p in passes)
            slowest = statistics.median(p[mix][1] for p in passes)
            cells.append(f"{rate:14.1f} ({slowest:5.1f} s)")
        print(f"{mix:8}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
