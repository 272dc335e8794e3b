"""What the AMX fallback costs: llama.cpp with its extra CPU buffer types (the default) vs without
(`use_extra_bufts = false`, what backends/llamacpp_probe.py falls back to where the AMX path dies).

    python benchmarks/extra_buffers.py [--model PATH] [--quant q4_0] [--threads 2] [--passes 4]

The extra buffer types are AMX and the CPU repack layouts: Q4_0, IQ4_NL and Q4_K weights are
interleaved at load for the AVX2/AVX-512 gemm kernels. A model of another type (the default
SmolLM2 is Q4_1) loads the same either way; `--quant q4_0` re-quantizes it into a temporary Q4_0
GGUF first (llama_model_quantize), the type the repack helps most. Also prints the probe's cost on
a first load (a child process loading the model and decoding 48 tokens).

Passes alternate (on, off, off, on, ...) so a drift of this shared machine's speed cancels. Prints
one line per pass, then a JSON object: prefill tok/s (a 128-token prompt) and decode tok/s at
batch 1 and 8, best of the passes for each setting, and the off/on ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import llama_cpp  # noqa: E402

from localserve.backends.base import BatchToken  # noqa: E402
from localserve.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from localserve.backends.llamacpp.baseline import greedy_bare_loop  # noqa: E402
from localserve.backends.llamacpp.probe import probe  # noqa: E402

DEFAULT_MODEL = REPO / ".test-cache/home/models/smollm2-135m/Q4_1/SmolLM2-135M-Instruct.Q4_1.gguf"
QUANTS = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q4_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
          "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}


def quantize(src: Path, quant: str, out_dir: Path) -> Path:
    dst = out_dir / f"{src.stem}.{quant}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTS[quant]
    params.allow_requantize = True  # speed is what is measured here, not quality
    if llama_cpp.llama_model_quantize(bytes(src), bytes(dst), ctypes.byref(params)) != 0:
        raise SystemExit(f"quantizing to {quant} failed")
    return dst


def measure(model: Path, extra_buffers: bool, threads: int) -> dict[str, float]:
    with LlamaCppBackend.load(model, n_ctx=8 * 512, n_seq_max=8, n_batch=512, n_threads=threads,
                              kv_unified=False, flash_attention=False, extra_buffers=extra_buffers) as b:
        text = " ".join(f"word{k}" for k in range(200))
        tokens = b.tokenize(text)[:128]
        t0 = time.perf_counter()
        for _ in range(4):
            b.kv_remove(0)
            b.decode([BatchToken(t, 0, i, i == len(tokens) - 1) for i, t in enumerate(tokens)])
        prefill = 4 * len(tokens) / (time.perf_counter() - t0)
        b.kv_clear()
        rates = {}
        for batch in (1, 8):
            prompts = [b.tokenize(f"Request {i}: count to ten.") for i in range(batch)]
            rates[f"decode_b{batch}"] = greedy_bare_loop(b, prompts, 64).decode_tokens_per_s
    return {"prefill": prefill, **rates}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--quant", choices=sorted(QUANTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = quantize(args.model, args.quant, Path(tmp)) if args.quant else args.model
        verdict = probe(model, "benchmark")
        print(f"probe (first load on a CPU that claims AMX): {verdict.seconds if verdict else float('nan'):.2f} s")
        best: dict[bool, dict[str, float]] = {True: {}, False: {}}
        for i in range(args.passes):
            on = i % 4 in (0, 3)
            figures = measure(model, on, args.threads)
            print(f"pass {i + 1} extra buffers {'on ' if on else 'off'}: "
                  + ", ".join(f"{k} {v:.1f} tok/s" for k, v in figures.items()), flush=True)
            for key, value in figures.items():
                best[on][key] = max(best[on].get(key, 0.0), value)
    out = {"model": model.name, "probe_s": verdict.seconds if verdict else None,
           "on": {k: round(v, 1) for k, v in best[True].items()},
           "off": {k: round(v, 1) for k, v in best[False].items()},
           "off_over_on": {k: round(best[False][k] / best[True][k], 3) for k in best[True]}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
