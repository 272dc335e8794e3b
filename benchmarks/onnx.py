"""Decode throughput of the ONNX Runtime backend vs the llama.cpp backend on the same weights.

    python benchmarks/onnx.py [--model PATH] [--threads N] [--steps N] [--weights int4,fp32]

Both backends load the test model (SmolLM2-135M Q4_1 by default; the ONNX side converts it first
into a temporary folder, once per --weights form: int4 MatMulNBits blocks and/or fp32 dequantized
weights, with the weights file's size and the RSS a load adds), prefill BATCH sequences with a short prompt,
then time STEPS packed decode steps of one token per sequence (decode + argmax per row), for batch
1, 4, 8 and 16. Figures are the best of 3 repeats: on a shared machine the rest is noise.
Prints a table and, as its last line, one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the test model in .test-cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--slots", type=int, default=2048, help="KV cells/slots of both backends")
    ap.add_argument("--weights", default="int4,fp32", help="the ONNX folders' weights, comma-separated")
    args = ap.parse_args()
    from localserve.backends.llamacpp import LlamaCppBackend
    from localserve.backends.onnx import OnnxBackend
    from localserve.convert import convert_gguf

    gguf = args.model or next((HERE.parent / ".test-cache" / "home").rglob("*.gguf"))
    results: dict[str, dict[int, float]] = {}
    sizes: dict[str, str] = {}
    for weights in args.weights.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            convert_gguf(gguf, Path(tmp) / "onnx", weights=weights)
            convert_s = time.perf_counter() - t0
            rss = _rss()
            onnx = OnnxBackend.load(Path(tmp) / "onnx", gguf, n_ctx=args.slots, n_seq_max=16, n_batch=512,
                                    n_threads=args.threads)
            rss = _rss() - rss
            results[f"onnx-{weights}"] = {b: decode_tok_s(onnx, b, args.steps) for b in BATCHES}
            onnx.close()
            size = (Path(tmp) / "onnx" / "model.onnx.data").stat().st_size
            sizes[weights] = f"{weights}: converted in {convert_s:.1f} s, {size / 2**20:.0f} MiB, load +{rss / 2**20:.0f} MiB RSS"
    llama = LlamaCppBackend.load(gguf, n_ctx=args.slots, n_seq_max=16, n_batch=512, n_threads=args.threads,
                                 kv_unified=True, flash_attention=False)
    results["llamacpp"] = {b: decode_tok_s(llama, b, args.steps) for b in BATCHES}
    llama.close()
    print("; ".join(sizes.values()))
    print(f"decode tok/s, {args.threads} threads, {args.slots} KV slots")
    print("backend    " + "".join(f"{'batch ' + str(b):>10}" for b in BATCHES))
    for name, row in results.items():
        print(f"{name:<11}" + "".join(f"{row[b]:>10.1f}" for b in BATCHES))
    first = next(iter(results))
    ratio = results[first][8] / results[first][1]
    print(json.dumps({"folders": sizes, f"{first}_b8_over_b1": round(ratio, 2),
                      **{f"{n}_b{b}": round(v, 1) for n, r in results.items() for b, v in r.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
