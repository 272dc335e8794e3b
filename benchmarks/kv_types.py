"""What KV-cache types save, K and V apart: the planner's KV bytes (runtime/memory.py, what `show`
prints and the load is charged) beside the KV buffer llama.cpp itself reports when it makes the
context, and decode speed with each type.

    python benchmarks/kv_types.py [--model PATH] [--cells 8192] [--threads 2] [--tokens 64]

For each type (f16, q8_0/f16, q8_0, q4_0) one context of `--cells` cells for one sequence, flash
attention on where llama.cpp needs it (a quantized V) and off otherwise, as the planner decides in
the streams layout; a 256-token prompt, then `--tokens` greedy decodes at batch 1. Prints one line
per type and a JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from localserve.backends.base import BatchToken  # noqa: E402
from localserve.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from localserve.backends.llamacpp.runtime import captured_log  # noqa: E402
from localserve.config.kv_cache import kv_element_bytes, needs_flash_attention  # noqa: E402
from localserve.runtime.memory import kv_cache_bytes  # noqa: E402
from localserve.store.gguf_facts import read_gguf_facts  # noqa: E402

MODEL = REPO / ".test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf"
TYPES = ("f16", "q8_0/f16", "q8_0", "q4_0")
MIB = 1024 * 1024


def measure(path: Path, kv_type: str, cells: int, threads: int, tokens: int) -> dict:
    flash = needs_flash_attention(kv_type)
    with captured_log() as lines:
        backend = LlamaCppBackend.load(path, n_ctx=cells, n_seq_max=1, n_batch=256, n_threads=threads,
                                       kv_unified=False, flash_attention=flash, kv_type=kv_type)
    try:
        (line,) = [x for x in lines if x.startswith("llama_kv_cache: size")]
        reported = float(re.search(r"size =\s+([\d.]+) MiB", line).group(1)) * MIB
        prompt = [(7 * i + 11) % 40000 + 100 for i in range(256)]
        backend.decode([BatchToken(t, 0, i, i == len(prompt) - 1) for i, t in enumerate(prompt)])
        token = int(backend.logits(len(prompt) - 1).argmax())
        start = time.perf_counter()
        for k in range(tokens):
            backend.decode([BatchToken(token, 0, len(prompt) + k, True)])
            token = int(backend.logits(0).argmax())
        decode = tokens / (time.perf_counter() - start)
    finally:
        backend.close()
    return {"kv_type": kv_type, "flash_attention": flash, "llamacpp_kv_mib": round(reported / MIB, 2),
            "planner_kv_mib": round(kv_cache_bytes(read_gguf_facts(path), cells, kv_element_bytes(kv_type)) / MIB, 2),
            "decode_tok_s": round(decode, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--cells", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    rows = []
    for kv_type in TYPES:
        row = measure(args.model, kv_type, args.cells, args.threads, args.tokens)
        print(f"{kv_type:9} flash={row['flash_attention']!s:5} llama.cpp KV {row['llamacpp_kv_mib']:8.2f} MiB  "
              f"planner {row['planner_kv_mib']:8.2f} MiB  decode {row['decode_tok_s']:6.1f} tok/s", flush=True)
        rows.append(row)
    print(json.dumps({"model": args.model.name, "cells": args.cells, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
