"""llama.cpp's Vulkan path on Mesa's lavapipe (a software Vulkan device on the CPU): issue 12's
GPU check on a machine without a GPU. Slow (lavapipe generates ~2 tok/s), so not in the CI run.

    GGML_VK_VISIBLE_DEVICES=0 python benchmarks/vulkan_lavapipe.py \\
        --vulkan-python ~/.cache/localserve-vulkan/venv/bin/python --cpu-python .venv/bin/python

Each python is an environment with localserve's dependencies and a llama-cpp-python build (the
Vulkan one, the CPU one); this checkout's localserve is imported in both. Building the Vulkan
environment: /work/shared/notes/vulkan-on-lavapipe.md (ggml skips CPU-type Vulkan devices unless
GGML_VK_VISIBLE_DEVICES names them). With the Vulkan build it checks:

- the hardware report lists lavapipe (probe gpu:ggml) and buildinfo sees the Vulkan build;
- placement offloads the test model to it, and a load through ModelManager reports the layers and
  llama.cpp's device memory in its status (what show and /api/ps print);
- partial (--partial layers) and full (-ngl 99) loads: layers offloaded, llama.cpp's device buffers
  vs our estimate;
- greedy answers to --prompts short prompts vs the CPU build (how many agree), and tok/s.

Prints a table and, as its last line, one JSON object with the figures.

Measured 2026-11-30 (loaded shared 2-core VM, Mesa 22.3 lavapipe, SmolLM2-135M Q4_1, 1 thread,
8 prompts x 6 greedy tokens). Vulkan wheel build: 1,479 s at nice 19 (Vulkan 1.4.309 headers).
hw: lavapipe listed (gpu:ggml), build "vulkan"; placement gpu:0, all layers; ModelManager load:
31/31 layers, llama.cpp device memory 163.2 MiB vs the plan's 212.1 MiB (compute overestimated).
-ngl 10: 10/31 offloaded, device model 47.71 MiB (the output layer, 28 MiB with tied embeddings,
goes too: our plan's 10 x 2.3 MiB misses it), KV 1.69, compute 12.14 MiB; 7/8 prompts equal, 8/8
first tokens. -ngl 99: 31/31, model 92.10 MiB (estimate 92.10), KV 5.62 (5.63), compute 12.28
(estimate 48.75); 6/8 equal, 8/8 first tokens. tok/s prompt/generation: CPU 22-66 / 12-31
(two runs, machine load), Vulkan -ngl 10 0.6-2.8 / 1.3, -ngl 99 1.2 / 0.65.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The three primary colors are",
    "A haiku about the sea:", "def fibonacci(n):", "The largest planet in our solar system is",
    "Once upon a time, in a small village,", "To make a cup of tea, first",
    "The opposite of hot is", "In 1969, astronauts", "The chemical symbol for gold is",
    "My favourite book is",
]


# --- child: runs inside one environment, prints one JSON object --------------------------------

def greedy(backend, prompt: str, n_tokens: int) -> tuple[list[int], float, float]:
    """Greedy continuation of `prompt`: (tokens, prompt seconds, generation seconds)."""
    import numpy as np

    from localserve.backends.base import BatchToken

    ids = backend.tokenize(prompt)
    backend.kv_remove(0)
    t0 = time.perf_counter()
    backend.decode([BatchToken(t, 0, i, i == len(ids) - 1) for i, t in enumerate(ids)])
    out = [int(np.argmax(backend.logits_row(len(ids) - 1)))]
    t1 = time.perf_counter()
    for k in range(n_tokens - 1):
        backend.decode([BatchToken(out[-1], 0, len(ids) + k, True)])
        out.append(int(np.argmax(backend.logits_row(0))))
    return out, t1 - t0, time.perf_counter() - t1


def _answers(gguf: str, n_gpu_layers: int, prompts: list[str], n_tokens: int, threads: int) -> dict:
    from localserve.backends.llamacpp.backend import LlamaCppBackend

    t0 = time.perf_counter()
    backend = LlamaCppBackend.load(gguf, n_ctx=256, n_seq_max=1, n_batch=64, n_gpu_layers=n_gpu_layers,
                                   n_threads=threads, kv_unified=False, flash_attention=False)
    load_s = time.perf_counter() - t0
    try:
        runs = [greedy(backend, p, n_tokens) for p in prompts]
        facts = backend.offload
        prompt_tokens = sum(len(backend.tokenize(p)) for p in prompts)
        return {
            "n_gpu_layers": n_gpu_layers, "load_s": round(load_s, 2),
            "gpu_layers": facts.gpu_layers, "offloadable_layers": facts.offloadable_layers,
            "device_bytes": facts.device_bytes, "devices": facts.devices,
            "tokens": [r[0] for r in runs],
            "prompt_tok_s": round(prompt_tokens / sum(r[1] for r in runs), 2),
            "gen_tok_s": round(len(prompts) * (n_tokens - 1) / sum(r[2] for r in runs), 2),
        }
    finally:
        backend.close()


def _estimate(gguf: str) -> dict:
    """Our estimate for the load _answers makes (256 cells, one stream, f16, no flash attention)."""
    from localserve.store.gguf_facts import read_gguf_facts
    from localserve.runtime.memory import estimate_memory

    return estimate_memory(read_gguf_facts(gguf), 256, flash_attention=False).as_dict()


def _platform(gguf: str, threads: int) -> dict:
    """Hardware report, buildinfo, placement and a ModelManager load, as the daemon does them."""
    import asyncio
    import tempfile

    from localserve.runtime.buildinfo import installed_build
    from localserve.config.settings import Settings, replace
    from localserve.store.gguf_facts import read_gguf_facts
    from localserve.hardware import detect_hardware
    from localserve.runtime.memory import estimate_memory
    from localserve.runtime.manager import ModelManager
    from localserve.runtime.placement import choose_backend
    from localserve.store.cache import ModelStore

    report = detect_hardware()
    choice = choose_backend(report, ["gguf"], estimate=estimate_memory(read_gguf_facts(gguf), 2048))
    out = {"gpus": [{"name": g.name, "apis": g.apis, "source": g.source, "vram_bytes": g.vram_bytes}
                    for g in report.gpus],
           "llama_gpu_apis": report.llama_gpu_apis, "installed_build": installed_build(report),
           "placement": choice.as_dict()}

    async def load_and_ask() -> dict:
        with tempfile.TemporaryDirectory() as home:
            settings = replace(Settings(), home=Path(home), context_length=512, max_sequences=1,
                               threads=threads)
            ModelStore(settings).register_local(gguf, "smol", "vk")
            manager = ModelManager(settings)
            try:
                async with manager.use("smol:vk"):
                    (row,) = manager.status()
                return {k: row[k] for k in ("device", "gpu_layers", "offloadable_layers", "gpu_memory_bytes",
                                            "vram_bytes", "memory_bytes")}
            finally:
                await manager.close()

    out["manager"] = asyncio.run(load_and_ask())
    return out


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    prompts = PROMPTS[: args.prompts]
    result: dict = {"estimate": _estimate(args.model)}
    if args.platform:
        result["platform"] = _platform(args.model, args.threads)
    result["runs"] = [_answers(args.model, ngl, prompts, args.tokens, args.threads) for ngl in args.layers]
    print("RESULT " + json.dumps(result))


# --- parent: runs the children and compares -----------------------------------------------------

def run_child(python: str, args: argparse.Namespace, layers: list[int], platform: bool) -> dict:
    cmd = [python, __file__, "--child", "--model", args.model, "--prompts", str(args.prompts),
           "--tokens", str(args.tokens), "--threads", str(args.threads), "--layers", *map(str, layers)] + (["--platform"] if platform else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{python} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def _default_model() -> str:
    found = sorted((ROOT / ".test-cache/home/models").rglob("*.gguf"))
    return str(found[0]) if found else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=_default_model())
    ap.add_argument("--vulkan-python", default=str(Path.home() / ".cache/localserve-vulkan/venv/bin/python"))
    ap.add_argument("--cpu-python", default=str(ROOT / ".venv/bin/python"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8)
    # One: on a shared, loaded 2-core machine two OpenMP threads spin at each barrier while the
    # other is descheduled (measured: 5 s per single-token decode with 2, 0.03 s with 1).
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp CPU threads, both builds")
    ap.add_argument("--partial", type=int, default=10, help="layers of the partial offload")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--platform", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if os.environ.get("GGML_VK_VISIBLE_DEVICES") is None:
        sys.exit("set GGML_VK_VISIBLE_DEVICES=0: ggml's Vulkan backend skips a CPU-type device like lavapipe")

    cpu = run_child(args.cpu_python, args, [0], platform=False)
    vk = run_child(args.vulkan_python, args, [args.partial, 99], platform=True)
    ref = cpu["runs"][0]
    est = vk["estimate"]
    summary = {"platform": vk["platform"], "estimate": est, "cpu": {k: ref[k] for k in ("prompt_tok_s", "gen_tok_s")},
               "vulkan": []}
    print(f"hardware: {vk['platform']['gpus']}; build {vk['platform']['installed_build']}; "
          f"placement {vk['platform']['placement']['device']} n_gpu_layers={vk['platform']['placement']['n_gpu_layers']}")
    print(f"ModelManager.status with the Vulkan build: {vk['platform']['manager']}")
    print(f"CPU build: prompt {ref['prompt_tok_s']} tok/s, generation {ref['gen_tok_s']} tok/s")
    print(f"estimate (256 cells): weights {est['weights_bytes']}, KV {est['kv_bytes']}, compute {est['compute_bytes']}, "
          f"per layer {est['layer_bytes']}")
    for run in vk["runs"]:
        same = sum(a == b for a, b in zip(run["tokens"], ref["tokens"]))
        first = sum(a[0] == b[0] for a, b in zip(run["tokens"], ref["tokens"]))
        row = {k: run[k] for k in ("n_gpu_layers", "gpu_layers", "offloadable_layers", "device_bytes", "devices",
                                   "prompt_tok_s", "gen_tok_s", "load_s")}
        row.update(agree=same, first_token_agree=first, prompts=len(ref["tokens"]))
        summary["vulkan"].append(row)
        print(f"-ngl {run['n_gpu_layers']}: offloaded {run['gpu_layers']}/{run['offloadable_layers']} to "
              f"{run['devices']}, device buffers {run['device_bytes']}; prompt {run['prompt_tok_s']} tok/s, "
              f"generation {run['gen_tok_s']} tok/s; greedy {args.tokens} tokens equal to the CPU build's on "
              f"{same}/{len(ref['tokens'])} prompts (first token {first})")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
